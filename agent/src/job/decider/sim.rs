//! The controller on a simulated cluster: hosts whose ranks train in
//! lockstep, a network that delays each message by a seeded amount (in
//! order on each link), hosts killed, frozen and thawed, a controller that
//! a successor replaces, and a coordinator that may stop letting it act;
//! no process, no socket, no sleep. The controller is the real
//! [`Controller`] driven through [`Controller::step`]; the followers are
//! simulated as the driver carries orders out.
//!
//! The oracle is the state itself: each rank's state is a checksum folded
//! over every step it took, from the state it restored. A run whose ranks
//! all end with the checksum of a run without faults restored only
//! consistent state (the same step everywhere, from real snapshots).

use super::{Controller, Down, Facts, Input, Mirror, Rules, Up};
use crate::coordinator::View;
use crate::reaper::ExitStatus;
use crate::recovery::{
    Command, Event, ExitCause, HangPolicy, HostLoss, Machine, MachineConfig, Outcome, RankView,
    RestartPolicy,
};
use hatrain_shared::control::FaultRecord;
use hatrain_shared::ha::HaModes;
use hatrain_shared::shm::{Directive, Phase};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

mod rank;
mod scenarios;
mod succession;
mod writes;

use rank::{Rank, act, registration};
pub use rank::{fold, reference};

pub const TICK: Duration = Duration::from_millis(10);
/// A host unheard this long is lost.
const HOST_TIMEOUT: Duration = Duration::from_millis(300);

/// One host: the ranks it plays, and its agent.
#[derive(Debug, Default)]
pub struct Host {
    up: bool,
    /// Its agent and workers are stopped (SIGSTOP): it neither trains nor
    /// speaks.
    frozen: bool,
    /// When it was last heard by the others.
    heard: Duration,
    /// Events not reported yet.
    events: Vec<Event>,
    /// Ranks that register on its next tick.
    registering: Vec<usize>,
    /// The state the controller last showed it.
    pub mirror: Option<Mirror>,
    /// The controller's end arrived.
    ended: bool,
    /// Its share of a checkpoint being written: (epoch, ranks, ticks
    /// left).
    share: Option<(u64, Vec<usize>, u32)>,
}

/// A message in flight: when it arrives, from whom, to whom.
#[derive(Debug)]
enum Msg {
    Down(Box<Down>),
    Up(Up),
}

pub struct Cluster {
    pub now: Duration,
    nodes: usize,
    per_node: usize,
    pub hosts: Vec<Host>,
    /// Every rank of the job, and the host playing it.
    ranks: Vec<Rank>,
    plays: Vec<u64>,
    /// The replicas of each rank, on the next original host after its own.
    replicas: Vec<Vec<(u64, u64)>>,
    /// The controller, and its host.
    pub ctl: Controller,
    pub leader: u64,
    /// Hosts the controller's agent stopped hearing.
    gone: Vec<u64>,
    /// The coordinator lets the controller act.
    pub acting: bool,
    /// Hosts not heard yet (a standby whose agent has not started).
    pub silent: BTreeSet<u64>,
    /// The steps each epoch's resume and reshape directives named.
    pub resumed: BTreeMap<u64, BTreeSet<u64>>,
    /// Whom the controller's coordinator says the job follows (itself
    /// when `None`), and the newest term it knows.
    pub follows: Option<u64>,
    pub term: u64,
    net: VecDeque<(Duration, u64, u64, Msg)>,
    /// Per link, when its last message arrives (order is kept).
    link: BTreeMap<(u64, u64), Duration>,
    /// Seeded delays, in ticks, taken in turn.
    delays: Vec<u64>,
    next_delay: usize,
    /// Steps to train.
    pub target: u64,
    cfg: MachineConfig,
    pub outcome: Option<Outcome>,
    pub stop: Option<String>,
    /// Checkpoint writes in progress: (epoch, step, ticks left).
    writing: Option<(u64, u64, u32)>,
    /// The checkpoint directories on disk.
    pub disk: writes::Disk,
    /// Every order sent: (to, what).
    pub sent: Vec<(u64, Down)>,
    /// The answers to `agentctl dump`.
    pub dumps: Vec<Result<crate::recovery::Written, crate::recovery::WriteFailed>>,
    /// The state the controller last showed: what a served job keeps for
    /// its next agent.
    pub kept: Option<Mirror>,
    /// When the controller's agent started, on the job's clock; `None`
    /// while no agent runs (a served job between two agents).
    pub agent: Option<Duration>,
    /// Hand-overs of replicas this host or others were told to make.
    pub notes: Vec<String>,
}

