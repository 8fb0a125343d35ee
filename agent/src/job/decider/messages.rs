//! The messages between the controller and its followers, and the state
//! the followers mirror.

use crate::recovery::{Command, Event, Inherited, RankView, Reshaping, WriteFailed, Written};
use hatrain_shared::control::{FaultRecord, StartMode};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// A follower to the controller.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Up {
    /// The host's ranks as seen now, and what happened since the last
    /// report (in order).
    Report {
        views: Vec<RankView>,
        events: Vec<Event>,
        /// The ranks whose peer replicas the host holds, each with a
        /// sealed step.
        #[serde(default)]
        held: Vec<usize>,
        /// What the steps kept for the replicas are chosen from.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        hold: Option<super::HoldReport>,
    },
    /// The host's ranks' verified snapshot steps, for the collection of
    /// `epoch`.
    Collected {
        epoch: u64,
        steps: Vec<(usize, Vec<u64>)>,
        /// The verified steps of the peer replicas it holds of lost hosts'
        /// ranks (with their state maps): what a checkpoint takes those
        /// ranks from.
        #[serde(default)]
        replicas: Vec<(usize, Vec<u64>)>,
    },
    /// Its share (the directories of `ranks`) of the periodic save of
    /// `step` is written (in seconds), or why not.
    Saved {
        step: u64,
        ranks: Vec<usize>,
        result: Result<f64, WriteFailed>,
    },
    /// Its share of the checkpoint of `epoch` is written (in seconds), or
    /// why not.
    Wrote {
        epoch: u64,
        result: Result<f64, WriteFailed>,
    },
    /// The end of the job arrived: the follower stops its workers and
    /// leaves.
    Ended,
}

/// The controller to a follower: commands for its ranks (in order), under
/// the controller's term, and the machine's state when it changed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Down {
    pub term: u64,
    /// Shared by every host's orders of one step: one copy, however many
    /// hosts.
    pub mirror: Option<Arc<Mirror>>,
    pub commands: Vec<Command>,
    /// Registrations the controller took, with how each rank starts.
    #[serde(default)]
    pub registered: Vec<(usize, StartMode)>,
    /// To a standby: take the ranks of lost host `node` (before the
    /// commands that start them).
    #[serde(default)]
    pub adopt: Option<Adopt>,
    /// To every host: stream the replicas held of a lost host's ranks to
    /// the standby that takes them.
    #[serde(default)]
    pub give: Option<Give>,
    /// To every host: a standby plays node `node` again (its ranks come
    /// back in a growing group): the replicas are placed on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regrow: Option<Give>,
    /// Write these ranks of a checkpoint several hosts write.
    #[serde(default)]
    pub write: Option<WritePart>,
    /// Ranks no live host holds (a lost host's, with no standby to take
    /// them): a collection verifies the replicas held of them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub orphans: Vec<usize>,
    /// The final checkpoint is settled (committed, or failed): a follower
    /// that sent its share may leave.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub final_done: bool,
    /// To every host, when they change: the steps its ranks' stores and
    /// the replicas it holds keep for the replicas (`super::hold`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep: Option<hatrain_shared::shm::Kept>,
    /// To a host that holds the job back (`--on-slow replace`), and why:
    /// it leaves the job as a lost host does, and a standby host takes its
    /// ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leave: Option<String>,
}

/// A host's share of a checkpoint: the directories of `ranks` (its own,
/// or replicas it holds of a lost host's) of iteration `step`, into the
/// `_tmp` directory the controller made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WritePart {
    pub epoch: u64,
    pub step: u64,
    pub ranks: Vec<usize>,
}

/// A standby takes the ranks of a lost host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Adopt {
    pub node: u64,
    pub ranks: Vec<usize>,
    /// Their stores are filled from their replicas (a host lost); else
    /// they join a growing group with nothing (elastic training).
    #[serde(default = "yes")]
    pub fill: bool,
}

fn yes() -> bool {
    true
}

/// The replicas of lost host `node`'s ranks go to standby `to`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Give {
    pub node: u64,
    pub to: u64,
}

/// The machine's state as a follower shows it (`agentctl status`, the
/// job's summary) and starts its replacements by.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Mirror {
    pub epoch: u64,
    pub recovering: bool,
    pub activity: String,
    pub faults: Vec<FaultRecord>,
    pub restarts: BTreeMap<usize, u32>,
    pub protected: BTreeSet<usize>,
    pub last_words: Option<Written>,
    pub group_restarts: u32,
    /// What a successor needs to take over: when the job started, whether
    /// a rank registered a checkpoint layout, and where the ranks are.
    #[serde(default)]
    pub started_unix_s: f64,
    #[serde(default)]
    pub checkpoint: bool,
    #[serde(default)]
    pub members: BTreeSet<u64>,
    #[serde(default)]
    pub spares: BTreeSet<u64>,
    #[serde(default)]
    pub placement: BTreeMap<usize, u64>,
    /// Ranks a standby took and is still filling from their replicas.
    #[serde(default)]
    pub filling: BTreeSet<usize>,
    /// The size of the data-parallel group and its resizes (elastic
    /// training).
    #[serde(default)]
    pub world_size: Option<usize>,
    #[serde(default)]
    pub resizes: Vec<hatrain_shared::control::ResizeRecord>,
    /// The ranks that left the group: a successor does not wait for them.
    #[serde(default)]
    pub retired: BTreeSet<usize>,
    /// Each rank's place in the group after a resize: a process started
    /// again takes it.
    #[serde(default)]
    pub places: BTreeMap<usize, (u64, u64)>,
    /// The resize under way: a successor carries it on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reshape: Option<Reshaping>,
    /// The global batch the group's size divides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_batch: Option<u64>,
}

impl Mirror {
    /// What a machine taking over from the controller that sent this
    /// inherits.
    pub fn inherited(&self) -> Inherited {
        Inherited {
            started_unix_s: self.started_unix_s,
            epoch: self.epoch,
            faults: self.faults.clone(),
            restarts: self.restarts.clone(),
            protected: self.protected.clone(),
            checkpoint: self.checkpoint,
            last_words: self.last_words.clone(),
            group_restarts: self.group_restarts,
            retired: self.retired.clone(),
            resizes: self.resizes.clone(),
            places: self.places.clone(),
            reshape: self.reshape.clone(),
            global_batch: self.global_batch,
        }
    }
}
