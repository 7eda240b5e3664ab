"""Every hook a plugin can implement. One module, one docstring per hook.

Registration hooks receive a `register` callback so that the core, not the plugin,
checks names and conflicts (the pattern of simonw/llm's `register_models`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pluggy

hookspec = pluggy.HookspecMarker("outrider")
hookimpl = pluggy.HookimplMarker("outrider")


@hookspec
def outrider_register_backends(register: Callable[[type], None]) -> None:
    """Register compute backends: call `register(BackendClass)` once per class.

    A backend class subclasses `outrider.backend.Backend`, has a unique `name`
    (the name manifests use in `backend:`) and implements the lifecycle
    load -> warmup -> execute -> health -> unload.
    """


@hookspec
def outrider_register_tasks(register: Callable[[type], None]) -> None:
    """Register input/output processing for a kind of model: `register(TaskClass)`.

    A task (e.g. `sentence-embedding`: tokenize text, pool and normalize) turns the
    manifest's inputs into model feeds and model results into the manifest's outputs,
    so that several backends can serve the same model with the same contract.
    """


@hookspec
def outrider_register_accelerators(register: Callable[..., None]) -> None:
    """Register accelerators: `register(AcceleratorSpec(name, role, section, factory, backends, config))`.

    `role` is where the core calls it (`artifact_transform` before load, `batch_policy` between
    queue and instances, `decode_strategy` at each generation step; see outrider.accelerators);
    `section` is the manifest section that turns it on; `backends` the backend names (fnmatch
    patterns) it applies to; `config` the pydantic model of its section, validated at start.
    `factory(manifest, config)` returns the object the core uses for that model.
    """


@hookspec
def outrider_register_drafters(register: Callable[[str, Any], None]) -> None:
    """Register drafters for speculative decoding: `register(name, factory)`.

    `factory(model, options, context)` returns an object with `propose(sequence, budget) -> DraftTree`
    (see outrider.generation.contract: `model` is a `CausalLM`, `context` a `DrafterContext`, the
    contract in `Drafter`'s docstring). Manifests pick drafters by name in `speculative.drafters`;
    a drafter only proposes, it never decides what is accepted.
    """


@hookspec(firstresult=True)
def outrider_choose_backend(manifest: Any, backends: dict[str, type]) -> Optional[Any]:
    """Pick the backend for a manifest; the first non-None answer wins.

    Returns an `outrider.backend.BackendChoice` (class, device and the reasons the
    preferred ones were skipped). The core's own implementation runs last and walks
    the manifest's preference list, asking each class `availability()`.
    A plugin may answer first to impose a policy (e.g. pin a device).
    """


@hookspec
def outrider_model_state_changed(model: str, state: str, reason: str) -> None:
    """Told whenever a served model changes state (loading, ready, degraded, failed, ...).

    For monitoring plugins; must return quickly and never raise.
    """


@hookspec
def outrider_register_fronts(register: Callable[[type], None]) -> None:
    """Register front-ends: `register(FrontClass)` once per class.

    A front subclasses `outrider.front.Front`, has a unique `name` (what
    `outrider serve --front NAME=ADDRESS` selects; `--http ADDRESS` selects `http`) and serves
    another protocol from the same process as the ZeroMQ socket: it passes every request to
    `Server.submit`, so queues, batching, limits, deadlines, cancellation and metrics are shared.
    It must not import its framework at module level (`availability()` says what is missing).
    """
