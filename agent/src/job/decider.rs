//! Who decides for a host: the job's controller, or a follower of it.
//!
//! One recovery machine decides for the whole job. On one node it runs in
//! the host's own agent over the host's ranks; on several nodes (with a
//! high-availability mode on) it runs in node 0's agent over every rank of
//! the job (in a successor's, once node 0's host is lost: see
//! [`super::takeover`]), and every other agent follows it. The event loop is the same
//! in both roles: it gathers events and carries commands out on its own
//! ranks. What differs is where events go and where commands come from:
//!
//! - the **controller** feeds its own events to the machine, and the
//!   followers' as their reports come ([`Up::Report`]: the host's control
//!   pages as [`RankView`]s, and what happened). Each command goes to the
//!   host of its rank; a collection, a group restart, an answer to a dump
//!   and the end of the job go to every host. A collection is complete when
//!   every host has verified its ranks' snapshots ([`Up::Collected`]).
//!   With each batch of orders goes the machine's state as followers show
//!   it (epoch, activity, faults; a [`Mirror`]) when it changed.
//! - a **follower** sends its events at once, and its views on every tick
//!   they changed (and every [`REPORT_EVERY`] anyway); it carries out the
//!   orders ([`Down`]) on its ranks, refusing any of a term older than the
//!   newest it has seen (a fencing token: a controller that lost its place
//!   cannot act). It stops with the controller's outcome; when the
//!   controller's host is lost it follows the successor, or stops when
//!   none acts in time.
//!
//! This module holds what is decided, without I/O: the messages, the
//! controller's routing and placement, and each role's state;
//! [`super::orders`] carries them between the hosts.

use crate::recovery::{Command, Event, HostLoss, Machine, RankView};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

pub(super) use super::role::{Decider, Follower};
pub(super) use crate::coordinator::wire::Inbox;
pub use hold::HoldReport;
pub(super) use hosts::{Handover, LossFacts, OnLoss};
pub use messages::{Adopt, Down, Give, Mirror, Up, WritePart};
pub(super) use saves::{FINAL_WAIT, FinalSave, Share};
pub use shared::{WriteEnd, WriteStart};
pub use step::{Facts, Input, Ready, Rules, SUCCESSOR_WAIT};

mod hold;
mod hosts;
mod messages;
mod minority;
mod saves;
mod shared;
mod slowhost;
mod step;
mod unled;

/// A follower reports its views at least this often, changed or not.
pub const REPORT_EVERY: Duration = Duration::from_millis(250);

/// The node whose agent hosts the controller when the job starts.
pub const CONTROLLER: u64 = 0;

/// Where a command is carried out.
#[derive(Debug, PartialEq)]
pub(super) enum Routed {
    Here(Command),
    There(u64, Command),
}

/// A collection in progress: the hosts that verified their snapshots.
#[derive(Debug)]
struct Gather {
    epoch: u64,
    got: BTreeMap<u64, Vec<(usize, Vec<u64>)>>,
    /// Per rank, the replica holders that verified theirs, and the steps.
    replicas: BTreeMap<usize, Vec<(u64, Vec<u64>)>>,
}

