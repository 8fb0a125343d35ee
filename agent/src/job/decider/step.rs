//! The controller as one machine: [`Controller::step`] takes one [`Input`]
//! at an instant of the job's clock, with the [`Facts`] of the world around
//! it (the coordinator's view, the hosts lost, the replicas this host
//! holds, the newest checkpoint on disk), and returns one [`Ready`]: the
//! commands for this host's ranks, the orders for each other host, the
//! replicas this host hands over, the notes for the log, the state to keep
//! for the next agent, and why the job stops. No clock, no disk, no
//! socket: the driver gathers the inputs and carries out the `Ready`
//! (`super::super::orders`). The same machine decides for one host
//! (`nodes = 1`) and for many; it wraps the single-host recovery
//! machine, unchanged.
//!
//! What comes of a command carried out here (a replacement that could not
//! start) comes back as [`Input::Followed`], and is decided at once.

use super::minority::CutOffVerdict;
use super::shared::{WriteEnd, WriteStart};
use super::unled::{UnledVerdict, is_fault};
use super::{Controller, Down, Give, Handover, LossFacts, Mirror, OnLoss, Routed, Up};
use crate::coordinator::View;
use crate::recovery::{Command, Event, HostLoss, Level, Note, OnDisk, Outcome, RankView};
use hatrain_shared::shm::Kept;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// How long a follower whose controller is lost, or a controller cut off
/// from the majority, waits for a successor with the embedded coordinator.
pub const SUCCESSOR_WAIT: Duration = Duration::from_secs(10);

/// What the controller is told, one at a time.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// Something that happened on this host (a worker's exit, the views
    /// of its ranks, a registration, a request) or to the whole job (a
    /// shutdown). A fault waits while an etcd controller may not act.
    Event(Event),
    /// What came of a command carried out here: decided at once.
    Followed(Event),
    /// A follower's message.
    Up { from: u64, up: Up },
    /// This host verified its ranks' snapshots (and the replicas it holds
    /// of lost hosts' ranks) for the collection of `epoch`.
    Verified {
        epoch: u64,
        steps: Vec<(usize, Vec<u64>)>,
        replicas: Vec<(usize, Vec<u64>)>,
    },
    /// This host's share of the checkpoint the hosts write under `epoch`
    /// is written (the seconds it took), or failed.
    Wrote {
        epoch: u64,
        result: Result<f64, crate::recovery::WriteFailed>,
    },
    /// Hosts this agent stopped hearing, all known at once (so that a
    /// host lost with the holder of its replicas is named so).
    HostsLost(Vec<HostLoss>),
    /// Every rank of host `node`, and no other, holds the job back, and
    /// handing the host to a standby host pays (`--on-slow replace`):
    /// asked on each tick while it does.
    SlowHost { node: u64, detail: String },
    /// Time passed: deadlines (a take-over settling, a cut-off, faults
    /// waiting for etcd) and the group growing back onto a standby.
    Tick,
}

/// The world around the controller when an input comes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Facts {
    /// The coordinator's view of the job's agents; `None` for a job of
    /// one host (nobody to follow, always acting).
    pub view: Option<View>,
    /// Every host lost so far.
    pub gone: Vec<u64>,
    /// The ranks whose replicas this host holds, each with a sealed step.
    pub own_held: Vec<usize>,
    /// This host's replicas and its stores' kept snapshots, for the
    /// replica hold (with peers).
    pub own_hold: Option<super::HoldReport>,
    /// The newest complete checkpoint on disk, where the job saves.
    pub on_disk: Option<OnDisk>,
}

impl Facts {
    /// This agent may act as the job's controller now.
    pub fn acting(&self) -> bool {
        self.view.as_ref().is_none_or(|v| v.acting)
    }
}

