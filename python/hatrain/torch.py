"""hatrain for PyTorch data-parallel training: the few lines a DDP script adds.

::

    import hatrain.torch

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    job = hatrain.torch.Job(model, opt)          # process group, DDP, registration
    for step in job.steps(total_steps):          # resumes where the job is
        with job.step():                         # a fault in here is recovered
            loss = loss_fn(job.model(batch(step)))  # job.model: the DDP module
            opt.zero_grad()
            loss.backward()
            with job.update():                   # the fences; commits on exit
                opt.step()

``Job`` moves the parameters, the module's buffers and the optimizer's state
into a few flat tensors, one per dtype and state key (the tensors become
views into them; nothing else changes for the script: see
``hatrain.torchstate``), and registers those with the host's agent, with
their data-parallel replication marked: each rank's snapshot then holds only
its slice, and a restore gathers the rest from the other ranks. What is not
a tensor travels in each snapshot's metadata block: the step, the torch,
Python and numpy RNG states, the optimizer's parameter groups, the
schedulers' and the gradient scaler's state, and ``job.extra`` (a JSON-able
dict, e.g. a data position). A scheduler's ``step()`` (and the scaler's
``update()``) belongs inside ``job.update()``, after ``optimizer.step()``.

On a fault (a collective that fails because a peer died, a pending
directive, a repaired memory error) the rank destroys its process group,
waits for the agent's directive, restores the snapshot of the step all
ranks return to, and builds the process group and the DDP module again
under the new epoch, in a store that outlives any rank, keys of one epoch
at a time (``hatrain.torchstore``). ``steps()``
then yields the step after that one again.

Without an agent (a plain ``torchrun``) the script runs as before: the
process group comes from ``env://`` and nothing is snapshotted.

A sharded job makes the process group first, then shards its model
(FSDP2's ``fully_shard``) or builds its ``ZeroRedundancyOptimizer``, then
registers::

    job = hatrain.torch.Job()
    mesh = init_device_mesh("cpu", (job.world,))
    ...fully_shard(block, mesh=mesh)...; fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    job.register(model, opt, schedulers=[sched])

Under the agent that first group is a stand-in (torch's ``fake`` backend:
the right size and rank, no data passed); the real one is made at
registration, or for a replacement once the agent says where the job
resumes, and FSDP's and the optimizer's references are pointed at it
(``_build``). What each rank snapshots for each layout: ``hatrain.torchstate``.

Any ``torch.optim.Optimizer`` whose state is tensors and numbers (Adam,
AdamW, SGD, Adagrad, RMSprop, Adamax, NAdam, RAdam...): its state is learnt
from its own ``step()``. Parameters and buffers of any floating or integer
dtype (bfloat16 and float16 included) are kept in their dtype.

The state is on the CPU (gloo) or on one accelerator per rank (CUDA with
NCCL, Ascend's NPU with HCCL through ``torch_npu``; ``device`` names it,
the backend follows): there it is copied to the host after each update on
a side stream, overlapped with the next step (``hatrain.torchstate``).
When the agent pauses the job, the process group is aborted, so that a
collective blocked on a dead or hung peer returns; with NCCL,
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is honoured where it is set, and set to
2 (abort the communicators, keep the process) where it is not.

A job may span hosts (its group meets in the agent's store). With
``--enable-elastic-training`` a DDP job shrinks when a host is lost with no
standby, and grows back when one is heard (``hatrain.torchelastic``);
``job.rank`` and ``job.world`` then give each rank's new place, from which
the script takes its share of the batch.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import json
import os
import random
import sys
import threading
import time
import traceback
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hatrain
from hatrain.drill import Plan
from hatrain import npu, torchckpt, torchgc, torchstore, torchtime
from hatrain.torchstate import State, b64, same_device, unb64

__all__ = ["Job", "Stopped"]

#: Bytes of the metadata block: the step, the RNG states and ``extra``.
META_LEN = 64 * 1024


class Stopped(SystemExit):
    """The agent stopped the job (or could not recover it): leave the loop."""

    def __init__(self, why: str):
        super().__init__(1)
        self.why = why

    def __str__(self) -> str:
        return self.why


class _Torn(Exception):
    """A memory error was repaired in the state: the step is thrown away."""


class _Abandoned(Exception):
    """The agent posted another directive while the process group was being
    built (a rank died meanwhile): the build is given up."""


def _shard(numel: int, world: int, index: int) -> tuple[int, int]:
    """This index's slice of a replicated part (hatrain_shared::shard)."""
    base, rem = divmod(numel, world)
    start = index * base + min(index, rem)
    return start, start + base + (1 if index < rem else 0)


