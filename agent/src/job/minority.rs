//! A controller cut off from the majority of the job's agents decides
//! nothing. Hosts it stops hearing may be alive on the other side of a
//! partition, where a successor that a majority follows takes over (and
//! may declare this host lost, giving its ranks to a standby): deciding on
//! them here would make two controllers. So their losses wait. When this
//! agent acts again (the partition mended before anyone took over), it
//! decides on them; when another agent acts under a newer term, or nobody
//! does within [`SUCCESSOR_WAIT`], this host stops, saying why. Its ranks
//! wait meanwhile, their collectives held up by the hosts they lost.

use super::Driver;
use super::decider::{Controller, Decider};
use crate::coordinator::View;
use crate::recovery::{HostLoss, Outcome};
use crate::supervisor::Supervisor;
use std::time::{Duration, Instant};

/// Host losses a controller without a majority holds back.
#[derive(Debug)]
pub(super) struct CutOff {
    pub since: Instant,
    pub losses: Vec<HostLoss>,
}

/// What a controller cut off from the majority does now.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum CutOffVerdict {
    /// Nothing is held back, or it waits still.
    Wait,
    /// A majority follows it again: it decides on the losses held back.
    Decide(Vec<HostLoss>),
    /// With etcd, nobody acted in time and it follows nobody else: the
    /// losses go toward the last words, as a fault would.
    GiveUp(Vec<HostLoss>),
    /// Another agent acts in its place: it stops.
    Replaced { by: u64 },
    /// Nobody acted within the successor wait: it stops.
    TimedOut,
}

impl Controller {
    /// Holds back `loss`, seen at `now`, while no majority follows.
    pub(super) fn hold_back(&mut self, loss: HostLoss, now: Instant) {
        self.cut_off
            .get_or_insert_with(|| CutOff {
                since: now,
                losses: Vec::new(),
            })
            .losses
            .push(loss);
    }

