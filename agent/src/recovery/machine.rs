//! The recovery machine: every decision of a job, as a state machine with
//! no I/O and no clock.
//!
//! ```text
//!            fault (exit, hang, UCE)                 dump asked / last words
//!  Running ──────────────────────────► Recovering    Running ───────────► Dumping
//!     ▲        Pausing ─► Collecting ─► Resuming       Pausing ─► Collecting ─► Writing
//!     └──────────── every rank completed s*+1 ◄─┘        │ then resume: ─► Recovering(Resuming)
//!                                                        └ then stop:   ─► Done(outcome)
//! ```
//!
//! - A recovery opens a new epoch and posts `Pause` to every rank; once all
//!   have acknowledged it, their snapshots are collected, s\* is chosen and
//!   `Resume { epoch, s* }` posted; it is complete when every rank has
//!   completed step s\*+1 under the new epoch. A fault during a recovery
//!   opens another epoch and pauses again.
//! - INVARIANT: a rank that does not pause within the pause timeout, or does
//!   not complete s\*+1 within twice that, is killed and handled as a crash
//!   of the same recovery; it never ends the job by itself (the restart
//!   limits still do).
//! - A dump pauses every rank, collects, and has the newest consistent step
//!   written (by the event loop, off the loop's thread); then training goes
//!   on from it (`agentctl dump`) or the job ends (last words: SIGTERM, or
//!   a fault nothing can repair, with the dump mode on). A dump asked for
//!   during a recovery follows it; an exit during a dump is recorded, and
//!   the rank is restarted and recovered after the dump.
//! - A clean exit is the end only when the rank said it finished and no
//!   rank that still runs is behind it ([`super::policy::early_exit`]).
//!
//! Time is the `now` the caller passes (time since the job started).

use super::consistent::consistent_step;
use super::policy::{
    ExitDecision, RankHistory, RestartPolicy, UceAction, early_exit, left_waiting, on_failure,
    out_of_memory_again, uce_action,
};
use super::watchdog::{HangPolicy, Watch};
use super::{
    Command, Event, ExitCause, HostLoss, Level, Note, Outcome, RankView, WriteFailed, Written,
};
use crate::reaper::ExitStatus;
pub use elastic::Reshaping;
use hatrain_shared::control::{
    FaultAction, FaultKind, FaultRecord, ResizeRecord as Resize, StartMode,
};
use hatrain_shared::ha::HaModes;
use hatrain_shared::shm::{Directive, Phase};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Duration;

/// Epochs a recovery tries to rebuild the communicators under before the
/// job stops.
pub const MAX_REBUILDS: usize = 3;

/// Restarts after an out-of-memory kill, over the whole job: a restart at
/// the same size usually meets the same end, so the second one stops the
/// job (with its last words).
pub const MAX_OOM_RESTARTS: u32 = 1;

/// What the machine decides by.
#[derive(Debug, Clone, PartialEq)]
pub struct MachineConfig {
    pub modes: HaModes,
    pub restart: RestartPolicy,
    pub hang: HangPolicy,
    /// How long every rank has to pause (and, doubled, to complete the
    /// first step after resuming).
    pub pause_timeout: Duration,
    /// Times the whole group may be restarted when a failure cannot be
    /// repaired in place (torchrun's `--max-restarts`).
    pub group_restarts: u32,
    /// How long a worker may run without registering before the machine
    /// says it is not protected (with any mode on).
    pub register_timeout: Duration,
    /// Elastic training shrinks the group only while at least this many
    /// hosts hold ranks (`--min-nodes`).
    pub min_nodes: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AfterDump {
    Resume,
    Stop(Outcome),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Pausing { deadline: Duration },
    Collecting,
    Resuming { s_star: u64, deadline: Duration },
    Writing { s_star: u64 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Running,
    Recovering {
        epoch: u64,
        stage: Stage,
        /// The faults this recovery repairs (indices into the history).
        faults: Vec<usize>,
        /// The newest step any rank had completed at the first fault.
        max_step: u64,
    },
    Dumping {
        epoch: u64,
        stage: Stage,
        then: AfterDump,
        /// Faults that happened during the dump: recovered after it.
        recover: Vec<usize>,
        max_step: u64,
    },
    Done(Outcome),
}

/// What a machine taking over a job inherits from the controller before
/// it ([`Machine::take_over`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Inherited {
    pub started_unix_s: f64,
    pub epoch: u64,
    pub faults: Vec<FaultRecord>,
    pub restarts: BTreeMap<usize, u32>,
    pub protected: BTreeSet<usize>,
    pub checkpoint: bool,
    pub last_words: Option<Written>,
    pub group_restarts: u32,
    /// Ranks that left the group (elastic training), its resizes, and
    /// each rank's place after them.
    pub retired: BTreeSet<usize>,
    pub resizes: Vec<Resize>,
    pub places: BTreeMap<usize, (u64, u64)>,
    /// The resize the old controller had under way: it goes on.
    pub reshape: Option<Reshaping>,
    /// The global batch the group's size divides.
    pub global_batch: Option<u64>,
}

/// What one [`Machine::step`] decided.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Step {
    pub commands: Vec<Command>,
    pub notes: Vec<Note>,
}

