"""Plugin manager: loads plugins (entry points and modules), collects what they register."""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Iterable, Optional

import pluggy

from . import entry_index, hookspecs
from .accelerators import AcceleratorSet, AcceleratorSpec, select, validate_section
from .backend import Backend, BackendChoice, Task, check_backend_class, choose_backend
from .errors import ManifestError, OutriderError
from .front import Front
from .hookspecs import hookimpl
from .manifest import Manifest

log = logging.getLogger("outrider.plugins")

ENTRY_POINT_GROUP = "outrider"
ALLOW_ENV = "OUTRIDER_PLUGINS"


class _CoreDefaults:
    """The core's own hook implementations; they run last so plugins can override."""

    @hookimpl(trylast=True)
    def outrider_choose_backend(self, manifest: Manifest, backends: dict[str, type]) -> BackendChoice:
        return choose_backend(manifest, backends)


@dataclass
class PluginRegistry:
    """What the loaded plugins registered, checked by the core."""

    pm: pluggy.PluginManager
    backends: dict[str, type[Backend]] = field(default_factory=dict)
    tasks: dict[str, type[Task]] = field(default_factory=dict)
    #: accelerator specs by (role, name)
    accelerators: dict[tuple[str, str], AcceleratorSpec] = field(default_factory=dict)
    drafters: dict[str, Any] = field(default_factory=dict)
    #: front-ends by name (`outrider serve --front NAME=ADDRESS`)
    fronts: dict[str, type[Front]] = field(default_factory=dict)
    #: modules registered by name (not through entry points): worker processes register them too.
    modules: list[str] = field(default_factory=list)
    _owner: dict[str, str] = field(default_factory=dict)

    def collect(self) -> None:
        """Ask every plugin to register; conflicting names are errors, not silent overrides."""
        self.backends.clear()
        self.tasks.clear()
        self.accelerators.clear()
        self.drafters.clear()
        self.fronts.clear()
        self.pm.hook.outrider_register_backends(register=self._register_backend)
        self.pm.hook.outrider_register_tasks(register=self._register_task)
        self.pm.hook.outrider_register_accelerators(register=self._register_accelerator)
        self.pm.hook.outrider_register_drafters(register=self._register_drafter)
        self.pm.hook.outrider_register_fronts(register=self._register_front)

    def _register_front(self, cls: type) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Front)) or not cls.name:
            raise OutriderError(f"register_fronts: {cls!r} is not a Front subclass with a name")
        self._claim(self.fronts, "front", cls.name, cls)

    def front(self, name: str) -> type[Front]:
        """The front class registered as `name`, available here, or an OutriderError saying why not."""
        cls = self.fronts.get(name)
        if cls is None:
            raise OutriderError(
                f"no plugin registers front {name!r} (known: {sorted(self.fronts) or 'none'}); the HTTP "
                f"front is the plugin outrider_http: install 'outrider[http]', and load it (OUTRIDER_PLUGINS "
                f"must allow 'http', or pass --plugin outrider_http)", code="usage")
        available, why = cls.availability()
        if not available:
            raise OutriderError(f"front {name!r} cannot run here: {why}", code="usage")
        return cls

    def _register_drafter(self, name: str, factory: Any) -> None:
        if not isinstance(name, str) or not name or not callable(factory):
            raise OutriderError(f"register_drafters: expected (name, factory), got ({name!r}, {factory!r})")
        self._claim(self.drafters, "drafter", name, factory)

    def _register_backend(self, cls: type) -> None:
        check_backend_class(cls)
        self._claim(self.backends, "backend", cls.name, cls)

    def _register_task(self, cls: type) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Task)) or not cls.name:
            raise OutriderError(f"register_tasks: {cls!r} is not a Task subclass with a name")
        self._claim(self.tasks, "task", cls.name, cls)

    def _register_accelerator(self, spec: Any) -> None:
        if not isinstance(spec, AcceleratorSpec):
            raise OutriderError(f"register_accelerators: expected an AcceleratorSpec, got {spec!r}")
        spec.check()
        for key, other in self.accelerators.items():
            if other is not spec and other.section == spec.section and key != (spec.role, spec.name):
                # Two plugins may fill one section only for different backends (ORT int8, torch int8).
                shared = [b for b in spec.backends if other.applies_to(b)] + [
                    b for b in other.backends if spec.applies_to(b)]
                if shared:
                    raise OutriderError(
                        f"accelerators {other.name!r} and {spec.name!r} both claim section {spec.section!r} "
                        f"for backends {shared}"
                    )
        self._claim(self.accelerators, "accelerator", (spec.role, spec.name), spec)

    def _claim(self, table: dict, kind: str, name: str, value: Any) -> None:
        existing = table.get(name)
        if existing is not None and existing is not value:
            raise OutriderError(
                f"two plugins register {kind} {name!r}: {self._owner.get(kind + str(name))} and {value!r}"
            )
        table[name] = value
        self._owner[kind + str(name)] = _owner_module(value)

    def choose_backend(self, manifest: Manifest) -> BackendChoice:
        return self.pm.hook.outrider_choose_backend(manifest=manifest, backends=dict(self.backends))

    def check_section(self, section: str, value: Any, where: str) -> list[str]:
        """Error lines for an accelerator section as written (manifest.SectionCheck): none when a
        plugin that provides `section` accepts it, or when none provides it (model building says
        so, naming the sections provided); else what the first provider's model rejects."""
        errors = []
        for spec in self.accelerators.values():
            if spec.section != section:
                continue
            try:
                validate_section(spec, value, where)
                return []
            except ManifestError as exc:
                errors.append(exc.message)
        return errors[:1]

    def accelerators_for(self, manifest: Manifest, backend: type[Backend]) -> AcceleratorSet:
        """Validate and build the accelerators `manifest` turns on, for the chosen backend class."""
        made = select(list(self.accelerators.values()), manifest, backend)
        for section, obj in made.items():
            if made.specs[section].uses_drafters:  # e.g. speculative decoding finds drafters by name
                obj.bind_registry(dict(self.drafters))
        return made

    def make_task(self, manifest: Manifest) -> Optional[Task]:
        task = manifest.model.task if manifest.model else None
        if not task:
            return None
        cls = self.tasks.get(task)
        if cls is None:
            raise ManifestError(
                f"{manifest.where}: field 'model.task': no plugin registers task "
                f"{task!r}; known tasks: {sorted(self.tasks)}"
            )
        return cls(manifest)

    def notify_state(self, model: str, state: str, reason: str = "") -> None:
        try:
            self.pm.hook.outrider_model_state_changed(model=model, state=state, reason=reason)
        except Exception:  # monitoring must never take serving down
            log.exception("outrider_model_state_changed hook failed")

    def describe(self) -> list[dict[str, Any]]:
        """Every plugin: name, version, hooks, and the availability of what it registered."""
        out = []
        for name, plugin in self.pm.list_name_plugin():
            if isinstance(plugin, _CoreDefaults):
                continue
            hooks = sorted(h.name for h in self.pm.get_hookcallers(plugin) or [])
            backends = []
            for bname, cls in sorted(self.backends.items()):
                if self._owner.get("backend" + bname) and getattr(cls, "__module__", "").split(".")[0] == _module_root(plugin):
                    avail = cls.availability(None, "auto")
                    backends.append({"name": bname, "available": avail.available, "reason": avail.reason})
            out.append({
                "name": name,
                "module": _module_root(plugin),
                "version": _version_of(plugin),
                "hooks": hooks,
                "backends": backends,
                "tasks": sorted(t for t, c in self.tasks.items() if c.__module__.split(".")[0] == _module_root(plugin)),
                "fronts": [
                    {"name": f, "available": c.availability()[0], "reason": c.availability()[1]}
                    for f, c in sorted(self.fronts.items()) if c.__module__.split(".")[0] == _module_root(plugin)
                ],
                "accelerators": [
                    {"name": spec.name, "role": spec.role, "section": spec.section, "backends": list(spec.backends)}
                    for (_, _), spec in sorted(self.accelerators.items())
                    if _owner_module(spec).split(".")[0] == _module_root(plugin)
                ],
            })
        return out


