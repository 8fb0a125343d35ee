//! Elastic training in the machine: a host lost with no standby shrinks the
//! group (the others take new places by a reshape directive), and below
//! `--min-nodes` the job writes its last words and stops.

use super::*;

fn elastic(min_nodes: usize) -> MachineConfig {
    let mut cfg = config();
    cfg.modes.elastic = true;
    cfg.min_nodes = min_nodes;
    cfg
}

/// Each `(rank, place)` was told to take `place` of `world` at `s_star`.
fn assert_places(sim: &Sim, s_star: u64, places: &[(usize, u64)], world: u64) {
    for &(rank, place) in places {
        let want = Directive::Reshape {
            epoch: sim.m.epoch(),
            step: s_star,
            rank: place,
            world,
        };
        assert!(
            sim.commands.contains(&Command::Post {
                rank,
                directive: want
            }),
            "rank {rank} takes place {place}: {:?}",
            sim.commands
        );
    }
}

fn loss(hosts_left: usize) -> Event {
    Event::HostLost(HostLoss {
        node: 1,
        ranks: vec![2, 3],
        detail: "no heartbeat".into(),
        spare: None,
        state_lost: vec![],
        on_disk: None,
        hosts_left,
        stand_by: Vec::new(),
    })
}

#[test]
fn a_host_lost_with_no_standby_shrinks_the_group() {
    let mut sim = Sim::with(6, elastic(2));
    sim.run(14);
    for r in [2, 3] {
        sim.ranks[r].alive = false;
        sim.ranks[r].gone = true;
    }
    sim.feed(loss(2));
    assert_eq!(
        (sim.m.world_size(), sim.m.layout_size()),
        (4, 6),
        "a checkpoint during the shrink is of the snapshots' 6 ranks"
    );
    sim.run_until("the reshape", 300, |s| !s.m.recovering());
    assert_eq!(sim.outcome, None, "{:?}", sim.notes);
    assert_eq!(sim.m.layout_size(), 4);
    let s_star = sim.m.faults()[0].s_star.expect("an s*");
    // Ranks 0, 1, 4, 5 take places 0..4 of 4; nobody posts to 2 or 3.
    assert_places(&sim, s_star, &[(0, 0), (1, 1), (4, 2), (5, 3)], 4);
    assert!(sim.commands.contains(&Command::Donate {
        step: s_star,
        leaving: vec![2, 3]
    }));
    assert!(!sim.commands.iter().any(|c| matches!(
        c,
        Command::Respawn { .. } | Command::Write { .. } | Command::Finish(_)
    )));
    let resize = &sim.m.resizes()[0];
    assert_eq!(
        (resize.from, resize.to, resize.s_star),
        (6, 4, Some(s_star))
    );
    assert_eq!(sim.m.retired(), &BTreeSet::from([2, 3]));
    // The group goes on at its new size.
    let before = sim.ranks[0].step;
    sim.run(20);
    assert!(sim.ranks[0].step > before + 10, "training goes on");
}

#[test]
fn below_min_nodes_the_job_writes_its_last_words_and_stops() {
    let mut sim = Sim::with(6, elastic(3));
    sim.run(14);
    for r in [2, 3] {
        sim.ranks[r].alive = false;
        sim.ranks[r].gone = true;
    }
    sim.feed(loss(2));
    sim.run_until("the end", 300, |s| s.outcome.is_some());
    assert_eq!(sim.outcome, Some(Outcome::RecoveryFailed));
    let f = &sim.m.faults()[0];
    assert!(
        f.reason.contains("fewer than --min-nodes 3") && f.action.contains("last-words"),
        "{f:?}"
    );
    assert!(sim.m.last_words().is_some(), "the last words are written");
    assert!(sim.m.resizes().is_empty());
}

/// A 4-rank group that lost rank 1's host and shrank to 3.
fn shrunk() -> Sim {
    let mut sim = Sim::with(4, elastic(1));
    sim.run(14);
    sim.ranks[1].alive = false;
    sim.ranks[1].gone = true;
    sim.feed(Event::HostLost(HostLoss {
        node: 1,
        ranks: vec![1],
        detail: "no heartbeat".into(),
        spare: None,
        state_lost: vec![],
        on_disk: None,
        hosts_left: 3,
        stand_by: Vec::new(),
    }));
    sim.run_until("the shrink", 300, |s| !s.m.recovering());
    assert_eq!(sim.m.world_size(), 3);
    sim
}

#[test]
fn the_group_grows_back_once_the_new_ranks_register() {
    let mut sim = shrunk();
    sim.run(5);
    assert!(!sim.m.grow(sim.now, &[2]), "rank 2 never left");
    assert!(sim.m.grow(sim.now, &[1]));
    assert_eq!(
        sim.m.start_mode(),
        StartMode::AwaitDirective,
        "the new rank waits"
    );
    sim.run(1);
    assert!(
        sim.commands
            .iter()
            .any(|c| matches!(c, Command::Respawn { rank: 1, .. }))
    );
    sim.run_until("the grow", 300, |s| {
        s.m.resizes().len() == 2 && !s.m.recovering()
    });
    let grow = &sim.m.resizes()[1];
    assert_eq!((grow.from, grow.to, grow.fault), (3, 4, None));
    let s_star = grow.s_star.unwrap();
    for rank in 0..4u64 {
        assert!(
            sim.commands.contains(&Command::Post {
                rank: rank as usize,
                directive: Directive::Reshape {
                    epoch: sim.m.epoch(),
                    step: s_star,
                    rank,
                    world: 4
                }
            }),
            "rank {rank} takes place {rank} of 4"
        );
    }
    assert!(sim.m.retired().is_empty());
    assert_eq!(sim.outcome, None);
}

