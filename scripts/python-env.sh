#!/usr/bin/env bash
# Builds the `hatrain` Python package (python/: the pyo3 binding of the
# worker runtime and hatrain.torch) as an abi3 wheel with maturin, installs
# it into a virtual environment of this checkout, and prints its python.
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
WHEELS="$ROOT/target/python/wheels"
rm -rf "$WHEELS"
CARGO_TARGET_DIR="$ROOT/target/python" "$TORCH_BIN/maturin" build --quiet --release \
    --manifest-path "$ROOT/python/Cargo.toml" --interpreter "$TORCH_PY" --out "$WHEELS" >&2
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
    --force-reinstall "$WHEELS"/hatrain-*.whl >&2
echo "$VENV/bin/python"