def _owner_module(value: Any) -> str:
    """The module a registered thing comes from (an AcceleratorSpec: its factory's)."""
    if isinstance(value, AcceleratorSpec):
        value = value.factory
    return getattr(value, "__module__", None) or repr(value)


def _module_root(plugin: Any) -> str:
    name = plugin.__name__ if isinstance(plugin, ModuleType) else type(plugin).__module__
    return name.split(".")[0]


def _version_of(plugin: Any) -> str:
    root = _module_root(plugin)
    mod = importlib.import_module(root)
    version = getattr(mod, "__version__", None)
    if version:
        return str(version)
    from importlib import metadata  # not at import: ~14 ms of every start

    for dist in metadata.packages_distributions().get(root, []):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return "unknown"


def allowed_entry_points(environ: Optional[dict[str, str]] = None) -> Optional[set[str]]:
    """OUTRIDER_PLUGINS=a,b loads only those entry points; 'none' or '' loads none; unset loads all."""
    value = (os.environ if environ is None else environ).get(ALLOW_ENV)
    if value is None:
        return None
    value = value.strip()
    if value.lower() in ("", "none"):
        return set()
    return {p.strip() for p in value.split(",") if p.strip()}


def create_registry(
    modules: Iterable[str | ModuleType | Any] = (), load_entry_points: bool = True
) -> PluginRegistry:
    """Build a plugin manager: entry points (filtered by OUTRIDER_PLUGINS), then `modules`."""
    modules = list(modules)
    pm = pluggy.PluginManager("outrider")
    pm.add_hookspecs(hookspecs)
    pm.register(_CoreDefaults(), name="outrider-core")
    if load_entry_points:
        allowed = allowed_entry_points()
        for name, value in entry_index.entry_points(ENTRY_POINT_GROUP, also=("pydantic",)):
            if allowed is not None and name not in allowed:
                continue
            if pm.get_plugin(name) is not None:
                continue
            try:
                pm.register(entry_index.load(ENTRY_POINT_GROUP, name, value), name=name)
            except Exception as exc:
                raise OutriderError(f"plugin {name!r} ({value}) failed to load: {exc!r}") from exc
    for module in modules:
        plugin = importlib.import_module(module) if isinstance(module, str) else module
        name = plugin.__name__ if isinstance(plugin, ModuleType) else None
        if pm.is_registered(plugin):
            continue
        pm.register(plugin, name=name)
    pm.check_pending()  # a misspelled hook name fails here, not silently
    registry = PluginRegistry(pm, modules=[m for m in modules if isinstance(m, str)])
    registry.collect()
    return registry
