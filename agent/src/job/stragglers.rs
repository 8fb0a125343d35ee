//! This host's ranks' step times fed to the slow-rank detector
//! ([`crate::slow`]); with `--on-slow replace`, a slow rank handed to a
//! fresh process once that pays ([`crate::slow::replace_pays`]), and a
//! slow host to a standby host ([`crate::slow::hand_host_over_pays`]).

use super::decider::Input;
use super::{Decider, Driver};
use crate::recovery::Event;
use crate::slow::OnSlow;
use crate::supervisor::Supervisor;
use hatrain_shared::control::FaultAction;

impl Driver<'_> {
    /// Feeds the slow-rank detector this host's ranks' step times; one log
    /// line per finding that begins or ends; a hand-over where it pays.
    ///
    /// The job's controller compares every rank of the job, each with its
    /// host, from the views the hosts report; another agent compares its
    /// own ranks, and leaves the hand-over to the controller.
    pub(super) fn watch_slow(&mut self, sup: &mut Supervisor) {
        let readings: Vec<_> = match &self.decider {
            Decider::Controller(c) if self.cfg.nnodes > 1 => {
                let views: Vec<_> = c.machine.views().filter(|v| v.registered).collect();
                let hosts = views.iter().map(|v| (v.rank, c.node_of(v.rank))).collect();
                self.slow.set_hosts(hosts);
                views.iter().map(|v| (v.rank, v.step, v.times)).collect()
            }
            _ => self
                .stores
                .iter()
                .map(|(&rank, s)| (rank, s.page().step(), s.page().step_times()))
                .collect(),
        };
        for change in self.slow.observe(&readings) {
            match change {
                crate::slow::Change::Began(f) => tracing::warn!(
                    rank = f.rank,
                    host = f.host,
                    phase = %f.phase,
                    excess_ms = f.excess_ms,
                    step_ms = f.step_ms,
                    over_own_history_ms = f.over_own_history_ms,
                    since_step = f.since_step,
                    cause = %f.cause,
                    "a slow rank holds the job back"
                ),
                crate::slow::Change::Ended(f) => tracing::info!(
                    rank = f.rank,
                    phase = %f.phase,
                    since_step = f.since_step,
                    last_step = f.last_step,
                    "the slow rank no longer holds the job back"
                ),
            }
        }
        if self.cfg.ha.on_slow == OnSlow::Replace && matches!(self.decider, Decider::Controller(_))
        {
            self.hand_over_slow(sup);
        }
    }

    /// The recovery seconds of this job's last fault recovered by
    /// `class`, or `--slow-handover-secs` until one was measured.
    fn last_recovery_s(&self, class: FaultAction) -> f64 {
        let measured = self
            .decider
            .faults()
            .iter()
            .rev()
            .filter(|f| f.class == class)
            .find_map(|f| f.recovery_s);
        measured.unwrap_or(self.cfg.ha.slow_handover.as_secs_f64())
    }

    /// The price of a hand-over: the recovery time of this job's last
    /// worker reboot, or `--slow-handover-secs` until one was measured.
    fn handover_price_ms(&self) -> f64 {
        1e3 * self.last_recovery_s(FaultAction::Reboot)
    }

    /// The price of handing a host over: the recovery time of this job's
    /// last host handed to a standby, or `--slow-handover-secs` until one
    /// was measured, and the host timeout before its loss is seen.
    fn host_handover_price_ms(&self) -> f64 {
        1e3 * (self.last_recovery_s(FaultAction::Standby) + self.cfg.ha.host_timeout.as_secs_f64())
    }

    /// The controller is asked, on each tick, to hand over each host whose
    /// slowdown has cost the job the price of a hand-over; it decides
    /// whether the host leaves ([`Input::SlowHost`]).
    fn hand_over_slow_hosts(&mut self, sup: &mut Supervisor) {
        let price_ms = self.host_handover_price_ms();
        let mut due = std::collections::BTreeMap::new();
        for f in self.slow.findings() {
            if let Some(host) = f
                .host
                .filter(|_| crate::slow::hand_host_over_pays(f, price_ms))
            {
                due.entry(host)
                    .or_insert_with(|| why_hand_over(f, "other hosts' ranks", price_ms));
            }
        }
        for (node, detail) in due {
            self.advance(sup, Input::SlowHost { node, detail });
        }
    }

    /// Hands each open finding over once, when what it has cost the job
    /// reached the price of a hand-over.
    fn hand_over_slow(&mut self, sup: &mut Supervisor) {
        if self.cfg.nnodes > 1 {
            self.hand_over_slow_hosts(sup);
        }
        let price_ms = self.handover_price_ms();
        let due: Vec<_> = self
            .slow
            .findings()
            .iter()
            .filter(|f| {
                crate::slow::replace_pays(f, price_ms)
                    && !self.slow_handed.contains(&(f.rank, f.since_step))
            })
            .cloned()
            .collect();
        for f in due {
            self.slow_handed.insert((f.rank, f.since_step));
            let detail = why_hand_over(&f, "other ranks'", price_ms);
            tracing::warn!(rank = f.rank, %detail, "handing a slow rank to a fresh process");
            self.feed(
                sup,
                Event::Slow {
                    rank: f.rank,
                    detail,
                },
            );
        }
    }
}

/// Why finding `f` is handed over, in words: its excess over `others`,
/// what it has cost, and the price it passed.
fn why_hand_over(f: &hatrain_shared::slowness::SlowFinding, others: &str, price_ms: f64) -> String {
    format!(
        "{} {:.1} ms per step over the {others} since step {}, {:.0} ms lost to it by step {}, more than a hand-over costs ({price_ms:.0} ms)",
        f.phase,
        f.excess_ms,
        f.since_step,
        f.cost_ms(),
        f.last_step
    )
}
