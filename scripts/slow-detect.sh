#!/usr/bin/env bash
# How fast the agent names a slow rank, and how often it names one that is
# not: the reference trainer, 2 ranks under `hatrain-agent launch`,
# `agentctl slow` polled every 100 ms.
#
#   scripts/slow-detect.sh delay MS [RUNS] [DEVICE]   an emulated device
#       of DEVICE ms per step (default 60: 10 steps span more than the
#       detector's half-second window, as a large job's steps do); rank 0
#       sleeps MS ms in its forward pass from step 80 on (20: about 30% of
#       the step; 65: about 2x): for each run, the step the finding begins
#       at and its step time
#   scripts/slow-detect.sh healthy STEPS     the real tiny model, a busy
#       loop on every core beside it, STEPS steps: the findings (none
#       expected)
#   scripts/slow-detect.sh replace POLICY [RUNS]   the real tiny model,
#       600 steps, rank 1's process held to 20% of a core (a cgroup v1 cpu
#       quota) from step 60 on, a warm standby, --on-slow POLICY (report:
#       left alone; replace: handed over, priced at 1 s): the mean step
#       time before the quota, with it, after the hand-over, and the wall
#       time from step 60 to the end
#
# Needs the debug binaries (cargo build -p hatrain-agent --bins -p
# hatrain-trainer).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="$ROOT/target/debug"
WORK="$(mktemp -d)"
BURNERS=()
cleanup() {
    for p in "${BURNERS[@]}"; do kill "$p" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT

# run NAME STEPS PLAN [TRAINER FLAGS...]: prints the first finding, or none.
run() {
    local name=$1 steps=$2 plan=$3
    shift 3
    local root="$WORK/shm-$name" job="slow-detect-$name-$$" found=""
    mkdir -p "$root"
    HATRAIN_FAULT_PLAN="$plan" RUST_LOG=warn "$BIN/hatrain-agent" launch --nproc-per-node 2 \
        --job-id "$job" --threads-per-worker 1 --shm-root "$root" -- \
        "$BIN/hatrain-train" --model-size tiny --global-batch 16 --seq-len 16 \
        --log-interval 1000 --train-iters "$steps" "$@" >"$WORK/$name.out" 2>&1 &
    local pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        local j
        j=$("$BIN/agentctl" --shm-root "$root" --job "$job" --json slow 2>/dev/null || true)
        if [ -z "$found" ] && [ -n "$j" ] && [ "$j" != "[]" ]; then found=$j; fi
        sleep 0.1
    done
    wait "$pid"
    if [ -z "$found" ]; then
        echo "$name: no finding"
    else
        echo "$found" | python3 -c '
import json, sys
f = json.load(sys.stdin)[0]
print("%s: rank %d %s, found at step %d (since %d), +%.1f ms on a %.1f ms step" % (
    sys.argv[1], f["rank"], f["phase"], f["last_step"], f["since_step"], f["excess_ms"], f["step_ms"]))' "$name"
    fi
}

case "${1:-}" in
delay)
    for k in $(seq "${3:-3}"); do
        run "delay-$2-$k" 200 "0:80-400:forward:sleep$2" --emulate-device "${4:-60}"
    done
    ;;
healthy)
    for _ in $(seq "$(nproc)"); do
        sh -c 'while :; do :; done' &
        BURNERS+=($!)
    done
    run healthy "${2:-3000}" ""
    ;;
replace)
    for k in $(seq "${3:-3}"); do
        python3 - "$BIN" "$WORK" "$2" "$k" <<'PY'
import json, os, subprocess, sys, time
bin_, work, policy, k = sys.argv[1:]
job, root = f"slow-replace-{policy}-{k}-{os.getpid()}", f"{work}/shm-{policy}-{k}"
log = f"{work}/{policy}-{k}.jsonl"
agent = subprocess.Popen(
    [f"{bin_}/hatrain-agent", "launch", "--nproc-per-node", "2", "--job-id", job,
     "--threads-per-worker", "1", "--shm-root", root, "--enable-high-availability",
     "--enable-worker-reboot", "--warm-standby", "1", "--on-slow", policy,
     "--slow-handover-secs", "1", "--", f"{bin_}/hatrain-train", "--model-size", "tiny",
     "--global-batch", "16", "--seq-len", "16", "--log-interval", "1000",
     "--train-iters", "600", "--log-jsonl", log],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
def status():
    r = subprocess.run([f"{bin_}/agentctl", "--shm-root", root, "--job", job, "--json", "status"],
                       capture_output=True, text=True)
    return json.loads(r.stdout)["status"] if r.returncode == 0 else None
group, fault = f"/sys/fs/cgroup/cpu/{job}", None
while agent.poll() is None:
    s = status()
    w = next((w for w in (s or {}).get("workers", []) if w["rank"] == 1), None)
    if w and w["step"] >= 60 and not os.path.exists(group):
        os.mkdir(group)
        open(f"{group}/cpu.cfs_period_us", "w").write("100000")
        open(f"{group}/cpu.cfs_quota_us", "w").write("20000")
        open(f"{group}/cgroup.procs", "w").write(str(w["pid"]))
    for f in (s or {}).get("faults", []):
        if f["kind"] == "slow" and f.get("s_star") is not None:
            fault = f
    time.sleep(0.1)
for pid in open(f"{group}/cgroup.procs").read().split() if os.path.exists(group) else []:
    open("/sys/fs/cgroup/cpu/cgroup.procs", "w").write(pid)
if os.path.exists(group):
    os.rmdir(group)
steps = {}
for line in open(log):
    e = json.loads(line)
    if e["event"] == "step":
        steps[e["step"]] = e["unix_s"]  # the last time each step was logged
def mean_ms(a, b):
    return 1e3 * (steps[b] - steps[a]) / (b - a)
cut = fault["s_star"] + 20 if fault else None
print(f"{policy} run {k}: mean step ms before {mean_ms(20, 60):.1f}, "
      + (f"quota until the hand-over at step {fault['s_star']} {mean_ms(60, fault['s_star']):.1f}, "
         f"after {mean_ms(cut, 600):.1f}" if fault else f"quota to the end {mean_ms(60, 600):.1f}")
      + f"; steps 60-600 took {steps[600] - steps[60]:.2f} s")
PY
    done
    ;;
*)
    sed -n '2,23p' "$0"
    exit 2
    ;;
esac
