"""A GPT-style language model trained data-parallel, protected by hatrain.

A decoder-only transformer (GPT-2 blocks: pre-norm causal self-attention
and a GELU MLP; tied input and output embeddings), bfloat16 autocast over
float32 weights, AdamW with a linear warm-up and a cosine decay, gradient
clipping, over gloo, sharded with FSDP2 (``fully_shard`` on each block and
the root: each rank holds a shard of the parameters and of the AdamW
moments); ``--zero`` for DDP with a ``ZeroRedundancyOptimizer`` (each rank
updates and keeps the moments of its own parameters), ``--ddp`` for plain
DDP. The tokens are synthetic, drawn per step and per rank from a seeded
generator, so a run is a pure function of its flags: a run with faults
ends with the same parameters, bit for bit, as one without.

    torchrun --nproc-per-node 2 examples/torch_gpt.py --steps 100
    hatrain-agent launch --nproc-per-node 2 --enable-high-availability \\
        --enable-worker-reboot -- python examples/torch_gpt.py --steps 100

Under torchrun it runs without hatrain (``--save DIR --save-interval N``
then saves with ``torch.distributed.checkpoint`` and resumes from the
newest save at start, the way a torchrun job recovers); under the agent,
``hatrain.torch`` snapshots every step and recovers a fault in seconds, and
with ``--save DIR`` the agent writes the checkpoints, from shared memory.
``--load DIR`` starts from a checkpoint the agent wrote (its save folder's
newest, or an iteration's ``dcp`` folder), at any world size: under
torchrun read by ``torch.distributed.checkpoint`` alone (no hatrain), under
the agent by ``hatrain.torch``.
``--device cuda`` (or ``npu``) trains on the rank's accelerator (its
``LOCAL_RANK``-th, modulo the devices there are) over NCCL (HCCL; or
``--backend``); hatrain then copies the state to the
host after each update, overlapped with the next step. ``--stage`` runs
that path on the CPU. ``--deterministic`` asks torch for deterministic
kernels (on a GPU, what makes two runs bit-identical).
``--global-batch N`` (instead of ``--batch``) keeps the step's batch
whatever the group's size: with ``--ddp`` under the agent's
``--enable-elastic-training``, a job that loses a host goes on with fewer
ranks, each taking its share.
``--log-jsonl FILE`` (``{rank}`` in it: one per rank) logs ``start``,
``step`` (loss, learning rate, step time), ``resume`` and ``final`` (the
SHA-256 of the full parameters and of the full AdamW state).
"""

import argparse
import hashlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=100)
ap.add_argument("--layers", type=int, default=6)
ap.add_argument("--width", type=int, default=384)
ap.add_argument("--heads", type=int, default=6)
ap.add_argument("--vocab", type=int, default=4096)
ap.add_argument("--seq", type=int, default=128)
ap.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
ap.add_argument("--global-batch", type=int, default=None,
                help="sequences per step over all ranks, instead of --batch: each rank takes its share, which "
                     "follows the group's size when an elastic job is resized")
ap.add_argument("--lr", type=float, default=3e-4)
ap.add_argument("--warmup", type=int, default=10, help="steps of linear warm-up")
ap.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
ap.add_argument("--no-autocast", action="store_true", help="float32 compute (bfloat16 autocast by default)")
ap.add_argument("--seed", type=int, default=1234)
how = ap.add_mutually_exclusive_group()
how.add_argument("--zero", action="store_true", help="DDP with a ZeroRedundancyOptimizer (FSDP2 by default)")
how.add_argument("--ddp", action="store_true", help="plain DDP (FSDP2 by default)")
ap.add_argument("--save", default=None, help="checkpoint folder (torchrun: DCP saves; under the agent: the agent's)")
ap.add_argument("--save-interval", type=int, default=10)
ap.add_argument("--load", default=None, help="start from a checkpoint the agent wrote")
ap.add_argument("--device", default="cpu", help="cpu, cuda or npu (the LOCAL_RANK-th, modulo the devices there are)")
ap.add_argument("--backend", default=None, help="the process group's (by default gloo on cpu, nccl on cuda, hccl on npu)")
ap.add_argument("--snapshot-interval", type=int, default=1, help="under the agent: snapshot every N steps")
ap.add_argument("--stage", action="store_true", help="under the agent: stage the state through host copies on the CPU too")
ap.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
ap.add_argument("--log-jsonl", default=None, help="JSON-lines log of rank 0 (of each rank if it has {rank})")
args = ap.parse_args()
if args.zero and (args.save or args.load) and not os.environ.get("HATRAIN_AGENT_SOCKET"):
    ap.error("--save and --load (torch.distributed.checkpoint) take FSDP2 or DDP here, not --zero")

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
torch.manual_seed(args.seed)
if args.deterministic:
    torch.use_deterministic_algorithms(True)
