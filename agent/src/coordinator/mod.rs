//! Membership, liveness and leadership of a job's agents, behind one small
//! trait ([`Coordinator`]), so that whatever decides (the recovery machine
//! in the controller) never knows which backend keeps them: the embedded
//! one here, agent to agent, for a single host and small jobs; an etcd one
//! (leases and an election key) for clusters that outgrow it.
//!
//! # The embedded coordinator
//!
//! Every agent heartbeats every other agent (the driver sends
//! [`Coordinator::heartbeat`] and feeds what it hears to
//! [`Coordinator::observe`]); a state machine without I/O and without a
//! clock of its own, so a test runs thousands of agents and partitions with
//! no process and no sleep.
//!
//! - **Liveness.** A host is lost after `host_timeout` without a heartbeat,
//!   or at once when its connection drops, until it is heard again.
//! - **Whom an agent follows.** The controller it followed while that one
//!   lives (no churn when a lower node returns), else the live node most
//!   live nodes follow (so a returning agent joins the controller chosen
//!   meanwhile), else the lowest live node, itself included; an agent
//!   that never followed anyone waits for node 0 instead, whose agent runs
//!   the job's controller from the start. Following is a lease: every heartbeat to the
//!   followed node echoes the newest stamp (the sender's clock) heard from
//!   it, and an agent that stops following a node follows nobody until
//!   `lease` has passed since it last heard from that node.
//! - **Who acts.** An agent acts as controller only while it follows itself
//!   and a strict majority of the job's agents (itself included) follow it
//!   under leases still valid by its own clock: a follower counts until the
//!   echoed stamp plus `lease - margin`. Since an agent follows one node at
//!   a time and keeps its word for a lease, two majorities cannot follow two
//!   nodes at once: **a partition never yields two acting controllers**,
//!   whatever the delays, provided clocks run at rates within `margin /
//!   lease` of each other. A minority side never acts: it pauses and waits.
//! - **Terms.** Each time an agent starts acting it takes a term above any
//!   it has seen; every heartbeat carries the highest term known, and
//!   commands carry the term they were decided in (a fencing token: a
//!   command of an older term is refused).
//!
//! INVARIANT: `lease < host_timeout`, so a follower whose controller is
//! declared lost has already passed its lease and follows the successor at
//! once.

pub mod etcd;
pub mod wire;

use std::time::Duration;

/// What agents say to each other, every `heartbeat` interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heartbeat {
    pub from: u64,
    /// The sender's clock when it sent this.
    pub stamp: Duration,
    /// Whom the sender follows (nobody while it waits out a lease).
    pub follows: Option<u64>,
    /// The newest stamp the sender heard from the node it follows.
    pub echo: Option<Duration>,
    /// The highest term the sender knows.
    pub term: u64,
}

/// What a coordinator is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observed {
    Heartbeat(Heartbeat),
    /// The connection to `node` dropped and it sent nothing more.
    Dropped {
        node: u64,
    },
}

/// Membership as one agent sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    /// Nodes this agent hears (itself included).
    pub live: Vec<u64>,
    /// Nodes it does not.
    pub lost: Vec<u64>,
    /// Whom it follows.
    pub follows: Option<u64>,
    /// It may act as the job's controller now.
    pub acting: bool,
    /// The highest term it knows (its own, while acting).
    pub term: u64,
    /// The term it last acted under (0: never): a controller's orders
    /// carry it, so one that another replaced cannot stamp the newer term
    /// it hears of.
    pub acted: u64,
}

