//! The replica hold: the steps every host keeps for the peer replicas, so
//! that whichever host is lost, its ranks' replicas and every other
//! rank's store have a step in common (`hatrain_shared::shm::Kept`).
//!
//! Survivors commit every step and keep only a few; a replica of a host's
//! ranks may lag many steps behind (its stream takes idle CPU only). A
//! step is kept everywhere in two phases, so that at every moment one is:
//!
//! 1. The controller names a **target**, a step no rank has reached yet
//!    (the newest step any rank completed, plus [`LEAD`]). Each store keeps
//!    the first snapshot it seals at or after it; each stream sends that
//!    snapshot to the rank's holder ahead of newer ones, and the holder's
//!    replica store keeps it as well.
//! 2. Once every rank's store keeps the same step for the target, and a
//!    replica of every rank holds it (sealed in this epoch), it becomes
//!    the **common** step; the old common step is let go, and a new target
//!    is named.
//!
//! The stores kept different steps for the target (it was named late for
//! some rank: the job's steps are shorter than the orders take), or it
//! was not reached within [`GIVE_UP`]: a new target is named, the common
//! step stays. Each disagreement names the next target twice as far
//! ahead; each target reached, one step nearer again (never under
//! [`LEAD`]). A recovery names a new target too (the
//! timeline after its step is new); the common step, at or before the
//! step it resumed from, stays.
//!
//! A controller that takes over names nothing until every host of the
//! group has reported what it keeps: its predecessor may have made a
//! target the common step and told only some hosts. Any host's common
//! step is held by every store (as the common step, or kept for the
//! target it was), so the newest one reported is taken.

use super::Down;
use super::step::{Facts, Out};
use hatrain_shared::shm::Kept;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// Steps between the newest step a rank completed and a target named, at
/// least.
pub const LEAD: u64 = 2;
/// ...and at most.
const MAX_LEAD: u64 = 1024;
/// How long a target may take to be reached before another is named.
pub const GIVE_UP: Duration = Duration::from_secs(30);
/// How long a host must have reported a kept snapshot or a replica's step
/// before it counts: a report may be read just as a store begins to
/// rewrite the slot (before its host had applied the target), and a later
/// report shows it gone.
pub const STABLE: Duration = Duration::from_millis(150);

/// What a host tells the controller for the replica hold.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldReport {
    /// The replicas it holds, by rank: their sealed steps and epochs.
    pub replicas: Vec<(usize, Vec<(u64, u64)>)>,
    /// The common step and the target its stores keep.
    #[serde(default)]
    pub common: Option<u64>,
    pub target: Option<u64>,
    /// By rank of the host, the snapshot (step, epoch) its store keeps for
    /// that target, once it has sealed one at or after it.
    pub kept: Vec<(usize, Option<(u64, u64)>)>,
}

/// A host's last report, and since when it has reported each fact in it.
#[derive(Debug, Default)]
struct Seen {
    report: HoldReport,
    /// By rank: since when its store has kept the same snapshot for the
    /// same target.
    kept: BTreeMap<usize, Duration>,
    /// By rank, step and epoch: since when a replica has held it.
    replicas: BTreeMap<(usize, u64, u64), Duration>,
}

impl Seen {
    fn take(&mut self, now: Duration, r: HoldReport) {
        let old = std::mem::take(&mut self.report);
        let mut kept = BTreeMap::new();
        for &(rank, k) in &r.kept {
            let same =
                old.target == r.target && old.kept.iter().any(|&(o, ok)| o == rank && ok == k);
            let since = self
                .kept
                .get(&rank)
                .copied()
                .filter(|_| same)
                .unwrap_or(now);
            kept.insert(rank, since);
        }
        let mut replicas = BTreeMap::new();
        for (rank, sealed) in &r.replicas {
            for &(step, epoch) in sealed {
                let key = (*rank, step, epoch);
                replicas.insert(key, self.replicas.get(&key).copied().unwrap_or(now));
            }
        }
        *self = Self {
            report: r,
            kept,
            replicas,
        };
    }
}

