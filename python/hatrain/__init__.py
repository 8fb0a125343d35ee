"""hatrain: keeps data-parallel training running through faults.

This package is the worker runtime for Python. A training process registers
its state (numpy arrays, or torch tensors through ``hatrain.torch``) with the
host's ``hatrain-agent``, which keeps a consistent copy of it in shared
memory and repairs faults around it: a crashed rank is restarted and
refilled from memory, an uncorrectable memory error in the state is repaired
by recomputing one step.

The training loop's side, in order (see ``Runtime``):

1. ``connect(rank, parts, meta_len)`` registers the state; ``start`` says
   whether to start fresh or, in a replacement process, to await the
   agent's directive and restore.
2. ``directive_pending()`` at each step boundary.
3. ``with rt.update(step):`` around the optimizer update: the state may
   change only inside it.
4. ``commit(step, epoch, meta)`` after it: the state is copied in the
   background while the next step computes.
5. ``await_directive()`` after a failed collective or a pending directive,
   then ``restore(step)``.

Without an agent (no ``HATRAIN_AGENT_SOCKET``) the runtime is inert and the
loop runs as a plain process.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from ._native import HatrainError, __version__
from ._native import Runtime as _Native
from ._native import standby as _standby

__all__ = ["HatrainError", "Part", "Runtime", "connect", "dtype_name", "standby", "__version__"]

_DTYPES = {
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint16): "U16",
    np.dtype(np.int16): "I16",
    np.dtype(np.float16): "F16",
    np.dtype(np.uint32): "U32",
    np.dtype(np.int32): "I32",
    np.dtype(np.float32): "F32",
    np.dtype(np.uint64): "U64",
    np.dtype(np.int64): "I64",
    np.dtype(np.float64): "F64",
}


def dtype_name(dtype: np.dtype) -> str:
    """The state map's name of a numpy dtype (safetensors' names)."""
    try:
        return _DTYPES[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be snapshotted") from None


@dataclass
class Part:
    """One registered buffer: ``array`` is snapshotted without a copy.

    ``replicated=(group, index)`` marks the same bytes on each of the
    ``group`` ranks of the data-parallel group, this rank being number
    ``index``: with sliced snapshots (the agent's default) each rank's
    snapshot then holds only its slice, and a restore is completed by
    gathering the slices (``Runtime.held``).
    """

    name: str
    array: np.ndarray
    replicated: tuple[int, int] | None = None
    #: The state map's element type when numpy has none for it (``"BF16"``:
    #: bfloat16 bits held in an ``int16`` or ``uint16`` array); of the
    #: array's own size.
    dtype: str | None = None

    def dtype_name(self) -> str:
        if self.dtype is None:
            return dtype_name(self.array.dtype)
        if self.dtype.upper() != "BF16" or self.array.dtype.itemsize != 2:
            raise ValueError(
                f"part {self.name!r}: dtype {self.dtype} is given only for bfloat16 bits in a 2-byte array, "
                f"not {self.array.dtype}"
            )
        return "BF16"


def _bytes_view(name: str, a: np.ndarray) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"part {name!r}: expected a numpy array, got {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError(f"part {name!r} is not C-contiguous: register its contiguous copy")
    if not a.flags.writeable:
        raise ValueError(f"part {name!r} is read-only: a restore writes it")
    # A view of the same memory: nothing is copied.
    return a.reshape(-1).view(np.uint8)


class Runtime:
    """One rank's runtime. Made by ``connect``."""

    def __init__(self, native: _Native, parts: Sequence[Part], meta_len: int):
        self._rt = native
        self.parts = list(parts)
        self.meta_len = meta_len

    # -- identity and start -------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rt.rank

    @property
    def start(self) -> tuple[str, int | None]:
        """``("standalone", None)``, ``("fresh", epoch)`` or ``("await", None)``."""
        return self._rt.start

    @property
    def recovers(self) -> bool:
        """Whether a failed collective should wait for the agent's recovery."""
        return self._rt.recovers

    @property
    def sliced(self) -> bool:
        return self._rt.sliced

    @property
    def snapshot_bytes(self) -> int:
        return self._rt.snapshot_bytes

    def held(self) -> list[tuple[int, int]]:
        """Per part, the elements ``(start, end)`` a restore fills."""
        return self._rt.held()

    def has_snapshots(self) -> bool:
        return self._rt.has_snapshots()

    # -- the step ----------------------------------------------------------

    def directive_pending(self) -> bool:
        return self._rt.directive_pending()

    def wait_pending(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for the agent to post a directive."""
        import time

        deadline = time.monotonic() + timeout
        while not self._rt.directive_pending():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True

    def begin_step(self, step: int) -> None:
        self._rt.begin_step(step)

    def batch_ready(self) -> None:
        """This step's batch is loaded: the time since ``begin_step`` was
        data loading, what follows is compute."""
        self._rt.batch_ready()

    def gc_collected(self, ns: int, step: int) -> None:
        """A garbage collection took ``ns`` in ``step``: timed into the
        control page (``hatrain.torchgc``)."""
        self._rt.gc_collected(ns, step)

    def collective_overlapped(self, ns: int) -> None:
        """This step's compute waited ``ns`` on collectives that ran beside
        it (DDP's all-reduce of its gradient buckets, inside the backward
        pass): counted as collective time, not compute
        (``hatrain.torchtime``)."""
        self._rt.collective_overlapped(ns)

    def report_device_uce(self, why: str, part: int | None = None) -> None:
        """An uncorrectable memory error the device reported (torch_npu's
        ``UCE ERROR``) rather than a SIGBUS: the live state is torn, and the
        step must be recomputed; the agent is told (as for a SIGBUS)."""
        self._rt.report_device_uce(why, part)

    def check_uce(self) -> tuple[int, int] | None:
        """``(part, byte offset)`` of a memory error repaired since the last
        check: the live state is torn, and the step must be recomputed."""
        return self._rt.check_uce()

    @contextlib.contextmanager
    def update(self, step: int) -> Iterator[None]:
        """The update fences: the state changes only inside. An exception
        inside leaves the state marked torn (as it is)."""
        self._rt.start_update()
        yield
        self._rt.end_update(step)

    def start_update(self) -> None:
        self._rt.start_update()

    def end_update(self, step: int) -> None:
        self._rt.end_update(step)

    def commit(self, step: int, epoch: int, meta: bytes = b"", of: str = "step") -> None:
        """Snapshots the state of ``step``. ``meta`` is padded with zeros to
        the metadata block's length. ``of``: ``"start"``, ``"step"``,
        ``"last"``."""
        if len(meta) > self.meta_len:
            raise ValueError(
                f"metadata of {len(meta)} bytes; the block holds {self.meta_len}"
            )
        self._rt.commit(step, epoch, bytes(meta).ljust(self.meta_len, b"\0"), of)

    def snapshots(self, step: int, of: str = "step") -> bool:
        """Whether ``commit(step, of=of)`` takes a snapshot (every
        ``snapshot_interval`` steps, and each step the agent saves)."""
        return self._rt.snapshots(step, of)

    def set_snapshot_window(self, window: str) -> None:
        """What the start-update fence does with a snapshot copy still
        running: ``"wait"``, ``"skip"`` or ``"skip:N"``."""
        self._rt.set_snapshot_window(window)

    def wait_commit(self) -> None:
        self._rt.wait_commit()

    def finish(self, step: int) -> bool:
        """The loop has finished at ``step``: whether its snapshot is sealed."""
        return self._rt.finish(step)

    # -- recovery ----------------------------------------------------------

    def await_directive(self) -> tuple[str, int | None, int | None]:
        """Parks until the agent says how to go on: ``("resume", step,
        epoch)``, ``("reshape", step, epoch)`` or ``("stop", None, None)``."""
        return self._rt.await_directive()

    @property
    def reshape_place(self) -> tuple[int, int] | None:
        """``(rank, world)``: the place the last ``("reshape", ...)``
        directive gave this rank in the resized group."""
        return self._rt.reshape_place

    def donations(self, step: int) -> list[tuple[int, str, bytes, list[tuple[int, int, bytes]]]]:
        """The lost ranks' state at ``step`` the agent says this rank brings
        to a reshape, read from their replicas: ``(rank, state_map_json,
        meta, parts)``, ``parts`` one ``(start, end, bytes)`` per registered
        array (elements it holds, and their bytes)."""
        return self._rt.donations(step)

    def reshape(self, epoch: int, step: int, parts: Sequence[Part], checkpoint: dict | None = None) -> None:
        """Takes the new place ``parts`` describe (their ``replicated``
        says it), under the reshape directive of ``epoch`` to ``step``:
        they replace the registered arrays, and the agent makes this rank's
        store anew for the new layout. ``parts`` hold the state of
        ``step``: commit it next, ``of="start"``."""
        views = [(_bytes_view(p.name, p.array), p.dtype_name()) for p in parts]
        smap = state_map(parts, self.meta_len, checkpoint)
        self._rt.reshape(epoch, step, json.dumps(smap), views)
        self.parts = list(parts)

    def restore(self, step: int) -> bytes:
        """Copies the snapshot of ``step`` into the registered arrays;
        returns its metadata block."""
        return self._rt.restore(step)

    def restore_sibling(self, step: int, rank: int, index: int | None = None) -> None:
        """Sliced snapshots of ranks on one host: copies the slices that
        rank ``rank`` (number ``index`` in the replication groups; its rank
        by default) holds in its snapshot of ``step`` into the registered
        arrays, from its store beside this rank's. After ``restore(step)``
        and this for every other rank, the replicated parts are whole
        without a collective. Nothing to do without sliced snapshots."""
        self._rt.restore_sibling(step, rank, rank if index is None else index)

    def set_communicator(self, epoch: int, abort=None) -> None:
        """The communicator of ``epoch`` is built; ``abort`` (a callable), if
        given, is called from another thread when the agent pauses the job."""
        self._rt.set_communicator(epoch, abort)

    def rebuild_failed(self, epoch: int, peer: int | None = None) -> None:
        self._rt.rebuild_failed(epoch, peer)

    def inject_uce(self, part: int, offset: int) -> None:
        """Injects an uncorrectable memory error at byte ``offset`` of part
        ``part`` (1 is the first registered array): for tests and drills."""
        self._rt.inject_uce(part, offset)


def standby() -> tuple[int, int, int] | None:
    """For a warm standby (the agent started it with ``HATRAIN_STANDBY=1``
    and no rank): parks until the agent gives it a failed rank's place,
    sets ``os.environ`` as a process started as that rank would have it
    (``RANK``, ``LOCAL_RANK``, ``ROLE_RANK``, ``HATRAIN_RESTART_COUNT``, the
    rank's ``TORCHELASTIC_ERROR_FILE``; no ``HATRAIN_STANDBY``), and returns
    ``(rank, local_rank, restarts)``. Returns ``None`` at once in any other
    process.

    Call it after the expensive start-up (imports, model build, buffer
    allocation), before anything that depends on the rank; then
    ``connect`` as that rank, which starts by awaiting the directive."""
    import os

    got = _standby()
    if got is None:
        return None
    place, env, cleared = got
    os.environ.update(env)
    os.environ.pop(cleared, None)
    return place


def state_map(parts: Sequence[Part], meta_len: int, checkpoint: dict | None = None) -> dict:
    """The state map of a metadata block of ``meta_len`` bytes and ``parts``,
    with ``checkpoint`` (a checkpoint layout, as the state map's
    ``CheckpointMap``: part 0 is the metadata block, part ``i + 1`` is
    ``parts[i]``) when the agent is to write this job's checkpoints."""
    out = [{"name": "meta", "dtype": "U8", "len": meta_len}]
    for p in parts:
        entry = {"name": p.name, "dtype": p.dtype_name(), "len": int(p.array.size)}
        if p.replicated is not None:
            group, index = p.replicated
            entry["sharing"] = {"replicated": {"group": int(group), "index": int(index)}}
        out.append(entry)
    smap = {"parts": out}
    if checkpoint is not None:
        smap["checkpoint"] = checkpoint
    return smap


def connect(
    rank: int,
    parts: Sequence[Part],
    meta_len: int = 0,
    snapshot_interval: int = 1,
    slots: int = 3,
    commit_halfway=None,
    checkpoint: dict | None = None,
    before_copy=None,
) -> Runtime:
    """Registers ``rank`` and its state with the host's agent (inert
    without one). ``parts`` are snapshotted without a copy; each commit also
    carries a metadata block of ``meta_len`` bytes (step, RNG states, the
    data position: whatever the loop needs to resume).

    ``slots`` is the fewest snapshot slots the agent is to keep for this
    rank (0: the agent's ``--snapshot-slots``). Three, the default, suit a
    loop that reduces its gradients before the update fences, as DDP does:
    a peer may complete step n+1 while this rank still copies step n, and
    the step all ranks hold in common is then n-1.

    ``commit_halfway(step)``, if given, is called from the commit thread
    when half of a snapshot is copied: a drill's hook for a fault in the
    middle of a commit. ``before_copy(step)``, if given, is called from the
    commit thread before a snapshot is copied out of ``parts``, and returns
    once they hold ``step``: the hook of a job that stages device state
    into them asynchronously (``hatrain.torchstate``).

    ``checkpoint``, if given, is the layout of this rank's checkpoints (see
    ``state_map``): the agent writes them from the snapshots, periodically,
    at the last step and as last words."""
    views = [(_bytes_view(p.name, p.array), p.dtype_name()) for p in parts]
    smap = state_map(parts, meta_len, checkpoint)
    native = _Native.connect(
        rank, json.dumps(smap), views, snapshot_interval, slots, commit_halfway, before_copy
    )
    return Runtime(native, parts, meta_len)
