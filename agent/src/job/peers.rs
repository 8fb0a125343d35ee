//! Joining the other agents of a job of several nodes: heartbeats (the
//! embedded coordinator) and peer replicas.
//!
//! Each agent listens for heartbeats and replicas on its local address,
//! publishes where in the job's rendezvous store (with its failure-domain
//! label), heartbeats every other agent, reads every node's label, and from
//! those alone computes the same replica placement as every other agent
//! ([`crate::replicator::targets`]): whom it streams to, and whose ranks it
//! holds. The exchange runs on a thread of its own, so the workers start
//! meanwhile; a node that never shows up only delays what goes to it.

use crate::config::{CoordinatorChoice, LaunchConfig, LaunchError};
use crate::coordinator::EmbeddedConfig;
use crate::coordinator::etcd::EtcdConfig;
use crate::coordinator::wire::{Backend, Membership, MembershipConfig};
use crate::replicator::{self, Replicator, ReplicatorConfig};
use hatrain_shared::auth::Secret;
use hatrain_shared::store::StoreClient;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::Path;
use std::sync::{Arc, Mutex};
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

/// This agent's links to the others.
#[derive(Debug)]
pub(super) struct Peers {
    pub membership: Arc<Membership>,
    /// With `--replicas` above 0.
    pub replicator: Option<Arc<Replicator>>,
    /// Where the standby agents take replicas, as they publish it.
    pub standbys: Arc<Mutex<BTreeMap<u64, String>>>,
    /// The store each agent hosts, as it publishes it.
    pub stores: Arc<Mutex<BTreeMap<u64, SocketAddr>>>,
}

impl Peers {
    /// The store of the controller this agent follows now.
    pub fn controller_store(&self) -> impl Fn() -> Option<SocketAddr> + Send + Sync + 'static {
        let (membership, stores) = (Arc::clone(&self.membership), Arc::clone(&self.stores));
        move || {
            let node = membership.seen().view.follows?;
            stores.lock().expect("not poisoned").get(&node).copied()
        }
    }
}

impl Peers {
    pub fn stop(&self) {
        if let Some(r) = &self.replicator {
            r.stop();
        }
        self.membership.stop();
    }
}

/// The address this agent takes heartbeats, replicas and store
/// connections on: `--local-addr`, else the one that routes to the job's
/// store.
pub(super) fn local_ip(cfg: &LaunchConfig, store: SocketAddr) -> Result<IpAddr, LaunchError> {
    cfg.ha
        .local_addr
        .or_else(|| route_to(store))
        .ok_or_else(|| {
            LaunchError::Config(format!(
                "no local address routes to the store at {store}: give --local-addr"
            ))
        })
}

/// Starts the heartbeats, the replicator, and the exchange that connects
/// them to the other agents, on address `bind`; `own_store` is the store
/// this agent hosts (the job's, at `store`, on node 0).
pub(super) fn start(
    cfg: &LaunchConfig,
    secret: &Secret,
    dir: &Path,
    (store, own_store): (SocketAddr, SocketAddr),
    bind: IpAddr,
) -> Result<Peers, LaunchError> {
    let (nodes, node) = (
        (cfg.nnodes + cfg.ha.standby_nodes) as u64,
        cfg.node_rank as u64,
    );
    let coordinator = match &cfg.ha.coordinator {
        CoordinatorChoice::Embedded => Backend::Embedded(EmbeddedConfig::with_timeout(
            nodes,
            node,
            cfg.ha.host_timeout,
        )),
        CoordinatorChoice::Etcd(endpoints) => Backend::Etcd(EtcdConfig {
            endpoints: endpoints.clone(),
            prefix: format!("/hatrain/{}/", cfg.job_id),
            nodes,
            node,
            ttl: cfg.ha.host_timeout,
            about: serde_json::json!({
                "node": node,
                "standby": cfg.ha.standby,
                "failure_domain": cfg.ha.failure_domain,
                "ranks_per_node": cfg.nproc_per_node,
            })
            .to_string(),
        }),
    };
    let membership = Membership::start(MembershipConfig {
        secret: secret.clone(),
        coordinator,
        bind,
    })?;
    let replicator = if cfg.replicates() {
        Some(Replicator::listen(ReplicatorConfig {
            secret: secret.clone(),
            node: cfg.node_rank as u64,
            bind,
            dir: dir.to_path_buf(),
            slots: cfg.ha.slots,
            ranks_per_node: cfg.nproc_per_node,
            chunk: replicator::CHUNK,
            window: replicator::WINDOW,
        })?)
    } else {
        None
    };
    let standbys = Arc::new(Mutex::new(BTreeMap::new()));
    let stores = Arc::new(Mutex::new(BTreeMap::from([(
        cfg.node_rank as u64,
        own_store,
    )])));
    let peers = Peers {
        membership: Arc::clone(&membership),
        replicator: replicator.clone(),
        standbys: Arc::clone(&standbys),
        stores: Arc::clone(&stores),
    };
    let (node, nnodes, replicas) = (cfg.node_rank, cfg.nnodes, cfg.ha.replicas);
    let spares = cfg.ha.standby_nodes;
    let domain = cfg.ha.failure_domain.clone().unwrap_or_default();
    let secret = secret.clone();
    std::thread::Builder::new()
        .name("peer-exchange".into())
        .spawn(move || {
            let x = Exchange {
                membership: &membership,
                replicator: replicator.as_deref(),
                standbys: &standbys,
                stores: &stores,
                own_store,
            };
            if let Err(e) = x.run(store, secret, node, (nnodes, spares), replicas, &domain) {
                tracing::error!(error = %crate::error_chain(&e), "not connected to the other agents: no heartbeats, no peer replicas");
            }
        })
        .map_err(|source| LaunchError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    Ok(peers)
}

struct Exchange<'a> {
    membership: &'a Membership,
    replicator: Option<&'a Replicator>,
    standbys: &'a Mutex<BTreeMap<u64, String>>,
    stores: &'a Mutex<BTreeMap<u64, SocketAddr>>,
    own_store: SocketAddr,
}

