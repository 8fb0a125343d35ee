"""A small, deterministic PyTorch DDP job (an MLP with dropout, AdamW or
another optimizer, an optional LR schedule, float32 or bfloat16, gloo, CPU)
protected by hatrain.

    hatrain-agent launch --nproc-per-node 2 --enable-high-availability \\
        --enable-worker-reboot -- python examples/torch_ddp.py --steps 50

It learns a fixed random teacher network from batches drawn per step and
per rank from a seeded generator, so a run is a pure function of its flags:
a run with faults ends with the same parameters, bit for bit, as one
without. Rank 0 (or each rank) logs JSON lines (``--log-jsonl``): ``start`` (with the
state's parts and the snapshot's size), ``step`` (loss, step time, learning rate),
``resume`` and ``final`` (the SHA-256 of the parameters and the module's buffers).

Under a plain ``torchrun`` it runs too (no snapshots); ``--checkpoint DIR
--checkpoint-interval N`` then saves every N steps with ``torch.save`` and
resumes from the newest save at start, the way a torchrun job recovers.
Under the agent, ``--save DIR --save-interval N``: the agent writes the
job's checkpoints (``hatrain.torch.Job(save=...)``).
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import hatrain.torch

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=50)
ap.add_argument("--hidden", type=int, default=256)
ap.add_argument("--layers", type=int, default=3)
ap.add_argument("--inputs", type=int, default=64)
ap.add_argument("--batch", type=int, default=32, help="per rank")
ap.add_argument("--lr", type=float, default=1e-3)
ap.add_argument("--seed", type=int, default=1234)
ap.add_argument("--batchnorm", action="store_true", help="a BatchNorm after each layer (module buffers)")
ap.add_argument("--log-jsonl", default=None, help="JSON-lines log of rank 0 (of each rank if it has {rank})")
ap.add_argument("--step-ms", type=float, default=0, help="extra compute time per step")
ap.add_argument("--checkpoint", default=None, help="(plain torchrun) save folder")
ap.add_argument("--checkpoint-interval", type=int, default=10)
ap.add_argument("--save", default=None, help="(under the agent) the agent's checkpoint folder")
ap.add_argument("--save-interval", type=int, default=10)
ap.add_argument("--plain", action="store_true", help="no hatrain: torch.distributed alone")
ap.add_argument("--gc", default="auto", help="hatrain.torch.Job(gc=...): auto, planned or planned:N")
ap.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS := {
    "adamw": lambda p, lr: torch.optim.AdamW(p, lr=lr),
    "adam-amsgrad": lambda p, lr: torch.optim.Adam(p, lr=lr, amsgrad=True, weight_decay=1e-4),
    "sgd-nesterov": lambda p, lr: torch.optim.SGD(p, lr=lr * 10, momentum=0.9, nesterov=True),
    "adagrad": lambda p, lr: torch.optim.Adagrad(p, lr=lr * 10, lr_decay=1e-3),
    "rmsprop": lambda p, lr: torch.optim.RMSprop(p, lr=lr, momentum=0.5, centered=True),
    "adamax": lambda p, lr: torch.optim.Adamax(p, lr=lr),
    "nadam": lambda p, lr: torch.optim.NAdam(p, lr=lr, decoupled_weight_decay=True, weight_decay=1e-4),
    "radam": lambda p, lr: torch.optim.RAdam(p, lr=lr),
}))
ap.add_argument("--scheduler", default="none", choices=["none", "cosine", "step"],
                help="an LR schedule, stepped after each update")
ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                help="the parameters' dtype")
args = ap.parse_args()

torch.set_num_threads(1)
torch.manual_seed(args.seed)
# A warm standby has no rank until hatrain.torch.Job gives it one.
rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
t_start = time.time()


class MLP(torch.nn.Module):
    def __init__(self, inputs, hidden, layers, batchnorm):
        super().__init__()
        dims = [inputs] + [hidden] * layers
        self.body = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        norm = torch.nn.BatchNorm1d if batchnorm else lambda n: torch.nn.Identity()
        self.norms = torch.nn.ModuleList(norm(b) for b in dims[1:])
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x):
        for layer, norm in zip(self.body, self.norms):
            x = F.dropout(torch.relu(norm(layer(x))), p=0.1, training=self.training)
        return self.head(x)


model = MLP(args.inputs, args.hidden, args.layers, args.batchnorm).to(getattr(torch, args.dtype))
teacher = torch.randn(args.inputs, generator=torch.Generator().manual_seed(args.seed + 1))
opt = OPTIMIZERS[args.optimizer](model.parameters(), args.lr)
if args.scheduler == "cosine":
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
elif args.scheduler == "step":
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
else:
    sched = None


def batch(step):
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1_009 + rank)
    x = torch.randn(args.batch, args.inputs, generator=g)
    dtype = getattr(torch, args.dtype)
    return x.to(dtype), torch.sin(x @ teacher).unsqueeze(1).to(dtype)


log = None


def open_log():
    global log
    if args.log_jsonl and ("{rank}" in args.log_jsonl or rank == 0):
        log = open(args.log_jsonl.format(rank=rank), "a", buffering=1)


def say(**event):
    if log:
        event["unix_s"] = time.time()
        log.write(json.dumps(event) + "\n")


def train_step(ddp, step):
    x, y = batch(step)
    loss = F.mse_loss(ddp(x), y)
    opt.zero_grad()
    loss.backward()
    return loss


if args.plain:
    # torch.distributed alone, with periodic torch.save checkpoints.
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    open_log()
    start = 0
    path = lambda s: os.path.join(args.checkpoint, f"step-{s}.rank-{rank}.pt")  # noqa: E731
    if args.checkpoint:
        os.makedirs(args.checkpoint, exist_ok=True)
        done = sorted(
            int(f.split("-")[1].split(".")[0]) for f in os.listdir(args.checkpoint) if f.endswith(f".rank-{rank}.pt")
        )
        if done:
            start = done[-1]
            ck = torch.load(path(start), weights_only=False)
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            torch.set_rng_state(ck["rng"])
    ddp = DDP(model)
    say(event="start", world_size=world, start_step=start, restart_count=os.environ.get("TORCHELASTIC_RESTART_COUNT"), pid=os.getpid(), since_start_s=time.time() - t_start)
    for step in range(start + 1, args.steps + 1):
        t0 = time.time()
        loss = train_step(ddp, step)
        opt.step()
        if sched:
            sched.step()
        if args.step_ms:
            time.sleep(args.step_ms / 1000)
        if args.checkpoint and step % args.checkpoint_interval == 0:
            tmp = path(step) + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()}, tmp)
            os.replace(tmp, path(step))
        say(event="step", step=step, loss=loss.item(), step_time_s=time.time() - t0)
    dist.destroy_process_group()
    sys.exit(0)


class Job(hatrain.torch.Job):
    def on_resume(self, step, epoch):
        say(event="resume", step=step, epoch=epoch, pid=os.getpid())


job = Job(model, opt, schedulers=[sched] if sched else None, save=args.save, save_interval=args.save_interval,
          gc=args.gc)
rank = job.rank
open_log()
say(event="start", world_size=world, start_step=job.step_done, pid=os.getpid(), standby=job.standby_pid is not None,
    role_rank=os.environ.get("ROLE_RANK"), error_file=os.environ.get("TORCHELASTIC_ERROR_FILE"),
    restart_count=os.environ.get("HATRAIN_RESTART_COUNT"), since_start_s=time.time() - t_start,
    parts=[[p.name, p.dtype_name(), int(p.array.size)] for p in job.rt.parts], snapshot_bytes=job.rt.snapshot_bytes)
for step in job.steps(args.steps):
    t0 = time.time()
    with job.step():
        loss = train_step(job.model, step)
        if args.step_ms:
            time.sleep(args.step_ms / 1000)
        with job.update():
            opt.step()
            if sched:
                sched.step()
        say(event="step", step=step, loss=loss.item(), step_time_s=time.time() - t0, epoch=job.epoch,
            lr=opt.param_groups[0]["lr"])
job.close()
digest = job.model_digest()
say(event="final", step=job.step_done, model_sha256=digest)
if rank == 0:
    print(f"done: step {job.step_done} | parameters and buffers sha256 {digest}")
