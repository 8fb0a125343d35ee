#!/usr/bin/env bash
# Makes (once) the Python virtual environment with PyTorch that the
# torchrun-compatibility tests run real DDP scripts in, and prints its
# python. Idempotent and safe to call from several processes at once.
#
# Where: $HATRAIN_TORCH_VENV, else ~/.cache/hatrain/torch-venv (outside the
# checkout, so a fresh clone reuses it). PyPI's torch wheel for Linux is
# the CUDA build (about 3.5 GB with its dependencies); the tests use its
# CPU side only (gloo).
set -euo pipefail
TORCH_VERSION="${HATRAIN_TORCH_VERSION:-2.15.0}"
VENV="${HATRAIN_TORCH_VENV:-$HOME/.cache/hatrain/torch-venv}"
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    echo "torch-venv: installing torch $TORCH_VERSION into $VENV (once)" >&2
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==$TORCH_VERSION" "numpy" >&2
fi
# torch.distributed.checkpoint reads safetensors checkpoints (the agent's,
# for a PyTorch job) with the safetensors package.
if ! "$VENV/bin/python" -c "import safetensors" 2>/dev/null; then
    echo "torch-venv: installing safetensors into $VENV (once)" >&2
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "safetensors" >&2
fi
echo "$VENV/bin/python"
