//! `hatrain-agent launch`: the torchrun-style launcher of one host.
//!
//! It hosts the job's rendezvous store (on node rank 0), starts
//! `--nproc-per-node` workers with the torchrun environment (`RANK`,
//! `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`), and supervises them until they all finish,
//! one fails, or the agent is asked to stop.

use crate::control::ControlError;
use crate::job::{self, JobReport};
use crate::reaper::ReaperError;
use crate::recovery::{HangPolicy, RestartPolicy};
use crate::supervisor::{SupervisorError, WorkerSpec};
use hatrain_shared::ha::HaModes;
use hatrain_shared::ident::JobId;
use hatrain_shared::rendezvous::ENV_AGENT_STORE;
use hatrain_shared::store::RendezvousError;
use std::ffi::OsString;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Environment variables a node rank may come from, in order of precedence
/// (after `--node-rank`).
pub const NODE_RANK_VARS: [&str; 3] = ["SLURM_NODEID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"];

#[derive(Debug, Clone, PartialEq)]
pub struct LaunchConfig {
    pub nnodes: usize,
    pub node_rank: usize,
    pub nproc_per_node: usize,
    pub master_addr: String,
    /// `None` on a single node: the store picks a free port.
    pub master_port: Option<u16>,
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
}

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
        }
    }
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
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
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
    let mut bits = [0u8; 4];
    getrandom::fill(&mut bits)
        .map_err(|e| LaunchError::Config(format!("cannot make a job id: {e}")))?;
    let id = format!(
        "hatrain-{}-{:08x}",
        std::process::id(),
        u32::from_le_bytes(bits)
    );
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
        if self.node_rank >= self.nnodes {
            return bad(format!(
                "node rank {} is outside --nnodes {}",
                self.node_rank, self.nnodes
            ));
        }
        if self.nnodes > 1 && self.master_port.is_none() {
            return bad("--master-port is required with more than one node".into());
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
        if self.ha.modes.recover && self.nnodes > 1 {
            return bad(
                "worker reboot recovers the ranks of one host; across hosts it needs the job controller, \
                 which this agent does not have yet: use --nnodes 1"
                    .into(),
            );
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

    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }

    /// The worker specs of this node, given the store's actual port.
    pub fn worker_specs(&self, master_port: u16) -> Vec<WorkerSpec> {
        let inherited_threads = std::env::var_os("RAYON_NUM_THREADS").is_some();
        (0..self.nproc_per_node)
            .map(|local_rank| {
                let rank = self.node_rank * self.nproc_per_node + local_rank;
                let mut env = vec![
                    ("RANK".to_string(), rank.to_string()),
                    ("LOCAL_RANK".into(), local_rank.to_string()),
                    ("WORLD_SIZE".into(), self.world_size().to_string()),
                    ("LOCAL_WORLD_SIZE".into(), self.nproc_per_node.to_string()),
                    ("GROUP_RANK".into(), self.node_rank.to_string()),
                    ("MASTER_ADDR".into(), self.master_addr.clone()),
                    ("MASTER_PORT".into(), master_port.to_string()),
                    (ENV_AGENT_STORE.into(), "1".into()),
                    ("HATRAIN_JOB_ID".into(), self.job_id.to_string()),
                    ("HATRAIN_RESTART_COUNT".into(), "0".into()),
                ];
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

/// Runs one host's part of the job until it ends or `shutdown` fires.
pub async fn run(
    cfg: &LaunchConfig,
    shutdown: CancellationToken,
) -> Result<JobReport, LaunchError> {
    job::run(cfg, shutdown).await
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

    fn cfg() -> LaunchConfig {
        LaunchConfig {
            nnodes: 2,
            node_rank: 1,
            nproc_per_node: 3,
            master_addr: "127.0.0.1".into(),
            master_port: Some(29500),
            job_id: JobId::new("j").unwrap(),
            secret_file: Some(PathBuf::from("/unused")),
            threads_per_worker: 1,
            stop_grace: Duration::from_secs(1),
            command: vec!["train".into(), "--x".into()],
            ha: HaSettings::default(),
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
        let specs = cfg().worker_specs(29500);
        assert_eq!(specs.len(), 3);
        let get = |s: &WorkerSpec, k: &str| {
            s.env
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
                .unwrap()
        };
        assert_eq!(get(&specs[2], "RANK"), "5");
        assert_eq!(get(&specs[2], "LOCAL_RANK"), "2");
        assert_eq!(get(&specs[2], "WORLD_SIZE"), "6");
        assert_eq!(get(&specs[2], "LOCAL_WORLD_SIZE"), "3");
        assert_eq!(get(&specs[2], "MASTER_PORT"), "29500");
        assert_eq!(specs[0].program, PathBuf::from("train"));
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
}
