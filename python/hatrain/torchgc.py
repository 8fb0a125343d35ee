"""The interpreter's garbage collections in a job under hatrain: timed, and,
with ``Job(gc="planned")``, planned.

Python's cycle collector runs when allocations cross its thresholds: at a
different step on each rank, and every other rank waits for the one that
collects (a collection planned at the same step on every rank costs once,
not once per rank). Every collection is timed through ``gc.callbacks`` and
added to the rank's control page with the step it ran in (``agentctl
status``: ``workers[].step_times.gc_ms``, ``gc_collections`` and
``gc_step_sum``, the sum of those steps). ``gc="planned"`` disables the
automatic collector and collects before every 100th step on every rank
(``"planned:N"``: every N); ``"auto"`` (the default) leaves it alone.
"""

from __future__ import annotations

import gc
import time
from typing import Callable

#: Steps between planned collections, by default.
EVERY = 100


def parse(spec: str) -> int | None:
    """The steps between planned collections for ``Job(gc=spec)``; None
    for ``"auto"``."""
    if spec == "auto":
        return None
    if spec == "planned":
        return EVERY
    head, _, n = spec.partition(":")
    if head == "planned" and n.isdigit() and int(n) > 0:
        return int(n)
    raise ValueError(f"Job(gc={spec!r}): \"auto\", \"planned\" or \"planned:N\" (N steps, at least 1)")


class Collections:
    """Times every collection to ``rt`` (with the step ``step_of()`` says
    it ran in), and plans them every ``every`` steps where given."""

    def __init__(self, rt, every: int | None, step_of: Callable[[], int]):
        self.rt, self.every, self.step_of = rt, every, step_of
        self._began: int | None = None
        gc.callbacks.append(self._timed)
        if every is not None:
            gc.disable()

    def _timed(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter_ns()
        elif self._began is not None:
            self.rt.gc_collected(time.perf_counter_ns() - self._began, self.step_of())
            self._began = None

    def before(self, step: int) -> None:
        """Step ``step`` is about to begin: a planned collection is due
        before every ``every``-th."""
        if self.every is not None and step % self.every == 0:
            gc.collect()

    def close(self) -> None:
        if self._timed in gc.callbacks:
            gc.callbacks.remove(self._timed)
        if self.every is not None:
            gc.enable()
