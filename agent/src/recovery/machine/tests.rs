//! The machine driven by a simulated job: ranks that step in lockstep,
//! acknowledge directives, die, hang and restart, with a fake clock and no
//! processes. Each test runs in milliseconds.

use super::*;
use crate::recovery::OnDisk;
use std::collections::VecDeque;
use std::path::PathBuf;

mod elastic;
mod endings;
mod pauses;
mod stops;
mod unreported;

const TICK: Duration = Duration::from_millis(10);

/// One simulated rank: its process and its control page.
#[derive(Debug, Clone)]
struct SimRank {
    alive: bool,
    registered: bool,
    /// Acknowledges directives (a rank stuck somewhere does not).
    responsive: bool,
    /// Makes no progress at all (no step, no heartbeat), outside any
    /// collective.
    hung: bool,
    phase: Phase,
    step: u64,
    epoch: u64,
    heartbeat: u64,
    directive: Directive,
    acked: Option<Directive>,
    in_collective: bool,
    /// Verified snapshot steps.
    slots: Vec<u64>,
    /// Left the group (a shrink): the others train without it.
    gone: bool,
}

impl SimRank {
    fn fresh() -> Self {
        Self {
            alive: true,
            registered: true,
            responsive: true,
            hung: false,
            phase: Phase::Computing,
            step: 0,
            epoch: 0,
            heartbeat: 0,
            directive: Directive::None,
            gone: false,
            acked: None,
            in_collective: false,
            slots: vec![0],
        }
    }
}

struct Sim {
    m: Machine,
    now: Duration,
    ranks: Vec<SimRank>,
    queue: VecDeque<Event>,
    commands: Vec<Command>,
    notes: Vec<Note>,
    dumps: Vec<Result<Written, WriteFailed>>,
    outcome: Option<Outcome>,
    /// Respawned ranks register on the next tick.
    registering: Vec<usize>,
    /// A write finishes this many ticks after it is asked for.
    write_ticks: u32,
    writing: Option<(u64, u64, u32)>,
}

fn config() -> MachineConfig {
    MachineConfig {
        modes: HaModes {
            dump: true,
            retry: true,
            recover: true,
            elastic: false,
        },
        restart: RestartPolicy::default(),
        hang: HangPolicy {
            floor: Duration::from_millis(200),
            startup_grace: Duration::from_secs(5),
            ..HangPolicy::default()
        },
        pause_timeout: Duration::from_secs(1),
        group_restarts: 0,
        register_timeout: Duration::from_secs(3),
        min_nodes: 1,
    }
}

impl Sim {
    fn new(n: usize) -> Self {
        Self::with(n, config())
    }

    fn with(n: usize, cfg: MachineConfig) -> Self {
        let mut sim = Self {
            m: Machine::new(cfg, (0..n).collect(), 1_000.0),
            now: Duration::ZERO,
            ranks: vec![SimRank::fresh(); n],
            queue: VecDeque::new(),
            commands: Vec::new(),
            notes: Vec::new(),
            dumps: Vec::new(),
            outcome: None,
            registering: Vec::new(),
            write_ticks: 3,
            writing: None,
        };
        for r in 0..n {
            sim.feed(Event::Registered {
                rank: r,
                checkpoint: true,
                global_batch: None,
            });
        }
        sim
    }

    fn views(&self) -> Vec<RankView> {
        self.ranks
            .iter()
            .enumerate()
            .map(|(rank, r)| RankView {
                rank,
                alive: r.alive,
                registered: r.registered,
                phase: r.phase,
                step: r.step,
                epoch: r.epoch,
                heartbeat: r.heartbeat,
                in_collective: r.in_collective,
                acked: r.acked,
                times: Default::default(),
                final_sealed: (!r.alive).then(|| r.slots.iter().max().copied()).flatten(),
            })
            .collect()
    }

    fn feed(&mut self, e: Event) {
        let step = self.m.step(self.now, e);
        self.notes.extend(step.notes);
        for c in step.commands {
            self.apply(c.clone());
            self.commands.push(c);
        }
    }