/// How the controller may act, fixed for the job.
#[derive(Debug, Clone, PartialEq)]
pub struct Rules {
    /// Worker reboot is on: a standby host may take a lost host's ranks.
    pub reboot: bool,
    /// Elastic training: the group grows back onto a standby.
    pub elastic: bool,
    /// The etcd endpoints, when etcd coordinates the job.
    pub etcd: Option<String>,
    /// `--coordinator-timeout`: how long a fault waits for etcd.
    pub coordinator_timeout: Duration,
    /// How long a controller cut off from the majority waits for a
    /// successor before it stops.
    pub successor_wait: Duration,
}

impl Default for Rules {
    fn default() -> Self {
        Self {
            reboot: true,
            elastic: false,
            etcd: None,
            coordinator_timeout: Duration::from_secs(60),
            successor_wait: SUCCESSOR_WAIT,
        }
    }
}

/// What to carry out after a step.
#[derive(Debug, Default, PartialEq)]
pub struct Ready {
    /// Commands for this host's ranks, in order.
    pub here: Vec<Command>,
    /// Orders for other hosts, in the order they are to be sent; the
    /// driver stamps each with the term it acts under.
    pub orders: Vec<(u64, Down)>,
    /// This host streams the replicas it holds of a lost host's ranks to
    /// the standby that takes them.
    pub give: Vec<Give>,
    /// This host places the replicas of a node on a standby again (the
    /// group grew back onto it).
    pub regrow: Vec<Give>,
    /// Why each decision was taken, for the log.
    pub notes: Vec<Note>,
    /// The machine's state changed: followers are shown this, and the
    /// next agent of a served job inherits it.
    pub mirror: Option<Arc<Mirror>>,
    /// The steps this host's stores keep for the replicas changed (every
    /// other host is sent them among the orders).
    pub keep: Option<Kept>,
    /// The controller stops the job (the outcome, when it is not the last
    /// words' own), and why, in words.
    pub stop: Option<(Option<Outcome>, String)>,
    /// The hosts are to write a checkpoint, each its share: the driver
    /// makes its `_tmp` directory and sends the shares (what comes of a
    /// write it cannot start returns as [`Input::Followed`]).
    pub write: Option<WriteStart>,
    /// This host (the controller's own) leaves the job as a lost host does,
    /// and why: it holds the job back.
    pub leave: Option<String>,
    /// Every share of that checkpoint is in: the driver commits it (or
    /// removes it, when a share failed), and returns what came of it as
    /// [`Input::Followed`].
    pub commit: Option<WriteEnd>,
}

impl Ready {
    pub(super) fn note(&mut self, level: Level, text: String) {
        self.notes.push(Note {
            level,
            rank: None,
            detail: None,
            reason: None,
            text,
        });
    }
}

/// A step being taken: its `Ready`, and the commands for other hosts not
/// sent yet (they go out together, as one order per host, before any
/// order that must follow them).
#[derive(Default)]
pub(super) struct Out {
    pub ready: Ready,
    pending: BTreeMap<u64, Vec<Command>>,
}

