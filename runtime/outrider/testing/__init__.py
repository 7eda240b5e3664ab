"""Conformance checks for backend plugins, for third-party authors and the built-ins alike.

Use from pytest:

    from outrider.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        plugins = ["my_plugin"]                     # modules to register
        manifest = {"name": "m", "backend": "mine", "inputs": [...], "outputs": [...]}
        sample_inputs = {"x": np.ones((2, 4), np.float32)}

or call `check_backend(...)` directly; every failure is an AssertionError that says what is wrong.
A generating backend has `check_generating_backend` (and its model `check_causal_lm`), a front
`check_front`, a batch policy `check_batch_policy`, a decode strategy `check_decode_strategy`, a
drafter `check_drafter`, a tokenizer `outrider.generation.contract.check_tokenizer`; a task runs
under `check_backend` (the backend executes through it), an artifact transform under its load.

Running a real server (`ServerProcess`, `free_port`, `rss_mb`, `tree_rss_mb`) is `outrider.harness`'s,
re-exported here. The checks live by what they check: backends.py, generation.py, fronts.py.
"""

from __future__ import annotations

from ..harness import ServerProcess, free_port, process_tree, rss_mb, tree_rss_mb
from .backends import BackendConformance, check_backend, check_batch_policy
from .fronts import SUBMITTER_MEMBERS, SubmitterView, check_front
from .generation import check_causal_lm, check_decode_strategy, check_drafter, check_generating_backend

__all__ = ["BackendConformance", "SUBMITTER_MEMBERS", "ServerProcess", "SubmitterView", "check_backend",
           "check_batch_policy", "check_causal_lm", "check_decode_strategy", "check_drafter", "check_front",
           "check_generating_backend", "free_port", "process_tree", "rss_mb", "tree_rss_mb"]
