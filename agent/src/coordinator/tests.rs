//! The embedded coordinator in a simulated network: agents, links that go
//! down one way or both, crashes, restarts, message delays and clocks that
//! start at different readings; no process and no sleep. The safety
//! property is checked at every tick: never two acting controllers.

use super::*;
use proptest::prelude::*;
use std::collections::VecDeque;

const TICK: Duration = Duration::from_millis(50);
const BEAT: Duration = Duration::from_millis(500);

struct Net {
    agents: Vec<Embedded>,
    /// Each agent's clock reads the network's time plus this.
    offset: Vec<Duration>,
    up: Vec<bool>,
    /// link[i][j]: what i sends reaches j.
    link: Vec<Vec<bool>>,
    delay: Duration,
    now: Duration,
    queue: VecDeque<(Duration, usize, Observed)>,
    /// Every term an agent acted in, with the agent.
    acted: Vec<(u64, usize)>,
}

impl Net {
    fn new(n: usize, delay: Duration, offsets: &[u64]) -> Self {
        Self {
            agents: (0..n)
                .map(|k| Embedded::new(EmbeddedConfig::new(n as u64, k as u64)))
                .collect(),
            offset: (0..n)
                .map(|k| Duration::from_millis(offsets.get(k).copied().unwrap_or(0)))
                .collect(),
            up: vec![true; n],
            link: vec![vec![true; n]; n],
            delay,
            now: Duration::ZERO,
            queue: VecDeque::new(),
            acted: Vec::new(),
        }
    }

    fn clock(&self, k: usize) -> Duration {
        self.now + self.offset[k]
    }

    /// Cuts (or mends) both directions between the two sides.
    fn partition(&mut self, side: &[usize], up: bool) {
        let n = self.agents.len();
        for i in 0..n {
            for j in 0..n {
                if side.contains(&i) != side.contains(&j) {
                    self.link[i][j] = up;
                }
            }
        }
    }

    fn heal(&mut self) {
        let n = self.agents.len();
        self.link = vec![vec![true; n]; n];
    }

    /// A crashed agent restarts with nothing remembered.
    fn restart(&mut self, k: usize) {
        let n = self.agents.len();
        self.agents[k] = Embedded::new(EmbeddedConfig::new(n as u64, k as u64));
        self.up[k] = true;
    }

    fn crash(&mut self, k: usize) {
        self.up[k] = false;
        // Its peers see its connections drop.
        let n = self.agents.len();
        for j in (0..n).filter(|&j| j != k) {
            self.queue.push_back((
                self.now + self.delay,
                j,
                Observed::Dropped { node: k as u64 },
            ));
        }
    }

    fn view(&mut self, k: usize) -> View {
        let now = self.clock(k);
        self.agents[k].view(now)
    }

    fn acting(&mut self) -> Vec<usize> {
        let n = self.agents.len();
        let mut out = Vec::new();
        for k in (0..n).filter(|&k| self.up[k]) {
            let now = self.clock(k);
            let v = self.agents[k].view(now);
            if v.acting {
                out.push(k);
                if !self.acted.contains(&(v.term, k)) {
                    self.acted.push((v.term, k));
                }
            }
        }
        out
    }

    /// Advances one tick; panics if two agents act at once.
    fn tick(&mut self) {
        self.now += TICK;
        let n = self.agents.len();
        if self.now.as_millis().is_multiple_of(BEAT.as_millis()) {
            for i in (0..n).filter(|&i| self.up[i]) {
                let now = self.clock(i);
                let hb = self.agents[i].heartbeat(now);
                for j in (0..n).filter(|&j| j != i && self.link[i][j]) {
                    self.queue
                        .push_back((self.now + self.delay, j, Observed::Heartbeat(hb)));
                }
            }
        }
        while self.queue.front().is_some_and(|(t, _, _)| *t <= self.now) {
            let (_, j, ev) = self.queue.pop_front().expect("checked");
            if self.up[j] {
                let now = self.clock(j);
                self.agents[j].observe(now, ev);
            }
        }
        let acting = self.acting();
        assert!(
            acting.len() <= 1,
            "two controllers at {:?}: {acting:?}",
            self.now
        );
    }

    fn run(&mut self, d: Duration) {
        let end = self.now + d;
        while self.now < end {
            self.tick();
        }
    }
}

