//! The machine's stages: the tick that moves a recovery or dump from one
//! stage to the next (and runs the watchdog), the collected snapshots and
//! written checkpoints that end a stage, and the requests that start one.

use super::*;

impl Machine {
    pub(super) fn tick(&mut self, now: Duration, views: Vec<RankView>) {
        for v in &views {
            self.views.insert(v.rank, *v);
        }
        self.watch.observe(now, &views);
        self.unreported_exits(now);
        self.warn_unprotected(now);
        if self.state == State::Running && self.stranded(now) {
            return;
        }
        match self.state.clone() {
            // INVARIANT: while a rank's death is pending (killed, or dead
            // and not yet reaped) nobody is blamed: its peers wait for it,
            // and its exit starts a recovery anyway.
            State::Running
                if self.cfg.modes.any()
                    && self.killed.is_empty()
                    && self.participants().iter().all(|&r| self.view(r).alive) =>
            {
                let spared: HashSet<usize> = self.finished.iter().copied().collect();
                let all: Vec<RankView> = self.views.values().copied().collect();
                for c in self.watch.culprits(now, &all, &self.cfg.hang, &spared) {
                    self.note(
                        Level::Error,
                        Some(c.rank),
                        format!("rank hung: killing it ({})", c.seen),
                    );
                    self.killed.insert(c.rank, (FaultKind::Hang, c.seen));
                    self.cmd(Command::Kill { rank: c.rank });
                }
            }
            State::Recovering {
                epoch,
                stage: Stage::Pausing { deadline },
                faults,
                max_step,
            } => {
                let waiting: Vec<usize> = self
                    .participants()
                    .into_iter()
                    .filter(|&r| !self.paused(r, epoch))
                    .collect();
                if waiting.is_empty() {
                    self.cmd(Command::Collect { epoch });
                    self.state = State::Recovering {
                        epoch,
                        stage: Stage::Collecting,
                        faults,
                        max_step,
                    };
                } else if now > deadline {
                    let t = self.cfg.pause_timeout;
                    for r in waiting {
                        if self.view(r).alive && !self.killed.contains_key(&r) {
                            let seen = format!(
                                "did not pause within {t:?} for the recovery under epoch {epoch}"
                            );
                            self.note(
                                Level::Error,
                                Some(r),
                                format!(
                                    "rank {r} {seen}: killing it; it is restarted like a crash"
                                ),
                            );
                            self.killed.insert(r, (FaultKind::NoPause, seen));
                            self.cmd(Command::Kill { rank: r });
                        }
                    }
                    self.state = State::Recovering {
                        epoch,
                        stage: Stage::Pausing { deadline: now + t },
                        faults,
                        max_step,
                    };
                }
            }
            State::Recovering {
                epoch,
                stage: Stage::Resuming { s_star, deadline },
                faults,
                max_step,
            } => {
                let behind: Vec<usize> = self
                    .participants()
                    .into_iter()
                    .filter(|&r| {
                        let v = self.view(r);
                        !(v.alive && v.step > s_star && v.epoch == epoch)
                    })
                    .collect();
                if behind.is_empty() {
                    self.complete_recovery(now, s_star, faults, max_step);
                } else if now > deadline {
                    let t = self.cfg.pause_timeout * 2;
                    for r in behind {
                        if self.view(r).alive && !self.killed.contains_key(&r) {
                            let seen = format!(
                                "did not complete step {} under epoch {epoch} within {t:?}",
                                s_star + 1
                            );
                            self.note(
                                Level::Error,
                                Some(r),
                                format!(
                                    "rank {r} {seen}: killing it; it is restarted like a crash"
                                ),
                            );
                            self.killed.insert(r, (FaultKind::Hang, seen));
                            self.cmd(Command::Kill { rank: r });
                        }
                    }
                    self.state = State::Recovering {
                        epoch,
                        stage: Stage::Resuming {
                            s_star,
                            deadline: now + t,
                        },
                        faults,
                        max_step,
                    };
                }
            }
            State::Dumping {
                epoch,
                stage: Stage::Pausing { deadline },
                then,
                recover,
                max_step,
            } => {
                let waiting: Vec<usize> = self
                    .participants()
                    .into_iter()
                    .filter(|&r| self.view(r).alive && !self.paused(r, epoch))
                    .collect();
                if !waiting.is_empty() && now <= deadline {
                    return;
                }
                if !waiting.is_empty() {
                    self.note(
                        Level::Warn,
                        None,
                        format!("rank(s) {waiting:?} did not pause; writing from their verified snapshots anyway"),
                    );
                }
                self.cmd(Command::Collect { epoch });
                self.state = State::Dumping {
                    epoch,
                    stage: Stage::Collecting,
                    then,
                    recover,
                    max_step,
                };
            }
            _ => {}
        }
    }

