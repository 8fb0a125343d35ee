//! The agent's control protocol: one Unix socket per job, spoken by the
//! job's workers (registration) and by `agentctl`.
//!
//! Every request and reply is one [`frame`](crate::frame) of [`PROTOCOL`]
//! carrying JSON; requests are refused with [`Response::Error`] when they do
//! not parse. Requests that change anything are accepted only from the
//! socket owner's uid or root (checked with SO_PEERCRED by the agent).

use crate::frame::{FrameError, Protocol};
use crate::ha::HaModes;
use crate::shm::Phase;
use crate::statemap::StateMap;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const PROTOCOL: Protocol = Protocol {
    name: "control",
    magic: *b"HTCL",
    major: 1,
    // 1.7: a fault record's `class`. 1.8: fault kind `slow`, and whether a
    // slow-rank finding is of one rank alone. 1.9: whether it is of a
    // whole host.
    minor: 9,
    max_payload: 1 << 20,
};

/// Environment variable naming the control socket, set for workers.
pub const ENV_SOCKET: &str = "HATRAIN_AGENT_SOCKET";
/// Environment variable with the workers' own folder of the job (private,
/// removed with the job): where a framework's rendezvous files go.
pub const ENV_WORKER_DIR: &str = "HATRAIN_WORKER_DIR";
/// Environment variable set (to `1`) for a warm standby process: it has no
/// rank until the agent gives it one ([`Request::Standby`]).
pub const ENV_STANDBY: &str = "HATRAIN_STANDBY";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Request {
    /// A worker announces itself and its state map.
    Register {
        rank: usize,
        pid: u32,
        map: StateMap,
        /// The fewest snapshot slots its loop needs (the agent may keep
        /// more): 3 when gradients are reduced before the update fences,
        /// as PyTorch DDP does, since a peer may then complete a step while
        /// this rank still copies the snapshot of the one before. Since
        /// protocol 1.4.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        slots: Option<usize>,
    },
    /// A warm standby (started with [`ENV_STANDBY`]) has done its start-up
    /// and parks: answered with [`Response::Assigned`] when the agent gives
    /// it a failed rank's place, never otherwise. Since protocol 1.4.
    Standby { pid: u32 },
    /// Which replicas of lost ranks this worker brings to the reshape to
    /// `step` (read before it takes its new place).
    Donations { rank: usize, step: u64 },
    /// A registered worker takes a new place in the data-parallel group
    /// (a reshape directive of `epoch`): its state map for that place. The
    /// agent makes its store anew for the map's layout.
    Reshape {
        rank: usize,
        pid: u32,
        epoch: u64,
        map: StateMap,
    },
    /// Write a last-words checkpoint now and carry on.
    Dump,
    /// Make a rank give itself a fault at its next step (for a UCE: in
    /// state part `buffer`, default the largest, at byte `offset`).
    Inject {
        rank: usize,
        fault: InjectKind,
        #[serde(default)]
        buffer: Option<String>,
        #[serde(default)]
        offset: u64,
        /// Give it at the start of this step instead of the next one.
        #[serde(default)]
        at_step: Option<u64>,
    },
    /// Job overview.
    Status,
    /// Per-rank details.
    Workers,
    /// Fault history.
    Faults,
    /// What the device fault sources reported, and what was decided about
    /// each report (since protocol 1.5).
    DeviceFaults,
}

impl Request {
    /// Whether the request changes the job (and so needs the owner's uid).
    pub fn mutates(&self) -> bool {
        matches!(
            self,
            Self::Register { .. }
                | Self::Standby { .. }
                | Self::Donations { .. }
                | Self::Reshape { .. }
                | Self::Dump
                | Self::Inject { .. }
        )
    }
}

/// A lost rank's replica that a worker brings to a reshape: the store
/// (in the agent's folder) and the state map that says what its bytes are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Donation {
    pub rank: usize,
    pub store: PathBuf,
    pub map: StateMap,
}

/// The fault an `Inject` request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InjectKind {
    /// SIGKILL itself.
    Crash,
    /// Block inside the step forever.
    Hang,
    /// An uncorrectable memory error in a state part.
    Uce,
}

