"""A PyTorch job's state as the few flat parts hatrain snapshots.

What is snapshotted is taken from the objects' own structure, never from a
list of known optimizers:

- the parameters (the optimizer's, then any other of the module's), one
  flat tensor per dtype; each parameter becomes a view into it;
- the module's buffers (a norm's statistics, its counters), one flat
  tensor per dtype;
- the optimizer's per-parameter state, as its own ``step()`` makes it: one
  flat tensor per state key and dtype (``exp_avg``, ``momentum_buffer``,
  ``sum``, ``step``...), each state tensor becoming a view into it, and one
  float64 tensor per key whose values are numbers;
- in the metadata (JSON): which parameters have state yet (an optimizer
  makes it on its first step), the hyperparameters of each parameter group
  (a scheduler changes them), and the ``state_dict()`` of each scheduler
  and of a gradient scaler.

The layout is learnt once, at the start, by a step of a copy of the
optimizer on copies of the parameters with zero gradients (the real
parameters and optimizer are not touched). After each ``optimizer.step()``
(:meth:`State.adopt`) a state tensor the optimizer made or replaced is
copied into its place and the view put back, and numbers are written out;
a restore rebuilds the optimizer's state from the views (:meth:`State.load`).

Each tensor keeps its dtype everywhere: a bfloat16 tensor is 2 bytes an
element in the snapshot and in the checkpoint (``BF16``).

The state lives on one device, the parameters'. On the CPU its flat
tensors are what the agent snapshots, with no copy. On an accelerator
(CUDA, Ascend's NPU through ``torch_npu``: one code path, through the
device's torch module) each flat tensor has a host copy, page-locked where
the runtime allows, and that is what is registered: after each update
(:meth:`State.stage_out`) the device state is copied into it on a side
stream, queued behind the update, and the copy's event is recorded; the
runtime's commit thread waits for that event (:meth:`State.ready`, its
``before_copy`` hook) before it copies the host copy into the rank's slot.
The training loop never waits for either copy: the next forward and
backward run meanwhile (they do not change the state), and the next update
begins once the commit is done (the runtime's start-update fence). A
restore fills the host copies, which are copied back (:meth:`State.stage_in`).
``stage=True`` runs that path on the CPU (a copy made in the loop, with no
stream): the tests exercise it so.

Three data-parallel layouts (:func:`layout`):

- ``ddp``: every rank holds the same parameters and optimizer state; both
  are marked replicated, and each rank's snapshot holds a slice of them.
- ``zero`` (``torch.distributed.optim.ZeroRedundancyOptimizer``): the
  parameters are replicated as with DDP; the optimizer state is that of
  the rank's own parameters (its local optimizer's), the rank's own.
- ``fsdp`` (FSDP2, ``fully_shard``): the parameters and the optimizer
  state are DTensor shards, each rank's own. FSDP keeps the parameters'
  shards in its own buffers, so they are copied into their part after
  each update and back after a restore; the optimizer's state tensors are
  made DTensors over views of their parts, with no copy.
"""

from __future__ import annotations

import base64
import copy
import json
from dataclasses import dataclass, field

import torch

import hatrain

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = ()

#: The dtype each torch dtype is seen as by numpy, and the state map's name.
_DTYPES = {
    torch.float32: (torch.float32, "F32"),
    torch.float64: (torch.float64, "F64"),
    torch.float16: (torch.float16, "F16"),
    torch.bfloat16: (torch.int16, "BF16"),
    torch.int64: (torch.int64, "I64"),
    torch.int32: (torch.int32, "I32"),
    torch.int16: (torch.int16, "I16"),
    torch.int8: (torch.int8, "I8"),
    torch.uint8: (torch.uint8, "U8"),
    torch.bool: (torch.uint8, "U8"),
}

#: Number types an optimizer's state may hold besides tensors.
_NUMBERS = {"int": int, "float": float, "bool": bool}


