//! The controller's routing, placement and messages.

use super::hosts::Growth;
use super::*;
use crate::recovery::{HangPolicy, Inherited, MachineConfig, Outcome, RestartPolicy};
use hatrain_shared::control::StartMode;
use hatrain_shared::ha::HaModes;
use hatrain_shared::shm::Directive;

fn controller(nodes: usize, per_node: usize) -> Controller {
    let cfg = MachineConfig {
        modes: HaModes {
            dump: true,
            retry: false,
            recover: true,
            elastic: false,
        },
        restart: RestartPolicy::default(),
        hang: HangPolicy::default(),
        pause_timeout: Duration::from_secs(1),
        group_restarts: 0,
        register_timeout: Duration::from_secs(3),
        min_nodes: 1,
    };
    let machine = Machine::new(cfg, (0..nodes * per_node).collect(), 0.0);
    Controller::new(machine, nodes, 0, per_node, 0)
}

#[test]
fn commands_go_to_the_host_of_their_rank_and_the_job_wide_ones_everywhere() {
    let mut c = controller(3, 2);
    let post = |rank| Command::Post {
        rank,
        directive: Directive::Pause {
            epoch: 1,
            upto: None,
        },
    };
    assert_eq!(c.route(post(1)), vec![Routed::Here(post(1))]);
    assert_eq!(c.route(post(4)), vec![Routed::There(2, post(4))]);
    assert_eq!(
        c.route(Command::Kill { rank: 3 }),
        vec![Routed::There(1, Command::Kill { rank: 3 })]
    );
    let end = Command::Finish(Outcome::Succeeded);
    assert_eq!(
        c.route(end.clone()),
        vec![
            Routed::There(1, end.clone()),
            Routed::There(2, end.clone()),
            Routed::Here(end)
        ]
    );
    // A checkpoint starts here: the controller shares it out (see
    // `super::super::lastwords`).
    let write = Command::Write { epoch: 2, step: 9 };
    assert_eq!(c.route(write.clone()), vec![Routed::Here(write)]);
    // One host: everything is here.
    let mut one = controller(1, 4);
    assert_eq!(one.route(post(3)), vec![Routed::Here(post(3))]);
    // A host of several that decides for itself alone (no mode on):
    // likewise, and its collection is its own.
    let mut own = Controller::new(controller(1, 2).machine, 1, 2, 2, 0);
    let end = Command::Finish(Outcome::Interrupted);
    assert_eq!(own.route(end.clone()), vec![Routed::Here(end)]);
    own.route(Command::Collect { epoch: 1 });
    assert!(own.gathered(2, 1, vec![(4, vec![3])], Vec::new()).is_some());
}

fn placed(ranks: Vec<usize>, spare: Option<u64>, state_lost: Vec<usize>) -> Option<Placed> {
    Some(Placed {
        ranks,
        spare,
        state_lost,
    })
}

/// A 3×2 controller with a standby, each host holding the replicas of
/// the host before it.
pub(super) fn ring() -> Controller {
    let mut c = Controller::new(controller(3, 2).machine, 3, 0, 2, 1);
    c.heard = (0..4).collect();
    c.note_held(0, [4, 5]);
    c.note_held(1, [0, 1]);
    c.note_held(2, [2, 3]);
    c
}

#[test]
fn a_lost_hosts_ranks_move_to_a_standby_until_none_is_left() {
    let mut c = ring();
    // A standby holds nothing: its loss moves no rank.
    let mut spare_lost = ring();
    assert_eq!(spare_lost.host_lost(3, true, &[3]), None);
    assert_eq!(
        spare_lost.host_lost(1, true, &[1]),
        placed(vec![2, 3], None, vec![])
    );

    assert_eq!(
        c.host_lost(1, true, &[1]),
        placed(vec![2, 3], Some(3), vec![])
    );
    assert_eq!(c.node_of(2), 3);
    assert_eq!(c.ranks_on(3), vec![2, 3]);
    assert_eq!(c.ranks_on(1), Vec::<usize>::new());
    let kill = Command::Kill { rank: 3 };
    assert_eq!(c.route(kill.clone()), vec![Routed::There(3, kill)]);
    // A collection now waits for the standby, not the lost host.
    c.route(Command::Collect { epoch: 1 });
    assert_eq!(
        c.gathered(0, 1, vec![(0, vec![5]), (1, vec![5])], Vec::new()),
        None
    );
    assert_eq!(
        c.gathered(2, 1, vec![(4, vec![5]), (5, vec![5])], Vec::new()),
        None
    );
    assert!(
        c.gathered(3, 1, vec![(2, vec![5]), (3, vec![5])], Vec::new())
            .is_some()
    );
    c.registered(3, 2);
    c.registered(3, 3);
    // The standby lost in turn: nobody is left to take its ranks.
    assert_eq!(
        c.host_lost(3, true, &[1, 3]),
        placed(vec![2, 3], None, vec![])
    );
    // Without worker reboot no standby is used.
    let mut off = ring();
    assert_eq!(
        off.host_lost(2, false, &[2]),
        placed(vec![4, 5], None, vec![])
    );
}

