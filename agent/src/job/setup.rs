//! What a host's job is set up with before its loop runs: the rendezvous
//! store, the peers of a job of several nodes, and who decides for it.

use super::decider::{self, Controller, Decider, Follower};
use super::{Kept, machine_config, peers, relay, unix_now};
use crate::config::{LaunchConfig, LaunchError};
use crate::jobdir::JobDir;
use crate::recovery::Machine;
use hatrain_shared::store::StoreServer;
use std::path::PathBuf;
use tokio_util::sync::CancellationToken;

/// The rendezvous store (node 0's; with several nodes every agent hosts
/// one, the controller's in use), the peers of a job of several nodes,
/// the address the workers reach the store at (this agent's relay to the
/// controller's), and the store's own. The store lives as long as the
/// caller keeps it: it outlives every worker. On one node it listens on
/// loopback only, on a port of its own: the workers' MASTER_PORT is
/// theirs.
pub(super) async fn stores_and_peers(
    cfg: &LaunchConfig,
    dir: &JobDir,
    (secret, resume): (&hatrain_shared::auth::Secret, Option<&Kept>),
    relay_stop: CancellationToken,
) -> Result<
    (
        Option<StoreServer>,
        Option<peers::Peers>,
        std::net::SocketAddr,
        std::net::SocketAddr,
    ),
    LaunchError,
> {
    let (mut store, store_addr) = if cfg.node_rank == 0 {
        let host = if cfg.nnodes == 1 {
            "127.0.0.1"
        } else {
            cfg.master_addr.as_str()
        };
        let port = resume.as_ref().map(|k| k.store.port()).or(cfg.store_port());
        let addr = crate::config::resolve(host, port.unwrap_or(0))?;
        let store = StoreServer::bind(addr, Some(secret.clone())).map_err(LaunchError::Store)?;
        let addr = store.local_addr();
        tracing::info!(addr = %addr, "rendezvous store listening (authenticated)");
        (Some(store), addr)
    } else {
        let port = cfg.store_port().expect("validated: set with several nodes");
        (None, crate::config::resolve(&cfg.master_addr, port)?)
    };
    if !(cfg.nnodes > 1 && cfg.ha.modes.any())
        && cfg.ha.coordinator != crate::config::CoordinatorChoice::Embedded
    {
        tracing::warn!(
            "--coordinator is for jobs of several nodes with a high-availability switch on: not used here"
        );
    }
    let (peers, workers_store) = if cfg.nnodes > 1 && cfg.ha.modes.any() {
        let ip = peers::local_ip(cfg, store_addr)?;
        // Every agent hosts a store: the one in use is the controller's,
        // which the workers reach through this agent's relay.
        let own = match &store {
            Some(s) => s.local_addr(),
            None => {
                let s = StoreServer::bind(std::net::SocketAddr::new(ip, 0), Some(secret.clone()))
                    .map_err(LaunchError::Store)?;
                let a = s.local_addr();
                store = Some(s);
                a
            }
        };
        let p = peers::start(cfg, secret, dir.path(), (store_addr, own), ip)?;
        let relay = relay::start(ip, p.controller_store(), relay_stop.clone())
            .await
            .map_err(|source| LaunchError::Io {
                path: PathBuf::from(format!("store relay on {ip}")),
                source,
            })?;
        tracing::info!(relay = %relay, "the workers reach the controller's store through this agent");
        (Some(p), relay)
    } else {
        (None, store_addr)
    };
    Ok((store, peers, workers_store, store_addr))
}

/// Who decides for this host, and whether the agent before it died in a
/// recovery. One machine decides for the job: on one node, or without any
/// mode (each host restarts its own group, as torchrun's agents do), this
/// host's over `own` ranks; on several (`joined`), node 0's over every
/// rank, which the others follow. A served job's next agent takes the
/// machine over from what the last one kept.
pub(super) fn decider_for(
    cfg: &LaunchConfig,
    dir: &JobDir,
    resume: Option<&Kept>,
    joined: bool,
    own: &[usize],
) -> (Decider, bool) {
    let ranks: Vec<usize> = if joined {
        (0..cfg.world_size()).collect()
    } else {
        own.to_vec()
    };
    let (inherited, interrupted) = match resume {
        Some(k) => {
            let (from, interrupted) = k.inherited(dir.path());
            (Some(from), interrupted)
        }
        None => (None, false),
    };
    let machine = match inherited {
        Some(from) => Machine::take_over(machine_config(cfg), ranks, from),
        None => Machine::new(machine_config(cfg), ranks, unix_now()),
    };
    let decider = if !joined {
        Decider::Controller(Box::new(Controller::new(
            machine,
            1,
            cfg.node_rank,
            cfg.nproc_per_node,
            0,
        )))
    } else if cfg.node_rank as u64 == decider::CONTROLLER {
        Decider::Controller(Box::new(Controller::new(
            machine,
            cfg.nnodes,
            cfg.node_rank,
            cfg.nproc_per_node,
            cfg.ha.standby_nodes,
        )))
    } else {
        Decider::Follower(Box::new(Follower::new()))
    };
    (decider, interrupted)
}