/// The job's recovery machine, and what it needs to reach every host.
#[derive(Debug)]
pub struct Controller {
    pub(in crate::job) machine: Machine,
    /// Nodes it decides for (1: this host alone).
    nodes: u64,
    pub(in crate::job) node: u64,
    per_node: usize,
    /// Hosts that hold ranks now (those lost leave, a standby that takes
    /// their ranks joins).
    members: BTreeSet<u64>,
    /// Standby hosts not used yet, and not lost.
    spares: BTreeSet<u64>,
    /// Ranks on another host than their own (taken by a standby).
    placement: BTreeMap<usize, u64>,
    gather: Option<Gather>,
    /// The state last sent to the followers.
    pub(in crate::job) sent: Option<std::sync::Arc<Mirror>>,
    /// Followers that took the end of the job.
    pub(in crate::job) ended: BTreeSet<u64>,
    /// The ranks whose peer replicas each host holds (with a sealed step),
    /// as it last reported.
    held: BTreeMap<u64, BTreeSet<usize>>,
    /// The steps every host keeps for the peer replicas.
    hold: hold::Hold,
    /// Ranks a standby took and has not registered yet: their stores are
    /// still being filled from their replicas.
    filling: BTreeSet<usize>,
    /// A controller that took over decides on lost hosts only once every
    /// live host has reported (what replicas it holds) or this deadline
    /// passed; until then the losses wait here.
    pub(in crate::job) settling: Option<Settling>,
    /// Host losses held back while no majority follows this controller.
    pub(in crate::job) cut_off: Option<minority::CutOff>,
    /// Lost hosts whose ranks no live host was known to hold a replica
    /// of: every live host reported once more before that was decided.
    reheard: BTreeSet<u64>,
    /// The replicas of ranks no live host holds (a lost host's, with no
    /// standby to take them), as the last collection found them: per rank,
    /// the holders and their verified steps.
    replica_steps: BTreeMap<usize, Vec<(u64, Vec<u64>)>>,
    /// A checkpoint the hosts are writing, each its share.
    writing: Option<shared::SharedWrite>,
    /// The periodic saves being written, each host its share: the ranks
    /// written of each step.
    pub(in crate::job) saves: BTreeMap<u64, BTreeSet<usize>>,
    /// The final save the controller waits for at the end of the job.
    pub(in crate::job) final_save: Option<FinalSave>,
    /// The hosts heard now: a standby is taken only once it runs.
    pub(in crate::job) heard: BTreeSet<u64>,
    /// Faults waiting for this controller to hold its lease in etcd again.
    pub(in crate::job) waiting: Option<unled::Held>,
    /// It waited past `--coordinator-timeout`: the job writes its last
    /// words and stops, deciding without etcd.
    pub(in crate::job) given_up: bool,
    /// How it may act, fixed for the job.
    pub(in crate::job) rules: Rules,
    /// It stopped the job (cut off past the wait, or replaced).
    stopped: bool,
    /// It took over from a controller lost during a recovery: the
    /// recovery starts again with its first step.
    interrupted: bool,
    /// The views hosts reported since the last tick, by rank.
    views_in: BTreeMap<usize, RankView>,
    /// A glance at the state last shown (see `step::Glance`).
    glanced: Option<step::Glance>,
    /// Hosts ordered out of the job for holding it back (`--on-slow
    /// replace`), and why; and those that could not be (told once).
    slow_hosts: BTreeMap<u64, String>,
    slow_kept: BTreeSet<u64>,
}

/// A controller that took over, waiting for the first reports.
#[derive(Debug)]
pub(super) struct Settling {
    pub until: Duration,
    /// Hosts not heard since the take-over.
    pub waiting: BTreeSet<u64>,
    pub losses: Vec<HostLoss>,
}

/// How long a controller that took over waits for every host's first
/// report before it decides on lost hosts anyway.
pub const SETTLE: Duration = Duration::from_secs(2);

/// A host lost, as the controller places its ranks.
#[derive(Debug, PartialEq)]
pub(super) struct Placed {
    pub ranks: Vec<usize>,
    /// The standby that takes them.
    pub spare: Option<u64>,
    /// Ranks no surviving host holds a replica of (this host's, or ranks
    /// still being filled on a standby).
    pub state_lost: Vec<usize>,
}

impl Controller {
    /// The controller of `nodes` hosts of `per_node` ranks (this one
    /// `node`), and `spares` standby hosts (node ranks from `nodes` on).
    pub fn new(
        machine: Machine,
        nodes: usize,
        node: usize,
        per_node: usize,
        spares: usize,
    ) -> Self {
        let (nodes, spares, node) = (nodes as u64, spares as u64, node as u64);
        Self {
            machine,
            nodes,
            node,
            per_node,
            // Deciding for this host alone (one node, or no mode on), it is
            // the only member, whatever its node rank.
            members: if nodes == 1 {
                BTreeSet::from([node])
            } else {
                (0..nodes).collect()
            },
            spares: (nodes..nodes + spares).collect(),
            placement: BTreeMap::new(),
            gather: None,
            sent: None,
            ended: BTreeSet::new(),
            held: BTreeMap::new(),
            hold: hold::Hold::default(),
            filling: BTreeSet::new(),
            settling: None,
            cut_off: None,
            reheard: BTreeSet::new(),
            waiting: None,
            given_up: false,
            rules: Rules::default(),
            stopped: false,
            interrupted: false,
            views_in: BTreeMap::new(),
            glanced: None,
            replica_steps: BTreeMap::new(),
            writing: None,
            saves: BTreeMap::new(),
            final_save: None,
            heard: BTreeSet::new(),
            slow_hosts: BTreeMap::new(),
            slow_kept: BTreeSet::new(),
        }
    }

