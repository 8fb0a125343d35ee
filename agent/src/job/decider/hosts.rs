//! The controller's decisions on hosts: a host lost (its ranks, the
//! standby that takes them, the hand-over's orders) and the group grown
//! back onto a standby. Pure calls: the facts and the instant come in, the
//! orders go out as data, which the driver sends.

use super::{Adopt, Controller, Give};
use crate::recovery::{HostLoss, OnDisk};
use std::time::Duration;

/// What the controller decides on a lost host, from the facts given to it
/// ([`Controller::on_host_lost`]): no clock, no disk, no socket.
#[derive(Debug, Clone, PartialEq)]
pub(in crate::job) enum OnLoss {
    /// No majority of the job's agents follows this controller: the loss
    /// waits until one does (or another controller acts).
    HoldBack(HostLoss),
    /// A take-over is settling: the loss is decided once it has.
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
}

impl Controller {
    /// Decides on `loss` (as the coordinator reported it: its node and
    /// how it was seen): the ranks it held, the standby that takes them
    /// and the orders of the hand-over, or why nothing is decided now.
    pub(in crate::job) fn on_host_lost(&mut self, loss: HostLoss, facts: LossFacts<'_>) -> OnLoss {
        if let Some(s) = &mut self.settling {
            s.losses.push(loss);
            return OnLoss::Settling;
        }
        if !facts.acting && !self.given_up {
            return OnLoss::HoldBack(loss);
        }
        let node = loss.node;
        self.note_held(self.node, facts.own_held.iter().copied());
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
        OnLoss::Recover {
            loss: HostLoss {
                ranks: placed.ranks,
                spare: placed.spare,
                state_lost: placed.state_lost,
                on_disk: facts.on_disk,
                hosts_left: self.hosts_left(facts.gone),
                ..loss
            },
            handover,
        }
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
        Some((spare, node, ranks))
    }
}