impl Controller {
    /// Takes `input` at `now` (the job's clock), given `facts`.
    pub fn step(&mut self, now: Duration, facts: &Facts, input: Input) -> Ready {
        let mut out = Out::default();
        // Inputs that change nothing followers are shown unless they
        // decide something.
        let routine = match &input {
            Input::Event(Event::Tick(_))
            | Input::Tick
            | Input::Verified { .. }
            | Input::SlowHost { .. } => true,
            Input::Up {
                up: Up::Report { events, .. },
                ..
            } => events.is_empty(),
            Input::Up {
                up: Up::Collected { .. } | Up::Ended,
                ..
            } => true,
            _ => false,
        };
        // A lost host's ranks go only to a standby heard now: taken on the
        // inputs that may place them (not on each of thousands of
        // reports).
        if let Some(v) = &facts.view
            && (matches!(input, Input::Tick) || self.may_decide_losses(&input))
        {
            self.heard = v.live.iter().copied().collect();
        }
        // The step kept for the replicas is chosen again on ticks (not on
        // each of thousands of reports).
        let tick = matches!(input, Input::Tick | Input::Event(Event::Tick(_)));
        if std::mem::take(&mut self.interrupted) {
            // The faults its predecessor had not recovered from yet.
            self.decide(now, Event::Interrupted, &mut out);
        }
        match input {
            Input::Event(e) => self.on_event(now, facts, e, &mut out),
            Input::Followed(e) => {
                if let Event::Written { epoch, .. } = &e {
                    self.write_settled(*epoch);
                }
                self.decide(now, e, &mut out)
            }
            Input::Up { from, up } => self.on_up(now, facts, from, up, &mut out),
            Input::Verified {
                epoch,
                steps,
                replicas,
            } => {
                if let Some(e) = self.gathered(self.node, epoch, steps, replicas) {
                    self.on_event(now, facts, e, &mut out);
                }
            }
            Input::Wrote { epoch, result } => {
                self.share_written(now, self.node, epoch, result, &mut out)
            }
            Input::HostsLost(lost) => self.on_hosts_lost(now, facts, lost, &mut out),
            Input::SlowHost { node, detail } => self.on_slow_host(facts, node, detail, &mut out),
            Input::Tick => self.on_tick(now, facts, &mut out),
        }
        // A routine input that decided nothing changes nothing the
        // followers are shown: the state is not built again (at thousands
        // of hosts, every report is a step).
        let quiet = routine
            && out.ready.notes.is_empty()
            && out.ready.here.is_empty()
            && out.ready.orders.is_empty()
            && out.ready.stop.is_none()
            && out.ready.write.is_none()
            && out.ready.commit.is_none()
            && out.ready.leave.is_none()
            && out.pending.is_empty()
            && self.sent.is_some()
            && self.glanced.as_ref() == Some(&self.glance());
        if quiet {
            debug_assert!(
                self.sent.as_deref() == Some(&self.mirror()),
                "a quiet step changed the state shown"
            );
        } else {
            self.flush(&mut out, true);
        }
        if tick {
            self.keep_for_replicas(now, facts, &mut out);
        }
        out.ready
    }

    fn hold_views(&mut self, views: Vec<RankView>) {
        for v in views {
            self.views_in.insert(v.rank, v);
        }
    }

    /// The views the hosts reported since the last tick go to the
    /// machine, in one tick.
    fn views_now(&mut self, now: Duration, out: &mut Out) {
        if self.views_in.is_empty() {
            return;
        }
        let views = std::mem::take(&mut self.views_in).into_values().collect();
        self.decide(now, Event::Tick(views), out);
    }

    /// An event: decided now, or held while an etcd controller may not
    /// act. This host's views take the other hosts' reported since the
    /// last tick with them.
    fn on_event(&mut self, now: Duration, facts: &Facts, e: Event, out: &mut Out) {
        let e = match e {
            Event::Tick(views) => {
                self.hold_views(views);
                return self.views_now(now, out);
            }
            e => e,
        };
        if self.rules.etcd.is_none() || !is_fault(&e) || facts.acting() || self.given_up {
            return self.decide(now, e, out);
        }
        let never_acted = facts.view.as_ref().is_none_or(|v| v.acted == 0);
        if let Event::Exited { rank, .. }
        | Event::SpawnFailed { rank, .. }
        | Event::Unfit { rank, .. } = &e
        {
            // Its end is known, only not decided yet.
            self.machine.exit_held(*rank);
        }
        if self.hold_unled(e, now) {
            match never_acted {
                true => out.ready.note(
                    Level::Info,
                    "an event to decide before this controller holds the job's leader key in etcd: it waits for the key".into(),
                ),
                false => out.ready.note(
                    Level::Warn,
                    "a fault, and this controller does not hold its lease in etcd: the job waits for etcd (or --coordinator-timeout)".into(),
                ),
            }
        }
    }

    /// The recovery machine decides on `e`; each command goes to the host
    /// of its rank.
    pub(super) fn decide(&mut self, now: Duration, e: Event, out: &mut Out) {
        let step = self.machine.step(now, e);
        out.ready.notes.extend(step.notes);
        for c in step.commands {
            if let Command::Write { epoch, step } = c
                && self.joined()
            {
                // Each host writes its share.
                self.start_write(now, epoch, step, out);
                continue;
            }
            for r in self.route(c) {
                match r {
                    Routed::Here(c) => out.ready.here.push(c),
                    Routed::There(n, c) => out.pending.entry(n).or_default().push(c),
                }
            }
        }
    }

