//! Any host may be lost, the controller's included. When a follower's
//! controller is lost, the agents agree on a successor through the
//! coordinator (whom each follows, and who acts: only an agent that a
//! strict majority of the job's agents follow). The successor's agent
//! turns from follower into controller: its machine inherits what the old
//! controller had told every host (epoch, faults, restarts, registered
//! ranks, placement), it hears every live host's report (their control
//! pages are the truth), and then decides on the lost hosts, its
//! predecessor's first. The others follow it once its first orders, under
//! a newer term, arrive. A follower that sees no successor act within
//! [`SUCCESSOR_WAIT`] (no majority: a minority side of a partition) stops.

use super::decider::{Controller, Decider, Input, Rules, SUCCESSOR_WAIT};
use super::{Driver, job_clock, machine_config};
use crate::config::CoordinatorChoice;
use crate::recovery::{Event, Machine, Outcome};
use crate::supervisor::Supervisor;
use hatrain_shared::control::{FaultAction, FaultKind, FaultRecord};
use std::time::{Duration, Instant};

impl Driver<'_> {
    /// How long a host without a controller that acts waits for one:
    /// [`SUCCESSOR_WAIT`] with the embedded coordinator; with etcd,
    /// `--coordinator-timeout` (etcd itself may be what is missing).
    pub(super) fn successor_wait(&self) -> Duration {
        match self.cfg.ha.coordinator {
            CoordinatorChoice::Embedded => SUCCESSOR_WAIT,
            CoordinatorChoice::Etcd(_) => self.cfg.ha.coordinator_timeout,
        }
    }

    /// How the job's controller may act, from the configuration.
    pub(super) fn rules(&self) -> Rules {
        let ha = &self.cfg.ha;
        Rules {
            reboot: ha.modes.recover,
            elastic: ha.modes.elastic,
            etcd: match &ha.coordinator {
                CoordinatorChoice::Embedded => None,
                CoordinatorChoice::Etcd(e) => Some(e.join(",")),
            },
            coordinator_timeout: ha.coordinator_timeout,
            successor_wait: self.successor_wait(),
        }
    }

    /// Who may act, for the messages that say why nobody did.
    pub(super) fn who_acts(&self) -> String {
        match &self.cfg.ha.coordinator {
            CoordinatorChoice::Embedded => "a controller needs a strict majority of the job's agents, and this host does not hear one".into(),
            CoordinatorChoice::Etcd(e) => format!(
                "a controller acts only while it holds its lease and the job's leader key in etcd ({}), and etcd did not answer or gave the key to nobody",
                e.join(",")
            ),
        }
    }
}

