//! What the training thread pays for hatrain in each step, and the window a
//! snapshot's copy has.
//!
//! A snapshot of step `s` is copied by the commit thread while step `s + 1`
//! computes its forward and backward passes: the state does not change
//! until that step's update begins. The start-update fence closes the
//! window. A copy still running then is waited for ([`Window::Wait`], the
//! default: every requested snapshot is taken), or, with
//! [`Window::Skip`], abandoned after the piece being copied (at most
//! 64 KiB more are read), left unsealed and counted as skipped: training
//! does not wait, and the newest sealed snapshot stays the one before.
//! After `max_misses` skips in a row the fence waits for the next copy, so
//! a copy that never fits its window still leaves a snapshot every
//! `max_misses + 1` requests. Snapshots held for the agent's checkpoints
//! and the final step's are always waited for.
//!
//! The time the training thread spends inside the runtime's per-step calls
//! (the step boundary and its directive check, the UCE checks, both update
//! fences, the commit hand-off) is summed per step and recorded in the
//! control page at the next step boundary.

use super::Runtime;
use hatrain_shared::shm::{Directive, Phase};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What the start-update fence does with a snapshot copy still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Window {
    /// Wait for it.
    #[default]
    Wait,
    /// Abandon it and count it as skipped, except after `max_misses`
    /// skips in a row.
    Skip { max_misses: u32 },
}

/// A snapshot window that is not `wait`, `skip` or `skip:N`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WindowError {
    #[error("snapshot window {0:?}: N of skip:N must be a whole number")]
    Misses(String),
    #[error("snapshot window {0:?}: expected wait, skip or skip:N")]
    Unknown(String),
}

impl std::str::FromStr for Window {
    type Err = WindowError;

    /// `wait`, `skip` (at most 4 misses in a row) or `skip:N`.
    fn from_str(s: &str) -> Result<Self, WindowError> {
        match s.split_once(':') {
            None if s == "wait" => Ok(Self::Wait),
            None if s == "skip" => Ok(Self::Skip { max_misses: 4 }),
            Some(("skip", n)) => n
                .parse()
                .map(|max_misses| Self::Skip { max_misses })
                .map_err(|_| WindowError::Misses(s.into())),
            _ => Err(WindowError::Unknown(s.into())),
        }
    }
}

impl std::fmt::Display for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Wait => f.write_str("wait"),
            Self::Skip { max_misses } => write!(f, "skip:{max_misses}"),
        }
    }
}

/// Nanoseconds the training thread has spent in the runtime's calls since
/// the current step began.
#[derive(Debug, Default)]
pub(super) struct HeldClock {
    ns: AtomicU64,
    /// Whether a step has begun since the last [`HeldClock::take`].
    open: AtomicBool,
}

impl HeldClock {
    pub(super) fn add(&self, since: Instant) {
        let ns = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// The step's total, if a step was open, and a new count.
    pub(super) fn take(&self, open_next: bool) -> Option<u64> {
        let was_open = self.open.swap(open_next, Ordering::Relaxed);
        let ns = self.ns.swap(0, Ordering::Relaxed);
        was_open.then_some(ns)
    }
}

impl Runtime {
    /// How the start-update fence treats a snapshot copy still running
    /// (see [`Window`]).
    pub fn set_snapshot_window(&mut self, window: Window) {
        self.window = window;
    }

    /// Records the last step's held time and opens the next step's.
    pub(super) fn close_held_step(&self, open_next: bool) {
        let Some(a) = &self.attached else { return };
        if let Some(ns) = self.held_clock.take(open_next) {
            a.store.page().record_held(ns);
        }
    }

    /// Start-update fence: waits for the running snapshot copy (the update
    /// may now change the state), then marks the state as being updated.
    pub fn start_update(&self) {
        if let Some(a) = &self.attached {
            let t = Instant::now();
            self.time_fence();
            self.close_window();
            let blocked = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
            a.store.page().record_commit_blocking(blocked);
            a.store.page().set_phase(Phase::Updating);
            self.time_update_begins();
            self.held_clock.add(t);
        }
    }

    /// End-update fence: the state is consistent again at `step`.
    pub fn end_update(&self, step: u64) {
        if let Some(a) = &self.attached {
            let t = Instant::now();
            a.store.page().set_step(step);
            a.store.page().set_phase(Phase::Computing);
            self.time_fence();
            self.held_clock.add(t);
        }
    }

