//! Faults as the machine takes them: exits (clean or not), ranks stranded
//! by a peer's clean exit, registrations of replacements, memory errors and
//! replacements that cannot be started.

use super::*;

impl Machine {
    pub(super) fn stranded(&mut self, now: Duration) -> bool {
        if self.finished.is_empty() {
            return false;
        }
        let waiting: Vec<(usize, u64)> = self
            .participants()
            .into_iter()
            .map(|r| self.view(r))
            .filter(|v| v.alive && v.phase == Phase::Paused)
            .map(|v| (v.rank, v.step))
            .collect();
        let gone: Vec<(usize, u64)> = self
            .finished
            .iter()
            .map(|&r| (r, self.finished_at.get(&r).copied().unwrap_or(0)))
            .collect();
        let Some(why) = left_waiting(&gone, &waiting) else {
            return false;
        };
        self.note(Level::Error, None, why.clone());
        for (rank, step) in gone {
            self.finished.remove(&rank);
            let detail = format!("exit code 0 after step {step}: {why}");
            self.failure(
                now,
                rank,
                FaultKind::EarlyExit,
                detail,
                "exited 0 before its peers finished",
                None,
                step,
            );
        }
        true
    }

    pub(super) fn registered(&mut self, rank: usize, checkpoint: bool, global_batch: Option<u64>) {
        self.checkpoint |= checkpoint;
        match (self.global_batch, global_batch) {
            (None, Some(b)) => self.global_batch = Some(b),
            (Some(a), Some(b)) if a != b => self.note(
                Level::Warn,
                Some(rank),
                format!(
                    "rank {rank} registered a global batch of {b}, the group's is {a}: a resize keeps the size a divisor of {a}"
                ),
            ),
            _ => {}
        }
        self.protected.insert(rank);
        self.exits.remove(&rank);
        let v = self.views.entry(rank).or_insert(RankView::absent(rank));
        v.registered = true;
        v.alive = true;
        let epoch = match self.state {
            State::Recovering {
                epoch,
                stage: Stage::Pausing { .. },
                ..
            }
            | State::Dumping {
                epoch,
                stage: Stage::Pausing { .. },
                ..
            } => epoch,
            _ => return,
        };
        self.cmd(Command::Post {
            rank,
            directive: Directive::Pause { epoch, upto: None },
        });
    }

    pub(super) fn exited(
        &mut self,
        now: Duration,
        rank: usize,
        status: ExitStatus,
        cause: ExitCause,
    ) {
        let step = self.view(rank).step;
        if let Some(v) = self.views.get_mut(&rank) {
            v.alive = false;
        }
        self.exits.insert(rank);
        self.last_status.insert(rank, status);
        if matches!(self.state, State::Done(_)) {
            return;
        }
        if self.left(rank) {
            // A rank told to stand by when the group shrank to a size
            // dividing the global batch: its state goes on in its replica.
            self.note(
                Level::Info,
                Some(rank),
                format!("rank {rank}, standing by outside the group, ended ({status})"),
            );
            return;
        }
        if status.success() && !self.killed.contains_key(&rank) {
            let v = self.view(rank);
            let said_finished = v.phase == Phase::Finished || !v.registered;
            if let Some(why) = early_exit(rank, step, said_finished) {
                self.note(Level::Error, Some(rank), why.clone());
                let detail = format!("exit code 0 after step {step}: {why}");
                self.failure(
                    now,
                    rank,
                    FaultKind::EarlyExit,
                    detail,
                    "exited 0 before its peers finished",
                    None,
                    step,
                );
                return;
            }
            // The first step after a recovery may be the job's last (or s*
            // itself was): ranks that finish from s* on completed it.
            if let State::Recovering {
                stage: Stage::Resuming { s_star, .. },
                faults,
                max_step,
                ..
            } = self.state.clone()
                && step >= s_star
                && self.participants().iter().all(|&r| {
                    let v = self.view(r);
                    r == rank || (v.alive && v.step > s_star) || self.finished.contains(&r)
                })
            {
                self.complete_recovery(now, s_star, faults, max_step);
            }
            self.finished.insert(rank);
            self.finished_at.insert(rank, step);
            let left = self.participants().len();
            if left == 0 {
                self.note(
                    Level::Info,
                    Some(rank),
                    "every worker finished successfully",
                );
                self.finish(Outcome::Succeeded);
            } else {
                self.note(
                    Level::Info,
                    Some(rank),
                    format!("rank {rank} finished; {left} worker(s) still running"),
                );
            }
            return;
        }
        let (kind, detail) = match (self.killed.remove(&rank), cause) {
            (Some((kind, seen)), _) => (kind, format!("{seen}; then {status}")),
            (None, ExitCause::FatalUce) => (
                FaultKind::Uce,
                format!(
                    "SIGBUS BUS_MCEERR outside the registered state: the process could not trust its memory; {status}"
                ),
            ),
            (None, ExitCause::OutOfMemory) => (
                FaultKind::Oom,
                format!("killed by the kernel's OOM killer: out of memory ({status})"),
            ),
            (None, ExitCause::Status) => (FaultKind::Crash, status.to_string()),
        };
        let what = if kind == FaultKind::Oom {
            format!("ran out of memory ({status})")
        } else {
            format!("failed ({status})")
        };
        self.failure(now, rank, kind, detail, &what, Some(status), step);
    }