    /// The controller of a job of `nodes` hosts of `per_node` ranks that
    /// node `node` takes over from one that is gone, as the old one had
    /// told it (`from`); hosts in `gone` are lost with it. It decides on
    /// lost hosts once every other live host has reported.
    pub fn take_over(
        machine: Machine,
        (nodes, per_node): (usize, usize),
        node: u64,
        (from, gone): (&Mirror, &[u64]),
        now: Duration,
    ) -> Self {
        let mut c = Self::new(machine, nodes, node as usize, per_node, 0);
        if !from.members.is_empty() {
            c.members.clone_from(&from.members);
        }
        c.members.insert(node);
        c.spares.clone_from(&from.spares);
        c.placement.clone_from(&from.placement);
        c.interrupted = from.recovering;
        c.filling.clone_from(&from.filling);
        let waiting = c.everyone().filter(|n| !gone.contains(n)).collect();
        c.settling = Some(Settling {
            until: now + SETTLE,
            waiting,
            losses: Vec::new(),
        });
        c
    }

    /// Host `node` reported (at `now`); the losses that waited for the
    /// take-over to settle, once it has (every live host heard, or the
    /// deadline passed).
    pub(in crate::job) fn settle(&mut self, node: Option<u64>, now: Duration) -> Vec<HostLoss> {
        let Some(s) = &mut self.settling else {
            return Vec::new();
        };
        if let Some(n) = node {
            s.waiting.remove(&n);
        }
        if !s.waiting.is_empty() && now < s.until {
            return Vec::new();
        }
        self.settling.take().map(|s| s.losses).unwrap_or_default()
    }

    /// Host `node` holds replicas of `ranks` (each with a sealed step).
    pub(in crate::job) fn note_held(&mut self, node: u64, ranks: impl IntoIterator<Item = usize>) {
        self.held.insert(node, ranks.into_iter().collect());
    }

    /// A controller that took over keeps what this host keeps for the
    /// replicas until every host has reported (`hold`).
    pub(in crate::job) fn inherit_kept(&mut self, own: hatrain_shared::shm::Kept) {
        self.hold = hold::Hold::inherited(own);
    }

    /// Rank `rank` registered on `node`: a standby's filled store.
    pub(in crate::job) fn registered(&mut self, node: u64, rank: usize) {
        if self.holds(node, rank) {
            self.filling.remove(&rank);
        }
    }

    /// The node holding `rank`.
    pub(in crate::job) fn node_of(&self, rank: usize) -> u64 {
        if self.nodes == 1 {
            self.node
        } else {
            self.placement
                .get(&rank)
                .copied()
                .unwrap_or((rank / self.per_node) as u64)
        }
    }

    /// Whether `node` holds `rank` now (a rank of the job).
    pub(in crate::job) fn holds(&self, node: u64, rank: usize) -> bool {
        rank < self.nodes as usize * self.per_node && self.node_of(rank) == node
    }

    /// How many hosts hold ranks now and are not lost (`gone`: the hosts
    /// lost so far, some perhaps not decided on yet).
    pub(in crate::job) fn hosts_left(&self, gone: &[u64]) -> usize {
        self.members.iter().filter(|n| !gone.contains(n)).count()
    }

    /// Whether this controller decides for several hosts.
    pub(in crate::job) fn joined(&self) -> bool {
        self.nodes > 1
    }

    /// The ranks `node` holds now.
    pub(in crate::job) fn ranks_on(&self, node: u64) -> Vec<usize> {
        (0..self.nodes as usize * self.per_node)
            .filter(|&r| self.holds(node, r))
            .collect()
    }

