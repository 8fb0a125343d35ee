//! Writes checkpoints from the ranks' snapshot stores, off the training
//! path: the last-words dump (and later the periodic agent-side save).
//!
//! A rank's snapshot is `meta` (step, RNG state, data position: three
//! little-endian u64), `params` (the full flat buffer), then its `exp_avg`
//! and `exp_avg_sq` shards; each rank contributes its own parameter shard
//! and moments, in exactly the layout and with the atomicity of
//! `hatrain_shared::checkpoint`, so `--load` reads the result.
//!
//! INVARIANT: only verified, sealed slots are read, and each is verified
//! again after it was written out, so a slot rewritten meanwhile is caught
//! rather than saved torn.

use hatrain_shared::checkpoint::{self, CheckpointError, ShardData, ShardHeader};
use hatrain_shared::control::{CheckpointInfo, StatePart};
use hatrain_shared::model::shard_range;
use hatrain_shared::shm::{ShmError, Store};
use std::path::{Path, PathBuf};

/// One rank's store and what it registered.
#[derive(Debug, Clone, Copy)]
pub struct RankSource<'a> {
    pub rank: usize,
    pub store: &'a Store,
    pub parts: &'a [StatePart],
    pub info: &'a CheckpointInfo,
}

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error(
        "rank {rank}: its snapshot layout {found:?} is not the trainer's (meta, params, exp_avg, exp_avg_sq of {expected:?} bytes)"
    )]
    Layout {
        rank: usize,
        found: Vec<(String, u64)>,
        expected: [u64; 4],
    },
    #[error("the checkpoint needs all {world} ranks, but this host has {have:?}")]
    MissingRanks { world: usize, have: Vec<usize> },
    #[error("rank {rank} has no verified snapshot of step {step}")]
    NoSnapshot { rank: usize, step: u64 },
    #[error("rank {rank}: snapshot of step {step} changed while it was written out")]
    Changed { rank: usize, step: u64 },
    #[error(transparent)]
    Shm(#[from] ShmError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

fn expected_layout(src: &RankSource<'_>) -> [u64; 4] {
    let numel = src.info.model.numel();
    let shard = shard_range(numel, src.info.world_size, src.rank).len() as u64;
    [24, numel as u64 * 4, shard * 4, shard * 4]
}

/// Writes iteration `step` from every rank's snapshot into `dir`.
pub fn write_checkpoint(
    sources: &[RankSource<'_>],
    step: u64,
    dir: &Path,
) -> Result<PathBuf, PersistError> {
    let world = sources.first().map_or(0, |s| s.info.world_size);
    let mut have: Vec<usize> = sources.iter().map(|s| s.rank).collect();
    have.sort();
    if have != (0..world).collect::<Vec<_>>() {
        return Err(PersistError::MissingRanks { world, have });
    }
    for src in sources {
        let sizes: Vec<u64> = src.parts.iter().map(|p| p.bytes).collect();
        if sizes != expected_layout(src) {
            return Err(PersistError::Layout {
                rank: src.rank,
                found: src
                    .parts
                    .iter()
                    .map(|p| (p.name.clone(), p.bytes))
                    .collect(),
                expected: expected_layout(src),
            });
        }
    }
    let tmp = checkpoint::begin_save(dir, step)?;
    for src in sources {
        let info = src
            .store
            .sealed()
            .into_iter()
            .filter(|i| i.step == step)
            .find_map(|i| src.store.verify(i.slot).ok())
            .ok_or(PersistError::NoSnapshot {
                rank: src.rank,
                step,
            })?;
        // SAFETY: the slot is verified; a concurrent rewrite is caught by the
        // verification after the write below.
        let bytes = unsafe { src.store.slot_bytes(info.slot)? };
        let [meta_len, params_len, m_len, _] = expected_layout(src).map(|b| b as usize);
        let word =
            |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        let (iteration, rng_state, data_position) = (word(0), word(1), word(2));
        // The slot data is page-aligned and every part a multiple of 4 bytes
        // long, so each part is f32-aligned.
        let floats =
            |from: usize, len: usize| -> &[f32] { bytemuck::cast_slice(&bytes[from..from + len]) };
        let params = floats(meta_len, params_len);
        let exp_avg = floats(meta_len + params_len, m_len);
        let exp_avg_sq = floats(meta_len + params_len + m_len, m_len);
        let shard = shard_range(params.len(), src.info.world_size, src.rank);
        let header = ShardHeader {
            iteration,
            world_size: src.info.world_size,
            rank: src.rank,
            model: src.info.model,
            rng_state,
            data_position,
            args: src.info.args.clone(),
        };
        checkpoint::write_shard(
            &tmp,
            &header,
            ShardData {
                params: &params[shard],
                exp_avg,
                exp_avg_sq,
            },
        )?;
        if iteration != step || src.store.verify(info.slot).ok() != Some(info) {
            return Err(PersistError::Changed {
                rank: src.rank,
                step,
            });
        }
    }
    Ok(checkpoint::commit_save(dir, step, world)?)
}