/// How a registered worker starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StartMode {
    /// Start (or `--load`) normally under `epoch`.
    Fresh { epoch: u64 },
    /// A replacement: wait for the agent's directive, which names the step
    /// to restore and the epoch to join.
    AwaitDirective,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Response {
    Registered {
        store: PathBuf,
        start: StartMode,
        /// Whether a failed collective should wait for recovery (else the
        /// worker exits, as without high availability).
        recover: bool,
        /// The agent writes the periodic and final checkpoints from the
        /// snapshots (the worker holds each save step's snapshot for it and
        /// does not save itself).
        #[serde(default)]
        agent_saves: bool,
        /// The store holds this rank's slice of each replicated part only
        /// (the group rebuilds the rest with an all-gather on restore).
        #[serde(default)]
        sliced: bool,
    },
    /// A standby becomes `rank` (local rank `local_rank`, its
    /// `restarts`-th process): it registers as that rank next, and restores
    /// its state from shared memory. `error_file` is the rank's
    /// `TORCHELASTIC_ERROR_FILE` (since protocol 1.5).
    Assigned {
        rank: usize,
        local_rank: usize,
        restarts: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error_file: Option<PathBuf>,
    },
    /// The replicas a worker reads the lost ranks' state from (`sliced`:
    /// they hold a slice of each replicated part).
    Donations {
        sliced: bool,
        donations: Vec<Donation>,
    },
    /// The answer to a reshape: the rank's new store.
    Reshaped {
        store: PathBuf,
        sliced: bool,
    },
    Status(Box<StatusReport>),
    Workers(Vec<WorkerReport>),
    Faults(Vec<FaultRecord>),
    DeviceFaults(Vec<DeviceFaultRecord>),
    /// An injection was posted.
    Injected {
        message: String,
    },
    /// A last-words checkpoint was written (or why not).
    Dumped {
        iteration: Option<u64>,
        dir: Option<PathBuf>,
        message: String,
    },
    Error {
        message: String,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotReport {
    pub step: u64,
    pub age_s: f64,
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerReport {
    pub rank: usize,
    pub local_rank: usize,
    pub pid: Option<i32>,
    pub phase: Phase,
    pub step: u64,
    pub epoch: u64,
    pub heartbeat: u64,
    pub restarts: u64,
    pub last_snapshot: Option<SnapshotReport>,
    /// Duration of the last snapshot commit, and how long it blocked the
    /// training loop, in milliseconds.
    pub last_commit_ms: Option<f64>,
    pub last_commit_blocking_ms: Option<f64>,
    /// The rank registered with the runtime: its state is snapshotted and
    /// it can be restarted in place. A worker that never did is supervised
    /// as torchrun would (the whole group restarts).
    #[serde(default)]
    pub protected: bool,
    /// The time the rank's training thread spent in hatrain's calls, per
    /// step (absent before its first step, or from an older worker).
    #[serde(default)]
    pub held_time: Option<HeldTimeReport>,
    /// The rank's snapshot copies.
    #[serde(default)]
    pub copies: Option<CopyReport>,
    /// Where its steps went, phase by phase (absent before its second
    /// step, or from an older worker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_times: Option<crate::shm::StepTimesReport>,
}

/// The time a rank's training thread spent in hatrain's calls per step: the
/// step boundary, the UCE checks, the update fences (a wait for a snapshot
/// copy included) and the commit hand-off. Quantiles are upper bounds (the
/// edge of a histogram bucket, 16 µs << k, or the maximum).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeldTimeReport {
    pub steps: u64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub last_ms: f64,
}

impl HeldTimeReport {
    /// The report of a control page's statistics; `None` before a step.
    pub fn of(s: &crate::shm::HeldStats) -> Option<Self> {
        let ms = |ns: u64| ns as f64 / 1e6;
        (s.steps > 0).then(|| Self {
            steps: s.steps,
            mean_ms: ms(s.total_ns) / s.steps as f64,
            p50_ms: ms(s.quantile_ns(0.5).unwrap_or(0)),
            p99_ms: ms(s.quantile_ns(0.99).unwrap_or(0)),
            max_ms: ms(s.max_ns),
            last_ms: ms(s.last_ns),
        })
    }
}

/// A rank's snapshot copies: those sealed (their time, bytes and the
/// commit thread's CPU time, summed), those skipped because the update
/// began before they finished, and the updates that waited for one after
/// too many skips.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CopyReport {
    pub sealed: u64,
    pub copy_ms_mean: f64,
    pub bytes: u64,
    pub copy_s: f64,
    pub cpu_s: f64,
    /// Commit-thread CPU seconds per GB (10^9 bytes) sealed.
    pub cpu_s_per_gb: f64,
    pub skipped: u64,
    pub waited_after_misses: u64,
    /// Snapshots not taken because every slot but the newest was held
    /// (for the persister, or for the replicas while they catch up).
    #[serde(default)]
    pub thinned: u64,
}

impl CopyReport {
    /// The report of a control page's statistics; `None` before any copy.
    pub fn of(c: &crate::shm::CommitStats) -> Option<Self> {
        (c.sealed > 0 || c.skipped > 0 || c.thinned > 0).then(|| Self {
            sealed: c.sealed,
            copy_ms_mean: c.sealed_ns as f64 / 1e6 / c.sealed.max(1) as f64,
            bytes: c.sealed_bytes,
            copy_s: c.sealed_ns as f64 / 1e9,
            cpu_s: c.sealed_cpu_ns as f64 / 1e9,
            cpu_s_per_gb: if c.sealed_bytes > 0 {
                c.sealed_cpu_ns as f64 / c.sealed_bytes as f64
            } else {
                0.0
            },
            skipped: c.skipped,
            waited_after_misses: c.waited_after_misses,
            thinned: c.thinned,
        })
    }
}

/// What was done about a fault.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultAction {
    /// Its state restored from s\* and the step recomputed, in place.
    Repair,
    /// The rank restarted in place (a fresh process or a warm standby).
    Reboot,
    /// The whole group restarted, as torchrun would.
    GroupRestart,
    /// Its ranks restarted on a standby host.
    Standby,
    /// The data-parallel group went on without its ranks.
    Shrink,
    /// The last-words checkpoint written, then the job stopped.
    LastWords,
    /// The job stopped.
    Stop,
    /// Nothing: the job was stopping already.
    #[default]
    None,
}

