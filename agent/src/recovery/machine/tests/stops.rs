//! Faults that stop the job at once: a store that cannot be made, a host
//! lost with every replica of its ranks.

use super::*;

#[test]
fn a_store_that_cannot_be_made_stops_the_job_at_once() {
    let mut sim = Sim::new(2);
    sim.feed(Event::Unfit {
        rank: 1,
        reason: "the shm root /x has 0 bytes free".into(),
    });
    assert_eq!(sim.outcome, Some(Outcome::Unfit));
    assert_eq!(sim.kinds(), vec![FaultKind::Store]);
    assert!(
        !sim.commands
            .iter()
            .any(|c| matches!(c, Command::Respawn { .. } | Command::Write { .. }))
    );
}

#[test]
fn a_host_lost_with_its_replicas_stops_at_once_naming_the_ranks_and_the_disk() {
    let loss = |spare, state_lost: Vec<usize>| {
        Event::HostLost(HostLoss {
            node: 1,
            ranks: vec![2, 3],
            detail: "no heartbeat".into(),
            spare,
            state_lost,
            on_disk: Some(OnDisk {
                dir: "/ckpt".into(),
                iteration: Some(10),
            }),
            hosts_left: 2,
            stand_by: Vec::new(),
        })
    };
    let mut sim = Sim::new(6);
    sim.run(14);
    sim.feed(loss(Some(3), vec![2, 3]));
    assert_eq!(sim.outcome, Some(Outcome::RecoveryFailed));
    let f = &sim.m.faults()[0];
    assert_eq!((f.kind, f.ranks.clone()), (FaultKind::HostLost, vec![2, 3]));
    assert!(
        f.reason.contains("the state of ranks [2, 3] is lost")
            && f.reason.contains("iteration 10 in /ckpt"),
        "{f:?}"
    );
    // Nothing is written, nothing restarted: no checkpoint could be whole.
    assert!(
        !sim.commands
            .iter()
            .any(|c| matches!(c, Command::Respawn { .. } | Command::Write { .. })),
        "{:?}",
        sim.commands
    );

    // With the replicas alive the ranks restart on the standby, and every
    // rank resumes from s*.
    let mut sim = Sim::new(6);
    sim.run(14);
    sim.ranks[2].alive = false;
    sim.ranks[3].alive = false;
    sim.feed(loss(Some(3), vec![]));
    for rank in [2, 3] {
        assert!(
            sim.commands
                .iter()
                .any(|c| matches!(c, Command::Respawn { rank: r, .. } if *r == rank))
        );
    }
    sim.run_until("the recovery", 300, |s| !s.m.recovering());
    assert_eq!(sim.outcome, None);
    assert!(sim.m.faults()[0].recovery_s.is_some());
}
