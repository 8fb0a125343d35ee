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
//!
//! The group grows back when a standby host is heard: the controller
//! places a lost host's ranks there ([`Machine::grow`]); once they have
//! registered, every rank pauses at its step boundary and the group
//! reshapes at `s*` over the old ranks' snapshots, the new ranks taking
//! their state from the others. A host lost meanwhile is one more shrink
//! in the same reshape (its joining ranks, which hold nothing, leave
//! again).

use super::*;

/// A resize in progress: a shrink, a grow, or both at once. A controller
/// that takes the job over inherits it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Reshaping {
    /// The ranks leaving the group.
    pub leaving: Vec<usize>,
    /// The ranks joining it (they hold no state yet).
    pub joining: Vec<usize>,
    /// The group's size before.
    pub from: usize,
    /// The fault that started it (its index among the job's faults; none
    /// for a grow).
    pub fault: Option<usize>,
    /// When it started, on the job's clock.
    pub since: Duration,
    /// Its directives went out: every rank that stays was told its place.
    #[serde(default)]
    pub resumed: Option<Resumed>,
}

/// A reshape's directives, as they went out.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Resumed {
    /// The step the group reshaped at.
    pub step: u64,
    /// The ranks that had left it, and those that had joined it.
    pub left: Vec<usize>,
    pub joined: Vec<usize>,
    /// The group's size after it.
    pub world: usize,
}

impl Machine {
    /// Whether the loss of `ranks` can be taken by shrinking: elastic
    /// training on, and `hosts_left` at least `--min-nodes`.
    pub(super) fn can_shrink(&self, hosts_left: usize) -> bool {
        self.cfg.modes.elastic && hosts_left >= self.cfg.min_nodes.max(1)
    }

