//! The runtime's two background threads: the commit thread, which copies
//! each requested snapshot into a free slot while the next step computes,
//! and the watcher, which aborts the communicator when the agent pauses
//! the job.

use crate::buffer::Buffer;
use crate::comm::{Abort, Hooks};
use hatrain_shared::shm::{Directive, Store};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
pub(super) struct CommitProgress {
    pub(super) requested: u64,
    pub(super) done: u64,
    pub(super) last_error: Option<String>,
    /// The step of the newest snapshot sealed.
    pub(super) sealed: Option<u64>,
}

pub(super) struct CommitJob {
    pub(super) step: u64,
    pub(super) epoch: u64,
    pub(super) meta: Vec<u8>,
    pub(super) seq: u64,
    /// Repaired UCEs when the commit was asked for: the state is known good
    /// then, and a copy that sees the count change is not sealed.
    pub(super) uces: u64,
    /// Hold the sealed snapshot for the agent's persister.
    pub(super) hold: bool,
    /// The final step: its snapshot is never skipped.
    pub(super) last: bool,
}

/// The commit thread: copies each requested snapshot (its held ranges of
/// `bufs`) into a free slot and seals it, until the channel closes.
pub(super) fn commit_loop(
    rx: mpsc::Receiver<CommitJob>,
    store: &Store,
    bufs: &[Buffer],
    held: &[std::ops::Range<usize>],
    progress: &(Mutex<CommitProgress>, Condvar),
    hooks: &dyn Hooks,
    rank: u64,
) {
    // Whether a hold has cost a snapshot yet (said once).
    let mut said_blocked = false;
    while let Ok(job) = rx.recv() {
        let t = Instant::now();
        let result = match free_slot(store, &job) {
            Some(slot) => {
                hooks.before_copy(job.step);
                let guards: Vec<_> = bufs.iter().map(Buffer::read).collect();
                let mut parts: Vec<&[u8]> = vec![&job.meta];
                parts.extend(guards.iter().zip(held).map(|(g, h)| g.bytes(h.clone())));
                let mut halfway = false;
                let uces = job.uces;
                store
                    .write_slot(slot, rank, job.step, job.epoch, &parts, &mut |at, len| {
                        if !halfway && at * 2 >= len {
                            halfway = true;
                            hooks.commit_halfway(job.step);
                        }
                        // A UCE repaired meanwhile may have zeroed bytes being
                        // copied.
                        crate::uce::count() == uces
                    })
                    .map(|info| {
                        // Refused only while the agent still writes an older
                        // step; it then skips to a newer one and says so.
                        if job.hold {
                            let _ = store.page().hold(job.step, info.slot);
                        }
                        Some(job.step)
                    })
                    .map_err(|e| e.to_string())
            }
            None => {
                if !said_blocked && let Some(h) = store.page().held() {
                    said_blocked = true;
                    eprintln!(
                        "rank {rank}: snapshot of step {} skipped: its slot is held while the agent writes iteration {} to disk (with --snapshot-slots 3 snapshots go on meanwhile; said once)",
                        job.step, h.step
                    );
                }
                Ok(None)
            }
        };
        let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
        store.page().record_commit(ns);
        let (lock, cv) = progress;
        let mut p = lock.lock().unwrap_or_else(|p| p.into_inner());
        p.done = job.seq;
        match result {
            Ok(Some(step)) => p.sealed = Some(step),
            Ok(None) => {}
            Err(e) => p.last_error = Some(e),
        }
        cv.notify_all();
    }
}

/// The slot for `job`'s snapshot, when every slot but the newest is held
/// for the persister: a save step takes the place of an unclaimed hold (the
/// persister skips to the newest), and the final step waits for a claimed
/// one to be written out; any other step is not snapshotted (`None`).
fn free_slot(store: &Store, job: &CommitJob) -> Option<usize> {
    loop {
        if let Some(slot) = store.writable_slot() {
            return Some(slot);
        }
        let h = store.page().held()?;
        if !job.hold {
            return None;
        }
        if !h.claimed {
            store.page().release_hold(h);
        } else if job.last {
            // Alive, not hung: the training loop waits for this commit.
            store.page().beat();
            thread::sleep(Duration::from_millis(1));
        } else {
            return None;
        }
    }
}

pub(super) fn watch_loop(
    store: &Store,
    abort: &Mutex<Option<Arc<dyn Abort>>>,
    handled: &AtomicU64,
    stop: &AtomicBool,
) {
    let mut aborted_for = 0;
    while !stop.load(Ordering::SeqCst) {
        let mut seq = store.page().directive_seq();
        if seq != handled.load(Ordering::Acquire) && seq != aborted_for {
            let (now, d) = store.page().directive();
            seq = now;
            if matches!(d, Directive::Pause { .. } | Directive::Stop) {
                if let Some(h) = abort.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                    h.abort();
                }
                aborted_for = seq;
            }
        }
        // Asleep until the next post (or the runtime's stop) wakes it: no
        // CPU taken from the training between steps. The limit only
        // bounds a wake that is missed.
        store.page().wait_directive(seq, Duration::from_millis(200));
    }
}
