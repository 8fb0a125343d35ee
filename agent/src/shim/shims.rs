//! The exec shims of one served job: each rank's commands connection, and
//! where its worker's exits go.
//!
//! A start is one blocking round trip on the rank's commands connection:
//! the shim forks and answers with the pid at once (a fork and an exec,
//! about a millisecond), so the supervisor gets its pid as from its own
//! fork. Exits arrive on the shim's events connection, read by the serve
//! loop, and are handed to the supervisor as [`ExitEvent`]s. A shim that
//! vanishes (its launcher killed it) took its worker with it (the worker's
//! parent-death signal): that worker's exit is reported as a SIGKILL.

use super::wire::{PROTOCOL, Started, ToShim};
use crate::reaper::{ExitEvent, ExitStatus};
use crate::spec::WorkerSpec;
use std::collections::BTreeMap;
use std::io;
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;

/// How long a shim has to answer a start (a fork and an exec). The agent's
/// one thread waits meanwhile: a shim that does not answer (stopped, or
/// starved) holds every job up this long, once, and its rank is given up.
const START_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a shim's commands connection is not attached.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("rank {rank} is not registered")]
    NotRegistered { rank: usize },
    #[error("rank {rank} was registered by pid {registered}, not pid {pid}")]
    OtherPid {
        rank: usize,
        registered: i32,
        pid: i32,
    },
    #[error("rank {rank}'s shim is already attached")]
    Attached { rank: usize },
    #[error("cannot set the connection's timeouts")]
    Socket(#[source] io::Error),
}

#[derive(Debug, Default)]
pub struct Shims {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    ranks: BTreeMap<usize, Shim>,
    exits: Option<UnboundedSender<ExitEvent>>,
    /// Exits heard before the supervisor watched (a re-adopted job's
    /// workers that ended while no agent ran).
    pending: Vec<ExitEvent>,
}

#[derive(Debug, Default)]
struct Shim {
    /// `None` until the shim attaches it, and once it is gone.
    commands: Option<UnixStream>,
    /// The shim's process (both its connections come from it).
    pid: i32,
    /// Its worker while it runs.
    worker: Option<i32>,
    /// The worker it had when it came back to a new agent.
    resumed: Option<i32>,
    gone: bool,
}

impl Shims {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `rank`'s registration from the shim process `pid`.
    pub fn register(&self, rank: usize, pid: i32) {
        self.lock().ranks.insert(
            rank,
            Shim {
                pid,
                ..Shim::default()
            },
        );
    }

    /// Attaches `rank`'s commands connection, if `pid` is the process that
    /// registered the rank.
    pub fn attach(&self, rank: usize, pid: i32, stream: UnixStream) -> Result<(), AttachError> {
        let mut g = self.lock();
        let Some(shim) = g.ranks.get_mut(&rank) else {
            return Err(AttachError::NotRegistered { rank });
        };
        if shim.pid != pid {
            return Err(AttachError::OtherPid {
                rank,
                registered: shim.pid,
                pid,
            });
        }
        if shim.commands.is_some() {
            return Err(AttachError::Attached { rank });
        }
        stream
            .set_read_timeout(Some(START_TIMEOUT))
            .and_then(|()| stream.set_write_timeout(Some(START_TIMEOUT)))
            .map_err(AttachError::Socket)?;
        shim.commands = Some(stream);
        Ok(())
    }

    /// The ranks registered, and whether each is attached.
    pub fn ranks(&self) -> Vec<(usize, bool)> {
        self.lock()
            .ranks
            .iter()
            .map(|(&r, s)| (r, s.commands.is_some()))
            .collect()
    }

    /// Where the workers' exits go from now on (those heard before go
    /// first).
    pub fn watch(&self, exits: UnboundedSender<ExitEvent>) {
        let mut g = self.lock();
        for ev in std::mem::take(&mut g.pending) {
            let _ = exits.send(ev);
        }
        g.exits = Some(exits);
    }

