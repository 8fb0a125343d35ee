//! The configuration of one host's part of a job: what `launch` and
//! `serve` are given (flags, the environment of mpirun, srun or a
//! scheduler) made into a [`LaunchConfig`], the worker specs it gives each
//! local rank ([`LaunchConfig::worker_specs`]: the environment torchrun
//! gives its workers), and the errors of a launch. Below the job: the job
//! and the verbs read it; it reads neither.
//!
//! Ports: the workers' `MASTER_ADDR:MASTER_PORT` is theirs, as under
//! torchrun (rank 0 of node 0 listens there, for torch's own store); the
//! agents' store listens on `--rdzv-port` (default `--master-port` + 1 on
//! several nodes, a free port on one), and hatrain's workers find it in
//! `HATRAIN_AGENT_STORE`.

use crate::control::ControlError;
use crate::reaper::ReaperError;
use crate::recovery::{HangPolicy, RestartPolicy};
use crate::spec::{ENV_ERROR_FILE, ENV_GROUP_RESTARTS, OutputPlan, WorkerSpec, error_file};
use crate::supervisor::SupervisorError;
use hatrain_shared::ha::HaModes;
use hatrain_shared::ident::JobId;
use hatrain_shared::rendezvous::ENV_AGENT_STORE;
use hatrain_shared::store::RendezvousError;
use std::ffi::OsString;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

/// Environment variables a node rank may come from, in order of precedence
/// (after `--node-rank`).
pub const NODE_RANK_VARS: [&str; 3] = ["SLURM_NODEID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"];

#[derive(Debug, Clone, PartialEq)]
pub struct LaunchConfig {
    pub nnodes: usize,
    pub node_rank: usize,
    pub nproc_per_node: usize,
    pub master_addr: String,
    /// The workers' `MASTER_PORT`; `None` on a single node: a free port.
    pub master_port: Option<u16>,
    /// The agents' rendezvous store's port; `None`: see [`Self::store_port`].
    pub rdzv_port: Option<u16>,
    /// Times the whole group may be stopped and started again after a
    /// worker fails, when worker reboot cannot handle it (torchrun's
    /// `--max-restarts`).
    pub group_restarts: u32,
    /// Where the workers' output and error files go.
    pub output: OutputPlan,
    pub job_id: JobId,
    /// Where the job's secret comes from (`None`: made for this launch).
    pub secret_file: Option<PathBuf>,
    /// Compute threads per worker (`RAYON_NUM_THREADS`), unless the
    /// environment already sets it.
    pub threads_per_worker: usize,
    pub stop_grace: Duration,
    /// The worker command: program and arguments.
    pub command: Vec<OsString>,
    pub ha: HaSettings,
    /// The environment the workers start from, when another launcher
    /// started them (`serve`: their exec shims'); `None`: the agent's own.
    pub worker_env: Option<std::collections::BTreeMap<String, String>>,
}

/// Most warm standby processes per host.
pub const MAX_WARM_STANDBYS: usize = 64;

