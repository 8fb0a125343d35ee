//! The supervisor: spawns one host's workers, forwards their output with a
//! rank prefix, follows their exits through the [`Reaper`], and stops them.
//!
//! What to do on an exit is decided by [`on_exit`], a pure function of the
//! workers' states; the supervisor only carries the decision out. Stopping is
//! always SIGTERM, a grace period, then SIGKILL, and waits until every worker
//! has been reaped, so no worker outlives the supervisor. Workers also get
//! `PR_SET_PDEATHSIG = SIGKILL`, so they die with an agent that is killed
//! before it can stop them.

use crate::reaper::{ExitEvent, ExitStatus, Reaper};
use nix::errno::Errno;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How to start one worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    pub rank: usize,
    pub local_rank: usize,
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub env: Vec<(String, String)>,
}

#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("cannot start worker rank {rank} ({program})")]
    Spawn {
        rank: usize,
        program: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot forward the output of worker rank {rank}")]
    Output {
        rank: usize,
        #[source]
        source: io::Error,
    },
}

/// A worker as the decision function sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerState {
    Running { pid: i32 },
    Exited(ExitStatus),
}

/// What to do after an exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Others are still running normally.
    Wait,
    /// Every worker finished successfully.
    Finished,
    /// A worker failed: stop the rest and end with its exit code.
    StopAll { failed_rank: usize, code: i32 },
}

/// Decides what the exit of `rank` with `status` means, given all workers'
/// states (already updated with this exit). Returns the decision and the
/// reason to log.
pub fn on_exit(workers: &[WorkerState], rank: usize, status: ExitStatus) -> (Decision, String) {
    if !status.success() {
        return (
            Decision::StopAll {
                failed_rank: rank,
                code: status.code(),
            },
            format!("rank {rank} failed ({status}) and no recovery is enabled: stopping the job"),
        );
    }
    let running = workers
        .iter()
        .filter(|w| matches!(w, WorkerState::Running { .. }))
        .count();
    if running == 0 {
        (
            Decision::Finished,
            "every worker finished successfully".into(),
        )
    } else {
        (
            Decision::Wait,
            format!("rank {rank} finished; {running} worker(s) still running"),
        )
    }
}

/// How supervision ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    WorkerFailed { rank: usize, status: ExitStatus },
    Interrupted,
}

/// One host's workers.
#[derive(Debug)]
pub struct Supervisor {
    states: Vec<WorkerState>,
    ranks: Vec<usize>,
    by_pid: HashMap<i32, usize>,
    exits: broadcast::Receiver<ExitEvent>,
    reaper: Reaper,
    output: TaskTracker,
    grace: Duration,
}

impl Supervisor {
    /// Subscribes to exits, then spawns every worker. If one cannot be
    /// spawned, those already started are stopped again.
    pub async fn start(
        specs: &[WorkerSpec],
        reaper: &Reaper,
        grace: Duration,
    ) -> Result<Self, SupervisorError> {
        // INVARIANT: subscribe before the first spawn, so no exit is missed.
        let exits = reaper.subscribe();
        let mut sup = Self {
            states: Vec::with_capacity(specs.len()),
            ranks: Vec::with_capacity(specs.len()),
            by_pid: HashMap::new(),
            exits,
            reaper: reaper.clone(),
            output: TaskTracker::new(),
            grace,
        };
        for spec in specs {
            if let Err(e) = sup.spawn(spec) {
                sup.stop_all().await;
                return Err(e);
            }
        }
        Ok(sup)
    }