#[test]
fn a_host_lost_with_the_holder_of_its_replicas_names_the_ranks_whose_state_is_gone() {
    // Hosts 1 and 2 at once: host 1's replicas were on host 2.
    let mut c = ring();
    assert_eq!(
        c.host_lost(1, true, &[1, 2]),
        placed(vec![2, 3], None, vec![2, 3])
    );
    // Host 2's ranks still have their replicas on host 0.
    assert_eq!(
        c.host_lost(2, true, &[1, 2]),
        placed(vec![4, 5], Some(3), vec![])
    );

    // One after the other: host 1's ranks go to the standby, to be
    // filled from host 2; host 2 lost before they registered takes
    // their state with it.
    let mut c = ring();
    assert_eq!(
        c.host_lost(1, true, &[1]),
        placed(vec![2, 3], Some(3), vec![])
    );
    assert_eq!(
        c.host_lost(2, true, &[1, 2]),
        placed(vec![4, 5], None, vec![2, 3])
    );
    // Once filled they are safe on the standby.
    let mut c = ring();
    c.host_lost(1, true, &[1]);
    c.registered(3, 2);
    c.registered(3, 3);
    // (A rank registered by a host that does not hold it changes
    // nothing.)
    c.registered(2, 4);
    assert_eq!(
        c.host_lost(2, false, &[1, 2]),
        placed(vec![4, 5], None, vec![])
    );

    // Without replicas every lost rank's state is gone.
    let mut bare = Controller::new(controller(3, 2).machine, 3, 0, 2, 1);
    assert_eq!(
        bare.host_lost(2, true, &[2]),
        placed(vec![4, 5], None, vec![4, 5])
    );
}

#[test]
fn a_collection_is_whole_once_every_host_verified_its_ranks() {
    let mut c = controller(3, 1);
    let routed = c.route(Command::Collect { epoch: 4 });
    assert_eq!(routed.len(), 3, "{routed:?}");
    assert_eq!(c.gathered(1, 4, vec![(1, vec![9, 8])], Vec::new()), None);
    // Another epoch's answer is stale, and changes nothing.
    assert_eq!(c.gathered(2, 3, vec![(2, vec![7])], Vec::new()), None);
    assert_eq!(c.gathered(0, 4, vec![(0, vec![9])], Vec::new()), None);
    let whole = c.gathered(2, 4, vec![(2, vec![9, 8])], Vec::new());
    assert_eq!(
        whole,
        Some(Event::Collected {
            epoch: 4,
            steps: vec![(0, vec![9]), (1, vec![9, 8]), (2, vec![9, 8])]
        })
    );
    // Done: a late answer starts nothing.
    assert_eq!(c.gathered(1, 4, vec![(1, vec![9])], Vec::new()), None);
}

