//! Recovery, as a state machine without I/O.
//!
//! [`Machine`] owns every decision of a job: whether an exit is the end, a
//! fault to repair or a reason to stop; pausing every rank under a new
//! epoch; s\* over the collected snapshots; resuming; the hang watchdog;
//! UCE repair; and the last-words dump. It is advanced by
//! [`Machine::step`]`(now, event)`, which returns the [`Command`]s to carry
//! out and the [`Note`]s that say why. The event loop (`crate::job`) only
//! gathers [`Event`]s (exits, control pages, requests, ticks, write
//! results) and carries commands out; it decides nothing.
//!
//! Nothing here reads a clock or assumes that all ranks are on one host: a
//! rank is a number, seen through its [`RankView`], so the same machine can
//! run inside a multi-host controller.
//!
//! - [`machine`]: the machine;
//! - [`policy`]: restarts (limits, rate, the same step again), clean exits
//!   that are faults, the UCE policy;
//! - [`watchdog`]: the hang watchdog and who it blames;
//! - [`consistent`]: how s\* is chosen.

pub mod consistent;
pub mod machine;
pub mod policy;
pub mod watchdog;

pub use consistent::consistent_step;
pub use machine::{Inherited, Machine, MachineConfig, Reshaping};
pub use policy::{RankHistory, RestartPolicy};
pub use watchdog::HangPolicy;

use crate::reaper::ExitStatus;
use hatrain_shared::shm::{Directive, Phase, StepTimes};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// What the machine sees of one rank at a tick: its process and its
/// control page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankView {
    pub rank: usize,
    /// Its process runs.
    pub alive: bool,
    /// It has registered (its control page exists).
    pub registered: bool,
    pub phase: Phase,
    /// The last step it completed.
    pub step: u64,
    /// The epoch of its communicator.
    pub epoch: u64,
    pub heartbeat: u64,
    pub in_collective: bool,
    /// The directive it has acknowledged, if that is the current one.
    pub acked: Option<Directive>,
    /// Its step times so far (the slow-rank detector's input; a
    /// controller compares every rank of the job).
    #[serde(default)]
    pub times: StepTimes,
    /// Once its process has ended: the newest step its store holds sealed
    /// (`None` while it runs, or when nothing is sealed). Nothing can seal
    /// a newer one, so the job cannot resume past it.
    #[serde(default)]
    pub final_sealed: Option<u64>,
}

impl RankView {
    /// A rank that has not started or registered yet.
    pub fn absent(rank: usize) -> Self {
        Self {
            rank,
            alive: false,
            registered: false,
            phase: Phase::Starting,
            step: 0,
            epoch: 0,
            heartbeat: 0,
            in_collective: false,
            acked: None,
            times: StepTimes::default(),
            final_sealed: None,
        }
    }
}

/// A checkpoint the dump wrote (or found already on disk).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Written {
    pub iteration: u64,
    /// The save directory (`--load` it to resume).
    pub dir: PathBuf,
    /// False when the iteration (or a newer one) was already on disk.
    pub written: bool,
    pub seconds: f64,
}

/// Why a checkpoint (a periodic save, a host's share, the last words) was
/// not written: the writer's error chain in words, which is what the
/// machine, the log and the other hosts are told (it crosses the wire as a
/// plain string).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(transparent)]
#[error("{0}")]
pub struct WriteFailed(pub String);

impl WriteFailed {
    /// The failure of `e`, with its sources.
    pub fn of(e: &dyn std::error::Error) -> Self {
        Self(crate::error_chain(e))
    }
}

impl From<String> for WriteFailed {
    fn from(why: String) -> Self {
        Self(why)
    }
}

impl From<&str> for WriteFailed {
    fn from(why: &str) -> Self {
        Self(why.to_string())
    }
}