#[test]
fn a_host_lost_during_a_grow_leaves_in_the_same_reshape() {
    // The new rank's own host is lost before the group took it in: it
    // leaves again, with nothing to lose.
    let mut sim = shrunk();
    assert!(sim.m.grow(sim.now, &[1]));
    sim.run(1);
    sim.ranks[1].alive = false;
    sim.ranks[1].gone = true;
    sim.feed(Event::HostLost(HostLoss {
        node: 4,
        ranks: vec![1],
        detail: "no heartbeat".into(),
        spare: None,
        state_lost: vec![],
        on_disk: None,
        hosts_left: 3,
        stand_by: Vec::new(),
    }));
    sim.run_until("the reshape", 300, |s| {
        !s.m.recovering() && s.m.joining().is_empty()
    });
    assert_eq!(sim.outcome, None, "{:?}", sim.notes);
    assert_eq!(sim.m.world_size(), 3);
    assert_eq!(sim.m.retired(), &BTreeSet::from([1]));

    // Another host is lost during a grow: it leaves as the new rank joins.
    let mut sim = shrunk();
    assert!(sim.m.grow(sim.now, &[1]));
    sim.run(1);
    sim.ranks[2].alive = false;
    sim.ranks[2].gone = true;
    sim.feed(Event::HostLost(HostLoss {
        node: 2,
        ranks: vec![2],
        detail: "no heartbeat".into(),
        spare: None,
        state_lost: vec![],
        on_disk: None,
        hosts_left: 3,
        stand_by: Vec::new(),
    }));
    sim.run_until("the reshape", 300, |s| {
        !s.m.recovering() && s.m.joining().is_empty()
    });
    assert_eq!(sim.outcome, None, "{:?}", sim.notes);
    assert_eq!(sim.m.retired(), &BTreeSet::from([2]));
    let s_star = sim.m.resizes().last().unwrap().s_star.unwrap();
    for (rank, place) in [(0, 0), (1, 1), (3, 2)] {
        assert!(
            sim.commands.contains(&Command::Post {
                rank,
                directive: Directive::Reshape {
                    epoch: sim.m.epoch(),
                    step: s_star,
                    rank: place,
                    world: 3
                }
            }),
            "rank {rank} takes place {place} of 3: {:?}",
            sim.commands
        );
    }
    let before = sim.ranks[0].step;
    sim.run(20);
    assert!(sim.ranks[0].step > before + 10, "training goes on");
}

#[test]
fn a_successor_knows_the_ranks_that_left() {
    let from = Inherited {
        retired: BTreeSet::from([1]),
        ..Inherited::default()
    };
    let m = Machine::take_over(elastic(1), (0..4).collect(), from);
    assert_eq!(m.world_size(), 3);
    assert_eq!(m.retired(), &BTreeSet::from([1]));
}

#[test]
fn a_shrink_to_a_size_that_does_not_divide_the_global_batch_stands_ranks_by() {
    // Four ranks of a global batch of 8 lose rank 1's host: the controller
    // chose rank 3 to stand by, so the group goes on with 2.
    let mut sim = Sim::with(4, elastic(1));
    sim.feed(Event::Registered {
        rank: 0,
        checkpoint: true,
        global_batch: Some(8),
    });
    sim.run(14);
    sim.ranks[1].alive = false;
    sim.ranks[1].gone = true;
    sim.feed(Event::HostLost(HostLoss {
        node: 1,
        ranks: vec![1],
        detail: "no heartbeat".into(),
        spare: None,
        state_lost: vec![],
        on_disk: None,
        hosts_left: 3,
        stand_by: vec![3],
    }));
    assert_eq!(sim.m.world_size(), 2);
    assert!(sim.commands.contains(&Command::Post {
        rank: 3,
        directive: Directive::Stop
    }));
    sim.run_until("the reshape", 300, |s| !s.m.recovering());
    assert_eq!(sim.outcome, None, "{:?}", sim.notes);
    let s_star = sim.m.faults()[0].s_star.expect("an s*");
    assert_places(&sim, s_star, &[(0, 0), (2, 1)], 2);
    // The stood-by rank's state comes from its replica, as the lost one's.
    assert!(sim.commands.contains(&Command::Donate {
        step: s_star,
        leaving: vec![1, 3]
    }));
    assert!(
        !sim.commands
            .iter()
            .any(|c| matches!(c, Command::Respawn { .. } | Command::Finish(_))),
        "{:?}",
        sim.commands
    );
    assert_eq!(
        sim.m.faults().len(),
        1,
        "its exit is no fault: {:?}",
        sim.m.faults()
    );
    let f = &sim.m.faults()[0];
    assert!(
        f.action.contains("go on with 2 ranks") && f.action.contains("[3] stand by"),
        "{f:?}"
    );
    assert_eq!(sim.m.retired(), &BTreeSet::from([1, 3]));
    let resize = &sim.m.resizes()[0];
    assert_eq!((resize.from, resize.to), (4, 2));
    let before = sim.ranks[0].step;
    sim.run(20);
    assert!(sim.ranks[0].step > before + 10, "training goes on");
}