    /// Ranks that finished while others still run and now wait for them
    /// (parked for a recovery nothing started): the clean exits were faults
    /// after all. Restarts and recovers those ranks; true if it did.
    pub(super) fn collected(&mut self, now: Duration, epoch: u64, steps: Vec<(usize, Vec<u64>)>) {
        let by_rank: HashMap<usize, Vec<u64>> = steps.into_iter().collect();
        self.settle_resumed(now, &by_rank);
        // The ranks leaving in a shrink count, through their replicas;
        // those joining in a grow have nothing yet.
        let joining = self.joining();
        let counted: Vec<usize> = self
            .ranks
            .iter()
            .copied()
            .filter(|r| !self.retired.contains(r) && !joining.contains(r))
            .collect();
        let per_rank: Vec<Vec<u64>> = counted
            .iter()
            .map(|r| by_rank.get(r).cloned().unwrap_or_default())
            .collect();
        let s_star = consistent_step(&per_rank);
        let listing = counted
            .iter()
            .zip(&per_rank)
            .map(|(r, s)| format!("rank {r}: {s:?}"))
            .collect::<Vec<_>>()
            .join(", ");
        match self.state.clone() {
            State::Recovering {
                epoch: e,
                stage: Stage::Collecting,
                faults,
                max_step,
            } if e == epoch => match s_star {
                None => {
                    let why = format!(
                        "no step has a sealed, verified snapshot on every rank ({listing}){}",
                        behind_hint(&counted, &per_rank)
                    );
                    self.note(Level::Error, None, format!("recovery failed: {why}"));
                    for &f in &faults {
                        self.faults[f].action =
                            format!("{}; recovery failed: {why}", self.faults[f].action);
                        self.faults[f].class = FaultAction::Stop;
                    }
                    // Nothing consistent exists to write either.
                    self.finish(Outcome::RecoveryFailed);
                }
                Some(s) => {
                    self.resume_all(epoch, s);
                    for &f in &faults {
                        self.faults[f].s_star = Some(s);
                    }
                    self.note(
                        Level::Info,
                        None,
                        format!("every rank paused: resuming from the consistent step s_star={s} under epoch {epoch} ({listing})"),
                    );
                    self.state = State::Recovering {
                        epoch,
                        stage: Stage::Resuming {
                            s_star: s,
                            deadline: now + self.cfg.pause_timeout * 2,
                        },
                        faults,
                        max_step,
                    };
                }
            },
            State::Dumping {
                epoch: e,
                stage: Stage::Collecting,
                then,
                recover,
                max_step,
            } if e == epoch => match s_star {
                None => {
                    let m = format!(
                        "no step has a verified snapshot on every rank ({listing}); nothing written, the previous checkpoint is untouched"
                    );
                    self.note(Level::Error, None, m.clone());
                    self.cmd(Command::DumpDone(Err(m.into())));
                    match then {
                        AfterDump::Stop(o) => self.finish(o),
                        AfterDump::Resume => self.finish(Outcome::RecoveryFailed),
                    }
                }
                Some(s) => {
                    self.cmd(Command::Write { epoch, step: s });
                    self.state = State::Dumping {
                        epoch,
                        stage: Stage::Writing { s_star: s },
                        then,
                        recover,
                        max_step,
                    };
                }
            },
            _ => self.note(
                Level::Info,
                None,
                format!("snapshots of epoch {epoch} collected after the machine moved on; ignored"),
            ),
        }
    }

