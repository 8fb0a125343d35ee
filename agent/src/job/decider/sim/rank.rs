//! A simulated rank: its process, its control page and its snapshots,
//! and its state as a checksum folded over every step it took.

use hatrain_shared::shm::{Directive, Phase};

/// One rank's process and control page.
#[derive(Debug, Clone)]
pub(super) struct Rank {
    pub(super) alive: bool,
    pub(super) registered: bool,
    pub(super) phase: Phase,
    pub(super) step: u64,
    pub(super) epoch: u64,
    pub(super) heartbeat: u64,
    pub(super) directive: Directive,
    pub(super) acked: Option<Directive>,
    pub(super) in_collective: bool,
    /// The state: a checksum of every step taken.
    pub(super) sum: u64,
    /// Sealed snapshots: (step, state), newest first.
    pub(super) slots: Vec<(u64, u64)>,
    /// Rolled back to a step it held no snapshot of.
    pub(super) torn: bool,
    /// Joins a growing group with no state of its own: a reshape gives
    /// it its share of the others'.
    pub(super) joining: bool,
    /// Took a new place in a resized group: its state was re-sliced.
    pub(super) resliced: bool,
    /// In the group's communicator: a joining rank is once its reshape
    /// is posted (the others then wait for it).
    pub(super) member: bool,
    /// Its registration was answered: a worker trains only then.
    pub(super) answered: bool,
}

impl Rank {
    pub(super) fn fresh() -> Self {
        Self {
            alive: true,
            registered: true,
            phase: Phase::Computing,
            step: 0,
            epoch: 0,
            heartbeat: 0,
            directive: Directive::None,
            acked: None,
            in_collective: false,
            sum: 0,
            slots: vec![(0, 0)],
            torn: false,
            joining: false,
            resliced: false,
            member: true,
            answered: true,
        }
    }
}

/// The state of `rank` after `step`, from `sum` before it.
pub fn fold(sum: u64, rank: usize, step: u64) -> u64 {
    (sum ^ (rank as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ step)
        .wrapping_mul(0xff51_afd7_ed55_8ccd)
        .rotate_left(17)
}

/// The state of `rank` after `steps` steps without a fault.
pub fn reference(rank: usize, steps: u64) -> u64 {
    (1..=steps).fold(0, |s, step| fold(s, rank, step))
}

/// A rank acts on its directive.
pub(super) fn act(r: &mut Rank) {
    if !(r.alive && r.registered) || r.acked == Some(r.directive) {
        if r.phase == Phase::Paused {
            r.heartbeat += 1;
        }
        return;
    }
    match r.directive {
        Directive::Pause { .. } => {
            r.acked = Some(r.directive);
            r.phase = Phase::Paused;
            r.in_collective = false;
        }
        Directive::Resume { epoch, step } | Directive::Reshape { epoch, step, .. } => {
            r.acked = Some(r.directive);
            r.epoch = epoch;
            let reshape = matches!(r.directive, Directive::Reshape { .. });
            match r.slots.iter().find(|s| s.0 == step) {
                Some(&(_, sum)) => r.sum = sum,
                None if r.step == step => {}
                // Its share of the others' state at that step.
                None if reshape && r.joining => r.sum = step,
                None => r.torn = true,
            }
            r.resliced |= reshape;
            r.joining = false;
            r.step = step;
            r.slots.retain(|s| s.0 <= step);
            r.phase = Phase::Computing;
        }
        Directive::None | Directive::Stop => {}
    }
}

/// A rank's registration, as the sims' workers make it.
pub(super) fn registration(rank: usize) -> crate::recovery::Event {
    crate::recovery::Event::Registered {
        rank,
        checkpoint: true,
        global_batch: None,
    }
}