/// The controller's side (see the module's doc).
#[derive(Debug, Default)]
pub struct Hold {
    kept: Kept,
    /// The epoch the target was named in, and when.
    epoch: u64,
    named: Duration,
    reports: BTreeMap<u64, Seen>,
    sent: Option<Kept>,
    /// Taken over from another controller: nothing is named until every
    /// host has reported.
    inherited: bool,
    /// How far ahead the next target is named (see the module's doc).
    lead: u64,
}

impl Hold {
    /// The hold of a controller that takes over, from what this host
    /// keeps (see the module's doc).
    pub fn inherited(own: Kept) -> Self {
        Self {
            kept: own,
            sent: Some(own),
            inherited: true,
            ..Self::default()
        }
    }

    /// Host `node` reported at `now`.
    pub fn report(&mut self, now: Duration, node: u64, r: HoldReport) {
        self.reports.entry(node).or_default().take(now, r);
    }

    /// Host `node` is lost: what it held is gone.
    pub fn forget(&mut self, node: u64) {
        self.reports.remove(&node);
    }

    /// Moves the hold on at `now`, for the group's ranks (each with the
    /// node it runs on and the last step it completed) under `epoch`;
    /// returns what every host is to keep when that changed.
    pub fn advance(
        &mut self,
        now: Duration,
        epoch: u64,
        ranks: &[(usize, u64, u64)],
    ) -> Option<Kept> {
        let newest = ranks.iter().map(|&(_, _, step)| step).max().unwrap_or(0);
        if self.inherited {
            if !ranks
                .iter()
                .all(|(_, node, _)| self.reports.contains_key(node))
            {
                return None;
            }
            self.inherited = false;
            self.kept.common = self
                .reports
                .values()
                .map(|s| s.report.common)
                .max()
                .flatten();
            self.kept.target = None;
            self.epoch = epoch;
        }
        if epoch != self.epoch {
            self.epoch = epoch;
            self.kept.target = None;
        }
        match self.kept.target {
            None => self.name(now, newest),
            Some(t) => match self.reached(now, t, ranks) {
                Reached::Yes(x) => {
                    self.kept.common = Some(x);
                    self.lead = self.lead.saturating_sub(1);
                    self.name(now, newest.max(x));
                }
                Reached::Disagree => {
                    self.lead = (self.lead.max(LEAD) * 2).min(MAX_LEAD);
                    self.name(now, newest)
                }
                Reached::NotYet if now.saturating_sub(self.named) >= GIVE_UP => {
                    self.name(now, newest)
                }
                Reached::NotYet => {}
            },
        }
        (self.sent != Some(self.kept)).then(|| {
            self.sent = Some(self.kept);
            self.kept
        })
    }

    fn name(&mut self, now: Duration, newest: u64) {
        self.kept.target = Some(newest + self.lead.max(LEAD));
        self.named = now;
    }

    /// Whether target `t` was reached at `now`: the step every store
    /// keeps for it, held by a replica of every rank that has one, each
    /// reported for [`STABLE`] at least.
    fn reached(&self, now: Duration, t: u64, ranks: &[(usize, u64, u64)]) -> Reached {
        let stable = |since: Duration| now.saturating_sub(since) >= STABLE;
        // Each rank's kept snapshot, and the holders of its replicas with
        // their sealed steps, by rank (one pass over the reports).
        let mut kept: BTreeMap<usize, (Option<(u64, u64)>, bool)> = BTreeMap::new();
        let mut held: BTreeMap<usize, Vec<(u64, &Seen)>> = BTreeMap::new();
        for (&node, seen) in &self.reports {
            let r = &seen.report;
            if r.target == Some(t) {
                for &(rank, k) in &r.kept {
                    let since = seen.kept.get(&rank).copied().unwrap_or(now);
                    kept.insert(rank, (k, stable(since)));
                }
            }
            for (rank, _) in &r.replicas {
                held.entry(*rank).or_default().push((node, seen));
            }
        }
        let mut x = None;
        for &(rank, _, _) in ranks {
            match kept.get(&rank) {
                Some((Some((step, e)), steady)) if *e >= self.epoch => {
                    match x {
                        None => x = Some(*step),
                        Some(x) if x != *step => return Reached::Disagree,
                        Some(_) => {}
                    }
                    if !steady {
                        return Reached::NotYet;
                    }
                }
                _ => return Reached::NotYet,
            }
        }
        let Some(x) = x else {
            return Reached::NotYet;
        };
        for &(rank, node, _) in ranks {
            let holders: Vec<_> = held
                .get(&rank)
                .into_iter()
                .flatten()
                .filter(|(n, _)| *n != node)
                .collect();
            if holders.is_empty() {
                // No live host holds a replica of it: nothing to wait for.
                continue;
            }
            let has = |seen: &Seen| {
                seen.replicas.iter().any(|(&(r, s, e), &since)| {
                    r == rank && s == x && e >= self.epoch && stable(since)
                })
            };
            if !holders.iter().any(|(_, seen)| has(seen)) {
                return Reached::NotYet;
            }
        }
        Reached::Yes(x)
    }
}

