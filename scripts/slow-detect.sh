#!/usr/bin/env bash
# How fast the agent names a slow rank, and how often it names one that is
# not: the reference trainer, 2 ranks under `hatrain-agent launch`,
# `agentctl slow` polled every 100 ms.
#
#   scripts/slow-detect.sh delay MS [RUNS]   an emulated device of 20 ms
#       per step; rank 0 sleeps MS ms in its forward pass from step 40 on
#       (7: about 30% of the step; 22: about 2x): for each run, the step
#       the finding begins at and its step time
#   scripts/slow-detect.sh healthy STEPS     the real tiny model, a busy
#       loop on every core beside it, STEPS steps: the findings (none
#       expected)
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
        run "delay-$2-$k" 200 "0:40-400:forward:sleep$2" --emulate-device 20
    done
    ;;
healthy)
    for _ in $(seq "$(nproc)"); do
        sh -c 'while :; do :; done' &
        BURNERS+=($!)
    done
    run healthy "${2:-3000}" ""
    ;;
*)
    sed -n '2,17p' "$0"
    exit 2
    ;;
esac