    fn spawn(&mut self, spec: &WorkerSpec) -> Result<(), SupervisorError> {
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: the closure runs in the child between fork and exec and
        // only calls prctl(2), which is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|source| SupervisorError::Spawn {
            rank: spec.rank,
            program: spec.program.clone(),
            source,
        })?;
        let pid = i32::try_from(child.id()).expect("pids fit in i32");
        tracing::info!(
            rank = spec.rank,
            local_rank = spec.local_rank,
            pid,
            "worker started"
        );
        let idx = self.states.len();
        self.states.push(WorkerState::Running { pid });
        self.ranks.push(spec.rank);
        self.by_pid.insert(pid, idx);
        let out_err = |source| SupervisorError::Output {
            rank: spec.rank,
            source,
        };
        // The `Child` is dropped without waiting: the reaper collects it.
        let stdout = child.stdout.take().map(OwnedFd::from);
        let stderr = child.stderr.take().map(OwnedFd::from);
        for (fd, to_stderr) in [(stdout, false), (stderr, true)] {
            if let Some(fd) = fd {
                let rx = tokio::net::unix::pipe::Receiver::from_owned_fd(fd).map_err(out_err)?;
                self.output.spawn(forward(rx, spec.rank, to_stderr));
            }
        }
        Ok(())
    }

    /// Pids of the workers still running, by rank.
    pub fn running(&self) -> Vec<(usize, i32)> {
        self.states
            .iter()
            .zip(&self.ranks)
            .filter_map(|(s, &r)| match s {
                WorkerState::Running { pid } => Some((r, *pid)),
                WorkerState::Exited(_) => None,
            })
            .collect()
    }

    /// Records an exit; returns the worker's index if it was ours.
    fn record(&mut self, ev: ExitEvent) -> Option<usize> {
        let idx = self.by_pid.remove(&ev.pid)?;
        self.states[idx] = WorkerState::Exited(ev.status);
        Some(idx)
    }

    /// Follows the workers until the job ends or `shutdown` fires, then
    /// makes sure none is left running.
    pub async fn run(mut self, shutdown: CancellationToken) -> Outcome {
        let outcome = loop {
            let ev = tokio::select! {
                _ = shutdown.cancelled() => {
                    tracing::warn!("shutdown requested: stopping the workers");
                    break Outcome::Interrupted;
                }
                ev = self.exits.recv() => ev,
            };
            let ev = match ev {
                Ok(ev) => ev,
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    tracing::error!(missed = n, "exit events were dropped");
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => break Outcome::Interrupted,
            };
            let Some(idx) = self.record(ev) else { continue };
            let rank = self.ranks[idx];
            let (decision, reason) = on_exit(&self.states, rank, ev.status);
            match decision {
                Decision::Wait => {
                    tracing::info!(rank, pid = ev.pid, status = %ev.status, %reason, "worker exited");
                }
                Decision::Finished => {
                    tracing::info!(rank, pid = ev.pid, %reason, "job finished");
                    break Outcome::Succeeded;
                }
                Decision::StopAll { failed_rank, .. } => {
                    tracing::error!(rank = failed_rank, pid = ev.pid, status = %ev.status, %reason, "worker failed");
                    break Outcome::WorkerFailed {
                        rank: failed_rank,
                        status: ev.status,
                    };
                }
            }
        };
        self.stop_all().await;
        outcome
    }

    /// SIGTERM to every running worker, SIGKILL to those still running after
    /// the grace period, then waits until all are reaped and their output is
    /// drained.
    pub async fn stop_all(&mut self) {
        let running = self.running();
        for &(rank, pid) in &running {
            tracing::info!(rank, pid, "sending SIGTERM");
            signal(pid, Signal::SIGTERM);
        }
        let sent_kill = !self.wait_all(self.grace).await;
        if sent_kill {
            for (rank, pid) in self.running() {
                tracing::warn!(rank, pid, grace = ?self.grace, "still running after the grace period: SIGKILL");
                signal(pid, Signal::SIGKILL);
            }
            if !self.wait_all(Duration::from_secs(10)).await {
                tracing::error!(left = ?self.running(), "workers not reaped after SIGKILL");
            }
        }
        self.output.close();
        // Output pipes close when the workers die; a grandchild holding a
        // pipe open must not keep the agent from exiting.
        let _ = tokio::time::timeout(Duration::from_secs(2), self.output.wait()).await;
        let _ = io::stdout().flush();
    }

    /// Waits until no worker runs; false if `limit` passed first.
    async fn wait_all(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if self.running().is_empty() {
                return true;
            }
            // A signal we sent may have been delivered before our SIGCHLD
            // wait began; poll once so the exit is not waited for in vain.
            self.reaper.poll();
            match tokio::time::timeout_at(deadline, self.exits.recv()).await {
                Err(_) => return self.running().is_empty(),
                Ok(Ok(ev)) => {
                    if let Some(idx) = self.record(ev) {
                        tracing::info!(rank = self.ranks[idx], pid = ev.pid, status = %ev.status, "worker stopped");
                    }
                }
                Ok(Err(broadcast::error::RecvError::Lagged(_))) => {}
                Ok(Err(broadcast::error::RecvError::Closed)) => return false,
            }
        }
    }
}

/// Sends `sig`; a process that is already gone (ESRCH) counts as success.
fn signal(pid: i32, sig: Signal) {
    match kill(Pid::from_raw(pid), sig) {
        Ok(()) | Err(Errno::ESRCH) => {}
        Err(e) => tracing::error!(pid, ?sig, error = %e, "kill failed"),
    }
}

/// Copies a worker's output line by line, prefixed with its rank.
async fn forward(rx: tokio::net::unix::pipe::Receiver, rank: usize, to_stderr: bool) {
    let mut reader = BufReader::new(rx);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let text = String::from_utf8_lossy(&line);
                let text = text.trim_end_matches(['\n', '\r']);
                let out = format!("[rank {rank}] {text}\n");
                let _ = if to_stderr {
                    io::stderr().lock().write_all(out.as_bytes())
                } else {
                    io::stdout().lock().write_all(out.as_bytes())
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RUN: WorkerState = WorkerState::Running { pid: 1 };

    #[test]
    fn decisions_cover_every_case() {
        let ok = ExitStatus::Exited(0);
        let done = WorkerState::Exited(ok);
        assert_eq!(on_exit(&[done, done], 1, ok).0, Decision::Finished);
        assert_eq!(on_exit(&[done, RUN], 0, ok).0, Decision::Wait);
        for status in [ExitStatus::Exited(3), ExitStatus::Signaled(9)] {
            let failed = WorkerState::Exited(status);
            for others in [RUN, done] {
                let (d, reason) = on_exit(&[others, failed], 1, status);
                assert_eq!(
                    d,
                    Decision::StopAll {
                        failed_rank: 1,
                        code: status.code()
                    }
                );
                assert!(reason.contains("rank 1 failed"), "{reason}");
            }
        }
    }
}
