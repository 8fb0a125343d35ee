//! The one reaper of the agent.
//!
//! INVARIANT: nothing else in the process waits for children. A single task
//! handles SIGCHLD and loops `waitpid(-1, WNOHANG)` until no exited child is
//! left, because one SIGCHLD may stand for several exits (signals of one kind
//! coalesce, signal(7)). Every exit is published on a broadcast channel;
//! a supervisor subscribes *before* it spawns, so no exit can be missed.
//!
//! The agent is also a child subreaper (`PR_SET_CHILD_SUBREAPER`, prctl(2)),
//! so a worker's own children that outlive it are reparented here and reaped
//! here rather than by init.

use nix::errno::Errno;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// Handle to the reaper task.
#[derive(Debug, Clone)]
pub struct Reaper {
    tx: broadcast::Sender<ExitEvent>,
}

impl Reaper {
    /// Installs the SIGCHLD handler and starts the reaping task on the
    /// current runtime. Call before spawning any child.
    pub fn start(shutdown: CancellationToken) -> Result<Self, ReaperError> {
        // SAFETY: prctl with PR_SET_CHILD_SUBREAPER takes one integer
        // argument and touches no memory of ours.
        let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        if rc != 0 {
            return Err(ReaperError::Subreaper(Errno::last()));
        }
        let mut sigchld = signal(SignalKind::child()).map_err(ReaperError::Signal)?;
        let (tx, _) = broadcast::channel(1024);
        let reaper = Self { tx: tx.clone() };
        tokio::spawn(async move {
            loop {
                reap_all(&tx);
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    got = sigchld.recv() => if got.is_none() { break },
                }
            }
            // Children that exited during shutdown are still collected.
            reap_all(&tx);
        });
        Ok(reaper)
    }

    /// Subscribes to every exit from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<ExitEvent> {
        self.tx.subscribe()
    }

    /// Reaps now, without waiting for a SIGCHLD (used after sending signals).
    pub fn poll(&self) {
        reap_all(&self.tx);
    }
}

fn reap_all(tx: &broadcast::Sender<ExitEvent>) {
    loop {
        let status = match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
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
        // No receiver is fine: an exit nobody asked about (a reparented
        // grandchild) is simply collected.
        let _ = tx.send(status);
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
}