pub fn config(elastic: bool) -> MachineConfig {
    MachineConfig {
        modes: HaModes {
            dump: true,
            retry: true,
            recover: true,
            elastic,
        },
        restart: RestartPolicy::default(),
        hang: HangPolicy {
            floor: Duration::from_millis(500),
            startup_grace: Duration::from_secs(5),
            ..HangPolicy::default()
        },
        pause_timeout: Duration::from_secs(2),
        group_restarts: 0,
        register_timeout: Duration::from_secs(3),
        min_nodes: 1,
    }
}

impl Cluster {
    /// `nodes` hosts of `per_node` ranks and `spares` standbys; messages
    /// take the `delays` (in ticks) in turn.
    pub fn new(nodes: usize, per_node: usize, spares: usize, delays: Vec<u64>) -> Self {
        Self::with(nodes, per_node, spares, delays, config(false))
    }

    pub fn with(
        nodes: usize,
        per_node: usize,
        spares: usize,
        delays: Vec<u64>,
        cfg: MachineConfig,
    ) -> Self {
        let world = nodes * per_node;
        let machine = Machine::new(cfg.clone(), (0..world).collect(), 1_000.0);
        let mut ctl = Controller::new(machine, nodes, 0, per_node, spares);
        ctl.rules = Rules {
            elastic: cfg.modes.elastic,
            ..Rules::default()
        };
        let mut c = Self {
            now: Duration::ZERO,
            nodes,
            per_node,
            hosts: (0..nodes + spares)
                .map(|_| Host {
                    up: true,
                    ..Host::default()
                })
                .collect(),
            ranks: vec![Rank::fresh(); world],
            plays: (0..world).map(|r| (r / per_node) as u64).collect(),
            replicas: vec![vec![(0, 0)]; world],
            ctl,
            leader: 0,
            gone: Vec::new(),
            acting: true,
            silent: BTreeSet::new(),
            resumed: BTreeMap::new(),
            follows: None,
            term: 1,
            net: VecDeque::new(),
            link: BTreeMap::new(),
            delays: if delays.is_empty() { vec![1] } else { delays },
            next_delay: 0,
            target: 60,
            cfg,
            outcome: None,
            stop: None,
            writing: None,
            disk: writes::Disk::default(),
            sent: Vec::new(),
            dumps: Vec::new(),
            kept: None,
            agent: Some(Duration::ZERO),
            notes: Vec::new(),
        };
        for r in 0..world {
            c.ranks[r].answered = false;
            let node = c.plays[r];
            c.hosts[node as usize].events.push(registration(r));
        }
        c
    }

    /// The ranks `node` plays now.
    fn ranks_of(&self, node: u64) -> Vec<usize> {
        (0..self.ranks.len())
            .filter(|&r| self.plays[r] == node)
            .collect()
    }

    /// The next original host after `rank`'s own that is not lost holds
    /// its replica (the streams are planned again around a lost host; a
    /// new holder is given the replica at once here, where the real one
    /// takes a step or so).
    fn holder(&self, rank: usize) -> u64 {
        let own = rank / self.per_node;
        (1..self.nodes)
            .map(|k| ((own + k) % self.nodes) as u64)
            .find(|n| !self.gone.contains(n))
            .unwrap_or(own as u64)
    }

    fn views(&self, node: u64) -> Vec<RankView> {
        self.ranks_of(node)
            .into_iter()
            .map(|rank| {
                let r = &self.ranks[rank];
                RankView {
                    rank,
                    alive: r.alive,
                    registered: r.registered,
                    phase: r.phase,
                    step: r.step,
                    epoch: r.epoch,
                    heartbeat: r.heartbeat,
                    in_collective: r.in_collective,
                    acked: r.acked,
                    times: Default::default(),
                    final_sealed: None,
                }
            })
            .collect()
    }

