//! The control page: one 4096-byte page of little-endian `u64` words at the
//! start of a rank's store, each accessed atomically. Its layout is the
//! `#[repr(C)]` struct [`ControlPage`]; the offsets in the module diagram
//! of [`super`] are checked against it at compile time.
//!
//! Who writes what: the agent writes the identity words at creation, the
//! directive words, injections and claims of holds; the worker writes its
//! status (pid, phase, step, epoch, heartbeat, restarts, collective flag,
//! commit statistics), the fault words and holds. Each protocol on the page
//! has its own module: [`super::directive`], [`super::hold`],
//! [`super::fault`].

use super::mapping::Words;
use std::sync::atomic::{AtomicU64, Ordering};

/// What a worker is doing, as its control page says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Starting,
    Computing,
    Updating,
    Paused,
    Restoring,
    Finished,
    Unknown,
}

impl Phase {
    pub fn word(self) -> u64 {
        match self {
            Self::Starting => 0,
            Self::Computing => 1,
            Self::Updating => 2,
            Self::Paused => 3,
            Self::Restoring => 4,
            Self::Finished => 5,
            Self::Unknown => 99,
        }
    }

    pub fn from_word(w: u64) -> Self {
        match w {
            0 => Self::Starting,
            1 => Self::Computing,
            2 => Self::Updating,
            3 => Self::Paused,
            4 => Self::Restoring,
            5 => Self::Finished,
            _ => Self::Unknown,
        }
    }
}

/// The control page, word by word (see the diagram in [`super`]).
#[repr(C)]
#[derive(Debug)]
pub struct ControlPage {
    pub(super) magic: AtomicU64,
    pub(super) version: AtomicU64,
    pub(super) rank: AtomicU64,
    pub(super) slots: AtomicU64,
    pub(super) capacity: AtomicU64,
    pub(super) layout: AtomicU64,
    pub(super) job: AtomicU64,
    pub(super) rebuild_epoch: AtomicU64,
    pid: AtomicU64,
    phase: AtomicU64,
    step: AtomicU64,
    epoch: AtomicU64,
    heartbeat: AtomicU64,
    restarts: AtomicU64,
    in_collective: AtomicU64,
    pub(super) rebuild_peer: AtomicU64,
    pub(super) dir_seq: AtomicU64,
    pub(super) dir_kind: AtomicU64,
    pub(super) dir_epoch: AtomicU64,
    pub(super) dir_step: AtomicU64,
    pub(super) ack: AtomicU64,
    pub(super) fault_flags: AtomicU64,
    pub(super) fault_part: AtomicU64,
    pub(super) fault_offset: AtomicU64,
    commit_ns: AtomicU64,
    commit_block_ns: AtomicU64,
    commits: AtomicU64,
    pub(super) inject_kind: AtomicU64,
    pub(super) inject_part: AtomicU64,
    pub(super) inject_offset: AtomicU64,
    pub(super) inject_at: AtomicU64,
    pub(super) hold: AtomicU64,
    /// A reshape's data-parallel place: rank and world size (version 2.1).
    pub(super) dir_rank: AtomicU64,
    pub(super) dir_world: AtomicU64,
    /// What the rank's training thread spent in hatrain's calls, per step
    /// (version 2.2): steps counted, total, maximum, last, and a histogram.
    held_steps: AtomicU64,
    held_total_ns: AtomicU64,
    held_max_ns: AtomicU64,
    held_last_ns: AtomicU64,
    held_hist: [AtomicU64; HELD_BUCKETS],
    /// The sealed snapshots' copies (2.2): their time, bytes and the commit
    /// thread's CPU time, summed; snapshots that missed their window and
    /// were skipped; and those the update waited for after too many misses.
    sealed_ns: AtomicU64,
    sealed_bytes: AtomicU64,
    sealed_cpu_ns: AtomicU64,
    skipped: AtomicU64,
    waited_after_misses: AtomicU64,
    sealed: AtomicU64,
    /// The steps kept for the peer replicas (2.3): the common one and
    /// the target, each 0 for none, else step + 1; written by the agent.
    pub(super) keep: AtomicU64,
    pub(super) keep_target: AtomicU64,
    /// Snapshots not taken because every slot but the newest was held
    /// (for the persister, or for the replicas' step) (2.3).
    thinned: AtomicU64,
    /// Where the training thread's steps went (2.4): steps timed, then
    /// summed over them, ns of each phase (see [`super::timing`]).
    pub(super) timed_steps: AtomicU64,
    pub(super) phase_ns: [AtomicU64; super::timing::PHASES],
    /// The garbage collections of a Python worker (2.5): their ns, how
    /// many, and the sum of the steps they ran in.
    pub(super) gc_ns: AtomicU64,
    pub(super) gc_collections: AtomicU64,
    pub(super) gc_step_sum: AtomicU64,
}

