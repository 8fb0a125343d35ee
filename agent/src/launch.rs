//! `hatrain-agent launch`: the torchrun-style launcher of one host.
//!
//! It hosts the job's rendezvous store (on node rank 0), starts
//! `--nproc-per-node` workers with the torchrun environment (`RANK`,
//! `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`), and supervises them until they all finish,
//! one fails, or the agent is asked to stop.

use crate::reaper::{Reaper, ReaperError};
use crate::supervisor::{Outcome, Supervisor, SupervisorError, WorkerSpec};
use hatrain_shared::rendezvous::ENV_AGENT_STORE;
use hatrain_worker::rendezvous::{RendezvousError, StoreServer};
use std::ffi::OsString;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Environment variables a node rank may come from, in order of precedence
/// (after `--node-rank`).
pub const NODE_RANK_VARS: [&str; 3] = ["SLURM_NODEID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchConfig {
    pub nnodes: usize,
    pub node_rank: usize,
    pub nproc_per_node: usize,
    pub master_addr: String,
    /// `None` on a single node: the store picks a free port.
    pub master_port: Option<u16>,
    pub job_id: String,
    /// Compute threads per worker (`RAYON_NUM_THREADS`), unless the
    /// environment already sets it.
    pub threads_per_worker: usize,
    pub stop_grace: Duration,
    /// The worker command: program and arguments.
    pub command: Vec<OsString>,
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
        if self.command.is_empty() {
            return bad("no worker command given (put it after `--`)".into());
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
                    ("HATRAIN_JOB_ID".into(), self.job_id.clone()),
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
pub async fn run(cfg: &LaunchConfig, shutdown: CancellationToken) -> Result<Outcome, LaunchError> {
    cfg.validate()?;
    // The store lives as long as this function: it outlives every worker.
    let (_store, port) = if cfg.node_rank == 0 {
        let addr = resolve(&cfg.master_addr, cfg.master_port.unwrap_or(0))?;
        let store = StoreServer::bind(addr).map_err(LaunchError::Store)?;
        let port = store.local_addr().port();
        tracing::info!(addr = %store.local_addr(), "rendezvous store listening");
        (Some(store), port)
    } else {
        (
            None,
            cfg.master_port.expect("validated: set with several nodes"),
        )
    };
    let reaper = Reaper::start(shutdown.child_token())?;
    let specs = cfg.worker_specs(port);
    tracing::info!(
        world_size = cfg.world_size(),
        node_rank = cfg.node_rank,
        nproc = cfg.nproc_per_node,
        "starting workers"
    );
    let sup = Supervisor::start(&specs, &reaper, cfg.stop_grace).await?;
    Ok(sup.run(shutdown).await)
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr, LaunchError> {
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
            job_id: "j".into(),
            threads_per_worker: 1,
            stop_grace: Duration::from_secs(1),
            command: vec!["train".into(), "--x".into()],
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
