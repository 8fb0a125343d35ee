//! The final checkpoint a controller of several hosts waits for: each
//! host writes its share, and the controller commits it once all are in
//! (see `super::super::saves`, which writes and commits on disk).

use super::Controller;
use std::time::Duration;

/// How long the controller waits at most for every host's share of the
/// final checkpoint.
pub(in crate::job) const FINAL_WAIT: Duration = Duration::from_secs(300);

/// The final checkpoint the controller waits for.
#[derive(Debug)]
pub(in crate::job) struct FinalSave {
    pub step: u64,
    pub until: Duration,
    /// Why it cannot be committed, once known.
    pub failed: Option<String>,
}

impl Controller {
    /// Whether it still waits at `now` for shares of the final
    /// checkpoint: not committed, nothing failed, no host holding a
    /// missing rank lost (`lost`), and in time.
    pub(in crate::job) fn final_pending(&self, now: Duration, lost: &[u64]) -> bool {
        let Some(f) = &self.final_save else {
            return false;
        };
        let Some(got) = self.saves.get(&f.step) else {
            // Committed (or failed) already.
            return false;
        };
        // Ranks that left the group (elastic training) write nothing.
        let left = self.machine.retired();
        let missing_lost = lost.iter().any(|&n| {
            self.ranks_on(n)
                .iter()
                .any(|r| !got.contains(r) && !left.contains(r))
        });
        f.failed.is_none() && !missing_lost && now < f.until
    }
}