/// Buckets of the held-time histogram: bucket `k` counts the steps held
/// less than [`held_bucket_le_ns`]`(k)`, the last one the rest.
pub const HELD_BUCKETS: usize = 16;

/// The upper bound of held-time bucket `k` in nanoseconds (16 µs << k);
/// `None` for the last, unbounded one.
pub fn held_bucket_le_ns(k: usize) -> Option<u64> {
    (k + 1 < HELD_BUCKETS).then(|| 16_000u64 << k)
}

/// The bucket a step held for `ns` falls in.
fn held_bucket(ns: u64) -> usize {
    (0..HELD_BUCKETS)
        .find(|&k| held_bucket_le_ns(k).is_none_or(|le| ns < le))
        .unwrap_or(HELD_BUCKETS - 1)
}

// SAFETY: repr(C), only AtomicU64 fields.
unsafe impl Words for ControlPage {}

// The byte diagram in `super` is the contract; these keep the struct to it.
const _: () = {
    use std::mem::offset_of;
    assert!(offset_of!(ControlPage, magic) == 0);
    assert!(offset_of!(ControlPage, layout) == 40);
    assert!(offset_of!(ControlPage, pid) == 64);
    assert!(offset_of!(ControlPage, step) == 80);
    assert!(offset_of!(ControlPage, in_collective) == 112);
    assert!(offset_of!(ControlPage, dir_seq) == 128);
    assert!(offset_of!(ControlPage, ack) == 160);
    assert!(offset_of!(ControlPage, fault_flags) == 168);
    assert!(offset_of!(ControlPage, commit_ns) == 192);
    assert!(offset_of!(ControlPage, inject_kind) == 216);
    assert!(offset_of!(ControlPage, inject_at) == 240);
    assert!(offset_of!(ControlPage, hold) == 248);
    assert!(offset_of!(ControlPage, dir_rank) == 256);
    assert!(offset_of!(ControlPage, dir_world) == 264);
    assert!(offset_of!(ControlPage, held_steps) == 272);
    assert!(offset_of!(ControlPage, held_hist) == 304);
    assert!(offset_of!(ControlPage, sealed_ns) == 432);
    assert!(offset_of!(ControlPage, waited_after_misses) == 464);
    assert!(offset_of!(ControlPage, sealed) == 472);
    assert!(offset_of!(ControlPage, keep) == 480);
    assert!(offset_of!(ControlPage, keep_target) == 488);
    assert!(offset_of!(ControlPage, thinned) == 496);
    assert!(offset_of!(ControlPage, timed_steps) == 504);
    assert!(offset_of!(ControlPage, phase_ns) == 512);
    assert!(offset_of!(ControlPage, gc_ns) == 552);
    assert!(offset_of!(ControlPage, gc_step_sum) == 568);
    assert!(size_of::<ControlPage>() == 576);
    assert!(size_of::<ControlPage>() <= super::PAGE);
};

impl ControlPage {
    pub fn rank(&self) -> u64 {
        self.rank.load(Ordering::Relaxed)
    }
    pub fn layout_hash(&self) -> u64 {
        self.layout.load(Ordering::Relaxed)
    }
    pub fn job_hash(&self) -> u64 {
        self.job.load(Ordering::Relaxed)
    }