    fn facts(&self) -> Facts {
        let leader = self.leader;
        Facts {
            view: Some(View {
                live: (0..self.hosts.len() as u64)
                    .filter(|n| !self.gone.contains(n) && !self.silent.contains(n))
                    .collect(),
                lost: self.gone.clone(),
                follows: Some(self.follows.unwrap_or(leader)),
                acting: self.acting,
                term: self.term,
                acted: 1,
            }),
            gone: self.gone.clone(),
            own_held: (0..self.ranks.len())
                .filter(|&r| self.holder(r) == leader)
                .collect(),
            own_hold: None,
            on_disk: None,
        }
    }

    /// The controller takes `input`; what it decides is carried out.
    pub fn input(&mut self, input: Input) {
        let mut inputs = VecDeque::from([input]);
        while let Some(input) = inputs.pop_front() {
            let facts = self.facts();
            let Some(now) = self.clock() else {
                return;
            };
            let ready = self.ctl.step(now, &facts, input);
            if let Some(m) = &ready.mirror {
                self.kept = Some((**m).clone());
            }
            for n in &ready.notes {
                self.notes.push(n.text.clone());
            }
            if let Some((outcome, reason)) = ready.stop {
                self.stop = Some(reason);
                if outcome.is_some() {
                    self.outcome = outcome;
                }
            }
            for (to, down) in ready.orders {
                // A rank a reshape names is in the group's communicator
                // from now on: the others wait for it to join.
                for c in &down.commands {
                    if let Command::Post {
                        rank,
                        directive: Directive::Reshape { .. },
                    } = c
                    {
                        self.ranks[*rank].member = true;
                    }
                }
                self.sent.push((to, down.clone()));
                self.send(self.leader, to, Msg::Down(Box::new(down)));
            }
            for c in ready.here {
                if let Some(e) = self.carry_out(self.leader, c) {
                    inputs.push_back(Input::Followed(e));
                }
            }
            if let Some(w) = ready.write {
                self.start_write(w);
            }
            if let Some(end) = ready.commit {
                inputs.push_back(self.end_write(end));
            }
        }
    }

    /// The controller's clock, as its agent reads it: its uptime, moved to
    /// the job's start; `None` while no agent runs.
    fn clock(&self) -> Option<Duration> {
        let started = self.agent?;
        let unix = |d: Duration| 1_000.0 + d.as_secs_f64();
        Some(super::super::job_clock(
            self.now - started,
            unix(started),
            self.ctl.machine.started_unix_s(),
        ))
    }

    fn send(&mut self, from: u64, to: u64, msg: Msg) {
        let d = self.delays[self.next_delay % self.delays.len()];
        self.next_delay += 1;
        let at = self.now + TICK * d as u32;
        let last = self.link.get(&(from, to)).copied().unwrap_or_default();
        let at = at.max(last);
        self.link.insert((from, to), at);
        self.net.push_back((at, from, to, msg));
    }