    /// A re-registered shim's worker: running (`Some(pid)`), and the exit
    /// it saw while no agent ran.
    pub fn resumed(&self, rank: usize, running: Option<i32>, exited: Option<(i32, ExitStatus)>) {
        let mut g = self.lock();
        if let Some(shim) = g.ranks.get_mut(&rank) {
            shim.worker = running.or(exited.map(|(pid, _)| pid));
            shim.resumed = shim.worker;
        }
        if let Some((pid, status)) = exited {
            drop(g);
            self.exited(rank, pid, status);
        }
    }

    /// The pid each rank's worker had when its shim came back to this
    /// agent.
    pub fn pids(&self) -> BTreeMap<usize, i32> {
        self.lock()
            .ranks
            .iter()
            .filter_map(|(&r, s)| Some((r, s.resumed?)))
            .collect()
    }

    /// Has `spec.rank`'s shim start its worker; the worker's pid.
    pub fn start(&self, spec: &WorkerSpec) -> io::Result<i32> {
        let mut g = self.lock();
        let shim = g.ranks.get_mut(&spec.rank).ok_or_else(|| {
            io::Error::other(format!("no exec shim registered rank {}", spec.rank))
        })?;
        let conn = shim.commands.as_mut().ok_or_else(|| {
            io::Error::other(format!(
                "rank {}'s exec shim is gone (its launcher stopped it)",
                spec.rank
            ))
        })?;
        let text = |s: &std::ffi::OsStr| s.to_string_lossy().into_owned();
        let msg = ToShim::Start {
            program: text(spec.program.as_os_str()),
            args: spec.args.iter().map(|a| text(a)).collect(),
            env: spec.env.clone(),
        };
        let answer = PROTOCOL
            .send_json(conn, &msg)
            .and_then(|()| PROTOCOL.recv_json::<_, Started>(conn));
        match answer {
            Ok(Started::Pid(pid)) => {
                shim.worker = Some(pid);
                Ok(pid)
            }
            Ok(Started::Failed { message }) => Err(io::Error::other(message)),
            Err(e) => {
                shim.commands = None;
                Err(io::Error::other(format!(
                    "rank {}'s exec shim did not answer: {e}",
                    spec.rank
                )))
            }
        }
    }

    /// `rank`'s worker `pid` ended.
    pub fn exited(&self, rank: usize, pid: i32, status: ExitStatus) {
        let mut g = self.lock();
        if let Some(shim) = g.ranks.get_mut(&rank)
            && shim.worker == Some(pid)
        {
            shim.worker = None;
        }
        let ev = ExitEvent { pid, status };
        match &g.exits {
            Some(tx) => {
                let _ = tx.send(ev);
            }
            None => g.pending.push(ev),
        }
    }

    /// `rank`'s shim is gone; a worker it had died with it.
    pub fn gone(&self, rank: usize) {
        let mut g = self.lock();
        let Some(shim) = g.ranks.get_mut(&rank) else {
            return;
        };
        shim.commands = None;
        shim.gone = true;
        let Some(pid) = shim.worker.take() else {
            return;
        };
        tracing::warn!(
            rank,
            pid,
            "the rank's exec shim is gone (its launcher stopped it); its worker died with it"
        );
        let ev = ExitEvent {
            pid,
            status: ExitStatus::Signaled(libc::SIGKILL),
        };
        match &g.exits {
            Some(tx) => {
                let _ = tx.send(ev);
            }
            None => g.pending.push(ev),
        }
    }

    /// Whether every registered shim is gone.
    pub fn all_gone(&self) -> bool {
        self.lock().ranks.values().all(|s| s.gone)
    }

    /// Tells every shim the job is over: each exits with its worker's last
    /// status, or, with `error` (the job could not run), says it and fails.
    /// With `detach`, a worker that still runs trains on unprotected.
    pub fn finish(&self, error: Option<String>, detach: bool) {
        let mut g = self.lock();
        for shim in g.ranks.values_mut() {
            if let Some(mut conn) = shim.commands.take() {
                let msg = ToShim::Finish {
                    error: error.clone(),
                    detach,
                };
                let _ = PROTOCOL.send_json(&mut conn, &msg);
            }
        }
    }
}
