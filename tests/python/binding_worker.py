"""A small numpy workload on the hatrain binding, run under hatrain-agent.

Its state is two registered numpy arrays (``w``: float32, ``count``: int64)
and the step in the metadata block; each step changes both inside the
update fences and commits. ``--fault`` hurts the first incarnation of rank
``--fault-rank`` at step ``--at``:

- ``kill-update``: SIGKILL inside the update fences (the live state torn);
- ``kill-commit``: SIGKILL when half of the step's snapshot is copied
  (from the runtime's commit thread);
- ``uce``: an uncorrectable memory error injected into ``w`` after the
  step's compute: the process lives, the step is recomputed.

At the end it writes ``final.<rank>.json`` (the step and a hash of its
state) and logs each event to ``log.<rank>.jsonl`` in ``--out``.
"""

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import numpy as np

import hatrain

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--elems", type=int, default=1 << 22)
ap.add_argument("--fault", default="none", choices=["none", "kill-update", "kill-commit", "uce"])
ap.add_argument("--at", type=int, default=5)
ap.add_argument("--fault-rank", type=int, default=0)
ap.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
ap.add_argument("--out", required=True)
args = ap.parse_args()

rank = int(os.environ.get("RANK", "0"))
first = os.environ.get("HATRAIN_RESTART_COUNT", "0") == "0"
hurt = first and rank == args.fault_rank
log = open(os.path.join(args.out, f"log.{rank}.jsonl"), "a", buffering=1)


def say(**event):
    log.write(json.dumps(event) + "\n")


def publish(step):
    """This rank has completed ``step`` (the lockstep's half of a collective)."""
    tmp = os.path.join(args.out, f".at.{rank}")
    with open(tmp, "w") as f:
        f.write(str(step))
    os.replace(tmp, os.path.join(args.out, f"at.{rank}"))


def peers_at_least(step):
    """Waits until every rank has completed ``step - 1``, as a data-parallel
    step waits on its collective; False if the agent paused the job first."""
    while True:
        done = True
        for r in range(args.world):
            try:
                with open(os.path.join(args.out, f"at.{r}")) as f:
                    done &= int(f.read() or -1) >= step - 1
            except FileNotFoundError:
                done = False
        if done:
            return True
        if rt.directive_pending():
            return False
        time.sleep(0.001)


w = np.zeros(args.elems, dtype=np.float32)
count = np.zeros(4, dtype=np.int64)
def halfway(step):
    if hurt and step == args.at and args.fault == "kill-commit":
        say(event="killed", step=step, halfway=True)
        os.kill(os.getpid(), signal.SIGKILL)


rt = hatrain.connect(
    rank,
    [hatrain.Part("w", w), hatrain.Part("count", count)],
    meta_len=8,
    commit_halfway=halfway,
)
kind, epoch = rt.start
say(event="start", kind=kind, pid=os.getpid())


def recover():
    kind, step, e = rt.await_directive()
    if kind != "resume":
        say(event="stopped", directive=kind)
        sys.exit(1)
    meta = rt.restore(step)
    got = int.from_bytes(meta[:8], "little")
    assert got == step, f"the snapshot of step {step} holds step {got}"
    say(event="resume", step=step, epoch=e)
    return step, e


step = 0
if kind == "await":
    step, epoch = recover()
    publish(step)
else:
    epoch = epoch or 0
    rt.commit(0, epoch, (0).to_bytes(8, "little"), of="start")
    publish(0)

while step < args.steps:
    if rt.directive_pending():
        step, epoch = recover()
        publish(step)
        continue
    s = step + 1
    if not peers_at_least(s):
        continue
    rt.begin_step(s)
    # The step's compute: the state is only read.
    delta = np.float32(s) * np.float32(0.25) + np.float32(rank)
    if hurt and s == args.at and args.fault == "uce":
        hurt = False
        rt.inject_uce(1, w.nbytes // 2 + 123)
    uce = rt.check_uce()
    if uce is not None:
        say(event="uce", step=s, part=uce[0], offset=uce[1])
        if not rt.recovers:
            sys.exit(3)
        step, epoch = recover()
        publish(step)
        continue
    with rt.update(s):
        if hurt and s == args.at and args.fault == "kill-update":
            w[: len(w) // 2] = -1.0  # half-updated
            os.kill(os.getpid(), signal.SIGKILL)
        w *= np.float32(0.999)
        w += delta
        count += s
    rt.commit(s, epoch, s.to_bytes(8, "little"), of="last" if s == args.steps else "step")
    say(event="step", step=s)
    step = s
    publish(step)

sealed = rt.finish(step)
digest = hashlib.sha256(w.tobytes() + count.tobytes()).hexdigest()
with open(os.path.join(args.out, f"final.{rank}.json"), "w") as f:
    json.dump({"step": step, "sha256": digest, "sealed": sealed}, f)
say(event="final", step=step, sha256=digest)