#[test]
fn messages_round_trip_and_garbage_is_an_error() {
    let up = Up::Report {
        views: vec![RankView::absent(3)],
        events: vec![Event::Registered {
            rank: 3,
            checkpoint: true,
            global_batch: None,
        }],
        held: vec![0, 1],
        hold: Some(HoldReport {
            replicas: vec![(1, vec![(12, 2), (11, 2)])],
            common: Some(9),
            target: Some(12),
            kept: vec![(3, Some((12, 2))), (4, None)],
        }),
    };
    let bytes = serde_json::to_vec(&up).unwrap();
    assert_eq!(serde_json::from_slice::<Up>(&bytes).unwrap(), up);
    let down = Down {
        term: 2,
        mirror: Some(std::sync::Arc::new(controller(2, 1).mirror())),
        commands: vec![Command::Respawn {
            rank: 1,
            restarts: 1,
        }],
        registered: vec![(1, StartMode::AwaitDirective)],
        adopt: Some(Adopt {
            node: 1,
            ranks: vec![1],
            fill: false,
        }),
        give: Some(Give { node: 1, to: 2 }),
        regrow: Some(Give { node: 1, to: 2 }),
        write: Some(WritePart {
            epoch: 3,
            step: 40,
            ranks: vec![1, 2],
        }),
        orphans: vec![2],
        final_done: true,
        keep: Some(hatrain_shared::shm::Kept {
            common: Some(12),
            target: Some(15),
        }),
        leave: Some("compute +30 ms".into()),
    };
    let bytes = serde_json::to_vec(&down).unwrap();
    assert_eq!(serde_json::from_slice::<Down>(&bytes).unwrap(), down);
    for up in [
        Up::Wrote {
            epoch: 3,
            result: Err("disk full".into()),
        },
        Up::Collected {
            epoch: 3,
            steps: vec![(1, vec![9])],
            replicas: vec![(2, vec![9, 8])],
        },
    ] {
        let bytes = serde_json::to_vec(&up).unwrap();
        assert_eq!(serde_json::from_slice::<Up>(&bytes).unwrap(), up);
    }
    for junk in [&b""[..], b"{}", b"[1,2]", b"\xff\xfe", b"{\"report\":{}}"] {
        assert!(serde_json::from_slice::<Up>(junk).is_err());
    }
}

proptest::proptest! {
    #[test]
    fn arbitrary_bytes_never_panic_the_decoders(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
        let _ = serde_json::from_slice::<Up>(&bytes);
        let _ = serde_json::from_slice::<Down>(&bytes);
    }
}

/// A host lost with no standby: its ranks are orphans, a collection counts
/// them with the steps their replica holders verified, and each is written
/// by a holder that verified the step; a rank nobody holds is named.
#[test]
fn a_lost_hosts_ranks_are_written_by_the_holders_of_their_replicas() {
    let mut c = controller(3, 2);
    c.note_held(2, [2, 3]);
    assert_eq!(
        c.host_lost(1, true, &[1]),
        Some(Placed {
            ranks: vec![2, 3],
            spare: None,
            state_lost: vec![],
        })
    );
    assert_eq!(c.orphans(), vec![2, 3]);
    c.route(Command::Collect { epoch: 4 });
    assert_eq!(
        c.gathered(0, 4, vec![(0, vec![8, 7]), (1, vec![8, 7])], Vec::new()),
        None
    );
    // Host 2 verified rank 2's replica at 8 and 7, rank 3's at 7 only; a
    // replica of a rank a live host holds is not counted.
    let whole = c.gathered(
        2,
        4,
        vec![(4, vec![8, 7]), (5, vec![8, 7])],
        vec![(2, vec![8, 7]), (3, vec![7]), (0, vec![1])],
    );
    let Some(Event::Collected { steps, .. }) = whole else {
        panic!("the collection is complete: {whole:?}");
    };
    let by_rank: BTreeMap<usize, Vec<u64>> = steps.into_iter().collect();
    assert_eq!(by_rank[&0], vec![8, 7]);
    assert_eq!(by_rank[&2], vec![8, 7]);
    assert_eq!(by_rank[&3], vec![7]);
    assert_eq!(
        c.shares(7),
        Ok(BTreeMap::from([(0, vec![0, 1]), (2, vec![2, 3, 4, 5])]))
    );
    assert_eq!(c.shares(8), Err(vec![3]), "nobody holds rank 3 at step 8");
}

#[test]
fn a_standby_not_heard_yet_takes_no_ranks() {
    let mut c = ring();
    c.heard = (0..3).collect();
    assert_eq!(c.host_lost(1, true, &[1]), placed(vec![2, 3], None, vec![]));
    assert_eq!(c.grow(Duration::ZERO), None, "nothing left the group");
}

#[test]
fn hosts_lost_at_once_all_count_against_the_hosts_left() {
    let mut c = ring();
    c.heard = (0..3).collect();
    c.host_lost(1, true, &[1, 2]);
    assert_eq!(
        c.hosts_left(&[1, 2]),
        1,
        "host 2 is lost too, not yet decided on"
    );
    c.host_lost(2, true, &[1, 2]);
    assert_eq!(c.hosts_left(&[1, 2]), 1);
}