    /// The commands not sent yet go out, one order per host, with the
    /// machine's state to every host when it changed (`state`: at the end
    /// of a step, after every other order).
    fn flush(&mut self, out: &mut Out, state: bool) {
        let mirror = Arc::new(self.mirror());
        let changed = state && self.sent.as_ref() != Some(&mirror);
        if state {
            self.glanced = Some(self.glance());
        }
        if changed {
            self.sent = Some(Arc::clone(&mirror));
            out.ready.mirror = Some(Arc::clone(&mirror));
        }
        if !self.joined() {
            out.pending.clear();
            return;
        }
        let orphans = self.orphans();
        let everyone: Vec<u64> = self.everyone().collect();
        for n in everyone {
            let commands = out.pending.remove(&n).unwrap_or_default();
            if commands.is_empty() && !changed {
                continue;
            }
            out.ready.orders.push((
                n,
                Down {
                    mirror: changed.then(|| Arc::clone(&mirror)),
                    commands,
                    orphans: orphans.clone(),
                    ..Down::default()
                },
            ));
        }
        out.pending.clear();
    }

    /// Sends `down` to `node` after what was decided before it.
    pub(super) fn order(&mut self, node: u64, down: Down, out: &mut Out) {
        self.flush(out, false);
        out.ready.orders.push((node, down));
    }

    fn on_up(&mut self, now: Duration, facts: &Facts, from: u64, up: Up, out: &mut Out) {
        if !self.knows(from) {
            out.ready.note(
                Level::Warn,
                format!("a report from node {from}, not in the job, refused"),
            );
            return;
        }
        match up {
            Up::Report {
                views,
                events,
                held,
                hold,
            } => {
                self.note_held(from, held);
                if let Some(h) = hold {
                    self.hold.report(now, from, h);
                }
                let settled = self.settle(Some(from), now);
                if let Some(v) = views.iter().find(|v| !self.holds(from, v.rank)) {
                    out.ready.note(
                        Level::Warn,
                        format!(
                            "a report of node {from} on rank {}, another host's, refused",
                            v.rank
                        ),
                    );
                } else {
                    // Views wait for the next tick, all hosts' in one:
                    // the machine looks over every rank at each, and a
                    // report is one host's few. What happened goes after
                    // the views that show it.
                    self.hold_views(views);
                    if !events.is_empty() {
                        self.views_now(now, out);
                    }
                    let mut registered = Vec::new();
                    for e in events {
                        let rank = match e {
                            Event::Registered { rank, .. } => Some(rank),
                            _ => None,
                        };
                        self.on_event(now, facts, e, out);
                        if let Some(rank) = rank {
                            self.registered(from, rank);
                            registered.push((rank, self.machine.start_mode()));
                        }
                    }
                    if !registered.is_empty() {
                        let down = Down {
                            registered,
                            ..Down::default()
                        };
                        self.order(from, down, out);
                    }
                }
                // Losses the take-over waited to decide are decided
                // whatever this report held.
                self.on_hosts_lost(now, facts, settled, out);
            }
            Up::Collected {
                epoch,
                steps,
                replicas,
            } => {
                let steps = steps
                    .into_iter()
                    .filter(|(r, _)| self.holds(from, *r))
                    .collect();
                if let Some(e) = self.gathered(from, epoch, steps, replicas) {
                    self.on_event(now, facts, e, out);
                }
            }
            Up::Ended => {
                self.ended.insert(from);
            }
            Up::Wrote { epoch, result } => self.share_written(now, from, epoch, result, out),
            // Shares of periodic saves are counted where they are
            // committed, on disk (`super::super::saves`).
            Up::Saved { .. } => {}
        }
    }