    fn apply(&mut self, c: Command) {
        match c {
            Command::Post { rank, directive } => {
                let r = &mut self.ranks[rank];
                r.directive = directive;
                r.acked = None;
            }
            Command::Kill { rank } => {
                if self.ranks[rank].alive {
                    self.ranks[rank].alive = false;
                    self.queue.push_back(Event::Exited {
                        rank,
                        status: ExitStatus::Signaled(9),
                        cause: ExitCause::Status,
                    });
                }
            }
            Command::Respawn { rank, .. } => {
                let old = self.ranks[rank].clone();
                self.ranks[rank] = SimRank {
                    registered: false,
                    phase: Phase::Starting,
                    step: 0,
                    slots: old.slots,
                    directive: old.directive,
                    ..SimRank::fresh()
                };
                self.registering.push(rank);
            }
            Command::Donate { .. } => {}
            Command::Collect { epoch } => self.queue.push_back(Event::Collected {
                epoch,
                steps: self
                    .ranks
                    .iter()
                    .enumerate()
                    .map(|(r, s)| (r, s.slots.clone()))
                    .collect(),
            }),
            Command::Write { epoch, step } => self.writing = Some((epoch, step, self.write_ticks)),
            Command::DumpDone(r) => self.dumps.push(r),
            Command::RestartGroup { .. } => {
                for r in self.ranks.iter_mut() {
                    *r = SimRank {
                        registered: false,
                        phase: Phase::Starting,
                        ..SimRank::fresh()
                    };
                }
            }
            Command::Finish(o) => self.outcome = Some(o),
        }
    }

    /// Crashes `rank` now (as SIGKILL from outside would).
    fn crash(&mut self, rank: usize) {
        self.killed_by(rank, ExitCause::Status);
    }

    /// `rank` dies of SIGKILL now, for `cause` as far as the agent can tell.
    fn killed_by(&mut self, rank: usize, cause: ExitCause) {
        self.ranks[rank].alive = false;
        let views = self.views();
        self.feed(Event::Tick(views));
        self.feed(Event::Exited {
            rank,
            status: ExitStatus::Signaled(9),
            cause,
        });
    }

    /// One tick of simulated time: ranks act on their directives, train in
    /// lockstep when all can, and the machine sees them.
    fn tick(&mut self) {
        self.now += TICK;
        for rank in std::mem::take(&mut self.registering) {
            self.ranks[rank].registered = true;
            self.feed(Event::Registered {
                rank,
                checkpoint: true,
                global_batch: None,
            });
        }
        for (rank, r) in self
            .ranks
            .iter_mut()
            .enumerate()
            .filter(|(_, r)| r.alive && r.registered && r.responsive)
        {
            match r.directive {
                Directive::Stop => {
                    // The rank leaves its loop and exits 0.
                    r.alive = false;
                    r.gone = true;
                    self.queue.push_back(Event::Exited {
                        rank,
                        status: ExitStatus::Exited(0),
                        cause: ExitCause::Status,
                    });
                }
                Directive::Pause { .. } if r.acked != Some(r.directive) => {
                    r.acked = Some(r.directive);
                    r.phase = Phase::Paused;
                    r.in_collective = false;
                }
                Directive::Resume { epoch, step } | Directive::Reshape { epoch, step, .. }
                    if r.acked != Some(r.directive) =>
                {
                    r.acked = Some(r.directive);
                    r.epoch = epoch;
                    r.step = step;
                    r.slots.retain(|s| *s <= step);
                    r.phase = Phase::Computing;
                }
                _ => {}
            }
            if r.phase == Phase::Paused {
                r.heartbeat += 1;
            }
        }
        // Lockstep: a step completes only when every rank can take it.
        let can = |r: &SimRank| r.alive && r.registered && !r.hung && r.phase == Phase::Computing;
        let all = self.ranks.iter().filter(|r| !r.gone).all(can);
        for r in self.ranks.iter_mut() {
            if !can(r) {
                continue;
            }
            if all {
                r.step += 1;
                r.heartbeat += 1;
                r.in_collective = false;
                r.slots.insert(0, r.step);
                r.slots.truncate(2);
            } else {
                r.in_collective = true;
            }
        }
        if let Some((epoch, step, left)) = self.writing.take() {
            if left == 0 {
                self.queue.push_back(Event::Written {
                    epoch,
                    result: Ok(Written {
                        iteration: step,
                        dir: PathBuf::from("/ckpt"),
                        written: true,
                        seconds: 0.01,
                    }),
                });
            } else {
                self.writing = Some((epoch, step, left - 1));
            }
        }
        let views = self.views();
        self.feed(Event::Tick(views));
        while let Some(e) = self.queue.pop_front() {
            if let Event::Exited { .. } = e {
                let views = self.views();
                self.feed(Event::Tick(views));
            }
            self.feed(e);
        }
    }

