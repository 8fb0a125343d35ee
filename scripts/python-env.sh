#!/usr/bin/env bash
# Builds the `hatrain` Python package (python/: the pyo3 binding of the
# worker runtime and hatrain.torch, with the hatrain-agent and agentctl
# binaries) as an abi3 wheel with maturin, installs it into a virtual
# environment of this checkout, and prints its python. The wheel is left in
# target/python/wheels: `pip install` of it in any environment gives
# `hatrain`, `hatrain.torch`, and `hatrain-agent` and `agentctl` on PATH.
# That environment sees the packages of the PyTorch one
# (scripts/torch-venv.sh: torch, numpy, maturin) through a .pth file, so
# torch is installed once per machine and the wheel once per checkout.
# Idempotent and safe to call from several processes at once.
#
# The wheel is built in target/python (a cargo target folder of its own, so
# that a test running under `cargo test` never waits on that cargo's lock).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TORCH_PY="$("$ROOT/scripts/torch-venv.sh")"
VENV="$ROOT/target/python-venv"
MATURIN="maturin>=1.9,<2"
mkdir -p "$ROOT/target"
exec 8>"$ROOT/target/python-env.lock"
flock 8
TORCH_BIN="$(dirname "$TORCH_PY")"
if ! "$TORCH_BIN/maturin" --version >/dev/null 2>&1; then
    echo "python-env: installing $MATURIN into $(dirname "$TORCH_BIN") (once)" >&2
    "$TORCH_PY" -m pip install --quiet --disable-pip-version-check "$MATURIN" >&2
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$TORCH_PY" -m venv --without-pip "$VENV" >&2
    SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
    "$TORCH_PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))' > "$SITE/hatrain-torch-venv.pth"
fi
# The agent's binaries go into the wheel (its data's scripts: the
# environment's bin/ once installed). HATRAIN_AGENT_BINS names a folder that
# has them built already (the tests pass the ones cargo built for them);
# otherwise they are built here, in release.
BINS="${HATRAIN_AGENT_BINS:-}"
if [ -z "$BINS" ]; then
    CARGO_TARGET_DIR="$ROOT/target/python" cargo build --quiet --release \
        --manifest-path "$ROOT/Cargo.toml" -p hatrain-agent --bins >&2
    BINS="$ROOT/target/python/release"
fi
SCRIPTS="$ROOT/python/hatrain.data/scripts"
rm -rf "$SCRIPTS"
mkdir -p "$SCRIPTS"
for bin in hatrain-agent agentctl; do
    if [ ! -x "$BINS/$bin" ]; then
        echo "python-env: $BINS/$bin is missing (HATRAIN_AGENT_BINS must name a folder with hatrain-agent and agentctl)" >&2
        exit 1
    fi
    # Line tables are kept out of the wheel (a fifth of the size).
    strip --strip-debug -o "$SCRIPTS/$bin" "$BINS/$bin" 2>/dev/null || cp "$BINS/$bin" "$SCRIPTS/$bin"
done
WHEELS="$ROOT/target/python/wheels"
rm -rf "$WHEELS"
CARGO_TARGET_DIR="$ROOT/target/python" "$TORCH_BIN/maturin" build --quiet --release \
    --manifest-path "$ROOT/python/Cargo.toml" --interpreter "$TORCH_PY" --out "$WHEELS" >&2
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
    --force-reinstall "$WHEELS"/hatrain-*.whl >&2
echo "$VENV/bin/python"