impl FaultAction {
    /// Its name, as the metrics label it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Repair => "repair",
            Self::Reboot => "reboot",
            Self::GroupRestart => "group_restart",
            Self::Standby => "standby",
            Self::Shrink => "shrink",
            Self::LastWords => "last_words",
            Self::Stop => "stop",
            Self::None => "none",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultRecord {
    pub id: u64,
    pub ranks: Vec<usize>,
    /// What was seen.
    pub kind: FaultKind,
    /// How it was seen (exit status, signal...).
    pub detail: String,
    pub detected_unix_s: f64,
    /// The consistent step restored to, once decided.
    pub s_star: Option<u64>,
    /// What was done about it, and how it went.
    pub action: String,
    /// What was done, as a type: what code branches on (and the metrics'
    /// label), never the words of `action`.
    #[serde(default)]
    pub class: FaultAction,
    /// Detection to the first step completed after recovery.
    pub recovery_s: Option<f64>,
    /// Steps that had to be computed again.
    pub steps_lost: Option<u64>,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatusReport {
    pub job: String,
    pub world_size: usize,
    pub local_ranks: usize,
    pub epoch: u64,
    pub modes: HaModes,
    pub uptime_s: f64,
    pub recovering: bool,
    /// What the agent is doing: running, recovering, dumping (and where).
    #[serde(default)]
    pub activity: Option<String>,
    /// What the rendezvous store has served and refused (node 0).
    #[serde(default)]
    pub store: Option<crate::store::StoreStats>,
    /// Where the rendezvous store listens (node 0).
    #[serde(default)]
    pub store_addr: Option<String>,
    pub workers: Vec<WorkerReport>,
    pub faults: Vec<FaultRecord>,
    /// The agent-side checkpoint writer, when it saves for the trainer.
    #[serde(default)]
    pub persist: Option<PersistReport>,
    /// Peer replicas: what this agent streams and what it holds.
    #[serde(default)]
    pub replicas: Option<ReplicaReport>,
    /// The job's agents as this one hears them (several nodes).
    #[serde(default)]
    pub membership: Option<MembershipReport>,
    /// The resizes of the data-parallel group (elastic training).
    #[serde(default)]
    pub resizes: Vec<ResizeRecord>,
    /// The median recent step time the hang watchdog measures.
    #[serde(default)]
    pub step_time_s: Option<f64>,
    /// Ranks found holding the job back, newest last.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slow: Vec<crate::slowness::SlowFinding>,
}

/// A resize of the data-parallel group (elastic training).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResizeRecord {
    /// The fault (or the host's return) that caused it.
    pub fault: Option<u64>,
    pub from: usize,
    pub to: usize,
    /// The step the group resumed from at the new size.
    pub s_star: Option<u64>,
    /// From the fault to the first step completed at the new size.
    pub seconds: Option<f64>,
}

/// The job's agents, as one agent hears them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MembershipReport {
    /// Where this agent takes heartbeats.
    pub listen: String,
    /// Nodes heard within the host timeout (this one included).
    pub live: Vec<u64>,
    /// Nodes heard once and not any more.
    pub lost: Vec<u64>,
    /// Nodes not heard yet.
    pub starting: Vec<u64>,
    /// The node this agent follows as the job's controller.
    pub follows: Option<u64>,
    /// This agent may act as the controller (it hears a strict majority
    /// that follows it).
    pub acting: bool,
    pub term: u64,
    /// Faults the controller holds undecided until it may act again (with
    /// etcd: until it holds its lease and the leader key).
    #[serde(default)]
    pub waiting_faults: usize,
}

