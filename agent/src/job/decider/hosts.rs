//! The controller's decisions on hosts: a host lost (its ranks, the
//! standby that takes them, the hand-over's orders) and the group grown
//! back onto a standby. Pure calls: the facts and the instant come in, the
//! orders go out as data, which the driver sends.

use super::{Adopt, Controller, Give};
use crate::recovery::{HostLoss, OnDisk};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// What the controller decides on a lost host, from the facts given to it
/// ([`Controller::on_host_lost`]): no clock, no disk, no socket.
#[derive(Debug, Clone, PartialEq)]
pub(in crate::job) enum OnLoss {
    /// No majority of the job's agents follows this controller: the loss
    /// waits until one does (or another controller acts).
    HoldBack(HostLoss),
    /// A take-over is settling, or every live host reports once more
    /// before state is found lost: the loss is decided once it has.
    Settling,
    /// A standby that held no ranks is lost: nothing to recover.
    StandbyLost { node: u64 },
    /// The machine recovers from `loss`, after the hand-over of its ranks
    /// to a standby host when there is one.
    Recover {
        loss: HostLoss,
        handover: Option<Handover>,
    },
}

/// A lost host's ranks go to standby `to`: it takes them (`adopt`), and
/// each of `givers` streams it the replicas it holds of them (`give`), as
/// this host does.
#[derive(Debug, Clone, PartialEq)]
pub(in crate::job) struct Handover {
    pub to: u64,
    pub adopt: Adopt,
    pub give: Give,
    pub givers: Vec<u64>,
}

/// The group grows back onto a standby: it takes the ranks (`adopt`, with
/// nothing to fill), and every other member places the replicas of that
/// node on it again (`regrow`), as this host does.
#[derive(Debug, Clone, PartialEq)]
pub(in crate::job) struct Growth {
    pub adopt: Adopt,
    pub regrow: Give,
    pub others: Vec<u64>,
}

/// What the controller is told beside a host loss.
#[derive(Debug, Clone)]
pub(in crate::job) struct LossFacts<'a> {
    /// A majority of the job's agents follows this controller.
    pub acting: bool,
    /// Worker reboot is on (a standby host may take the ranks).
    pub reboot: bool,
    /// Every host lost so far, this one included.
    pub gone: &'a [u64],
    /// The ranks whose replicas this host holds, each with a sealed step.
    pub own_held: &'a [usize],
    /// The newest complete checkpoint on disk.
    pub on_disk: Option<OnDisk>,
    /// The job's clock.
    pub now: Duration,
}

impl Controller {
    /// Decides on `loss` (as the coordinator reported it: its node and
    /// how it was seen): the ranks it held, the standby that takes them
    /// and the orders of the hand-over, or why nothing is decided now.
    pub(in crate::job) fn on_host_lost(&mut self, loss: HostLoss, facts: LossFacts<'_>) -> OnLoss {
        let loss = self.why_lost(loss);
        if let Some(s) = &mut self.settling {
            s.losses.push(loss);
            return OnLoss::Settling;
        }
        if !facts.acting && !self.given_up {
            return OnLoss::HoldBack(loss);
        }
        let node = loss.node;
        self.note_held(self.node, facts.own_held.iter().copied());
        if self.rehear(&loss, facts.gone, facts.now) {
            return OnLoss::Settling;
        }
        let Some(placed) = self.host_lost(node, facts.reboot, facts.gone) else {
            return OnLoss::StandbyLost { node };
        };
        let handover = placed.spare.map(|to| Handover {
            to,
            adopt: Adopt {
                node,
                ranks: placed.ranks.clone(),
                fill: true,
            },
            give: Give { node, to },
            givers: self.others().filter(|&n| n != to).collect(),
        });
        let stand_by = match (placed.spare, self.machine.global_batch()) {
            (None, Some(batch)) => self.stand_by(batch, &placed.ranks, facts.gone),
            _ => Vec::new(),
        };
        OnLoss::Recover {
            loss: HostLoss {
                ranks: placed.ranks,
                spare: placed.spare,
                state_lost: placed.state_lost,
                on_disk: facts.on_disk,
                hosts_left: self.hosts_left(facts.gone),
                stand_by,
                ..loss
            },
            handover,
        }
    }

    /// Should the group shrink without `lost`, the ranks that stand by so
    /// that its size divides `batch` ([`stand_by`]).
    fn stand_by(&self, batch: u64, lost: &[usize], gone: &[u64]) -> Vec<usize> {
        let mut hosts: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        for (rank, _) in self.machine.members_at() {
            let n = self.node_of(rank);
            if !lost.contains(&rank) && !gone.contains(&n) {
                hosts.entry(n).or_default().push(rank);
            }
        }
        stand_by(batch, &hosts, lost, &self.held)
    }

    /// A standby heard while ranks have left the group: the ranks of the
    /// lowest lost host that left come back there. The machine grows the
    /// group at `now` ([`Machine::grow`](crate::recovery::Machine::grow));
    /// only once it has are the ranks placed on the standby, which then
    /// holds them instead of waiting as a spare.
    pub(in crate::job) fn grow(&mut self, now: Duration) -> Option<Growth> {
        let (spare, node, ranks) = self.grow_onto()?;
        if !self.machine.grow(now, &ranks) {
            return None;
        }
        self.spares.remove(&spare);
        self.members.insert(spare);
        for &r in &ranks {
            self.placement.insert(r, spare);
        }
        let others = self.others().filter(|&n| n != spare).collect();
        Some(Growth {
            adopt: Adopt {
                node,
                ranks,
                fill: false,
            },
            regrow: Give { node, to: spare },
            others,
        })
    }