    fn run(&mut self, ticks: usize) {
        for _ in 0..ticks {
            self.tick();
        }
    }

    fn run_until(&mut self, what: &str, limit: usize, mut done: impl FnMut(&Self) -> bool) {
        for _ in 0..limit {
            if done(self) {
                return;
            }
            self.tick();
        }
        panic!(
            "{what} did not happen within {limit} ticks; state {}; notes {:#?}",
            self.m.activity(),
            self.notes
        );
    }

    fn steps(&self) -> Vec<u64> {
        self.ranks.iter().map(|r| r.step).collect()
    }

    fn posted(&self, pred: impl Fn(&Directive) -> bool) -> usize {
        self.commands
            .iter()
            .filter(|c| matches!(c, Command::Post { directive, .. } if pred(directive)))
            .count()
    }

    fn kinds(&self) -> Vec<FaultKind> {
        self.m.faults().iter().map(|f| f.kind).collect()
    }
}

#[test]
fn a_crash_is_restarted_and_every_rank_returns_to_s_star() {
    let mut sim = Sim::new(3);
    sim.run(10);
    assert_eq!(sim.steps(), vec![10, 10, 10]);
    sim.crash(1);
    assert!(sim.commands.contains(&Command::Respawn {
        rank: 1,
        restarts: 1
    }));
    assert_eq!(sim.m.start_mode(), StartMode::AwaitDirective);
    sim.run_until("recovery", 200, |s| !s.m.recovering());
    let f = &sim.m.faults()[0];
    assert_eq!(
        (f.kind, f.ranks.clone(), f.s_star),
        (FaultKind::Crash, vec![1], Some(10))
    );
    assert_eq!(f.steps_lost, Some(0));
    assert!(f.recovery_s.is_some() && f.action.contains("restart rank 1 in place"));
    assert_eq!(f.class, FaultAction::Reboot);
    assert_eq!(
        sim.posted(|d| *d == Directive::Resume { epoch: 1, step: 10 }),
        3
    );
    sim.run(5);
    assert!(sim.steps().iter().all(|s| *s > 11), "{:?}", sim.steps());
    assert_eq!(sim.m.start_mode(), StartMode::Fresh { epoch: 1 });
}

/// A machine that took the job over (a successor, or the next agent of a
/// served job) is driven on the job's clock, so a fault it records is
/// dated when it was seen, and one the old controller left unfinished is
/// timed from its own detection.
#[test]
fn a_successor_dates_and_times_faults_on_the_jobs_clock() {
    let mut sim = Sim::new(3);
    sim.now = Duration::from_secs(500);
    sim.run(10);
    sim.crash(1);
    let mirror = Inherited {
        started_unix_s: 1_000.0,
        epoch: sim.m.epoch(),
        faults: sim.m.faults().to_vec(),
        protected: (0..3).collect(),
        ..Inherited::default()
    };
    let detected = mirror.faults[0].detected_unix_s;
    assert!(
        (detected - 1_500.1).abs() < 1e-6,
        "seen 500 s and 10 ticks into the job: {detected}"
    );
    let mut next = Sim::new(3);
    next.m = Machine::take_over(config(), (0..3).collect(), mirror);
    next.now = Duration::from_secs(700);
    // The old controller's agent died during the recovery: its successor
    // starts it again.
    next.feed(Event::Interrupted);
    next.run_until("the recovery", 400, |s| {
        s.m.faults().first().is_some_and(|f| f.recovery_s.is_some())
    });
    let first = &next.m.faults()[0];
    let timed = first.recovery_s.unwrap();
    assert!(
        (199.9..201.0).contains(&timed),
        "timed from its detection, not the job's start: {timed}"
    );
    next.crash(2);
    let second = next.m.faults().last().unwrap();
    assert!(
        second.detected_unix_s >= 1_700.0 && second.detected_unix_s < 1_710.0,
        "dated on the job's clock: {}",
        second.detected_unix_s
    );
}

