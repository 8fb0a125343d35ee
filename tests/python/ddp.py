"""A plain PyTorch DDP script, as users write them, with no hatrain import.

gloo and env:// initialisation, AdamW, a torch.save checkpoint every
--save-interval steps that it resumes from. Deterministic: the data of a
step is drawn from a generator seeded by (step, rank), so a run that
restarts from its checkpoint ends with the same parameters as one that
does not.

  --steps N --ckpt DIR --out FILE     train N steps; rank 0 writes the
                                      parameters' sha256 to FILE
  --fail-at S                         rank 1 exits 3 before step S, in the
                                      first attempt only
                                      (TORCHELASTIC_RESTART_COUNT == 0)
  --raise-at S                        rank 1 raises an exception before
                                      step S (recorded by torch's @record
                                      into TORCHELASTIC_ERROR_FILE)
  --env-out DIR                       each rank writes its environment to
                                      DIR/env.<rank>.json and exits
"""

import argparse
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--fail-at", type=int, default=None)
    p.add_argument("--raise-at", type=int, default=None)
    p.add_argument("--env-out", default=None)
    a = p.parse_args()

    if a.env_out:
        with open(os.path.join(a.env_out, f"env.{os.environ['RANK']}.json"), "w") as f:
            json.dump(dict(os.environ), f, indent=1, sort_keys=True)
        return 0

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    torch.use_deterministic_algorithms(True)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    start = 0
    path = os.path.join(a.ckpt, "ckpt.pt") if a.ckpt else None
    if path and os.path.exists(path):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        print(f"rank {rank}: resumed from step {start}", flush=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(start + 1, a.steps + 1):
        if a.raise_at == step and rank == 1:
            raise RuntimeError(f"planned failure before step {step}")
        if a.fail_at == step and rank == 1 and restart == 0:
            print(f"rank {rank}: failing before step {step}", flush=True)
            sys.exit(3)
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if path and step % a.save_interval == 0:
            if rank == 0:
                tmp = path + ".tmp"
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
                os.replace(tmp, path)
            dist.barrier()
    if rank == 0 and a.out:
        h = hashlib.sha256()
        for t in model.state_dict().values():
            h.update(t.detach().numpy().tobytes())
        with open(a.out, "w") as f:
            f.write(h.hexdigest() + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