    pub fn set_pid(&self, pid: u32) {
        self.pid.store(u64::from(pid), Ordering::Release);
    }
    pub fn pid(&self) -> u64 {
        self.pid.load(Ordering::Acquire)
    }
    pub fn set_phase(&self, p: Phase) {
        self.phase.store(p.word(), Ordering::Release);
    }
    pub fn phase(&self) -> Phase {
        Phase::from_word(self.phase.load(Ordering::Acquire))
    }
    /// The last step the rank completed (its state is consistent there).
    pub fn set_step(&self, step: u64) {
        self.step.store(step, Ordering::Release);
    }
    pub fn step(&self) -> u64 {
        self.step.load(Ordering::Acquire)
    }
    /// The epoch of the rank's current communicator.
    pub fn set_epoch(&self, e: u64) {
        self.epoch.store(e, Ordering::Release);
    }
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }
    /// A sign of life at a step boundary or while parked.
    pub fn beat(&self) {
        self.heartbeat.fetch_add(1, Ordering::Release);
    }
    pub fn heartbeat(&self) -> u64 {
        self.heartbeat.load(Ordering::Acquire)
    }
    pub fn set_restarts(&self, n: u64) {
        self.restarts.store(n, Ordering::Release);
    }
    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Acquire)
    }

    /// Marks whether the rank is waiting in a collective (on its peers): a
    /// stalled rank that is not is the one the others wait for.
    pub fn set_in_collective(&self, yes: bool) {
        self.in_collective.store(u64::from(yes), Ordering::Release);
    }
    pub fn in_collective(&self) -> bool {
        self.in_collective.load(Ordering::Acquire) != 0
    }

    /// Records a sealed commit and how long its copy took.
    pub fn record_commit(&self, total_ns: u64) {
        self.commit_ns.store(total_ns, Ordering::Relaxed);
        self.commits.fetch_add(1, Ordering::Release);
    }
    /// Records how long the training loop last waited for a commit.
    pub fn record_commit_blocking(&self, ns: u64) {
        self.commit_block_ns.store(ns, Ordering::Relaxed);
    }
    /// Records the time the training thread spent in hatrain's calls
    /// during one step.
    pub fn record_held(&self, ns: u64) {
        self.held_total_ns.fetch_add(ns, Ordering::Relaxed);
        self.held_max_ns.fetch_max(ns, Ordering::Relaxed);
        self.held_last_ns.store(ns, Ordering::Relaxed);
        self.held_hist[held_bucket(ns)].fetch_add(1, Ordering::Relaxed);
        self.held_steps.fetch_add(1, Ordering::Release);
    }
    /// The held-time statistics.
    pub fn held_stats(&self) -> HeldStats {
        let steps = self.held_steps.load(Ordering::Acquire);
        HeldStats {
            steps,
            total_ns: self.held_total_ns.load(Ordering::Relaxed),
            max_ns: self.held_max_ns.load(Ordering::Relaxed),
            last_ns: self.held_last_ns.load(Ordering::Relaxed),
            buckets: std::array::from_fn(|k| self.held_hist[k].load(Ordering::Relaxed)),
        }
    }
    /// Records a sealed snapshot: its copy's time, its bytes, and the CPU
    /// time the commit thread spent on it.
    pub fn record_sealed(&self, copy_ns: u64, bytes: u64, cpu_ns: u64) {
        self.sealed_ns.fetch_add(copy_ns, Ordering::Relaxed);
        self.sealed_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.sealed_cpu_ns.fetch_add(cpu_ns, Ordering::Relaxed);
        self.sealed.fetch_add(1, Ordering::Release);
    }
    /// Records a snapshot skipped because its copy had not finished when
    /// the update began.
    pub fn record_skipped(&self) {
        self.skipped.fetch_add(1, Ordering::Relaxed);
    }
    /// Records an update that waited for a copy because the snapshots
    /// before it had all missed their window.
    pub fn record_waited_after_misses(&self) {
        self.waited_after_misses.fetch_add(1, Ordering::Relaxed);
    }
    /// Records a snapshot not taken because every slot but the newest was
    /// held.
    pub fn record_thinned(&self) {
        self.thinned.fetch_add(1, Ordering::Relaxed);
    }
    /// The commit statistics.
    pub fn commit_stats(&self) -> CommitStats {
        CommitStats {
            last_ns: self.commit_ns.load(Ordering::Relaxed),
            last_blocking_ns: self.commit_block_ns.load(Ordering::Relaxed),
            commits: self.commits.load(Ordering::Acquire),
            sealed: self.sealed.load(Ordering::Acquire),
            sealed_ns: self.sealed_ns.load(Ordering::Relaxed),
            sealed_bytes: self.sealed_bytes.load(Ordering::Relaxed),
            sealed_cpu_ns: self.sealed_cpu_ns.load(Ordering::Relaxed),
            skipped: self.skipped.load(Ordering::Relaxed),
            waited_after_misses: self.waited_after_misses.load(Ordering::Relaxed),
            thinned: self.thinned.load(Ordering::Relaxed),
        }
    }
}

