"""How long a DDP rank waits on its peers inside the backward pass.

DDP all-reduces each bucket of gradients as soon as the bucket's gradients
are ready, while the backward pass goes on, and the pass ends (DDP's own
callback at its end) once every bucket is reduced. From this rank's last
gradient to that end, its compute was done and it waited: for the ring's
transfers, and for the peers whose gradients came later. A rank slowed in
its own compute waits little; the ranks it holds back wait as long as it
was slow. That wait is timed here, and counted as collective time, not
compute (``agentctl status``: ``workers[].step_times.collective_ms``), so
that the slow-rank detector sees who waited for whom in a PyTorch job as
it does for the reference trainer's collectives.

Nothing of DDP is changed (no communication hook: its sums stay
bit-identical to a plain DDP run's): a hook after each parameter's
gradient is accumulated notes the time, and a callback of the autograd
engine, queued after DDP's, notes the end.

FSDP2 calls its all-gathers (before a block's forward and backward) and
its reduce-scatters (after a block's backward) from its own hooks: each
parameter group's collectives go through FSDP's own (the comm objects
``set_custom_all_gather`` would replace), wrapped to time the call; the
time is counted as collective, as DDP's wait is. The wrapped objects call
FSDP's unchanged, so the sums are those of plain FSDP2. On an accelerator
a call only enqueues the collective: the host waits later, and that wait
is not seen here.
"""

from __future__ import annotations

import time

import torch


def _queue(callback) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class Overlap:
    """Times the wait after the last gradient of each backward pass of the
    module :meth:`attach` was given (the one DDP wraps), and hands it to
    ``rt.collective_overlapped`` once per step (:meth:`step_ends`). Until
    then, and for a job DDP does not wrap (FSDP2), it times nothing."""

    def __init__(self, rt):
        self.rt = rt
        self._last = 0
        self._queued = False
        self._waited = 0
        self._hooks: list = []

    def attach(self, module: torch.nn.Module) -> None:
        """Times ``module``'s backward passes (once: a DDP module built
        again over it after a recovery keeps the hooks)."""
        if not self._hooks:
            self._hooks = [
                p.register_post_accumulate_grad_hook(self._accumulated) for p in module.parameters() if p.requires_grad
            ]

    def _accumulated(self, _param) -> None:
        self._last = time.perf_counter_ns()
        if not self._queued:
            # Queued at the pass's first gradient, this callback runs
            # before DDP's (queued once its last bucket is ready) or after
            # it; either way the one it queues runs after DDP's, which
            # waits for every bucket's all-reduce.
            self._queued = True
            _queue(lambda: _queue(self._ended))

    def _ended(self) -> None:
        self._queued = False
        self._waited += max(0, time.perf_counter_ns() - self._last)

    def attach_fsdp(self, groups) -> None:
        """Times the all-gathers and reduce-scatters of FSDP2's parameter
        ``groups`` (once each: the groups outlive a recovery)."""
        for g in groups:
            for name in ("_all_gather_comm", "_reduce_scatter_comm"):
                comm = getattr(g, name, None)
                if comm is not None and not isinstance(comm, _Timed):
                    setattr(g, name, _Timed(comm, self))

    def waited(self, ns: int) -> None:
        """This step waited ``ns`` in a collective called inside its
        compute."""
        self._waited += ns

    def step_ends(self) -> None:
        """The step's backward passes are done (its update begins): what
        they waited goes to the runtime."""
        waited, self._waited = self._waited, 0
        # A pass that failed (a fault in the backward pass) ran no
        # callbacks: the next one is timed again.
        self._queued = False
        if waited:
            self.rt.collective_overlapped(waited)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class _Timed:
    """One of FSDP2's comm objects (``AllGather``, ``ReduceScatter``), each
    call timed into ``overlap``; its buffers are the wrapped one's."""

    def __init__(self, comm, overlap: Overlap):
        self.comm = comm
        self.overlap = overlap

    def allocate(self, *args, **kwargs):
        return self.comm.allocate(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return self.comm(*args, **kwargs)
        finally:
            self.overlap.waited(time.perf_counter_ns() - t0)
