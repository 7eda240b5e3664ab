"""Conformance checks for a backend (its life, its outputs) and for the batch policy over it."""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np

from ..backend import Availability, Backend, warmup_inputs
from ..manifest import Manifest, TensorSpec, validate_manifest
from ..plugins import PluginRegistry, create_registry
from ..protocol import datatype_of


def _check_outputs(manifest: Manifest, inputs: dict[str, np.ndarray], outputs: Any) -> None:
    assert isinstance(outputs, dict), f"execute must return a dict of arrays, got {type(outputs).__name__}"
    for name, value in outputs.items():
        assert isinstance(value, np.ndarray), f"output {name!r} is {type(value).__name__}, expected numpy.ndarray"
    batch = next((v.shape[0] for v in inputs.values() if v.ndim), None)
    for spec in manifest.outputs:
        assert spec.name in outputs, f"output {spec.name!r} declared in the manifest is missing; got {sorted(outputs)}"
        _check_spec(spec, outputs[spec.name], batch)


def _check_spec(spec: TensorSpec, value: np.ndarray, batch: Optional[int]) -> None:
    got = datatype_of(value)
    assert got == spec.datatype, f"output {spec.name!r} is {got}, manifest says {spec.datatype}"
    assert value.ndim == len(spec.shape), f"output {spec.name!r} has shape {value.shape}, manifest says {spec.shape}"
    for i, (dim, want) in enumerate(zip(value.shape, spec.shape)):
        assert want in (-1, dim), f"output {spec.name!r} dim {i} is {dim}, manifest says {want}"
    if batch is not None and spec.shape and spec.shape[0] == -1:
        assert value.shape[0] == batch, f"output {spec.name!r} has batch {value.shape[0]}, inputs had {batch}"


def _close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if a.dtype == object or b.dtype == object:
        assert a.tolist() == b.tolist(), f"{what}: outputs differ"
    else:
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4, err_msg=what)


def check_backend(
    backend_class: type[Backend],
    manifest: Manifest | dict,
    sample_inputs: Optional[dict[str, np.ndarray]] = None,
    registry: Optional[PluginRegistry] = None,
    device: Optional[str] = None,
) -> dict[str, Any]:
    """Run a backend through its whole lifecycle and check each step; returns timings."""
    assert isinstance(backend_class, type) and issubclass(backend_class, Backend), "backend must subclass Backend"
    assert backend_class.name, "backend class needs a non-empty `name`"
    if isinstance(manifest, dict):
        manifest = validate_manifest(manifest, "<conformance manifest>")
    t0 = time.perf_counter()
    avail = backend_class.availability(manifest, manifest.device)
    assert isinstance(avail, Availability), "availability() must return an Availability"
    assert time.perf_counter() - t0 < 5.0, "availability() must be cheap (it runs on every start)"
    if not avail.available:
        assert avail.reason, "an unavailable backend must say why"
        return {"available": False, "reason": avail.reason}
    registry = registry or create_registry(load_entry_points=False)
    task = registry.make_task(manifest)
    backend = backend_class(manifest, device or backend_class.resolve_device(manifest.device), task)
    timings: dict[str, Any] = {"available": True}
    t0 = time.perf_counter()
    backend.prepare_artifact()  # as the core does: the manifest's artifact transforms, then load
    backend.load()
    timings["load_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    backend.warmup()
    timings["warmup_seconds"] = time.perf_counter() - t0

    inputs = sample_inputs or warmup_inputs(manifest)
    first = backend.execute(inputs)
    _check_outputs(manifest, inputs, first)
    again = backend.execute(inputs)
    for name in first:
        _close(first[name], again[name], f"output {name!r} differs between two identical calls")

    # Batch consistency: the batcher concatenates requests, so rows must not depend on each other.
    batchable = manifest.inputs and all(s.shape and s.shape[0] == -1 for s in manifest.inputs)
    if batchable and all(v.shape[0] >= 2 for v in inputs.values()):
        one = backend.execute({k: v[:1] for k, v in inputs.items()})
        for name in one:
            _close(one[name], first[name][:1], f"output {name!r} of row 0 depends on the other rows of the batch")

    health = backend.health()
    assert isinstance(health, dict) and isinstance(health.get("healthy"), bool), \
        f"health() must return a dict with a boolean 'healthy', got {health!r}"
    assert health["healthy"], f"a loaded backend reports unhealthy: {health}"
    assert isinstance(backend.metadata(), dict), "metadata() must return a dict"
    backend.unload()
    return timings


class BackendConformance:
    """pytest mixin: set `plugins`, `backend` (name), `manifest` and optionally `sample_inputs`."""

    plugins: list[str] = []
    backend: str = ""
    manifest: dict = {}
    sample_inputs: Optional[dict[str, np.ndarray]] = None

    def _registry(self) -> PluginRegistry:
        return create_registry(modules=self.plugins, load_entry_points=False)

    def test_registers_backend(self) -> None:
        registry = self._registry()
        assert self.backend in registry.backends, f"no plugin in {self.plugins} registers backend {self.backend!r}"

    def test_lifecycle(self) -> None:
        import pytest

        registry = self._registry()
        result = check_backend(registry.backends[self.backend], self.manifest, self.sample_inputs, registry)
        if not result["available"]:
            pytest.skip(f"backend {self.backend!r} unavailable here: {result['reason']}")


def check_batch_policy(registry: PluginRegistry, manifest: Manifest | dict, backend: Backend,
                       requests: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """Run the batch policy `manifest` turns on (a Scheduler from an accelerator, or the core's
    default) over a loaded `backend`: every queued request is taken once and answered once, each
    answer equal to what the backend gives that request alone (rows do not leak between
    neighbours), in the order of its batch. Returns the batch sizes it made."""
    from ..serving.queue import RequestQueue
    from ..serving.request import PendingRequest
    from ..serving.scheduler import Scheduler

    if isinstance(manifest, dict):
        manifest = validate_manifest(manifest, "<conformance manifest>")
    made = registry.accelerators_for(manifest, type(backend))
    policy = made.batch_policy if made.batch_policy is not None else Scheduler(manifest)
    assert not policy.stateful, "a stateful policy (generation) is checked with check_generating_backend"
    queue = RequestQueue(max(64, len(requests)))
    pending = [PendingRequest(b"c", i, "infer", manifest.name, inputs, {}, lambda *a: None)
               for i, inputs in enumerate(requests)]
    for request in pending:
        queue.put(request)
    sizes, answered = [], {}
    for _ in range(10 * len(requests) + 10):
        batch = policy.next_batch(queue, None, backend)
        if not batch:
            if len(answered) == len(requests):
                break
            continue
        results = policy.execute(backend, batch)
        assert len(results) == len(batch), f"execute answered {len(results)} of a batch of {len(batch)}"
        for request, result in zip(batch, results):
            assert request.id not in answered, f"request {request.id} was taken twice"
            answered[request.id] = result
        sizes.append(len(batch))
    assert len(answered) == len(requests), f"{len(requests) - len(answered)} requests were never taken"
    for request in pending:
        alone, got = backend.execute(request.inputs), answered[request.id]
        assert isinstance(got, dict), f"request {request.id} failed: {got!r}"
        for name in alone:
            _close(np.asarray(got[name]), np.asarray(alone[name]),
                   f"request {request.id}: output {name!r} differs from the request run alone")
    return {"batch_sizes": sizes}