    /// Hosts lost: each one's ranks go to a standby (the hand-over's
    /// orders go out first) and the machine recovers, or the loss waits
    /// (a take-over settling, no majority); a collection in progress
    /// starts again over the hosts left.
    fn on_hosts_lost(&mut self, now: Duration, facts: &Facts, lost: Vec<HostLoss>, out: &mut Out) {
        if lost.is_empty() {
            return;
        }
        // A checkpoint the hosts write fails with any share of a host lost.
        let nodes: Vec<u64> = (facts.gone.iter().copied())
            .chain(lost.iter().map(|l| l.node))
            .collect();
        self.shares_lost(now, &nodes, out);
        for loss in lost {
            let lf = LossFacts {
                acting: facts.acting(),
                reboot: self.rules.reboot,
                gone: &facts.gone,
                own_held: &facts.own_held,
                on_disk: facts.on_disk.clone(),
                now,
            };
            match self.on_host_lost(loss, lf) {
                OnLoss::HoldBack(loss) => {
                    out.ready.note(
                        Level::Warn,
                        format!(
                            "host {} (ranks {:?}) is lost, and this host hears no majority of the job's agents: deciding nothing on the hosts it lost; its ranks wait",
                            loss.node, loss.ranks
                        ),
                    );
                    self.hold_back(loss, now);
                }
                OnLoss::Settling => {}
                OnLoss::StandbyLost { node } => {
                    out.ready
                        .note(Level::Warn, format!("standby host {node} is lost"));
                }
                OnLoss::Recover { loss, handover } => {
                    if let Some(h) = handover {
                        self.hand_over(h, out);
                    }
                    self.on_event(now, facts, Event::HostLost(loss), out);
                }
            }
        }
        self.collect_again(out);
    }

    /// A standby takes a lost host's ranks, and every host holding their
    /// replicas (this one too) streams them there.
    fn hand_over(&mut self, h: Handover, out: &mut Out) {
        out.ready.note(
            Level::Warn,
            format!(
                "host {} lost: its ranks {:?} go to standby host {}, filled from their peer replicas",
                h.give.node, h.adopt.ranks, h.to
            ),
        );
        let adopt = Down {
            adopt: Some(h.adopt),
            ..Down::default()
        };
        self.order(h.to, adopt, out);
        for n in h.givers {
            let give = Down {
                give: Some(h.give.clone()),
                ..Down::default()
            };
            self.order(n, give, out);
        }
        out.ready.give.push(h.give);
    }

    /// A collection in progress waits for the hosts it was sent to: when
    /// some are lost it starts again over the hosts left (with the
    /// replicas of the ranks no live host holds now), or it would wait
    /// for ever.
    fn collect_again(&mut self, out: &mut Out) {
        let Some(epoch) = self.gathering().filter(|e| *e == self.machine.epoch()) else {
            return;
        };
        out.ready.note(
            Level::Warn,
            format!("hosts lost during the collection of epoch {epoch}: collecting again from the hosts left"),
        );
        for r in self.route(Command::Collect { epoch }) {
            match r {
                Routed::Here(c) => out.ready.here.push(c),
                Routed::There(n, c) => out.pending.entry(n).or_default().push(c),
            }
        }
    }

    fn on_tick(&mut self, now: Duration, facts: &Facts, out: &mut Out) {
        self.views_now(now, out);
        if self.stopped() {
            return;
        }
        // A take-over decides on lost hosts at its deadline, heard or not.
        let settled = self.settle(None, now);
        self.on_hosts_lost(now, facts, settled, out);
        if let Some(view) = &facts.view {
            self.mend_or_stop(now, facts, view, out);
            self.stop_if_replaced(view, out);
        }
        self.lead_or_give_up(now, facts, out);
        if self.rules.elastic && facts.acting() && !self.stopped() {
            self.grow_back(now, out);
        }
    }

    /// The job has ended, or this controller stopped it.
    pub(super) fn stopped(&self) -> bool {
        self.stopped || self.machine.outcome().is_some()
    }

