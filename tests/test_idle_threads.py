"""An instance that waits for work hands back per-thread resources (Backend.idle): the queue
tells it when nothing came for a moment, and the torch backends then release their OpenMP team,
so that a busy torch model beside an idle one keeps libgomp's spinning fast path (two models on
2 cores decoded 2-3x slower before). Real torch, in a subprocess of its own (its thread count is
per process)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from outrider.serving.queue import RequestQueue
from outrider.serving.request import PendingRequest


def _request(rid: int) -> PendingRequest:
    return PendingRequest(route=b"a", id=rid, kind="infer", model="m", inputs={}, parameters={},
                          send=lambda req, kind, header, outputs: None)


def test_take_calls_idle_once_when_nothing_comes_and_still_returns_what_comes_later():
    queue = RequestQueue(8)
    calls: list[float] = []
    threading.Timer(0.1, lambda: queue.put(_request(7))).start()
    t0 = time.monotonic()
    request = queue.take(timeout=5.0, idle=lambda: calls.append(time.monotonic() - t0))
    assert request is not None and request.id == 7
    assert len(calls) == 1 and RequestQueue.IDLE_AFTER_S <= calls[0] < 0.1


def test_take_does_not_call_idle_when_work_is_waiting_or_the_wait_is_short():
    queue = RequestQueue(8)
    calls: list[int] = []
    queue.put(_request(1))
    assert queue.take(timeout=1.0, idle=lambda: calls.append(1)).id == 1
    assert queue.take(timeout=0.0, idle=lambda: calls.append(1)) is None  # a poll is not a wait
    assert calls == []


def test_take_after_close_returns_at_once_without_idle():
    queue = RequestQueue(8)
    queue.close()
    calls: list[int] = []
    t0 = time.monotonic()
    assert queue.take(timeout=2.0, idle=lambda: calls.append(1)) is None
    assert time.monotonic() - t0 < 0.5 and calls == []


_PROBE = r"""
import json, os, threading
import torch
from outrider.torch_process import release_cpu_threads

torch.set_num_threads(2)
a = torch.randn(512, 512)

def threads():
    return len(os.listdir("/proc/self/task"))

seen = {}
def instance():
    seen["before"] = threads()
    for _ in range(3):
        torch.mm(a, a)  # a parallel region: this thread's team of 2 (itself + 1 worker)
    seen["with_team"] = threads()
    release_cpu_threads()
    seen["released"] = threads()
    torch.mm(a, a)  # the team comes back for the next region, and the result is still right
    seen["again"] = threads()
    seen["right"] = bool(torch.allclose(torch.mm(a, a), a.double().mm(a.double()).float(), atol=1e-3))
    release_cpu_threads()
    release_cpu_threads()  # nothing to hand back: harmless
    seen["twice"] = threads()

t = threading.Thread(target=instance)
t.start(); t.join()
print(json.dumps(seen))
"""


def test_release_cpu_threads_hands_back_the_calling_threads_openmp_team():
    import pytest

    torch = pytest.importorskip("torch")
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("this torch does not use OpenMP for its CPU threads")
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                         env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin",
                              "PYTHONPATH": ":".join(sys.path)})
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["with_team"] == seen["before"] + 1, seen  # one worker besides the calling thread
    assert seen["released"] == seen["before"], seen
    assert seen["again"] == seen["with_team"] and seen["right"], seen
    assert seen["twice"] == seen["before"], seen


def test_an_llm_instance_hands_freed_heap_back_once_per_idle_spell(monkeypatch):
    """The llm backend's idle(): malloc_trim once an idle spell has lasted RELEASE_MEMORY_AFTER_S
    (a finished request's KV cache goes back to the OS), not again while the spell lasts, and
    again after the next work."""
    import types

    import outrider_llm
    from outrider_llm import heap

    trims: list[int] = []
    monkeypatch.setattr(heap, "release_free_memory", lambda: trims.append(1))
    monkeypatch.setattr(outrider_llm, "release_cpu_threads", lambda: None)
    clock = [100.0]
    monkeypatch.setattr(outrider_llm.time, "monotonic", lambda: clock[0])
    from outrider.manifest import validate_manifest

    backend = outrider_llm.LlmBackend(validate_manifest({"name": "t", "backend": "llm"}), "cpu")
    backend.engine = types.SimpleNamespace(steps=5)
    after = outrider_llm.RELEASE_MEMORY_AFTER_S
    backend.idle()  # the spell starts
    clock[0] += after / 2
    backend.idle()
    assert trims == []
    clock[0] += after
    backend.idle()
    backend.idle()
    assert trims == [1]
    backend.engine.steps = 9  # it worked in between: a new spell
    backend.idle()
    assert trims == [1]
    clock[0] += after
    backend.idle()
    assert trims == [1, 1]


RACE = """
import threading
from outrider.torch_process import from_transformers
errors = []
def take(*names):
    try:
        from_transformers(*names)
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=take, args=("AutoModel",)),
           threading.Thread(target=take, args=("LlamaConfig", "LlamaForCausalLM"))]
[t.start() for t in threads]
[t.join() for t in threads]
print(errors)
"""


def test_two_loads_importing_transformers_at_once_both_get_their_names():
    """Two model loads importing transformers' lazy names in parallel threads, in fresh interpreters
    (the race is on the first import): unserialized, about half of such pairs failed one import with
    "cannot import name ..." here; through from_transformers none may."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        import pytest

        pytest.skip("needs transformers and torch")
    for _ in range(6):
        done = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