#[test]
fn orders_of_a_replaced_controller_are_refused_before_its_successors_come() {
    // Node 0 controlled under term 6; node 1 took the leader key at 9.
    // Orders of term 6 are refused once the coordinator knows of 9, even
    // by a follower that still follows node 0 and heard nothing of node 1.
    assert_eq!(admit(0, 6, (0, 6), 9), Admit::Stale);
    assert_eq!(admit(0, 6, (1, 9), 9), Admit::Stale);
    // Before the coordinator knows, node 0 is still the controller: the
    // follower cannot tell (the successor's first orders tell it).
    assert_eq!(admit(0, 6, (0, 6), 6), Admit::Take);
    // The successor's first orders: followed from now on.
    assert_eq!(admit(1, 9, (0, 6), 9), Admit::Follow);
    assert_eq!(admit(1, 9, (0, 6), 6), Admit::Follow);
    // Another node, of no newer term, is not the controller.
    assert_eq!(admit(2, 6, (0, 6), 6), Admit::NotController);
    assert_eq!(admit(2, 0, (0, 6), 6), Admit::NotController);
    // The job's first controller, before it acts (term 0), at the start.
    assert_eq!(admit(0, 0, (0, 0), 0), Admit::Take);
    assert_eq!(admit(0, 0, (0, 0), 1), Admit::Take);
}

#[test]
fn the_successors_orders_end_the_wait_for_one_even_under_the_lost_controllers_term() {
    // Node 0 acted under term 1 for an instant and was lost before a
    // heartbeat carried the term: node 1 took over under term 1 too. Its
    // orders end the wait of a follower that took node 0's of term 1.
    assert!(ends_successor_wait(1, 1, 1, &[0]));
    assert!(ends_successor_wait(1, 2, 1, &[0]));
    // Late orders of the lost controller itself do not, unless it acts
    // again under a newer term.
    assert!(!ends_successor_wait(0, 1, 1, &[0]));
    assert!(ends_successor_wait(0, 2, 1, &[0]));
    // A lost standby's are no successor's either.
    assert!(!ends_successor_wait(3, 1, 1, &[0, 3]));
}

/// A successor's take-over settles once every live host reported, or when
/// its deadline passes: the instant comes in, no clock is read.
#[test]
fn a_take_over_settles_when_every_host_reported_or_at_its_deadline() {
    let t0 = Duration::from_secs(1_000);
    let mirror = Mirror::default();
    let mut c = Controller::take_over(controller(3, 2).machine, (3, 2), 1, (&mirror, &[0]), t0);
    let loss = lost(0);
    c.settling.as_mut().unwrap().losses.push(loss.clone());
    assert!(c.settle(Some(1), t0).is_empty(), "host 2 not heard yet");
    assert_eq!(c.settle(Some(2), t0), vec![loss.clone()]);
    assert!(c.settling.is_none());

    let mut late = Controller::take_over(controller(3, 2).machine, (3, 2), 1, (&mirror, &[0]), t0);
    late.settling.as_mut().unwrap().losses.push(loss.clone());
    assert!(late.settle(None, t0 + SETTLE / 2).is_empty());
    assert_eq!(late.settle(None, t0 + SETTLE), vec![loss]);
}

/// Host 1 is lost and no live host has reported a replica of its ranks:
/// before their state is found lost, every live host reports once more
/// (a replica made an instant ago). Host 2's report that it holds them
/// lets the loss go to the standby; with no report by the deadline, the
/// state is lost.
#[test]
fn state_is_found_lost_only_once_every_live_host_reported_again() {
    for reported in [true, false] {
        let mut c = Controller::new(controller(3, 2).machine, 3, 0, 2, 1);
        c.heard = (0..4).collect();
        assert_eq!(
            c.on_host_lost(lost(1), facts(&[1], &[])),
            OnLoss::Settling,
            "nobody holds ranks 2 and 3 yet"
        );
        let t0 = Duration::ZERO;
        let settled = if reported {
            c.note_held(2, [2, 3]);
            assert!(
                c.settle(Some(2), t0).is_empty(),
                "the standby not heard yet"
            );
            c.settle(Some(3), t0)
        } else {
            c.settle(None, t0 + SETTLE)
        };
        assert_eq!(settled, vec![lost(1)]);
        let OnLoss::Recover { loss, .. } = c.on_host_lost(lost(1), facts(&[1], &[])) else {
            panic!("decided once heard");
        };
        if reported {
            assert_eq!((loss.ranks, loss.spare), (vec![2, 3], Some(3)));
            assert!(loss.state_lost.is_empty(), "{:?}", loss.state_lost);
        } else {
            assert_eq!((loss.state_lost, loss.spare), (vec![2, 3], None));
        }
    }
}