/// High-availability settings of a launch.
#[derive(Debug, Clone, PartialEq)]
pub struct HaSettings {
    pub modes: HaModes,
    pub policy: RestartPolicy,
    /// Root of the snapshot stores: `<root>/<job>/rank_NNNNN.shm`.
    pub shm_root: PathBuf,
    /// Snapshot slots per rank (at least 2).
    pub slots: usize,
    /// How long every rank has to pause (and, doubled, to resume) in a
    /// recovery.
    pub pause_timeout: Duration,
    pub hang: HangPolicy,
    /// Leave the trainer's `--save-interval` saves to the trainer (on the
    /// training path) instead of writing them from the snapshots.
    pub trainer_saves: bool,
    /// How long a worker may run without registering with the runtime
    /// before the agent warns that it is not protected.
    pub register_timeout: Duration,
    /// Snapshots hold each rank's slice of the replicated parts only.
    pub slices: bool,
    /// Hosts that hold a copy of this host's snapshots (several nodes).
    pub replicas: usize,
    /// This host's failure-domain label.
    pub failure_domain: Option<String>,
    /// Another host is lost after this long without a heartbeat.
    pub host_timeout: Duration,
    /// The address peers send replicas to (default: the route to the
    /// master address).
    pub local_addr: Option<std::net::IpAddr>,
    /// Spare agents of the job (node ranks `nnodes..nnodes + standby_nodes`).
    pub standby_nodes: usize,
    /// Warm standby worker processes kept on this host.
    pub warm_standbys: usize,
    /// What a slow rank gets (`--on-slow`), and the price of handing it
    /// over until this job measured one (`--slow-handover-secs`).
    pub on_slow: crate::slow::OnSlow,
    pub slow_handover: Duration,
    /// Python modules the fork server of the workers imports (`--preload`;
    /// none: no server).
    pub preload: Vec<String>,
    /// This agent is one of them.
    pub standby: bool,
    /// Elastic training shrinks only while this many hosts are left.
    pub min_nodes: usize,
    /// Where membership and leadership are kept.
    pub coordinator: CoordinatorChoice,
    /// With etcd: how long a fault waits for etcd before the job stops.
    pub coordinator_timeout: Duration,
    /// How device faults are handled (`--fault-table` over the defaults).
    pub fault_table: hatrain_shared::npu::FaultTable,
    /// The devices of the local ranks, in local-rank order (`--devices`).
    pub devices: Option<Vec<u32>>,
    /// The Ascend source's DCMI library, and its `npu-smi` where the
    /// library is missing.
    pub dcmi_library: std::path::PathBuf,
    pub npu_smi: std::path::PathBuf,
}

/// Where a job of several nodes keeps membership and leadership.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum CoordinatorChoice {
    /// The agents agree among themselves (heartbeats and a majority).
    #[default]
    Embedded,
    /// etcd's members, as `host:port`.
    Etcd(Vec<String>),
}

/// A `--coordinator` value that names no coordinator.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorChoiceError {
    #[error("--coordinator {0:?}: expected `embedded` or etcd://HOST:PORT[,HOST:PORT...]")]
    Unknown(String),
    #[error(transparent)]
    Etcd(#[from] crate::coordinator::etcd::EtcdError),
}

impl std::str::FromStr for CoordinatorChoice {
    type Err = CoordinatorChoiceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "embedded" => Ok(Self::Embedded),
            _ if s.starts_with("etcd://") => {
                Ok(Self::Etcd(crate::coordinator::etcd::parse_url(s)?))
            }
            _ => Err(CoordinatorChoiceError::Unknown(s.to_string())),
        }
    }
}

impl Default for HaSettings {
    fn default() -> Self {
        Self {
            modes: HaModes::default(),
            policy: RestartPolicy::default(),
            shm_root: hatrain_shared::trust::default_shm_root(),
            slots: 2,
            pause_timeout: Duration::from_secs(60),
            hang: HangPolicy::default(),
            trainer_saves: false,
            register_timeout: Duration::from_secs(60),
            slices: true,
            replicas: 1,
            failure_domain: None,
            host_timeout: Duration::from_secs(3),
            local_addr: None,
            standby_nodes: 0,
            warm_standbys: 0,
            on_slow: crate::slow::OnSlow::Report,
            slow_handover: Duration::from_secs(5),
            preload: Vec::new(),
            standby: false,
            min_nodes: 1,
            coordinator: CoordinatorChoice::Embedded,
            coordinator_timeout: Duration::from_secs(30),
            fault_table: hatrain_shared::npu::FaultTable::default(),
            devices: None,
            dcmi_library: "libdcmi.so".into(),
            npu_smi: "npu-smi".into(),
        }
    }
}

