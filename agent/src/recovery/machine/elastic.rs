//! Elastic training: a host lost with no standby to take its ranks, with
//! `elastic-training` on, shrinks the data-parallel group instead of
//! stopping the job. The lost ranks leave; the survivors take the places
//! `0..W′` in rank order and resume from the consistent step `s*`, their
//! ZeRO shards re-sliced for `W′` from their own snapshots and the lost
//! ranks' replicas (each rank does it with the others; see the trainer's
//! `reshape`). Nothing goes through the disk.
//!
//! The recovery is an ordinary one (pause, collect, resume) whose resume
//! is a `Reshape` directive carrying each rank's new place. The lost ranks
//! count for `s*` (through their replicas) until it completes, and not
//! after.

use super::*;

/// A shrink in progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Reshaping {
    /// The ranks leaving the group.
    pub leaving: Vec<usize>,
    /// The group's size before.
    pub from: usize,
    /// The fault that started it.
    pub fault: usize,
}

impl Machine {
    /// Whether the loss of `ranks` can be taken by shrinking: elastic
    /// training on, and `hosts_left` at least `--min-nodes`.
    pub(super) fn can_shrink(&self, hosts_left: usize) -> bool {
        self.cfg.modes.elastic && hosts_left >= self.cfg.min_nodes.max(1)
    }

    /// Shrinks the group by `leaving` (the ranks of a lost host), for fault
    /// `f`: the other ranks resume at their new places.
    pub(super) fn shrink(&mut self, now: Duration, f: usize, leaving: &[usize]) {
        let from = self.participants().len();
        for r in leaving {
            if let Some(v) = self.views.get_mut(r) {
                v.alive = false;
            }
            self.protected.remove(r);
        }
        match &mut self.reshape {
            // A shrink during a shrink: one reshape, all of them leaving.
            Some(r) => r.leaving.extend_from_slice(leaving),
            None => {
                self.reshape = Some(Reshaping {
                    leaving: leaving.to_vec(),
                    from,
                    fault: f,
                });
            }
        }
        let to = self.participants().len();
        self.note(
            Level::Warn,
            None,
            format!("shrinking the data-parallel group from {from} to {to} ranks"),
        );
        self.recover(now, f);
    }

    /// The place of `rank` in the group being formed: its index among the
    /// ranks that stay, and their number.
    pub(super) fn place(&self, rank: usize) -> Option<(u64, u64)> {
        self.reshape.as_ref()?;
        let stay = self.participants();
        let i = stay.iter().position(|&r| r == rank)?;
        Some((i as u64, stay.len() as u64))
    }

    /// Whether `rank` has left the group (or is leaving it).
    pub(super) fn left(&self, rank: usize) -> bool {
        self.retired.contains(&rank)
            || self
                .reshape
                .as_ref()
                .is_some_and(|r| r.leaving.contains(&rank))
    }

    /// The recovery that carried the reshape completed at `s_star`: the
    /// leaving ranks are gone for good.
    pub(super) fn reshaped(&mut self, now: Duration, s_star: u64) {
        let Some(r) = self.reshape.take() else {
            return;
        };
        self.retired.extend(&r.leaving);
        self.ranks.retain(|x| !r.leaving.contains(x));
        for x in &r.leaving {
            self.views.remove(x);
        }
        let to = self.participants().len();
        let seconds = now.saturating_sub(self.detected[r.fault]).as_secs_f64();
        self.note(
            Level::Info,
            None,
            format!(
                "resized: the data-parallel group went from {} to {to} ranks at s_star={s_star} in {seconds:.3} s",
                r.from
            ),
        );
        self.resizes.push(Resize {
            fault: Some(self.faults[r.fault].id),
            from: r.from,
            to,
            s_star: Some(s_star),
            seconds: Some(seconds),
        });
    }

    /// The size of the group: its ranks but those that left.
    pub fn world_size(&self) -> usize {
        self.ranks.iter().filter(|&&r| !self.left(r)).count()
    }

    /// The resizes so far.
    pub fn resizes(&self) -> &[Resize] {
        &self.resizes
    }

    /// The ranks that left the group.
    pub fn retired(&self) -> &BTreeSet<usize> {
        &self.retired
    }

    /// The leaving ranks of a reshape in progress.
    pub fn leaving(&self) -> Vec<usize> {
        self.reshape
            .as_ref()
            .map(|r| r.leaving.clone())
            .unwrap_or_default()
    }
}