pub(super) fn lost(node: u64) -> HostLoss {
    HostLoss {
        node,
        ranks: Vec::new(),
        detail: format!("no heartbeat from host {node}"),
        spare: None,
        state_lost: Vec::new(),
        on_disk: None,
        hosts_left: 0,
        stand_by: Vec::new(),
    }
}

fn facts<'a>(gone: &'a [u64], own_held: &'a [usize]) -> LossFacts<'a> {
    LossFacts {
        acting: true,
        reboot: true,
        gone,
        own_held,
        on_disk: None,
        now: Duration::ZERO,
    }
}

/// Defect A as the controller decides it: host 0's ranks go to standby 3;
/// when standby 3 is lost in turn, the hand-over to standby 4 adopts
/// ranks 0 and 1 (the ranks standby 3 played, not node 3's own numbers),
/// and every other member gives it their replicas.
#[test]
fn the_hand_over_of_a_lost_standby_names_the_ranks_it_played() {
    let mut c = Controller::new(controller(3, 2).machine, 3, 1, 2, 2);
    c.heard = (0..5).collect();
    c.note_held(2, [2, 3]);
    c.note_held(0, [4, 5]);
    let first = c.on_host_lost(lost(0), facts(&[0], &[0, 1]));
    let OnLoss::Recover {
        loss,
        handover: Some(h),
    } = first
    else {
        panic!("host 0's ranks go to a standby: {first:?}");
    };
    assert_eq!((loss.ranks.clone(), loss.spare), (vec![0, 1], Some(3)));
    assert_eq!(h.adopt.ranks, vec![0, 1]);
    assert_eq!((h.to, h.give.node), (3, 0));
    c.registered(3, 0);
    c.registered(3, 1);
    let second = c.on_host_lost(lost(3), facts(&[0, 3], &[0, 1]));
    let OnLoss::Recover {
        loss,
        handover: Some(h),
    } = second
    else {
        panic!("standby 3's ranks go to standby 4: {second:?}");
    };
    assert_eq!(
        (loss.node, loss.ranks.clone(), loss.state_lost.clone()),
        (3, vec![0, 1], vec![])
    );
    assert_eq!(
        h,
        Handover {
            to: 4,
            adopt: Adopt {
                node: 3,
                ranks: vec![0, 1],
                fill: true,
            },
            give: Give { node: 3, to: 4 },
            givers: vec![2],
        }
    );
    // With no standby left, the next loss is recovered without one.
    let third = c.on_host_lost(lost(4), facts(&[0, 3, 4], &[0, 1]));
    assert!(
        matches!(&third, OnLoss::Recover { loss, handover: None } if loss.ranks == [0, 1]),
        "{third:?}"
    );
}

/// Without a majority the controller decides nothing on a loss; while a
/// take-over settles, the loss waits for it; a lost standby holding
/// nothing needs nothing.
#[test]
fn a_loss_is_held_back_without_a_majority_and_waits_for_a_take_over_to_settle() {
    let mut c = Controller::new(controller(3, 2).machine, 3, 0, 2, 1);
    c.heard = (0..4).collect();
    let cut_off = LossFacts {
        acting: false,
        ..facts(&[1], &[])
    };
    assert_eq!(c.on_host_lost(lost(1), cut_off), OnLoss::HoldBack(lost(1)));
    assert_eq!(
        c.on_host_lost(lost(3), facts(&[3], &[])),
        OnLoss::StandbyLost { node: 3 }
    );
    let mirror = Mirror::default();
    let mut s = Controller::take_over(
        controller(3, 2).machine,
        (3, 2),
        1,
        (&mirror, &[0]),
        Duration::from_secs(1_000),
    );
    assert_eq!(
        s.on_host_lost(lost(2), facts(&[0, 2], &[])),
        OnLoss::Settling
    );
    assert_eq!(s.settling.as_ref().unwrap().losses, vec![lost(2)]);
}