/// What happened, as the event loop saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Event {
    /// Every rank's control page and process, read now.
    Tick(Vec<RankView>),
    /// A worker process ended, for `cause` as far as the agent could tell.
    /// The event loop feeds a fresh [`Event::Tick`] first.
    Exited {
        rank: usize,
        status: ExitStatus,
        cause: ExitCause,
    },
    /// A rank's snapshot store cannot be made on this host (no room in the
    /// shm root, or no resources): the job cannot run here.
    Unfit { rank: usize, reason: String },
    /// A rank registered; `checkpoint` when its state map says how to write
    /// a checkpoint, `global_batch` when it says the group's size must
    /// divide one.
    Registered {
        rank: usize,
        checkpoint: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        global_batch: Option<u64>,
    },
    /// A rank repaired an uncorrectable memory error in state part `part`.
    Uce {
        rank: usize,
        part: String,
        offset: u64,
    },
    /// A replacement process could not be started.
    SpawnFailed { rank: usize, error: String },
    /// `--on-slow replace` found `rank` slow long enough that a fresh
    /// process costs less than leaving it (`detail` says how slow).
    Slow { rank: usize, detail: String },
    /// A device fault source reported a fault of `rank`'s device:
    /// `FaultKind::Crash` or `FaultKind::Hang` take the rank down (and
    /// its exit is recovered from as that kind); `FaultKind::Device`
    /// means the device is lost to the job.
    DeviceFault {
        rank: usize,
        kind: hatrain_shared::control::FaultKind,
        detail: String,
    },
    /// A rank could not build its communicator for `epoch` (`peer`, when
    /// known, was unreachable).
    RebuildFailed {
        rank: usize,
        epoch: u64,
        peer: Option<u64>,
    },
    /// The verified snapshot steps of every rank, for [`Command::Collect`].
    Collected {
        epoch: u64,
        steps: Vec<(usize, Vec<u64>)>,
    },
    /// The checkpoint of [`Command::Write`] is on disk, or why not.
    Written {
        epoch: u64,
        result: Result<Written, WriteFailed>,
    },
    /// Another host of the job is gone.
    HostLost(HostLoss),
    /// `agentctl dump`: a last-words checkpoint now, then carry on.
    DumpRequested,
    /// The agent is asked to stop (SIGTERM).
    Shutdown,
    /// No coordinator let this controller act for longer than it may wait
    /// (etcd did not answer): the job writes its last words and stops.
    Unled { reason: String },
    /// A new agent took the job over from one that died during a
    /// recovery (its ranks wait on directives nobody will finish): the
    /// recovery starts again under a new epoch.
    Interrupted,
}

/// A host of the job that is gone, as the controller found it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostLoss {
    pub node: u64,
    /// The ranks it held.
    pub ranks: Vec<usize>,
    /// How the loss was seen.
    pub detail: String,
    /// A standby host that takes the ranks (their stores filled from their
    /// peer replicas).
    pub spare: Option<u64>,
    /// Ranks whose state is gone: no surviving host holds a replica of
    /// them (this host's, or those of an earlier loss still being filled
    /// from a host lost now).
    pub state_lost: Vec<usize>,
    /// The checkpoint directory and the newest complete checkpoint in it,
    /// when a rank registered one.
    pub on_disk: Option<OnDisk>,
    /// Hosts that hold ranks after this loss.
    pub hosts_left: usize,
    /// Should the group shrink, the ranks that stand by so that its size
    /// divides the global batch (whole hosts whose ranks' replicas are
    /// held by hosts that stay).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stand_by: Vec<usize>,
}

/// The newest complete checkpoint in a save directory, as its tracker
/// says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OnDisk {
    pub dir: PathBuf,
    /// `None` when the directory holds no complete checkpoint.
    pub iteration: Option<u64>,
}

impl std::fmt::Display for OnDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.iteration {
            Some(it) => write!(
                f,
                "iteration {it} in {} (resume with --load {})",
                self.dir.display(),
                self.dir.display()
            ),
            None => write!(f, "none (nothing complete in {})", self.dir.display()),
        }
    }
}

/// What else the agent knows of why a worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExitCause {
    /// Nothing beyond its exit status.
    Status,
    /// Its control page says an uncorrectable memory error outside its
    /// state killed it.
    FatalUce,
    /// The kernel's OOM killer killed it (its memory cgroup counted the
    /// kill, or the kernel's log names it).
    OutOfMemory,
}

/// What the event loop is to do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Command {
    Post {
        rank: usize,
        directive: Directive,
    },
    /// SIGKILL the rank's process (its exit comes back as an event).
    Kill {
        rank: usize,
    },
    /// Start the rank again in place, with this restart count.
    Respawn {
        rank: usize,
        restarts: u32,
    },
    /// A shrink resumes from `step`: the hosts holding the replicas of the
    /// `leaving` ranks hand them to a rank of theirs, which brings them to
    /// the reshape.
    Donate {
        step: u64,
        leaving: Vec<usize>,
    },
    /// Verify every rank's snapshots and report [`Event::Collected`].
    Collect {
        epoch: u64,
    },
    /// Write iteration `step` from the snapshots into the save directory
    /// (unless it is on disk already) and report [`Event::Written`].
    Write {
        epoch: u64,
        step: u64,
    },
    /// Stop every worker and start the whole group again, as restart
    /// `restart` of the group (torchrun's restart: the workers resume from
    /// their own checkpoints).
    RestartGroup {
        restart: u32,
    },
    /// Answer the waiting `agentctl dump` requests.
    DumpDone(Result<Written, WriteFailed>),
    /// The job ends with this outcome: stop the workers.
    Finish(Outcome),
}

/// How loud a note is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Info,
    Warn,
    Error,
}

/// A decision's reason, for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    pub level: Level,
    pub rank: Option<usize>,
    /// How the fault was seen, when the note is about one.
    pub detail: Option<String>,
    /// Why the machine decided as it did, when the note is a decision.
    pub reason: Option<String>,
    pub text: String,
}

/// How a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    Succeeded,
    WorkerFailed {
        rank: usize,
        status: ExitStatus,
    },
    /// A fault could not be repaired; the reason is logged and in the fault
    /// history.
    RecoveryFailed,
    /// The host cannot hold the job (its snapshot stores cannot be made).
    Unfit,
    Interrupted,
}