    /// The hosts whose losses are held back, in words.
    pub(super) fn cut_off_hosts(&self) -> String {
        self.cut_off
            .iter()
            .flat_map(|x| &x.losses)
            .map(|l| match l.ranks.is_empty() {
                true => format!("host {} (a standby)", l.node),
                false => format!("host {} (ranks {:?})", l.node, l.ranks),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// What this controller does at `now` about the losses it holds back,
    /// given the coordinator's `view`, how long it waits for a successor,
    /// and whether etcd coordinates the job.
    pub(super) fn cut_off_verdict(
        &mut self,
        now: Instant,
        view: &View,
        wait: Duration,
        etcd: bool,
    ) -> CutOffVerdict {
        let Some(since) = self.cut_off.as_ref().map(|x| x.since) else {
            return CutOffVerdict::Wait;
        };
        let take = |c: &mut Self| c.cut_off.take().map(|x| x.losses).unwrap_or_default();
        if view.acting {
            return CutOffVerdict::Decide(take(self));
        }
        let waited = now.saturating_duration_since(since) >= wait;
        let leads = view.follows.is_none_or(|n| n == self.node);
        if waited && leads && etcd {
            return CutOffVerdict::GiveUp(take(self));
        }
        match view.follows {
            Some(n) if n != self.node => CutOffVerdict::Replaced { by: n },
            _ if waited => CutOffVerdict::TimedOut,
            _ => CutOffVerdict::Wait,
        }
    }
}

impl Driver<'_> {
    /// Whether this agent may decide: one host alone, or a strict majority
    /// of the job's agents follows it.
    pub(super) fn acting(&self) -> bool {
        self.peers
            .as_ref()
            .is_none_or(|p| p.membership.seen().view.acting)
    }

    /// Holds back `loss`: this controller is cut off from the majority.
    pub(super) fn hold_back(&mut self, loss: HostLoss) {
        let Decider::Controller(c) = &mut self.decider else {
            return;
        };
        tracing::warn!(
            node = loss.node,
            ranks = ?loss.ranks,
            "this host hears no majority of the job's agents: deciding nothing on the hosts it lost; its ranks wait"
        );
        c.hold_back(loss, Instant::now());
    }

    /// On a tick: a controller that was cut off decides once it acts
    /// again, and stops when another acts or nobody does in time.
    pub(super) fn mend_or_stop(&mut self, sup: &mut Supervisor) {
        let Some(view) = self.peers.as_ref().map(|p| p.membership.seen().view) else {
            return;
        };
        let wait = self.successor_wait();
        let etcd = matches!(
            self.cfg.ha.coordinator,
            crate::config::CoordinatorChoice::Etcd(_)
        );
        let Decider::Controller(c) = &mut self.decider else {
            return;
        };
        let unheard = c.cut_off_hosts();
        let reason = match c.cut_off_verdict(Instant::now(), &view, wait, etcd) {
            CutOffVerdict::Wait => return,
            CutOffVerdict::Decide(losses) => {
                tracing::warn!("this host hears a majority of the job's agents again: deciding");
                self.on_hosts_lost(sup, losses);
                return;
            }
            CutOffVerdict::GiveUp(losses) => {
                // With etcd, the hosts it does not hear go toward the last
                // words with the faults held, as a fault would.
                self.give_up(sup, losses);
                return;
            }
            CutOffVerdict::Replaced { by } => self.replaced(&format!("node {by}"), view.term),
            CutOffVerdict::TimedOut => {
                let newest = self
                    .persister
                    .as_ref()
                    .and_then(|p| {
                        let it = hatrain_shared::checkpoint::read_tracker(p.dir()).ok()?;
                        Some(format!(
                            "; the newest complete checkpoint on disk is iteration {it} in {}",
                            p.dir().display()
                        ))
                    })
                    .unwrap_or_default();
                match etcd {
                    false => format!(
                        "this host ran the job's controller and was cut off from the majority of the job's agents for {} s: a controller needs a strict majority, so it decided nothing on the hosts it does not hear ({unheard}){newest}",
                        wait.as_secs()
                    ),
                    true => format!(
                        "this host ran the job's controller and could not act for {} s: {}; so it decided nothing on the hosts it does not hear ({unheard}){newest}",
                        wait.as_secs_f64(),
                        self.who_acts()
                    ),
                }
            }
        };
        tracing::error!(reason, "stopping");
        self.stop_reason = Some(reason);
        self.outcome = Some(Outcome::RecoveryFailed);
    }

    /// A controller that another replaced, under a newer term (it was
    /// paused, or cut off, past its lease), stops: its orders are refused
    /// anyway, and the job goes on without this host.
    pub(super) fn stop_if_replaced(&mut self, view: &crate::coordinator::View) {
        let Decider::Controller(c) = &self.decider else {
            return;
        };
        // A term above its own that it does not act under: another agent
        // acted since (a term rises only when an agent starts acting). It
        // stops whomever it follows now: with etcd cut off, its own copy
        // of the leader key may still name it.
        if view.acting || view.acted == 0 || view.term <= view.acted || self.outcome.is_some() {
            return;
        }
        let who = match view.follows.filter(|&n| n != c.node) {
            Some(n) => format!("node {n}"),
            None => "another agent".into(),
        };
        let reason = self.replaced(&who, view.term);
        tracing::error!(reason, "stopping");
        self.stop_reason = Some(reason);
        self.outcome = Some(Outcome::RecoveryFailed);
    }

    /// Why a controller that `who` replaced under `term` stops.
    fn replaced(&self, who: &str, term: u64) -> String {
        match self.cfg.ha.coordinator {
            crate::config::CoordinatorChoice::Embedded => format!(
                "this host ran the job's controller and was cut off from the majority of the job's agents, which follow {who} now (term {term}): the job goes on without this host"
            ),
            crate::config::CoordinatorChoice::Etcd(_) => format!(
                "this host ran the job's controller and its lease in etcd ran out; {who} holds the job's leader key now (term {term}): the job goes on without this host"
            ),
        }
    }
}