#[test]
fn the_lowest_node_leads_and_its_loss_hands_over_to_the_next() {
    let mut net = Net::new(5, Duration::from_millis(20), &[0, 7000, 300, 0, 12345]);
    net.run(Duration::from_secs(3));
    assert_eq!(net.acting(), vec![0]);
    let v = net.view(3);
    assert_eq!((v.follows, v.lost.len()), (Some(0), 0));
    // Node 0 stops heartbeating without its connections dropping (a hung
    // host): lost after the host timeout; node 1 acts once its followers'
    // leases to node 0 ran out.
    net.up[0] = false;
    net.run(Duration::from_secs(6));
    assert_eq!(net.acting(), vec![1]);
    let v = net.view(4);
    assert_eq!((v.lost.clone(), v.follows), (vec![0], Some(1)));
    // Node 0 returns empty-handed: it joins node 1, which stays.
    net.restart(0);
    net.run(Duration::from_secs(5));
    assert_eq!(net.acting(), vec![1]);
    assert_eq!(net.view(0).follows, Some(1));
}

#[test]
fn a_job_starts_with_node_0_leading_even_when_its_agent_starts_last() {
    let mut net = Net::new(4, Duration::from_millis(20), &[0, 500, 900, 0]);
    net.up[0] = false;
    net.run(Duration::from_secs(5));
    assert!(net.acting().is_empty(), "nobody leads before node 0 comes");
    assert_eq!(net.view(2).follows, None);
    net.restart(0);
    net.run(Duration::from_secs(3));
    assert_eq!(net.acting(), vec![0]);
    for k in 1..4 {
        assert_eq!(net.view(k).follows, Some(0), "node {k}");
    }
}

#[test]
fn a_dropped_connection_is_a_lost_host_at_once() {
    let mut net = Net::new(3, Duration::from_millis(5), &[]);
    net.run(Duration::from_secs(2));
    net.crash(2);
    net.run(Duration::from_millis(100));
    let v = net.view(0);
    assert_eq!(v.lost, vec![2]);
    assert_eq!(net.acting(), vec![0], "two of three still act");
}

#[test]
fn the_minority_side_of_a_partition_never_acts_and_the_majority_side_takes_over() {
    let mut net = Net::new(5, Duration::from_millis(30), &[]);
    net.run(Duration::from_secs(3));
    assert_eq!(net.acting(), vec![0]);
    net.partition(&[0, 1], false);
    net.run(Duration::from_secs(8));
    assert_eq!(net.acting(), vec![2], "the majority side chose node 2");
    for k in [0, 1] {
        assert!(!net.view(k).acting);
    }
    net.heal();
    net.run(Duration::from_secs(6));
    assert_eq!(net.acting(), vec![2], "node 2 stays after the heal");
    let terms: Vec<u64> = net.acted.iter().map(|(t, _)| *t).collect();
    assert!(
        terms.windows(2).all(|w| w[0] < w[1]),
        "terms only grow: {:?}",
        net.acted
    );
}

#[test]
fn an_even_split_leaves_nobody_acting() {
    let mut net = Net::new(4, Duration::from_millis(10), &[]);
    net.run(Duration::from_secs(3));
    net.partition(&[0, 1], false);
    net.run(Duration::from_secs(8));
    assert!(net.acting().is_empty(), "2 of 4 is no majority");
}

#[test]
fn a_link_down_one_way_does_not_yield_two_controllers() {
    let mut net = Net::new(3, Duration::from_millis(10), &[]);
    net.run(Duration::from_secs(3));
    // Node 1 no longer hears node 0, but node 0 hears node 1; node 2 hears
    // both.
    net.link[0][1] = false;
    net.run(Duration::from_secs(10));
    assert_eq!(net.acting().len(), 1);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random partitions, one-way cuts, crashes and restarts: never two
    /// acting controllers; once everything is mended, one acts.
    #[test]
    fn never_two_controllers(
        n in 3usize..8,
        delay_ms in 1u64..400,
        offsets in proptest::collection::vec(0u64..100_000, 8),
        events in proptest::collection::vec((0u8..5, 0usize..8, 0usize..8, 1u64..40), 1..25),
    ) {
        let mut net = Net::new(n, Duration::from_millis(delay_ms), &offsets);
        for (kind, a, b, ticks) in events {
            let (a, b) = (a % n, b % n);
            match kind {
                0 => net.link[a][b] = !net.link[a][b],
                1 => net.partition(&(0..=a).collect::<Vec<_>>(), false),
                2 => net.heal(),
                3 if net.up[a] => net.crash(a),
                3 => net.restart(a),
                _ => {}
            }
            for _ in 0..ticks {
                net.tick();
            }
        }
        net.heal();
        for k in 0..n {
            if !net.up[k] {
                net.restart(k);
            }
        }
        net.run(Duration::from_secs(12));
        prop_assert_eq!(net.acting().len(), 1);
    }
}