    /// Carries out a command on `node`'s ranks; some produce an event.
    fn carry_out(&mut self, node: u64, c: Command) -> Option<Event> {
        if let Command::Post { rank, .. } | Command::Kill { rank } | Command::Respawn { rank, .. } =
            &c
            && self.plays[*rank] != node
        {
            // Not a rank of this host (any more).
            return None;
        }
        match c {
            Command::Post { rank, directive } => {
                if let Directive::Resume { epoch, step } | Directive::Reshape { epoch, step, .. } =
                    directive
                {
                    self.resumed.entry(epoch).or_default().insert(step);
                }
                let r = &mut self.ranks[rank];
                r.directive = directive;
                r.acked = None;
                r.member |= matches!(directive, Directive::Reshape { .. });
                None
            }
            Command::Kill { rank } => {
                let r = &mut self.ranks[rank];
                if r.alive {
                    r.alive = false;
                    self.hosts[node as usize].events.push(Event::Exited {
                        rank,
                        status: ExitStatus::Signaled(9),
                        cause: ExitCause::Status,
                    });
                }
                None
            }
            Command::Respawn { rank, .. } => {
                // Its store and control page outlive it (a standby's store
                // was filled): the directive its predecessor acknowledged
                // is not taken again.
                let old = &self.ranks[rank];
                self.ranks[rank] = Rank {
                    registered: false,
                    phase: Phase::Starting,
                    slots: old.slots.clone(),
                    directive: old.directive,
                    acked: old.acked,
                    joining: old.joining,
                    member: old.member,
                    answered: false,
                    ..Rank::fresh()
                };
                self.hosts[node as usize].registering.push(rank);
                None
            }
            Command::Collect { epoch } => {
                let steps: Vec<(usize, Vec<u64>)> = self
                    .ranks_of(node)
                    .into_iter()
                    .map(|r| (r, self.ranks[r].slots.iter().map(|s| s.0).collect()))
                    .collect();
                let held = self
                    .ctl_orphans()
                    .into_iter()
                    .filter(|&r| self.holder(r) == node)
                    .map(|r| (r, self.replicas[r].iter().map(|s| s.0).collect()))
                    .collect();
                self.collected(node, epoch, steps, held);
                None
            }
            Command::Write { epoch, step } => {
                self.writing = Some((epoch, step, 3));
                None
            }
            Command::DumpDone(r) => {
                if node == self.leader {
                    self.dumps.push(r);
                }
                None
            }
            Command::Donate { .. } => None,
            Command::RestartGroup { .. } => panic!("no group restart in these runs"),
            Command::Finish(o) => {
                if node == self.leader {
                    self.outcome = Some(o);
                }
                let h = &mut self.hosts[node as usize];
                if !h.ended && node != self.leader {
                    h.ended = true;
                    self.send(node, self.leader, Msg::Up(Up::Ended));
                }
                None
            }
        }
    }

    fn ctl_orphans(&self) -> Vec<usize> {
        self.ctl.orphans()
    }

    fn collected(
        &mut self,
        node: u64,
        epoch: u64,
        steps: Vec<(usize, Vec<u64>)>,
        replicas: Vec<(usize, Vec<u64>)>,
    ) {
        if node == self.leader {
            self.input(Input::Verified {
                epoch,
                steps,
                replicas,
            });
        } else {
            let up = Up::Collected {
                epoch,
                steps,
                replicas,
            };
            self.send(node, self.leader, Msg::Up(up));
        }
    }

    /// A follower carries out the controller's orders.
    fn on_down(&mut self, node: u64, down: Down) {
        if let Some(m) = down.mirror {
            self.hosts[node as usize].mirror = Some(std::sync::Arc::unwrap_or_clone(m));
        }
        for (rank, _) in &down.registered {
            self.ranks[*rank].answered = true;
        }
        if let Some(a) = down.adopt {
            // Its stores are filled from the replicas (with `fill`), and
            // its processes start when the controller says.
            for &r in &a.ranks {
                self.plays[r] = node;
                let slots = match a.fill {
                    true => self.replicas[r].clone(),
                    false => vec![(0, 0)],
                };
                self.ranks[r] = Rank {
                    alive: false,
                    registered: false,
                    phase: Phase::Starting,
                    slots,
                    joining: !a.fill,
                    member: a.fill,
                    ..Rank::fresh()
                };
            }
        }
        if let Some(w) = down.write {
            self.hosts[node as usize].share = Some((w.epoch, w.ranks, writes::SHARE_TICKS));
        }
        for c in down.commands {
            if let Some(e) = self.carry_out(node, c) {
                self.hosts[node as usize].events.push(e);
            }
        }
    }

    /// Kills `node` (SIGKILL of its agent and workers).
    pub fn kill(&mut self, node: u64) {
        self.hosts[node as usize].up = false;
        for r in self.ranks_of(node) {
            self.ranks[r].alive = false;
        }
    }

    /// Freezes (SIGSTOP) or thaws `node`.
    pub fn freeze(&mut self, node: u64, frozen: bool) {
        self.hosts[node as usize].frozen = frozen;
        if !frozen {
            self.hosts[node as usize].heard = self.now;
        }
    }

    /// Crashes `rank` (SIGKILL of its process).
    pub fn crash(&mut self, rank: usize) {
        let node = self.plays[rank];
        self.ranks[rank].alive = false;
        self.hosts[node as usize].events.push(Event::Exited {
            rank,
            status: ExitStatus::Signaled(9),
            cause: ExitCause::Status,
        });
    }

