//! Warm standby workers (`--warm-standby K`): K extra processes of the
//! worker command, started ahead with `HATRAIN_STANDBY=1` and without a
//! rank. Each does its start-up and parks with the agent; a rank that must
//! be restarted takes one ([`Supervisor::promote`]) instead of a fresh
//! process, and another is started once the recovery is over
//! ([`Supervisor::release_refill`]): its start-up (a Python worker's imports
//! and model build) would otherwise compete with the ranks' first steps
//! back for the host's cores.
//!
//! A standby that dies while parked is replaced; after [`MAX_DEATHS`] in a
//! row without one being used, none is started again (the command does not
//! support standbys, or cannot start), and ranks are restarted as fresh
//! processes.

use super::{ExitEvent, Signal, Supervisor, SupervisorError, WorkerSpec, WorkerState};
use crate::output::Sink;
use std::collections::BTreeMap;
use tokio::sync::oneshot;

/// Standbys that may die in a row before the pool gives up.
pub const MAX_DEATHS: u32 = 3;

/// The variables a rank's process has and a standby's must not: it has no
/// rank until the agent gives it one.
pub(super) const RANK_VARS: [&str; 4] =
    ["RANK", "LOCAL_RANK", "ROLE_RANK", "TORCHELASTIC_ERROR_FILE"];

#[derive(Debug, Default)]
pub(super) struct Pool {
    want: usize,
    /// Running standbys: pid → their number (their output's label).
    pids: BTreeMap<i32, usize>,
    next: usize,
    /// Standbys that exited unused, in a row.
    deaths: u32,
    /// The workers are being stopped: no standby is started.
    pub(super) stopping: bool,
    /// A standby was promoted during a recovery still under way: the pool
    /// refills when it is over.
    held: bool,
    /// Per running standby, where to send the sinks of its output streams
    /// (stdout: false, stderr: true) when it takes a rank's place.
    pub(super) retarget: BTreeMap<i32, Vec<(bool, oneshot::Sender<Sink>)>>,
}

impl Pool {
    pub(super) fn is_empty(&self) -> bool {
        self.pids.is_empty()
    }
}

impl Supervisor {
    /// Keeps `k` warm standbys running from now on.
    pub fn keep_warm(&mut self, k: usize) {
        if k > 0 && self.specs.is_empty() {
            // A spare host's agent has no worker until it takes a lost
            // host's ranks.
            return;
        }
        if k > 0 && !matches!(self.spawner, super::Spawner::Own(_)) {
            tracing::warn!(
                "--warm-standby is for `launch`: a served job's processes are its launcher's; none is kept"
            );
            return;
        }
        self.warm.want = k;
        self.refill();
    }

    /// Whether `pid` is a parked (unused, running) standby of this host.
    pub fn is_standby(&self, pid: i32) -> bool {
        self.warm.pids.contains_key(&pid)
    }

    /// The local rank of `rank` on this host.
    pub fn local_rank(&self, rank: usize) -> Option<usize> {
        Some(self.specs[self.index(rank)?].local_rank)
    }

    /// The error file (`TORCHELASTIC_ERROR_FILE`) of `rank`'s process.
    pub fn error_file(&self, rank: usize) -> Option<std::path::PathBuf> {
        self.specs[self.index(rank)?]
            .env
            .iter()
            .find(|(k, _)| k == crate::spec::ENV_ERROR_FILE)
            .map(|(_, v)| v.into())
    }

    /// Standby `pid` becomes `rank`, whose process must have been reaped:
    /// its exit is `rank`'s from now on. Another standby is started at the
    /// next [`Self::release_refill`]. False if `pid` is not a running
    /// standby.
    pub fn promote(&mut self, rank: usize, pid: i32) -> bool {
        let Some(idx) = self.index(rank) else {
            return false;
        };
        if !matches!(self.states[idx], WorkerState::Exited(_)) {
            return false;
        }
        let Some(n) = self.warm.pids.remove(&pid) else {
            return false;
        };
        tracing::info!(
            rank,
            pid,
            standby = n,
            "warm standby takes the rank's place"
        );
        self.states[idx] = WorkerState::Running { pid };
        self.by_pid.insert(pid, idx);
        // Its output is the rank's from now on: labelled, filed and
        // filtered as the rank's.
        let spec = self.specs[idx].clone();
        for (stderr, tx) in self.warm.retarget.remove(&pid).unwrap_or_default() {
            match self.sink(&spec, None, stderr) {
                Ok(sink) => {
                    let _ = tx.send(sink);
                }
                Err(e) => {
                    tracing::warn!(rank, pid, error = %e, "the rank's log file cannot be opened: the promoted standby's output keeps its standby label");
                }
            }
        }
        self.warm.deaths = 0;
        self.warm.held = true;
        true
    }

    /// The recovery is over (or none is under way): starts the standbys
    /// that promotions used up.
    pub fn release_refill(&mut self) {
        if std::mem::take(&mut self.warm.held) {
            self.refill();
        }
    }

    /// Starts standbys until `want` run (unless stopping, or given up).
    pub(super) fn refill(&mut self) {
        while !self.warm.stopping
            && !self.warm.held
            && self.warm.pids.len() < self.warm.want
            && self.warm.deaths < MAX_DEATHS
        {
            match self.spawn_standby() {
                Ok(_) => {}
                Err(e) => {
                    tracing::error!(error = %crate::error_chain(&e), "cannot start a warm standby");
                    self.warm.deaths += 1;
                }
            }
        }
    }

    fn spawn_standby(&mut self) -> Result<i32, SupervisorError> {
        let Some(template) = self.specs.first() else {
            return Err(SupervisorError::Spawn {
                rank: 0,
                program: "(no worker command on this host)".into(),
                source: std::io::Error::other("a host with no worker keeps no standby"),
            });
        };
        let mut spec: WorkerSpec = template.clone();
        spec.env.retain(|(k, _)| !RANK_VARS.contains(&k.as_str()));
        spec.env
            .push((hatrain_shared::control::ENV_STANDBY.into(), "1".into()));
        let n = self.warm.next;
        self.warm.next += 1;
        let pid = self.spawn_as(&spec, Some(n))?;
        self.warm.pids.insert(pid, n);
        Ok(pid)
    }

    /// Records the exit of a standby; false if `ev` is not one's.
    pub(super) fn standby_exited(&mut self, ev: &ExitEvent) -> bool {
        let Some(n) = self.warm.pids.remove(&ev.pid) else {
            return false;
        };
        self.warm.retarget.remove(&ev.pid);
        // What it started dies with it.
        self.os.signal(-ev.pid, Signal::SIGKILL);
        if self.warm.stopping {
            tracing::info!(standby = n, pid = ev.pid, status = %ev.status, "warm standby stopped");
            return true;
        }
        self.warm.deaths += 1;
        if self.warm.deaths >= MAX_DEATHS {
            tracing::error!(standby = n, pid = ev.pid, status = %ev.status, deaths = self.warm.deaths,
                "warm standby exited unused, {MAX_DEATHS} in a row: no more are started (does the worker command support standbys?); failed ranks restart as fresh processes");
        } else {
            tracing::warn!(standby = n, pid = ev.pid, status = %ev.status, "warm standby exited unused: starting another");
        }
        self.refill();
        true
    }

    /// SIGTERM (or `sig`) to every standby.
    pub(super) fn signal_standbys(&self, sig: Signal) {
        for &pid in self.warm.pids.keys() {
            self.os.signal(-pid, sig);
        }
    }
}
