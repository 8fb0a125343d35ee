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
    /// The step of the newest requested snapshot.
    pub(super) requested_step: u64,
    pub(super) done: u64,
    pub(super) last_error: Option<String>,
    /// The step of the newest snapshot sealed.
    pub(super) sealed: Option<u64>,
    /// The newest requested snapshot may be skipped when it misses its
    /// window (not a checkpoint's, not the final or the starting one).
    pub(super) skippable: bool,
    /// The commit whose bytes are being copied now (0: none): the
    /// start-update fence waits for a copy it abandons to let go of the
    /// buffers, not for one that has not begun.
    pub(super) copying: u64,
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

/// What the commit thread shares with the runtime.
pub(super) struct Committer {
    pub(super) store: Arc<Store>,
    pub(super) bufs: Vec<Buffer>,
    pub(super) held: Arc<Vec<std::ops::Range<usize>>>,
    pub(super) progress: Arc<(Mutex<CommitProgress>, Condvar)>,
    /// Commits numbered up to this one are abandoned (they missed their
    /// window; see [`super::Window`]).
    pub(super) cancel: Arc<AtomicU64>,
    pub(super) hooks: Arc<dyn Hooks>,
    pub(super) rank: u64,
}

/// How one commit ended.
enum Outcome {
    /// Sealed: its step, its bytes, and the commit thread's CPU time for it.
    Sealed {
        step: u64,
        bytes: u64,
        cpu_ns: u64,
    },
    /// Not taken: its slot was held for the persister, or it missed its
    /// window.
    Skipped,
    Failed(String),
}

/// The commit thread: copies each requested snapshot (its held ranges of
/// the buffers) into a free slot and seals it, until the channel closes.
pub(super) fn commit_loop(rx: mpsc::Receiver<CommitJob>, c: &Committer) {
    no_wakeup_preemption();
    let (store, rank) = (&*c.store, c.rank);
    // Whether a hold has cost a snapshot yet (said once).
    let mut said_blocked = false;
    while let Ok(job) = rx.recv() {
        let t = Instant::now();
        let cpu = hatrain_shared::thread_cpu_ns();
        let cancelled = || job.seq <= c.cancel.load(Ordering::Acquire);
        let outcome = match free_slot(store, &job) {
            Some(_) if cancelled() => Outcome::Skipped,
            Some(slot) => 'copy: {
                c.hooks.before_copy(job.step);
                {
                    // Abandoned while it waited: the buffers may be changing.
                    let mut p = c.progress.0.lock().unwrap_or_else(|p| p.into_inner());
                    if cancelled() {
                        break 'copy Outcome::Skipped;
                    }
                    p.copying = job.seq;
                }
                let guards: Vec<_> = c.bufs.iter().map(Buffer::read).collect();
                let mut parts: Vec<&[u8]> = vec![&job.meta];
                parts.extend(
                    guards
                        .iter()
                        .zip(c.held.iter())
                        .map(|(g, h)| g.bytes(h.clone())),
                );
                let mut halfway = false;
                let uces = job.uces;
                let written =
                    store.write_slot(slot, rank, job.step, job.epoch, &parts, &mut |at, len| {
                        if !halfway && at * 2 >= len {
                            halfway = true;
                            c.hooks.commit_halfway(job.step);
                        }
                        // A UCE repaired meanwhile may have zeroed bytes being
                        // copied; a copy that missed its window is abandoned.
                        crate::uce::count() == uces && !cancelled()
                    });
                match written {
                    Ok(info) => {
                        // Refused only while the agent still writes an older
                        // step; it then skips to a newer one and says so.
                        if job.hold {
                            let _ = store.page().hold(job.step, info.slot);
                        }
                        Outcome::Sealed {
                            step: job.step,
                            bytes: info.len,
                            cpu_ns: hatrain_shared::thread_cpu_ns().saturating_sub(cpu),
                        }
                    }
                    Err(_) if cancelled() => Outcome::Skipped,
                    Err(e) => Outcome::Failed(e.to_string()),
                }
            }
            None => {
                store.page().record_thinned();
                if !said_blocked {
                    said_blocked = true;
                    let page = store.page();
                    match (page.held(), page.kept().common) {
                        (Some(h), _) => eprintln!(
                            "rank {rank}: snapshot of step {} skipped: its slot is held while the agent writes iteration {} to disk (with --snapshot-slots 3 snapshots go on meanwhile; said once)",
                            job.step, h.step
                        ),
                        (None, Some(k)) => eprintln!(
                            "rank {rank}: snapshot of step {} skipped: steps are kept for the peer replicas (step {k} held by all, and the next), which lag (snapshots thin out until they catch up; said once)",
                            job.step
                        ),
                        (None, None) => {}
                    }
                }
                Outcome::Skipped
            }
        };
        if matches!(outcome, Outcome::Skipped) && cancelled() {
            store.page().record_skipped();
        }
        let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
        store.page().record_commit(ns);
        if let Outcome::Sealed { bytes, cpu_ns, .. } = outcome {
            store.page().record_sealed(ns, bytes, cpu_ns);
        }
        let (lock, cv) = &*c.progress;
        let mut p = lock.lock().unwrap_or_else(|p| p.into_inner());
        p.done = job.seq;
        p.copying = 0;
        match outcome {
            Outcome::Sealed { step, .. } => p.sealed = Some(step),
            Outcome::Skipped => {}
            Outcome::Failed(e) => p.last_error = Some(e),
        }
        cv.notify_all();
    }
}

/// Makes the calling (commit) thread `SCHED_BATCH`: the same nice value
/// and share of the CPU, but a batch thread that wakes never preempts the
/// running one (sched(7)). Without it, the hand-off that wakes the commit
/// thread could give it the training thread's core at once, holding the
/// training thread 1-10 ms in `Runtime::commit` while the copy began;
/// now the copy starts on an idle core, or at the next tick.
fn no_wakeup_preemption() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: a plain system call with a pointer to a live sched_param;
    // pid 0 is the calling thread (the policy is per thread on Linux).
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) } != 0 {
        eprintln!(
            "hatrain: the snapshot thread keeps its scheduling policy: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// The slot for `job`'s snapshot. When every slot but the newest is held,
/// the job's last step takes the one kept for the replicas; when one is
/// held for the persister, a save step takes the place of an unclaimed hold (the
/// persister skips to the newest), and the final step waits for a claimed
/// one to be written out; any other step is not snapshotted (`None`).
fn free_slot(store: &Store, job: &CommitJob) -> Option<usize> {
    loop {
        if let Some(slot) = store.writable_slot() {
            return Some(slot);
        }
        if job.last
            && let Some(slot) = store.writable_slot_keeping(false)
        {
            // The job's last step: the checkpoint at its end takes it.
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