    fn live(&self, node: u64) -> bool {
        let h = &self.hosts[node as usize];
        h.up && !h.frozen
    }

    /// The ranks training together now: not those that left the group
    /// or are leaving it, nor those joining it before the reshape.
    fn group(&self) -> Vec<usize> {
        let m = &self.ctl.machine;
        let (retired, leaving) = (m.retired(), m.leaving());
        (0..self.ranks.len())
            .filter(|&r| !retired.contains(&r) && !leaving.contains(&r) && self.ranks[r].member)
            .collect()
    }

    /// One tick: ranks act on their directives and train in lockstep,
    /// messages arrive, hosts report, the controller ticks.
    pub fn tick(&mut self) {
        self.now += TICK;
        for node in 0..self.hosts.len() as u64 {
            if !self.live(node) || self.silent.contains(&node) {
                continue;
            }
            self.hosts[node as usize].heard = self.now;
            for rank in std::mem::take(&mut self.hosts[node as usize].registering) {
                self.ranks[rank].registered = true;
                self.hosts[node as usize].events.push(registration(rank));
            }
            for rank in self.ranks_of(node) {
                act(&mut self.ranks[rank]);
            }
        }
        self.train();
        self.finish_write();
        self.write_shares();
        self.deliver();
        self.report();
        self.detect();
        if self.live(self.leader) && self.stop.is_none() && self.agent.is_some() {
            self.input(Input::Tick);
        }
    }

    /// A step completes only when every rank of the group can take it.
    fn train(&mut self) {
        let group = self.group();
        let live: Vec<bool> = (0..self.ranks.len())
            .map(|r| self.live(self.plays[r]))
            .collect();
        let can = |r: &Rank| r.alive && r.registered && r.answered && r.phase == Phase::Computing;
        let all = group.iter().all(|&r| live[r] && can(&self.ranks[r]));
        for &rank in &group {
            let r = &mut self.ranks[rank];
            if !live[rank] || !can(r) {
                continue;
            }
            if !all {
                r.in_collective = true;
                continue;
            }
            if r.step == self.target {
                r.phase = Phase::Finished;
                r.alive = false;
                let node = self.plays[rank] as usize;
                self.hosts[node].events.push(Event::Exited {
                    rank,
                    status: ExitStatus::Exited(0),
                    cause: ExitCause::Status,
                });
                continue;
            }
            r.step += 1;
            r.sum = fold(r.sum, rank, r.step);
            r.heartbeat += 1;
            r.in_collective = false;
            r.slots.insert(0, (r.step, r.sum));
            r.slots.truncate(2);
            self.replicas[rank] = r.slots.clone();
        }
    }

    fn deliver(&mut self) {
        let mut later = VecDeque::new();
        while let Some((at, from, to, msg)) = self.net.pop_front() {
            if at > self.now {
                later.push_back((at, from, to, msg));
                continue;
            }
            // A dead sender's messages in flight still arrive; a dead or
            // frozen receiver's are lost (a frozen one's wait for it).
            if !self.hosts[to as usize].up {
                continue;
            }
            if self.hosts[to as usize].frozen {
                later.push_back((at, from, to, msg));
                continue;
            }
            match msg {
                Msg::Down(d) if from == self.leader => self.on_down(to, *d),
                Msg::Down(_) => {}
                Msg::Up(up) if to == self.leader && !self.gone.contains(&from) => {
                    self.input(Input::Up { from, up })
                }
                Msg::Up(_) => {}
            }
        }
        self.net = later;
    }

    /// Every live host reports its ranks and what happened.
    fn report(&mut self) {
        for node in 0..self.hosts.len() as u64 {
            if !self.live(node) || self.gone.contains(&node) || self.silent.contains(&node) {
                continue;
            }
            let views = self.views(node);
            let events = std::mem::take(&mut self.hosts[node as usize].events);
            if node == self.leader {
                if self.agent.is_none() {
                    // Nobody reads them: the next agent will.
                    self.hosts[node as usize].events = events;
                    continue;
                }
                self.input(Input::Event(Event::Tick(views)));
                for e in events {
                    if let Event::Registered { rank, .. } = e {
                        self.ranks[rank].answered = true;
                    }
                    self.input(Input::Event(e));
                }
                continue;
            }
            let held = (0..self.ranks.len())
                .filter(|&r| self.holder(r) == node)
                .collect();
            let up = Up::Report {
                views,
                events,
                held,
                hold: None,
            };
            self.send(node, self.leader, Msg::Up(up));
        }
    }

