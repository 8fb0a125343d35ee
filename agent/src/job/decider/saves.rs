//! The final checkpoint a controller of several hosts waits for: each
//! host writes its share, and the controller commits it once all are in
//! (see `super::super::saves`, which writes and commits on disk).

use super::Controller;
use crate::recovery::WriteFailed;
use std::time::Duration;

/// Periodic steps tracked at most while their shares come in (the oldest
/// go first, with their `_tmp` directories: a step four save intervals
/// behind the newest is not going to be committed).
const PENDING_STEPS: usize = 4;

/// What a host's share of a periodic save comes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::job) enum Share {
    /// A share with a rank the host does not hold: refused.
    Refused { rank: usize },
    /// The share failed: its step is never committed.
    Failed,
    /// Counted; other ranks' shares are still to come.
    Counted,
    /// Every rank of `step` is written: commit it, a checkpoint of `world`
    /// ranks (unless a newer step is on disk); the older steps `stale` are
    /// overtaken.
    Whole {
        step: u64,
        stale: Vec<u64>,
        world: usize,
    },
}

/// What [`Controller::share_saved`] decided, and the steps given up
/// (their `_tmp` directories go).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::job) struct SaveVerdict {
    pub share: Share,
    pub given_up: Vec<u64>,
}

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

impl Controller {
    /// Host `node` wrote the directories of `ranks` of periodic save
    /// `step` (or failed to), in a group whose snapshots are of `world`
    /// ranks: the step is whole once every rank's is written.
    pub(in crate::job) fn share_saved(
        &mut self,
        node: u64,
        step: u64,
        ranks: Vec<usize>,
        result: Result<(), &WriteFailed>,
        world: usize,
    ) -> SaveVerdict {
        if let Err(m) = result {
            // Tracked, so that its `_tmp` directory goes once a newer step
            // is committed (or it is given up).
            self.saves.entry(step).or_default();
            if let Some(f) = self.final_save.as_mut().filter(|f| f.step == step) {
                f.failed = Some(format!("host {node}: {m}"));
            }
            let given_up = self.give_up_saves();
            return SaveVerdict {
                share: Share::Failed,
                given_up,
            };
        }
        if let Some(&rank) = ranks.iter().find(|&&r| !self.holds(node, r)) {
            return SaveVerdict {
                share: Share::Refused { rank },
                given_up: Vec::new(),
            };
        }
        // The size of the group the snapshots are of (elastic training
        // resizes it).
        let world = if self.joined() {
            self.machine.layout_size()
        } else {
            world
        };
        let got = self.saves.entry(step).or_default();
        got.extend(ranks);
        let whole = got.len() >= world;
        let given_up = self.give_up_saves();
        if !whole {
            return SaveVerdict {
                share: Share::Counted,
                given_up,
            };
        }
        let done: Vec<u64> = self.saves.range(..=step).map(|(s, _)| *s).collect();
        for s in &done {
            self.saves.remove(s);
        }
        let stale = done.into_iter().filter(|s| *s < step).collect();
        SaveVerdict {
            share: Share::Whole { step, stale, world },
            given_up,
        }
    }

    /// The final save of `step` was committed, or why not.
    pub(in crate::job) fn final_committed(&mut self, step: u64, failed: Option<String>) {
        if let Some(f) = self.final_save.as_mut().filter(|f| f.step == step) {
            f.failed = failed;
        }
    }

    /// The oldest steps beyond [`PENDING_STEPS`] are given up.
    fn give_up_saves(&mut self) -> Vec<u64> {
        let mut out = Vec::new();
        while self.saves.len() > PENDING_STEPS {
            if let Some((s, _)) = self.saves.pop_first() {
                out.push(s);
            }
        }
        out
    }
}