/// A controller of 3 hosts of 2 ranks and one standby whose group shrank
/// without host 1 (ranks 2 and 3 left), as a successor inherits it.
fn shrunk() -> Controller {
    let cfg = MachineConfig {
        modes: HaModes {
            dump: true,
            retry: false,
            recover: true,
            elastic: true,
        },
        restart: RestartPolicy::default(),
        hang: HangPolicy::default(),
        pause_timeout: Duration::from_secs(1),
        group_restarts: 0,
        register_timeout: Duration::from_secs(3),
        min_nodes: 1,
    };
    let from = Inherited {
        retired: BTreeSet::from([2, 3]),
        protected: BTreeSet::from([0, 1, 4, 5]),
        ..Inherited::default()
    };
    let machine = Machine::take_over(cfg, (0..6).collect(), from);
    let mut c = Controller::new(machine, 3, 0, 2, 1);
    c.members.remove(&1);
    c.heard = BTreeSet::from([0, 2, 3]);
    c
}

/// The group grows back onto a standby only when the machine grows it:
/// then ranks 2 and 3 are placed there and the orders name them; when the
/// machine refuses (the job is stopping), the standby stays a spare and
/// nothing is placed.
#[test]
fn the_group_grows_onto_a_standby_only_when_the_machine_does() {
    let mut c = shrunk();
    let g = c.grow(Duration::from_secs(1)).expect("the group grows");
    assert_eq!(
        g,
        Growth {
            adopt: Adopt {
                node: 1,
                ranks: vec![2, 3],
                fill: false,
            },
            regrow: Give { node: 1, to: 3 },
            others: vec![2],
        }
    );
    assert_eq!(c.ranks_on(3), vec![2, 3]);

    let mut stopping = shrunk();
    stopping.machine.step(Duration::ZERO, Event::Shutdown);
    assert_eq!(stopping.grow(Duration::from_secs(1)), None);
    assert!(
        stopping.ranks_on(3).is_empty(),
        "nothing placed on the spare"
    );
    assert!(stopping.spares.contains(&3), "the standby is still a spare");
}

/// A controller cut off from the majority holds its losses back; it
/// decides on them once a majority follows it again, stops when another
/// acts, and when nobody does within the wait: it stops (embedded) or
/// gives the held losses to the last words (etcd). The instant comes in.
#[test]
fn a_cut_off_controller_decides_when_it_acts_again_and_stops_when_replaced_or_unheard() {
    use super::minority::CutOffVerdict;
    let view = |acting: bool, follows: Option<u64>| crate::coordinator::View {
        live: vec![0],
        lost: vec![1, 2],
        follows,
        acting,
        term: 3,
        acted: 2,
    };
    let wait = Duration::from_secs(10);
    let t0 = Duration::from_secs(1_000);
    let mut c = ring();
    assert_eq!(
        c.cut_off_verdict(t0, &view(false, Some(0)), wait, false),
        CutOffVerdict::Wait,
        "nothing held back"
    );
    c.hold_back(lost(1), t0);
    c.hold_back(lost(2), t0 + Duration::from_secs(1));
    assert_eq!(c.cut_off_hosts(), "host 1 (a standby), host 2 (a standby)");
    let early = t0 + wait / 2;
    assert_eq!(
        c.cut_off_verdict(early, &view(false, Some(0)), wait, false),
        CutOffVerdict::Wait
    );
    assert_eq!(
        c.cut_off_verdict(early, &view(false, Some(1)), wait, false),
        CutOffVerdict::Replaced { by: 1 }
    );
    let late = t0 + wait;
    assert_eq!(
        c.cut_off_verdict(late, &view(false, None), wait, false),
        CutOffVerdict::TimedOut
    );
    assert_eq!(
        c.cut_off_verdict(early, &view(true, Some(0)), wait, false),
        CutOffVerdict::Decide(vec![lost(1), lost(2)])
    );
    assert!(c.cut_off.is_none(), "decided: nothing held back any more");

    let mut e = ring();
    e.hold_back(lost(1), t0);
    assert_eq!(
        e.cut_off_verdict(late, &view(false, Some(0)), wait, true),
        CutOffVerdict::GiveUp(vec![lost(1)])
    );
}