#[test]
fn a_second_fault_mid_recovery_opens_another_epoch() {
    let mut sim = Sim::new(4);
    sim.run(8);
    sim.crash(1);
    // Rank 1's replacement is still starting when rank 3 dies too.
    assert!(sim.m.recovering());
    sim.crash(3);
    assert_eq!(sim.m.epoch(), 2);
    sim.run_until("recovery", 200, |s| !s.m.recovering());
    assert_eq!(
        sim.posted(|d| matches!(d, Directive::Resume { epoch: 1, .. })),
        0
    );
    assert_eq!(
        sim.posted(|d| *d == Directive::Resume { epoch: 2, step: 8 }),
        4
    );
    let faults = sim.m.faults();
    assert_eq!(faults.len(), 2);
    assert!(
        faults
            .iter()
            .all(|f| f.s_star == Some(8) && f.recovery_s.is_some())
    );
}

#[test]
fn a_rank_that_never_pauses_is_killed_restarted_and_the_recovery_completes() {
    let mut sim = Sim::new(3);
    sim.run(6);
    sim.ranks[2].responsive = false;
    sim.crash(0);
    sim.run_until("the unresponsive rank killed", 200, |s| {
        s.commands.contains(&Command::Kill { rank: 2 })
    });
    assert!(sim.outcome.is_none(), "it is not a reason to end the job");
    sim.run_until("recovery", 300, |s| !s.m.recovering());
    assert_eq!(sim.kinds(), vec![FaultKind::Crash, FaultKind::NoPause]);
    let no_pause = &sim.m.faults()[1];
    assert!(
        no_pause.detail.contains("did not pause within"),
        "{no_pause:?}"
    );
    assert!(sim.commands.contains(&Command::Respawn {
        rank: 2,
        restarts: 1
    }));
    assert!(sim.m.faults().iter().all(|f| f.recovery_s.is_some()));
    sim.run(3);
    assert!(sim.steps().iter().all(|s| *s > 6));
}

#[test]
fn no_common_step_ends_the_job_with_the_reason() {
    let mut sim = Sim::new(2);
    sim.run(5);
    sim.ranks[0].slots = vec![3, 2];
    sim.ranks[1].slots = vec![5, 4];
    sim.crash(1);
    sim.run_until("the end", 200, |s| s.outcome.is_some());
    assert_eq!(sim.outcome, Some(Outcome::RecoveryFailed));
    let f = &sim.m.faults()[0];
    assert!(
        f.action
            .contains("no step has a sealed, verified snapshot on every rank"),
        "{f:?}"
    );
    assert!(f.action.contains("rank 0: [3, 2], rank 1: [5, 4]"), "{f:?}");
    assert!(
        f.action
            .contains("the snapshots of rank(s) [0] end before step 4"),
        "{f:?}"
    );
}

#[test]
fn a_dump_during_a_recovery_follows_it_and_training_goes_on() {
    let mut sim = Sim::new(3);
    sim.run(7);
    sim.crash(2);
    sim.feed(Event::DumpRequested);
    assert!(
        !sim.commands
            .iter()
            .any(|c| matches!(c, Command::Write { .. }))
    );
    sim.run_until("the dump", 300, |s| !s.dumps.is_empty());
    // The recovery completed first, under epoch 1 (every rank completed
    // step 8 from s* = 7); then the dump paused them again.
    let w = sim.dumps[0].clone().unwrap();
    assert_eq!(w.iteration, 8);
    assert_eq!(sim.m.faults()[0].s_star, Some(7));
    assert!(sim.m.faults()[0].recovery_s.is_some());
    assert!(sim.commands.contains(&Command::Write { epoch: 2, step: 8 }));
    sim.run_until("training again", 200, |s| !s.m.recovering());
    sim.run(3);
    assert!(sim.steps().iter().all(|s| *s > 8), "{:?}", sim.steps());
    assert_eq!(sim.outcome, None);
}

#[test]
fn an_exit_during_a_dump_is_recovered_after_it() {
    let mut sim = Sim::new(3);
    sim.write_ticks = 20;
    sim.run(9);
    sim.feed(Event::DumpRequested);
    sim.run_until("the write", 100, |s| s.writing.is_some());
    sim.crash(0);
    // Restarted at once; recovered only once the checkpoint is on disk.
    assert!(sim.commands.contains(&Command::Respawn {
        rank: 0,
        restarts: 1
    }));
    assert_eq!(sim.m.epoch(), 1);
    sim.run_until("the dump", 100, |s| !s.dumps.is_empty());
    assert_eq!(sim.dumps[0].as_ref().unwrap().iteration, 9);
    sim.run_until("the recovery", 300, |s| !s.m.recovering());
    let f = &sim.m.faults()[0];
    assert_eq!((f.kind, f.s_star), (FaultKind::Crash, Some(9)));
    assert!(f.recovery_s.is_some());
    assert_eq!(sim.m.epoch(), 2);
    sim.run(3);
    assert!(sim.steps().iter().all(|s| *s > 10), "{:?}", sim.steps());
}

