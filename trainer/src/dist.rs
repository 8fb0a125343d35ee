//! Where a rank sits in the job (the torchrun-style environment) and how it
//! meets its peers: the rendezvous store (the agent's, or rank 0's under
//! another launcher) and the communicator of each epoch.

use crate::collective::Communicator;
use crate::trainer::{CONNECT_TIMEOUT, TrainError};
use hatrain_shared::auth::Secret;
use hatrain_shared::rendezvous::{ENV_AGENT_STORE, ENV_GROUP_PLACE};
use hatrain_shared::store::{StoreClient, StoreServer};
use std::net::{SocketAddr, ToSocketAddrs};

/// Where this process sits in the job, from the torchrun-style environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// This rank's place in the data-parallel group.
    pub rank: usize,
    pub world_size: usize,
    /// Its identity with the agent: the launcher's `RANK` (the place too,
    /// unless elastic training resized the group).
    pub slot: usize,
    pub local_rank: usize,
    pub master: Option<SocketAddr>,
    /// Where the launcher hosts the rendezvous store (`None`: rank 0 hosts
    /// one at the master address).
    pub agent_store: Option<SocketAddr>,
}

impl DistEnv {
    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`,
    /// the agent's store address (`HATRAIN_AGENT_STORE`, `HOST:PORT`) and a
    /// place in a resized group (`HATRAIN_GROUP_PLACE`, `RANK/WORLD`).
    /// Without `WORLD_SIZE` the process is a job of one.
    pub fn from_env() -> Result<Self, TrainError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, TrainError> {
        let num = |k: &str, default: usize| -> Result<usize, TrainError> {
            match get(k) {
                None => Ok(default),
                Some(v) => v
                    .trim()
                    .parse()
                    .map_err(|_| TrainError::Env(format!("{k}={v:?} is not a number"))),
            }
        };
        let mut world_size = num("WORLD_SIZE", 1)?;
        let slot = num("RANK", 0)?;
        let mut rank = slot;
        if let Some(v) = get(ENV_GROUP_PLACE) {
            let place = v
                .split_once('/')
                .and_then(|(r, w)| Some((r.trim().parse().ok()?, w.trim().parse().ok()?)));
            (rank, world_size) = place.ok_or_else(|| {
                TrainError::Env(format!("{ENV_GROUP_PLACE}={v:?} is not RANK/WORLD"))
            })?;
        }
        let local_rank = num("LOCAL_RANK", rank)?;
        if world_size == 0 || rank >= world_size {
            return Err(TrainError::Env(format!(
                "RANK={rank} is outside WORLD_SIZE={world_size}"
            )));
        }
        let master = if world_size > 1 {
            let addr = get("MASTER_ADDR").ok_or_else(|| {
                TrainError::Env("MASTER_ADDR is required when WORLD_SIZE > 1".into())
            })?;
            let port = num("MASTER_PORT", usize::MAX)?;
            let port = u16::try_from(port).map_err(|_| {
                TrainError::Env("MASTER_PORT (1-65535) is required when WORLD_SIZE > 1".into())
            })?;
            let resolved = (addr.as_str(), port)
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .ok_or_else(|| TrainError::Env(format!("MASTER_ADDR={addr:?} does not resolve")))?;
            Some(resolved)
        } else {
            None
        };
        let agent_store = match get(ENV_AGENT_STORE) {
            None => None,
            Some(v) => Some(
                v.to_socket_addrs()
                    .ok()
                    .and_then(|mut a| a.next())
                    .ok_or_else(|| {
                        TrainError::Env(format!(
                            "{ENV_AGENT_STORE}={v:?} is not a HOST:PORT that resolves"
                        ))
                    })?,
            ),
        };
        Ok(Self {
            rank,
            world_size,
            slot,
            local_rank,
            master,
            agent_store,
        })
    }
}

/// The store and communicator of a job.
pub(crate) struct Dist {
    pub(crate) env: DistEnv,
    _server: Option<StoreServer>,
    store: Option<StoreClient>,
    /// Where the store is, and whether a communicator was built over the
    /// connection to it (the next one opens a new connection).
    at: Option<SocketAddr>,
    used: bool,
    /// The job's secret, when the launcher gave one: the store and the ring
    /// then speak only to its holders.
    secret: Option<Secret>,
}

impl Dist {
    pub(crate) fn start(env: DistEnv) -> Result<Self, TrainError> {
        let secret = match std::env::var_os(hatrain_shared::auth::ENV_SECRET_FILE) {
            Some(path) => Some(Secret::load(std::path::Path::new(&path))?),
            None => None,
        };
        let Some(master) = env.master else {
            return Ok(Self {
                env,
                _server: None,
                store: None,
                at: None,
                used: false,
                secret,
            });
        };
        // Under another launcher rank 0 hosts the store itself, at the
        // master address; under hatrain's the agent hosts it.
        let server = if env.agent_store.is_none() && env.rank == 0 {
            if secret.is_none() {
                eprintln!(
                    "rank 0: no {} given: the rendezvous store and the ring accept any local process",
                    hatrain_shared::auth::ENV_SECRET_FILE
                );
            }
            Some(StoreServer::bind(master, secret.clone())?)
        } else {
            None
        };
        let at = env.agent_store.unwrap_or(master);
        let store = StoreClient::connect(at, CONNECT_TIMEOUT, secret.clone())?;
        Ok(Self {
            env,
            _server: server,
            store: Some(store),
            at: Some(at),
            used: false,
            secret,
        })
    }

    /// The rank takes place `rank` of `world` (a reshape): the next
    /// communicator is built there.
    pub(crate) fn place(&mut self, rank: usize, world: usize) {
        self.env.rank = rank;
        self.env.world_size = world;
    }

    pub(crate) fn communicator(
        &mut self,
        epoch: u64,
        cancel: &dyn Fn() -> bool,
    ) -> Result<Communicator, TrainError> {
        // Each rebuild meets the others over a new connection: the store
        // may have moved with the job's controller (the agent's relay
        // passes a new connection to the one in use now), and a connection
        // the last rebuild broke is not reused.
        if let (true, Some(at)) = (self.used, self.at) {
            self.store = Some(StoreClient::connect(
                at,
                CONNECT_TIMEOUT,
                self.secret.clone(),
            )?);
        }
        self.used = true;
        match self.store.as_mut() {
            None => Ok(Communicator::single(epoch)),
            Some(store) => Ok(Communicator::connect(
                store,
                self.env.rank,
                self.env.world_size,
                epoch,
                CONNECT_TIMEOUT,
                self.secret.as_ref(),
                cancel,
            )?),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<DistEnv, TrainError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        DistEnv::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn environment_is_validated() {
        let single = env(&[]).unwrap();
        assert_eq!(
            (single.rank, single.world_size, single.master),
            (0, 1, None)
        );
        let e = env(&[("WORLD_SIZE", "2"), ("RANK", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("RANK=2 is outside WORLD_SIZE=2"), "{e}");
        let e = env(&[("WORLD_SIZE", "2"), ("RANK", "0")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("MASTER_ADDR"), "{e}");
        let e = env(&[("WORLD_SIZE", "two")]).unwrap_err().to_string();
        assert!(e.contains("WORLD_SIZE=\"two\""), "{e}");
        let ok = env(&[
            ("WORLD_SIZE", "4"),
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            (ENV_AGENT_STORE, "127.0.0.1:29600"),
        ])
        .unwrap();
        assert_eq!(ok.master, Some("127.0.0.1:29500".parse().unwrap()));
        assert_eq!(ok.agent_store, Some("127.0.0.1:29600".parse().unwrap()));
        assert_eq!(ok.local_rank, 1);
        let e = env(&[(ENV_AGENT_STORE, "nowhere")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("HATRAIN_AGENT_STORE"), "{e}");
        // A process started again after a resize: its place, and its
        // launcher's rank as its identity.
        let placed = env(&[
            ("WORLD_SIZE", "6"),
            ("RANK", "5"),
            (ENV_GROUP_PLACE, "3/4"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!((placed.rank, placed.world_size, placed.slot), (3, 4, 5));
        for bad in ["3", "4/4", "x/4"] {
            let e = env(&[("WORLD_SIZE", "6"), ("RANK", "5"), (ENV_GROUP_PLACE, bad)]);
            assert!(e.is_err(), "{bad}");
        }
    }
}