/// With etcd, faults seen while the controller may not act wait: decided
/// in order once it acts, given up to the last words past the timeout.
#[test]
fn faults_held_while_unled_are_decided_in_order_or_given_up_past_the_timeout() {
    use super::unled::UnledVerdict;
    let t0 = Duration::from_secs(1_000);
    let timeout = Duration::from_secs(30);
    let fault = |rank| Event::SpawnFailed {
        rank,
        error: "no".into(),
    };
    let mut c = ring();
    assert_eq!(c.unled_verdict(t0, false, timeout), UnledVerdict::Wait);
    assert!(c.hold_unled(fault(1), t0), "the first one held");
    assert!(!c.hold_unled(fault(2), t0 + Duration::from_secs(5)));
    assert_eq!(
        c.unled_verdict(t0 + Duration::from_secs(29), false, timeout),
        UnledVerdict::Wait
    );
    assert_eq!(
        c.unled_verdict(t0 + Duration::from_secs(12), true, timeout),
        UnledVerdict::Decide {
            events: vec![fault(1), fault(2)],
            waited: Duration::from_secs(12),
        }
    );
    assert_eq!(c.unled_verdict(t0, true, timeout), UnledVerdict::Wait);
    c.hold_unled(fault(3), t0);
    assert_eq!(
        c.unled_verdict(t0 + timeout, false, timeout),
        UnledVerdict::GiveUp
    );
}

/// The controller waits for the final checkpoint's shares while they may
/// still come: not past its deadline, nothing failed, and no host lost
/// that holds a rank whose share is missing.
#[test]
fn the_final_checkpoint_is_waited_for_only_while_its_shares_may_come() {
    use super::saves::FinalSave;
    let t0 = Duration::from_secs(1_000);
    let mut c = ring();
    assert!(!c.final_pending(t0, &[]), "no final save");
    c.final_save = Some(FinalSave {
        step: 60,
        until: t0 + Duration::from_secs(10),
        failed: None,
    });
    c.saves.insert(60, BTreeSet::from([0, 1, 2, 3]));
    assert!(c.final_pending(t0, &[]));
    assert!(c.final_pending(t0, &[1]), "host 1's ranks are in");
    assert!(!c.final_pending(t0, &[2]), "host 2 held ranks 4 and 5");
    assert!(!c.final_pending(t0 + Duration::from_secs(10), &[]));
    c.final_save.as_mut().unwrap().failed = Some("disk full".into());
    assert!(!c.final_pending(t0, &[]));
    c.saves.clear();
    c.final_save.as_mut().unwrap().failed = None;
    assert!(!c.final_pending(t0, &[]), "committed already");
}

#[test]
fn a_periodic_save_is_whole_once_every_hosts_share_is_in_and_older_steps_go() {
    use super::saves::Share;
    let mut c = controller(3, 2);
    let ok: Result<(), &crate::recovery::WriteFailed> = Ok(());
    // Step 10: hosts 0 and 1 wrote theirs; a share of another host's rank
    // is refused.
    assert_eq!(
        c.share_saved(0, 10, vec![0, 1], ok, 6).share,
        Share::Counted
    );
    assert_eq!(
        c.share_saved(1, 10, vec![4], ok, 6).share,
        Share::Refused { rank: 4 }
    );
    assert_eq!(
        c.share_saved(1, 10, vec![2, 3], ok, 6).share,
        Share::Counted
    );
    // Step 20 starts; one of its shares fails: never committed.
    assert_eq!(
        c.share_saved(0, 20, vec![0, 1], ok, 6).share,
        Share::Counted
    );
    let failed = crate::recovery::WriteFailed("disk full".into());
    assert_eq!(
        c.share_saved(2, 20, vec![4, 5], Err(&failed), 6).share,
        Share::Failed
    );
    // Step 30 is whole before 10 is: 10 and 20 are overtaken.
    for (node, ranks) in [(0, vec![0, 1]), (1, vec![2, 3])] {
        assert_eq!(c.share_saved(node, 30, ranks, ok, 6).share, Share::Counted);
    }
    assert_eq!(
        c.share_saved(2, 30, vec![4, 5], ok, 6).share,
        Share::Whole {
            step: 30,
            stale: vec![10, 20],
            world: 6
        }
    );
    // Steps whose shares never all come are given up beyond four.
    let mut given_up = Vec::new();
    for step in [40, 50, 60, 70, 80, 90] {
        given_up.extend(c.share_saved(0, step, vec![0, 1], ok, 6).given_up);
    }
    assert_eq!(given_up, vec![40, 50]);
}
