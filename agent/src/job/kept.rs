//! What a serving agent keeps of each running job, so that the agent that
//! follows it (after a crash, a SIGKILL or `systemctl restart`) re-adopts
//! the job without stopping it.
//!
//! The workers do not need the agent between steps: they commit snapshots
//! into their stores and read their directives from the stores' control
//! pages. What the next agent cannot find there is written here, in a
//! small JSON file in the serving agent's state folder (under
//! `/run/hatrain`), rewritten (atomically) whenever it changes: the ports
//! the workers were given, the recovery machine's view as a successor
//! inherits it ([`Mirror`]: the epoch, faults, restarts, which ranks are
//! protected), and each rank's state map. The secret and the stores stay
//! in the job's shared-memory folder, which the next agent reopens instead
//! of clearing ([`JobDir::reopen`]).

use super::decider::Mirror;
use super::{Decider, Driver};
use crate::config::{LaunchConfig, LaunchError};
use crate::jobdir::{self, JobDir};
use crate::shim::Shims;
use crate::supervisor::Supervisor;
use hatrain_shared::auth::Secret;
use hatrain_shared::shm::{self, Directive, Phase, Store};
use hatrain_shared::statemap::StateMap;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A running job's state, as the next agent needs it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Kept {
    /// The workers' `MASTER_PORT` and the agent's rendezvous store: a
    /// worker started again finds its peers where the others were told.
    pub master_port: u16,
    pub store: SocketAddr,
    pub(super) mirror: Mirror,
    pub maps: BTreeMap<usize, StateMap>,
}