/// The recovery machine of one job.
#[derive(Debug)]
pub struct Machine {
    cfg: MachineConfig,
    ranks: Vec<usize>,
    started_unix_s: f64,
    epoch: u64,
    state: State,
    views: BTreeMap<usize, RankView>,
    history: HashMap<usize, RankHistory>,
    last_status: HashMap<usize, ExitStatus>,
    faults: Vec<FaultRecord>,
    detected: Vec<Duration>,
    /// Ranks the machine had killed, with the fault kind and what was seen,
    /// until their exit comes.
    killed: HashMap<usize, (FaultKind, String)>,
    /// Ranks that finished training (a clean exit that was the end), and
    /// the step each finished at.
    finished: BTreeSet<usize>,
    finished_at: HashMap<usize, u64>,
    /// Some rank registered a checkpoint layout, so a dump can be written.
    checkpoint: bool,
    /// An `agentctl dump` waits for the recovery in progress.
    dump_waiting: bool,
    /// Epochs whose communicator could not be built in the recovery in
    /// progress, with who could not reach whom.
    rebuilds: Vec<(u64, usize, Option<u64>)>,
    watch: Watch,
    last_words: Option<Written>,
    /// Restarts of ranks the OOM killer killed.
    oom_restarts: u32,
    /// Ranks that registered with the runtime since the group (re)started:
    /// only these can be rebooted in place and restored.
    protected: BTreeSet<usize>,
    /// When each rank's current process started.
    spawned: HashMap<usize, Duration>,
    /// Ranks whose current process's exit the machine took.
    exits: BTreeSet<usize>,
    /// Registered ranks seen dead whose exit never came, since when.
    unreported: HashMap<usize, Duration>,
    /// Ranks already warned about running unprotected.
    warned: BTreeSet<usize>,
    /// Group restarts so far.
    group_restarts: u32,
    /// A resize in progress, and the ranks that left the group.
    reshape: Option<elastic::Reshaping>,
    retired: BTreeSet<usize>,
    resizes: Vec<Resize>,
    /// Each rank's place after the last resize (none before one).
    places: BTreeMap<usize, (u64, u64)>,
    /// The global batch the ranks registered: a resize keeps the group's
    /// size a divisor of it.
    global_batch: Option<u64>,
    out: Step,
}

impl Machine {
    /// A machine for a job of `ranks` that started at `started_unix_s`.
    pub fn new(cfg: MachineConfig, ranks: Vec<usize>, started_unix_s: f64) -> Self {
        Self {
            views: ranks.iter().map(|&r| (r, RankView::absent(r))).collect(),
            cfg,
            ranks,
            started_unix_s,
            epoch: 0,
            state: State::Running,
            history: HashMap::new(),
            last_status: HashMap::new(),
            faults: Vec::new(),
            detected: Vec::new(),
            killed: HashMap::new(),
            finished: BTreeSet::new(),
            finished_at: HashMap::new(),
            checkpoint: false,
            dump_waiting: false,
            rebuilds: Vec::new(),
            watch: Watch::default(),
            last_words: None,
            oom_restarts: 0,
            protected: BTreeSet::new(),
            spawned: HashMap::new(),
            exits: BTreeSet::new(),
            unreported: HashMap::new(),
            warned: BTreeSet::new(),
            group_restarts: 0,
            reshape: None,
            retired: BTreeSet::new(),
            resizes: Vec::new(),
            places: BTreeMap::new(),
            global_batch: None,
            out: Step::default(),
        }
    }