/// The program a worker runs, as torchrun picks it: the command as it is
/// with `--no-python`; `python -u -m MODULE ...` with `-m`; `python -u
/// SCRIPT ...` for a script ending in `.py`; else the command as it is (so
/// `-- hatrain-train ...` runs the binary). `python` is `$HATRAIN_PYTHON`,
/// else `python3` on the PATH.
pub fn worker_command(
    command: Vec<OsString>,
    no_python: bool,
    module: bool,
    python: Option<OsString>,
) -> Result<Vec<OsString>, LaunchError> {
    if command.is_empty() {
        return Err(LaunchError::Config(
            "no worker command given (a script, or a program after `--`)".into(),
        ));
    }
    if no_python && module {
        return Err(LaunchError::Config(
            "--no-python and -m/--module do not go together".into(),
        ));
    }
    let script = std::path::Path::new(&command[0])
        .extension()
        .is_some_and(|e| e == "py");
    if no_python || !(module || script) {
        return Ok(command);
    }
    let mut c = vec![python.unwrap_or_else(|| "python3".into()), "-u".into()];
    if module {
        c.push("-m".into());
    }
    c.extend(command);
    Ok(c)
}

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("invalid launch configuration: {0}")]
    Config(String),
    #[error("cannot host the rendezvous store")]
    Store(#[source] RendezvousError),
    #[error(transparent)]
    Reaper(#[from] ReaperError),
    #[error(transparent)]
    Supervisor(#[from] SupervisorError),
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error(transparent)]
    JobDir(#[from] crate::jobdir::JobDirError),
    #[error("the job's secret")]
    Secret(#[from] hatrain_shared::auth::AuthError),
    #[error(transparent)]
    Replicator(#[from] crate::replicator::ReplicatorError),
    #[error(transparent)]
    Membership(#[from] crate::coordinator::wire::MembershipError),
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A device of this host is lost to a job of several hosts: the host
    /// left the job, which recovers without it.
    #[error("device lost: this host left the job ({detail})")]
    DeviceLost { detail: String },
    /// This host held the job back, and the job's controller handed its
    /// ranks to a standby host (`--on-slow replace`): the host left the
    /// job, which goes on without it.
    #[error("this host held the job back and left it for a standby host ({detail})")]
    HandedOver { detail: String },
}

/// Where a launch's job id came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobIdSource {
    /// `--job-id` or `HATRAIN_JOB_ID`.
    Given,
    /// The launcher's own run id (Slurm's job and step).
    Launcher(&'static str),
    /// Made for this launch: unique on the host.
    Made,
}

/// Picks the job id: the flag (or `HATRAIN_JOB_ID`), else Slurm's job and
/// step (`slurm-<job>.<step>`, with `-node<K>` on several nodes, since
/// several agents of one job may share a host), else one made for this
/// launch from its pid and random bits, so that two launches with default
/// settings never share a folder.
pub fn resolve_job_id(
    flag: Option<JobId>,
    nnodes: usize,
    node_rank: usize,
    get: impl Fn(&str) -> Option<String>,
) -> Result<(JobId, JobIdSource), LaunchError> {
    if let Some(id) = flag {
        return Ok((id, JobIdSource::Given));
    }
    if let Some(job) = get("SLURM_JOB_ID") {
        let step = get("SLURM_STEP_ID").unwrap_or_else(|| "0".into());
        let mut id = format!("slurm-{}.{}", job.trim(), step.trim());
        if nnodes > 1 {
            id.push_str(&format!("-node{node_rank}"));
        }
        let id = JobId::new(&id).map_err(|e| {
            LaunchError::Config(format!("SLURM_JOB_ID={job:?} gives no job id: {e}"))
        })?;
        return Ok((id, JobIdSource::Launcher("SLURM_JOB_ID")));
    }
    let tag = crate::random_tag()
        .map_err(|e| LaunchError::Config(format!("cannot make a job id: {e}")))?;
    let id = format!("hatrain-{}-{tag}", std::process::id());
    Ok((
        JobId::new(&id).expect("a made id is a name"),
        JobIdSource::Made,
    ))
}

/// Picks the node rank: the flag, else the first of [`NODE_RANK_VARS`] set.
pub fn resolve_node_rank(
    flag: Option<usize>,
    get: impl Fn(&str) -> Option<String>,
) -> Result<usize, LaunchError> {
    if let Some(r) = flag {
        return Ok(r);
    }
    for var in NODE_RANK_VARS {
        if let Some(v) = get(var) {
            return v
                .trim()
                .parse()
                .map_err(|_| LaunchError::Config(format!("{var}={v:?} is not a node rank")));
        }
    }
    Ok(0)
}

impl LaunchConfig {
    pub fn validate(&self) -> Result<(), LaunchError> {
        let bad = |m: String| Err(LaunchError::Config(m));
        if self.nnodes == 0 || self.nproc_per_node == 0 {
            return bad("--nnodes and --nproc-per-node must be at least 1".into());
        }
        if self.ha.standby {
            if self.node_rank < self.nnodes || self.node_rank >= self.nnodes + self.ha.standby_nodes
            {
                return bad(format!(
                    "a --standby agent takes a node rank from --nnodes {} to --nnodes + --standby-nodes - 1 ({}); node rank {} is not one",
                    self.nnodes,
                    self.nnodes + self.ha.standby_nodes.max(1) - 1,
                    self.node_rank
                ));
            }
            if !self.ha.modes.recover {
                return bad(
                    "a --standby agent takes over the ranks of a lost host by worker reboot: give --enable-worker-reboot to every agent"
                        .into(),
                );
            }
        } else if self.node_rank >= self.nnodes {
            return bad(format!(
                "node rank {} is outside --nnodes {}{}",
                self.node_rank,
                self.nnodes,
                if self.node_rank < self.nnodes + self.ha.standby_nodes {
                    " (a spare agent takes --standby)"
                } else {
                    ""
                }
            ));
        }
        if self.nnodes > 1 && self.master_port.is_none() {
            return bad("--master-port is required with more than one node".into());
        }
        if self.nnodes > 1 && self.rdzv_port.is_none() && self.master_port == Some(u16::MAX) {
            return bad(
                "--master-port 65535 leaves no port above it for the agents' store: give --rdzv-port"
                    .into(),
            );
        }
        if self.master_port.is_some() && self.master_port == self.store_port() {
            return bad(
                "--rdzv-port must differ from --master-port: the workers' rank 0 listens on --master-port"
                    .into(),
            );
        }
        if self.nnodes > 1 && self.secret_file.is_none() {
            return bad(
                "--secret-file is required with more than one node: every host's agent needs the job's secret"
                    .into(),
            );
        }
        if self.command.is_empty() {
            return bad("no worker command given (put it after `--`)".into());
        }
        if self.ha.host_timeout < Duration::from_millis(300) {
            return bad(format!(
                "--host-timeout-secs {} is shorter than a heartbeat can be trusted to arrive in (0.3 s at least)",
                self.ha.host_timeout.as_secs_f64()
            ));
        }
        if self.nnodes > 1 && self.ha.replicas >= self.nnodes {
            return bad(format!(
                "--replicas {} needs more hosts than --nnodes {}: a replica never stays on its own host",
                self.ha.replicas, self.nnodes
            ));
        }
        if self.ha.warm_standbys > 0 && !self.ha.modes.recover {
            return bad(format!(
                "--warm-standby {} needs --enable-worker-reboot: a standby takes the place of a rank that is restarted in place",
                self.ha.warm_standbys
            ));
        }
        if !self.ha.preload.is_empty() {
            for m in &self.ha.preload {
                crate::supervisor::check_module(m)
                    .map_err(|e| LaunchError::Config(e.to_string()))?;
            }
            if let Some((program, args)) = self.command.split_first() {
                crate::supervisor::PythonCommand::parse(program.as_ref(), args)
                    .map_err(|e| LaunchError::Config(format!("--preload: {e}")))?;
            }
        }
        if self.ha.on_slow == crate::slow::OnSlow::Replace && !self.ha.modes.recover {
            return bad(
                "--on-slow replace needs --enable-worker-reboot: a slow rank is handed over by restarting it in place (to a warm standby where there is one)"
                    .to_string(),
            );
        }
        if self.ha.warm_standbys > MAX_WARM_STANDBYS {
            return bad(format!(
                "--warm-standby {} is more than {MAX_WARM_STANDBYS} processes per host",
                self.ha.warm_standbys
            ));
        }
        if !(2..=hatrain_shared::shm::MAX_SLOTS).contains(&self.ha.slots) {
            return bad(format!(
                "--snapshot-slots {} must be between 2 and {}",
                self.ha.slots,
                hatrain_shared::shm::MAX_SLOTS
            ));
        }
        Ok(())
    }

    /// Whether this host streams its snapshots to peers and holds theirs:
    /// on several nodes, with any high-availability mode and `--replicas`
    /// above 0.
    pub fn replicates(&self) -> bool {
        self.nnodes > 1 && self.ha.replicas > 0 && self.ha.modes.any()
    }

    /// A variable of the environment the workers start from.
    pub fn env_var(&self, key: &str) -> Option<String> {
        match &self.worker_env {
            Some(env) => env.get(key).cloned(),
            None => std::env::var(key).ok(),
        }
    }

    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }

    /// The agents' store's port: `--rdzv-port`, else `--master-port` + 1
    /// on several nodes (so every agent derives the same), else `None` (a
    /// free port, on one node).
    pub fn store_port(&self) -> Option<u16> {
        self.rdzv_port.or_else(|| {
            (self.nnodes > 1)
                .then(|| self.master_port.and_then(|p| p.checked_add(1)))
                .flatten()
        })
    }

    /// The worker specs of this node: the workers' `MASTER_ADDR` and
    /// `MASTER_PORT`, the store's address, the run's folder for error
    /// files, and the environment `env` the agent was started with (for
    /// what it leaves alone). Each variable has torchrun's meaning;
    /// `TORCHELASTIC_RESTART_COUNT` counts group restarts and
    /// [`Supervisor`](crate::supervisor::Supervisor) updates it.
    pub fn worker_specs(
        &self,
        master_addr: &str,
        master_port: u16,
        store: SocketAddr,
        run_dir: &std::path::Path,
        env_of: impl Fn(&str) -> Option<String>,
    ) -> Vec<WorkerSpec> {
        let inherited_threads = env_of("RAYON_NUM_THREADS").is_some();
        let omp_unset = env_of("OMP_NUM_THREADS").is_none() && self.nproc_per_node > 1;
        (0..self.nproc_per_node)
            .map(|local_rank| {
                let rank = self.node_rank * self.nproc_per_node + local_rank;
                let world = self.world_size().to_string();
                let mut env = vec![
                    ("RANK".to_string(), rank.to_string()),
                    ("LOCAL_RANK".into(), local_rank.to_string()),
                    ("WORLD_SIZE".into(), world.clone()),
                    ("LOCAL_WORLD_SIZE".into(), self.nproc_per_node.to_string()),
                    ("GROUP_RANK".into(), self.node_rank.to_string()),
                    ("GROUP_WORLD_SIZE".into(), self.nnodes.to_string()),
                    ("ROLE_RANK".into(), rank.to_string()),
                    ("ROLE_WORLD_SIZE".into(), world),
                    ("ROLE_NAME".into(), "default".into()),
                    ("MASTER_ADDR".into(), master_addr.to_string()),
                    ("MASTER_PORT".into(), master_port.to_string()),
                    (ENV_GROUP_RESTARTS.into(), "0".into()),
                    (
                        "TORCHELASTIC_MAX_RESTARTS".into(),
                        self.group_restarts.to_string(),
                    ),
                    ("TORCHELASTIC_RUN_ID".into(), self.job_id.to_string()),
                    // The workers' rank 0 makes torch's store itself: the
                    // agent's store is hatrain's own, on another port.
                    ("TORCHELASTIC_USE_AGENT_STORE".into(), "False".into()),
                    (
                        "TORCH_NCCL_ASYNC_ERROR_HANDLING".into(),
                        env_of("TORCH_NCCL_ASYNC_ERROR_HANDLING").unwrap_or_else(|| "1".into()),
                    ),
                    // The signals the launcher stops the group on, as
                    // torchrun says in its own environment.
                    (
                        "TORCHELASTIC_SIGNALS_TO_HANDLE".into(),
                        env_of("TORCHELASTIC_SIGNALS_TO_HANDLE")
                            .unwrap_or_else(|| "SIGTERM,SIGINT,SIGHUP,SIGQUIT".into()),
                    ),
                    (
                        ENV_ERROR_FILE.into(),
                        error_file(run_dir, 0, local_rank).display().to_string(),
                    ),
                    (ENV_AGENT_STORE.into(), store.to_string()),
                    ("HATRAIN_JOB_ID".into(), self.job_id.to_string()),
                    ("HATRAIN_RESTART_COUNT".into(), "0".into()),
                ];
                if omp_unset {
                    env.push(("OMP_NUM_THREADS".into(), "1".into()));
                }
                if !inherited_threads {
                    env.push((
                        "RAYON_NUM_THREADS".into(),
                        self.threads_per_worker.to_string(),
                    ));
                }
                WorkerSpec {
                    rank,
                    local_rank,
                    program: PathBuf::from(&self.command[0]),
                    args: self.command[1..].to_vec(),
                    env,
                }
            })
            .collect()
    }
}

/// A port free now on `host` (the kernel's pick for port 0), for the
/// workers' `MASTER_PORT` on one node, as torchrun's `--standalone` picks
/// one.
pub(crate) fn free_port(host: &str) -> Result<u16, LaunchError> {
    let addr = resolve(host, 0)?;
    std::net::TcpListener::bind(addr)
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|source| LaunchError::Io {
            path: PathBuf::from(format!("{host}:0")),
            source,
        })
}

pub(crate) fn resolve(host: &str, port: u16) -> Result<SocketAddr, LaunchError> {
    (host, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| LaunchError::Config(format!("--master-addr {host:?} does not resolve")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn cfg() -> LaunchConfig {
        LaunchConfig {
            nnodes: 2,
            node_rank: 1,
            nproc_per_node: 3,
            master_addr: "127.0.0.1".into(),
            master_port: Some(29500),
            rdzv_port: None,
            group_restarts: 0,
            output: OutputPlan::default(),
            job_id: JobId::new("j").unwrap(),
            secret_file: Some(PathBuf::from("/unused")),
            threads_per_worker: 1,
            stop_grace: Duration::from_secs(1),
            command: vec!["train".into(), "--x".into()],
            ha: HaSettings::default(),
            worker_env: None,
        }
    }

    #[test]
    fn node_rank_precedence() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(
            resolve_node_rank(Some(3), env(&[("SLURM_NODEID", "1")])).unwrap(),
            3
        );
        assert_eq!(
            resolve_node_rank(None, env(&[("PMI_RANK", "2"), ("SLURM_NODEID", "1")])).unwrap(),
            1
        );
        assert_eq!(
            resolve_node_rank(None, env(&[("OMPI_COMM_WORLD_RANK", "4")])).unwrap(),
            4
        );
        assert_eq!(resolve_node_rank(None, env(&[])).unwrap(), 0);
        let given = JobId::new("mine").unwrap();
        assert_eq!(
            resolve_job_id(Some(given.clone()), 1, 0, env(&[("SLURM_JOB_ID", "7")])).unwrap(),
            (given, JobIdSource::Given)
        );
        let (id, from) = resolve_job_id(
            None,
            2,
            1,
            env(&[("SLURM_JOB_ID", "7"), ("SLURM_STEP_ID", "3")]),
        )
        .unwrap();
        assert_eq!(
            (id.as_str(), from),
            ("slurm-7.3-node1", JobIdSource::Launcher("SLURM_JOB_ID"))
        );
        let e = resolve_job_id(None, 1, 0, env(&[("SLURM_JOB_ID", "../x")])).unwrap_err();
        assert!(e.to_string().contains("SLURM_JOB_ID"), "{e}");
        let (a, from) = resolve_job_id(None, 1, 0, env(&[])).unwrap();
        let (b, _) = resolve_job_id(None, 1, 0, env(&[])).unwrap();
        assert_eq!(from, JobIdSource::Made);
        assert_ne!(a, b, "made ids differ");
        assert!(
            a.as_str()
                .starts_with(&format!("hatrain-{}-", std::process::id()))
        );
        let e = resolve_node_rank(None, env(&[("PMI_RANK", "x")])).unwrap_err();
        assert!(e.to_string().contains("PMI_RANK=\"x\""), "{e}");
    }

    #[test]
    fn worker_environment_is_torchrun_compatible() {
        let store: SocketAddr = "127.0.0.1:29501".parse().unwrap();
        let specs = cfg().worker_specs("127.0.0.2", 29500, store, Path::new("/run/x"), |_| None);
        assert_eq!(specs.len(), 3);
        let get = |s: &WorkerSpec, k: &str| {
            s.env
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("{k} is set"))
        };
        for (k, v) in [
            ("RANK", "5"),
            ("LOCAL_RANK", "2"),
            ("WORLD_SIZE", "6"),
            ("LOCAL_WORLD_SIZE", "3"),
            ("GROUP_RANK", "1"),
            ("GROUP_WORLD_SIZE", "2"),
            ("ROLE_RANK", "5"),
            ("ROLE_WORLD_SIZE", "6"),
            ("ROLE_NAME", "default"),
            ("MASTER_ADDR", "127.0.0.2"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
            ("TORCHELASTIC_MAX_RESTARTS", "0"),
            ("TORCHELASTIC_RUN_ID", "j"),
            ("TORCHELASTIC_USE_AGENT_STORE", "False"),
            ("TORCHELASTIC_ERROR_FILE", "/run/x/attempt_0/2/error.json"),
            ("HATRAIN_AGENT_STORE", "127.0.0.1:29501"),
            ("OMP_NUM_THREADS", "1"),
        ] {
            assert_eq!(get(&specs[2], k), v, "{k}");
        }
        assert_eq!(specs[0].program, PathBuf::from("train"));
        // What the user set is left alone.
        let specs = cfg().worker_specs("h", 1, store, Path::new("/r"), |k| {
            (k == "OMP_NUM_THREADS").then(|| "4".to_string())
        });
        assert!(specs[0].env.iter().all(|(k, _)| k != "OMP_NUM_THREADS"));
        let mut c = cfg();
        c.rdzv_port = None;
        assert_eq!(c.store_port(), Some(29501), "derived from --master-port");
        c.rdzv_port = Some(29500);
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("--rdzv-port must differ")
        );
        c.nnodes = 1;
        c.node_rank = 0;
        c.rdzv_port = None;
        assert_eq!(c.store_port(), None, "a free port on one node");
    }

    #[test]
    fn commands_run_as_torchrun_runs_them() {
        let v = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(
            worker_command(v(&["ddp.py", "--lr", "1"]), false, false, None).unwrap(),
            v(&["python3", "-u", "ddp.py", "--lr", "1"])
        );
        assert_eq!(
            worker_command(v(&["pkg.train"]), false, true, Some("/v/bin/python".into())).unwrap(),
            v(&["/v/bin/python", "-u", "-m", "pkg.train"])
        );
        assert_eq!(
            worker_command(v(&["ddp.py"]), true, false, None).unwrap(),
            v(&["ddp.py"])
        );
        assert_eq!(
            worker_command(v(&["hatrain-train", "--x"]), false, false, None).unwrap(),
            v(&["hatrain-train", "--x"])
        );
        assert!(worker_command(v(&["x"]), true, true, None).is_err());
        assert!(worker_command(vec![], false, false, None).is_err());
    }

    #[test]
    fn bad_configurations_are_named() {
        let mut c = cfg();
        c.node_rank = 2;
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("outside --nnodes 2")
        );
        let mut c = cfg();
        c.master_port = None;
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("--master-port is required")
        );
        let mut c = cfg();
        c.command.clear();
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("no worker command")
        );
    }

    #[test]
    fn preload_needs_module_names_and_a_python_command() {
        let mut c = cfg();
        c.ha.preload = vec!["torch".into()];
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("--preload") && e.contains("not a Python interpreter"),
            "{e}"
        );
        c.command = vec!["python3".into(), "-u".into(), "train.py".into()];
        c.validate().unwrap();
        c.ha.preload = vec!["torch".into(), "torch/_dynamo".into()];
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("\"torch/_dynamo\" is not a Python module name"),
            "{e}"
        );
    }
}
