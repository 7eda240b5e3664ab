"""The entry-point index (outrider.entry_index): what importlib.metadata would say, read from the
artifact cache while the install is unchanged, scanned again when a distribution comes or goes."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from outrider import entry_index
from outrider.artifacts import package_version


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A cache of its own and no memo from earlier tests, as in a new process."""
    monkeypatch.setenv("OUTRIDER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(entry_index, "_memo", {})
    monkeypatch.setattr(entry_index, "_memo_stamp", None)
    return tmp_path


def _distribution(site: Path, name: str, entry_points: str) -> Path:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n\n")
    (info / "entry_points.txt").write_text(entry_points)
    return info


def test_the_index_says_what_importlib_metadata_says_and_is_written_once(fresh) -> None:
    expected = [(ep.name, ep.value) for ep in importlib.metadata.entry_points(group="outrider")]
    assert expected, "the project's own plugins declare outrider entry points"
    assert entry_index.entry_points("outrider", also=("pydantic",)) == expected
    assert entry_index.entry_points("pydantic") == [
        (ep.name, ep.value) for ep in importlib.metadata.entry_points(group="pydantic")]
    assert (fresh / "cache" / entry_index.INDEX_FILE).is_file()


def test_an_unchanged_install_is_answered_from_the_file_without_a_scan(fresh, monkeypatch) -> None:
    first = entry_index.entry_points("outrider")
    monkeypatch.setattr(entry_index, "_memo", {})  # a new process: only the file is left
    monkeypatch.setattr(entry_index, "_memo_stamp", None)

    def no_scan(groups):
        raise AssertionError("scanned although the install did not change")

    monkeypatch.setattr(entry_index, "_scan", no_scan)
    assert entry_index.entry_points("outrider") == first


def test_a_distribution_that_comes_or_goes_is_seen_at_the_next_call(fresh, monkeypatch) -> None:
    import shutil

    site = fresh / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    before = entry_index.entry_points("outrider")
    assert ("demo", "demo_plugin") not in before
    info = _distribution(site, "demo_plugin", "[outrider]\ndemo = demo_plugin\n")
    assert ("demo", "demo_plugin") in entry_index.entry_points("outrider")
    shutil.rmtree(info)
    assert entry_index.entry_points("outrider") == before


def test_a_read_only_cache_scans_each_time_and_still_answers(fresh, monkeypatch) -> None:
    blocked = fresh / "not-a-directory"
    blocked.write_text("")  # a file where the cache directory would be: nothing can be written
    monkeypatch.setenv("OUTRIDER_CACHE_DIR", str(blocked))
    expected = [(ep.name, ep.value) for ep in importlib.metadata.entry_points(group="outrider")]
    assert entry_index.entry_points("outrider") == expected


def test_a_garbled_index_file_is_scanned_again(fresh) -> None:
    path = fresh / "cache" / entry_index.INDEX_FILE
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    expected = [(ep.name, ep.value) for ep in importlib.metadata.entry_points(group="outrider")]
    assert entry_index.entry_points("outrider") == expected


def test_pydantic_plugins_are_skipped_only_where_none_is_installed(fresh, monkeypatch) -> None:
    monkeypatch.delenv(entry_index.PYDANTIC_PLUGINS_ENV, raising=False)
    if importlib.metadata.entry_points(group="pydantic"):
        pytest.skip("a pydantic plugin is installed here; the case with one is tested below")
    entry_index.skip_pydantic_plugin_scan()
    assert os.environ[entry_index.PYDANTIC_PLUGINS_ENV] == "__all__"

    monkeypatch.setenv(entry_index.PYDANTIC_PLUGINS_ENV, "some_plugin")  # the user's own choice stays
    entry_index.skip_pydantic_plugin_scan()
    assert os.environ[entry_index.PYDANTIC_PLUGINS_ENV] == "some_plugin"

    monkeypatch.delenv(entry_index.PYDANTIC_PLUGINS_ENV)
    site = fresh / "site"
    monkeypatch.syspath_prepend(str(site))
    _distribution(site, "a_pydantic_plugin", "[pydantic]\nmine = a_pydantic_plugin:plugin\n")
    entry_index.skip_pydantic_plugin_scan()
    assert entry_index.PYDANTIC_PLUGINS_ENV not in os.environ


def test_a_server_start_loads_the_plugins_the_index_names(fresh) -> None:
    """`outrider plugins` in a fresh process, through the entry points (OUTRIDER_PLUGINS unset):
    the index built there lists the same plugins a scan finds, and loads them."""
    env = {k: v for k, v in os.environ.items() if k != "OUTRIDER_PLUGINS"}
    env["OUTRIDER_CACHE_DIR"] = str(fresh / "cache")
    out = subprocess.run([sys.executable, "-m", "outrider.cli", "plugins"], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    for name, _ in entry_index.entry_points("outrider"):
        assert name in out
    assert (fresh / "cache" / entry_index.INDEX_FILE).is_file()


@pytest.mark.parametrize("package", ["numpy", "pyzmq", "pydantic", "onnxruntime", "outrider"])
def test_package_version_reads_what_importlib_metadata_reads(package) -> None:
    assert package_version(package) == importlib.metadata.version(package)


def test_package_version_of_a_missing_distribution_is_absent() -> None:
    assert package_version("no-such-distribution-here") == "absent"


def test_two_import_paths_keep_an_index_each(fresh, monkeypatch) -> None:
    """The same install started with another first path entry (`python -m` from another
    directory) keeps its own stamp beside the first: alternating between them scans no more."""
    other = fresh / "elsewhere"
    other.mkdir()
    first = entry_index.entry_points("outrider")
    with monkeypatch.context() as patch:
        patch.syspath_prepend(str(other))
        entry_index.entry_points("outrider")

    def no_scan(groups):
        raise AssertionError("scanned although both import paths were indexed")

    monkeypatch.setattr(entry_index, "_scan", no_scan)
    for prepend in (False, True, False):
        monkeypatch.setattr(entry_index, "_memo", {})  # a new process: only the file is left
        monkeypatch.setattr(entry_index, "_memo_stamp", None)
        with monkeypatch.context() as patch:
            if prepend:
                patch.syspath_prepend(str(other))
            assert entry_index.entry_points("outrider") == first


def test_the_index_keeps_a_bounded_number_of_stamps(fresh, monkeypatch) -> None:
    import json

    for n in range(entry_index.INDEX_ENTRIES + 3):
        directory = fresh / f"path{n}"
        directory.mkdir()
        with monkeypatch.context() as patch:
            patch.syspath_prepend(str(directory))
            entry_index.entry_points("outrider")
    index = json.loads((fresh / "cache" / entry_index.INDEX_FILE).read_text())
    assert len(index["entries"]) == entry_index.INDEX_ENTRIES
    kept = [entry["stamp"][3][0][0] for entry in index["entries"].values()]
    assert kept[-1] == str(fresh / f"path{entry_index.INDEX_ENTRIES + 2}")  # the newest stay


@pytest.mark.parametrize("value", ["json", "json:dumps", "os.path:join", "logging:Logger.info",
                                   "json : loads [extra]"])
def test_an_entry_point_loads_what_importlib_metadata_loads(value) -> None:
    expected = importlib.metadata.EntryPoint(name="x", value=value, group="outrider").load()
    assert entry_index.load("outrider", "x", value) is expected


def test_an_entry_point_that_names_no_module_is_refused_with_its_value() -> None:
    with pytest.raises(ValueError, match="not-a-module"):
        entry_index.load("outrider", "broken", "not-a-module!")


def test_a_start_from_the_index_does_not_import_importlib_metadata(fresh) -> None:
    """What `outrider serve` does before its models load (the index, the plugins from their entry
    points, a manifest validated by pydantic, cache keys with package versions), in a new process,
    twice: the second start, answered by the index, never imports importlib.metadata (~14 ms)."""
    code = "\n".join([
        "import sys",
        "from outrider import entry_index",
        "entry_index.skip_pydantic_plugin_scan()",
        "from outrider.manifest import load_manifest",
        "from outrider.plugins import create_registry",
        "from outrider.artifacts import package_version",
        "registry = create_registry()",
        f"load_manifest({str(Path(__file__).parent.parent / 'manifests' / 'echo.yaml')!r}, [], registry.check_section)",
        "assert package_version('numpy') != 'absent'",
        "print('importlib.metadata' in sys.modules)",
    ])
    env = {k: v for k, v in os.environ.items() if k not in ("OUTRIDER_PLUGINS", entry_index.PYDANTIC_PLUGINS_ENV)}
    env["OUTRIDER_CACHE_DIR"] = str(fresh / "cache")
    seen = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                           check=True).stdout.strip() for _ in range(2)]
    if importlib.metadata.entry_points(group="pydantic"):
        pytest.skip("a pydantic plugin is installed here: pydantic's own loader scans for it")
    assert seen == ["True", "False"]  # the first start scans and writes the index