    /// A machine that takes over the job from a controller that is gone,
    /// from what it had told the others (`from`): the epoch (the next
    /// recovery takes a newer one than any the old controller could have
    /// started), the faults, the restarts, which ranks registered. Ranks
    /// are seen through the reports that come next.
    pub fn take_over(cfg: MachineConfig, ranks: Vec<usize>, from: Inherited) -> Self {
        let mut m = Self::new(cfg, ranks, from.started_unix_s);
        m.epoch = from.epoch + 1;
        // Each fault's detection on the job's clock (which starts at
        // `started_unix_s`, whichever agent reads it): a recovery the old
        // controller left unfinished is timed from its detection.
        m.detected = from
            .faults
            .iter()
            .map(|f| Duration::from_secs_f64((f.detected_unix_s - from.started_unix_s).max(0.0)))
            .collect();
        m.faults = from.faults;
        for (rank, restarts) in from.restarts {
            m.history.entry(rank).or_default().restarts = restarts;
        }
        for &r in &from.protected {
            if let Some(v) = m.views.get_mut(&r) {
                v.registered = true;
                v.alive = true;
            }
        }
        m.protected = from.protected;
        m.checkpoint = from.checkpoint;
        m.last_words = from.last_words;
        m.group_restarts = from.group_restarts;
        m.ranks.retain(|r| !from.retired.contains(r));
        for r in &from.retired {
            m.views.remove(r);
        }
        m.retired = from.retired;
        m.resizes = from.resizes;
        m.places = from.places;
        m.global_batch = from.global_batch;
        // The ranks a resize under way takes out are gone with their
        // host: none of their exits is coming.
        if let Some(r) = &from.reshape {
            m.exits.extend(&r.leaving);
            let known = r.fault.is_none_or(|f| f < m.faults.len());
            m.reshape = from.reshape.filter(|_| known);
        }
        m
    }

    /// When the job started (seconds since the Unix epoch).
    pub fn started_unix_s(&self) -> f64 {
        self.started_unix_s
    }

    /// The global batch the ranks registered, which the group's size
    /// divides.
    pub fn global_batch(&self) -> Option<u64> {
        self.global_batch
    }

    /// Whether some rank registered a checkpoint layout.
    pub fn checkpoint(&self) -> bool {
        self.checkpoint
    }

    /// Advances the machine by one event; returns what to do and why.
    /// `now` is the job's clock: the time since [`Machine::started_unix_s`],
    /// also on an agent that took the job over.
    pub fn step(&mut self, now: Duration, event: Event) -> Step {
        match event {
            Event::Tick(views) => self.tick(now, views),
            Event::Exited {
                rank,
                status,
                cause,
            } => self.exited(now, rank, status, cause),
            Event::Unfit { rank, reason } => self.unfit(now, rank, reason),
            Event::Registered {
                rank,
                checkpoint,
                global_batch,
            } => {
                self.registered(rank, checkpoint, global_batch);
                self.maybe_reshape(now);
            }
            Event::Uce { rank, part, offset } => self.uce(now, rank, &part, offset),
            Event::SpawnFailed { rank, error } => self.spawn_failed(now, rank, &error),
            Event::DeviceFault { rank, kind, detail } => self.device_fault(now, rank, kind, detail),
            Event::Slow { rank, detail } => self.slow(rank, detail),
            Event::RebuildFailed { rank, epoch, peer } => {
                self.rebuild_failed(now, rank, epoch, peer)
            }
            Event::Collected { epoch, steps } => self.collected(now, epoch, steps),
            Event::Written { epoch, result } => self.written(now, epoch, result),
            Event::HostLost(loss) => self.host_lost(now, loss),
            Event::DumpRequested => self.dump_requested(now),
            Event::Shutdown => self.shutdown(now),
            Event::Interrupted => {
                // The faults the previous agent had not recovered from yet.
                let open: Vec<usize> = (0..self.faults.len())
                    .filter(|&i| {
                        self.faults[i].recovery_s.is_none()
                            && self.faults[i].class != FaultAction::Stop
                    })
                    .collect();
                self.note(
                    Level::Warn,
                    None,
                    "the previous agent died during a recovery: it starts again",
                );
                self.begin_recovery(now, open);
            }
            Event::Unled { reason } => {
                self.note(Level::Error, None, &reason);
                self.stop_with(now, Outcome::RecoveryFailed);
            }
        }
        std::mem::take(&mut self.out)
    }