/// Why the exchange with the other agents (through the job's store) did
/// not complete.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("cannot reach the job's store at {store}")]
    Connect {
        store: SocketAddr,
        #[source]
        source: hatrain_shared::store::RendezvousError,
    },
    #[error("cannot publish this agent's addresses in the job's store")]
    Publish(#[source] hatrain_shared::store::RendezvousError),
    #[error("{key}: not read from the job's store")]
    Read {
        key: String,
        #[source]
        source: hatrain_shared::store::RendezvousError,
    },
}

impl Exchange<'_> {
    fn stopped(&self) -> bool {
        self.membership.stopped()
    }

    /// Gets `key`, waiting while the agent runs.
    fn wait_for(&self, c: &mut StoreClient, key: &str) -> Result<String, ExchangeError> {
        loop {
            match c.get(key, WAIT) {
                Ok(v) => return Ok(v),
                Err(_) if !self.stopped() => continue,
                Err(source) => {
                    return Err(ExchangeError::Read {
                        key: key.to_string(),
                        source,
                    });
                }
            }
        }
    }

    fn run(
        &self,
        store: SocketAddr,
        secret: Secret,
        node: usize,
        (nnodes, spares): (usize, usize),
        replicas: usize,
        domain: &str,
    ) -> Result<(), ExchangeError> {
        let mut c = StoreClient::connect(store, Duration::from_secs(120), Some(secret))
            .map_err(|source| ExchangeError::Connect { store, source })?;
        let key = |k: usize, what: &str| format!("peer/node{k}/{what}");
        c.set(&key(node, "domain"), domain)
            .and_then(|()| c.set(&key(node, "store"), &self.own_store.to_string()))
            .and_then(|()| c.set(&key(node, "heartbeats"), self.membership.endpoint()))
            .and_then(|()| match self.replicator {
                Some(r) => c.set(&key(node, "replicas"), r.endpoint()),
                None => Ok(()),
            })
            .map_err(ExchangeError::Publish)?;
        // The nodes first: the job starts with them. A standby may come
        // later (elastic training grows the group onto it), so the nodes
        // do not wait for the standbys, which are met afterwards.
        for k in (0..nnodes).filter(|&k| k != node) {
            self.meet(&mut c, k)?;
        }
        if let Some(repl) = self.replicator {
            self.place(&mut c, repl, node, nnodes, replicas, domain)?;
        }
        for k in (nnodes..nnodes + spares).filter(|&k| k != node) {
            self.meet(&mut c, k)?;
            if let Some(repl) = self.replicator {
                let endpoint = self.wait_for(&mut c, &key(k, "replicas"))?;
                repl.know(k as u64, endpoint.clone());
                self.standbys
                    .lock()
                    .expect("not poisoned")
                    .insert(k as u64, endpoint);
            }
        }
        Ok(())
    }

    /// Heartbeats agent `k`, and learns where its store is (for when it
    /// controls the job).
    fn meet(&self, c: &mut StoreClient, k: usize) -> Result<(), ExchangeError> {
        let key = |what: &str| format!("peer/node{k}/{what}");
        let endpoint = self.wait_for(c, &key("heartbeats"))?;
        self.membership.connect(k as u64, endpoint);
        let at = self.wait_for(c, &key("store"))?;
        match at.parse::<SocketAddr>() {
            Ok(a) => {
                self.stores
                    .lock()
                    .expect("not poisoned")
                    .insert(k as u64, a);
            }
            Err(_) => tracing::warn!(node = k, store = at, "a store address that does not parse"),
        }
        Ok(())
    }

    /// The placement, and where every host takes replicas. A standby
    /// holds and streams nothing until it takes a lost host's ranks; then
    /// it plays that host's node ([`Replicator::replace`]).
    fn place(
        &self,
        c: &mut StoreClient,
        repl: &Replicator,
        node: usize,
        nnodes: usize,
        replicas: usize,
        domain: &str,
    ) -> Result<(), ExchangeError> {
        let key = |k: usize, what: &str| format!("peer/node{k}/{what}");
        let mut domains = Vec::with_capacity(nnodes);
        for k in 0..nnodes {
            let d = self.wait_for(c, &key(k, "domain"))?;
            domains.push((!d.is_empty()).then_some(d));
        }
        if node < nnodes {
            let mine = replicator::targets(node, &domains, replicas);
            if mine.len() < replicas {
                tracing::warn!(
                    replicas,
                    placed = mine.len(),
                    domain,
                    "fewer hosts outside this host's failure domain than --replicas asks for"
                );
            }
        }
        repl.set_ring(domains, replicas);
        for k in (0..nnodes).filter(|&k| k != node) {
            let endpoint = self.wait_for(c, &key(k, "replicas"))?;
            repl.know(k as u64, endpoint);
        }
        if node < nnodes {
            repl.play(node as u64);
        } else {
            // Ranks taken meanwhile are streamed now.
            repl.arrange();
        }
        Ok(())
    }
}
