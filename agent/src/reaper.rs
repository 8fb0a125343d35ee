//! The one reaper of the agent.
//!
//! INVARIANT: nothing else in the process waits for children. A single task
//! handles SIGCHLD and loops `waitpid(-1, WNOHANG)` until no exited child is
//! left, because one SIGCHLD may stand for several exits (signals of one kind
//! coalesce, signal(7)).
//!
//! Exits are delivered per process, as containerd's shim does: a child is
//! spawned through [`Reaper::spawn`], which registers the channel its exit
//! goes to under the same lock as the spawn, so the exit cannot be reaped
//! before it has somewhere to go (subscribe before spawn). The channel is
//! unbounded: nothing lags and nothing is dropped.
//!
//! The agent is also a child subreaper (`PR_SET_CHILD_SUBREAPER`, prctl(2)),
//! so a worker's own children that outlive it are reparented here and reaped
//! here rather than by init.

use nix::errno::Errno;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use std::collections::HashMap;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc::UnboundedSender;
use tokio_util::sync::CancellationToken;

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ExitStatus {
    Exited(i32),
    Signaled(i32),
}

impl ExitStatus {
    /// Shell convention: the exit code, or 128+N for death by signal N.
    pub fn code(self) -> i32 {
        match self {
            Self::Exited(c) => c,
            Self::Signaled(s) => 128 + s,
        }
    }

    pub fn success(self) -> bool {
        self == Self::Exited(0)
    }
}

impl std::fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Exited(c) => write!(f, "exit code {c}"),
            Self::Signaled(s) => {
                let name = nix::sys::signal::Signal::try_from(*s)
                    .map(|s| s.as_str())
                    .unwrap_or("unknown signal");
                write!(f, "killed by signal {s} ({name})")
            }
        }
    }
}

/// One reaped child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitEvent {
    pub pid: i32,
    pub status: ExitStatus,
}

#[derive(Debug, thiserror::Error)]
pub enum ReaperError {
    #[error("cannot install the SIGCHLD handler")]
    Signal(#[source] std::io::Error),
    #[error("cannot become a child subreaper")]
    Subreaper(#[source] Errno),
}

/// Where each watched child's exit goes.
type Watchers = Arc<Mutex<HashMap<i32, UnboundedSender<ExitEvent>>>>;

/// Handle to the reaper task.
#[derive(Debug, Clone)]
pub struct Reaper {
    watchers: Watchers,
}

impl Reaper {
    /// Installs the SIGCHLD handler and starts the reaping task on the
    /// current runtime. Call before spawning any child.
    pub fn start(shutdown: CancellationToken) -> Result<Self, ReaperError> {
        nix::sys::prctl::set_child_subreaper(true).map_err(ReaperError::Subreaper)?;
        let mut sigchld = signal(SignalKind::child()).map_err(ReaperError::Signal)?;
        let reaper = Self {
            watchers: Arc::default(),
        };
        let watchers = Arc::clone(&reaper.watchers);
        tokio::spawn(async move {
            loop {
                reap_all(&watchers);
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    got = sigchld.recv() => if got.is_none() { break },
                }
            }
            // Children that exited during shutdown are still collected.
            reap_all(&watchers);
        });
        Ok(reaper)
    }

    /// Spawns `cmd` and sends its exit to `exits`. The returned `Child` must
    /// not be waited for: its exit is the reaper's.
    pub fn spawn(
        &self,
        cmd: &mut Command,
        exits: &UnboundedSender<ExitEvent>,
    ) -> std::io::Result<Child> {
        let mut child = None;
        self.spawn_with(exits, || {
            let c = cmd.spawn()?;
            let pid = i32::try_from(c.id()).expect("pids fit in i32");
            child = Some(c);
            Ok(pid)
        })?;
        Ok(child.expect("spawned"))
    }

    /// Runs `start`, which makes a child of this process some way (a fork
    /// server's worker is reparented here) and returns its pid, and sends
    /// that child's exit to `exits`.
    pub fn spawn_with(
        &self,
        exits: &UnboundedSender<ExitEvent>,
        start: impl FnOnce() -> std::io::Result<i32>,
    ) -> std::io::Result<i32> {
        // INVARIANT: the lock is held from before the child exists until
        // its pid is registered, and `reap_all` takes it for every exit it
        // delivers.
        let mut w = self.watchers.lock().unwrap_or_else(|p| p.into_inner());
        let pid = start()?;
        w.insert(pid, exits.clone());
        Ok(pid)
    }

    /// Reaps now, without waiting for a SIGCHLD (used after sending signals).
    pub fn poll(&self) {
        reap_all(&self.watchers);
    }
}

fn reap_all(watchers: &Watchers) {
    loop {
        let ev = match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(pid, code)) => ExitEvent {
                pid: pid.as_raw(),
                status: ExitStatus::Exited(code),
            },
            Ok(WaitStatus::Signaled(pid, sig, _)) => ExitEvent {
                pid: pid.as_raw(),
                status: ExitStatus::Signaled(sig as i32),
            },
            Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return,
            Ok(_) => continue, // stopped/continued: not an exit
            Err(Errno::EINTR) => continue,
            Err(e) => {
                tracing::error!(error = %e, "waitpid failed");
                return;
            }
        };
        let to = watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ev.pid);
        match to {
            // A closed channel: its supervisor is gone, the exit is moot.
            Some(tx) => {
                let _ = tx.send(ev);
            }
            // A reparented grandchild (we are a subreaper): collected.
            None => tracing::debug!(pid = ev.pid, status = %ev.status, "reaped an orphan"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_the_shell_convention() {
        assert_eq!(ExitStatus::Exited(3).code(), 3);
        assert_eq!(ExitStatus::Signaled(9).code(), 137);
        assert!(ExitStatus::Exited(0).success());
        assert!(!ExitStatus::Signaled(15).success());
        assert_eq!(
            ExitStatus::Signaled(9).to_string(),
            "killed by signal 9 (SIGKILL)"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    // The children are waited for by the reaper under test.
    #[allow(clippy::zombie_processes)]
    async fn every_exit_reaches_its_watcher_and_none_is_dropped() {
        use std::collections::HashMap;
        let stop = CancellationToken::new();
        let reaper = Reaper::start(stop.clone()).unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        // More exits than the old broadcast channel held (1024), none read
        // until all have happened.
        let n = 1100;
        let mut want = HashMap::new();
        for i in 0..n {
            let code = i % 7;
            let child = reaper
                .spawn(
                    Command::new("sh").args(["-c", &format!("exit {code}")]),
                    &tx,
                )
                .unwrap();
            want.insert(child.id() as i32, ExitStatus::Exited(code));
        }
        let mut got = HashMap::new();
        while got.len() < n as usize {
            let ev = tokio::time::timeout(std::time::Duration::from_secs(30), rx.recv())
                .await
                .expect("every exit arrives")
                .expect("channel open");
            assert!(got.insert(ev.pid, ev.status).is_none(), "delivered once");
        }
        assert_eq!(got, want);
        stop.cancel();
    }
}