    fn stop(&mut self, outcome: Option<Outcome>, reason: String, out: &mut Out) {
        if outcome.is_some() {
            self.stopped = true;
        }
        out.ready.note(Level::Error, format!("stopping: {reason}"));
        out.ready.stop = Some((outcome, reason));
    }

    /// A controller that was cut off decides once it acts again, and
    /// stops when another acts or nobody does in time.
    fn mend_or_stop(&mut self, now: Duration, facts: &Facts, view: &View, out: &mut Out) {
        let wait = self.rules.successor_wait;
        let unheard = self.cut_off_hosts();
        let etcd = self.rules.etcd.clone();
        let reason = match self.cut_off_verdict(now, view, wait, etcd.is_some()) {
            CutOffVerdict::Wait => return,
            CutOffVerdict::Decide(losses) => {
                out.ready.note(
                    Level::Warn,
                    "this host hears a majority of the job's agents again: deciding".into(),
                );
                return self.on_hosts_lost(now, facts, losses, out);
            }
            // With etcd, the hosts it does not hear go toward the last
            // words with the faults held, as a fault would.
            CutOffVerdict::GiveUp(losses) => return self.give_up(now, facts, losses, out),
            CutOffVerdict::Replaced { by } => self.replaced(&format!("node {by}"), view.term),
            CutOffVerdict::TimedOut => {
                let newest = facts
                    .on_disk
                    .as_ref()
                    .and_then(|d| {
                        Some(format!(
                            "; the newest complete checkpoint on disk is iteration {} in {}",
                            d.iteration?,
                            d.dir.display()
                        ))
                    })
                    .unwrap_or_default();
                match etcd {
                    None => format!(
                        "this host ran the job's controller and was cut off from the majority of the job's agents for {} s: a controller needs a strict majority, so it decided nothing on the hosts it does not hear ({unheard}){newest}",
                        wait.as_secs()
                    ),
                    Some(e) => format!(
                        "this host ran the job's controller and could not act for {} s: a controller acts only while it holds its lease and the job's leader key in etcd ({e}), and etcd did not answer or gave the key to nobody; so it decided nothing on the hosts it does not hear ({unheard}){newest}",
                        wait.as_secs_f64(),
                    ),
                }
            }
        };
        self.stop(Some(Outcome::RecoveryFailed), reason, out);
    }

    /// A controller that another replaced, under a newer term (it was
    /// paused, or cut off, past its lease), stops: its orders are refused
    /// anyway, and the job goes on without this host.
    fn stop_if_replaced(&mut self, view: &View, out: &mut Out) {
        // A term above its own that it does not act under: another agent
        // acted since (a term rises only when an agent starts acting). It
        // stops whomever it follows now: with etcd cut off, its own copy
        // of the leader key may still name it.
        if view.acting || view.acted == 0 || view.term <= view.acted || self.stopped() {
            return;
        }
        let who = match view.follows.filter(|&n| n != self.node) {
            Some(n) => format!("node {n}"),
            None => "another agent".into(),
        };
        let reason = self.replaced(&who, view.term);
        self.stop(Some(Outcome::RecoveryFailed), reason, out);
    }

    /// Why a controller that `who` replaced under `term` stops.
    fn replaced(&self, who: &str, term: u64) -> String {
        match self.rules.etcd {
            None => format!(
                "this host ran the job's controller and was cut off from the majority of the job's agents, which follow {who} now (term {term}): the job goes on without this host"
            ),
            Some(_) => format!(
                "this host ran the job's controller and its lease in etcd ran out; {who} holds the job's leader key now (term {term}): the job goes on without this host"
            ),
        }
    }