    /// The other hosts holding ranks.
    pub(in crate::job) fn others(&self) -> impl Iterator<Item = u64> + '_ {
        self.members
            .iter()
            .copied()
            .filter(move |&n| n != self.node)
    }

    /// Whether `node` is another agent of the job (one of
    /// [`Controller::everyone`]).
    pub(in crate::job) fn knows(&self, node: u64) -> bool {
        node != self.node && (self.members.contains(&node) || self.spares.contains(&node))
    }

    /// Every other agent of the job: those holding ranks, and the spares.
    pub(in crate::job) fn everyone(&self) -> impl Iterator<Item = u64> + '_ {
        self.others().chain(self.spares.iter().copied())
    }

    /// Host `node` is lost (with the hosts in `gone`, lost too): its
    /// ranks, those whose state no surviving host holds a replica of, and
    /// the standby that takes its ranks (now placed there) when one is left
    /// and no state is lost. `None` for a standby holding nothing.
    pub(in crate::job) fn host_lost(
        &mut self,
        node: u64,
        reboot: bool,
        gone: &[u64],
    ) -> Option<Placed> {
        if self.spares.remove(&node) || !self.members.remove(&node) {
            return None;
        }
        self.held.remove(&node);
        let ranks = self.ranks_on(node);
        let state_lost = self.state_lost(node, gone);
        let heard = self.spares.iter().copied().find(|s| self.heard.contains(s));
        let spare = match heard {
            Some(s) if reboot && state_lost.is_empty() => self.spares.take(&s),
            _ => None,
        };
        if let Some(s) = spare {
            for &r in &ranks {
                self.placement.insert(r, s);
            }
            self.members.insert(s);
            self.filling.extend(&ranks);
        }
        Some(Placed {
            ranks,
            spare,
            state_lost,
        })
    }

    /// The ranks whose state would be lost with host `node` (and the hosts
    /// in `gone`): its own and those a standby is being filled with, that
    /// no other live host reported holding a replica of.
    pub(in crate::job) fn state_lost(&self, node: u64, gone: &[u64]) -> Vec<usize> {
        let kept = |r: &usize| {
            self.held
                .iter()
                .any(|(n, held)| *n != node && !gone.contains(n) && held.contains(r))
        };
        // Ranks joining a growing group hold nothing to lose.
        let joining = self.machine.joining();
        self.ranks_on(node)
            .iter()
            .chain(&self.filling)
            .copied()
            .collect::<BTreeSet<usize>>()
            .into_iter()
            .filter(|r| !kept(r) && !joining.contains(r))
            .collect()
    }

    /// `loss` at `now` leaves state no live host is known to hold: unless
    /// every live host has reported since, it waits for their reports (a
    /// replica made an instant ago may not have been reported yet), at
    /// most [`SETTLE`]; true while it waits.
    pub(in crate::job) fn rehear(&mut self, loss: &HostLoss, gone: &[u64], now: Duration) -> bool {
        let node = loss.node;
        if !self.members.contains(&node)
            || self.reheard.remove(&node)
            || self.state_lost(node, gone).is_empty()
        {
            return false;
        }
        self.reheard.insert(node);
        let waiting = self
            .everyone()
            .filter(|n| *n != node && !gone.contains(n))
            .collect();
        self.settling = Some(Settling {
            until: now + SETTLE,
            waiting,
            losses: vec![loss.clone()],
        });
        true
    }

    /// Where `c` is carried out.
    pub(in crate::job) fn route(&mut self, c: Command) -> Vec<Routed> {
        let to = |n: u64, c: Command| {
            if n == self.node {
                Routed::Here(c)
            } else {
                Routed::There(n, c)
            }
        };
        match c {
            Command::Post { rank, .. } | Command::Kill { rank } | Command::Respawn { rank, .. } => {
                vec![to(self.node_of(rank), c)]
            }
            // Each leaving rank's replica goes from a live holder that
            // verified the step; a rank nobody holds at it is left out, and
            // the reshape names it.
            // It is a host with a rank that stays, which brings it.
            Command::Donate { step, leaving } => {
                let staying: BTreeSet<u64> = self
                    .machine
                    .members_at()
                    .iter()
                    .map(|&(r, _)| self.node_of(r))
                    .collect();
                let mut by: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
                for rank in leaving {
                    let holder = self.replica_steps.get(&rank).and_then(|held| {
                        held.iter()
                            .find(|(n, s)| {
                                self.members.contains(n) && staying.contains(n) && s.contains(&step)
                            })
                            .map(|(n, _)| *n)
                    });
                    if let Some(n) = holder {
                        by.entry(n).or_default().push(rank);
                    }
                }
                by.into_iter()
                    .map(|(n, leaving)| to(n, Command::Donate { step, leaving }))
                    .collect()
            }
            Command::Collect { epoch } => {
                self.gather = Some(Gather {
                    epoch,
                    got: BTreeMap::new(),
                    replicas: BTreeMap::new(),
                });
                let mut out: Vec<Routed> =
                    self.others().map(|n| Routed::There(n, c.clone())).collect();
                out.push(Routed::Here(c));
                out
            }
            // INVARIANT: a checkpoint is written only from every rank's
            // snapshot; this host's persister holds its own ranks only, and
            // refuses a checkpoint without all of them.
            Command::Write { .. } => vec![Routed::Here(c)],
            Command::RestartGroup { .. } | Command::DumpDone(_) | Command::Finish(_) => {
                let mut out: Vec<Routed> = self
                    .everyone()
                    .map(|n| Routed::There(n, c.clone()))
                    .collect();
                out.push(Routed::Here(c));
                out
            }
        }
    }

    /// Node `node`'s verified steps for the collection of `epoch` (its
    /// ranks', and the replicas' it holds of lost hosts' ranks); the whole
    /// collection once every host's are in. A rank no live host holds
    /// counts with the steps any holder of its replica verified.
    pub(in crate::job) fn gathered(
        &mut self,
        node: u64,
        epoch: u64,
        steps: Vec<(usize, Vec<u64>)>,
        replicas: Vec<(usize, Vec<u64>)>,
    ) -> Option<Event> {
        let g = self.gather.as_mut().filter(|g| g.epoch == epoch)?;
        g.got.insert(node, steps);
        for (rank, s) in replicas {
            g.replicas.entry(rank).or_default().push((node, s));
        }
        // Fewer hosts than members answered: not whole (a cheap look
        // first, as each of thousands of hosts' answers comes).
        if g.got.len() < self.members.len() || self.members.iter().any(|n| !g.got.contains_key(n)) {
            return None;
        }
        let g = self.gather.take()?;
        let wanted: BTreeSet<usize> = self.orphans().into_iter().collect();
        let orphans: BTreeMap<usize, Vec<(u64, Vec<u64>)>> = g
            .replicas
            .into_iter()
            .filter(|(r, _)| wanted.contains(r))
            .collect();
        // A rank standing by counts with its replica, from which it is
        // brought to the reshape, not with its own store.
        let mut steps: Vec<(usize, Vec<u64>)> = g
            .got
            .into_values()
            .flatten()
            .filter(|(r, _)| !orphans.contains_key(r))
            .collect();
        for (rank, held) in &orphans {
            let mut any: Vec<u64> = held.iter().flat_map(|(_, s)| s.iter().copied()).collect();
            any.sort_unstable_by(|a, b| b.cmp(a));
            any.dedup();
            steps.push((*rank, any));
        }
        self.replica_steps = orphans;
        Some(Event::Collected { epoch, steps })
    }

    /// The epoch of the collection in progress, if one is.
    pub(in crate::job) fn gathering(&self) -> Option<u64> {
        self.gather.as_ref().map(|g| g.epoch)
    }

    /// Ranks no live host holds (a lost host's, with no standby to take
    /// them), and ranks standing by while the group reshapes without them:
    /// each counts and goes on with its replicas.
    pub(in crate::job) fn orphans(&self) -> Vec<usize> {
        let leaving = self.machine.leaving();
        (0..self.nodes as usize * self.per_node)
            .filter(|&r| {
                (!self.members.contains(&self.node_of(r)) || leaving.contains(&r))
                    && !self.machine.retired().contains(&r)
            })
            .collect()
    }

    /// Who writes each rank of a checkpoint of `step`: the host holding
    /// it, or for a rank no live host holds, a holder of its replica that
    /// verified that step. `Err` names the ranks nobody can write.
    pub(in crate::job) fn shares(
        &self,
        step: u64,
    ) -> Result<BTreeMap<u64, Vec<usize>>, Vec<usize>> {
        let mut shares: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        let mut missing = Vec::new();
        let ranks = (0..self.nodes as usize * self.per_node)
            .filter(|r| !self.machine.retired().contains(r) && !self.machine.joining().contains(r));
        for rank in ranks {
            let home = self.node_of(rank);
            let by = if self.members.contains(&home) {
                Some(home)
            } else {
                self.replica_steps.get(&rank).and_then(|held| {
                    held.iter()
                        .find(|(n, s)| self.members.contains(n) && s.contains(&step))
                        .map(|(n, _)| *n)
                })
            };
            match by {
                Some(n) => shares.entry(n).or_default().push(rank),
                None => missing.push(rank),
            }
        }
        if missing.is_empty() {
            Ok(shares)
        } else {
            Err(missing)
        }
    }

    /// Whether every follower took the end of the job, or is lost.
    pub(in crate::job) fn all_ended(&self, lost: &[u64]) -> bool {
        self.everyone()
            .all(|n| self.ended.contains(&n) || lost.contains(&n))
    }

    pub fn mirror(&self) -> Mirror {
        let m = &self.machine;
        let ranks = 0..self.nodes as usize * self.per_node;
        Mirror {
            epoch: m.epoch(),
            recovering: m.recovering(),
            activity: m.activity(),
            faults: m.faults().to_vec(),
            restarts: ranks
                .clone()
                .map(|r| (r, m.restarts(r)))
                .filter(|(_, n)| *n > 0)
                .collect(),
            protected: ranks.filter(|&r| m.protected(r)).collect(),
            last_words: m.last_words().cloned(),
            group_restarts: m.group_restarts(),
            started_unix_s: m.started_unix_s(),
            checkpoint: m.checkpoint(),
            members: self.members.clone(),
            spares: self.spares.clone(),
            placement: self.placement.clone(),
            filling: self.filling.clone(),
            world_size: Some(m.world_size()),
            resizes: m.resizes().to_vec(),
            retired: m.retired().clone(),
            places: m.places().clone(),
            reshape: m.reshaping().cloned(),
            global_batch: m.global_batch(),
        }
    }
}