if args.device == "cpu":
    device = torch.device("cpu")
else:
    if args.device == "npu":
        import torch_npu  # noqa: F401 -- registers the device
    module = torch.get_device_module(args.device)
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0")) % module.device_count())
    module.set_device(device)
backend = args.backend or {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")
under_agent = bool(os.environ.get("HATRAIN_AGENT_SOCKET"))
t_start = time.time()


class Block(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab, seq, width, heads, layers):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Embedding(seq, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(width)
        for m in self.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        # The output projection is the token embedding (tied).
        return self.ln(x) @ self.tok.weight.t()


rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
fsdp = not (args.zero or args.ddp)
# The model is built (seeded: the same on every rank) before anything that
# needs the rank: a warm standby has it built when it is given one.
model = GPT(args.vocab, args.seq, args.width, args.heads, args.layers).to(device)
if under_agent:
    import hatrain.torch

    class Job(hatrain.torch.Job):
        def on_resume(self, step, epoch):
            say(event="resume", step=step, epoch=epoch, pid=os.getpid())

    # The process group next (FSDP2's mesh and ZeRO are made over it); a
    # warm standby parks here until it has a rank.
    job = Job(save=args.save, save_interval=args.save_interval, load=args.load, device=device, backend=backend,
              stage=True if args.stage else None, snapshot_interval=args.snapshot_interval)
    rank = job.rank
elif world > 1 or fsdp:
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

if fsdp:
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
adamw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
if args.zero:
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
else:
    opt = torch.optim.AdamW(model.parameters(), **adamw)


def schedule(step):
    """Linear warm-up to the peak, then a cosine decay to a tenth of it."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    done = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))


sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)


def place():
    """This rank's place in the data-parallel group, ``(rank, world)``: an
    elastic job's changes when the group is resized."""
    return (job.rank, job.world) if under_agent else (rank, world)


def tokens(step):
    """The sequences of this rank at ``step``: a seeded draw with a
    learnable rule (each token follows from the two before it). With
    ``--global-batch`` the step's whole batch is drawn and each rank takes
    its share, so that the run does not depend on the group's size."""
    r, w = place()
    if args.global_batch is None:
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1_009 + r)
        x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    else:
        if args.global_batch % w:
            raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of the group's {w} ranks")
        n = args.global_batch // w
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1_009)
        x = torch.randint(0, args.vocab, (args.global_batch, args.seq + 1), generator=g)[r * n : (r + 1) * n]
    x[:, 2:] = (x[:, 1:-1] * 31 + x[:, :-2] * 7) % args.vocab
    x = x.to(device)
    return x[:, :-1], x[:, 1:]


def train_step(net, step):
    x, y = tokens(step)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not args.no_autocast):
        logits = net(x)
    loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), y.reshape(-1))
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    return loss


log = None


def open_log():
    global log
    if args.log_jsonl and ("{rank}" in args.log_jsonl or rank == 0):
        log = open(args.log_jsonl.format(rank=rank), "a", buffering=1)


def say(**event):
    if log:
        event["unix_s"] = time.time()
        log.write(json.dumps(event) + "\n")