#[test]
fn shutdown_writes_the_last_words_then_stops() {
    let mut sim = Sim::new(2);
    sim.run(12);
    sim.feed(Event::Shutdown);
    sim.run_until("the end", 100, |s| s.outcome.is_some());
    assert_eq!(sim.outcome, Some(Outcome::Interrupted));
    assert_eq!(sim.m.last_words().map(|w| w.iteration), Some(12));
    // A second signal while writing is said, not lost.
    let mut sim = Sim::new(2);
    sim.write_ticks = 10;
    sim.run(4);
    sim.feed(Event::Shutdown);
    sim.run_until("the write", 100, |s| s.writing.is_some());
    sim.feed(Event::Shutdown);
    assert!(
        sim.notes
            .iter()
            .any(|n| n.text.contains("still writing the last-words"))
    );
    sim.run_until("the end", 100, |s| s.outcome.is_some());
    assert_eq!(sim.m.last_words().map(|w| w.iteration), Some(4));
}

#[test]
fn a_clean_exit_ahead_of_the_peers_is_a_fault_and_the_last_one_is_the_end() {
    let mut sim = Sim::new(2);
    sim.run(10);
    // Rank 1 finishes its loop at step 11 while rank 0 is at 10; rank 0's
    // collective with it then fails and it waits for a recovery.
    sim.ranks[1].step = 11;
    sim.ranks[1].phase = Phase::Finished;
    sim.ranks[1].alive = false;
    let views = sim.views();
    sim.feed(Event::Tick(views));
    sim.feed(Event::Exited {
        rank: 1,
        status: ExitStatus::Exited(0),
        cause: ExitCause::Status,
    });
    assert!(sim.kinds().is_empty(), "believed at first");
    sim.ranks[0].phase = Phase::Paused;
    sim.tick();
    assert_eq!(sim.kinds(), vec![FaultKind::EarlyExit]);
    assert!(
        sim.m.faults()[0]
            .detail
            .contains("rank 0 waits for it at step 10")
    );
    assert!(sim.commands.contains(&Command::Respawn {
        rank: 1,
        restarts: 1
    }));
    sim.run_until("recovery", 200, |s| !s.m.recovering());
    // Now both finish at the same step: the end, with success.
    for r in [0, 1] {
        sim.ranks[r].phase = Phase::Finished;
        sim.ranks[r].alive = false;
        let views = sim.views();
        sim.feed(Event::Tick(views));
        sim.feed(Event::Exited {
            rank: r,
            status: ExitStatus::Exited(0),
            cause: ExitCause::Status,
        });
    }
    assert_eq!(sim.outcome, Some(Outcome::Succeeded));
    // Without worker reboot, the early exit stops the job (after the dump).
    let mut cfg = config();
    cfg.modes.recover = false;
    let mut sim = Sim::with(2, cfg);
    sim.run(5);
    // It leaves its loop without finishing it.
    sim.ranks[0].alive = false;
    let views = sim.views();
    sim.feed(Event::Tick(views));
    sim.feed(Event::Exited {
        rank: 0,
        status: ExitStatus::Exited(0),
        cause: ExitCause::Status,
    });
    sim.run_until("the end", 100, |s| s.outcome.is_some());
    assert_eq!(sim.outcome, Some(Outcome::RecoveryFailed));
}

#[test]
fn a_hung_rank_is_killed_and_its_waiting_peers_are_not() {
    let mut sim = Sim::new(3);
    sim.run(30);
    sim.ranks[1].hung = true;
    sim.run_until("the kill", 500, |s| {
        s.commands.iter().any(|c| matches!(c, Command::Kill { .. }))
    });
    let kills: Vec<&Command> = sim
        .commands
        .iter()
        .filter(|c| matches!(c, Command::Kill { .. }))
        .collect();
    assert_eq!(kills, vec![&Command::Kill { rank: 1 }]);
    sim.run_until("recovery", 300, |s| {
        !s.m.recovering() && !s.m.faults().is_empty()
    });
    assert_eq!(sim.kinds(), vec![FaultKind::Hang]);
    assert!(
        sim.m.faults()[0].detail.contains("no progress"),
        "{:?}",
        sim.m.faults()
    );
}