class Job:
    """A data-parallel PyTorch job under hatrain (see the module's doc).

    ``schedulers`` (LR schedulers) and ``scaler`` (a ``torch.amp.GradScaler``)
    are saved with each snapshot through their ``state_dict()`` and restored
    with it. ``extra`` is a JSON-able dict saved and restored the same way
    (say, a data position the script keeps in it). ``ddp_kwargs`` are
    passed to ``DistributedDataParallel``; ``timeout`` (seconds) bounds a
    collective, and so how long a rank waits on a hung (not dead) peer.
    ``save`` (a folder) and ``save_interval``: the agent writes the job's
    checkpoints there (see ``torchckpt.layout``). ``load``: a job that
    starts afresh starts from the checkpoint there (``torchckpt.load``).
    ``device``: where the state is (the parameters' device; given, it must
    be theirs); ``backend``: the process group's (by default gloo on the
    CPU, nccl on CUDA, hccl on an NPU). ``stage``: whether the agent
    snapshots host copies of the state (by default, when it is on an
    accelerator; ``True`` on the CPU runs that path there); a staged state
    is copied to the host only on the steps that are snapshotted
    (``snapshot_interval``, the save steps). ``snapshot_window``: what the
    update does with a snapshot copy still running when it begins,
    ``"wait"`` for it or ``"skip"`` it (``"skip:N"``: wait after N skips in
    a row), as ``hatrain-train --snapshot-window``. ``gc``: ``"auto"``, or
    ``"planned"`` (``"planned:N"``) collections (``hatrain.torchgc``).
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        schedulers: list | None = None,
        scaler=None,
        device: str | torch.device | None = None,
        backend: str | None = None,
        stage: bool | None = None,
        snapshot_interval: int = 1,
        snapshot_window: str = "wait",
        timeout: float = 120.0,
        extra: dict | None = None,
        ddp_kwargs: dict | None = None,
        fault_wait: float = 30.0,
        save: str | os.PathLike | None = None,
        save_interval: int = 0,
        load: str | os.PathLike | None = None,
        gc: str = "auto",
    ):
        self._gc_every = torchgc.parse(gc)
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.save = os.path.abspath(save) if save is not None else None
        self.save_interval = save_interval
        self.load = os.fspath(load) if load is not None else None
        self.device = torch.device(device) if device is not None else None
        self._backend = backend
        self.stage = stage
        self.timeout = datetime.timedelta(seconds=timeout)
        self.snapshot_interval = snapshot_interval
        self.snapshot_window = snapshot_window
        self.extra = dict(extra or {})
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.fault_wait = fault_wait
        self.step_done = 0
        self.epoch = 0
        self.total = None
        self.module = self.model = None
        self.optimizer = None
        self.state = None
        self._current = None
        self._updated = None
        self._failed = False
        self._read_siblings = False
        self._built = False
        #: Whether the group was made before the model was registered.
        self._group_early = False
        #: ``ddp``, ``zero`` or ``fsdp`` once registered (``torchstate.layout``).
        self.layout = None
        self.standby_pid = None
        if model is None:
            if optimizer is not None or schedulers is not None or scaler is not None:
                raise TypeError("Job(): the optimizer, schedulers and scaler are given with the model (or to register())")
            # The group first: the script shards its model and builds its
            # optimizer over it, then registers them.
            self._take_rank()
            self._group_first()
        else:
            self.register(model, optimizer, schedulers=schedulers, scaler=scaler)

    def _take_rank(self) -> None:
        """A warm standby parks here until it is given a rank's place."""
        self.standby_pid = os.getpid() if hatrain.standby() is not None else None
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.plan = Plan(self.rank)

    def _group_first(self) -> None:
        """The process group a script shards its model over (FSDP2's device
        mesh, a ``ZeroRedundancyOptimizer``), before it registers them.
        Under the agent it is a stand-in of the same size and rank that
        passes no data: the real one is made at registration (or, for a
        replacement, once the agent says which step the job resumes), and
        FSDP's and the optimizer's references are pointed at it then."""
        if dist.is_initialized():
            raise hatrain.HatrainError("hatrain.torch.Job() makes the process group: it is made already")
        if self.under_agent_env():
            # The fake backend registers itself with its module.
            from torch.testing._internal.distributed import fake_pg

            dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=self.rank, world_size=self.world)
        elif "MASTER_ADDR" in os.environ:
            dist.init_process_group(self.backend, timeout=self.timeout)
        else:
            # A plain ``python script.py``: a group of one.
            dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1)
        self._group_early = True

    @property
    def backend(self) -> str:
        """The process group's backend: the one given, or the device's."""
        if self._backend is not None:
            return self._backend
        device = self.state.device if self.state is not None else self.device
        return {"cuda": "nccl", "npu": "hccl"}.get(device.type if device is not None else "cpu", "gloo")

    def register(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        schedulers: list | None = None,
        scaler=None,
    ) -> "Job":
        """Registers the model (a plain module for DDP and for a
        ``ZeroRedundancyOptimizer``, or one ``fully_shard`` sharded) and its
        optimizer with the agent, and builds the job's process group (and
        DDP module) when the job starts afresh. Returns the job."""
        if self.state is not None:
            raise hatrain.HatrainError("the job has a model registered already")
        self.module = self.model = model
        self.optimizer = optimizer
        early = self._group_early
        # The state is moved (and its pages touched) first: a warm standby
        # has done all its start-up when it parks here for a rank.
        # (Nothing is snapshotted without an agent: nothing is staged.)
        stage = self.stage if self.under_agent_env() else False
        self.state = State(model, optimizer, schedulers, scaler, world=self.world, stage=stage)
        if self.device is not None and not same_device(self.device, self.state.device):
            raise hatrain.HatrainError(
                f"the job's device is {self.device}, and its parameters are on {self.state.device}"
            )
        self.layout = self.state.layout
        if self.layout == "fsdp":
            from torch.distributed.fsdp import FSDPModule

            if not isinstance(model, FSDPModule):
                raise hatrain.HatrainError(
                    "an FSDP job registers its root module, on which fully_shard was called last "
                    f"(this {type(model).__name__} is not sharded itself)"
                )
        if self.layout != "ddp" and not early:
            raise hatrain.HatrainError(
                f"a {self.layout.upper()} job starts with `job = hatrain.torch.Job()` (the process group), "
                "then shards its model or builds its optimizer, then `job.register(model, optimizer)`"
            )
        self._has_buffers = self.state.has_buffers
        if self.under_agent_env():
            # What exists now (the imported modules, the model, the
            # optimizer) lives as long as the process: frozen, the cycle
            # collector passes over it, so that the collection a recovery
            # makes (``_recover``) scans what was made since, in
            # milliseconds, not torch's import (a tenth of a second, with
            # the interpreter's lock held). At exit they are thawed, so
            # that the interpreter's last collection frees them (extension
            # modules that count their objects, such as nanobind's, would
            # report them leaked).
            gc.freeze()
            atexit.register(gc.unfreeze)
        if not early:
            self._take_rank()
        if self.under_agent_env() and not self._one_host() and not os.environ.get("HATRAIN_AGENT_STORE"):
            raise hatrain.HatrainError(f"this job spans hosts (WORLD_SIZE {self.world}, LOCAL_WORLD_SIZE "
                                       f"{os.environ.get('LOCAL_WORLD_SIZE')}) and its agent names no store: "
                                       "run each host under a hatrain-agent of this version")
        rep = (self.world, self.rank) if self.world > 1 else None
        # What every rank of the data-parallel group holds the same (DDP's
        # parameters and optimizer state) is marked replicated; the rest
        # (module buffers, a sharded optimizer's state, FSDP's shards) is
        # the rank's own.
        parts = [f.part(rep) for f in self.state.flats]
        self.rt = hatrain.connect(
            self.rank,
            parts,
            META_LEN,
            snapshot_interval=self.snapshot_interval,
            # The drill's hook only when the plan has a fault there: it runs
            # Python on the commit thread.
            commit_halfway=(lambda s: self.plan.hit(s, "commit", self.rt)) if self.plan.has("commit") else None,
            checkpoint=torchckpt.layout(self),
            before_copy=self.state.ready if self.state.staged else None,
        )
        self.rt.set_snapshot_window(self.snapshot_window)
        self._gc = torchgc.Collections(self.rt, self._gc_every, lambda: self._current or self.step_done)
        self._overlap = torchtime.Overlap(self.rt)
        self.under_agent = self.rt.start[0] != "standalone"
        kind, epoch = self.rt.start
        # A replacement's state comes from shared memory: it awaits the
        # directive when the loop starts (``steps()``), so that the script
        # has set up what ``on_resume`` uses.
        self._awaiting = kind == "await"
        if not self._awaiting:
            self.epoch = epoch or 0
            self._build()
            if self.load is not None:
                self.step_done = torchckpt.load(self)
            self.state.stage_out()
            self.rt.commit(self.step_done, self.epoch, self._meta(self.step_done), of="start")
        return self

    # -- state ---------------------------------------------------------------

    def _meta(self, step: int) -> bytes:
        np_state = np.random.get_state()
        meta = {
            "step": step,
            "torch_rng": b64(torch.get_rng_state()),
            "device_rng": b64(self.state.rng_state()),
            "py_rng": random.getstate(),
            "np_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "extra": self.extra,
            "state": self.state.meta(),
        }
        raw = json.dumps(meta, separators=(",", ":")).encode()
        if len(raw) + 4 > META_LEN:
            raise ValueError(
                f"the snapshot's metadata (job.extra, the optimizer's groups, the schedulers) takes {len(raw)} bytes: "
                f"its block holds {META_LEN - 4}"
            )
        return len(raw).to_bytes(4, "little") + raw

    def _load_meta(self, block: bytes, step: int) -> None:
        n = int.from_bytes(block[:4], "little")
        try:
            meta = json.loads(block[4 : 4 + n])
        except ValueError as e:
            raise hatrain.HatrainError(f"the snapshot of step {step} has a malformed metadata block: {e}") from None
        if meta.get("step") != step:
            raise hatrain.HatrainError(f"the snapshot of step {step} holds step {meta.get('step')}")
        self._apply_meta(meta)

    def _apply_meta(self, meta: dict) -> None:
        """The RNG states, ``extra`` and the optimizer's, schedulers' and
        scaler's state of a snapshot's (or checkpoint's) metadata."""
        torch.set_rng_state(unb64(meta["torch_rng"]))
        if meta.get("device_rng") is not None:
            self.state.set_rng_state(unb64(meta["device_rng"]))
        v, state, gauss = meta["py_rng"]
        random.setstate((v, tuple(state), gauss))
        name, keys, pos, has_gauss, cached = meta["np_rng"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        self.extra = meta["extra"]
        self.state.load(meta["state"])

    # -- communicator ---------------------------------------------------------

    def _one_host(self) -> bool:
        """Every rank of the group runs on this host."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.world)) == self.world

    @staticmethod
    def under_agent_env() -> bool:
        return bool(os.environ.get("HATRAIN_AGENT_SOCKET"))

    def _store(self, epoch: int):
        return torchstore.for_epoch(epoch, self.timeout, self._one_host())

    def _build(self, gather: bool = False, exchange=None) -> None:
        """The process group and the DDP module of ``self.epoch``; with
        ``gather``, the restored slices are gathered in between (before DDP,
        whose construction broadcasts rank 0's parameters), or with
        ``exchange`` (a callable) a reshape's state moves. FSDP's and a
        ``ZeroRedundancyOptimizer``'s references to the group are pointed
        at the new one."""
        if self.under_agent:
            # The group a sharded job was set up on, a stand-in or the
            # last epoch's, goes first.
            self._destroy()
            store = self._store(self.epoch)
            if gather or exchange is not None:
                self._meet(store)
            if self.backend == "nccl":
                # NCCL's watchdog, on a failed or timed-out collective,
                # tears the process down by default (3): aborting the
                # communicators alone (2) lets the rank recover in place.
                # A value the user set is kept.
                os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            dist.init_process_group(
                self.backend,
                store=store,
                rank=self.rank,
                world_size=self.world,
                timeout=self.timeout,
            )
        elif self.world > 1 and not dist.is_initialized():
            dist.init_process_group(self.backend, timeout=self.timeout)
        self._built = True
        if exchange is not None:
            with torch.no_grad():
                exchange()
        elif gather:
            with torch.no_grad():
                self._gather()
        if self.layout == "fsdp":
            self._repoint_fsdp()
        elif self.world > 1 or self.under_agent:
            # DDP sums each gradient bucket around a ring, in an order set by
            # the bucket's layout, and by default lays its buckets out
            # again after the first iteration (in the order the gradients
            # became ready). A DDP module built after a recovery would then
            # sum its first step's gradients in another order than the run
            # without faults, and with more than two ranks the sum differs
            # in its last bits. With unused parameters looked for, DDP keeps
            # one layout from the start.
            kwargs = {"find_unused_parameters": True, **self.ddp_kwargs}
            if gather or exchange is not None:
                # After a restore every rank holds the same state already:
                # DDP's broadcast of rank 0's is skipped.
                kwargs["init_sync"] = False
            self.model = DDP(self.module, **kwargs)
            self._overlap.attach(self.module)
            if self.layout == "zero":
                self.optimizer.process_group = dist.group.WORLD
        # gloo's collectives fail when a peer's connection closes, and a
        # hung peer's at the group's timeout; an accelerator's (NCCL,
        # HCCL) are aborted when the agent pauses the job.
        self.rt.set_communicator(self.epoch, abort=self._abort if self.backend in ("nccl", "hccl") else None)

    @staticmethod
    def _abort() -> None:
        """Called from the runtime's watcher thread when the agent pauses
        the job: the process group's communicators are aborted, and a
        collective blocked on a dead or hung peer returns with an error
        (the step is then thrown away and the group built again)."""
        from torch.distributed import distributed_c10d

        abort = getattr(distributed_c10d, "_abort_process_group", None)
        if abort is not None and dist.is_initialized():
            abort()

    def _fsdp_groups(self) -> list:
        from torch.distributed.fsdp import FSDPModule

        return [
            g
            for m in self.module.modules()
            if isinstance(m, FSDPModule)
            for g in m._get_fsdp_state()._fsdp_param_groups
        ]

    def _fsdp_mesh_infos(self) -> list:
        return [
            info
            for g in self._fsdp_groups()
            for info in (g.mesh_info, g.post_forward_mesh_info)
            if info is not None
        ]

    def _repoint_fsdp(self) -> None:
        """FSDP2 keeps the process group of each parameter group's mesh at
        ``fully_shard``: each is pointed at the group the mesh now names
        (the default group, made again under this epoch). What a failed
        step left (unsharded parameters, a half-run forward or backward,
        collectives of the old group) is reset first."""
        for g in self._fsdp_groups():
            # The old group's collectives are not waited for: it is gone.
            g._all_gather_result = None
        for info in self._fsdp_mesh_infos():
            if hasattr(info, "shard_process_group"):
                info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
            if hasattr(info, "replicate_process_group"):
                info.replicate_process_group = info.mesh.get_group(info.replicate_mesh_dim)
        if self.module._get_fsdp_state()._is_root is not None:
            # (None: no forward ran yet, there is nothing to reset.)
            self.module.reset_iter_state()
        self._overlap.attach_fsdp(self._fsdp_groups())  # its collectives timed

    def _meet(self, store) -> None:
        """Waits at ``store`` until every rank of the epoch has arrived,
        watching for a new directive meanwhile: a rank that dies before it
        arrives would leave the others in the process group's own
        rendezvous, which no directive interrupts, until the agent's pause
        timeout. Raises ``_Abandoned`` when the agent posts one."""
        keys = [f"hatrain/arrived/{r}" for r in range(self.world)]
        store.set(keys[self.rank], "1")
        while not store.check(keys):
            if self.rt.directive_pending():
                raise _Abandoned()
            time.sleep(0.001)

    def _destroy(self) -> None:
        """Leaves the process group and lets go of the DDP module (whose
        gradient hooks on the parameters go when it is collected: see
        ``_recover``)."""
        self.model = self.module
        # FSDP and a ZeroRedundancyOptimizer hold the group: they let go of
        # it, so that it is closed now (its peers' collectives fail at
        # once, instead of waiting out their timeout on a group that still
        # exists).
        if self.layout == "fsdp":
            for info in self._fsdp_mesh_infos():
                for attr in ("shard_process_group", "replicate_process_group"):
                    if hasattr(info, attr):
                        setattr(info, attr, None)
        elif self.layout == "zero":
            self.optimizer.process_group = None
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    def _restore_siblings(self, step: int) -> bool:
        """Sliced snapshots: the other ranks' slices of each flat tensor,
        read from their snapshot stores when every rank of the job is on
        this host. False if one could not be, or the group spans hosts:
        ``_gather`` then sends the slices over the process group."""
        if not self.rt.sliced or self.world < 2:
            return True
        if not self._one_host():
            return False
        try:
            self.plan.hit(step, "restore", self.rt)
            for r in range(self.world):
                if r != self.rank:
                    self.rt.restore_sibling(step, r)
        except hatrain.HatrainError as e:
            print(
                f"rank {self.rank}: the other ranks' snapshots of step {step} could not be read here ({e}); "
                "gathering them over the process group",
                file=sys.stderr,
                flush=True,
            )
            return False
        return True

    def _gather(self) -> None:
        """Sliced snapshots: each rank restored its slice of each flat
        tensor and read the others' from their stores; if any rank could
        not, the owner of each slice broadcasts it."""
        if not self.rt.sliced or self.world < 2:
            return
        failed = torch.tensor([0 if self._read_siblings else 1], dtype=torch.int32, device=self.state.device)
        dist.all_reduce(failed)
        if not failed.item():
            return
        for f in self.state.flats:
            if not f.replicated:
                continue
            n = f.tensor.numel()
            for src in range(self.world):
                a, b = _shard(n, self.world, src)
                if b > a:
                    dist.broadcast(f.tensor[a:b], src=src)

    # -- recovery -------------------------------------------------------------

    def _recover(self) -> None:
        built, self._built = self._built, False
        self._destroy()
        # The old DDP module may be held in reference cycles (through the
        # failed step's traceback); it must be gone, with its hooks, before
        # the next one is built. Collecting takes a while in a big process:
        # it runs on a thread once this rank has told the agent it paused
        # (``await_directive`` lets go of the interpreter), so that the
        # agent decides meanwhile. A process that never built one (a
        # replacement, a standby) has nothing to collect. The objects that
        # existed when the job was set up are frozen (``__init__``): they
        # are not scanned.
        paused = threading.Event()

        def collect() -> None:
            paused.wait()
            gc.collect()

        collector = threading.Thread(target=collect, name="hatrain-gc") if built else None
        if collector is not None:
            collector.start()
        while True:
            paused.set()
            kind, step, epoch = self.rt.await_directive()
            if kind == "reshape":
                from hatrain import torchelastic

                if not torchelastic.take_place(self, step, epoch):
                    continue
                if collector is not None:
                    collector.join()
                self.on_resume(step, epoch)
                return
            if kind != "resume":
                raise Stopped(f"rank {self.rank}: the agent stopped the job ({kind})")
            with torch.no_grad():
                block = self.rt.restore(step)
                self._read_siblings = self._restore_siblings(step)
                # The state restored (what the other ranks' stores held
                # included) goes back onto the device, then is rebuilt.
                self.state.stage_in()
                self._load_meta(block, step)
            self.step_done, self.epoch = step, epoch
            if collector is not None:
                collector.join()
                collector = None
            if self.total is not None and step >= self.total and self._read_siblings:
                # Killed after its last step was sealed: the job's work is
                # done (the other ranks may have finished and left), so
                # this rank finishes too, with no process group to build
                # (its state is whole: the other ranks' slices were read).
                self.rt.set_communicator(epoch)
                print(f"rank {self.rank}: resumed at step {step}, the last, under epoch {epoch}", file=sys.stderr, flush=True)
                self.on_resume(step, epoch)
                return
            try:
                self._build(gather=True)
            except _Abandoned:
                print(f"rank {self.rank}: a rank failed while the job rebuilt under epoch {epoch}", file=sys.stderr, flush=True)
                self._destroy()
                continue
            except (RuntimeError, dist.DistError) as e:  # the new group could not be formed
                print(f"rank {self.rank}: rebuilding under epoch {epoch} failed: {e}; told the agent", file=sys.stderr)
                self._destroy()
                self.rt.rebuild_failed(epoch)
                continue
            print(f"rank {self.rank}: resumed at step {step} under epoch {epoch}", file=sys.stderr, flush=True)
            self.on_resume(step, epoch)
            return

    def on_resume(self, step: int, epoch: int) -> None:
        """Called after each recovery (a script may override it to log)."""

    def _is_fault(self, e: BaseException) -> bool:
        """Whether ``e`` comes from a fault the agent is handling: it posts a
        directive within ``fault_wait`` seconds of any rank's death."""
        if isinstance(e, _Torn):
            return True
        if not (self.under_agent and self.rt.recovers and isinstance(e, RuntimeError)):
            return False
        print(f"rank {self.rank}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; waiting for the agent", file=sys.stderr, flush=True)
        return self.rt.wait_pending(self.fault_wait)

    # -- the loop -------------------------------------------------------------

    def steps(self, total: int) -> Iterator[int]:
        """The steps to compute, from the one after the job's current step
        to ``total``; after a recovery, the step after the one resumed."""
        self.total = total
        if self._awaiting:
            self._awaiting = False
            self._recover()
        while self.step_done < total:
            if self.rt.directive_pending():
                self._recover()
                continue
            s = self.step_done + 1
            self._current, self._failed = s, False
            self._gc.before(s)
            self.rt.begin_step(s)
            self.plan.hit(s, "data", self.rt)
            yield s
            if self._failed:
                continue
            if self._updated != s:
                raise RuntimeError(f"step {s} ended without `with job.update():`")
            self.step_done = s
        self.rt.finish(self.step_done)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One step's body (the time before it is data loading): a fault
        inside is recovered (the step is thrown away, and ``steps()`` goes
        on from the step resumed)."""
        self.rt.batch_ready()
        self.plan.hit(self._current, "forward", self.rt)
        if self._has_buffers:
            # The forward pass writes the module's buffers (a norm's
            # statistics; DDP's broadcast of rank 0's): the last step's copy
            # of them must be done first (a staged state's copy to the
            # host, on the device; else the snapshot's).
            if self.state.staged:
                self.state.fence()
            else:
                self.rt.wait_commit()
        try:
            yield
            if self.rt.check_uce() is not None:
                raise _Torn()
        except Exception as e:
            uce = self._npu_uce(e)
            if uce is False or not (uce or self._is_fault(e)):
                raise
            self._failed = True
            # The failed step's frames hold the process group (a collective
            # called from Python, as FSDP's are, has it in its locals), and
            # the exception lives on until this block is left: with their
            # locals cleared, the group is closed when it is destroyed, and
            # the other ranks' collectives fail at once instead of at their
            # timeout.
            traceback.clear_frames(e.__traceback__)
            self._recover()

    def _npu_uce(self, e: BaseException) -> bool | None:
        """Whether ``e`` is an NPU's uncorrectable memory error (torch_npu's
        ``UCE ERROR``) that the step can be repaired from: then the agent is
        told, as for a SIGBUS, and every rank returns to the last consistent
        step. False for one that cannot (its address is outside torch_npu's
        allocator): the process must go, and is restarted. None for any
        other error."""
        if not (self.under_agent and self.rt.recovers and isinstance(e, RuntimeError)):
            return None
        kind = npu.classify(str(e))
        if kind is None or kind[0] != "uce":
            return None
        if not npu.repairable_uce(self.local_rank):
            return False
        self.rt.report_device_uce(kind[1])
        return True

    @contextlib.contextmanager
    def update(self) -> Iterator[None]:
        """The update fences around ``optimizer.step()``; on exit the step
        is complete and its snapshot is committed."""
        s = self._current
        # A drill's device error surfaces here, as an asynchronous device
        # error does at the update's first synchronisation.
        self.plan.surface()
        self._overlap.step_ends()
        self.rt.start_update()
        if self.rt.check_uce() is not None:
            raise _Torn()
        yield
        # State the optimizer made or replaced goes into its place; a staged state
        # is copied to the host (queued: the commit waits) when snapshotted.
        self.state.adopt()
        of = "last" if s == self.total else "step"
        if self.rt.snapshots(s, of):
            self.state.stage_out()
        self.plan.hit(s, "update", self.rt)
        if self.rt.check_uce() is not None:
            raise _Torn()
        self.rt.end_update(s)
        self.rt.commit(s, self.epoch, self._meta(s), of=of)
        self._updated = s

    def close(self) -> None:
        """Waits for the last snapshot and leaves the process group."""
        self.rt.wait_commit()
        self.plan.hit(self.step_done, "close", self.rt)
        self._gc.close()
        self._overlap.close()
        self._destroy()

    def model_digest(self) -> str:
        """A SHA-256 of the parameters' and the module buffers' bytes (what
        bit-identical means)."""
        import hashlib

        h = hashlib.sha256()
        for f in self.state.digest_parts():
            h.update(f.tensor.detach().cpu().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

