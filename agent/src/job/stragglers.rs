//! This host's ranks' step times fed to the slow-rank detector
//! ([`crate::slow`]); with `--on-slow replace`, a slow rank handed to a
//! fresh process once that pays ([`crate::slow::replace_pays`]).

use super::Driver;
use crate::recovery::Event;
use crate::slow::OnSlow;
use crate::supervisor::Supervisor;
use hatrain_shared::control::FaultAction;

impl Driver<'_> {
    /// Feeds the slow-rank detector this host's ranks' step times; one log
    /// line per finding that begins or ends; a hand-over where it pays.
    pub(super) fn watch_slow(&mut self, sup: &mut Supervisor) {
        let readings: Vec<_> = self
            .stores
            .iter()
            .map(|(&rank, s)| (rank, s.page().step(), s.page().step_times()))
            .collect();
        for change in self.slow.observe(&readings) {
            match change {
                crate::slow::Change::Began(f) => tracing::warn!(
                    rank = f.rank,
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
        if self.cfg.ha.on_slow == OnSlow::Replace {
            self.hand_over_slow(sup);
        }
    }

    /// The price of a hand-over: the recovery time of this job's last
    /// worker reboot, or `--slow-handover-secs` until one was measured.
    fn handover_price_ms(&self) -> f64 {
        let measured = self
            .decider
            .faults()
            .iter()
            .rev()
            .filter(|f| f.class == FaultAction::Reboot)
            .find_map(|f| f.recovery_s);
        1e3 * measured.unwrap_or(self.cfg.ha.slow_handover.as_secs_f64())
    }

    /// Hands each open finding over once, when what it has cost the job
    /// reached the price of a hand-over.
    fn hand_over_slow(&mut self, sup: &mut Supervisor) {
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
            let detail = format!(
                "{} {:.1} ms per step over the other ranks' since step {}, {:.0} ms lost to it by step {}, more than a hand-over costs ({price_ms:.0} ms)",
                f.phase,
                f.excess_ms,
                f.since_step,
                f.cost_ms(),
                f.last_step
            );
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