/// What a follower does with orders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admit {
    /// From the controller it follows.
    Take,
    /// From a controller that took over under a newer term: it follows
    /// that one from now on.
    Follow,
    /// Of a term older than the newest its coordinator knows: a controller
    /// that another replaced (it was paused, or cut off, past its lease)
    /// cannot act, even before the newer one's first orders come.
    Stale,
    /// From a node that is not the controller.
    NotController,
}

/// The fence, for orders of `term` from node `from` to a follower of
/// `leader` whose orders came under term `followed`, while its coordinator
/// knows of term `newest`. Term 0 is a controller that has not acted yet:
/// the job's first, at its start.
pub(super) fn admit(from: u64, term: u64, (leader, followed): (u64, u64), newest: u64) -> Admit {
    if term != 0 && term < newest {
        Admit::Stale
    } else if from == leader {
        Admit::Take
    } else if term > followed {
        Admit::Follow
    } else {
        Admit::NotController
    }
}

/// Whether orders of `term` from node `from`, admitted by a follower
/// whose orders came under term `followed` and which saw the hosts `lost`
/// go, end its wait for a successor: orders under a newer term, or from a
/// node not lost (the successor it turned to from what its coordinator
/// said). A term is no proof on its own: a controller that began to act
/// an instant before its host was lost stamped its orders with a term its
/// heartbeats never carried, and its successor, not knowing of it, takes
/// the same term.
pub(super) fn ends_successor_wait(from: u64, term: u64, followed: u64, lost: &[u64]) -> bool {
    term > followed || !lost.contains(&from)
}

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