    /// The current epoch.
    /// Every rank's last view.
    pub fn views(&self) -> impl Iterator<Item = &RankView> {
        self.views.values()
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Every fault so far.
    pub fn faults(&self) -> &[FaultRecord] {
        &self.faults
    }

    /// The median recent step time.
    pub fn median_step(&self) -> Option<Duration> {
        self.watch.median()
    }

    /// How often `rank` has been restarted.
    pub fn restarts(&self, rank: usize) -> u32 {
        self.history.get(&rank).map_or(0, |h| h.restarts)
    }

    /// Whether `rank` registered with the runtime (its state is snapshotted
    /// and it can be rebooted in place).
    pub fn protected(&self, rank: usize) -> bool {
        self.protected.contains(&rank)
    }

    /// How often the whole group was restarted.
    pub fn group_restarts(&self) -> u32 {
        self.group_restarts
    }

    /// A recovery or dump is in progress.
    pub fn recovering(&self) -> bool {
        matches!(self.state, State::Recovering { .. } | State::Dumping { .. })
    }

    /// How the job ended, once it has.
    pub fn outcome(&self) -> Option<Outcome> {
        match self.state {
            State::Done(o) => Some(o),
            _ => None,
        }
    }

    /// The last-words checkpoint, once written.
    pub fn last_words(&self) -> Option<&Written> {
        self.last_words.as_ref()
    }

    /// How a rank that registers now starts: normally while the job runs,
    /// else it waits for a directive (a replacement joins the recovery).
    pub fn start_mode(&self) -> StartMode {
        match self.state {
            // Ranks that register while the group grows wait for the
            // reshape that takes them in.
            State::Running if self.reshape.is_none() => StartMode::Fresh { epoch: self.epoch },
            _ => StartMode::AwaitDirective,
        }
    }

    /// What the machine is doing, in words.
    pub fn activity(&self) -> String {
        let stage = |s: &Stage| match s {
            Stage::Pausing { .. } => "pausing every rank".to_string(),
            Stage::Collecting => "collecting snapshots".to_string(),
            Stage::Resuming { s_star, .. } => format!("resuming from step {s_star}"),
            Stage::Writing { s_star } => format!("writing iteration {s_star}"),
        };
        match &self.state {
            State::Running => "running".into(),
            State::Recovering {
                epoch, stage: s, ..
            } => {
                format!("recovering under epoch {epoch}: {}", stage(s))
            }
            State::Dumping {
                epoch,
                stage: s,
                then,
                ..
            } => format!(
                "{} under epoch {epoch}: {}",
                match then {
                    AfterDump::Resume => "dumping",
                    AfterDump::Stop(_) => "writing the last words",
                },
                stage(s)
            ),
            State::Done(o) => format!("done: {o:?}"),
        }
    }

    // ---- output ----

    fn note(&mut self, level: Level, rank: Option<usize>, text: impl Into<String>) {
        self.out.notes.push(Note {
            level,
            rank,
            detail: None,
            reason: None,
            text: text.into(),
        });
    }

    /// A note about a fault: `what` happened, seen as `detail`, because of
    /// `reason`.
    fn fault_note(&mut self, level: Level, rank: usize, what: &str, detail: &str, reason: &str) {
        self.out.notes.push(Note {
            level,
            rank: Some(rank),
            detail: Some(detail.to_string()),
            reason: Some(reason.to_string()),
            text: what.to_string(),
        });
    }

    fn cmd(&mut self, c: Command) {
        self.out.commands.push(c);
    }

    // ---- views ----

    /// The ranks of the group (not finished, not left), each with the last
    /// step it completed.
    pub fn members_at(&self) -> Vec<(usize, u64)> {
        self.participants()
            .into_iter()
            .map(|r| (r, self.view(r).step))
            .collect()
    }

    /// Ranks that take part in pauses and resumes: all but those finished.
    fn participants(&self) -> Vec<usize> {
        self.ranks
            .iter()
            .copied()
            .filter(|&r| !self.finished.contains(&r) && !self.left(r))
            .collect()
    }

    fn view(&self, rank: usize) -> RankView {
        self.views
            .get(&rank)
            .copied()
            .unwrap_or(RankView::absent(rank))
    }

    fn paused(&self, rank: usize, epoch: u64) -> bool {
        let v = self.view(rank);
        v.alive
            && v.registered
            && matches!(v.acked, Some(Directive::Pause { epoch: e, .. }) if e == epoch)
            && v.phase == Phase::Paused
    }

    fn max_step(&self) -> u64 {
        self.views.values().map(|v| v.step).max().unwrap_or(0)
    }

    fn record_fault(
        &mut self,
        now: Duration,
        rank: usize,
        kind: FaultKind,
        detail: String,
        (class, action): (FaultAction, String),
        reason: String,
    ) -> usize {
        self.faults.push(FaultRecord {
            id: self.faults.len() as u64 + 1,
            ranks: vec![rank],
            kind,
            detail,
            detected_unix_s: self.started_unix_s + now.as_secs_f64(),
            s_star: None,
            action,
            class,
            recovery_s: None,
            steps_lost: None,
            reason,
        });
        self.detected.push(now);
        self.faults.len() - 1
    }

    /// Posts `Pause { epoch }` to every participant that can read it,
    /// with the step past which nothing can be resumed when a participant
    /// whose process has ended says so ([`Machine::resumable_upto`]).
    fn pause_all(&mut self, epoch: u64) {
        let upto = self.resumable_upto();
        for r in self.participants() {
            let v = self.view(r);
            if v.alive && v.registered {
                self.cmd(Command::Post {
                    rank: r,
                    directive: Directive::Pause { epoch, upto },
                });
            }
        }
    }

    /// The newest step the job could resume from, as far as the
    /// participants whose processes have ended tell: the oldest of their
    /// newest sealed steps. The step every rank holds cannot be newer than
    /// what one of them holds, and they seal nothing more. `None` when
    /// none has ended, or one has ended without a sealed step known.
    fn resumable_upto(&self) -> Option<u64> {
        self.participants()
            .into_iter()
            .map(|r| self.view(r))
            .filter(|v| v.registered && !v.alive)
            .map(|v| v.final_sealed)
            .collect::<Option<Vec<u64>>>()?
            .into_iter()
            .min()
    }

    /// Posts `Resume { epoch, step }` to every live participant; during a
    /// shrink, `Reshape` with each one's new place, after the lost ranks'
    /// replicas are handed to the ranks that bring them.
    fn resume_all(&mut self, epoch: u64, step: u64) {
        let world = self.participants().len();
        if let Some(r) = &mut self.reshape {
            r.resumed = Some(elastic::Resumed {
                step,
                left: r.leaving.clone(),
                joined: r.joining.clone(),
                world,
            });
        }
        let leaving = self.leaving();
        if !leaving.is_empty() {
            self.cmd(Command::Donate { step, leaving });
        }
        for r in self.participants() {
            if self.view(r).alive {
                let directive = match self.place(r) {
                    Some((rank, world)) => Directive::Reshape {
                        epoch,
                        step,
                        rank,
                        world,
                    },
                    None => Directive::Resume { epoch, step },
                };
                self.cmd(Command::Post { rank: r, directive });
            }
        }
    }

    // ---- transitions ----

    /// Opens a new epoch and pauses every rank to repair `new` faults (with
    /// those of a recovery already in progress).
    fn begin_recovery(&mut self, now: Duration, new: Vec<usize>) {
        let (mut faults, max_step) = match &self.state {
            State::Recovering {
                faults, max_step, ..
            } => (faults.clone(), *max_step),
            State::Dumping { max_step, .. } => (Vec::new(), *max_step),
            _ => (Vec::new(), self.max_step()),
        };
        faults.extend(new);
        self.epoch += 1;
        let epoch = self.epoch;
        self.pause_all(epoch);
        self.note(
            Level::Info,
            None,
            format!("pausing every rank for recovery under epoch {epoch}"),
        );
        self.state = State::Recovering {
            epoch,
            stage: Stage::Pausing {
                deadline: now + self.cfg.pause_timeout,
            },
            faults,
            max_step,
        };
    }

    /// Starts a dump: pause, collect, write; then `then`.
    fn begin_dump(&mut self, now: Duration, then: AfterDump, recover: Vec<usize>) {
        if !self.checkpoint {
            let m = "no last-words checkpoint: the trainer has no --save directory".to_string();
            self.note(Level::Warn, None, m.clone());
            self.cmd(Command::DumpDone(Err(m.into())));
            match then {
                AfterDump::Stop(o) => self.finish(o),
                AfterDump::Resume if !recover.is_empty() => self.begin_recovery(now, recover),
                AfterDump::Resume => {}
            }
            return;
        }
        let max_step = self.max_step();
        self.epoch += 1;
        let epoch = self.epoch;
        self.pause_all(epoch);
        self.note(
            Level::Info,
            None,
            format!("pausing every rank for a checkpoint under epoch {epoch}"),
        );
        self.state = State::Dumping {
            epoch,
            stage: Stage::Pausing {
                deadline: now + self.cfg.pause_timeout,
            },
            then,
            recover,
            max_step,
        };
    }

    /// Ends the job with `outcome`, writing the last words first when the
    /// dump mode is on.
    fn stop_with(&mut self, now: Duration, outcome: Outcome) {
        match &mut self.state {
            State::Done(_)
            | State::Dumping {
                then: AfterDump::Stop(_),
                ..
            } => {}
            State::Dumping { then, .. } => {
                // The dump in progress becomes the last words.
                *then = AfterDump::Stop(outcome);
            }
            _ if self.cfg.modes.dump => self.begin_dump(now, AfterDump::Stop(outcome), Vec::new()),
            _ => self.finish(outcome),
        }
    }

    fn finish(&mut self, outcome: Outcome) {
        if self.dump_waiting {
            self.dump_waiting = false;
            self.cmd(Command::DumpDone(Err("the job is ending".into())));
        }
        self.state = State::Done(outcome);
        self.cmd(Command::Finish(outcome));
    }

    fn complete_recovery(&mut self, now: Duration, s_star: u64, faults: Vec<usize>, max_step: u64) {
        let lost = max_step.saturating_sub(s_star);
        for f in faults {
            let secs = now.saturating_sub(self.detected[f]).as_secs_f64();
            self.faults[f].recovery_s = Some(secs);
            self.faults[f].steps_lost = Some(lost);
            let text = format!(
                "recovered: first step after the fault completed: fault={} ranks={:?} s_star={s_star} steps_lost={lost} recovery_s={secs:.6}",
                self.faults[f].id, self.faults[f].ranks
            );
            self.note(Level::Info, None, text);
        }
        self.reshaped(now, s_star);
        self.state = State::Running;
        self.rebuilds.clear();
        self.watch.restart_clocks(now);
        if self.dump_waiting {
            self.dump_waiting = false;
            self.begin_dump(now, AfterDump::Resume, Vec::new());
        }
    }
}

mod elastic;
mod faults;
mod hostloss;
mod stages;
mod unreported;

#[cfg(test)]
mod tests;
