//! One checkpoint from the ranks' snapshots: [`write_checkpoint`] reads
//! every rank's slot of a step through its state map and writes the rank
//! directories with [`checkpoint::write_rank`], the trainer's own writer.
//!
//! A sliced snapshot holds a rank's slice of each replicated part: a
//! tensor that reaches beyond it is assembled from the other ranks' slots
//! of the same step ([`assemble`]), each verified as it is read.
//!
//! INVARIANT: only verified, sealed slots are read, and each is verified
//! again after it was written out, so a slot rewritten meanwhile is caught
//! rather than saved torn.

use hatrain_shared::checkpoint::{self, CheckpointError};
use hatrain_shared::shm::{ShmError, Store};
use hatrain_shared::statemap::{PartView, StateMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One rank's store and the state map it registered; `sliced` when its
/// snapshots hold only its slice of each replicated part.
#[derive(Debug, Clone, Copy)]
pub struct RankSource<'a> {
    pub rank: usize,
    pub store: &'a Store,
    pub map: &'a StateMap,
    pub sliced: bool,
}

/// A [`RankSource`] that owns its parts, for the writer thread.
#[derive(Debug, Clone)]
pub struct OwnedSource {
    pub rank: usize,
    pub store: Arc<Store>,
    pub map: Arc<StateMap>,
    pub sliced: bool,
}

impl OwnedSource {
    pub fn borrow(&self) -> RankSource<'_> {
        RankSource {
            rank: self.rank,
            store: &self.store,
            map: &self.map,
            sliced: self.sliced,
        }
    }
}

/// The elements of each part that rank `src`'s checkpoint files read.
fn needed(src: &RankSource<'_>) -> Vec<Option<std::ops::Range<u64>>> {
    let mut need: Vec<Option<std::ops::Range<u64>>> = vec![None; src.map.parts.len()];
    for t in src
        .map
        .checkpoint
        .iter()
        .flat_map(|c| &c.files)
        .flat_map(|f| &f.tensors)
        .filter(|t| t.range.start < t.range.end)
    {
        let n = &mut need[t.part];
        *n = Some(match n.take() {
            None => t.range.clone(),
            Some(r) => r.start.min(t.range.start)..r.end.max(t.range.end),
        });
    }
    need
}

/// Elements `need` of replicated part `part` at `step`, gathered from the
/// slices the ranks' snapshots hold (each slot verified as it is read).
fn assemble(
    sources: &[RankSource<'_>],
    part: usize,
    need: std::ops::Range<u64>,
    step: u64,
) -> Result<Vec<u8>, PersistError> {
    let first = &sources[0];
    let size = first.map.parts[part].dtype.size() as u64;
    let mut out = vec![0u8; ((need.end - need.start) * size) as usize];
    let mut covered = 0u64;
    for q in sources {
        if q.map.parts.get(part).map(|p| (&p.name, p.len))
            != first.map.parts.get(part).map(|p| (&p.name, p.len))
        {
            continue;
        }
        let held = q.map.held(part, q.sliced);
        let (lo, hi) = (held.start.max(need.start), held.end.min(need.end));
        if lo >= hi {
            continue;
        }
        let slot = q
            .store
            .find_step(step)
            .ok_or(PersistError::NoSnapshot { rank: q.rank, step })?
            .slot;
        let at = q.map.slot_offsets(q.sliced)[part].start + ((lo - held.start) * size) as usize;
        let len = ((hi - lo) * size) as usize;
        let dst = ((lo - need.start) * size) as usize;
        q.store
            .with_slot(slot, |info, bytes| {
                (info.step == step)
                    .then(|| out[dst..dst + len].copy_from_slice(&bytes[at..at + len]))
            })
            .ok()
            .flatten()
            .ok_or(PersistError::Changed { rank: q.rank, step })?;
        covered += hi - lo;
    }
    if covered != need.end - need.start {
        return Err(PersistError::Disagree {
            rank: first.rank,
            detail: format!(
                "needs elements {need:?} of part {:?}, which the ranks' slices do not cover",
                first.map.parts[part].name
            ),
        });
    }
    Ok(out)
}

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("rank {rank} registered no checkpoint layout (the trainer has no --save directory)")]
    NoLayout { rank: usize },
    #[error("ranks disagree on the checkpoint: rank {rank} {detail}")]
    Disagree { rank: usize, detail: String },
    #[error("the checkpoint needs all {world} ranks, but this host has {have:?}")]
    MissingRanks { world: usize, have: Vec<usize> },
    #[error("rank {rank} has no verified snapshot of step {step}")]
    NoSnapshot { rank: usize, step: u64 },
    #[error("rank {rank}: snapshot of step {step} changed while it was written out")]
    Changed { rank: usize, step: u64 },
    #[error(
        "no step has a verified snapshot on every rank (per rank: {per_rank:?}); the final checkpoint was not written"
    )]
    NoCommonStep { per_rank: Vec<Vec<u64>> },
    #[error(
        "the final step {last} has no verified snapshot on every rank (per rank: {per_rank:?}); the newest checkpoint written is iteration {written}"
    )]
    FinalStepMissing {
        last: u64,
        written: u64,
        per_rank: Vec<Vec<u64>>,
    },
    #[error("the checkpoint of iteration {step} was not committed: {detail}")]
    NotCommitted { step: u64, detail: String },
    #[error(transparent)]
    Shm(#[from] ShmError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

impl PersistError {
    /// Whether the write failed for a reason that passes by itself: out
    /// of file descriptors (this process's or the system's), or a call
    /// interrupted or refused for the moment. Such a write is tried again;
    /// a full disk or a bad snapshot is not.
    pub fn is_transient(&self) -> bool {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(e) = cause {
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                return matches!(
                    io.raw_os_error(),
                    Some(libc::EMFILE | libc::ENFILE | libc::EINTR | libc::EAGAIN)
                );
            }
            cause = e.source();
        }
        false
    }
}

