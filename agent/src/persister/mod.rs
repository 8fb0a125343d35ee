//! Writes checkpoints from the ranks' snapshot stores, off the training
//! path: the periodic and final saves ([`Persister`]) and the last-words
//! dump.
//!
//! What a snapshot holds and how it becomes a checkpoint comes from the
//! rank's registered [`StateMap`](hatrain_shared::statemap::StateMap) alone; the agent knows no model. Each rank
//! directory is written with the same function the trainer's own save uses
//! ([`checkpoint::write_rank`]), with the atomicity of
//! `hatrain_shared::checkpoint`, so `--load` reads the result.
//!
//! - [`write`]: one checkpoint from the snapshots of every rank.

mod write;

pub use write::{
    OwnedSource, PersistError, RankSource, checkpoint_bytes, write_checkpoint, write_ranks,
    write_share,
};

use hatrain_shared::checkpoint;
use hatrain_shared::control::PersistReport;
use hatrain_shared::shm::Hold;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::recovery::{WriteFailed, Written};

/// Pauses between the tries of a write that failed for a transient
/// reason ([`PersistError::is_transient`]): about 6 s in all, while the
/// claimed snapshot stays put.
const RETRY_PAUSES: [Duration; 6] = [
    Duration::from_millis(100),
    Duration::from_millis(200),
    Duration::from_millis(400),
    Duration::from_millis(800),
    Duration::from_millis(1600),
    Duration::from_millis(3200),
];

/// Runs `write`, and again after each of [`RETRY_PAUSES`] while it fails
/// for a transient reason.
fn with_retries<T>(
    step: u64,
    mut write: impl FnMut() -> Result<T, PersistError>,
) -> Result<T, PersistError> {
    let mut pauses = RETRY_PAUSES.iter();
    loop {
        match write() {
            Err(e) if e.is_transient() => match pauses.next() {
                Some(p) => {
                    tracing::warn!(step, error = %crate::error_chain(&e), retry_in_ms = p.as_millis() as u64, "a checkpoint write failed for a reason that may pass: trying again");
                    std::thread::sleep(*p);
                }
                None => return Err(e),
            },
            r => return r,
        }
    }
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
    /// Writes the periodic saves (else only dumps and nothing at the end).
    periodic: bool,
    /// Writes only this host's share of each periodic save (a job of
    /// several hosts): its ranks' directories, into the iteration's `_tmp`
    /// directory, which the job's controller commits once every rank's is
    /// written.
    part: bool,
    /// The periodic shares written (or failed) since last taken.
    shares_done: Vec<(u64, Result<f64, WriteFailed>)>,
    writing: Option<Writing>,
    /// A dump waiting for the write in progress: its epoch, step, sources
    /// and share.
    pending_dump: Option<(u64, u64, Vec<OwnedSource>, Share)>,
    last_saved: Option<(u64, f64)>,
    last_started: Option<u64>,
    saves: u64,
    /// Bytes of every checkpoint written.
    bytes_written: u64,
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
    /// `Some(epoch)` for a dump the recovery machine waits for.
    dump: Option<u64>,
    /// This host's share of a checkpoint several hosts write.
    part: bool,
    thread: JoinHandle<Result<PathBuf, PersistError>>,
}

/// What a dump writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Share {
    /// The whole checkpoint: every rank's snapshot is on this host.
    Whole,
    /// These ranks' directories, into the `_tmp` directory of the
    /// iteration that the job's controller made; the controller commits
    /// the checkpoint once every host wrote its share.
    Part(Vec<usize>),
}

/// A dump's write that finished: the epoch it was asked for under, and the
/// checkpoint or why not.
#[derive(Debug, Clone, PartialEq)]
pub struct DumpDone {
    pub epoch: u64,
    pub result: Result<Written, WriteFailed>,
    /// It wrote this host's share only ([`Share::Part`]).
    pub part: bool,
}

/// Each rank's verified snapshot steps, and the step every rank completed
/// last.
fn final_steps(sources: &[OwnedSource]) -> (Vec<Vec<u64>>, u64) {
    let per_rank = sources.iter().map(|s| s.store.verified_steps().0).collect();
    let last = sources
        .iter()
        .map(|s| s.store.page().step())
        .min()
        .unwrap_or(0);
    (per_rank, last)
}

/// Save steps listed in a report at most (the newest).
const SKIPPED_KEPT: usize = 64;

