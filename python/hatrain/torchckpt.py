"""A PyTorch job's checkpoints (for :class:`hatrain.torch.Job`): the layout
the agent writes them in, and a job's start from one."""

from __future__ import annotations

import json
import os
import sys

import torch

import hatrain


def layout(job) -> dict | None:
    """With ``save``, the layout of this rank's checkpoints: the agent
    writes them (every ``save_interval`` steps, at the last step, and
    as last words) as ``save/iter_NNNNNNN/rank_NNNNN/state.safetensors``
    with the rank's ``meta.json``, every rank's files also linked into
    ``save/iter_NNNNNNN/dcp/``: a folder that
    ``torch.distributed.checkpoint.HuggingFaceStorageReader`` loads,
    at this world size or another, with no hatrain (see
    ``State.checkpoint_tensors`` for the names). Each ``meta.json``
    carries the snapshot's metadata (the step, the RNG states, the
    optimizer's groups, the schedulers', ``extra``) as ``torch``."""
    if job.save is None:
        return None
    tensors = job.state.checkpoint_tensors(job.world, job.rank)
    if not tensors:
        raise hatrain.HatrainError(
            f"rank {job.rank} has no tensor to write into a checkpoint of {job.world} ranks "
            "(fewer tensors than ranks): leave `save` out"
        )
    return {
        "dir": job.save,
        "interval": int(job.save_interval),
        "world_size": job.world,
        "files": [{"name": "state.safetensors", "tensors": tensors}],
        "fields": [
            {"name": "layout", "value": {"const": job.layout}},
            {"name": "torch", "value": {"json": {"part": 0}}},
        ],
        "linked": "dcp",
    }


def load(job) -> int:
    """The job starts from the checkpoint at ``load`` (a save folder the
    agent wrote into: its newest iteration; or an iteration's ``dcp``
    folder), read with ``torch.distributed.checkpoint`` at this world
    size, whatever the one it was written at. Returns its step."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = job.load
    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    try:
        if os.path.exists(tracker):
            with open(tracker) as f:
                path = os.path.join(path, f"iter_{int(f.read().strip()):07d}", "dcp")
        own = os.path.join(path, f"rank_{job.rank:05d}-meta.json")
        with open(own if os.path.exists(own) else os.path.join(path, "rank_00000-meta.json")) as f:
            meta = json.load(f)["torch"]
    except (OSError, ValueError, KeyError) as e:
        raise hatrain.HatrainError(f"{job.load} is not a checkpoint hatrain wrote for a PyTorch job: {e}") from None
    if job.layout == "zero":
        raise hatrain.HatrainError(
            "a ZeroRedundancyOptimizer's state cannot be loaded by torch.distributed.checkpoint: "
            f"{job.load} is not loaded"
        )
    msd, osd = get_state_dict(job.module, job.optimizer)
    dcp_load({"model": msd, "optim": {"state": osd["state"]}}, storage_reader=HuggingFaceStorageReader(path))
    with torch.no_grad():
        set_state_dict(job.module, job.optimizer, model_state_dict=msd, optim_state_dict=osd)
        # The loaded state moves into its parts (FSDP's shards are
        # copied in), then is rebuilt from them as after a restore.
        job.state.adopt()
        job._apply_meta(meta)
    print(f"rank {job.rank}: started from step {meta['step']} of {path}", file=sys.stderr, flush=True)
    return int(meta["step"])