/// Bytes a checkpoint of these sources holds (every tensor of every file).
pub fn checkpoint_bytes(sources: &[RankSource<'_>]) -> u64 {
    sources
        .iter()
        .filter_map(|s| {
            let ck = s.map.checkpoint.as_ref()?;
            Some(
                ck.files
                    .iter()
                    .flat_map(|f| &f.tensors)
                    .map(|t| {
                        (t.range.end - t.range.start)
                            * s.map.parts.get(t.part).map_or(0, |p| p.dtype.size() as u64)
                    })
                    .sum::<u64>(),
            )
        })
        .sum()
}

/// The save directory and world size all `sources` agree on.
fn common_layout(sources: &[RankSource<'_>]) -> Result<(PathBuf, usize), PersistError> {
    let mut common: Option<(&Path, usize)> = None;
    for s in sources {
        let ck = s
            .map
            .checkpoint
            .as_ref()
            .ok_or(PersistError::NoLayout { rank: s.rank })?;
        match common {
            None => common = Some((&ck.dir, ck.world_size)),
            Some((dir, world)) if dir != ck.dir || world != ck.world_size => {
                return Err(PersistError::Disagree {
                    rank: s.rank,
                    detail: format!(
                        "saves {} ranks into {}, others {world} into {}",
                        ck.world_size,
                        ck.dir.display(),
                        dir.display()
                    ),
                });
            }
            Some(_) => {}
        }
    }
    let (dir, world) = common.ok_or(PersistError::MissingRanks {
        world: 0,
        have: Vec::new(),
    })?;
    Ok((dir.to_path_buf(), world))
}

/// Writes iteration `step` from every rank's snapshot into `dir`.
pub fn write_checkpoint(
    sources: &[RankSource<'_>],
    step: u64,
    dir: &Path,
) -> Result<PathBuf, PersistError> {
    let (_, world) = common_layout(sources)?;
    let mut have: Vec<usize> = sources.iter().map(|s| s.rank).collect();
    have.sort();
    if have != (0..world).collect::<Vec<_>>() {
        return Err(PersistError::MissingRanks { world, have });
    }
    let tmp = checkpoint::begin_save(dir, step)?;
    let written = write_ranks(sources, &have, step, &tmp)
        .and_then(|()| Ok(checkpoint::commit_save(dir, step, world)?));
    if written.is_err() {
        // A partial checkpoint is not left to fill the disk; the previous
        // one and the tracker were never touched.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written
}

/// Writes the directories of `ranks` of iteration `step` into `tmp` (made
/// by [`checkpoint::begin_save`]) from their snapshots: every rank of a
/// checkpoint on one host, or the ranks this host holds of one that
/// several hosts write (whose commit is the controller's). A replicated
/// part a rank's files need beyond its slice is assembled from the slices
/// of `sources`.
pub fn write_ranks(
    sources: &[RankSource<'_>],
    ranks: &[usize],
    step: u64,
    tmp: &Path,
) -> Result<(), PersistError> {
    common_layout(sources)?;
    for &rank in ranks {
        let src = sources
            .iter()
            .find(|s| s.rank == rank)
            .ok_or(PersistError::NoSnapshot { rank, step })?;
        let slot = src
            .store
            .find_step(step)
            .ok_or(PersistError::NoSnapshot {
                rank: src.rank,
                step,
            })?
            .slot;
        let offsets = src.map.slot_offsets(src.sliced);
        let total = offsets.last().map_or(0, |r| r.end);
        // A tensor that reaches beyond this rank's slice of a
        // replicated part is assembled from the other ranks' slices.
        let mut borrowed: Vec<Option<(u64, Vec<u8>)>> = vec![None; offsets.len()];
        for (part, need) in needed(src).into_iter().enumerate() {
            let held = src.map.held(part, src.sliced);
            if let Some(need) = need
                && (need.start < held.start || need.end > held.end)
            {
                borrowed[part] = Some((need.start, assemble(sources, part, need, step)?));
            }
        }
        // The slot is verified before and after it is written out, so a
        // slot rewritten meanwhile is caught rather than saved torn.
        src.store
            .with_slot(slot, |info, bytes| {
                if info.step != step {
                    return Err(PersistError::Changed {
                        rank: src.rank,
                        step,
                    });
                }
                if bytes.len() != total {
                    return Err(PersistError::Disagree {
                        rank: src.rank,
                        detail: format!(
                            "holds a snapshot of {} bytes, its state map {total}",
                            bytes.len()
                        ),
                    });
                }
                let views: Vec<PartView<'_>> = offsets
                    .iter()
                    .enumerate()
                    .map(|(i, r)| match &borrowed[i] {
                        Some((first, b)) => PartView {
                            first: *first,
                            bytes: b,
                        },
                        None => PartView {
                            first: src.map.held(i, src.sliced).start,
                            bytes: &bytes[r.clone()],
                        },
                    })
                    .collect();
                Ok(checkpoint::write_rank(
                    tmp,
                    src.map,
                    src.map.checkpoint_rank(src.rank),
                    step,
                    &views,
                )?)
            })
            .map_err(|_| PersistError::Changed {
                rank: src.rank,
                step,
            })??;
    }
    Ok(())
}

/// Writes the directories of every rank of `sources` of iteration `step`
/// into its `_tmp` directory in `dir`, made if missing: one host's share
/// of a checkpoint several hosts write, which the job's controller
/// commits. Its ranks' directories left by an earlier attempt go first.
pub fn write_share(
    sources: &[RankSource<'_>],
    step: u64,
    dir: &Path,
) -> Result<PathBuf, PersistError> {
    let tmp = checkpoint::tmp_iter_dir(dir, step);
    let io = |e: std::io::Error| {
        PersistError::Checkpoint(checkpoint::CheckpointError::Io {
            path: tmp.clone(),
            source: e,
        })
    };
    std::fs::create_dir_all(&tmp).map_err(io)?;
    let ranks: Vec<usize> = sources.iter().map(|s| s.rank).collect();
    for s in sources {
        let dir = checkpoint::rank_dir(&tmp, s.map.checkpoint_rank(s.rank));
        match std::fs::remove_dir_all(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(e)),
            _ => {}
        }
    }
    write_ranks(sources, &ranks, step, &tmp)?;
    Ok(tmp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hatrain_shared::shm::{Geometry, store_path};
    use hatrain_shared::statemap::{Dtype, Sharing};

    #[test]
    fn a_replicated_part_is_written_from_the_slices_of_every_rank() {
        // Rank r's file holds all of "w", replicated over 3 ranks: its own
        // slot has only its third, the rest comes from the others' slots.
        let dir = tempfile::tempdir().unwrap();
        let out = tempfile::tempdir().unwrap();
        let n = 1001u64;
        let sources: Vec<OwnedSource> = (0..3)
            .map(|rank| {
                let mut m = super::super::tests::map();
                m.parts[1].len = n;
                m.parts[1].sharing = Sharing::Replicated {
                    group: 3,
                    index: rank,
                };
                let ck = m.checkpoint.as_mut().unwrap();
                ck.world_size = 3;
                ck.files[0].tensors[0].range = 0..n;
                let held = m.held(1, true);
                let store = Store::create(
                    &store_path(dir.path(), rank),
                    rank,
                    Geometry::new(2, m.slot_bytes(true) as usize),
                    m.slot_layout_hash(true),
                    2,
                )
                .unwrap();
                let w: Vec<f32> = (held.start..held.end).map(|i| i as f32).collect();
                let meta = (70 + rank as u64).to_le_bytes();
                store
                    .write_slot(
                        store.writable_slot().unwrap(),
                        rank as u64,
                        7,
                        0,
                        &[&meta, bytemuck::cast_slice(&w)],
                        &mut |_, _| true,
                    )
                    .unwrap();
                OwnedSource {
                    rank,
                    store: Arc::new(store),
                    map: Arc::new(m),
                    sliced: true,
                }
            })
            .collect();
        let borrowed: Vec<RankSource<'_>> = sources.iter().map(OwnedSource::borrow).collect();
        write_checkpoint(&borrowed, 7, out.path()).unwrap();
        let it_dir = checkpoint::iter_dir(out.path(), 7);
        for rank in 0..3 {
            let meta = checkpoint::read_rank_meta(&it_dir, rank, 3).unwrap();
            let rdir = checkpoint::rank_dir(&it_dir, rank);
            let bytes = checkpoint::read_verified(&rdir, &meta, "w.safetensors").unwrap();
            let w = checkpoint::tensor_bytes(
                &rdir.join("w.safetensors"),
                &bytes,
                "w",
                Dtype::F32,
                n as usize,
            )
            .unwrap();
            let want: Vec<f32> = (0..n).map(|i| i as f32).collect();
            assert_eq!(w, bytemuck::cast_slice::<f32, u8>(&want), "rank {rank}");
            assert_eq!(meta.fields["stamp"], 70 + rank as u64);
        }
        // Without one rank's slot, the part cannot be assembled.
        let two: Vec<RankSource<'_>> = borrowed[..2].to_vec();
        let e = write_checkpoint(&two, 7, out.path())
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs all 3 ranks"), "{e}");
    }
}