/// Peer replicas, as one agent sees them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaReport {
    /// Where this agent takes replicas from its peers (`tcp://ADDR:PORT`).
    pub listen: String,
    /// The streams of this host's snapshots to other hosts.
    pub streams: Vec<StreamReport>,
    /// The replicas this agent holds of other hosts' ranks.
    pub held: Vec<HeldReport>,
    /// Peer frames refused: not of the protocol, failing their tag, or
    /// replayed.
    pub rejected_malformed: u64,
    pub rejected_forged: u64,
    pub rejected_replayed: u64,
    /// Snapshot bytes written into the replicas held here, and the CPU
    /// seconds the receiving thread has used (checking tags, copying,
    /// hashing; ZeroMQ's I/O thread not counted).
    #[serde(default)]
    pub received_bytes: u64,
    #[serde(default)]
    pub receive_cpu_s: f64,
    /// The steps every store and replica keeps for the replicas: the one
    /// held everywhere, and the next (see [`crate::shm::Kept`]).
    #[serde(default)]
    pub kept: crate::shm::Kept,
}

/// One stream of this host's snapshots to a peer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamReport {
    pub node: u64,
    pub endpoint: String,
    /// The peer welcomed this agent (its session is open).
    pub connected: bool,
    pub bytes_sent: u64,
    pub chunks_sent: u64,
    pub ranks: Vec<RankReplicaReport>,
    /// CPU seconds the stream's thread has used (framing, tagging, sending;
    /// ZeroMQ's I/O thread, which copies into the kernel, not counted).
    #[serde(default)]
    pub cpu_s: f64,
}

/// How far a peer's replica of one rank is behind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankReplicaReport {
    pub rank: u64,
    /// The newest snapshot sealed here.
    pub local_step: Option<u64>,
    /// The newest snapshot the peer stored.
    pub replica_step: Option<u64>,
    /// Steps and bytes the peer lacks of the newest snapshot.
    pub lag_steps: Option<u64>,
    pub lag_bytes: u64,
    /// Snapshots given up (rewritten while sent, or dropped by the peer).
    pub abandoned: u64,
    /// The peer's replica is behind every step this host keeps of the rank
    /// but the one its next snapshot overwrites: were this host lost now,
    /// and no other holder current, no step would be common to the replica
    /// and the other ranks (since protocol 1.6).
    #[serde(default)]
    pub at_risk: bool,
}

