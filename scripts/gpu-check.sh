#!/usr/bin/env bash
# examples/torch_gpt.py on CUDA GPUs under hatrain-agent: the state in
# device memory, staged to host copies after each update on a side stream.
#
#   scripts/gpu-check.sh [OUT]
#
# Two ranks (high availability needs a replica): on two GPUs, FSDP2 over
# NCCL; on one, both ranks on it with DDP over gloo (an NCCL communicator
# takes one rank per GPU). Deterministic kernels, so that two runs are
# bit-identical.
#
# 1. a plain run (torchrun, no hatrain) and a run under the agent with a
#    snapshot every step: the step time of each (rank 0's median of the
#    steps after the fifth) and their ratio;
# 2. the same run under the agent with rank 1 SIGKILLed at two instants (in
#    the update, halfway through a snapshot's copy): restarted in place, its
#    state restored from shared memory and copied back to the GPU; the
#    final parameters must equal the fault-free runs', bit for bit.
#
# Needs: a python
# with torch built for CUDA and the hatrain wheel installed ($HATRAIN_PYTHON,
# default python3; `pip install target/python/wheels/hatrain-*.whl`, or
# scripts/python-env.sh), and hatrain-agent on PATH or $HATRAIN_AGENT.
# Model size: $GPU_CHECK_ARGS (default about 1 GB of state). Exits non-zero
# when a check fails; the logs are left in OUT. GPU_CHECK_DEVICE=cpu runs
# the same checks on the CPU (with `--stage` in GPU_CHECK_ARGS, through the
# host copies): a dry run of this script where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${HATRAIN_PYTHON:-python3}"
AGENT="${HATRAIN_AGENT:-$(command -v hatrain-agent || echo target/release/hatrain-agent)}"
OUT="${1:-$(mktemp -d -t hatrain-gpu-check.XXXXXX)}"
mkdir -p "$OUT"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
read -r -a MODEL <<<"${GPU_CHECK_ARGS:---steps 30 --layers 12 --width 1024 --heads 16 --vocab 32768 --seq 512 --batch 8}"

"$PY" - "$DEVICE" <<'EOF' || { echo "gpu-check: no $DEVICE device that torch sees from $PY" >&2; exit 2; }
import sys, torch
sys.exit(0 if sys.argv[1] == "cpu" or torch.get_device_module(sys.argv[1]).is_available() else 1)
EOF
"$PY" -c 'import hatrain.torch' || { echo "gpu-check: $PY has no hatrain wheel" >&2; exit 2; }
[ -x "$AGENT" ] || { echo "gpu-check: no hatrain-agent ($AGENT)" >&2; exit 2; }
"$PY" -c 'import sys, torch; print("gpu-check: torch", torch.__version__, "on", torch.cuda.get_device_name(0) if sys.argv[1] == "cuda" else sys.argv[1])' "$DEVICE"

export CUBLAS_WORKSPACE_CONFIG=:4096:8
SHARDING=()
if [ "$DEVICE" = cuda ] && [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ]; then
    SHARDING=(--ddp --backend gloo)
fi
ARGS=(examples/torch_gpt.py --device "$DEVICE" --deterministic "${SHARDING[@]}" "${MODEL[@]}")
echo "gpu-check: ${ARGS[*]}"

plain() {
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 "${ARGS[@]}" --log-jsonl "$OUT/plain.{rank}.jsonl"
}
under_agent() { # NAME [FAULT PLAN]
    local name=$1 plan=${2:-}
    env HATRAIN_FAULT_PLAN="$plan" "$AGENT" launch --nproc-per-node 2 --job-id "gpu-check-$name-$$" \
        --enable-high-availability --enable-worker-reboot -- \
        "$PY" "${ARGS[@]}" --log-jsonl "$OUT/$name.{rank}.jsonl" >"$OUT/$name.out" 2>&1 ||
        { echo "gpu-check: the $name run failed; see $OUT/$name.out" >&2; tail -20 "$OUT/$name.out" >&2; exit 1; }
}

rm -f "$OUT"/*.jsonl
plain >"$OUT/plain.out" 2>&1 || { echo "gpu-check: the plain run failed; see $OUT/plain.out" >&2; exit 1; }
under_agent snapshots
under_agent killed "1:13:update:kill:0;1:21:commit:kill:1"

"$PY" - "$OUT" <<'EOF'
import json, statistics, sys
out = sys.argv[1]
def log(name):
    with open(f"{out}/{name}.jsonl") as f:
        return [json.loads(l) for l in f]
def final(name):
    return [e for e in log(name) if e["event"] == "final"][-1]["model_sha256"]
def step_time(name):
    times = {e["step"]: e["step_time_s"] for e in log(name) if e["event"] == "step"}
    return statistics.median(t for s, t in times.items() if s > 5)
plain, snap = step_time("plain.0"), step_time("snapshots.0")
start = [e for e in log("snapshots.0") if e["event"] == "start"][0]
print(f"gpu-check: snapshot {start['snapshot_bytes'] / 2**20:.1f} MiB, staged {start['staged']}")
print(f"gpu-check: step time plain {plain:.4f} s, snapshot every step {snap:.4f} s, ratio {snap / plain:.4f}")
killed = log("killed.1")
starts = sum(e["event"] == "start" for e in killed)
resumes = [(e["step"], e.get("epoch")) for e in killed if e["event"] == "resume"]
print(f"gpu-check: killed run: rank 1 started {starts} times, resumed at {resumes}")
digests = {n: final(n) for n in ("plain.0", "snapshots.0", "killed.0", "killed.1")}
for n, d in digests.items():
    print(f"gpu-check: {n:11} final parameters sha256 {d}")
ok = len(set(digests.values())) == 1 and starts == 3
print("gpu-check:", "PASS: bit-identical" if ok else "FAIL")
sys.exit(0 if ok else 1)
EOF
