"""The model repository: the models a server may serve, which of them are loaded, and loading,
unloading and reloading them while it serves (Triton's model control and polled repository,
Ollama's load on first request and keep-alive, ModelMesh's memory budget).

- Entries come from the manifests named at `outrider serve` and from every `*.yaml`/`*.yml` in
  `--models DIR`. A loaded entry has a ServedModel in `server.models`; the rest are available.
- `load` builds and starts a ServedModel (warmed up before it is ready, as at start) after making
  room under the memory budget; `unload` takes the model out of `server.models` and drains it:
  what it had taken is answered (streams finish, or are cancelled with a reason when asked),
  then its instances stop and its memory is handed back.
- A reload (a changed file under `--watch`) loads the new version beside the old one; the name
  switches to it once it is ready and the old one drains. A new version that fails validation
  or its load leaves the old one serving, with the reason in the index.
- `tick` runs on the server's supervisor thread: reload switches, idle unloads, the watch scan.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from ..errors import (
    InsufficientMemoryError,
    ManifestError,
    ModelNotFoundError,
    ModelNotReadyError,
    OutriderError,
    UnavailableError,
)
from ..manifest import Manifest
from ..plugins import PluginRegistry
from ..hardware import resident_bytes
from .assembly import build_model
from .entries import READY, ModelEntry, artifact_changed, entry_fingerprint, manifest_files, raw_part, read_entry
from .memory_budget import MemoryBudget, mib as _mib
from .pending_load import PendingLoad
from .request import ModelState
from .served_model import ServedModel
from .unloading import Unloader

log = logging.getLogger("outrider.repository")

#: seconds between two scans of a watched directory
WATCH_INTERVAL_S = float(os.environ.get("OUTRIDER_WATCH_INTERVAL_S", "1.0"))


class ModelRepository:
    """Which models the server may serve, and the control of what is loaded (see the module doc)."""

    def __init__(
        self,
        server: Any,
        registry: PluginRegistry,
        manifests: Iterable[Manifest],
        directory: Optional[Path] = None,
        overrides: Optional[list[str]] = None,
        watch: bool = False,
        memory_budget: Optional[int] = None,
    ) -> None:
        self.server = server
        self.registry = registry
        self.directory = Path(directory) if directory is not None else None
        self.overrides = list(overrides or [])
        self.watch = watch
        self.budget = MemoryBudget(memory_budget)
        self.entries: dict[str, ModelEntry] = {}
        self._lock = threading.RLock()  # the entries dict and the budget decision
        self._next_scan = 0.0
        self.unloader = Unloader(server)
        for manifest in manifests:
            path = Path(manifest.source_file) if manifest.source_file else None
            self._add(ModelEntry(manifest.name, path, manifest, entry_fingerprint(path, manifest)))
        if self.directory is not None:
            if not self.directory.is_dir():
                raise ManifestError(f"--models {self.directory}: not a directory")
            for path in manifest_files(self.directory):
                entry = self._read(path)
                if entry.name in self.entries:
                    raise ManifestError(f"{path}: model {entry.name!r} is already defined by "
                                        f"{self.entries[entry.name].path}")
                self._add(entry)

    # -- reading the directory --------------------------------------------------------------

    def _read(self, path: Path) -> ModelEntry:
        return read_entry(path, self.overrides, self.registry.check_section)

    def _add(self, entry: ModelEntry) -> None:
        self.entries[entry.name] = entry
        if entry.manifest is None:
            log.error("model %s: %s", entry.name, entry.reason)

    # -- what clients see ---------------------------------------------------------------------

    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Every model with its version, state and why (Triton's repository index, with more)."""
        out = []
        for name, entry in sorted(self.entries.items()):
            state = entry.state
            if ready_only and state != READY:
                continue
            item: dict[str, Any] = {"name": name, "version": str(entry.version) if entry.version else "",
                                    "state": state}
            reason = entry.reason or (entry.served.reason if entry.served is not None else "")
            if reason:
                item["reason"] = reason
            if entry.pending is not None:
                item["loading_version"] = str(entry.pending.version)
            manifest = entry.manifest
            if manifest is not None:
                item["load_on_demand"] = manifest.load_on_demand
                item["idle_unload_s"] = manifest.idle_unload_s
            if entry.served is not None:
                item["idle_s"] = round(time.monotonic() - entry.served.last_used, 3)
            estimate = self.budget.estimate(entry)
            if estimate:
                item["resident_bytes_estimate"] = estimate[0]
            out.append(item)
        return out

    def on_demand(self, name: str) -> Optional["PendingLoad"]:
        """For a request to `name`, not loaded: start loading it if its manifest asks for load on
        demand and return the load, which holds requests until the model takes them; None when
        the model is unknown or not loaded on demand. Never blocks (called on I/O threads)."""
        entry = self.entries.get(name)
        if entry is None or entry.manifest is None or not entry.manifest.load_on_demand:
            return None
        if entry.unloading:
            raise UnavailableError(f"model {name!r} is being unloaded; retry shortly")
        return self._start_load(entry, on_demand=True)

    # -- load -----------------------------------------------------------------------------

    def build(self, entry: ModelEntry, manifest: Manifest) -> ServedModel:
        """A ServedModel for `manifest` (validated against the plugins; not started)."""
        previous = entry.served
        served = build_model(manifest, self.registry, stats=previous.stats if previous is not None else None)
        served.version = entry.version + 1
        return served

    def adopt(self, name: str, served: ServedModel) -> None:
        """Record a model the server built and starts itself (the ones loaded at start)."""
        entry = self.entries[name]
        entry.served, entry.version, entry.reason = served, served.version, ""
        entry.rss_before_load, entry.measured = resident_bytes(), False
        entry.warm_load = self.budget.backend_is_warm(entry)

    def load(self, name: str, wait_s: Optional[float] = None) -> Optional[ServedModel]:
        """Load `name` (nothing to do when it is loaded or loading) and, with `wait_s`, wait until
        it is ready and return it. Raises ModelNotFoundError, ManifestError (its file does not
        validate), InsufficientMemoryError (does not fit the budget), ModelNotReadyError (it failed,
        or is not ready after `wait_s`), UnavailableError (being unloaded)."""
        entry = self.entries.get(name)
        if entry is None:
            raise ModelNotFoundError(f"no model named {name[:128]!r} in the repository; known: {sorted(self.entries)}")
        if entry.manifest is None:
            raise ManifestError(f"model {name!r}: {entry.reason}")
        if entry.unloading:
            raise UnavailableError(f"model {name!r} is being unloaded; load it again once it is")
        started = self._start_load(entry, on_demand=False)
        if wait_s is None:
            return None
        end = time.monotonic() + wait_s
        if isinstance(started, PendingLoad):
            served = started.wait(wait_s)
        else:
            served = started
        self._wait_ready(served, max(0.0, end - time.monotonic()))
        self.budget.measure(entry)  # before the reply, so the next decision (and a test) sees it
        return served

    def _start_load(self, entry: ModelEntry, on_demand: bool) -> Any:
        """The serving or loading ServedModel of `entry`, else the PendingLoad just started (or
        under way). Holds the entry's lock only to decide: the building runs on the load's thread."""
        with entry.lock:
            served = entry.served
            if served is not None and served.state != ModelState.FAILED:
                return served
            if entry.loader is not None:
                return entry.loader
            if served is not None:  # failed before: a fresh try replaces it
                entry.served = None
                if self.server.models.get(entry.name) is served:
                    del self.server.models[entry.name]
                threading.Thread(target=self.unloader.stop_quietly, args=(served,), daemon=True).start()
            entry.loader = PendingLoad(self, entry, on_demand)
            entry.loader.start()
            return entry.loader

    def _finish_load(self, load: "PendingLoad") -> ServedModel:
        """On the load's thread: make room, build, register and start the model."""
        entry = load.entry
        assert entry.manifest is not None
        self._make_room(entry)
        rss = resident_bytes()
        try:
            served = self.build(entry, entry.manifest)
        except OutriderError as exc:
            entry.reason = f"load failed: {exc.message}"
            raise
        served.required = False
        served.accept_while_loading = entry.manifest.load_on_demand
        # Judged on the backend the build chose (a manifest may name several): a backend turns warm
        # only once a load of it is ready (`MemoryBudget.measure`), so this load has not made it warm yet.
        warm = served.choice.backend.name in self.budget.warm_backends
        with entry.lock:
            entry.rss_before_load, entry.measured, entry.warm_load = rss, False, warm
            entry.served, entry.version, entry.reason = served, served.version, ""
            self.server.models[entry.name] = served
        log.info("model %s: loading version %d%s", entry.name, served.version, " (on demand)" if load.on_demand else "")
        served.start()
        return served

    def _wait_ready(self, served: ServedModel, wait_s: float) -> None:
        end = time.monotonic() + wait_s
        while not served.ready:
            if served.state == ModelState.FAILED:
                raise ModelNotReadyError(f"model {served.name!r} failed to load: {served.reason}")
            if time.monotonic() >= end:
                raise ModelNotReadyError(f"model {served.name!r} is still {served.state} after {wait_s:g}s")
            time.sleep(0.01)

    # -- the memory budget ------------------------------------------------------------------

    def _make_room(self, entry: ModelEntry) -> None:
        """Under a budget: unload idle models, least recently used first, until `entry` fits;
        raise InsufficientMemoryError with the numbers when it cannot."""
        budget = self.budget.limit
        if budget is None:
            return
        estimate = self.budget.estimate(entry)
        need, how = estimate if estimate else (0, "unknown")
        with self._lock:
            while True:
                used = resident_bytes()
                if used + need <= budget:
                    return
                idle = [e for e in self.entries.values() if e is not entry and e.served is not None
                        and not e.unloading and e.pending is None and not e.served.outstanding
                        and e.served.state != ModelState.LOADING]
                if not idle:
                    busy = sorted(e.name for e in self.entries.values() if e is not entry and e.served is not None)
                    raise InsufficientMemoryError(
                        f"model {entry.name!r} needs about {_mib(need)} ({how}); the server holds {_mib(used)} of "
                        f"its {_mib(budget)} memory budget and no idle model is left to unload"
                        + (f" (loaded and busy: {', '.join(busy)})" if busy else ""))
                victim = min(idle, key=lambda e: e.served.last_used)
                log.info("model %s: unloading (least recently used) to make room for %s under the %s budget",
                         victim.name, entry.name, _mib(budget))
                self.unload(victim.name, wait=True)

    # -- unload and drain -------------------------------------------------------------------

    def unload(self, name: str, cancel_streams: bool = False, wait: bool = True,
               why: str = "unloaded") -> None:
        """Take `name` out of service and drain it (see `Unloader.retire`). Raises ModelNotFoundError."""
        entry = self.entries.get(name)
        if entry is None:
            raise ModelNotFoundError(f"no model named {name[:128]!r} in the repository; known: {sorted(self.entries)}")
        loader = entry.loader
        if loader is not None:  # a load under way finishes first, then is unloaded
            try:
                loader.wait(600.0)
            except OutriderError:
                pass
        self.unloader.unload(entry, cancel_streams, wait, why)

    def stop_all(self) -> list[ServedModel]:
        """At shutdown: the reloads still loading, stopped; the unloads under way, joined."""
        stopped = []
        for entry in self.entries.values():
            if entry.pending is not None:
                pending, entry.pending = entry.pending, None
                self.unloader.stop_quietly(pending)
                stopped.append(pending)
        self.unloader.join()
        return stopped

    # -- reload -------------------------------------------------------------------------------

    def reload(self, entry: ModelEntry, manifest: Manifest) -> None:
        """Load `manifest` as the next version of a loaded `entry`, beside the serving one (on a
        thread of its own: building may import a framework)."""
        with entry.lock:
            previous, entry.pending = entry.pending, None
        if previous is not None:  # a reload overtaken by a newer change
            self.unloader.stop_quietly(previous)
        try:
            served = self.build(entry, manifest)
        except OutriderError as exc:
            entry.reason = f"reload failed, version {entry.version} still serving: {exc.message}"
            log.error("model %s: %s", entry.name, entry.reason)
            return
        served.required = False
        with entry.lock:
            if entry.served is None or entry.unloading:
                return  # unloaded meanwhile: nothing to replace
            served.version = max(entry.version, entry.served.version) + 1
            entry.pending, entry.reason = served, ""
        log.info("model %s: loading version %d beside version %d", entry.name, served.version, entry.version)
        served.start()

    def _advance_reload(self, entry: ModelEntry) -> None:
        """A reload's new version: switch the name to it once ready; drop it if it failed."""
        pending = entry.pending
        if pending is None:
            return
        if pending.state == ModelState.FAILED:
            with entry.lock:
                if entry.pending is not pending:
                    return
                entry.pending = None
                entry.reason = f"reload to version {pending.version} failed, version {entry.version} still serving: {pending.reason}"
            log.error("model %s: %s", entry.name, entry.reason)
            threading.Thread(target=self.unloader.stop_quietly, args=(pending,), daemon=True).start()
            return
        if not pending.ready:
            return
        with entry.lock:
            if entry.pending is not pending:
                return
            old = entry.served
            pending.accept_while_loading = bool(entry.manifest and entry.manifest.load_on_demand)
            pending.required = old.required if old is not None else False
            entry.served, entry.pending, entry.version = pending, None, pending.version
            self.server.models[entry.name] = pending
        log.info("model %s: version %d serving; version %s draining", entry.name, pending.version,
                 old.version if old else "-")
        if old is not None:
            self.unloader.in_background(self.unloader.retire, f"outrider-drain-{entry.name}",
                                        old, False, "replaced by a new version")

    # -- the supervisor's tick -----------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Reload switches, measured load costs, idle unloads, and the watch scan (every
        WATCH_INTERVAL_S). Runs on the server's supervisor thread."""
        self.unloader.forget_finished()
        for entry in list(self.entries.values()):
            self._advance_reload(entry)
            served = entry.served
            if served is None or entry.unloading:
                continue
            self.budget.measure(entry)
            idle_s = entry.manifest.idle_unload_s if entry.manifest is not None else 0
            if (idle_s and served.ready and not served.outstanding and entry.pending is None
                    and now - served.last_used >= idle_s):
                log.info("model %s: no request for %.0fs: unloading", entry.name, now - served.last_used)
                self.unload(entry.name, wait=False, why=f"idle for {idle_s:g}s")
        if self.watch and self.directory is not None and now >= self._next_scan:
            self._next_scan = now + WATCH_INTERVAL_S
            self.scan()

    def scan(self) -> None:
        """Compare the directory with the entries: a new file adds a model (available), a changed
        one reloads a loaded model (or replaces an unloaded entry), a removed one unloads."""
        assert self.directory is not None
        try:
            files = {p: entry_fingerprint(p, None) for p in manifest_files(self.directory)}
        except OSError as exc:
            log.error("--models %s: cannot be read: %s", self.directory, exc)
            return
        by_path = {e.path: e for e in self.entries.values() if e.path is not None}
        for path, raw in files.items():
            entry = by_path.get(path)
            if entry is not None and raw_part(entry.fingerprint) == raw and not artifact_changed(entry):
                continue
            fresh = self._read(path)
            if entry is None:
                if fresh.name in self.entries:
                    log.error("%s: model %r is already defined by %s; ignored", path, fresh.name,
                              self.entries[fresh.name].path)
                    continue
                log.info("model %s: new in the repository (%s)", fresh.name, path.name)
                self._add(fresh)
                continue
            entry.fingerprint = fresh.fingerprint
            if fresh.manifest is None:
                entry.reason = (f"{fresh.reason}; version {entry.version} still serving" if entry.served
                                else fresh.reason)
                log.error("model %s: changed file does not validate: %s", entry.name, entry.reason)
                continue
            if fresh.name != entry.name:
                log.error("%s: the file now names model %r, was %r; renaming is an unload and a new "
                          "file", path, fresh.name, entry.name)
                entry.reason = f"{path.name} now names {fresh.name!r}; not reloaded"
                continue
            if entry.served is not None and not entry.unloading:
                entry.manifest = fresh.manifest
                threading.Thread(target=self.reload, args=(entry, fresh.manifest), name=f"outrider-reload-{entry.name}",
                                 daemon=True).start()
            else:
                entry.manifest, entry.reason = fresh.manifest, ""
        for path, entry in by_path.items():
            if self.directory in path.parents and path not in files:
                log.info("model %s: its file %s is gone: unloading and removing it", entry.name, path.name)
                self.unload(entry.name, wait=False, why="removed from the repository")
                with self._lock:
                    self.entries.pop(entry.name, None)


