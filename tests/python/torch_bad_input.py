"""hatrain.torch refuses state it cannot keep, with an error naming it.

Run without an agent (the job is standalone: nothing is snapshotted, but
the state is taken as under one). Prints ``bad input ok`` at the end; any
failed check raises.
"""

import torch

import hatrain
import hatrain.torch
from hatrain.torchstate import State


def raises(exc, needle, f, *a, **kw):
    try:
        f(*a, **kw)
    except exc as e:
        assert needle in str(e), f"{exc.__name__} without {needle!r}: {e}"
        return
    raise AssertionError(f"expected {exc.__name__} ({needle!r})")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


class Noted(torch.optim.SGD):
    """An optimizer whose state holds a string."""

    def step(self, closure=None):
        super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["note"] = "not a number"


# An optimizer state that is neither a tensor nor a number.
m = model()
raises(TypeError, "'note' of parameter 0 is a str: hatrain.torch snapshots tensors and numbers",
       hatrain.torch.Job, m, Noted(m.parameters(), lr=0.1))

# A parameter on a device the job does not use.
meta = torch.nn.Linear(4, 4, device="meta")
raises(TypeError, "the parameters has a tensor on meta",
       hatrain.torch.Job, meta, torch.optim.AdamW(meta.parameters()))

# A job whose device is not its parameters', and a buffer on another
# device than the parameters.
m = model()
raises(hatrain.HatrainError, "the job's device is cuda, and its parameters are on cpu",
       hatrain.torch.Job, m, torch.optim.AdamW(m.parameters()), device="cuda")
m = model()
m.register_buffer("elsewhere", torch.zeros(3, device="meta"))
raises(TypeError, "the parameters' (cpu); the module's buffers has a tensor on meta",
       hatrain.torch.Job, m, torch.optim.AdamW(m.parameters()))

# An optimizer whose step needs a closure cannot be learnt from a step.
m = model()
raises(TypeError, "LBFGS.step() failed on it", hatrain.torch.Job, m, torch.optim.LBFGS(m.parameters()))

# A scheduler whose state is not JSON.
class Odd(torch.optim.lr_scheduler.StepLR):
    def state_dict(self):
        return {**super().state_dict(), "table": object()}


m = model()
opt = torch.optim.AdamW(m.parameters())
raises(TypeError, "keeps scheduler Odd in the snapshot's metadata as JSON, and it holds a value of type object",
       hatrain.torch.Job, m, opt, schedulers=[Odd(opt, step_size=2)])

# A model changed between registration and a restore.
m = model()
opt = torch.optim.AdamW(m.parameters())
state = State(m, opt)
saved = state.meta()
m[0].weight.data = torch.zeros(8, 4)
raises(hatrain.HatrainError, "parameter 0.weight is not the one the job registered", state.load, saved)
m[0].weight.data = torch.zeros(3, 3)
raises(hatrain.HatrainError, "the model changed since", state.load, saved)

# A model sharded in part (FSDP2 on a block, not on the root), and a
# sharded model registered without making the job's group first.
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
m = model()
fully_shard(m[0], mesh=mesh)
raises(TypeError, "some of the model's parameters are DTensors and some are not",
       State, m, torch.optim.AdamW(m.parameters()))
fully_shard(m, mesh=mesh)
raises(hatrain.HatrainError, "starts with `job = hatrain.torch.Job()`",
       hatrain.torch.Job, m, torch.optim.AdamW(m.parameters()))
dist.destroy_process_group()

print("bad input ok")