/// How the worker's snapshot commits have gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitStats {
    /// Duration of the last commit's copy.
    pub last_ns: u64,
    /// How long the training loop last waited for a commit to finish.
    pub last_blocking_ns: u64,
    pub commits: u64,
    /// Snapshots sealed, and summed over them: copy time, bytes, and the
    /// commit thread's CPU time.
    pub sealed: u64,
    pub sealed_ns: u64,
    pub sealed_bytes: u64,
    pub sealed_cpu_ns: u64,
    /// Snapshots skipped because they missed their window.
    pub skipped: u64,
    /// Updates that waited for a copy after too many misses.
    pub waited_after_misses: u64,
    /// Snapshots not taken because every slot but the newest was held.
    pub thinned: u64,
}

/// The time a worker's training thread spent in hatrain's calls, per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldStats {
    pub steps: u64,
    pub total_ns: u64,
    pub max_ns: u64,
    pub last_ns: u64,
    /// Steps per bucket (see [`held_bucket_le_ns`]).
    pub buckets: [u64; HELD_BUCKETS],
}

impl HeldStats {
    /// An upper bound of the `q` quantile (0 < q ≤ 1) of the held time per
    /// step, in nanoseconds: the upper edge of the bucket it falls in, or
    /// the maximum seen when that is smaller or the bucket is unbounded.
    /// `None` before any step.
    pub fn quantile_ns(&self, q: f64) -> Option<u64> {
        let total: u64 = self.buckets.iter().sum();
        if total == 0 {
            return None;
        }
        let want = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (k, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= want {
                return Some(held_bucket_le_ns(k).map_or(self.max_ns, |le| le.min(self.max_ns)));
            }
        }
        Some(self.max_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_times_fall_in_the_bucket_below_their_upper_edge() {
        assert_eq!(held_bucket(0), 0);
        assert_eq!(held_bucket(15_999), 0);
        assert_eq!(held_bucket(16_000), 1);
        assert_eq!(held_bucket(31_999), 1);
        assert_eq!(held_bucket(5_000_000), 9); // 4.096 ms ≤ 5 ms < 8.192 ms
        assert_eq!(held_bucket(u64::MAX), HELD_BUCKETS - 1);
        for k in 0..HELD_BUCKETS - 1 {
            let le = held_bucket_le_ns(k).unwrap();
            assert_eq!(held_bucket(le - 1), k);
            assert_eq!(held_bucket(le), k + 1);
        }
        assert_eq!(held_bucket_le_ns(HELD_BUCKETS - 1), None);
    }

    #[test]
    fn a_quantile_is_bounded_by_its_bucket_and_the_maximum() {
        let mut s = HeldStats {
            steps: 0,
            total_ns: 0,
            max_ns: 0,
            last_ns: 0,
            buckets: [0; HELD_BUCKETS],
        };
        assert_eq!(s.quantile_ns(0.5), None);
        // 90 steps under 16 µs, 10 between 1.024 and 2.048 ms, the longest 1.5 ms.
        s.buckets[0] = 90;
        s.buckets[7] = 10;
        s.max_ns = 1_500_000;
        assert_eq!(s.quantile_ns(0.5), Some(16_000));
        assert_eq!(s.quantile_ns(0.9), Some(16_000));
        assert_eq!(s.quantile_ns(0.91), Some(1_500_000));
        assert_eq!(s.quantile_ns(1.0), Some(1_500_000));
        // In the unbounded bucket, the maximum.
        s.buckets[HELD_BUCKETS - 1] = 100;
        s.max_ns = 9_000_000_000;
        assert_eq!(s.quantile_ns(0.99), Some(9_000_000_000));
    }
}