/// Membership, liveness and leadership.
pub trait Coordinator: Send + std::fmt::Debug {
    /// Something was heard from, or about, another agent.
    fn observe(&mut self, now: Duration, event: Observed);
    /// What this agent sends every other agent now.
    fn heartbeat(&mut self, now: Duration) -> Heartbeat;
    /// Membership now.
    fn view(&mut self, now: Duration) -> View;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddedConfig {
    /// Agents in the job (node ranks 0..nodes).
    pub nodes: u64,
    /// This agent's node rank.
    pub node: u64,
    pub host_timeout: Duration,
    /// How long a follower keeps its word (less than `host_timeout`).
    pub lease: Duration,
    /// How much shorter a controller counts a follower's lease than the
    /// follower keeps it: room for clocks that run at different rates.
    pub margin: Duration,
}

impl EmbeddedConfig {
    /// Defaults for `nodes` agents: host timeout 3 s, lease 2 s, margin
    /// 0.5 s.
    pub fn new(nodes: u64, node: u64) -> Self {
        Self::with_timeout(nodes, node, Duration::from_secs(3))
    }

    /// A host timeout of `host_timeout`, a lease of two thirds of it, and a
    /// margin of a quarter of the lease.
    pub fn with_timeout(nodes: u64, node: u64, host_timeout: Duration) -> Self {
        let lease = host_timeout * 2 / 3;
        Self {
            nodes,
            node,
            host_timeout,
            lease,
            margin: lease / 4,
        }
    }
}

/// The agent-hosted coordinator.
#[derive(Debug)]
pub struct Embedded {
    cfg: EmbeddedConfig,
    /// When each node was last heard (this agent's clock).
    heard: Vec<Option<Duration>>,
    /// The newest stamp each node sent (its clock).
    stamps: Vec<Option<Duration>>,
    dropped: Vec<bool>,
    /// For this agent as controller: the newest echo of its own stamp from
    /// each node that follows it.
    followers: Vec<Option<Duration>>,
    /// Whom each node said it follows.
    their_follows: Vec<Option<u64>>,
    follows: Option<u64>,
    /// Following nobody until then: the lease to the last one runs out.
    bound_until: Duration,
    /// It has followed some node.
    followed: bool,
    acting: bool,
    term: u64,
    /// The term it last acted under.
    acted: u64,
}

impl Embedded {
    pub fn new(cfg: EmbeddedConfig) -> Self {
        assert!(
            cfg.lease < cfg.host_timeout && cfg.margin < cfg.lease,
            "lease {:?} must be under the host timeout {:?}, and the margin under the lease",
            cfg.lease,
            cfg.host_timeout
        );
        let n = cfg.nodes as usize;
        Self {
            cfg,
            heard: vec![None; n],
            stamps: vec![None; n],
            dropped: vec![false; n],
            followers: vec![None; n],
            their_follows: vec![None; n],
            follows: None,
            bound_until: Duration::ZERO,
            followed: false,
            acting: false,
            term: 0,
            acted: 0,
        }
    }

    fn alive(&self, now: Duration, k: u64) -> bool {
        k == self.cfg.node
            || (!self.dropped[k as usize]
                && self.heard[k as usize]
                    .is_some_and(|t| now.saturating_sub(t) < self.cfg.host_timeout))
    }

    /// Whether `k` may be followed: itself, or a node that follows itself
    /// (or nobody, while it waits out a lease), as far as this agent knows.
    fn candidate(&self, k: u64) -> bool {
        k == self.cfg.node || self.their_follows[k as usize].is_none_or(|f| f == k)
    }

    /// Whom to follow when the one followed is gone (or is this agent,
    /// acting for nobody): the live node most other live nodes follow (a
    /// controller already chosen, which a returning agent joins), the
    /// lowest on a tie; with nobody following another, the lowest live
    /// node. An agent that never followed anyone, while nobody follows
    /// another, waits for node 0: a job starts with node 0's controller,
    /// the one its agents run from the start.
    fn successor(&self, now: Duration) -> Option<u64> {
        let mut votes = vec![0u32; self.cfg.nodes as usize];
        for k in (0..self.cfg.nodes).filter(|&k| k != self.cfg.node && self.alive(now, k)) {
            // A node following itself is no vote: that is where every
            // agent starts.
            if let Some(f) = self.their_follows[k as usize]
                .filter(|&f| f != k && self.alive(now, f) && self.candidate(f))
            {
                votes[f as usize] += 1;
            }
        }
        let best = votes.iter().copied().max().unwrap_or(0);
        if best == 0 && !self.followed {
            return self.alive(now, 0).then_some(0);
        }
        (0..self.cfg.nodes)
            .find(|&k| self.alive(now, k) && (best == 0 || votes[k as usize] == best))
    }