    /// Shrinks the group by `leaving` (the ranks of a lost host), for fault
    /// `f`, and `stand_by` (live ranks left out so that the group's size
    /// divides the global batch; they stop, their state goes on in their
    /// replicas): the other ranks resume at their new places.
    pub(super) fn shrink(
        &mut self,
        now: Duration,
        f: usize,
        leaving: &[usize],
        stand_by: &[usize],
    ) {
        let from = self.participants().len();
        for r in leaving {
            if let Some(v) = self.views.get_mut(r) {
                v.alive = false;
            }
            self.exits.insert(*r);
            self.protected.remove(r);
        }
        for &r in stand_by {
            self.protected.remove(&r);
            if self.view(r).alive {
                self.cmd(Command::Post {
                    rank: r,
                    directive: Directive::Stop,
                });
            }
        }
        let leaving: Vec<usize> = leaving.iter().chain(stand_by).copied().collect();
        let leaving = leaving.as_slice();
        match &mut self.reshape {
            // A shrink during a shrink: one reshape, all of them leaving.
            Some(r) => r.leaving.extend_from_slice(leaving),
            None => {
                self.reshape = Some(Reshaping {
                    leaving: leaving.to_vec(),
                    joining: Vec::new(),
                    from,
                    fault: Some(f),
                    since: self.detected[f],
                    resumed: None,
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

    /// Lost ranks `ranks` come back on a standby host: once they have all
    /// registered, the group reshapes with them. False (nothing done)
    /// unless the job runs with no reshape in progress.
    pub fn grow(&mut self, now: Duration, ranks: &[usize]) -> bool {
        if self.reshape.is_some()
            || !matches!(self.state, State::Running)
            || ranks.is_empty()
            || !ranks.iter().all(|r| self.retired.contains(r))
        {
            return false;
        }
        let from = self.world_size();
        for &r in ranks {
            self.retired.remove(&r);
            self.views.insert(r, RankView::absent(r));
        }
        self.ranks.extend_from_slice(ranks);
        self.ranks.sort_unstable();
        for &r in ranks {
            // Started on the standby, where the controller placed them.
            self.respawn(now, r, 0);
        }
        self.reshape = Some(Reshaping {
            leaving: Vec::new(),
            joining: ranks.to_vec(),
            from,
            fault: None,
            since: now,
            resumed: None,
        });
        self.note(
            Level::Info,
            None,
            format!(
                "growing the data-parallel group from {from} to {} ranks: ranks {ranks:?} start on a standby host",
                self.world_size()
            ),
        );
        true
    }

    /// On a registration: when every joining rank has registered (and the
    /// job runs), the group pauses to reshape with them.
    pub(super) fn maybe_reshape(&mut self, now: Duration) {
        let Some(r) = &self.reshape else {
            return;
        };
        let ready = r
            .joining
            .iter()
            .filter(|j| !r.leaving.contains(j))
            .all(|&j| self.view(j).registered);
        if ready && !r.joining.is_empty() && matches!(self.state, State::Running) {
            self.begin_recovery(now, Vec::new());
        }
    }

    /// Ranks joining the group: they hold no state to collect.
    pub fn joining(&self) -> Vec<usize> {
        self.reshape
            .as_ref()
            .map(|r| r.joining.clone())
            .unwrap_or_default()
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

    /// A reshape whose directives went out, and past whose step every
    /// rank that stays now holds a snapshot (`by_rank`), took: the ranks
    /// trained at their new places. A recovery that began before it was
    /// seen to complete (a fault in its first step, or a controller lost
    /// then, whose successor inherits it) counts it done, or it would
    /// look for the leaving ranks' state at steps only the new layout
    /// has.
    pub(super) fn settle_resumed(&mut self, now: Duration, by_rank: &HashMap<usize, Vec<u64>>) {
        let Some(done) = self.reshape.as_ref().and_then(|r| r.resumed.clone()) else {
            return;
        };
        let stay: Vec<usize> = self
            .ranks
            .iter()
            .copied()
            .filter(|r| !self.retired.contains(r) && !done.left.contains(r))
            .collect();
        let past = !stay.is_empty()
            && stay.iter().all(|r| {
                by_rank
                    .get(r)
                    .is_some_and(|s| s.iter().any(|&t| t > done.step))
            });
        if !past {
            return;
        }
        let newest = self.faults.len().checked_sub(1);
        let Some(r) = self.reshape.as_mut() else {
            return;
        };
        r.resumed = None;
        r.leaving.retain(|x| !done.left.contains(x));
        r.joining.retain(|x| !done.joined.contains(x));
        let (from, fault) = (r.from, r.fault);
        r.from = done.world;
        // What still changes is the newest fault's.
        r.fault = newest.filter(|f| Some(*f) != fault);
        r.since = now;
        let rest = !r.leaving.is_empty() || !r.joining.is_empty();
        self.retired.extend(&done.left);
        self.ranks.retain(|x| !done.left.contains(x));
        for x in &done.left {
            self.views.remove(x);
        }
        self.note(
            Level::Info,
            None,
            format!(
                "the resize from {from} to {} ranks at s_star={} had taken: every rank that stays trained past it",
                done.world, done.step
            ),
        );
        self.resizes.push(Resize {
            fault: fault.map(|f| self.faults[f].id),
            from,
            to: done.world,
            s_star: Some(done.step),
            seconds: None,
        });
        if !rest {
            self.reshape = None;
            self.place_participants();
        }
    }

    /// Each rank of the group takes its place in rank order; the group's
    /// size.
    fn place_participants(&mut self) -> usize {
        let stay = self.participants();
        let to = stay.len();
        self.places = stay
            .iter()
            .enumerate()
            .map(|(i, &rank)| (rank, (i as u64, to as u64)))
            .collect();
        to
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
        let to = self.place_participants();
        let seconds = now.saturating_sub(r.since).as_secs_f64();
        self.note(
            Level::Info,
            None,
            format!(
                "resized: the data-parallel group went from {} to {to} ranks at s_star={s_star} in {seconds:.3} s",
                r.from
            ),
        );
        self.resizes.push(Resize {
            fault: r.fault.map(|f| self.faults[f].id),
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

    /// The size of the group the snapshots are of: during a resize, the
    /// size before it (a checkpoint written then is of that layout).
    pub fn layout_size(&self) -> usize {
        self.reshape
            .as_ref()
            .map_or_else(|| self.world_size(), |r| r.from)
    }

    /// The place a process of `rank` started now takes: its place after
    /// the last resize (none before one, or while it is leaving).
    pub fn place_now(&self, rank: usize) -> Option<(u64, u64)> {
        self.places.get(&rank).copied()
    }

    /// Every rank's place after the last resize.
    pub fn places(&self) -> &BTreeMap<usize, (u64, u64)> {
        &self.places
    }

    /// The resizes so far.
    pub fn resizes(&self) -> &[Resize] {
        &self.resizes
    }

    /// The resize in progress, if one is.
    pub fn reshaping(&self) -> Option<&Reshaping> {
        self.reshape.as_ref()
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
