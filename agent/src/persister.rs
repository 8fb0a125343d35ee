//! Writes checkpoints from the ranks' snapshot stores, off the training
//! path: the periodic and final saves ([`Persister`]) and the last-words
//! dump.
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
use hatrain_shared::control::{CheckpointInfo, PersistReport, StatePart};
use hatrain_shared::model::shard_range;
use hatrain_shared::shm::{Hold, ShmError, Store};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// One rank's store and what it registered.
#[derive(Debug, Clone, Copy)]
pub struct RankSource<'a> {
    pub rank: usize,
    pub store: &'a Store,
    pub parts: &'a [StatePart],
    pub info: &'a CheckpointInfo,
}

/// A [`RankSource`] that owns its parts, for the writer thread.
#[derive(Debug, Clone)]
pub struct OwnedSource {
    pub rank: usize,
    pub store: Arc<Store>,
    pub parts: Vec<StatePart>,
    pub info: CheckpointInfo,
}

impl OwnedSource {
    pub fn borrow(&self) -> RankSource<'_> {
        RankSource {
            rank: self.rank,
            store: &self.store,
            parts: &self.parts,
            info: &self.info,
        }
    }
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

/// Bytes a checkpoint of these sources holds (each rank's parameter shard
/// and moments).
pub fn checkpoint_bytes(sources: &[RankSource<'_>]) -> u64 {
    sources
        .iter()
        .map(|s| {
            let [_, _, m, v] = expected_layout(s);
            m * 2 + v
        })
        .sum()
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
    let written = (|| -> Result<PathBuf, PersistError> {
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
            let floats = |from: usize, len: usize| -> &[f32] {
                bytemuck::cast_slice(&bytes[from..from + len])
            };
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
    })();
    if written.is_err() {
        // A partial checkpoint is not left to fill the disk; the previous
        // one and the tracker were never touched.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written
}

/// The agent-side periodic save: writes the snapshots the ranks hold for
/// it (see "Persist holds" in `hatrain_shared::shm`) into the trainer's
/// `--save` directory, on a thread of its own, one checkpoint at a time.
///
/// The event loop calls [`Persister::poll`] on every tick. When every rank
/// holds the same step, the persister claims all the holds (or none) and
/// writes that step; the claimed slots are not rewritten meanwhile. While it
/// writes, the workers replace their unclaimed holds with newer save steps,
/// so a disk slower than the save interval makes it skip to the newest step
/// instead of queueing, and it says which steps it skipped.
pub struct Persister {
    dir: PathBuf,
    write: WriteFn,
    interval: u64,
    world: usize,
    writing: Option<Writing>,
    last_saved: Option<(u64, f64)>,
    last_started: Option<u64>,
    saves: u64,
    skipped: Vec<u64>,
    last_error: Option<String>,
}

/// How a checkpoint is written: [`write_checkpoint`] (a test gates it).
type WriteFn =
    Arc<dyn Fn(&[RankSource<'_>], u64, &Path) -> Result<PathBuf, PersistError> + Send + Sync>;

impl std::fmt::Debug for Persister {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Persister")
            .field("report", &self.report())
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Writing {
    step: u64,
    bytes: u64,
    started: Instant,
    thread: JoinHandle<Result<PathBuf, PersistError>>,
}

/// Save steps listed in a report at most (the newest).
const SKIPPED_KEPT: usize = 64;

impl Persister {
    /// Saves every `interval` steps (0: only the last) of a `world`-rank
    /// job into `dir`.
    pub fn new(dir: PathBuf, interval: u64, world: usize) -> Self {
        Self {
            dir,
            write: Arc::new(write_checkpoint),
            interval,
            world,
            writing: None,
            last_saved: None,
            last_started: None,
            saves: 0,
            skipped: Vec::new(),
            last_error: None,
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The newest iteration written.
    pub fn last_saved(&self) -> Option<u64> {
        self.last_saved.map(|(s, _)| s)
    }

    pub fn report(&self) -> PersistReport {
        PersistReport {
            dir: self.dir.clone(),
            interval: self.interval,
            last_saved: self.last_saved(),
            last_seconds: self.last_saved.map(|(_, t)| t),
            saves: self.saves,
            skipped: self.skipped.clone(),
            writing: self.writing.as_ref().map(|w| w.step),
            last_error: self.last_error.clone(),
        }
    }

    /// Collects a finished write, and starts the next one when every rank
    /// holds the same new step. `source` gives a rank's store and layout.
    pub fn poll(&mut self, ranks: &[usize], source: impl Fn(usize) -> Option<OwnedSource>) {
        self.reap(false);
        if self.writing.is_some() || ranks.len() != self.world {
            return;
        }
        let sources: Option<Vec<OwnedSource>> = ranks.iter().map(|&r| source(r)).collect();
        let Some(sources) = sources else { return };
        let holds: Option<Vec<Hold>> = sources.iter().map(|s| s.store.held()).collect();
        let Some(holds) = holds else { return };
        for (src, h) in sources.iter().zip(&holds) {
            // Nothing is being written, so a claimed hold is left over from
            // a write that ended; and a step already on disk (recomputed
            // after a rollback) is not written again.
            if h.claimed || self.last_saved().is_some_and(|s| h.step <= s) {
                src.store.release_hold(*h);
            }
        }
        let step = holds[0].step;
        if holds
            .iter()
            .any(|h| h.step != step || h.claimed || self.last_saved().is_some_and(|s| s >= step))
        {
            return;
        }
        // All or none: a hold replaced meanwhile by a newer step makes this
        // round give back what it claimed.
        let mut claimed = Vec::with_capacity(sources.len());
        for src in &sources {
            match src.store.claim_hold(step) {
                Some(h) => claimed.push((Arc::clone(&src.store), h)),
                None => {
                    for (store, h) in &claimed {
                        store.unclaim_hold(*h);
                    }
                    return;
                }
            }
        }
        if let Some(prev) = self.last_started.filter(|p| *p < step)
            && self.interval > 0
        {
            let passed: Vec<u64> = (prev / self.interval + 1..)
                .map(|k| k * self.interval)
                .take_while(|s| *s < step)
                .collect();
            if !passed.is_empty() {
                tracing::warn!(
                    skipped = ?passed,
                    writing = step,
                    last_save_s = self.last_saved.map(|(_, t)| t),
                    "save steps came faster than checkpoints could be written (a disk slower than the save interval): skipping to the newest held step"
                );
                self.skipped.extend(&passed);
                let extra = self.skipped.len().saturating_sub(SKIPPED_KEPT);
                self.skipped.drain(..extra);
            }
        }
        let bytes = checkpoint_bytes(&sources.iter().map(|s| s.borrow()).collect::<Vec<_>>());
        let (dir, write) = (self.dir.clone(), Arc::clone(&self.write));
        let spawned = std::thread::Builder::new()
            .name("hatrain-persist".into())
            .spawn(move || {
                let borrowed: Vec<RankSource<'_>> = sources.iter().map(|s| s.borrow()).collect();
                let result = write(&borrowed, step, &dir);
                // The slots are free for the workers again at once.
                for (store, h) in &claimed {
                    store.release_hold(*h);
                }
                result
            });
        match spawned {
            Ok(thread) => {
                tracing::debug!(step, "periodic save started");
                self.last_started = Some(step);
                self.writing = Some(Writing {
                    step,
                    bytes,
                    started: Instant::now(),
                    thread,
                });
            }
            Err(e) => {
                // The closure, and with it the claims, is gone: the workers'
                // next holds replace them only once released here.
                for src in ranks.iter().filter_map(|&r| source(r)) {
                    if let Some(h) = src.store.held().filter(|h| h.step == step) {
                        src.store.release_hold(h);
                    }
                }
                self.fail(step, format!("cannot start the writer thread: {e}"));
            }
        }
    }

    /// Waits for the write in progress (before a dump into the same
    /// directory, or at the end of the job).
    pub fn wait(&mut self) {
        self.reap(true);
    }

    /// At the end of a successful job: waits for the write in progress, then
    /// writes the newest step every rank has a verified snapshot of, unless
    /// it is already on disk. That must be the step the ranks finished at
    /// (else the trainer saved it itself, or this is an error). Returns the
    /// final iteration on disk and its directory.
    pub fn finish(&mut self, sources: &[OwnedSource]) -> Result<Option<(u64, PathBuf)>, String> {
        self.wait();
        let result = self.write_final(sources);
        if let Err(m) = &result {
            self.last_error = Some(m.clone());
        }
        result
    }

    fn write_final(&mut self, sources: &[OwnedSource]) -> Result<Option<(u64, PathBuf)>, String> {
        if sources.len() != self.world {
            return Err(format!(
                "the final checkpoint needs all {} ranks, but {} registered",
                self.world,
                sources.len()
            ));
        }
        let per_rank: Vec<Vec<u64>> = sources
            .iter()
            .map(|s| {
                s.store
                    .sealed()
                    .into_iter()
                    .filter_map(|i| s.store.verify(i.slot).ok().map(|v| v.step))
                    .collect()
            })
            .collect();
        // The step every rank completed last.
        let last = sources.iter().map(|s| s.store.step()).min().unwrap_or(0);
        let Some(step) = crate::recovery::consistent_step(&per_rank) else {
            return Err(format!(
                "no step has a verified snapshot on every rank (per rank: {per_rank:?}); the final checkpoint was not written"
            ));
        };
        let on_disk = checkpoint::read_tracker(&self.dir).ok();
        if step < last && on_disk == Some(last) {
            // The trainer saved the final step itself (its snapshot could
            // not be sealed on every rank).
            return Ok(Some((last, self.dir.clone())));
        }
        // Never behind what is on disk: the tracker only moves forward.
        let newer = self.last_saved().is_none_or(|s| s < step)
            && (step == last || on_disk.is_none_or(|t| t < step));
        if newer {
            let borrowed: Vec<RankSource<'_>> = sources.iter().map(|s| s.borrow()).collect();
            let t0 = Instant::now();
            match (self.write)(&borrowed, step, &self.dir) {
                Ok(path) => self.saved(step, &path, checkpoint_bytes(&borrowed), t0),
                Err(e) => {
                    let m = e.to_string();
                    self.fail(step, m.clone());
                    return Err(m);
                }
            }
        }
        if step < last {
            return Err(format!(
                "the final step {last} has no verified snapshot on every rank (per rank: {per_rank:?}); the newest checkpoint written is iteration {step}"
            ));
        }
        Ok(Some((step, self.dir.clone())))
    }

    fn reap(&mut self, block: bool) {
        if !self
            .writing
            .as_ref()
            .is_some_and(|w| block || w.thread.is_finished())
        {
            return;
        }
        let Some(w) = self.writing.take() else { return };
        match w.thread.join() {
            Ok(Ok(path)) => self.saved(w.step, &path, w.bytes, w.started),
            Ok(Err(e)) => self.fail(w.step, e.to_string()),
            Err(_) => self.fail(w.step, "the writer thread panicked".into()),
        }
    }

    fn saved(&mut self, step: u64, path: &Path, bytes: u64, started: Instant) {
        let secs = started.elapsed().as_secs_f64();
        tracing::info!(
            step,
            path = %path.display(),
            seconds = secs,
            gb_per_s = bytes as f64 / secs.max(1e-9) / 1e9,
            "checkpoint written from the snapshots"
        );
        self.last_saved = Some((step, secs));
        self.saves += 1;
        self.last_error = None;
    }

    fn fail(&mut self, step: u64, why: String) {
        tracing::error!(
            step,
            reason = %why,
            previous = ?self.last_saved(),
            "checkpoint from the snapshots failed; the previous checkpoint is intact"
        );
        self.last_error = Some(format!("iteration {step}: {why}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hatrain_shared::model::ModelSize;
    use hatrain_shared::shm::{Geometry, HoldRefused, store_path};
    use std::sync::mpsc;

    /// Two ranks of the tiny model, each with a real store of `slots` slots.
    struct Ranks {
        _dir: tempfile::TempDir,
        sources: Vec<OwnedSource>,
    }

    fn ranks(slots: usize) -> Ranks {
        let dir = tempfile::tempdir().unwrap();
        let model = ModelSize::Tiny.config();
        let numel = model.numel();
        let sources = (0..2)
            .map(|rank| {
                let shard = shard_range(numel, 2, rank).len() as u64;
                let parts: Vec<StatePart> = [
                    ("meta", 24),
                    ("params", numel as u64 * 4),
                    ("exp_avg", shard * 4),
                    ("exp_avg_sq", shard * 4),
                ]
                .into_iter()
                .map(|(name, bytes)| StatePart {
                    name: name.into(),
                    bytes,
                })
                .collect();
                let total = parts.iter().map(|p| p.bytes as usize).sum();
                let store = Store::create(
                    &store_path(dir.path(), rank),
                    rank,
                    Geometry::new(slots, total),
                    1,
                    2,
                )
                .unwrap();
                OwnedSource {
                    rank,
                    store: Arc::new(store),
                    parts,
                    info: CheckpointInfo {
                        model,
                        world_size: 2,
                        save_dir: None,
                        save_interval: 10,
                        args: serde_json::Value::Null,
                    },
                }
            })
            .collect();
        Ranks { _dir: dir, sources }
    }

    /// Seals `step` on every rank (parameters all `step`) and holds it;
    /// returns each rank's hold outcome.
    fn seal(r: &Ranks, step: u64) -> Vec<Result<(), HoldRefused>> {
        r.sources
            .iter()
            .map(|s| {
                let [_, params, m, _] = expected_layout(&s.borrow()).map(|b| b as usize);
                let mut meta = vec![0u8; 24];
                meta[..8].copy_from_slice(&step.to_le_bytes());
                let p = vec![step as f32; params / 4];
                let mv = vec![0.5f32; m / 4];
                let parts: [&[u8]; 4] = [
                    &meta,
                    bytemuck::cast_slice(&p),
                    bytemuck::cast_slice(&mv),
                    bytemuck::cast_slice(&mv),
                ];
                let slot = s.store.writable_slot().expect("a free slot");
                s.store
                    .write_slot(slot, s.rank as u64, step, 0, &parts, &mut |_, _| true)
                    .unwrap();
                s.store.hold(step, slot)
            })
            .collect()
    }

    /// A writer that waits for the test's go-ahead before each checkpoint.
    fn gated(p: &mut Persister) -> (mpsc::Sender<()>, mpsc::Receiver<u64>) {
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (started_tx, started_rx) = mpsc::channel::<u64>();
        let go = std::sync::Mutex::new(go_rx);
        p.write = Arc::new(move |src, step, dir| {
            started_tx.send(step).unwrap();
            go.lock().unwrap().recv().unwrap();
            write_checkpoint(src, step, dir)
        });
        (go_tx, started_rx)
    }

    fn settle(p: &mut Persister, r: &Ranks) {
        for _ in 0..500 {
            p.poll(&[0, 1], |i| Some(r.sources[i].clone()));
            if p.writing.is_none() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        panic!("the write did not finish");
    }

    #[test]
    fn a_slow_disk_skips_to_the_newest_held_step_and_never_queues() {
        let r = ranks(3);
        let out = tempfile::tempdir().unwrap();
        let mut p = Persister::new(out.path().to_path_buf(), 10, 2);
        let (go, started) = gated(&mut p);
        let poll = |p: &mut Persister| p.poll(&[0, 1], |i| Some(r.sources[i].clone()));

        // Only rank 0 holds step 10: nothing starts, nothing is claimed.
        seal(&r, 5);
        let s = &r.sources;
        s[1].store.release_hold(s[1].store.held().unwrap());
        s[0].store.release_hold(s[0].store.held().unwrap());
        assert!(seal(&r, 10).iter().all(Result::is_ok));
        let h1 = s[1].store.held().unwrap();
        s[1].store.release_hold(h1);
        poll(&mut p);
        assert!(p.writing.is_none() && !s[0].store.held().unwrap().claimed);
        s[1].store.hold(10, h1.slot).unwrap();
        poll(&mut p);
        assert_eq!(started.recv().unwrap(), 10);
        assert!(s.iter().all(|x| x.store.held().unwrap().claimed));

        // The disk is slow: step 20 is sealed meanwhile but cannot be held,
        // and the held slot is never the one rewritten.
        let refused = seal(&r, 20);
        assert!(
            refused
                .iter()
                .all(|h| matches!(h, Err(HoldRefused::Busy(b)) if b.step == 10))
        );
        assert!(seal(&r, 21).iter().all(Result::is_err));
        for x in s {
            let h = x.store.held().unwrap();
            assert_eq!((h.step, x.store.verify(h.slot).unwrap().step), (10, 10));
        }
        poll(&mut p);
        assert_eq!(p.report().writing, Some(10));
        go.send(()).unwrap();
        settle(&mut p, &r);
        let rep = p.report();
        assert_eq!(
            (rep.last_saved, rep.saves, rep.writing),
            (Some(10), 1, None)
        );
        assert!(s.iter().all(|x| x.store.held().is_none()), "released");

        // The next held step is 40: 20 and 30 were passed over and said so.
        assert!(seal(&r, 40).iter().all(Result::is_ok));
        poll(&mut p);
        assert_eq!(started.recv().unwrap(), 40);
        go.send(()).unwrap();
        settle(&mut p, &r);
        let rep = p.report();
        assert_eq!(rep.skipped, vec![20, 30]);
        assert_eq!((rep.last_saved, rep.saves), (Some(40), 2));

        // What was written is a checkpoint the loader reads, at another
        // world size too, with the held step's contents.
        assert_eq!(checkpoint::read_tracker(out.path()).unwrap(), 40);
        let model = s[0].info.model;
        for it in [10u64, 40] {
            let all =
                checkpoint::load_shard(out.path(), it, &model, 0..model.numel(), true).unwrap();
            assert_eq!((all.iteration, all.saved_world_size), (it, 2));
            assert!(all.params.iter().all(|v| *v == it as f32));
        }

        // A step already on disk (held again after a rollback) is released,
        // not written twice.
        assert!(seal(&r, 40).iter().all(Result::is_ok));
        poll(&mut p);
        assert!(p.writing.is_none());
        assert!(s.iter().all(|x| x.store.held().is_none()));
        drop(go);
    }

    /// Two ranks that sealed steps 7 and 8 and finished at 8, and a
    /// final-only persister into a fresh directory.
    fn finished() -> (Ranks, tempfile::TempDir, Persister) {
        let r = ranks(2);
        let out = tempfile::tempdir().unwrap();
        let p = Persister::new(out.path().to_path_buf(), 0, 2);
        seal(&r, 7);
        seal(&r, 8);
        for x in &r.sources {
            x.store.set_step(8);
        }
        (r, out, p)
    }

    #[test]
    fn finish_writes_the_final_step_once_and_says_when_it_cannot() {
        let (r, out, mut p) = finished();
        let done = Some((8, out.path().to_path_buf()));
        assert_eq!(p.finish(&r.sources).unwrap(), done);
        assert_eq!(checkpoint::read_tracker(out.path()).unwrap(), 8);
        assert_eq!(p.finish(&r.sources).unwrap(), done);
        assert_eq!(p.report().saves, 1, "not written twice");
        let e = p.finish(&r.sources[..1]).unwrap_err();
        assert!(e.contains("all 2 ranks"), "{e}");

        // Rank 1's final snapshot is corrupt: step 7 is the newest every
        // rank has; it is written, and the missing final step is an error.
        let (r, out, mut p) = finished();
        let slot8 = r.sources[1].store.find_step(8).unwrap().slot;
        r.sources[1].store.corrupt_slot_byte(slot8, 100);
        let e = p.finish(&r.sources).unwrap_err();
        assert!(
            e.contains("final step 8") && e.contains("iteration 7"),
            "{e}"
        );
        assert_eq!(checkpoint::read_tracker(out.path()).unwrap(), 7);
        assert_eq!(p.report().last_error.as_deref(), Some(e.as_str()));
    }
}