    /// Hosts unheard past the timeout are lost; a lost controller's host
    /// is replaced by the lowest live member, which takes over.
    fn detect(&mut self) {
        let lost: Vec<u64> = (0..self.hosts.len() as u64)
            .filter(|&n| {
                !self.gone.contains(&n)
                    && !self.silent.contains(&n)
                    && !self.hosts[n as usize].ended
                    && self.now.saturating_sub(self.hosts[n as usize].heard) > HOST_TIMEOUT
            })
            .collect();
        if lost.is_empty() {
            return;
        }
        self.gone.extend(&lost);
        if lost.contains(&self.leader) {
            return self.take_over(lost);
        }
        let losses = lost.iter().map(|&node| self.loss(node)).collect();
        self.input(Input::HostsLost(losses));
    }

    fn loss(&self, node: u64) -> HostLoss {
        HostLoss {
            node,
            ranks: self.ctl.ranks_on(node),
            detail: format!("host {node} unheard"),
            spare: None,
            state_lost: Vec::new(),
            on_disk: None,
            hosts_left: 0,
            stand_by: Vec::new(),
        }
    }

    pub fn run_until(&mut self, what: &str, limit: usize, mut done: impl FnMut(&Self) -> bool) {
        for _ in 0..limit {
            if done(self) {
                return;
            }
            self.tick();
        }
        panic!(
            "{what} did not happen within {limit} ticks at {:?}: activity {}; steps {:?}; stop {:?}; notes {:#?}",
            self.now,
            self.ctl.machine.activity(),
            self.steps(),
            self.stop,
            self.notes
        );
    }

    pub fn steps(&self) -> Vec<u64> {
        self.ranks.iter().map(|r| r.step).collect()
    }

    /// The lowest step any rank of the group reached.
    pub fn step(&self) -> u64 {
        self.group()
            .iter()
            .map(|&r| self.ranks[r].step)
            .min()
            .unwrap_or(0)
    }

    pub fn faults(&self) -> &[FaultRecord] {
        self.ctl.machine.faults()
    }

    /// Every rank of the group ended at the last step, none rolled back
    /// to a step it held no snapshot of, and every epoch resumed at one
    /// step.
    pub fn assert_consistent(&self) {
        for r in self.group() {
            let rank = &self.ranks[r];
            assert!(
                !rank.torn,
                "rank {r} restored a step it held no snapshot of"
            );
            assert_eq!(rank.step, self.target, "rank {r} ended at another step");
        }
        for (epoch, steps) in &self.resumed {
            assert_eq!(steps.len(), 1, "epoch {epoch} resumed at steps {steps:?}");
        }
    }

    /// [`Cluster::assert_consistent`], and every rank of the group ended
    /// with the state of a run without faults.
    pub fn assert_identical(&self) {
        self.assert_consistent();
        for r in self.group() {
            let rank = &self.ranks[r];
            assert!(
                !rank.resliced,
                "rank {r} was re-sliced: no run without faults to match"
            );
            assert_eq!(
                rank.sum,
                reference(r, self.target),
                "rank {r} ended with another state than a run without faults"
            );
        }
    }

    /// Which host plays `rank` now.
    pub fn host_of(&self, rank: usize) -> u64 {
        self.plays[rank]
    }

    /// Standby `node`'s agent starts: it is heard from now on.
    pub fn hear(&mut self, node: u64) {
        self.silent.remove(&node);
        self.hosts[node as usize].heard = self.now;
    }

    /// The hosts still in the job.
    pub fn hosts_left(&self) -> BTreeSet<u64> {
        (0..self.hosts.len() as u64)
            .filter(|n| !self.gone.contains(n))
            .collect()
    }
}