    pub(super) fn written(
        &mut self,
        now: Duration,
        epoch: u64,
        result: Result<Written, WriteFailed>,
    ) {
        let State::Dumping {
            epoch: e,
            stage: Stage::Writing { s_star },
            then,
            recover,
            max_step,
        } = self.state.clone()
        else {
            self.note(
                Level::Info,
                None,
                "a checkpoint write finished after the machine moved on",
            );
            return;
        };
        if e != epoch {
            return;
        }
        match &result {
            Ok(w) if w.written => self.note(
                Level::Warn,
                None,
                format!(
                    "last-words checkpoint of iteration {} written to {} in {:.3} s; resume with --load {}",
                    w.iteration,
                    hatrain_shared::checkpoint::iter_dir(&w.dir, w.iteration).display(),
                    w.seconds,
                    w.dir.display()
                ),
            ),
            Ok(w) => self.note(
                Level::Warn,
                None,
                format!(
                    "iteration {} is already on disk (the newest consistent step is {s_star}); resume with --load {}",
                    w.iteration,
                    w.dir.display()
                ),
            ),
            Err(m) => self.note(Level::Error, None, format!("last-words checkpoint failed: {m}")),
        }
        self.cmd(Command::DumpDone(result.clone()));
        match then {
            AfterDump::Stop(o) => {
                self.last_words = result.ok();
                self.finish(o);
            }
            AfterDump::Resume if !recover.is_empty() => {
                self.state = State::Dumping {
                    epoch,
                    stage: Stage::Writing { s_star },
                    then,
                    recover: Vec::new(),
                    max_step,
                };
                self.begin_recovery(now, recover);
            }
            AfterDump::Resume => {
                self.resume_all(epoch, s_star);
                self.state = State::Recovering {
                    epoch,
                    stage: Stage::Resuming {
                        s_star,
                        deadline: now + self.cfg.pause_timeout * 2,
                    },
                    faults: Vec::new(),
                    max_step,
                };
            }
        }
    }

    pub(super) fn dump_requested(&mut self, now: Duration) {
        if !self.cfg.modes.dump {
            self.cmd(Command::DumpDone(Err(
                "the last-words dump needs --enable-high-availability (or HIGH_AVAILABILITY)"
                    .into(),
            )));
            return;
        }
        match self.state {
            State::Running => self.begin_dump(now, AfterDump::Resume, Vec::new()),
            State::Recovering { .. } => {
                self.dump_waiting = true;
                self.note(
                    Level::Info,
                    None,
                    "a checkpoint was asked for during a recovery: it follows the recovery",
                );
            }
            State::Dumping { .. } => {}
            State::Done(_) => self.cmd(Command::DumpDone(Err("the job is ending".into()))),
        }
    }

    pub(super) fn shutdown(&mut self, now: Duration) {
        match self.state {
            State::Done(_) => {}
            State::Dumping {
                then: AfterDump::Stop(_),
                ..
            } => self.note(
                Level::Warn,
                None,
                "still writing the last-words checkpoint; the agent stops once it is on disk",
            ),
            _ => {
                self.note(Level::Warn, None, "shutdown requested: stopping the job");
                self.stop_with(now, Outcome::Interrupted);
            }
        }
    }
}

/// Why no step is common, when some ranks' snapshots all come before every
/// other rank's oldest (a lost host's replica that fell behind): which
/// ranks, and what keeps more steps. Empty otherwise.
fn behind_hint(ranks: &[usize], steps: &[Vec<u64>]) -> String {
    let Some(oldest_common) = steps.iter().filter_map(|s| s.iter().min()).max() else {
        return String::new();
    };
    let behind: Vec<usize> = ranks
        .iter()
        .zip(steps)
        .filter(|(_, s)| s.iter().max().is_some_and(|m| m < oldest_common))
        .map(|(r, _)| *r)
        .collect();
    if behind.is_empty() {
        return String::new();
    }
    format!(
        "; the snapshots of rank(s) {behind:?} end before step {oldest_common}, the oldest the others keep: a replica that falls as many steps behind as there are snapshot slots, or more, cannot be recovered from (more --snapshot-slots keep more steps)"
    )
}