def digest():
    """The SHA-256 of the full parameters (FSDP's shards gathered: every
    rank calls it)."""
    h = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if fsdp else p
        h.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def optim_digest():
    """The SHA-256 of the full optimizer state tensors (every rank calls
    it); None with a ZeroRedundancyOptimizer (each rank holds a part)."""
    if args.zero:
        return None
    h = hashlib.sha256()
    for p in model.parameters():
        st = opt.state.get(p, {})
        for k in sorted(st):
            v = st[k]
            if isinstance(v, torch.Tensor):
                full = v.full_tensor() if hasattr(v, "full_tensor") else v
                h.update(full.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_agent_checkpoint(path):
    """Loads a checkpoint the agent wrote (its save folder's newest
    iteration, or an iteration's ``dcp`` folder) with
    ``torch.distributed.checkpoint`` alone; returns its step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    if os.path.exists(tracker):
        with open(tracker) as f:
            path = os.path.join(path, f"iter_{int(f.read().strip()):07d}", "dcp")
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": {"state": osd["state"]}}, storage_reader=HuggingFaceStorageReader(path))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    # What is not a tensor: in each rank's meta.json beside.
    with open(os.path.join(path, "rank_00000-meta.json")) as f:
        meta = json.load(f)["torch"]
    for g, saved in zip(opt.param_groups, meta["state"]["groups"]):
        for k, v in saved.items():
            g[k] = tuple(v) if isinstance(v, list) else v
    sched.load_state_dict(meta["state"]["schedulers"][0])
    return meta["step"]


def dcp_state():
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "sched": sched.state_dict()}


if not under_agent:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    open_log()
    start = 0
    if args.save and os.path.isdir(args.save):
        done = sorted(int(d.split("-")[1]) for d in os.listdir(args.save) if d.startswith("step-"))
        if done:
            start = done[-1]
            state = dcp_state()
            dcp.load(state, checkpoint_id=os.path.join(args.save, f"step-{start}"))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            sched.load_state_dict(state["sched"])
    if args.load and start == 0:
        start = load_agent_checkpoint(args.load)
    net = DDP(model) if world > 1 and not fsdp else model
    say(event="start", world_size=world, start_step=start, pid=os.getpid(), since_start_s=time.time() - t_start)
    for step in range(start + 1, args.steps + 1):
        t0 = time.time()
        loss = train_step(net, step)
        opt.step()
        sched.step()
        if args.save and step % args.save_interval == 0:
            dcp.save(dcp_state(), checkpoint_id=os.path.join(args.save, f"step-{step}"))
        say(event="step", step=step, loss=loss.item(), lr=sched.get_last_lr()[0], step_time_s=time.time() - t0)
    say(event="final", step=max(start, args.steps), model_sha256=digest(), optim_sha256=optim_digest())
    if dist.is_initialized():
        dist.destroy_process_group()
    # The work is done and logged: the process ends without the
    # interpreter's teardown, in which one of torch's C++ threads now and
    # then aborted the process (`terminate called without an active
    # exception`, about one run in twenty-five at 3 ranks here).
    if log:
        log.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

job.register(model, opt, schedulers=[sched])
open_log()
say(event="start", world_size=world, start_step=job.step_done, pid=os.getpid(), standby=job.standby_pid is not None,
    since_start_s=time.time() - t_start, snapshot_bytes=job.rt.snapshot_bytes, staged=job.state.staged,
    parts=[[p.name, p.dtype_name(), int(p.array.size)] for p in job.rt.parts])
for step in job.steps(args.steps):
    t0 = time.time()
    with job.step():
        loss = train_step(job.model, step)
        with job.update():
            opt.step()
            sched.step()
    say(event="step", step=step, loss=loss.item(), lr=sched.get_last_lr()[0], step_time_s=time.time() - t0,
        epoch=job.epoch, world_size=job.world)
final, final_optim = digest(), optim_digest()
job.close()
say(event="final", step=job.step_done, model_sha256=final, optim_sha256=final_optim)
if rank == 0:
    print(f"done: step {job.step_done} | parameters sha256 {final}")