    /// Re-decides whom to follow and whether to act.
    fn update(&mut self, now: Duration) {
        let me = self.cfg.node;
        // Others that follow this agent under a valid lease.
        let followed_by = (0..self.cfg.nodes)
            .filter(|&k| {
                k != me
                    && self.followers[k as usize]
                        .is_some_and(|e| e + (self.cfg.lease - self.cfg.margin) > now)
            })
            .count() as u64;
        let majority = 2 * (followed_by + 1) > self.cfg.nodes;
        let choice = match self.follows {
            Some(c) if c == me && majority => Some(c),
            // A node that follows another is no controller to stay with.
            Some(c) if c != me && self.alive(now, c) && self.candidate(c) => Some(c),
            _ => self.successor(now),
        };
        if self.follows != choice {
            if let Some(old) = self.follows.filter(|&o| o != me) {
                // Keep the word given to `old` for a lease from the last
                // time it was heard. (Following itself binds nobody else:
                // it stops counting itself the moment it follows another.)
                let last = self.heard[old as usize].unwrap_or(now);
                self.bound_until = self.bound_until.max(last + self.cfg.lease);
            }
            self.follows = None;
            if now >= self.bound_until {
                self.follows = choice;
                self.followed |= choice.is_some();
            }
        }
        let acting = self.follows == Some(me) && majority;
        if acting && !self.acting {
            self.term += 1;
        }
        self.acting = acting;
        if acting {
            self.acted = self.term;
        }
    }
}

impl Coordinator for Embedded {
    fn observe(&mut self, now: Duration, event: Observed) {
        match event {
            Observed::Heartbeat(hb) => {
                let Some(k) = usize::try_from(hb.from)
                    .ok()
                    .filter(|&k| k < self.heard.len())
                else {
                    return;
                };
                if hb.from == self.cfg.node {
                    return;
                }
                self.heard[k] = Some(now);
                self.stamps[k] = Some(self.stamps[k].map_or(hb.stamp, |s| s.max(hb.stamp)));
                self.dropped[k] = false;
                self.their_follows[k] = hb.follows;
                if hb.follows == Some(self.cfg.node)
                    && let Some(e) = hb.echo
                {
                    self.followers[k] = Some(self.followers[k].map_or(e, |f| f.max(e)));
                } else {
                    self.followers[k] = None;
                }
                // A term is only ever raised: a controller that comes back
                // from a partition must take a newer one to act again.
                if hb.term > self.term {
                    self.term = hb.term;
                    if self.acting {
                        self.acting = false;
                    }
                }
            }
            Observed::Dropped { node } => {
                if let Some(d) = self.dropped.get_mut(node as usize)
                    && node != self.cfg.node
                {
                    *d = true;
                    self.followers[node as usize] = None;
                    self.their_follows[node as usize] = None;
                }
            }
        }
        self.update(now);
    }

    fn heartbeat(&mut self, now: Duration) -> Heartbeat {
        self.update(now);
        let echo = self.follows.and_then(|l| {
            if l == self.cfg.node {
                Some(now)
            } else {
                self.stamps[l as usize]
            }
        });
        Heartbeat {
            from: self.cfg.node,
            stamp: now,
            follows: self.follows,
            echo,
            term: self.term,
        }
    }

    fn view(&mut self, now: Duration) -> View {
        self.update(now);
        let (live, lost) = (0..self.cfg.nodes).partition(|&k| self.alive(now, k));
        View {
            live,
            lost,
            follows: self.follows,
            acting: self.acting,
            term: self.term,
            acted: self.acted,
        }
    }
}

#[cfg(test)]
mod tests;
