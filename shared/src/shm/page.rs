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
    assert!(size_of::<ControlPage>() == 272);
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
    /// The commit statistics.
    pub fn commit_stats(&self) -> CommitStats {
        CommitStats {
            last_ns: self.commit_ns.load(Ordering::Relaxed),
            last_blocking_ns: self.commit_block_ns.load(Ordering::Relaxed),
            commits: self.commits.load(Ordering::Acquire),
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
}