    /// The faults held are decided once this controller acts again; past
    /// `--coordinator-timeout` the job writes its last words and stops.
    fn lead_or_give_up(&mut self, now: Duration, facts: &Facts, out: &mut Out) {
        if self.stopped() {
            return;
        }
        match self.unled_verdict(now, facts.acting(), self.rules.coordinator_timeout) {
            UnledVerdict::Wait => {}
            UnledVerdict::Decide { events, waited } => {
                out.ready.note(
                    Level::Warn,
                    format!(
                        "this controller holds its lease in etcd: deciding the faults that waited ({}, for {:.3} s)",
                        events.len(),
                        waited.as_secs_f64()
                    ),
                );
                for e in events {
                    self.on_event(now, facts, e, out);
                }
            }
            UnledVerdict::GiveUp => self.give_up(now, facts, Vec::new(), out),
        }
    }

    /// Past `--coordinator-timeout`: the faults held (and the host losses
    /// `losses`, held back as well) are decided without etcd, toward the
    /// last words, and the job stops.
    fn give_up(&mut self, now: Duration, facts: &Facts, losses: Vec<HostLoss>, out: &mut Out) {
        if self.given_up {
            return;
        }
        self.given_up = true;
        let held = self.waiting.take().map(|h| h.events).unwrap_or_default();
        let reason = format!(
            "a fault waited {} s (--coordinator-timeout-secs) for etcd ({}), and this controller could not hold its lease and the job's leader key meanwhile: writing the last words from the snapshots and stopping",
            self.rules.coordinator_timeout.as_secs_f64(),
            self.rules.etcd.as_deref().unwrap_or_default()
        );
        self.stop(None, reason.clone(), out);
        self.decide(now, Event::Unled { reason }, out);
        for e in held {
            self.decide(now, e, out);
        }
        self.on_hosts_lost(now, facts, losses, out);
    }

    /// A standby heard while ranks have left the group takes a lost
    /// host's ranks back; they start there, and the group grows once they
    /// have registered.
    fn grow_back(&mut self, now: Duration, out: &mut Out) {
        let Some(g) = self.grow(now) else {
            return;
        };
        out.ready.note(
            Level::Warn,
            format!(
                "standby host {} is heard: the group grows back onto it (node {}'s ranks {:?})",
                g.regrow.to, g.regrow.node, g.adopt.ranks
            ),
        );
        let adopt = Down {
            adopt: Some(g.adopt),
            ..Down::default()
        };
        self.order(g.regrow.to, adopt, out);
        for n in g.others {
            let regrow = Down {
                regrow: Some(g.regrow.clone()),
                ..Down::default()
            };
            self.order(n, regrow, out);
        }
        out.ready.regrow.push(g.regrow);
    }
}

impl Controller {
    /// Whether `input` may decide on a lost host now (the losses come
    /// with it, or wait for a take-over to settle, for a majority, or for
    /// etcd), and so needs the facts that cost a look at the replicas and
    /// the disk.
    pub fn may_decide_losses(&self, input: &Input) -> bool {
        match input {
            Input::HostsLost(lost) => !lost.is_empty(),
            Input::Up { .. } | Input::Tick => self.settling.is_some() || self.cut_off.is_some(),
            Input::Event(_)
            | Input::Followed(_)
            | Input::Verified { .. }
            | Input::Wrote { .. }
            | Input::SlowHost { .. } => false,
        }
    }
}

/// What a glance at the state shown to followers sees, cheaply: the parts
/// that change without a decision (a stage ending as the ranks are seen
/// past it). The parts as large as the job (every rank's) change only
/// with a decision.
#[derive(Debug, Clone, PartialEq)]
pub(in crate::job) struct Glance {
    epoch: u64,
    recovering: bool,
    activity: String,
    faults: usize,
    last_fault: Option<(Option<f64>, Option<u64>)>,
    last_words: bool,
    world: usize,
    resizes: usize,
    reshaping: bool,
}

impl Controller {
    fn glance(&self) -> Glance {
        let m = &self.machine;
        Glance {
            epoch: m.epoch(),
            recovering: m.recovering(),
            activity: m.activity(),
            faults: m.faults().len(),
            last_fault: m.faults().last().map(|f| (f.recovery_s, f.s_star)),
            last_words: m.last_words().is_some(),
            world: m.world_size(),
            resizes: m.resizes().len(),
            reshaping: m.reshaping().is_some(),
        }
    }
}
