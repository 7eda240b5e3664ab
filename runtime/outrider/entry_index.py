"""Installed entry points, read once per install instead of once per start.

`importlib.metadata.entry_points()` opens every installed distribution's metadata on each call
(~7 ms with 100 distributions here, and pydantic makes a second scan for its own plugins), and
importing importlib.metadata at all costs ~14 ms more (its email parser, zipfile, csv); a
serverless start pays that every time. So the entry points of the groups a start asks
for are kept in the artifact cache (`entry-points.json`), stamped with the interpreter, the
import path, and each path directory's modification time and the names of the metadata
directories in it: installing, upgrading or removing a distribution creates or removes its
`*.dist-info` directory, which changes both, and the next start scans again. (A file edited in
place inside a dist-info directory is not seen: that is not how installers change an environment.)
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

from .artifacts import cache_root, metadata_directories

INDEX_FILE = "entry-points.json"
#: bumped when what the index file holds changes
INDEX_LAYOUT = 2
#: stamps kept in the file: the same install started as `python -m` from different directories
#: (its first path entry) or by another interpreter keeps one entry each instead of rescanning
INDEX_ENTRIES = 8

_memo: dict[str, list[tuple[str, str]]] = {}
_memo_stamp: Optional[list] = None


def _stamp() -> list:
    """What the index is valid for: this interpreter, its import path, and each path directory's
    mtime and the names of its metadata directories (a dist-info name carries the version; the
    mtime sees a reinstall of the same version, beyond the clock's tick)."""
    dirs = []
    for entry in sys.path:
        names = metadata_directories(entry)
        try:
            mtime = os.stat(entry or ".").st_mtime_ns
        except OSError:
            names = None
        if names is None:
            dirs.append([entry, None])
            continue
        digest = hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()[:16]
        dirs.append([entry, mtime, digest])
    return [INDEX_LAYOUT, sys.executable, sys.version, dirs]


def _scan(groups: Iterable[str]) -> dict[str, list[tuple[str, str]]]:
    import importlib.metadata

    every = importlib.metadata.entry_points()  # one pass over the distributions for all groups
    return {group: [(ep.name, ep.value) for ep in every.select(group=group)] for group in groups}


def entry_points(group: str, also: Iterable[str] = ()) -> list[tuple[str, str]]:
    """(name, value) of the installed entry points of `group`, in the order importlib.metadata
    gives them, from the index when it still matches the install (else scanned and written back;
    a read-only cache is scanned each time). `also` names groups to index with it, so that one
    scan answers the start's other questions (`has_entry_points`)."""
    global _memo_stamp
    stamp = _stamp()
    if _memo_stamp == stamp and group in _memo:
        return list(_memo[group])
    path = cache_root() / INDEX_FILE
    wanted = {group, *also}
    key = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:16]
    entries: dict[str, Any] = {}
    try:
        index = json.loads(path.read_text())
        if isinstance(index, dict) and index.get("layout") == INDEX_LAYOUT and isinstance(index.get("entries"), dict):
            entries = index["entries"]
    except (OSError, ValueError):
        pass
    entry = entries.get(key)
    groups = entry.get("groups") if isinstance(entry, dict) and entry.get("stamp") == stamp else None
    if not isinstance(groups, dict) or not wanted <= groups.keys():
        groups = _scan(wanted | set(groups or ()))
        entries.pop(key, None)
        entries[key] = {"stamp": stamp, "groups": groups}  # newest last; the oldest go
        _write(path, {"layout": INDEX_LAYOUT, "entries": dict(list(entries.items())[-INDEX_ENTRIES:])})
    _memo.clear()
    _memo.update({g: [tuple(pair) for pair in pairs] for g, pairs in groups.items()})
    _memo_stamp = stamp
    return list(_memo[group])


def has_entry_points(group: str) -> bool:
    """Whether any installed distribution declares an entry point in `group` (indexed as `entry_points`)."""
    return bool(entry_points(group))


#: an entry point's value, `module[:attr[.attr...]] [extras]`, as importlib.metadata parses it
_VALUE = re.compile(r"(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?((?P<extras>\[.*\])\s*)?$")


def load(group: str, name: str, value: str) -> Any:
    """What the entry point `name = value` names, loaded as importlib.metadata's EntryPoint.load
    would, without importing importlib.metadata (~14 ms of a start)."""
    match = _VALUE.match(value)
    if match is None:
        raise ValueError(f"entry point {name!r} of group {group!r}: {value!r} is not 'module:attribute'")
    loaded = importlib.import_module(match.group("module"))
    for attr in filter(None, (match.group("attr") or "").split(".")):
        loaded = getattr(loaded, attr)
    return loaded


def _write(path: Path, index: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(index))
        os.replace(tmp, path)
    except OSError:  # a read-only cache: scan at every start, as without the index
        pass



#: pydantic reads this before its first schema build: '__all__' loads no pydantic plugins
PYDANTIC_PLUGINS_ENV = "PYDANTIC_DISABLE_PLUGINS"


def skip_pydantic_plugin_scan() -> None:
    """pydantic scans every installed distribution for its plugins (group 'pydantic') when it
    builds its first schema. Where the index says that no distribution has one, say so to pydantic
    (PYDANTIC_DISABLE_PLUGINS=__all__), which then loads what it would have found: nothing. A value
    the user set is kept. Called before the core's schemas are built (`outrider serve`)."""
    if PYDANTIC_PLUGINS_ENV not in os.environ and not entry_points("pydantic", also=("outrider",)):
        os.environ[PYDANTIC_PLUGINS_ENV] = "__all__"
        _skip_pydantic_plugin_loader()


def _skip_pydantic_plugin_loader() -> None:
    """pydantic's plugin loader module imports importlib.metadata at its top (~14 ms of a start,
    for the email parser and zipfile it brings) only to return no plugins here, where
    PYDANTIC_DISABLE_PLUGINS is '__all__'. So, before pydantic first imports it, the module is
    one that gives that same answer without the import. Only for the pydantic versions whose
    loader this was read from (2.x: `get_plugins()` is all that pydantic asks of it)."""
    name = "pydantic.plugin._loader"
    if name in sys.modules:
        return
    try:
        from pydantic.version import VERSION
    except ImportError:
        return
    if not VERSION.startswith("2."):
        return
    import types

    loader = types.ModuleType(name, "pydantic's plugin loader where no pydantic plugin is installed "
                                    "(outrider.entry_index): it loads none, as pydantic's would")
    loader.PYDANTIC_ENTRY_POINT_GROUP = "pydantic"  # type: ignore[attr-defined]
    loader.get_plugins = lambda: ()  # type: ignore[attr-defined]
    sys.modules[name] = loader