/// A replica this agent holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeldReport {
    pub rank: u64,
    pub from_node: u64,
    /// Sealed steps, newest first.
    pub steps: Vec<u64>,
    pub stored: u64,
    pub dropped: u64,
    pub path: PathBuf,
}

/// What the agent-side persister has done.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PersistReport {
    pub dir: PathBuf,
    pub interval: u64,
    /// The newest iteration it wrote, and how long that took.
    pub last_saved: Option<u64>,
    pub last_seconds: Option<f64>,
    /// Checkpoints written.
    pub saves: u64,
    /// Save steps passed over because the disk was still busy.
    pub skipped: Vec<u64>,
    /// The iteration being written now.
    pub writing: Option<u64>,
    /// The last failure, if the newest attempt failed.
    pub last_error: Option<String>,
    /// Bytes of every checkpoint written so far.
    #[serde(default)]
    pub bytes_written: u64,
}

/// What kind of fault a record is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// A worker process died (signal or non-zero exit).
    Crash,
    /// A worker made no progress within its bound.
    Hang,
    /// An uncorrectable memory error.
    Uce,
    /// A worker exited 0 while its peers had not finished.
    EarlyExit,
    /// A worker did not pause for a recovery in time.
    NoPause,
    /// The ranks could not rebuild their communicator.
    Rebuild,
    /// The kernel's OOM killer killed a worker: out of memory.
    Oom,
    /// A rank's snapshot store could not be made on the host (no room in
    /// the shm root, or no resources).
    Store,
    /// Another host of the job is gone: no heartbeat within the host
    /// timeout, or its connection dropped.
    HostLost,
    /// A device fault source (an NPU's driver) took a device out: its
    /// ranks cannot go on on this host (since protocol 1.5).
    Device,
    /// A rank held the job back long enough that handing it to a fresh
    /// process (a warm standby) costs less than leaving it
    /// (`--on-slow replace`; since protocol 1.8).
    Slow,
}

/// One report of a device fault source, and what the agent decided.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceFaultRecord {
    /// Which source: `nvml`, `dcmi`, `npu-smi`.
    pub source: String,
    pub device: u32,
    /// The event code (an NVML Xid, a DCMI event id), if any.
    pub code: Option<u64>,
    /// MindCluster's class of the code, for NPU sources.
    pub class: Option<String>,
    /// What was done: `ignore`, `uce`, `crash`, `hang`, `host`, or
    /// `dropped` (with the reason in `why`).
    pub action: String,
    /// Why (the table's row, a side effect, an escalation).
    pub why: String,
    /// The ranks of this host on the device.
    pub ranks: Vec<usize>,
    /// The source's text for it.
    pub text: String,
    pub unix_s: f64,
}

impl std::fmt::Display for FaultKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            Self::Crash => "crash",
            Self::Hang => "hang",
            Self::Uce => "uce",
            Self::EarlyExit => "early exit",
            Self::NoPause => "no pause",
            Self::Rebuild => "rebuild",
            Self::Oom => "out of memory",
            Self::Store => "no store",
            Self::HostLost => "host lost",
            Self::Device => "device",
            Self::Slow => "slow",
        })
    }
}

/// Why a control request got no usable reply.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("not talking to the agent at {0}")]
    Untrusted(#[from] crate::trust::TrustError),
    #[error("cannot connect to the agent at {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not served by the agent of its job: {detail}")]
    NotTheAgent { path: PathBuf, detail: String },
    #[error("talking to the agent at {path}")]
    Frame {
        path: PathBuf,
        #[source]
        source: FrameError,
    },
}

/// Checks, before anything is sent, that `socket` and its folder are the
/// agent's: not symlinks, this user's or root's, writable by nobody else
/// (see [`crate::trust`]).
pub fn trusted_socket(socket: &Path) -> Result<(), crate::trust::TrustError> {
    let me = crate::trust::me();
    if let Some(dir) = socket.parent().filter(|d| !d.as_os_str().is_empty()) {
        crate::trust::check(dir, crate::trust::Kind::Dir, me)?;
    }
    crate::trust::check(socket, crate::trust::Kind::Socket, me)?;
    Ok(())
}