#[test]
fn a_repairable_uce_recovers_without_a_restart() {
    let mut sim = Sim::new(2);
    sim.run(5);
    sim.feed(Event::Uce {
        rank: 0,
        part: "exp_avg".into(),
        offset: 4096,
    });
    assert!(
        !sim.commands
            .iter()
            .any(|c| matches!(c, Command::Respawn { .. } | Command::Kill { .. }))
    );
    sim.run_until("recovery", 200, |s| !s.m.recovering());
    let f = &sim.m.faults()[0];
    assert_eq!((f.kind, f.s_star), (FaultKind::Uce, Some(5)));
    assert!(f.detail.contains("exp_avg at byte 4096"));
}

#[test]
fn restart_limits_still_end_the_job_with_last_words() {
    let mut cfg = config();
    cfg.restart.max_restarts = 1;
    let mut sim = Sim::with(2, cfg);
    sim.run(5);
    sim.crash(1);
    sim.run_until("recovery", 200, |s| !s.m.recovering());
    sim.run(3);
    sim.crash(1);
    sim.run_until("the end", 200, |s| s.outcome.is_some());
    assert_eq!(
        sim.outcome,
        Some(Outcome::WorkerFailed {
            rank: 1,
            status: ExitStatus::Signaled(9)
        })
    );
    assert!(sim.m.faults()[1].reason.contains("--max-restarts"));
    assert!(sim.m.last_words().is_some());
}

#[test]
fn a_rebuild_that_keeps_failing_is_retried_under_new_epochs_then_stops_naming_the_ranks() {
    let mut sim = Sim::new(4);
    sim.run(6);
    sim.crash(1);
    // No communicator can be built: no rank gets past s*.
    for r in &mut sim.ranks {
        r.hung = true;
    }
    let mut epochs = Vec::new();
    for _ in 0..MAX_REBUILDS {
        sim.run_until("resuming", 200, |s| s.m.activity().contains("resuming"));
        let epoch = sim.m.epoch();
        epochs.push(epoch);
        sim.feed(Event::RebuildFailed {
            rank: 2,
            epoch,
            peer: Some(3),
        });
        // A second report of the same epoch changes nothing.
        sim.feed(Event::RebuildFailed {
            rank: 0,
            epoch,
            peer: None,
        });
    }
    sim.run_until("the end", 200, |s| s.outcome.is_some());
    assert_eq!(sim.outcome, Some(Outcome::RecoveryFailed));
    assert!(
        sim.m.last_words().is_some(),
        "the last words are written first"
    );
    let f = sim.m.faults().last().unwrap();
    assert_eq!(f.kind, FaultKind::Rebuild);
    for e in &epochs {
        assert!(
            f.reason
                .contains(&format!("epoch {e}: rank 2 could not reach rank 3")),
            "{}",
            f.reason
        );
    }
    assert_eq!(
        epochs.windows(2).filter(|w| w[1] > w[0]).count(),
        MAX_REBUILDS - 1
    );
}

#[test]
fn an_oom_kill_is_restarted_once_then_the_job_writes_its_last_words_and_stops() {
    let mut sim = Sim::new(3);
    sim.run(6);
    sim.killed_by(2, ExitCause::OutOfMemory);
    sim.run_until("recovery", 200, |s| !s.m.recovering());
    let f = &sim.m.faults()[0];
    assert_eq!(f.kind, FaultKind::Oom);
    assert!(
        f.detail.contains("OOM killer") && f.action.contains("restart rank 2 in place"),
        "{f:?}"
    );
    sim.run(4);
    // Another rank this time: the limit is the job's, not the rank's.
    sim.killed_by(0, ExitCause::OutOfMemory);
    sim.run_until("the end", 300, |s| s.outcome.is_some());
    assert_eq!(
        sim.outcome,
        Some(Outcome::WorkerFailed {
            rank: 0,
            status: ExitStatus::Signaled(9)
        })
    );
    assert_eq!(sim.kinds(), vec![FaultKind::Oom, FaultKind::Oom]);
    let last = &sim.m.faults()[1];
    assert!(
        last.reason.contains("would meet the same end")
            && last.action == "stop the job"
            && last.class == FaultAction::Stop,
        "{last:?}"
    );
    assert!(
        sim.m.last_words().is_some(),
        "the last words are written before the stop"
    );
    assert!(!sim.commands.contains(&Command::Respawn {
        rank: 0,
        restarts: 1
    }));
}
