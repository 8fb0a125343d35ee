//! Who decides for a host: the job's controller (the cluster machine,
//! [`Controller`]), or a follower of it, whose state the driver keeps
//! (when its controller's host was lost, when it last reported, when a
//! shutdown it passed on is due), on the agent's own clock.

use super::decider::{CONTROLLER, Controller, HoldReport, Mirror};
use crate::recovery::{HostLoss, RankView, Written};
use hatrain_shared::control::{FaultRecord, StartMode};
use std::time::Instant;

/// A host that follows the controller.
#[derive(Debug)]
pub(super) struct Follower {
    /// The node whose controller it follows.
    pub leader: u64,
    /// When its controller's host was lost: it waits for a successor
    /// (itself, or another) until the deadline, then stops.
    pub orphaned: Option<Instant>,
    pub mirror: Mirror,
    /// The newest controller term seen.
    pub term: u64,
    /// What was last reported, and when.
    pub last: Option<Reported>,
    /// Set when a shutdown was passed on: a controller that has not ended
    /// the job by then, nor begun its last words, is not coming.
    pub shutdown_by: Option<Instant>,
    /// The controller's epoch when the shutdown was passed on: a newer one
    /// means it took it (it pauses every rank for the last words).
    pub shutdown_epoch: u64,
    /// A shutdown was passed on: a successor hears it again.
    pub shutdown_passed: bool,
    /// The controller ended the job.
    pub ended: bool,
    /// Every host loss it heard of: a successor taking over decides on
    /// those its predecessor had not.
    pub losses: Vec<HostLoss>,
    /// Ranks no live host holds, as the controller last said.
    pub orphans: Vec<usize>,
    /// The controller settled the final checkpoint.
    pub final_done: bool,
}

/// A follower's last report: when, its views, the ranks whose replicas it
/// held, and its replica hold.
pub(super) type Reported = (Instant, Vec<RankView>, Vec<usize>, Option<HoldReport>);

impl Follower {
    pub fn new() -> Self {
        Self {
            leader: CONTROLLER,
            orphaned: None,
            mirror: Mirror::default(),
            term: 0,
            last: None,
            shutdown_by: None,
            shutdown_epoch: 0,
            shutdown_passed: false,
            ended: false,
            losses: Vec::new(),
            orphans: Vec::new(),
            final_done: false,
        }
    }
}

/// Who decides for this host.
#[derive(Debug)]
pub(super) enum Decider {
    Controller(Box<Controller>),
    Follower(Box<Follower>),
}

impl Decider {
    pub fn epoch(&self) -> u64 {
        match self {
            Self::Controller(c) => c.machine.epoch(),
            Self::Follower(f) => f.mirror.epoch,
        }
    }

    pub fn recovering(&self) -> bool {
        match self {
            Self::Controller(c) => c.machine.recovering(),
            Self::Follower(f) => f.mirror.recovering,
        }
    }

    pub fn activity(&self) -> String {
        match self {
            Self::Controller(c) => c.machine.activity(),
            Self::Follower(f) if f.mirror.activity.is_empty() => "following the controller".into(),
            Self::Follower(f) => format!(
                "{} (the controller on node {})",
                f.mirror.activity, f.leader
            ),
        }
    }

    /// The size of the data-parallel group now, if known.
    pub fn world_size(&self) -> Option<usize> {
        match self {
            Self::Controller(c) if c.joined() => Some(c.machine.world_size()),
            Self::Controller(_) => None,
            Self::Follower(f) => f.mirror.world_size,
        }
    }

    pub fn resizes(&self) -> &[hatrain_shared::control::ResizeRecord] {
        match self {
            Self::Controller(c) => c.machine.resizes(),
            Self::Follower(f) => &f.mirror.resizes,
        }
    }

    /// The place of `rank` in the group after a resize (elastic training).
    pub fn place_of(&self, rank: usize) -> Option<(u64, u64)> {
        match self {
            Self::Controller(c) => c.machine.place_now(rank),
            Self::Follower(f) => f.mirror.places.get(&rank).copied(),
        }
    }

    pub fn faults(&self) -> &[FaultRecord] {
        match self {
            Self::Controller(c) => c.machine.faults(),
            Self::Follower(f) => &f.mirror.faults,
        }
    }

    /// The median recent step time (the controller's measure).
    pub fn median_step(&self) -> Option<std::time::Duration> {
        match self {
            Self::Controller(c) => c.machine.median_step(),
            Self::Follower(_) => None,
        }
    }

    pub fn restarts(&self, rank: usize) -> u32 {
        match self {
            Self::Controller(c) => c.machine.restarts(rank),
            Self::Follower(f) => f.mirror.restarts.get(&rank).copied().unwrap_or(0),
        }
    }

    pub fn protected(&self, rank: usize) -> bool {
        match self {
            Self::Controller(c) => c.machine.protected(rank),
            Self::Follower(f) => f.mirror.protected.contains(&rank),
        }
    }

    pub fn last_words(&self) -> Option<&Written> {
        match self {
            Self::Controller(c) => c.machine.last_words(),
            Self::Follower(f) => f.mirror.last_words.as_ref(),
        }
    }

    pub fn group_restarts(&self) -> u32 {
        match self {
            Self::Controller(c) => c.machine.group_restarts(),
            Self::Follower(f) => f.mirror.group_restarts,
        }
    }

    /// How a rank that registers now starts: normally while the job runs,
    /// else it waits for a directive (a replacement joins the recovery, a
    /// rank joining a growing group the reshape), as the controller's
    /// machine says.
    pub fn start_mode(&self) -> StartMode {
        match self {
            Self::Controller(c) => c.machine.start_mode(),
            Self::Follower(f) if f.mirror.recovering || f.mirror.reshape.is_some() => {
                StartMode::AwaitDirective
            }
            Self::Follower(f) => StartMode::Fresh {
                epoch: f.mirror.epoch,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recovery::Reshaping;
    use std::time::Duration;

    fn mirror(d: &mut Decider) -> &mut Mirror {
        match d {
            Decider::Follower(f) => &mut f.mirror,
            Decider::Controller(_) => unreachable!("a follower"),
        }
    }

    /// A follower starts a rank as its controller's machine would: a
    /// rank joining a growing group waits for the reshape even before the
    /// group pauses for it.
    #[test]
    fn a_follower_starts_ranks_as_the_controllers_machine_says() {
        let mut d = Decider::Follower(Box::new(Follower::new()));
        mirror(&mut d).epoch = 3;
        assert_eq!(d.start_mode(), StartMode::Fresh { epoch: 3 });
        mirror(&mut d).reshape = Some(Reshaping {
            leaving: Vec::new(),
            joining: vec![1],
            from: 3,
            fault: None,
            since: Duration::ZERO,
            resumed: None,
        });
        assert_eq!(d.start_mode(), StartMode::AwaitDirective);
        mirror(&mut d).reshape = None;
        mirror(&mut d).recovering = true;
        assert_eq!(d.start_mode(), StartMode::AwaitDirective);
    }
}