    /// The standby, the node it would play and the ranks that would come
    /// back, were the group to grow now; nothing changes.
    fn grow_onto(&self) -> Option<(u64, u64, Vec<usize>)> {
        let retired = self.machine.retired();
        if retired.is_empty() || self.machine.recovering() || !self.machine.joining().is_empty() {
            return None;
        }
        let spare = self
            .spares
            .iter()
            .copied()
            .find(|s| self.heard.contains(s))?;
        // By the node the ranks were launched on: a standby that held them
        // may be lost since.
        let per = self.per_node;
        let (node, ranks) = (0..self.nodes)
            .filter(|n| !self.members.contains(n))
            .map(|n| {
                (
                    n,
                    (n as usize * per..(n as usize + 1) * per).collect::<Vec<_>>(),
                )
            })
            .find(|(_, r)| !r.is_empty() && r.iter().all(|x| retired.contains(x)))?;
        // The group grows only to a size that divides the global batch.
        let to = self.machine.world_size() + ranks.len();
        if self
            .machine
            .global_batch()
            .is_some_and(|b| !b.is_multiple_of(to as u64))
        {
            return None;
        }
        Some((spare, node, ranks))
    }
}

/// The ranks that stand by when a group of `hosts` (each host's ranks
/// that stay in the group) goes on without `lost`, so that its size
/// divides the global batch `batch`: the largest size that divides it and
/// that whole hosts standing by, the highest first, can reach, while each
/// rank that leaves keeps a replica (by `held`, each host's replicas) on a
/// host that stays, from which that host brings it to the reshape. None
/// when the size divides the batch already; none either when no choice
/// keeps every leaving rank's state (the reshape then names the size).
pub(in crate::job) fn stand_by(
    batch: u64,
    hosts: &BTreeMap<u64, Vec<usize>>,
    lost: &[usize],
    held: &BTreeMap<u64, BTreeSet<usize>>,
) -> Vec<usize> {
    let stay: usize = hosts.values().map(Vec::len).sum();
    if stay == 0 || batch.is_multiple_of(stay as u64) {
        return Vec::new();
    }
    // Every leaving rank has a replica on a host that stays.
    let kept = |out: &BTreeSet<u64>| {
        lost.iter()
            .chain(out.iter().flat_map(|n| &hosts[n]))
            .all(|r| {
                hosts.iter().any(|(n, ranks)| {
                    !out.contains(n)
                        && !ranks.is_empty()
                        && held.get(n).is_some_and(|h| h.contains(r))
                })
            })
    };
    for size in (1..stay).rev().filter(|&w| batch.is_multiple_of(w as u64)) {
        let mut out = BTreeSet::new();
        let mut left = stay;
        for (&n, ranks) in hosts.iter().rev() {
            if left == size {
                break;
            }
            if ranks.is_empty() || left - ranks.len() < size {
                continue;
            }
            out.insert(n);
            if kept(&out) {
                left -= ranks.len();
            } else {
                out.remove(&n);
            }
        }
        if left == size {
            return out.iter().flat_map(|n| hosts[n].iter().copied()).collect();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::stand_by;
    use std::collections::{BTreeMap, BTreeSet};

    /// Hosts `0..n` of `per` ranks, each host's replicas on the next.
    fn ring(n: u64, per: usize) -> BTreeMap<u64, BTreeSet<usize>> {
        (0..n)
            .map(|h| {
                let from = (h + n - 1) % n;
                (
                    h,
                    (from as usize * per..(from as usize + 1) * per).collect(),
                )
            })
            .collect()
    }

    fn hosts(nodes: &[u64], per: usize) -> BTreeMap<u64, Vec<usize>> {
        nodes
            .iter()
            .map(|&n| (n, (n as usize * per..(n as usize + 1) * per).collect()))
            .collect()
    }

    #[test]
    fn the_largest_size_dividing_the_batch_that_keeps_every_state() {
        // 4 hosts of 1 rank, batch 8, host 1 lost: 3 left, 2 go on. Host 3
        // (the highest) stands by: its rank's replica is on host 0.
        let held = ring(4, 1);
        assert_eq!(stand_by(8, &hosts(&[0, 2, 3], 1), &[1], &held), vec![3]);
        // A size that divides the batch already: nobody stands by.
        assert!(stand_by(12, &hosts(&[0, 2, 3], 1), &[1], &held).is_empty());
        // 5 hosts of 2, batch 12, host 4 lost: 8 ranks left, 6 go on.
        // Host 3's replicas were on host 4, so host 2 stands by.
        let held = ring(5, 2);
        assert_eq!(
            stand_by(12, &hosts(&[0, 1, 2, 3], 2), &[8, 9], &held),
            vec![4, 5]
        );
    }

    #[test]
    fn a_host_holding_the_only_replica_of_a_leaving_rank_stays() {
        // Host 3 holds the only replica of lost rank 1: host 2 stands by
        // instead (its rank's replica is on host 3).
        let held = BTreeMap::from([
            (0, BTreeSet::from([3])),
            (2, BTreeSet::from([0])),
            (3, BTreeSet::from([1, 2])),
        ]);
        assert_eq!(stand_by(8, &hosts(&[0, 2, 3], 1), &[1], &held), vec![2]);
        // Nobody can stand by and keep every state: none does.
        let held = BTreeMap::from([(3, BTreeSet::from([1])), (2, BTreeSet::from([3]))]);
        assert!(stand_by(8, &hosts(&[0, 2, 3], 1), &[1], &held).is_empty());
    }
}