impl Persister {
    /// Writes the checkpoints of a `world`-rank job into `dir`: with
    /// `periodic`, every `interval` steps (0: only the last), else only the
    /// dumps it is given.
    pub fn new(dir: PathBuf, interval: u64, world: usize, periodic: bool) -> Self {
        Self {
            dir,
            write: Arc::new(write_checkpoint),
            interval,
            world,
            periodic,
            part: false,
            shares_done: Vec::new(),
            writing: None,
            pending_dump: None,
            last_saved: None,
            last_started: None,
            saves: 0,
            bytes_written: 0,
            skipped: Vec::new(),
            last_error: None,
        }
    }

    /// Writes only this host's share of each periodic save, for the
    /// controller to commit (a job of several hosts).
    pub fn in_part(mut self) -> Self {
        self.part = true;
        self
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The periodic shares written (each step, and its seconds or why
    /// not) since the last call.
    pub fn take_shares(&mut self) -> Vec<(u64, Result<f64, WriteFailed>)> {
        std::mem::take(&mut self.shares_done)
    }

    /// The ranks of the checkpoints it writes.
    pub fn world(&self) -> usize {
        self.world
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
            bytes_written: self.bytes_written,
        }
    }

    /// Whether it writes the periodic saves.
    pub fn periodic(&self) -> bool {
        self.periodic
    }

    /// Whether it writes only its host's share of each periodic save.
    pub fn in_parts(&self) -> bool {
        self.part
    }

    /// Queues a dump of iteration `step` from `sources` (asked for under
    /// `epoch`); it starts once no other write runs, so there is one writer
    /// per directory. Its result comes from [`Persister::poll`].
    pub fn dump(&mut self, epoch: u64, step: u64, sources: Vec<OwnedSource>, share: Share) {
        self.pending_dump = Some((epoch, step, sources, share));
    }

    /// Collects a finished write, then starts a queued dump, or the next
    /// periodic save when every rank holds the same new step. `source`
    /// gives a rank's store and layout. Returns the dumps that finished.
    pub fn poll(
        &mut self,
        ranks: &[usize],
        source: impl Fn(usize) -> Option<OwnedSource>,
    ) -> Vec<DumpDone> {
        let mut done: Vec<DumpDone> = self.reap(false).into_iter().collect();
        if self.writing.is_none() {
            done.extend(self.start_dump());
        }
        let all = if self.part {
            !ranks.is_empty()
        } else {
            ranks.len() == self.world
        };
        if self.writing.is_some() || !self.periodic || !all {
            return done;
        }
        self.start_periodic(ranks, source);
        done
    }

    /// Starts the queued dump, or finishes it at once when the step (or a
    /// newer one) is already on disk.
    fn start_dump(&mut self) -> Option<DumpDone> {
        let (epoch, step, sources, share) = self.pending_dump.take()?;
        let part = share != Share::Whole;
        if let Some(on_disk) = self.last_saved().filter(|d| *d >= step && !part) {
            return Some(DumpDone {
                epoch,
                result: Ok(Written {
                    iteration: on_disk,
                    dir: self.dir.clone(),
                    written: false,
                    seconds: 0.0,
                }),
                part,
            });
        }
        let bytes = checkpoint_bytes(&sources.iter().map(|s| s.borrow()).collect::<Vec<_>>());
        let (dir, write) = (self.dir.clone(), Arc::clone(&self.write));
        let spawned = std::thread::Builder::new()
            .name("hatrain-dump".into())
            .spawn(move || {
                let borrowed: Vec<RankSource<'_>> = sources.iter().map(|s| s.borrow()).collect();
                match share {
                    Share::Whole => with_retries(step, || write(&borrowed, step, &dir)),
                    Share::Part(ranks) => {
                        let tmp = checkpoint::tmp_iter_dir(&dir, step);
                        write_ranks(&borrowed, &ranks, step, &tmp).map(|()| tmp)
                    }
                }
            });
        match spawned {
            Ok(thread) => {
                self.writing = Some(Writing {
                    step,
                    bytes,
                    started: Instant::now(),
                    dump: Some(epoch),
                    part,
                    thread,
                });
                None
            }
            Err(e) => Some(DumpDone {
                epoch,
                result: Err(format!("cannot start the writer thread: {e}").into()),
                part,
            }),
        }
    }

    fn start_periodic(&mut self, ranks: &[usize], source: impl Fn(usize) -> Option<OwnedSource>) {
        let sources: Option<Vec<OwnedSource>> = ranks.iter().map(|&r| source(r)).collect();
        let Some(sources) = sources else { return };
        let holds: Option<Vec<Hold>> = sources.iter().map(|s| s.store.page().held()).collect();
        let Some(holds) = holds else { return };
        for (src, h) in sources.iter().zip(&holds) {
            // Nothing is being written, so a claimed hold is left over from
            // a write that ended; and a step already on disk (recomputed
            // after a rollback) is not written again.
            if h.claimed || self.last_saved().is_some_and(|s| h.step <= s) {
                src.store.page().release_hold(*h);
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
            match src.store.page().claim_hold(step) {
                Some(h) => claimed.push((Arc::clone(&src.store), h)),
                None => {
                    for (store, h) in &claimed {
                        store.page().unclaim_hold(*h);
                    }
                    return;
                }
            }
        }
        self.note_skipped(step);
        let bytes = checkpoint_bytes(&sources.iter().map(|s| s.borrow()).collect::<Vec<_>>());
        let (dir, write, part) = (self.dir.clone(), Arc::clone(&self.write), self.part);
        let spawned = std::thread::Builder::new()
            .name("hatrain-persist".into())
            .spawn(move || {
                let borrowed: Vec<RankSource<'_>> = sources.iter().map(|s| s.borrow()).collect();
                let result = with_retries(step, || {
                    if part {
                        write_share(&borrowed, step, &dir)
                    } else {
                        write(&borrowed, step, &dir)
                    }
                });
                // The slots are free for the workers again at once.
                for (store, h) in &claimed {
                    store.page().release_hold(*h);
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
                    dump: None,
                    part,
                    thread,
                });
            }
            Err(e) => {
                // The closure, and with it the claims, is gone: the workers'
                // next holds replace them only once released here.
                for src in ranks.iter().filter_map(|&r| source(r)) {
                    if let Some(h) = src.store.page().held().filter(|h| h.step == step) {
                        src.store.page().release_hold(h);
                    }
                }
                let _ = self.fail(step, format!("cannot start the writer thread: {e}"));
            }
        }
    }

    /// Waits for the write in progress (before a dump into the same
    /// directory, or at the end of the job).
    pub fn wait(&mut self) {
        let _ = self.reap(true);
    }

    /// At the end of a successful job: waits for the write in progress, then
    /// writes the newest step every rank has a verified snapshot of, unless
    /// it is already on disk. That must be the step the ranks finished at
    /// (else the trainer saved it itself, or this is an error). Returns the
    /// final iteration on disk and its directory.
    pub fn finish(
        &mut self,
        sources: &[OwnedSource],
    ) -> Result<Option<(u64, PathBuf)>, PersistError> {
        self.wait();
        let result = self.write_final(sources);
        if let Err(e) = &result {
            self.last_error = Some(e.to_string());
        }
        result
    }

    /// At the end of a successful job of several hosts: waits for the
    /// write in progress, then writes this host's share of the final step
    /// (every rank of it finished there with a verified snapshot), unless
    /// it wrote it already. Returns that step; an error when some rank's
    /// final snapshot is not verified (then the trainer saves it itself).
    pub fn finish_part(&mut self, sources: &[OwnedSource]) -> Result<u64, PersistError> {
        self.wait();
        let (per_rank, last) = final_steps(sources);
        if crate::recovery::consistent_step(&per_rank) != Some(last) {
            return Err(PersistError::FinalStepMissing {
                last,
                written: self.last_saved().unwrap_or(0),
                per_rank,
            });
        }
        if self.last_saved() == Some(last) {
            return Ok(last);
        }
        let borrowed: Vec<RankSource<'_>> = sources.iter().map(|s| s.borrow()).collect();
        let t0 = Instant::now();
        match with_retries(last, || write_share(&borrowed, last, &self.dir)) {
            Ok(path) => {
                self.saved(last, &path, checkpoint_bytes(&borrowed), t0, true);
                Ok(last)
            }
            Err(e) => {
                let _ = self.fail(last, e.to_string());
                Err(e)
            }
        }
    }

    /// Says which save steps between the last write started and `step`
    /// (which is about to be written) were never written: the disk was
    /// slower than the save interval, and their holds were replaced or
    /// refused while a write ran.
    fn note_skipped(&mut self, step: u64) {
        let Some(prev) = self.last_started.filter(|p| *p < step) else {
            return;
        };
        if self.interval == 0 {
            return;
        }
        let passed: Vec<u64> = (prev / self.interval + 1..)
            .map(|k| k * self.interval)
            .take_while(|s| *s < step)
            .collect();
        if passed.is_empty() {
            return;
        }
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

    fn write_final(
        &mut self,
        sources: &[OwnedSource],
    ) -> Result<Option<(u64, PathBuf)>, PersistError> {
        if sources.len() != self.world {
            let mut have: Vec<usize> = sources.iter().map(|s| s.rank).collect();
            have.sort();
            return Err(PersistError::MissingRanks {
                world: self.world,
                have,
            });
        }
        let (per_rank, last) = final_steps(sources);
        let Some(step) = crate::recovery::consistent_step(&per_rank) else {
            return Err(PersistError::NoCommonStep { per_rank });
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
            self.note_skipped(step);
            self.last_started = Some(step);
            let borrowed: Vec<RankSource<'_>> = sources.iter().map(|s| s.borrow()).collect();
            let t0 = Instant::now();
            match with_retries(step, || (self.write)(&borrowed, step, &self.dir)) {
                Ok(path) => {
                    self.saved(step, &path, checkpoint_bytes(&borrowed), t0, true);
                }
                Err(e) => {
                    let _ = self.fail(step, e.to_string());
                    return Err(e);
                }
            }
        }
        if step < last {
            return Err(PersistError::FinalStepMissing {
                last,
                written: step,
                per_rank,
            });
        }
        Ok(Some((step, self.dir.clone())))
    }

    /// Collects the write in progress if it finished (or, with `block`,
    /// waits for it); returns it if it was a dump.
    fn reap(&mut self, block: bool) -> Option<DumpDone> {
        if !self
            .writing
            .as_ref()
            .is_some_and(|w| block || w.thread.is_finished())
        {
            return None;
        }
        let w = self.writing.take()?;
        let result = match w.thread.join() {
            Ok(Ok(path)) if w.part && w.dump.is_some() => {
                let secs = w.started.elapsed().as_secs_f64();
                tracing::info!(step = w.step, path = %path.display(), seconds = secs, "this host's share of the checkpoint written from the snapshots");
                Ok(secs)
            }
            Ok(Ok(path)) => Ok(self.saved(w.step, &path, w.bytes, w.started, w.dump.is_none())),
            Ok(Err(e)) => Err(WriteFailed(self.fail(w.step, e.to_string()))),
            Err(_) => Err(WriteFailed(
                self.fail(w.step, "the writer thread panicked".into()),
            )),
        };
        if w.part && w.dump.is_none() {
            self.shares_done.push((w.step, result.clone()));
        }
        let epoch = w.dump?;
        Some(DumpDone {
            epoch,
            result: result.map(|seconds| Written {
                iteration: w.step,
                dir: self.dir.clone(),
                written: true,
                seconds,
            }),
            part: w.part,
        })
    }

    /// Records a checkpoint on disk; returns how long it took.
    fn saved(
        &mut self,
        step: u64,
        path: &Path,
        bytes: u64,
        started: Instant,
        periodic: bool,
    ) -> f64 {
        let secs = started.elapsed().as_secs_f64();
        tracing::info!(
            step,
            path = %path.display(),
            seconds = secs,
            gb_per_s = bytes as f64 / secs.max(1e-9) / 1e9,
            "{} written from the snapshots",
            if self.part { "this host's share of a checkpoint" } else { "checkpoint" }
        );
        self.last_saved = Some((step, secs));
        self.bytes_written += bytes;
        if periodic {
            self.saves += 1;
        }
        self.last_error = None;
        secs
    }

    /// Records a failed write; returns the message.
    fn fail(&mut self, step: u64, why: String) -> String {
        if self.part {
            tracing::error!(
                step,
                reason = %why,
                "this host's share of a checkpoint from the snapshots failed; the step is not committed, the previous checkpoint is intact"
            );
        } else {
            tracing::error!(
                step,
                reason = %why,
                previous = ?self.last_saved(),
                "checkpoint from the snapshots failed; the previous checkpoint is intact"
            );
        }
        self.last_error = Some(format!("iteration {step}: {why}"));
        why
    }
}

#[cfg(test)]
mod tests;