def _short(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _zero(optimizer) -> bool:
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:
        return False
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def layout(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """How a job's state is spread over its ranks: ``fsdp`` (the
    parameters are DTensor shards: FSDP2), ``zero`` (a
    ``ZeroRedundancyOptimizer``: each rank updates its own parameters) or
    ``ddp`` (every rank holds all of it)."""
    dtensors = [isinstance(p, DTensor) for p in module.parameters()]
    if any(dtensors):
        if not all(dtensors):
            raise TypeError(
                "some of the model's parameters are DTensors and some are not: hatrain.torch takes a model "
                "sharded whole (fully_shard on its root)"
            )
        if _zero(optimizer):
            raise TypeError("a ZeroRedundancyOptimizer over FSDP-sharded parameters: choose one of the two")
        return "fsdp"
    return "zero" if _zero(optimizer) else "ddp"


@dataclass
class Flat:
    """One part: a flat tensor holding several tensors' values."""

    name: str
    tensor: torch.Tensor
    #: Replicated on every rank of the data-parallel group (DDP's
    #: parameters and optimizer state), or this rank's own (buffers, a
    #: sharded optimizer's state).
    replicated: bool
    #: The host copy registered in ``tensor``'s place when it is staged
    #: (see the module's doc); None: ``tensor`` is registered itself.
    host: torch.Tensor | None = None

    def registered(self) -> torch.Tensor:
        """The CPU tensor the agent snapshots and a restore fills."""
        return self.tensor if self.host is None else self.host

    def part(self, rep: tuple[int, int] | None) -> hatrain.Part:
        t = self.registered()
        as_, name = _DTYPES[t.dtype]
        array = t.view(as_).numpy()
        dtype = "BF16" if name == "BF16" else None
        return hatrain.Part(self.name, array, replicated=rep if self.replicated else None, dtype=dtype)


def device_of(what: str, tensors) -> torch.device:
    """The one device ``tensors`` (a job's parameters) are on: the CPU or an
    accelerator with a torch device module (CUDA, Ascend's NPU...)."""
    devices = {}
    for t in tensors:
        devices.setdefault(_local(t).device, t)
    if len(devices) > 1:
        raise TypeError(
            f"hatrain.torch keeps a job's state on one device; {what} are on {', '.join(map(str, devices))}"
        )
    device = next(iter(devices), torch.device("cpu"))
    if device.type == "cpu":
        return device
    try:
        module = torch.get_device_module(device.type) if device.type != "meta" else None
    except (RuntimeError, AttributeError):
        module = None
    if module is None or not all(hasattr(module, a) for a in ("Stream", "Event", "current_stream")):
        raise TypeError(
            f"hatrain.torch snapshots tensors on the CPU or an accelerator with streams and events; "
            f"{what} has a tensor on {device}"
        )
    return device


def flatten(
    name: str, what: str, tensors: list[torch.Tensor], replicated: bool, device: torch.device
) -> tuple[Flat, list[torch.Tensor]]:
    """One flat tensor named ``name`` on ``device`` holding ``tensors``'
    values (all of one dtype), and views of it shaped like each."""
    dtype = tensors[0].dtype
    tensors = [_local(t) for t in tensors]
    for t in tensors:
        if t.device != device:
            raise TypeError(
                f"hatrain.torch keeps a job's state on one device, the parameters' ({device}); "
                f"{what} has a tensor on {t.device}"
            )
        if t.dtype not in _DTYPES:
            raise TypeError(f"hatrain.torch cannot snapshot {what} of {t.dtype}")
    total = sum(t.numel() for t in tensors)
    flat = torch.empty(max(total, 1), dtype=dtype, device=device)
    views, at = [], 0
    for t in tensors:
        v = flat[at : at + t.numel()].view(t.shape)
        v.copy_(t.detach())
        views.append(v)
        at += t.numel()
    return Flat(name, flat, replicated), views


def _by_dtype(items: list, dtype_of) -> dict[torch.dtype, list]:
    out: dict[torch.dtype, list] = {}
    for it in items:
        out.setdefault(dtype_of(it), []).append(it)
    return out


def _probe(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[dict]:
    """Per parameter, the optimizer's state after one step as its own
    ``step()`` makes it: key to ``(dtype, shape)`` for a tensor, or the
    number type's name. Taken from a copy, with zero gradients: the real
    parameters and optimizer are not touched."""
    memo = {id(p): torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in params}
    try:
        probe = copy.deepcopy(optimizer, memo)
    except Exception as e:  # noqa: BLE001 -- any failure is reported as what it is
        raise TypeError(f"hatrain.torch cannot copy {type(optimizer).__name__} to learn its state: {e}") from None
    copies = [memo[id(p)] for p in params]
    for c in copies:
        c.grad = torch.zeros_like(c)
    try:
        probe.step()
    except Exception as e:  # noqa: BLE001
        raise TypeError(
            f"hatrain.torch learns an optimizer's state from one step of a copy; "
            f"{type(optimizer).__name__}.step() failed on it: {e}"
        ) from None
    out = []
    for i, c in enumerate(copies):
        kinds = {}
        for k, v in probe.state.get(c, {}).items():
            if isinstance(v, DTensor):
                if v.shape != c.shape or v.placements != c.placements:
                    raise TypeError(
                        f"{type(optimizer).__name__}'s state {k!r} of parameter {i} is a DTensor of another "
                        f"shape or sharding than its parameter ({tuple(v.shape)} {v.placements}, the parameter "
                        f"{tuple(c.shape)} {c.placements}): hatrain.torch takes state sharded as its parameter"
                    )
                kinds[k] = (v.dtype, tuple(v.to_local().shape), True)
            elif isinstance(v, torch.Tensor):
                kinds[k] = (v.dtype, tuple(v.shape), False)
            elif type(v).__name__ in _NUMBERS:
                kinds[k] = type(v).__name__
            else:
                raise TypeError(
                    f"{type(optimizer).__name__}'s state {k!r} of parameter {i} is a {type(v).__name__}: "
                    "hatrain.torch snapshots tensors and numbers"
                )
        out.append(kinds)
    return out


def _json(what: str, value):
    """``value`` as JSON, or a clear error naming ``what``."""

    def plain(v):
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            return {"tensor": v.item()}
        if isinstance(v, tuple):
            return list(v)
        raise TypeError(f"a value of type {type(v).__name__}")

    try:
        return json.loads(json.dumps(value, default=plain))
    except (TypeError, ValueError) as e:
        raise TypeError(f"hatrain.torch keeps {what} in the snapshot's metadata as JSON, and it holds {e}") from None


def _restore_value(old, new):
    """A JSON value put back in the type it had."""
    if isinstance(old, torch.Tensor) and isinstance(new, dict) and "tensor" in new:
        old.fill_(new["tensor"])
        return old
    if isinstance(old, tuple) and isinstance(new, list):
        return tuple(new)
    return new


@dataclass
class _Key:
    """One state key's tensors of one dtype: the flat part, and per
    parameter index its view (for DTensor state, of this rank's shard)."""

    key: str
    views: dict[int, torch.Tensor] = field(default_factory=dict)
    dtensor: bool = False
    flat: Flat | None = None


class State:
    """The parameters, buffers and optimizer state of a job as flat parts
    (see the module's doc). ``world``: the ranks of the data-parallel group
    (what is replicated is marked so when there are several). ``stage``:
    whether the registered parts are host copies of the state (None: when
    it is on an accelerator)."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        schedulers: list | None = None,
        scaler=None,
        world: int = 1,
        stage: bool | None = None,
    ):
        self.module = module
        self.optimizer = optimizer
        self.schedulers = list(schedulers or [])
        self.scaler = scaler
        self.layout = layout(module, optimizer)
        self.flats: list[Flat] = []
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        seen = {id(p) for p in opt_params}
        if len(seen) != len(opt_params):
            raise ValueError("a parameter is in the optimizer twice")
        # Parameters the optimizer does not update (frozen, or a low
        # precision copy of master weights it keeps) are state too.
        others = [p for p in module.parameters() if id(p) not in seen]
        self.params = opt_params + others
        names = {id(p): n for n, p in module.named_parameters()}
        self.names = [names.get(id(p), f"optimizer parameter {i}") for i, p in enumerate(self.params)]
        self.device = device_of("the parameters", self.params)
        # FSDP keeps each parameter's shard in a buffer of its own: the
        # shards are copied into their part (``stage``), not made views.
        staged = self.layout == "fsdp"
        replicated = world > 1 and not staged
        self._param_views: list[torch.Tensor] = [None] * len(self.params)
        self._param_flat: list[Flat] = [None] * len(self.params)
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dtype, idx in _by_dtype(list(range(len(self.params))), lambda i: self.params[i].dtype).items():
            flat, views = flatten(
                f"params.{_short(dtype)}",
                "the parameters",
                [self.params[i].data for i in idx],
                replicated,
                self.device,
            )
            for i, v in zip(idx, views):
                if staged:
                    self._staged.append((self.params[i], v))
                else:
                    self.params[i].data = v
                self._param_views[i] = v
                self._param_flat[i] = flat
            self.flats.append(flat)
        buffer_names = {id(b): n for n, b in module.named_buffers(remove_duplicate=False)}
        owned = [(m, n, b) for m in module.modules() for n, b in m._buffers.items() if b is not None]
        self.has_buffers = bool(owned)
        #: Per buffer: its name in the module's state dict, flat part, view.
        self._buffers: list[tuple[str, Flat, torch.Tensor]] = []
        for dtype, mine in _by_dtype(owned, lambda o: o[2].dtype).items():
            flat, views = flatten(
                f"buffers.{_short(dtype)}", "the module's buffers", [b for _, _, b in mine], False, self.device
            )
            for (m, n, b), v in zip(mine, views):
                self._buffers.append((buffer_names.get(id(b), n), flat, v))
                m._buffers[n] = v
            self.flats.append(flat)
        # A ZeroRedundancyOptimizer's state is its local optimizer's, of
        # this rank's own parameters; its parameter groups (which the
        # schedulers change) are its own, copied to the local ones at each
        # step.
        inner = optimizer.optim if self.layout == "zero" else optimizer
        inner_params = [p for g in inner.param_groups for p in g["params"]]
        self._take_optimizer(inner, inner_params, world > 1 and self.layout == "ddp")
        self.staged = self.device.type != "cpu" if stage is None else bool(stage)
        self._module = None if self.device.type == "cpu" else torch.get_device_module(self.device.type)
        #: The side stream of the copies to the host, and the last copy's event.
        self._stream = self._module.Stream(self.device) if self.staged and self._module is not None else None
        self._copied = None
        if self.staged:
            for f in self.flats:
                if f.tensor.device == self.device:
                    f.host = _host_copy(f.tensor)

    def _take_optimizer(self, inner: torch.optim.Optimizer, params: list[torch.Tensor], replicated: bool) -> None:
        self._inner = inner
        kinds = _probe(inner, params)
        self._tensors: list[_Key] = []
        # Per number key: its float64 part, the indices holding it, the type.
        self._numbers: dict[str, tuple[torch.Tensor, dict[int, int], str]] = {}
        keys = []
        for kind in kinds:
            keys.extend(k for k in kind if k not in keys)
        for key in keys:
            tensor_idx = [i for i, k in enumerate(kinds) if isinstance(k.get(key), tuple)]
            number_idx = [i for i, k in enumerate(kinds) if isinstance(k.get(key), str)]
            groups = _by_dtype(tensor_idx, lambda i: (kinds[i][key][0], kinds[i][key][2]))
            for (dtype, dtensor), idx in groups.items():
                zeros = [torch.zeros(kinds[i][key][1], dtype=dtype, device=self.device) for i in idx]
                name = f"state.{key}.{_short(dtype)}"
                flat, views = flatten(name, f"optimizer state {key!r}", zeros, replicated, self.device)
                self.flats.append(flat)
                self._tensors.append(_Key(key, dict(zip(idx, views)), dtensor, flat))
            if number_idx:
                types = {kinds[i][key] for i in number_idx}
                if len(types) != 1:
                    raise TypeError(f"optimizer state {key!r} is of several number types: {sorted(types)}")
                flat = torch.zeros(len(number_idx), dtype=torch.float64)
                self.flats.append(Flat(f"state.{key}.number", flat, replicated))
                self._numbers[key] = (flat, {i: j for j, i in enumerate(number_idx)}, types.pop())
        names = {id(p): n for p, n in zip(self.params, self.names)}
        self._opt_params = params
        self._opt_names = [names.get(id(p), f"optimizer parameter {i}") for i, p in enumerate(params)]
        # State the optimizer has already (loaded, or made at its
        # construction, as Adagrad's) moves into place now.
        self.adopt()

    def _held(self, key: _Key, i: int, view: torch.Tensor) -> torch.Tensor:
        """What the optimizer's state holds for ``view``: the view itself,
        or for a parameter sharded by FSDP a DTensor over it (no copy)."""
        if not key.dtensor:
            return view
        p = self._opt_params[i]
        return DTensor.from_local(view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

    # -- after each update ------------------------------------------------------

    def adopt(self) -> None:
        """After ``optimizer.step()``: a state tensor it made or replaced is
        copied into its place and the view put back; numbers are written
        out; FSDP's parameter shards are copied into their part; which
        parameters have which state is noted for the metadata. Raises on
        state whose shape or dtype differs from the layout."""
        state = self._inner.state
        have: dict[str, list[int]] = {key: [] for key in self._keys()}
        for k in self._tensors:
            for i, view in k.views.items():
                st = state.get(self._opt_params[i])
                cur = None if st is None else st.get(k.key)
                if cur is not None:
                    have[k.key].append(i)
                if cur is None:
                    continue
                local = _local(cur) if isinstance(cur, torch.Tensor) else cur
                if local is view or (isinstance(local, torch.Tensor) and local.data_ptr() == view.data_ptr()):
                    continue
                if (
                    not isinstance(cur, torch.Tensor)
                    or isinstance(cur, DTensor) != k.dtensor
                    or local.shape != view.shape
                    or local.dtype != view.dtype
                ):
                    raise hatrain.HatrainError(
                        f"optimizer state {k.key!r} of {self._opt_names[i]} changed its kind "
                        f"({_describe(cur)}, registered {_describe(view)})"
                    )
                view.copy_(local)
                st[k.key] = self._held(k, i, view)
        for key, (flat, at, _) in self._numbers.items():
            for i, j in at.items():
                st = state.get(self._opt_params[i])
                if st is not None and key in st:
                    flat[j] = float(st[key])
                    have[key].append(i)
        with torch.no_grad():
            for p, view in self._staged:
                view.copy_(_local(p))
        n = len(self._opt_params)
        self._present = {key: "all" if len(idx) == n else sorted(idx) for key, idx in have.items()}

    # -- the host copies (a staged state) -------------------------------------------

    def stage_out(self) -> None:
        """After an update (and before the commit that snapshots it): the
        state is copied into the host copies. On an accelerator the copies
        are queued on the side stream behind the work queued so far (the
        update) and do not wait; :meth:`ready` waits for them."""
        if not self.staged:
            return
        if self._stream is None:
            for f in self.flats:
                if f.host is not None:
                    f.host.copy_(f.tensor)
            return
        self._stream.wait_stream(self._module.current_stream(self.device))
        with self._module.stream(self._stream):
            for f in self.flats:
                if f.host is not None:
                    f.host.copy_(f.tensor, non_blocking=True)
            event = self._module.Event()
            event.record(self._stream)
        self._copied = event

    def ready(self, step: int) -> None:
        """The commit thread's hook (``before_copy``): returns once the host
        copies hold the state last staged out (of ``step``)."""
        event = self._copied
        if event is not None:
            # (Waits with the interpreter's lock let go.)
            event.synchronize()

    def fence(self) -> None:
        """Before the forward pass writes the module's buffers (a norm's
        statistics): the device's work queued from now on waits for the
        copy to the host, and the loop does not."""
        if self._copied is not None:
            self._module.current_stream(self.device).wait_event(self._copied)

    def stage_in(self) -> None:
        """After a restore filled the host copies: they are copied back
        onto the device."""
        if not self.staged:
            return
        self._copied = None
        for f in self.flats:
            if f.host is not None:
                f.tensor.copy_(f.host)
        if self._module is not None:
            self._module.synchronize(self.device)

    def rng_state(self) -> torch.Tensor | None:
        """The device's random number generator's state (None on the CPU,
        whose is the job's torch RNG state)."""
        return None if self._module is None else self._module.get_rng_state(self.device)

    def set_rng_state(self, state: torch.Tensor) -> None:
        if self._module is not None:
            self._module.set_rng_state(state, self.device)

    def meta(self) -> dict:
        """What is not a tensor: which parameters have which state, the
        groups' hyperparameters, the schedulers' and the scaler's state."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        out = {
            "present": self._present,
            "groups": _json("the optimizer's parameter groups", groups),
            "schedulers": [_json(f"scheduler {type(s).__name__}", s.state_dict()) for s in self.schedulers],
        }
        if self.scaler is not None:
            out["scaler"] = _json("the gradient scaler", self.scaler.state_dict())
        return out

    def _keys(self) -> list[str]:
        keys = [k.key for k in self._tensors]
        keys.extend(self._numbers)
        return list(dict.fromkeys(keys))

    # -- after a restore --------------------------------------------------------

    def check_params(self) -> None:
        """Every parameter is still the one the job registered (for
        FSDP's, of the same shard shape): a model changed since cannot be
        restored into."""
        current = {id(p) for p in self.module.parameters()}
        for i, p in enumerate(self.params):
            v = self._param_views[i]
            local = _local(p.data)
            same = local.shape == v.shape and local.dtype == v.dtype and id(p) in current
            if self._staged:
                same = same and isinstance(p, DTensor)
            else:
                same = same and local.data_ptr() == v.data_ptr()
            if not same:
                raise hatrain.HatrainError(
                    f"parameter {self.names[i]} is not the one the job registered "
                    f"({_describe(p.data)}, registered {_describe(v)}): the model changed since, "
                    "and its state cannot be restored into it"
                )

    def load(self, meta: dict) -> None:
        """The parts were restored: FSDP's parameter shards are copied back
        and the optimizer's state is rebuilt from them and ``meta``, as it
        was when they were snapshotted."""
        self.check_params()
        with torch.no_grad():
            for p, view in self._staged:
                _local(p).copy_(view)
        present = meta["present"]
        self._present = dict(present)
        have: dict[int, dict] = {}
        for k in self._tensors:
            mark = present.get(k.key, [])
            for i, view in k.views.items():
                if mark == "all" or i in mark:
                    have.setdefault(i, {})[k.key] = self._held(k, i, view)
        for key, (flat, at, kind) in self._numbers.items():
            mark = present.get(key, [])
            for i, j in at.items():
                if mark == "all" or i in mark:
                    have.setdefault(i, {})[key] = _NUMBERS[kind](flat[j].item())
        state = self._inner.state
        for i, p in enumerate(self._opt_params):
            if i in have:
                state[p] = have[i]
            else:
                state.pop(p, None)
        groups = meta["groups"]
        if len(groups) != len(self.optimizer.param_groups):
            raise hatrain.HatrainError(
                f"the snapshot has {len(groups)} parameter groups, the optimizer {len(self.optimizer.param_groups)}"
            )
        for g, saved in zip(self.optimizer.param_groups, groups):
            for k, v in saved.items():
                g[k] = _restore_value(g.get(k), v)
        for s, saved in zip(self.schedulers, meta["schedulers"]):
            s.load_state_dict(saved)
        if self.scaler is not None and "scaler" in meta:
            self.scaler.load_state_dict(meta["scaler"])

    # -- checkpoints ----------------------------------------------------------------

    def checkpoint_tensors(self, world: int, rank: int) -> list[dict]:
        """The tensors this rank writes into its checkpoint file, as the
        state map's ``TensorMap``s (part ``i + 1`` is ``flats[i]``), named as
        ``torch.distributed.checkpoint`` names a state dict
        ``{"model": model_state_dict, "optim": optimizer_state_dict}`` of
        ``get_state_dict``: ``model.<name>``, ``optim.state.<name>.<key>``.
        A DTensor's shard is written by each rank with its place in the
        whole (``offsets``); every other tensor once, by one rank (a
        replicated one is read from the ranks' slices). Numbers in the
        optimizer's state are not tensors and are not written."""
        index = {id(f): i + 1 for i, f in enumerate(self.flats)}
        out: list[dict] = []
        turn = [0]

        def add(name: str, flat: Flat, view: torch.Tensor, shard=None, mine: bool = False) -> None:
            start = (view.data_ptr() - flat.tensor.data_ptr()) // flat.tensor.element_size()
            entry = {
                "name": name,
                "part": index[id(flat)],
                "range": {"start": start, "end": start + view.numel()},
                "shape": list(view.shape),
            }
            if shard is not None:
                entry["offsets"] = _global_offsets(shard)
            elif not mine:
                # A whole tensor every rank holds: one writes it, in turn.
                mine = turn[0] % world == rank
                turn[0] += 1
            if shard is not None or mine:
                out.append(entry)

        for i, p in enumerate(self.params):
            add(f"model.{self.names[i]}", self._param_flat[i], self._param_views[i], shard=_dtensor(p))
        for name, flat, view in self._buffers:
            add(f"model.{name}", flat, view)
        for k in self._tensors:
            for i, view in k.views.items():
                p = self._opt_params[i]
                name = f"optim.state.{self._opt_names[i]}.{k.key}"
                # A ZeroRedundancyOptimizer's rank holds its own parameters'
                # state alone: it writes it.
                add(name, k.flat, view, shard=_dtensor(p) if k.dtensor else None, mine=self.layout == "zero")
        return out

    # -- views --------------------------------------------------------------------

    def digest_parts(self) -> list[Flat]:
        """The parts that are the model (parameters and buffers; with FSDP,
        this rank's shards)."""
        return [f for f in self.flats if f.name.startswith(("params.", "buffers."))]


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor like ``t`` holding its values: page-locked when ``t`` is
    on an accelerator whose runtime allows it (the copies from it then run
    without the CPU), pageable otherwise."""
    if t.device.type != "cpu":
        try:
            return t.to("cpu").pin_memory()
        except RuntimeError:
            pass
    return t.detach().to("cpu", copy=True)


def _dtensor(t):
    return t if isinstance(t, DTensor) else None


def _global_offsets(t) -> list[int]:
    """Where a DTensor's shard on this rank lies in the whole tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return [int(o) for o in offsets]


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)} on {t.device}"
    return type(t).__name__


def b64(t: torch.Tensor | None) -> str | None:
    """A tensor's bytes in base64 (an RNG state in the metadata block)."""
    return None if t is None else base64.b64encode(t.cpu().numpy().tobytes()).decode()


def unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` (as given, its index perhaps left out) names ``b``."""
    return a.type == b.type and (a.index is None or a.index == b.index)
