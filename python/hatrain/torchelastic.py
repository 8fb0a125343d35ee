"""Elastic training for a PyTorch job (for :class:`hatrain.torch.Job`): a
reshape directive gives the rank a new place ``r′`` of ``W′`` in the
data-parallel group, at step ``s*``.

1. The rank brings its state to ``s*`` (restored from its snapshot; a rank
   joining a growing group brings nothing) and reads the lost ranks' state
   its agent holds in their replicas (the donations).
2. It builds the process group of ``W′`` at its new place, in the agent's
   store under the new epoch.
3. Every rank gathers every contribution: the elements of each replicated
   part each one holds (all of them, or its slice when snapshots are
   sliced) and each old rank's metadata block. Every element must come
   from some rank, and every contributor must be at ``s*``. Rank ``r′``
   takes the metadata block (RNG states, optimizer groups, schedulers,
   ``extra``) of old rank ``r′``: the one a fresh start at ``W′`` from a
   checkpoint of ``s*`` would read.
4. Only then does it take the new place with the runtime (a new state map
   and store, the replicated parts sliced for ``W′``) and commit ``s*`` as
   the first snapshot of the new layout.

Until step 4 the rank's store is untouched: a fault during the exchange
brings another directive, and the rank starts again from its snapshot.

A DDP job's state is the same on every rank, so a resize moves only what
a rank lacks. FSDP2 shards and a ``ZeroRedundancyOptimizer``'s partitions
are not re-sliced here: such a job refuses the directive, with the reason.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import hatrain

from . import torchckpt


class ReshapeError(hatrain.HatrainError):
    """A reshape that cannot be carried out with this state."""


def contribution(job, step: int) -> dict:
    """What this rank brings to the reshape to ``step``: the elements of
    each replicated part it holds, and each old rank's metadata block it
    has (its own, and the lost ranks' it brings)."""
    pieces: list[tuple[int, int, bytes]] = []
    metas: dict[int, bytes] = {}
    flats = job.state.flats
    holds = job.rt.has_snapshots()
    if holds:
        metas[job.rank] = bytes(job.rt.restore(step))
        job.state.stage_in()
        for i, ((a, b), f) in enumerate(zip(job.rt.held(), flats)):
            if f.replicated and b > a:
                pieces.append((i, a, _raw(f.registered()[a:b])))
    for lost, smap, meta, parts in job.rt.donations(step):
        metas[_place_of(smap, lost)] = bytes(meta)
        if len(parts) != len(flats):
            raise ReshapeError(f"rank {lost}'s replica holds {len(parts)} parts, this rank {len(flats)}")
        for i, ((a, b, data), f) in enumerate(zip(parts, flats)):
            if f.replicated and b > a:
                pieces.append((i, a, bytes(data)))
    return {"step": step, "holds": holds, "metas": metas, "pieces": pieces}


def exchange(job, mine: dict) -> bytes:
    """Every rank's contribution, over the new group: fills the replicated
    parts and returns the metadata block of this rank's new place."""
    # Unsliced, every rank that holds the state holds all of it: the
    # first such rank gives the replicated parts, the others only their
    # metadata.
    whole = not job.rt.sliced and bool(mine["holds"])
    holds: list = [None] * job.world
    dist.all_gather_object(holds, whole)
    giver = holds.index(True) if True in holds else None
    if giver is not None and giver != job.rank:
        mine = {**mine, "pieces": []}
    gathered: list = [None] * job.world
    dist.all_gather_object(gathered, mine)
    flats = job.state.flats
    have = [torch.zeros(f.registered().numel(), dtype=torch.bool) if f.replicated else None for f in flats]
    metas: dict[int, bytes] = {}
    for c in gathered:
        if c["metas"] and c["step"] != mine["step"]:
            raise ReshapeError(f"a rank brings step {c['step']} to the reshape to step {mine['step']}")
        metas.update(c["metas"])
        for i, start, data in c["pieces"]:
            if not (0 <= i < len(flats) and flats[i].replicated):
                raise ReshapeError(f"a piece of part {i}, which is not a replicated part of this state")
            t = flats[i].registered()
            n = len(data) // t.element_size()
            if start < 0 or start + n > t.numel() or n * t.element_size() != len(data):
                raise ReshapeError(f"a piece of {flats[i].name} at element {start} does not fit it")
            t[start : start + n].copy_(_tensor(data, t.dtype))
            have[i][start : start + n] = True
    for f, seen in zip(flats, have):
        if seen is not None and not bool(seen.all()):
            missing = int((~seen).nonzero()[0])
            raise ReshapeError(
                f"reshape to {job.world} ranks at step {mine['step']}: element {missing} of {f.name} "
                "came from no rank (a lost rank's replica is missing)"
            )
    # A place the old group did not have (it grew) takes rank 0's, as a
    # start from a checkpoint of fewer ranks does (``torchckpt.load``).
    meta = metas.get(job.rank, metas.get(0))
    if meta is None:
        raise ReshapeError(
            f"reshape to {job.world} ranks at step {mine['step']}: no rank brings the metadata of rank {job.rank} or 0"
        )
    job.state.stage_in()
    return meta


def take_place(job, step: int, epoch: int) -> bool:
    """The reshape directive to ``step`` under ``epoch``: carried out, or
    False when the rank must wait for the agent's next directive (a rank
    failed meanwhile, or the group could not be formed: the agent is told).
    A state that cannot be reshaped raises ``ReshapeError``."""
    from .torch import _Abandoned

    try:
        reshape(job, step, epoch, job.rt.reshape_place)
    except ReshapeError:
        raise
    except _Abandoned:
        print(f"rank {job.rank}: a rank failed while the job reshaped under epoch {epoch}", file=sys.stderr, flush=True)
        job._destroy()
        return False
    except (RuntimeError, dist.DistError) as e:  # the new group could not be formed
        print(f"rank {job.rank}: reshaping under epoch {epoch} failed: {e}; told the agent", file=sys.stderr)
        job._destroy()
        job.rt.rebuild_failed(epoch)
        return False
    job._read_siblings = True
    return True


def reshape(job, step: int, epoch: int, place: tuple[int, int]) -> None:
    """Carries out ``Reshape { epoch, step, place }`` (see the module's
    doc). On an error the rank keeps its old place."""
    rank, world = place
    if job.layout != "ddp":
        raise ReshapeError(
            f"elastic resizing of a {job.layout} job's state is not supported: each rank's shard would "
            "have to be sliced again (run it with a warm standby or a standby host instead)"
        )
    if world < 1 or not 0 <= rank < world:
        raise ReshapeError(f"cannot take place {rank} of {world}")
    mine = contribution(job, step)
    # The new group meets under the new epoch's keys: the old group's
    # (the lost ranks' addresses among them) are never read.
    old = (job.rank, job.world, job.epoch)
    job.rank, job.world, job.epoch = rank, world, epoch
    try:
        block: list[bytes] = []
        job._build(exchange=lambda: block.append(exchange(job, mine)))
    except BaseException:
        job.rank, job.world, job.epoch = old
        raise
    job._load_meta(block[0], step)
    parts = [f.part((world, rank) if world > 1 else None) for f in job.state.flats]
    job.rt.reshape(epoch, step, parts, checkpoint=torchckpt.layout(job))
    job.rt.set_communicator(epoch, abort=job._abort if job.backend in ("nccl", "hccl") else None)
    job.step_done = step
    job.state.stage_out()
    job.rt.commit(step, epoch, job._meta(step), of="start")
    print(f"rank {rank}: reshaped to {world} ranks at step {step} under epoch {epoch}", file=sys.stderr, flush=True)


def _place_of(state_map: str, rank: int) -> int:
    """The place in the group whose layout ``state_map`` (JSON) is: the
    index of its replicated parts; ``rank`` when it has none."""
    for p in json.loads(state_map)["parts"]:
        rep = p.get("sharing", {})
        if isinstance(rep, dict) and "replicated" in rep:
            return int(rep["replicated"]["index"])
    return rank


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _tensor(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
