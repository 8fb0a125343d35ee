//! This host's ranks' step times fed to the slow-rank detector
//! ([`crate::slow`]).

use super::Driver;

impl Driver<'_> {
    /// Feeds the slow-rank detector this host's ranks' step times; one log
    /// line per finding that begins or ends.
    pub(super) fn watch_slow(&mut self) {
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
    }
}