    /// A failure of `rank`: restarted in place and recovered, or the end.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn failure(
        &mut self,
        now: Duration,
        rank: usize,
        kind: FaultKind,
        detail: String,
        what: &str,
        status: Option<ExitStatus>,
        step: u64,
    ) {
        if matches!(
            self.state,
            State::Dumping {
                then: AfterDump::Stop(_),
                ..
            }
        ) {
            let reason = format!("rank {rank} {what} while the last words are written");
            self.note(Level::Warn, Some(rank), reason.clone());
            self.record_fault(
                now,
                rank,
                kind,
                detail,
                (FaultAction::None, "none: the job is stopping".into()),
                reason,
            );
            return;
        }
        if let Some(why) = self.unrepairable_in_place(rank)
            && self.state == State::Running
        {
            self.group_failure(now, rank, kind, detail, what, status, &why);
            return;
        }
        let history = self.history.get(&rank).cloned().unwrap_or_default();
        let code = status.map_or(0, ExitStatus::code);
        let (decision, reason) = match out_of_memory_again(
            rank,
            kind == FaultKind::Oom,
            self.oom_restarts,
            MAX_OOM_RESTARTS,
        ) {
            Some(reason) => (ExitDecision::Stop { rank, code }, reason),
            None => on_failure(
                now,
                rank,
                what,
                code,
                step,
                &history,
                &self.cfg.modes,
                &self.cfg.restart,
            ),
        };
        match decision {
            ExitDecision::Restart { .. } => {
                if kind == FaultKind::Oom {
                    self.oom_restarts += 1;
                }
                let restarts = self.respawn(now, rank, step);
                self.fault_note(
                    Level::Warn,
                    rank,
                    "worker failed: recovering",
                    &detail,
                    &reason,
                );
                let f = self.record_fault(
                    now,
                    rank,
                    kind,
                    detail,
                    (
                        FaultAction::Reboot,
                        format!("restart rank {rank} in place (restart {restarts})"),
                    ),
                    reason,
                );
                self.recover(now, f);
            }
            ExitDecision::Stop { .. } | ExitDecision::Wait | ExitDecision::Finished => {
                self.failure_stops(now, rank, kind, detail, reason, status);
            }
        }
    }

    /// A failure of `rank` ends the job, for `reason` (with its last words
    /// when the dump mode is on).
    fn failure_stops(
        &mut self,
        now: Duration,
        rank: usize,
        kind: FaultKind,
        detail: String,
        reason: String,
        status: Option<ExitStatus>,
    ) {
        self.fault_note(Level::Error, rank, "worker failed", &detail, &reason);
        self.record_fault(
            now,
            rank,
            kind,
            detail,
            (FaultAction::Stop, "stop the job".into()),
            reason,
        );
        let outcome = match status {
            Some(status) => Outcome::WorkerFailed { rank, status },
            None => Outcome::RecoveryFailed,
        };
        self.stop_with(now, outcome);
    }

    pub(super) fn uce(&mut self, now: Duration, rank: usize, part: &str, offset: u64) {
        let detail = format!("SIGBUS BUS_MCEERR in {part} at byte {offset}");
        if matches!(
            self.state,
            State::Done(_)
                | State::Dumping {
                    then: AfterDump::Stop(_),
                    ..
                }
        ) {
            self.note(
                Level::Warn,
                Some(rank),
                format!("{detail} while the job stops"),
            );
            return;
        }
        let (action, reason) = uce_action(&self.cfg.modes, rank, part);
        match action {
            UceAction::Repair => {
                self.fault_note(Level::Warn, rank, "UCE: step repair", &detail, &reason);
                let f = self.record_fault(
                    now,
                    rank,
                    FaultKind::Uce,
                    detail,
                    (
                        FaultAction::Repair,
                        "restore s* and recompute the step".into(),
                    ),
                    reason,
                );
                self.recover(now, f);
            }
            UceAction::Reboot => {
                self.fault_note(Level::Warn, rank, "UCE: worker reboot", &detail, &reason);
                self.killed.insert(rank, (FaultKind::Uce, detail));
                self.cmd(Command::Kill { rank });
            }
            UceAction::Stop => {
                self.fault_note(
                    Level::Error,
                    rank,
                    "UCE: stopping the job",
                    &detail,
                    &reason,
                );
                self.record_fault(
                    now,
                    rank,
                    FaultKind::Uce,
                    detail,
                    (FaultAction::Stop, "stop the job".into()),
                    reason,
                );
                self.stop_with(now, Outcome::RecoveryFailed);
            }
        }
    }

    /// Why a failure of `rank` cannot be repaired in place, if it cannot:
    /// worker reboot is off, or some rank never registered with the runtime
    /// (its state is nowhere to restore from).
    fn unrepairable_in_place(&self, rank: usize) -> Option<String> {
        if !self.cfg.modes.recover {
            return Some("worker reboot is not enabled".into());
        }
        let unprotected: Vec<usize> = self
            .participants()
            .into_iter()
            .chain([rank])
            .filter(|r| !self.protected.contains(r))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        (!unprotected.is_empty()).then(|| {
            format!(
                "rank(s) {unprotected:?} never registered with the hatrain runtime, so there is no snapshot to restore them from"
            )
        })
    }

    /// A failure that cannot be repaired in place (`why`): the whole group
    /// is stopped and started again, as torchrun does, while
    /// `--max-restarts` allows; then the job stops (with its last words when
    /// the dump mode is on).
    #[allow(clippy::too_many_arguments)]
    fn group_failure(
        &mut self,
        now: Duration,
        rank: usize,
        kind: FaultKind,
        detail: String,
        what: &str,
        status: Option<ExitStatus>,
        why: &str,
    ) {
        let limit = self.cfg.group_restarts;
        if self.group_restarts >= limit {
            let reason = format!(
                "rank {rank} {what}; {why}, and the group was restarted {} time(s), the --max-restarts limit of {limit}: stopping the job",
                self.group_restarts
            );
            self.failure_stops(now, rank, kind, detail, reason, status);
            return;
        }
        self.group_restarts += 1;
        let restart = self.group_restarts;
        let reason = format!(
            "rank {rank} {what}; {why}: stopping every worker and starting the group again (restart {restart} of at most {limit}); the workers resume from their own checkpoints"
        );
        self.fault_note(
            Level::Warn,
            rank,
            "worker failed: restarting the group",
            &detail,
            &reason,
        );
        let f = self.record_fault(
            now,
            rank,
            kind,
            detail,
            (
                FaultAction::GroupRestart,
                format!("restart the whole group (restart {restart} of {limit})"),
            ),
            reason,
        );
        // The group starts from nothing the machine knew: every rank is a
        // new process that has yet to register.
        self.faults[f].recovery_s = Some(0.0);
        self.finished.clear();
        self.finished_at.clear();
        self.killed.clear();
        self.protected.clear();
        for r in self.ranks.clone() {
            self.views.insert(r, RankView::absent(r));
            self.watch.new_process(r);
            self.spawned.insert(r, now);
        }
        self.cmd(Command::RestartGroup { restart });
    }

    /// Says once per rank, with any mode on, that a worker has run for the
    /// register timeout without registering: nothing protects it.
    pub(super) fn warn_unprotected(&mut self, now: Duration) {
        if !self.cfg.modes.any() {
            return;
        }
        let late: Vec<usize> = self
            .participants()
            .into_iter()
            .filter(|r| {
                self.view(*r).alive
                    && !self.protected.contains(r)
                    && !self.warned.contains(r)
                    && now.saturating_sub(self.spawned.get(r).copied().unwrap_or_default())
                        >= self.cfg.register_timeout
            })
            .collect();
        for r in late {
            self.warned.insert(r);
            let text = format!(
                "rank {r} has run {:?} without registering with the hatrain runtime: it is NOT protected (no snapshot, no in-place restart, no last-words checkpoint). Use the hatrain worker runtime in the training script (for PyTorch, the hatrain Python binding). Until then a failure stops and restarts the whole group, as torchrun does (--max-restarts {})",
                self.cfg.register_timeout, self.cfg.group_restarts
            );
            self.note(Level::Warn, Some(r), text);
        }
    }

    /// A device fault source took `rank`'s device down: the rank is killed
    /// and its exit handled as a `kind` fault (a crash or a hang), or, for
    /// [`FaultKind::Device`], the device is lost to the job: with one host
    /// the job writes its last words (dump mode) and stops.
    pub(super) fn device_fault(
        &mut self,
        now: Duration,
        rank: usize,
        kind: FaultKind,
        detail: String,
    ) {
        if matches!(self.state, State::Done(_)) || self.killed.contains_key(&rank) {
            return;
        }
        if kind == FaultKind::Device {
            let reason = "the device is lost to the job: its ranks cannot go on on this host";
            self.fault_note(Level::Error, rank, "device lost", &detail, reason);
            self.record_fault(
                now,
                rank,
                kind,
                detail,
                (FaultAction::Stop, "stop the job".into()),
                reason.into(),
            );
            self.stop_with(now, Outcome::RecoveryFailed);
            return;
        }
        self.note(
            Level::Warn,
            Some(rank),
            format!("device fault ({kind}): killing rank {rank} ({detail})"),
        );
        self.killed.insert(rank, (kind, detail));
        self.cmd(Command::Kill { rank });
    }

    /// `rank` is slow and handing it to a fresh process pays: it is killed,
    /// and its exit recovered from as a [`FaultKind::Slow`] (a worker
    /// reboot, to a warm standby where there is one). Only while the job
    /// runs undisturbed and the rank can be restarted in place: a recovery
    /// under way decides otherwise, and a rank with nothing to refill it
    /// from is better slow than gone.
    pub(super) fn slow(&mut self, rank: usize, detail: String) {
        let why_not = if !matches!(self.state, State::Running) {
            Some("a recovery or the job's end is under way".to_string())
        } else if self.killed.contains_key(&rank) || !self.view(rank).alive {
            Some("it is being restarted already".to_string())
        } else {
            self.unrepairable_in_place(rank)
        };
        if let Some(why) = why_not {
            self.note(
                Level::Info,
                Some(rank),
                format!("slow rank {rank} not handed over ({detail}): {why}"),
            );
            return;
        }
        self.note(
            Level::Warn,
            Some(rank),
            format!("slow rank handed over: restarting rank {rank} in place ({detail})"),
        );
        self.killed.insert(rank, (FaultKind::Slow, detail));
        self.cmd(Command::Kill { rank });
    }

    /// A rank's snapshot store cannot be made: the job cannot run on this
    /// host. It stops at once: nothing can have been snapshotted yet, since
    /// stores are made before a rank trains.
    pub(super) fn unfit(&mut self, now: Duration, rank: usize, reason: String) {
        if matches!(self.state, State::Done(_)) {
            return;
        }
        self.fault_note(
            Level::Error,
            rank,
            "the host cannot hold the job",
            &reason,
            "no snapshot store, no protection: stopping the job",
        );
        self.record_fault(
            now,
            rank,
            FaultKind::Store,
            reason,
            (FaultAction::Stop, "stop the job".into()),
            "the rank's snapshot store cannot be made on this host".into(),
        );
        self.finish(Outcome::Unfit);
    }

    /// Starts `rank` again in place (its process died after `step`);
    /// returns its restart count.
    pub(super) fn respawn(&mut self, now: Duration, rank: usize, step: u64) -> u32 {
        let history = self.history.entry(rank).or_default();
        history.record_restart(now, step, &self.cfg.restart);
        let restarts = history.restarts;
        self.watch.new_process(rank);
        self.spawned.insert(rank, now);
        self.exits.remove(&rank);
        self.cmd(Command::Respawn { rank, restarts });
        restarts
    }

    /// Recovers from fault `f`: now, or after the dump in progress.
    pub(super) fn recover(&mut self, now: Duration, f: usize) {
        if let State::Dumping { recover, .. } = &mut self.state {
            recover.push(f);
        } else {
            self.begin_recovery(now, vec![f]);
        }
    }

    pub(super) fn spawn_failed(&mut self, now: Duration, rank: usize, error: &str) {
        let why = format!("cannot restart rank {rank}: {error}");
        self.note(Level::Error, Some(rank), why.clone());
        if let Some(f) = self.faults.iter_mut().rev().find(|f| f.ranks == [rank]) {
            f.action = format!("stop the job: {why}");
            f.class = FaultAction::Stop;
        }
        let status = self
            .last_status
            .get(&rank)
            .copied()
            .unwrap_or(ExitStatus::Exited(1));
        self.stop_with(now, Outcome::WorkerFailed { rank, status });
    }

    /// A rank could not build the communicator of `epoch`: the recovery
    /// tries again under a new epoch, at most [`MAX_REBUILDS`] epochs in
    /// all; then the job stops, naming who could not reach whom.
    pub(super) fn rebuild_failed(
        &mut self,
        now: Duration,
        rank: usize,
        epoch: u64,
        peer: Option<u64>,
    ) {
        let current = match self.state {
            State::Recovering {
                epoch: e,
                stage: Stage::Resuming { .. },
                ..
            } => e,
            _ => return,
        };
        if epoch != current || self.rebuilds.iter().any(|(e, _, _)| *e == epoch) {
            return;
        }
        self.rebuilds.push((epoch, rank, peer));
        let whom = |p: Option<u64>| p.map_or("its peers".to_string(), |p| format!("rank {p}"));
        let detail = format!(
            "rank {rank} could not reach {} to rebuild the communicator of epoch {epoch}",
            whom(peer)
        );
        if self.rebuilds.len() < MAX_REBUILDS {
            self.note(
                Level::Warn,
                Some(rank),
                format!(
                    "{detail}: trying again under a new epoch ({} of {MAX_REBUILDS})",
                    self.rebuilds.len() + 1
                ),
            );
            self.begin_recovery(now, Vec::new());
            return;
        }
        let tried: Vec<String> = self
            .rebuilds
            .iter()
            .map(|(e, r, p)| format!("epoch {e}: rank {r} could not reach {}", whom(*p)))
            .collect();
        let reason = format!(
            "the communicator could not be rebuilt under {MAX_REBUILDS} epochs ({}): stopping the job",
            tried.join("; ")
        );
        self.fault_note(Level::Error, rank, "rebuild failed", &detail, &reason);
        self.record_fault(
            now,
            rank,
            FaultKind::Rebuild,
            detail,
            (FaultAction::Stop, "stop the job".into()),
            reason,
        );
        self.stop_with(now, Outcome::RecoveryFailed);
    }
}