impl Driver<'_> {
    /// On a tick: a follower whose controller is lost follows whom the
    /// coordinator names, takes over when it acts itself, or stops when
    /// nobody acts in time; a controller that took over decides on lost
    /// hosts once it has heard every live host.
    pub(super) fn follow_successor(&mut self, sup: &mut Supervisor) {
        let Some(view) = self.peers.as_ref().map(|p| p.membership.seen().view) else {
            return;
        };
        let me = self.cfg.node_rank as u64;
        match &mut self.decider {
            Decider::Controller(_) => self.advance(sup, Input::Tick),
            Decider::Follower(f) => {
                let Some(deadline) = f.orphaned else {
                    return;
                };
                match view.follows {
                    Some(n) if n == me && view.acting => {
                        let shutdown = f.shutdown_passed;
                        self.take_over(sup, view.term);
                        self.register_again(sup);
                        if shutdown {
                            // The shutdown this host passed on to the lost
                            // controller is decided here now.
                            self.feed(sup, Event::Shutdown);
                        }
                    }
                    // The controller it followed acts again under a newer
                    // term (its lease lapsed, and it took the key back
                    // first): it is followed again.
                    Some(n) if n == f.leader && n != me && view.term > f.term => {
                        tracing::warn!(
                            node = n,
                            term = view.term,
                            "the controller acts again under a newer term: following it"
                        );
                        f.orphaned = None;
                        self.lost.retain(|&l| l != n);
                        let shutdown = f.shutdown_passed;
                        self.register_again(sup);
                        if shutdown {
                            self.feed(sup, Event::Shutdown);
                        }
                    }
                    Some(n) if n != me && n != f.leader && !self.lost.contains(&n) => {
                        tracing::info!(node = n, "reporting to the successor");
                        f.leader = n;
                        let shutdown = f.shutdown_passed;
                        self.register_again(sup);
                        if shutdown {
                            self.feed(sup, Event::Shutdown);
                        }
                    }
                    _ if Instant::now() >= deadline => self.no_successor(),
                    _ => {}
                }
            }
        }
    }

    /// Registrations the lost controller never answered go to its
    /// successor (this agent's own machine, when it took over), so that
    /// their workers do not wait for an answer that cannot come.
    fn register_again(&mut self, sup: &mut Supervisor) {
        let ranks: Vec<usize> = self.unanswered.keys().copied().collect();
        for rank in ranks {
            let checkpoint = self.maps.get(&rank).is_some_and(|m| m.checkpoint.is_some());
            tracing::info!(rank, "registration sent again, to the successor");
            if matches!(self.decider, Decider::Controller(_))
                && let Some((reply, answer)) = self.unanswered.remove(&rank)
            {
                let _ = reply.send(answer);
            }
            self.feed(sup, self.registered_event(rank, checkpoint));
        }
    }

    /// This agent becomes the job's controller, under `term`.
    fn take_over(&mut self, sup: &mut Supervisor, term: u64) {
        let rules = self.rules();
        let Decider::Follower(f) = &mut self.decider else {
            return;
        };
        let cfg = self.cfg;
        let machine = Machine::take_over(
            machine_config(cfg),
            (0..cfg.world_size()).collect(),
            f.mirror.inherited(),
        );
        let now = job_clock(
            self.started.elapsed(),
            self.started_unix_s,
            machine.started_unix_s(),
        );
        let mut c = Controller::take_over(
            machine,
            (cfg.nnodes, cfg.nproc_per_node),
            cfg.node_rank as u64,
            (&f.mirror, &self.lost),
            now,
        );
        c.rules = rules;
        c.inherit_kept(self.kept);
        if let Some(s) = &mut c.settling {
            s.losses = std::mem::take(&mut f.losses);
        }
        tracing::warn!(
            term,
            lost = ?self.lost,
            "taking over as the job's controller: the previous one is lost"
        );
        self.decider = Decider::Controller(Box::new(c));
        let views = self.views(sup);
        // Every host hears of the new controller at once: the machine's
        // state goes to every host with this first step.
        self.feed(sup, Event::Tick(views));
    }

    /// Nobody took over in time: this host stops.
    fn no_successor(&mut self) {
        let (wait, who) = (self.successor_wait(), self.who_acts());
        let Decider::Follower(f) = &mut self.decider else {
            return;
        };
        let leader = f.leader;
        let lost = f.losses.iter().find(|l| l.node == leader);
        let (ranks, detail) = lost.map_or((Vec::new(), String::new()), |l| {
            (l.ranks.clone(), l.detail.clone())
        });
        tracing::error!(
            node = leader,
            ?ranks,
            "the controller's host is lost and no successor acts: stopping"
        );
        let detected = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        f.mirror.faults.push(FaultRecord {
            id: f.mirror.faults.len() as u64 + 1,
            ranks,
            kind: FaultKind::HostLost,
            detail,
            detected_unix_s: detected,
            s_star: None,
            action: "stop the job".into(),
            class: FaultAction::Stop,
            recovery_s: None,
            steps_lost: None,
            reason: format!(
                "host {leader} ran the job's controller, and no successor acted within {} s: {}",
                wait.as_secs_f64(),
                who
            ),
        });
        self.outcome = Some(Outcome::RecoveryFailed);
    }
}
