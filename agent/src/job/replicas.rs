//! Joining the peer-replica streams of a job of several nodes.
//!
//! Each agent listens for replicas on its local address, publishes where in
//! the job's rendezvous store (with its failure-domain label), reads every
//! node's label, and from those alone computes the same placement as every
//! other agent ([`crate::replicator::targets`]): whom it streams to, and
//! whose ranks it holds. The exchange runs on a thread of its own, so the
//! workers start meanwhile; a node that never shows up only delays the
//! streams to it.

use crate::launch::{LaunchConfig, LaunchError};
use crate::replicator::{self, Replicator, ReplicatorConfig};
use hatrain_shared::auth::Secret;
use hatrain_shared::store::StoreClient;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// How long one wait for a key in the store lasts before the stop flag is
/// looked at again.
const WAIT: Duration = Duration::from_secs(1);

/// The local address of the route to `to`: connecting a UDP socket picks
/// it without sending anything.
fn route_to(to: SocketAddr) -> Option<IpAddr> {
    let any: SocketAddr = if to.is_ipv4() {
        "0.0.0.0:0".parse().ok()?
    } else {
        "[::]:0".parse().ok()?
    };
    let s = UdpSocket::bind(any).ok()?;
    s.connect(to).ok()?;
    s.local_addr().ok().map(|a| a.ip())
}

/// Starts the replicator and the exchange that places its streams.
pub(super) fn start(
    cfg: &LaunchConfig,
    secret: &Secret,
    dir: &Path,
    store: SocketAddr,
) -> Result<Arc<Replicator>, LaunchError> {
    let bind = cfg
        .ha
        .local_addr
        .or_else(|| route_to(store))
        .ok_or_else(|| {
            LaunchError::Config(format!(
                "no local address routes to the store at {store}: give --local-addr"
            ))
        })?;
    let r = Replicator::listen(ReplicatorConfig {
        secret: secret.clone(),
        node: cfg.node_rank as u64,
        bind,
        dir: dir.to_path_buf(),
        slots: cfg.ha.slots,
        ranks_per_node: cfg.nproc_per_node,
        chunk: replicator::CHUNK,
        window: replicator::WINDOW,
    })?;
    let (node, nnodes, replicas) = (cfg.node_rank, cfg.nnodes, cfg.ha.replicas);
    let domain = cfg.ha.failure_domain.clone().unwrap_or_default();
    let (secret, repl) = (secret.clone(), Arc::clone(&r));
    std::thread::Builder::new()
        .name("replica-placement".into())
        .spawn(move || {
            if let Err(e) = place(&repl, store, secret, node, nnodes, replicas, &domain) {
                tracing::error!(error = %e, "peer replicas not placed: this host's snapshots live only here");
            }
        })
        .map_err(|source| LaunchError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    Ok(r)
}

/// Gets `key`, waiting while the replicator runs.
fn wait_for(c: &mut StoreClient, repl: &Replicator, key: &str) -> Result<String, String> {
    loop {
        match c.get(key, WAIT) {
            Ok(v) => return Ok(v),
            Err(_) if !repl.stopped() => continue,
            Err(e) => return Err(format!("{key}: {e}")),
        }
    }
}

fn place(
    repl: &Replicator,
    store: SocketAddr,
    secret: Secret,
    node: usize,
    nnodes: usize,
    replicas: usize,
    domain: &str,
) -> Result<(), String> {
    let mut c = StoreClient::connect(store, Duration::from_secs(120), Some(secret))
        .map_err(|e| e.to_string())?;
    let key = |k: usize, what: &str| format!("replica/node{k}/{what}");
    c.set(&key(node, "domain"), domain)
        .and_then(|()| c.set(&key(node, "endpoint"), repl.endpoint()))
        .map_err(|e| e.to_string())?;
    let mut domains = Vec::with_capacity(nnodes);
    for k in 0..nnodes {
        let d = wait_for(&mut c, repl, &key(k, "domain"))?;
        domains.push((!d.is_empty()).then_some(d));
    }
    for k in (0..nnodes).filter(|&k| k != node) {
        if replicator::targets(k, &domains, replicas).contains(&node) {
            repl.hold_for(k as u64);
        }
    }
    let mine = replicator::targets(node, &domains, replicas);
    if mine.len() < replicas {
        tracing::warn!(
            replicas,
            placed = mine.len(),
            domain,
            "fewer hosts outside this host's failure domain than --replicas asks for"
        );
    }
    for t in mine {
        let endpoint = wait_for(&mut c, repl, &key(t, "endpoint"))?;
        tracing::info!(node = t, endpoint = %endpoint, "streaming this host's snapshots");
        repl.stream_to(t as u64, endpoint);
    }
    Ok(())
}
