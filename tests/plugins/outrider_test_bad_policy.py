"""A batch policy with a bug: it answers fewer results than requests (registered only by the test
that checks the core still answers every request of the batch)."""

from __future__ import annotations

from outrider import hookimpl
from outrider.accelerators import AcceleratorSpec
from outrider.serving.scheduler import Scheduler


class ShortResults(Scheduler):
    """Runs the backend, then loses the results (a scheduler bug the core must survive)."""

    def execute(self, backend, batch):
        backend.execute(batch[0].inputs)
        return []


@hookimpl
def outrider_register_accelerators(register) -> None:
    register(AcceleratorSpec(name="short-results", role="batch_policy", section="batching",
                             factory=lambda manifest, config: ShortResults(manifest), backends=("echo",)))
