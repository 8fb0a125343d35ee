"""Deterministic faults for tests and drills, from ``HATRAIN_FAULT_PLAN``.

The format is the reference trainer's: ``RANK:STEP:POINT:ACTION`` entries
separated by ``;``, with an optional fifth field naming the incarnation
(restart count) the entry fires in (default 0, the first process; ``*``:
every one). STEP may be a range ``FIRST-LAST``: every step of it (a rank
slow for a while). An entry fires at most once per step per process.

POINT: ``data`` (the step began, its batch not loaded yet: in
``hatrain.torch``, before ``job.step()``), ``forward`` (the step's compute
begins), ``update`` (inside the
update fences, after ``optimizer.step()`` changed the state and before the
step is sealed), ``commit`` (halfway through the step's snapshot copy),
``restore`` (a recovery restores STEP), ``close`` (the loop ended at STEP,
its snapshot sealed); the last two in ``hatrain.torch`` only.

ACTION: ``kill`` (SIGKILL itself), ``exit`` (exit code 17), ``hang`` (block
forever), ``sleepMS`` (sleep MS milliseconds), ``uce-PART-OFFSET`` (an
uncorrectable memory error at byte OFFSET of state part PART), ``npu-uce``
(the ``RuntimeError`` torch_npu raises for an NPU's uncorrectable memory
error, ``UCE ERROR``: raised at the step's update, where an asynchronous
device error surfaces; see ``Plan.surface``), ``no-siblings`` (at
``restore``: reading the other ranks' slices from their stores fails, so
they are gathered over the process group).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

ENV = "HATRAIN_FAULT_PLAN"
POINTS = ("data", "forward", "update", "commit", "restore", "close")


@dataclass
class Entry:
    rank: int
    first: int
    last: int
    point: str
    action: str
    incarnation: int | None  # None: every one
    fired: set[int] = field(default_factory=set)


def parse(text: str) -> list[Entry]:
    out = []
    for raw in filter(None, (e.strip() for e in text.split(";"))):
        f = raw.split(":")
        if len(f) not in (4, 5):
            raise ValueError(f"invalid {ENV} entry {raw!r}: RANK:STEP:POINT:ACTION[:INCARNATION]")
        try:
            first, dash, last = f[1].partition("-")
            rank, first = int(f[0]), int(first)
            last = int(last) if dash else first
            inc = None if len(f) == 5 and f[4] == "*" else int(f[4]) if len(f) == 5 else 0
        except ValueError:
            raise ValueError(f"invalid {ENV} entry {raw!r}: RANK, STEP (or FIRST-LAST) and INCARNATION are numbers") from None
        if last < first:
            raise ValueError(f"invalid {ENV} entry {raw!r}: the STEP range FIRST-LAST ends before it begins")
        if f[2] not in POINTS:
            raise ValueError(f"invalid {ENV} entry {raw!r}: POINT is one of {', '.join(POINTS)}")
        a = f[3]
        ok = a in ("kill", "exit", "hang", "npu-uce", "no-siblings") or (a.startswith("sleep") and a[5:].isdigit())
        if a.startswith("uce-"):
            bits = a.split("-")
            ok = len(bits) == 3 and bits[1].isdigit() and bits[2].isdigit()
        if not ok:
            raise ValueError(f"invalid {ENV} entry {raw!r}: unknown action {a!r}")
        out.append(Entry(rank, first, last, f[2], a, inc))
    return out


class Plan:
    """The plan of this process (``rank``, restart count from the agent)."""

    def __init__(self, rank: int, text: str | None = None):
        self.rank = rank
        self.incarnation = int(os.environ.get("HATRAIN_RESTART_COUNT", "0") or 0)
        self.entries = parse(os.environ.get(ENV, "") if text is None else text)
        self.pending: BaseException | None = None

    def has(self, point: str) -> bool:
        """Whether an entry of this rank is at ``point``."""
        return any(e.rank == self.rank and e.point == point for e in self.entries)

    def hit(self, step: int, point: str, rt=None) -> None:
        for e in self.entries:
            if step in e.fired or e.rank != self.rank or not e.first <= step <= e.last or e.point != point:
                continue
            if e.incarnation is not None and e.incarnation != self.incarnation:
                continue
            e.fired.add(step)
            self._do(e, step, rt)

    def surface(self) -> None:
        """Raises the device error a fault of this step left pending."""
        err, self.pending = self.pending, None
        if err is not None:
            raise err

    def _do(self, e: Entry, step: int, rt) -> None:
        import sys

        if e.first == e.last or step == e.first:
            print(f"rank {self.rank}: planned fault {e.action} at step {step} ({e.point})", file=sys.stderr, flush=True)
        if e.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif e.action == "exit":
            os._exit(17)
        elif e.action == "hang":
            while True:
                time.sleep(3600)
        elif e.action.startswith("sleep"):
            time.sleep(int(e.action[5:]) / 1000)
        elif e.action == "npu-uce":
            # torch_npu's text for ACL error 507053 (NPUException.cpp).
            self.pending = RuntimeError(
                f"npu_forward:NPUQueue.cpp:219 NPU function error: UCE ERROR, error code is 507053\n"
                f"[ERROR] (PID:{os.getpid()}, Device:{self.rank}, RankID:{self.rank}) ERR00100 PTA call acl api failed"
            )
        elif e.action == "no-siblings":
            from hatrain import HatrainError

            raise HatrainError("planned: the other ranks' stores are not read")
        elif e.action.startswith("uce-") and rt is not None:
            _, part, offset = e.action.split("-")
            rt.inject_uce(int(part), int(offset))