    /// Waits until the last requested snapshot is sealed (or failed).
    pub fn wait_commit(&self) {
        let Some(a) = &self.attached else { return };
        let (lock, cv) = &*a.progress;
        let mut p = lock.lock().unwrap_or_else(|p| p.into_inner());
        while p.done < p.requested {
            p = cv.wait(p).unwrap_or_else(|p| p.into_inner());
        }
        if let Some(e) = p.last_error.take() {
            eprintln!("rank {}: snapshot commit failed: {e}", self.rank);
        }
    }

    /// [`Runtime::wait_commit`] for a paused rank: the copy under way is
    /// abandoned (after its piece, unsealed, counted as skipped) once the
    /// pause says the job cannot resume past an older step
    /// (`Directive::Pause`'s `upto`), since no rank could use it. The pause
    /// may be posted while this waits.
    pub(super) fn wait_commit_paused(&self) {
        if let Some(a) = &self.attached {
            let page = a.store.page();
            let (lock, cv) = &*a.progress;
            let mut p = lock.lock().unwrap_or_else(|p| p.into_inner());
            while p.done < p.requested {
                // Only one copy outstanding: an older one queued behind it
                // might be the step resumed from.
                if let Directive::Pause {
                    upto: Some(upto), ..
                } = page.directive().1
                    && p.requested_step > upto
                    && p.done + 1 == p.requested
                    && a.cancel.load(Ordering::Acquire) < p.requested
                {
                    a.cancel.store(p.requested, Ordering::Release);
                }
                p = cv
                    .wait_timeout(p, Duration::from_millis(2))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        // Every copy is over: says what failed, if anything.
        self.wait_commit();
    }

    /// The start-update fence's side of the snapshot window: waits for the
    /// outstanding copies, or abandons them (see [`Window`]) and waits only
    /// for one being copied to let go of the buffers.
    pub(super) fn close_window(&self) {
        let Some(a) = &self.attached else { return };
        let page = a.store.page();
        let (lock, cv) = &*a.progress;
        let mut p = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut abandon = false;
        if p.done < p.requested {
            if let Window::Skip { max_misses } = self.window
                && p.skippable
            {
                if self.misses.load(Ordering::Relaxed) < u64::from(max_misses) {
                    self.misses.fetch_add(1, Ordering::Relaxed);
                    a.cancel.store(p.requested, Ordering::Release);
                    abandon = true;
                } else {
                    page.record_waited_after_misses();
                    self.misses.store(0, Ordering::Relaxed);
                }
            }
        } else {
            self.misses.store(0, Ordering::Relaxed);
        }
        if abandon {
            // A copy under way stops after its current piece; one not begun
            // never reads the buffers.
            while p.copying != 0 {
                p = cv.wait(p).unwrap_or_else(|p| p.into_inner());
            }
        } else {
            while p.done < p.requested {
                p = cv.wait(p).unwrap_or_else(|p| p.into_inner());
            }
        }
        if let Some(e) = p.last_error.take() {
            eprintln!("rank {}: snapshot commit failed: {e}", self.rank);
        }
    }

    /// This rank's snapshot copies so far (`None` without an agent).
    pub fn commit_stats(&self) -> Option<hatrain_shared::shm::CommitStats> {
        self.attached
            .as_ref()
            .map(|a| a.store.page().commit_stats())
    }

    /// Snapshots skipped so far because they missed their window.
    pub fn snapshots_skipped(&self) -> u64 {
        self.attached
            .as_ref()
            .map_or(0, |a| a.store.page().commit_stats().skipped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_policies_parse_and_bad_ones_are_named() {
        assert_eq!("wait".parse::<Window>(), Ok(Window::Wait));
        assert_eq!("skip".parse::<Window>(), Ok(Window::Skip { max_misses: 4 }));
        assert_eq!(
            "skip:0".parse::<Window>(),
            Ok(Window::Skip { max_misses: 0 })
        );
        assert_eq!(
            "skip:12".parse::<Window>(),
            Ok(Window::Skip { max_misses: 12 })
        );
        for w in [Window::Wait, Window::Skip { max_misses: 3 }] {
            assert_eq!(w.to_string().parse::<Window>(), Ok(w));
        }
        for bad in ["", "skip:", "skip:-1", "skip:x", "wait:3", "Skip"] {
            let e = bad.parse::<Window>().unwrap_err().to_string();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn a_step_is_recorded_only_once_it_has_begun() {
        let c = HeldClock::default();
        c.add(Instant::now());
        assert_eq!(c.take(true), None, "no step was open");
        let t = Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(2));
        c.add(t);
        let ns = c.take(false).expect("the open step");
        assert!(ns >= 2_000_000, "{ns}");
        assert_eq!(c.take(false), None);
    }
}