/// Connects to the agent at `socket`, after checking that the socket and
/// its folder are trusted ([`trusted_socket`]), and that the process at the
/// other end is the agent that holds the folder's lock
/// ([`crate::joblock`]): not a stale socket, and not a second agent that
/// took the folder by mistake.
pub fn connect(socket: &Path) -> Result<std::os::unix::net::UnixStream, ClientError> {
    trusted_socket(socket)?;
    let s =
        std::os::unix::net::UnixStream::connect(socket).map_err(|source| ClientError::Connect {
            path: socket.to_path_buf(),
            source,
        })?;
    let not = |detail: String| ClientError::NotTheAgent {
        path: socket.to_path_buf(),
        detail,
    };
    let peer = nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(|e| not(format!("cannot read its peer's credentials: {e}")))?
        .pid();
    let dir = socket
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    match crate::joblock::probe(dir) {
        Ok(crate::joblock::LockState::Held(Some(h))) if h.pid == peer => Ok(s),
        Ok(crate::joblock::LockState::Held(Some(h))) => Err(not(format!(
            "its peer is pid {peer}, but the job's lock is held by pid {} (job {}, started at {})",
            h.pid,
            h.job,
            h.started()
        ))),
        Ok(crate::joblock::LockState::Held(None)) => {
            Err(not("its agent is still starting; try again".into()))
        }
        Ok(crate::joblock::LockState::Free) => Err(not(format!(
            "no agent holds the job's lock ({}): the agent that made it is gone",
            dir.join(crate::joblock::LOCK).display()
        ))),
        Ok(crate::joblock::LockState::Missing) => Err(not(format!(
            "{} has no {}",
            dir.display(),
            crate::joblock::LOCK
        ))),
        Err(e) => Err(not(format!("cannot probe the job's lock: {e}"))),
    }
}

/// Sends one request to the agent listening on `socket` and returns its
/// reply (a blocking client, for `agentctl`, workers and the demo);
/// `timeout` bounds the wait for the reply. The agent is checked first
/// ([`connect`]).
pub fn request(
    socket: &Path,
    request: &Request,
    timeout: Duration,
) -> Result<Response, ClientError> {
    let frame = |source| ClientError::Frame {
        path: socket.to_path_buf(),
        source,
    };
    let mut s = connect(socket)?;
    s.set_read_timeout(Some(timeout))
        .map_err(|source| ClientError::Connect {
            path: socket.to_path_buf(),
            source,
        })?;
    PROTOCOL.send_json(&mut s, request).map_err(frame)?;
    PROTOCOL.recv_json(&mut s).map_err(frame)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn only_registration_mutates() {
        assert!(
            Request::Register {
                rank: 0,
                pid: 1,
                map: StateMap {
                    parts: vec![],
                    checkpoint: None,
                    global_batch: None,
                },
                slots: None,
            }
            .mutates()
        );
        assert!(!Request::Status.mutates());
    }

    proptest! {
        #[test]
        fn requests_round_trip(rank in 0usize..100_000, pid in any::<u32>(), name in "[a-z_]{0,12}", len in any::<u64>()) {
            use crate::statemap::{Dtype, Part, Sharing};
            let map = StateMap { parts: vec![Part { name, dtype: Dtype::F32, len, sharing: Sharing::Unique }], checkpoint: None, global_batch: None };
            let req = Request::Register { rank, pid, map, slots: (pid % 3 == 0).then_some(3) };
            let mut buf = Vec::new();
            PROTOCOL.send_json(&mut buf, &req).unwrap();
            let back: Request = PROTOCOL.recv_json(&mut &buf[..]).unwrap();
            prop_assert_eq!(back, req);
        }

        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = PROTOCOL.recv_json::<_, Request>(&mut &bytes[..]);
            let _ = PROTOCOL.parse_json::<Response>(&bytes);
        }
    }
}