/// Why a served job's kept state cannot be read back.
#[derive(Debug, thiserror::Error)]
pub enum KeptError {
    #[error("{path}")]
    Read {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}")]
    Parse {
        path: std::path::PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

impl Kept {
    pub fn load(path: &Path) -> Result<Self, KeptError> {
        let text = std::fs::read(path).map_err(|source| KeptError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_slice(&text).map_err(|source| KeptError::Parse {
            path: path.to_path_buf(),
            source,
        })
    }

    /// What the next machine takes over: the kept view, with the newest
    /// epoch any store shows (the agent may have died after posting a
    /// recovery's directives and before keeping its epoch), so that the
    /// next recovery's epoch is newer than every one the workers saw; and
    /// whether a recovery was under way: the view says so, a rank is
    /// paused or restoring, or a directive was posted that its rank has
    /// not taken.
    pub(super) fn inherited(&self, job_dir: &Path) -> (crate::recovery::Inherited, bool) {
        let mut from = self.mirror.inherited();
        let mut interrupted = self.mirror.recovering;
        for &rank in self.maps.keys() {
            let Ok(store) = Store::open(&shm::store_path(job_dir, rank)) else {
                continue;
            };
            let page = store.page();
            let posted = match page.directive().1 {
                Directive::Pause { epoch, .. }
                | Directive::Resume { epoch, .. }
                | Directive::Reshape { epoch, .. } => epoch,
                Directive::None | Directive::Stop => 0,
            };
            interrupted |=
                matches!(page.phase(), Phase::Paused | Phase::Restoring) || posted > page.epoch();
            from.epoch = from.epoch.max(page.epoch()).max(posted);
        }
        (from, interrupted)
    }
}

/// A job a serving agent runs: its ranks' shims, where its state is kept,
/// and, when the agent before this one ran it, what that agent kept.
#[derive(Debug, Clone)]
pub struct Served {
    pub shims: Arc<Shims>,
    pub state_file: PathBuf,
    pub resume: Option<Kept>,
}

/// [`Kept`] as the writer sees it, borrowed: the same JSON.
#[derive(Serialize)]
struct KeptView<'a> {
    master_port: u16,
    store: SocketAddr,
    mirror: &'a Mirror,
    maps: BTreeMap<usize, &'a StateMap>,
}

/// The state file's writer: what it last wrote, so that an unchanged
/// state is neither encoded nor written again (a map changes only when a
/// rank registers, the view only at a fault).
#[derive(Debug)]
pub(super) struct Keeper {
    path: PathBuf,
    master_port: u16,
    store: SocketAddr,
    last: Option<(Mirror, BTreeMap<usize, Arc<StateMap>>)>,
}

impl Keeper {
    pub(super) fn new(path: PathBuf, master_port: u16, store: SocketAddr) -> Self {
        Self {
            path,
            master_port,
            store,
            last: None,
        }
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a
/// reader finds the old state or the new one, whole.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_data()?;
    std::fs::rename(&tmp, path)
}

/// The job's secret, and the file the workers read it from: made for the
/// launch, loaded from `--secret-file`, or, when the job is re-adopted,
/// the one its workers already hold.
pub(super) fn secret(
    cfg: &LaunchConfig,
    dir: &mut JobDir,
    resume: bool,
) -> Result<(Secret, PathBuf), LaunchError> {
    if resume {
        let path = dir.path().join(jobdir::SECRET);
        return Ok((Secret::load(&path)?, path));
    }
    let secret = match &cfg.secret_file {
        Some(path) => Secret::load(path)?,
        None => Secret::generate()?,
    };
    let (mut f, path) = dir.create(jobdir::SECRET)?;
    secret
        .write_to(&mut f)
        .and_then(|()| f.sync_all())
        .map_err(|source| LaunchError::Io {
            path: path.clone(),
            source,
        })?;
    Ok((secret, path))
}

impl Driver<'_> {
    /// Writes the job's state file when it changed (served jobs only).
    pub(super) fn keep(&mut self) {
        let (Some(keeper), Decider::Controller(c)) = (self.keeper.as_mut(), &self.decider) else {
            return;
        };
        let mirror = c.mirror();
        let unchanged = keeper.last.as_ref().is_some_and(|(m, maps)| {
            *m == mirror
                && maps.len() == self.maps.len()
                && maps
                    .iter()
                    .all(|(r, a)| self.maps.get(r).is_some_and(|b| Arc::ptr_eq(a, b)))
        });
        if unchanged {
            return;
        }
        let view = KeptView {
            master_port: keeper.master_port,
            store: keeper.store,
            mirror: &mirror,
            maps: self.maps.iter().map(|(&r, m)| (r, &**m)).collect(),
        };
        let Ok(bytes) = serde_json::to_vec(&view) else {
            return;
        };
        match write_atomic(&keeper.path, &bytes) {
            Ok(()) => {
                let maps = self.maps.iter().map(|(&r, m)| (r, Arc::clone(m))).collect();
                keeper.last = Some((mirror, maps));
            }
            Err(e) => {
                tracing::warn!(path = %keeper.path.display(), error = %e, "cannot keep the job's state: an agent restart would lose the job")
            }
        }
    }

    /// Takes up the stores, maps and checkpoint writer of a job the agent
    /// before this one ran.
    pub(super) fn resume(&mut self, sup: &Supervisor, kept: &Kept) -> Result<(), LaunchError> {
        for (&rank, map) in &kept.maps {
            if !sup.ranks().contains(&rank) {
                continue;
            }
            let path = shm::store_path(self.dir.path(), rank);
            let store = Store::open(&path).map_err(|e| LaunchError::Io {
                path: path.clone(),
                source: std::io::Error::other(e.to_string()),
            })?;
            if let Err(e) = self.set_up_persister(rank, map) {
                tracing::warn!(rank, error = %e, "the kept state map's checkpoint is not taken");
            }
            self.stores.insert(rank, Arc::new(store));
            self.maps.insert(rank, Arc::new(map.clone()));
        }
        tracing::info!(
            ranks = ?kept.maps.keys().collect::<Vec<_>>(),
            epoch = kept.mirror.epoch,
            faults = kept.mirror.faults.len(),
            "re-adopted the job its previous agent ran: its workers went on training"
        );
        Ok(())
    }
}