impl super::Controller {
    /// The steps every host keeps for the replicas (`super::hold`), sent
    /// to each when they change (after the step's other orders).
    pub(super) fn keep_for_replicas(&mut self, now: Duration, facts: &Facts, out: &mut Out) {
        let Some(own) = &facts.own_hold else {
            return;
        };
        self.hold.report(now, self.node, own.clone());
        for &n in &facts.gone {
            self.hold.forget(n);
        }
        let ranks: Vec<(usize, u64, u64)> = self
            .machine
            .members_at()
            .into_iter()
            .map(|(r, step)| (r, self.node_of(r), step))
            .collect();
        let Some(kept) = self.hold.advance(now, self.machine.epoch(), &ranks) else {
            return;
        };
        out.ready.keep = Some(kept);
        if !self.joined() {
            return;
        }
        let everyone: Vec<u64> = self.everyone().collect();
        for n in everyone {
            out.ready.orders.push((
                n,
                Down {
                    keep: Some(kept),
                    ..Down::default()
                },
            ));
        }
    }
}

enum Reached {
    Yes(u64),
    Disagree,
    NotYet,
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);
    const Z: Duration = Duration::ZERO;

    fn report(
        target: Option<u64>,
        kept: &[(usize, u64)],
        replicas: &[(usize, &[u64])],
    ) -> HoldReport {
        HoldReport {
            common: None,
            replicas: replicas
                .iter()
                .map(|(r, steps)| (*r, steps.iter().map(|&s| (s, 1)).collect()))
                .collect(),
            target,
            kept: kept.iter().map(|&(r, s)| (r, Some((s, 1)))).collect(),
        }
    }

    /// Two hosts of one rank, each holding the other's replica.
    fn ranks(step: u64) -> Vec<(usize, u64, u64)> {
        vec![(0, 0, step), (1, 1, step)]
    }

    #[test]
    fn a_target_becomes_the_common_step_once_every_store_and_a_replica_of_every_rank_hold_it() {
        let mut h = Hold::default();
        let k = h.advance(S, 1, &ranks(10)).unwrap();
        assert_eq!(
            k,
            Kept {
                common: None,
                target: Some(12)
            }
        );
        assert_eq!(h.advance(S, 1, &ranks(11)), None, "unchanged");
        // The stores keep 12; rank 1's replica on host 0 has it, rank 0's
        // on host 1 not yet: it waits, whatever the steps do.
        h.report(Z, 0, report(Some(12), &[(0, 12)], &[(1, &[12, 11])]));
        h.report(Z, 1, report(Some(12), &[(1, 12)], &[(0, &[9])]));
        assert_eq!(h.advance(2 * S, 1, &ranks(20)), None);
        h.report(Z, 1, report(Some(12), &[(1, 12)], &[(0, &[12, 9])]));
        let k = h.advance(3 * S, 1, &ranks(21)).unwrap();
        assert_eq!(
            k,
            Kept {
                common: Some(12),
                target: Some(23)
            }
        );
        // A replica of an older epoch (another timeline) does not count.
        h.report(Z, 0, report(Some(23), &[(0, 23)], &[(1, &[23])]));
        let mut old = report(Some(23), &[(1, 23)], &[]);
        old.replicas = vec![(0, vec![(23, 0)])];
        h.report(Z, 1, old);
        assert_eq!(h.advance(4 * S, 1, &ranks(24)), None);
    }

    #[test]
    fn stores_that_kept_different_steps_a_recovery_or_a_target_never_reached_name_another() {
        let mut h = Hold::default();
        h.advance(S, 1, &ranks(10));
        // Rank 1 heard of the target late: it kept 13.
        h.report(Z, 0, report(Some(12), &[(0, 12)], &[(1, &[13])]));
        h.report(Z, 1, report(Some(12), &[(1, 13)], &[(0, &[12])]));
        // The next one is named twice as far ahead.
        let k = h.advance(2 * S, 1, &ranks(14)).unwrap();
        assert_eq!(
            k,
            Kept {
                common: None,
                target: Some(18)
            }
        );
        // A recovery: a new target; the common step stays.
        h.kept.common = Some(8);
        let k = h.advance(3 * S, 2, &ranks(15)).unwrap();
        assert_eq!(
            k,
            Kept {
                common: Some(8),
                target: Some(19)
            }
        );
        // Not reached within the bound: another.
        assert_eq!(h.advance(3 * S + GIVE_UP - S, 2, &ranks(30)), None);
        let k = h.advance(3 * S + GIVE_UP, 2, &ranks(31)).unwrap();
        assert_eq!(
            k,
            Kept {
                common: Some(8),
                target: Some(35)
            }
        );
    }

    #[test]
    fn a_rank_no_live_host_holds_a_replica_of_does_not_hold_the_others_back() {
        let mut h = Hold::default();
        h.advance(S, 1, &ranks(10));
        h.report(Z, 0, report(Some(12), &[(0, 12)], &[(1, &[12])]));
        h.report(Z, 1, report(Some(12), &[(1, 12)], &[(0, &[12])]));
        h.forget(1);
        // Host 1 lost: rank 1 runs on a standby (node 2) now, which holds
        // no replica yet; rank 1's replica is on host 0.
        h.report(Z, 2, report(Some(12), &[(1, 12)], &[]));
        let ranks = [(0, 0, 12), (1, 2, 12)];
        let k = h.advance(2 * S, 1, &ranks).unwrap();
        assert_eq!(k.common, Some(12));
    }

    /// A successor waits for every host's report, then takes the newest
    /// common step any reports: its predecessor told only host 1 of it.
    #[test]
    fn a_controller_that_takes_over_takes_the_newest_common_step_once_every_host_reported() {
        let own = Kept {
            common: Some(8),
            target: Some(12),
        };
        let mut h = Hold::inherited(own);
        let ranks = [(0, 0, 14), (1, 1, 14)];
        h.report(
            Z,
            0,
            HoldReport {
                common: Some(8),
                ..report(Some(12), &[(0, 12)], &[])
            },
        );
        assert_eq!(h.advance(S, 3, &ranks), None, "host 1 not heard yet");
        h.report(
            Z,
            1,
            HoldReport {
                common: Some(12),
                ..report(Some(20), &[(1, 20)], &[])
            },
        );
        let k = h.advance(2 * S, 3, &ranks).unwrap();
        assert_eq!(
            k,
            Kept {
                common: Some(12),
                target: Some(16)
            }
        );
    }

    /// A kept snapshot or a replica's step counts once it has been
    /// reported for [`STABLE`]; one that went meanwhile never does.
    #[test]
    fn what_a_host_reports_counts_once_it_has_held_for_a_while() {
        let mut h = Hold::default();
        h.advance(S, 1, &ranks(10));
        let t = S + S / 10;
        h.report(t, 0, report(Some(12), &[(0, 12)], &[(1, &[12])]));
        h.report(t, 1, report(Some(12), &[(1, 12)], &[(0, &[12])]));
        assert_eq!(h.advance(t + STABLE / 2, 1, &ranks(12)), None, "too fresh");
        // Rank 0's replica on host 1 lost step 12 before it counted: a
        // new report says so, and the step counts only once it is back
        // for long enough.
        h.report(
            t + STABLE / 2,
            1,
            report(Some(12), &[(1, 12)], &[(0, &[13])]),
        );
        assert_eq!(h.advance(t + 2 * STABLE, 1, &ranks(13)), None);
        let back = t + 2 * STABLE;
        h.report(back, 1, report(Some(12), &[(1, 12)], &[(0, &[13, 12])]));
        assert_eq!(h.advance(back + STABLE / 2, 1, &ranks(13)), None);
        let k = h.advance(back + STABLE, 1, &ranks(13)).unwrap();
        assert_eq!(k.common, Some(12));
    }
}
