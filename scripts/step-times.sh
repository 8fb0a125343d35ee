#!/usr/bin/env bash
# Step times of examples/torch_ddp.py (2 ranks, gloo, the torch_recovery
# bench's model: 252 MiB of state per rank), read from the ranks' logs.
#
#   scripts/step-times.sh overhead [PAIRS]   plain DDP under torchrun
#       against hatrain with a snapshot every step, no faults, PAIRS
#       interleaved pairs (default 6): the median step of steps 5-40 of
#       each run, and their ratio
#   scripts/step-times.sh kill [FLAGS]       hatrain with FLAGS (default
#       --warm-standby 1): rank 1 SIGKILLed once rank 0 logs step 13; each
#       rank's start, resume and steps 10-20, in seconds from the kill
#
# Needs the release agent (cargo build --release -p hatrain-agent) and the
# Python environment (scripts/python-env.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$ROOT/target/python-venv/bin/python"
AGENT="$ROOT/target/release/hatrain-agent"
SCRIPT="$ROOT/examples/torch_ddp.py"
MODEL=(--hidden 2090 --layers 6)
HA=(launch --nproc-per-node 2 --stop-grace-secs 3 --enable-high-availability --enable-worker-reboot)
median() {
    "$PY" -c '
import json, statistics, sys
v = [json.loads(l) for l in open(sys.argv[1])]
print(statistics.median(e["step_time_s"] for e in v if e.get("event") == "step" and 5 <= e["step"] <= 40))' "$1"
}
case "${1:-}" in
overhead)
    for pair in $(seq "${2:-6}"); do
        d="$(mktemp -d)"
        (cd "$d" && env -u OMP_NUM_THREADS TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "$PY" -m torch.distributed.run \
            --nproc-per-node 2 "$SCRIPT" --steps 40 "${MODEL[@]}" --plain --log-jsonl "$d/plain.jsonl" >/dev/null 2>&1)
        (cd "$d" && env -u OMP_NUM_THREADS RUST_LOG=warn "$AGENT" "${HA[@]}" -- \
            "$PY" "$SCRIPT" --steps 40 "${MODEL[@]}" --log-jsonl "$d/hatrain.jsonl" >/dev/null 2>&1)
        p="$(median "$d/plain.jsonl")"
        h="$(median "$d/hatrain.jsonl")"
        echo "pair $pair: plain $p s, hatrain $h s, ratio $("$PY" -c "print(round($h / $p, 3))")"
        rm -rf "$d"
    done
    ;;
kill)
    shift
    flags=("$@")
    [ ${#flags[@]} -gt 0 ] || flags=(--warm-standby 1)
    d="$(mktemp -d)"
    trap 'rm -rf "$d"' EXIT
    (cd "$d" && env -u OMP_NUM_THREADS RUST_LOG=warn "$AGENT" "${HA[@]}" "${flags[@]}" -- \
        "$PY" "$SCRIPT" --steps 24 "${MODEL[@]}" --log-jsonl "$d/log.{rank}.jsonl" >/dev/null 2>&1) &
    launcher=$!
    "$PY" - "$d" <<'PY'
import json, os, signal, sys, time
d = sys.argv[1]
def log(r):
    try:
        return [json.loads(l) for l in open(f"{d}/log.{r}.jsonl")]
    except (OSError, ValueError):
        return []
while not any(e.get("event") == "step" and e["step"] >= 13 for e in log(0)):
    time.sleep(0.002)
victim = [e for e in log(1) if e["event"] == "start"][0]["pid"]
t = time.time()
os.kill(victim, signal.SIGKILL)
while not any(e.get("event") == "final" for e in log(0)):
    time.sleep(0.05)
for r in (0, 1):
    out = []
    for e in log(r):
        if e["event"] in ("start", "resume"):
            out.append(f"{e['event']}@{e.get('unix_s', 0) - t:+.3f}")
        elif e["event"] == "step" and 10 <= e["step"] <= 20:
            out.append(f"s{e['step']}:{e['step_time_s'] * 1000:.0f}ms@{e['unix_s'] - t:+.3f}")
    print(f"rank {r}:", " ".join(out))
PY
    wait "$launcher"
    ;;
*)
    sed -n '2,16p' "$0" >&2
    exit 2
    ;;
esac
