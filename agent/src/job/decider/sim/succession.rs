//! Who decides: a controller lost with its host is replaced by the lowest
//! live host holding ranks, from the state it last showed; a served job's
//! agent dies and the next one takes over from what it kept.

use super::{Cluster, Controller, Event, HostLoss, Input, Machine, Mirror};

impl Cluster {
    /// The controller's agent dies (a served job: its workers go on).
    pub fn agent_dies(&mut self) {
        self.agent = None;
    }

    /// The next agent of a served job takes the job over from what the
    /// last one kept: its own clock starts now.
    pub fn agent_starts(&mut self) {
        let kept = self.kept.clone().unwrap_or_default();
        let world = self.ranks.len();
        let machine = Machine::take_over(self.cfg.clone(), (0..world).collect(), kept.inherited());
        let rules = self.ctl.rules.clone();
        self.ctl = Controller::new(machine, self.nodes, self.leader as usize, self.per_node, 0);
        self.ctl.rules = rules;
        self.agent = Some(self.now);
        let views = self.views(self.leader);
        self.input(Input::Event(Event::Tick(views)));
        if kept.recovering {
            self.input(Input::Event(Event::Interrupted));
        }
    }

    /// The lowest live host that holds ranks takes over from the state
    /// the lost controller last showed it.
    pub(super) fn take_over(&mut self, lost: Vec<u64>) {
        let Some(next) = (0..self.hosts.len() as u64)
            .find(|&n| self.live(n) && !self.gone.contains(&n) && !self.ranks_of(n).is_empty())
        else {
            self.stop = Some("no host left to take over".into());
            return;
        };
        let mirror = self.hosts[next as usize].mirror.clone().unwrap_or_default();
        let world = self.ranks.len();
        let cfg = self.cfg.clone();
        let machine = Machine::take_over(cfg, (0..world).collect(), mirror.inherited());
        let rules = self.ctl.rules.clone();
        let heard = self.ctl.heard.clone();
        let mut ctl = Controller::take_over(
            machine,
            (self.nodes, self.per_node),
            next,
            (&mirror, &self.gone),
            self.now,
        );
        ctl.rules = rules;
        ctl.heard = heard
            .into_iter()
            .filter(|n| !self.gone.contains(n))
            .collect();
        if let Some(s) = &mut ctl.settling {
            s.losses = lost
                .iter()
                .map(|&n| self.loss_as_seen(n, &mirror))
                .collect();
        }
        self.ctl = ctl;
        self.leader = next;
        self.notes.push(format!("node {next} takes over"));
        let views = self.views(next);
        self.input(Input::Event(Event::Tick(views)));
    }

    /// A loss as a follower saw it: the ranks the mirror placed there.
    fn loss_as_seen(&self, node: u64, m: &Mirror) -> HostLoss {
        let own = node as usize * self.per_node..(node as usize + 1) * self.per_node;
        let ranks = (0..self.ranks.len())
            .filter(|r| match m.placement.get(r) {
                Some(&n) => n == node,
                None => own.contains(r) && (node as usize) < self.nodes,
            })
            .collect();
        HostLoss {
            ranks,
            ..self.loss(node)
        }
    }
}
