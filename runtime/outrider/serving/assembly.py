"""Assembly: a manifest and the plugin registry in, a ServedModel out.

The one place that decides, for a manifest, which backend runs it, with which accelerators, under
which scheduler, in this process or in worker processes. Used by the server, the worker process
(`backend_for`, for the same backend the server would have built), and the testing kit.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..backend import Backend, check_options
from ..errors import ManifestError
from ..manifest import Manifest
from ..plugins import PluginRegistry
from ..stats import ModelStats
from .scheduler import Scheduler
from .served_model import ServedModel


def build_model(manifest: Manifest, registry: PluginRegistry, stats: Optional[ModelStats] = None) -> ServedModel:
    """The served model of `manifest`: backend chosen, options and task checked, accelerators
    selected, its scheduler (the batch policy, or the generating backend's own), its instances'
    backends made in this process or behind worker processes. `stats`: the counters of the
    version it replaces (a reload), so they carry on. Raises ManifestError."""
    choice = registry.choose_backend(manifest)
    if manifest.model and manifest.model.task and manifest.model.task not in registry.tasks:
        raise ManifestError(
            f"{manifest.source_file}: field 'model.task': no plugin registers task "
            f"{manifest.model.task!r}; known: {sorted(registry.tasks)}"
        )
    check_options(manifest, choice.backend)
    accelerators = registry.accelerators_for(manifest, choice.backend)
    scheduler: Optional[Scheduler] = accelerators.batch_policy
    if choice.backend.generates:  # stateful engines (generation) bring their own loop
        if manifest.scheduling.instance_kind != "thread":
            # Its loop drives the engine object of an in-process backend across steps; a
            # worker process only answers execute(batch), so it could never serve.
            raise ManifestError(
                f"{manifest.where}: field 'scheduling.instance_kind': backend "
                f"{choice.backend.name!r} keeps its sequences in an engine of its own and runs only as "
                f"'thread' instances, got {manifest.scheduling.instance_kind!r}"
            )
        scheduler = choice.backend.make_scheduler(manifest)
    factory: Optional[Callable[[str, int], Backend]] = None
    if manifest.scheduling.instance_kind == "process":  # each instance behind a worker process
        from ..worker.proxy import WorkerBackend  # here: thread instances never pay its import
        factory = lambda device, index: WorkerBackend(manifest, device, registry.modules, index=index)  # noqa: E731
    return ServedModel(
        manifest,
        choice,
        make_task=lambda: registry.make_task(manifest),
        scheduler=scheduler,
        on_state=registry.notify_state,
        accelerators=accelerators,
        backend_factory=factory,
        stats=stats,
    )


def backend_for(manifest: Manifest, registry: PluginRegistry, device: str) -> Backend:
    """The backend instance a worker process runs for `manifest` on `device` (not loaded yet)."""
    choice = registry.choose_backend(manifest)
    backend = choice.backend(manifest, device, registry.make_task(manifest))
    backend.accelerators = registry.accelerators_for(manifest, choice.backend)
    return backend
