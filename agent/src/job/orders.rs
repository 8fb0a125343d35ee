//! Reports and orders between a job's hosts: what the [`Decider`] of this
//! host does with an event (decide it, or report it), the orders the
//! controller sends and a follower carries out, and lost hosts.
//!
//! Messages travel as JSON in authenticated [`hatrain_shared::peer`]
//! frames on the heartbeat sessions; a message that does not parse is
//! dropped and logged.

use super::decider::{
    Admit, Decider, Down, Facts, HoldReport, Inbox, Input, REPORT_EVERY, Up, admit,
    ends_successor_wait,
};
use super::{Collected, Driver, log};
use crate::recovery::{Command, Event, HostLoss, OnDisk, Outcome, RankView};
use crate::supervisor::Supervisor;
use hatrain_shared::control::Response;
use hatrain_shared::shm::Kept;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

impl Driver<'_> {
    /// Takes an event of this host: decided here by the controller, or
    /// reported to it.
    pub(super) fn feed(&mut self, sup: &mut Supervisor, event: Event) {
        match &mut self.decider {
            Decider::Controller(_) => self.advance(sup, Input::Event(event)),
            Decider::Follower(f) => match event {
                Event::Tick(views) => self.report(views, Vec::new(), true),
                event => {
                    if event == Event::Shutdown {
                        f.shutdown_by = Some(
                            Instant::now() + self.cfg.ha.host_timeout + Duration::from_secs(2),
                        );
                        f.shutdown_epoch = f.mirror.epoch;
                        f.shutdown_passed = true;
                    }
                    let views = self.views(sup);
                    self.report(views, vec![event], true);
                }
            },
        }
    }

    /// The controller takes `input` ([`Controller::step`]), and what it
    /// decides is carried out: the orders sent, the replicas handed over,
    /// this host's commands carried out (and what comes of them taken in
    /// turn).
    pub(super) fn advance(&mut self, sup: &mut Supervisor, input: Input) {
        let mut inputs = VecDeque::from([input]);
        while let Some(input) = inputs.pop_front() {
            let now = self.now();
            let facts = self.facts(&input);
            let Decider::Controller(c) = &mut self.decider else {
                return;
            };
            let ready = c.step(now, &facts, input);
            for n in &ready.notes {
                log(n);
            }
            if let Some(detail) = ready.leave {
                self.leave_slow(sup, detail);
            }
            if let Some((outcome, reason)) = ready.stop {
                self.stop_reason = Some(reason);
                if outcome.is_some() {
                    self.outcome = outcome;
                }
            }
            if let Some(m) = &ready.mirror {
                self.standbys_ready(m);
            }
            if let Some(k) = ready.keep {
                self.set_kept(k);
            }
            for (n, down) in ready.orders {
                self.send_down(n, down);
            }
            for g in &ready.give {
                self.give(g);
            }
            for g in &ready.regrow {
                self.regrow(g);
            }
            for cmd in ready.here {
                if let Some(e) = self.carry_out(sup, cmd) {
                    inputs.push_back(Input::Followed(e));
                }
            }
            if let Some(w) = ready.write {
                inputs.extend(self.start_write(w));
            }
            if let Some(end) = ready.commit {
                inputs.push_back(self.end_write(end));
            }
        }
    }

    /// The world as the controller is told it with `input`: the
    /// coordinator's view and the hosts lost, and when it may decide on a
    /// lost host, the replicas held here and the newest checkpoint.
    fn facts(&self, input: &Input) -> Facts {
        let Decider::Controller(c) = &self.decider else {
            return Facts::default();
        };
        let view = self.peers.as_ref().map(|p| p.membership.seen().view);
        let losses = c.may_decide_losses(input);
        Facts {
            view,
            gone: self.lost.clone(),
            // Read only where it is used: on ticks (`Controller::step`).
            own_hold: matches!(input, Input::Tick | Input::Event(Event::Tick(_)))
                .then(|| self.hold_report())
                .flatten(),
            own_held: match losses || matches!(input, Input::SlowHost { .. }) {
                true => held_replicas(self.peers.as_ref()),
                false => Vec::new(),
            },
            on_disk: self.persister.as_ref().filter(|_| losses).map(|p| OnDisk {
                dir: p.dir().to_path_buf(),
                iteration: hatrain_shared::checkpoint::read_tracker(p.dir()).ok(),
            }),
        }
    }

    /// Sends `node` the controller's orders, under the term it acts
    /// under now (or last acted under: a controller that another replaced
    /// cannot stamp the newer term it hears of).
    pub(super) fn send_down(&self, node: u64, down: Down) {
        let Some(peers) = &self.peers else {
            return;
        };
        let view = peers.membership.seen().view;
        let term = match &self.decider {
            Decider::Controller(_) => view.acted,
            Decider::Follower(_) => view.term,
        };
        let down = Down { term, ..down };
        match serde_json::to_vec(&down) {
            Ok(bytes) => peers.membership.send(node, &bytes),
            Err(e) => tracing::error!(node, error = %e, "orders not encoded"),
        }
    }

    /// A follower sends the controller its views (when they changed, or
    /// `force`) and its events.
    fn report(&mut self, views: Vec<RankView>, events: Vec<Event>, force: bool) {
        let hold = self.hold_report();
        let Decider::Follower(f) = &mut self.decider else {
            return;
        };
        let held = held_replicas(self.peers.as_ref());
        let stale = f.last.as_ref().is_none_or(|(at, v, h, k)| {
            *v != views || *h != held || *k != hold || at.elapsed() >= REPORT_EVERY
        });
        if !(force || stale || !events.is_empty()) {
            return;
        }
        f.last = Some((Instant::now(), views.clone(), held.clone(), hold.clone()));
        self.send_up(&Up::Report {
            views,
            events,
            held,
            hold,
        });
    }

    /// What this host tells the controller for the replica hold: the
    /// replicas it holds, and the snapshot each of its ranks' stores keeps
    /// for the target. `None` without replicas.
    fn hold_report(&self) -> Option<HoldReport> {
        let r = self.peers.as_ref()?.replicator.as_ref()?;
        let mut kept: Vec<(usize, Option<(u64, u64)>)> = self
            .stores
            .iter()
            .map(|(&rank, s)| (rank, s.kept_for_target().map(|i| (i.step, i.epoch))))
            .collect();
        kept.sort_unstable();
        Some(HoldReport {
            replicas: r.replica_steps(),
            common: self.kept.common,
            target: self.kept.target,
            kept,
        })
    }

    /// The steps the controller says to keep for the replicas: every store
    /// of this host's ranks, and every replica it holds, keeps them.
    pub(super) fn set_kept(&mut self, kept: Kept) {
        if kept != self.kept {
            tracing::debug!(common = ?kept.common, target = ?kept.target, "steps kept for the replicas");
        }
        self.kept = kept;
        for s in self.stores.values() {
            s.page().set_kept(kept);
        }
        if let Some(r) = self.peers.as_ref().and_then(|p| p.replicator.as_ref()) {
            r.set_kept(kept);
        }
    }

    pub(super) fn send_up(&self, up: &Up) {
        let (Some(peers), Decider::Follower(f)) = (&self.peers, &self.decider) else {
            return;
        };
        match serde_json::to_vec(up) {
            Ok(bytes) => peers.membership.send(f.leader, &bytes),
            Err(e) => tracing::error!(error = %e, "report not encoded"),
        }
    }

    /// This host's views on a tick: decided on, or reported when changed.
    pub(super) fn tick_views(&mut self, sup: &mut Supervisor) {
        let views = self.views(sup);
        match &self.decider {
            Decider::Controller(_) => self.feed(sup, Event::Tick(views)),
            Decider::Follower(_) => self.report(views, Vec::new(), false),
        }
    }

    /// This host's ranks' snapshots were verified.
    pub(super) fn on_collected(&mut self, sup: &mut Supervisor, c: Collected) {
        for (rank, why) in &c.rejected {
            tracing::warn!(rank, error = %why, "snapshot slot rejected");
        }
        match &mut self.decider {
            Decider::Controller(_) => self.advance(
                sup,
                Input::Verified {
                    epoch: c.epoch,
                    steps: c.steps,
                    replicas: c.replicas,
                },
            ),
            Decider::Follower(_) => self.send_up(&Up::Collected {
                epoch: c.epoch,
                steps: c.steps,
                replicas: c.replicas,
            }),
        }
    }

    /// A control message from another agent.
    pub(super) fn on_peer(&mut self, sup: &mut Supervisor, from: u64, bytes: &[u8]) {
        let newest = self
            .peers
            .as_ref()
            .map_or(0, |p| p.membership.seen().view.term);
        match &mut self.decider {
            Decider::Controller(_) => match serde_json::from_slice::<Up>(bytes) {
                Ok(up) => self.on_up(sup, from, up),
                Err(e) => tracing::warn!(node = from, error = %e, "a host's report refused"),
            },
            Decider::Follower(f) => match serde_json::from_slice::<Down>(bytes) {
                Ok(down) => match admit(from, down.term, (f.leader, f.term), newest) {
                    Admit::Stale => tracing::warn!(
                        node = from,
                        term = down.term,
                        newest,
                        "orders of an older controller term refused"
                    ),
                    Admit::Take => {
                        let lost: Vec<u64> = f.losses.iter().map(|l| l.node).collect();
                        if ends_successor_wait(from, down.term, f.term, &lost) {
                            f.orphaned = None;
                        }
                        self.on_down(sup, down)
                    }
                    Admit::Follow => {
                        tracing::warn!(
                            node = from,
                            term = down.term,
                            "following the controller that took over"
                        );
                        f.leader = from;
                        f.orphaned = None;
                        let again = f.shutdown_passed;
                        self.on_down(sup, down);
                        if again {
                            // The shutdown passed on to the lost controller.
                            self.feed(sup, Event::Shutdown);
                        }
                    }
                    Admit::NotController => tracing::warn!(
                        node = from,
                        "orders from a node that is not the controller refused"
                    ),
                },
                // A host that already reports to this one as the successor,
                // before it took over: it reports again.
                Err(_) if from != f.leader && serde_json::from_slice::<Up>(bytes).is_ok() => {
                    tracing::debug!(node = from, "a report before this host took over, dropped");
                }
                Err(e) => {
                    tracing::warn!(node = from, error = %e, "the controller's orders refused")
                }
            },
        }
    }

    /// A follower's message: shares of checkpoints are counted here,
    /// where they are committed on disk; the rest is the controller's.
    fn on_up(&mut self, sup: &mut Supervisor, from: u64, up: Up) {
        let Decider::Controller(c) = &self.decider else {
            return;
        };
        let known = c.knows(from);
        match up {
            Up::Saved {
                step,
                ranks,
                result,
            } if known => self.ranks_saved(from, step, ranks, result),
            up => self.advance(sup, Input::Up { from, up }),
        }
    }

    fn on_down(&mut self, sup: &mut Supervisor, down: Down) {
        let Decider::Follower(f) = &mut self.decider else {
            return;
        };
        if down.term < f.term {
            tracing::warn!(
                term = down.term,
                newest = f.term,
                "orders of an older controller term refused"
            );
            return;
        }
        f.term = down.term;
        if let Some(detail) = down.leave {
            return self.leave_slow(sup, detail);
        }
        if !down.orphans.is_empty() {
            f.orphans = down.orphans;
        }
        f.final_done |= down.final_done;
        let mirror = down.mirror.clone();
        if let Some(k) = down.keep {
            self.set_kept(k);
        }
        let Decider::Follower(f) = &mut self.decider else {
            return;
        };
        if let Some(m) = down.mirror {
            f.mirror = std::sync::Arc::unwrap_or_clone(m);
        }
        if let Some(m) = &mirror {
            self.standbys_ready(m);
        }
        if let Some(a) = down.adopt {
            self.adopt(sup, a);
        }
        if let Some(g) = &down.give {
            self.give(g);
        }
        if let Some(g) = &down.regrow {
            self.regrow(g);
        }
        if let Some(w) = down.write {
            let epoch = w.epoch;
            if let Err(m) = self.write_part(w) {
                tracing::error!(reason = %m, "this host's share of the checkpoint cannot be written");
                self.send_up(&Up::Wrote {
                    epoch,
                    result: Err(m),
                });
            }
        }
        for (rank, start) in down.registered {
            if let Some((reply, mut answer)) = self.unanswered.remove(&rank) {
                if let Response::Registered { start: s, .. } = &mut answer {
                    *s = start;
                }
                tracing::info!(rank, ?start, "registration taken by the controller");
                let _ = reply.send(answer);
            }
        }
        let mut follow = Vec::new();
        for c in down.commands {
            let end = matches!(c, Command::Finish(_));
            if let Command::Finish(outcome) = &c {
                tracing::info!(?outcome, "the controller ended the job");
            }
            if let Some(e) = self.carry_out(sup, c) {
                follow.push(e);
            }
            if end {
                if let Decider::Follower(f) = &mut self.decider {
                    f.ended = true;
                }
                self.send_up(&Up::Ended);
            }
        }
        if !follow.is_empty() {
            let views = self.views(sup);
            self.report(views, follow, true);
        }
    }

    /// Lost hosts: the controller decides (all of them known at once, so
    /// that a host lost with the holder of its replicas is named so); a
    /// follower that lost the controller's host waits for a successor,
    /// since nobody decides for it any more.
    pub(super) fn on_hosts_lost(&mut self, sup: &mut Supervisor, lost: Vec<HostLoss>) {
        if lost.is_empty() {
            return;
        }
        let successor_wait = self.successor_wait();
        let Decider::Follower(f) = &mut self.decider else {
            return self.advance(sup, Input::HostsLost(lost));
        };
        for loss in lost {
            f.losses.push(loss.clone());
            if loss.node != f.leader || f.ended || f.orphaned.is_some() {
                // The controller decides about the others.
                continue;
            }
            tracing::warn!(
                node = loss.node,
                ranks = ?loss.ranks,
                detail = loss.detail,
                "the controller's host is lost: waiting for a successor"
            );
            f.orphaned = Some(Instant::now() + successor_wait);
        }
    }

    /// A follower whose shutdown the controller did not answer in time
    /// stops by itself. A controller that began the job's last words (a
    /// newer epoch: it pauses every rank first, which may take up to the
    /// pause timeout) has answered: it ends the job once they are written,
    /// and if its host is lost meanwhile, a successor takes over.
    pub(super) fn shutdown_unanswered(&mut self) {
        if let Decider::Follower(f) = &mut self.decider
            && f.shutdown_by.is_some()
            && f.mirror.epoch > f.shutdown_epoch
        {
            f.shutdown_by = None;
        }
        if let Decider::Follower(f) = &self.decider
            && f.shutdown_by.is_some_and(|by| Instant::now() >= by)
        {
            tracing::warn!("the controller did not end the job after a shutdown: stopping");
            self.outcome = Some(Outcome::Interrupted);
        }
    }

    /// The controller of several hosts waits (at most the host timeout) for
    /// every follower to take the end of the job, so that none is left
    /// without it when this agent's connections close; and for every
    /// host's share of the final checkpoint (see [`super::saves`]).
    pub(super) async fn wait_for_followers(
        &mut self,
        sup: &mut Supervisor,
        rx: &mut Option<Inbox>,
    ) {
        let deadline = Instant::now() + self.cfg.ha.host_timeout;
        loop {
            let Decider::Controller(c) = &self.decider else {
                return;
            };
            let lost = self
                .peers
                .as_ref()
                .map(|p| p.membership.seen().lost())
                .unwrap_or_default();
            let ended = c.all_ended(&lost) || Instant::now() >= deadline;
            if ended && !self.final_pending(&lost) {
                return;
            }
            tokio::select! {
                Some((from, bytes)) = recv(rx) => self.on_peer(sup, from, &bytes),
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    }

    /// Hosts that joined and are not heard any more, each reported once,
    /// with what this host holds of their ranks' state.
    pub(super) fn take_lost_hosts(&mut self) -> Vec<HostLoss> {
        let Some(p) = &self.peers else {
            return Vec::new();
        };
        let seen = p.membership.seen();
        let held = p.replicator.as_ref().map(|r| r.report().held);
        let per_node = self.cfg.nproc_per_node;
        let mut out = Vec::new();
        let ended = match &self.decider {
            Decider::Controller(c) => c.ended.clone(),
            Decider::Follower(_) => Default::default(),
        };
        for node in seen.lost() {
            // A follower that took the end of the job leaves: not a loss.
            if self.lost.contains(&node) || ended.contains(&node) {
                continue;
            }
            self.lost.push(node);
            let ranks: Vec<usize> = match &self.decider {
                Decider::Controller(c) => c.ranks_on(node),
                Decider::Follower(_) => {
                    (node as usize * per_node..(node as usize + 1) * per_node).collect()
                }
            };
            let replicas: Vec<String> = held
                .iter()
                .flatten()
                .filter(|h| h.from_node == node)
                .map(|h| match h.steps.first() {
                    Some(s) => format!("rank {} up to step {s}", h.rank),
                    None => format!("rank {} (no complete snapshot yet)", h.rank),
                })
                .collect();
            let why = match self.cfg.ha.coordinator {
                crate::config::CoordinatorChoice::Embedded => format!(
                    "no heartbeat from host {node} within --host-timeout-secs, or its connection dropped"
                ),
                crate::config::CoordinatorChoice::Etcd(_) => format!(
                    "host {node}'s lease in etcd expired (TTL --host-timeout-secs) or it left; or, while etcd does not answer, its heartbeats stopped"
                ),
            };
            let detail = format!(
                "{why}; {}",
                if replicas.is_empty() {
                    "this host holds no replica of its ranks".to_string()
                } else {
                    format!("this host holds the replica of {}", replicas.join(", "))
                }
            );
            out.push(HostLoss {
                node,
                ranks,
                detail,
                spare: None,
                state_lost: Vec::new(),
                on_disk: None,
                hosts_left: 0,
                stand_by: Vec::new(),
            });
        }
        out
    }
}

/// The ranks whose peer replicas this host holds, each with a sealed step.
fn held_replicas(peers: Option<&super::peers::Peers>) -> Vec<usize> {
    let Some(r) = peers.and_then(|p| p.replicator.as_ref()) else {
        return Vec::new();
    };
    r.report()
        .held
        .into_iter()
        .filter(|h| !h.steps.is_empty())
        .map(|h| h.rank as usize)
        .collect()
}

/// The next control message from another agent; never, without peers.
pub(super) async fn recv(rx: &mut Option<Inbox>) -> Option<(u64, Vec<u8>)> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}
