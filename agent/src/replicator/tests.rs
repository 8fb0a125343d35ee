use super::*;
use hatrain_shared::shm::Geometry;

fn labels(l: &[Option<&str>]) -> Vec<Option<String>> {
    l.iter().map(|x| x.map(String::from)).collect()
}

#[test]
fn placement_is_the_next_hosts_outside_the_failure_domain() {
    let none = labels(&[None, None, None, None]);
    assert_eq!(targets(0, &none, 1), vec![1]);
    assert_eq!(targets(3, &none, 1), vec![0]);
    assert_eq!(targets(2, &none, 2), vec![3, 0]);
    assert_eq!(targets(1, &none, 9), vec![2, 3, 0], "never itself");
    let racks = labels(&[Some("a"), Some("a"), Some("b"), Some("b")]);
    assert_eq!(targets(0, &racks, 1), vec![2]);
    assert_eq!(targets(2, &racks, 2), vec![0, 1]);
    assert_eq!(targets(3, &racks, 1), vec![0]);
    let one_rack = labels(&[Some("a"), Some("a")]);
    assert!(
        targets(0, &one_rack, 1).is_empty(),
        "fewer when fewer qualify"
    );
    // An unlabelled host may hold anyone's.
    let mixed = labels(&[Some("a"), None, Some("a")]);
    assert_eq!(targets(0, &mixed, 2), vec![1]);
    assert_eq!(targets(1, &mixed, 1), vec![2]);
}

fn cfg(node: u64, bind: &str, dir: &std::path::Path) -> ReplicatorConfig {
    ReplicatorConfig {
        secret: Secret::from_bytes([5; 32]),
        node,
        bind: bind.parse().unwrap(),
        dir: dir.to_path_buf(),
        slots: 2,
        ranks_per_node: 1,
        chunk: 64 << 10,
        window: 4,
    }
}

/// Real sockets on two loopback addresses, a real store: every
/// snapshot sealed is streamed, held byte-identical, and the report says
/// so.
#[test]
fn snapshots_stream_over_real_sockets_and_are_held_identical() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let holder = Replicator::listen(cfg(1, "127.0.0.2", b.path())).unwrap();
    holder.hold_for(0);
    let sender = Replicator::listen(cfg(0, "127.0.0.1", a.path())).unwrap();
    let store = Arc::new(
        Store::create(
            &hatrain_shared::shm::store_path(a.path(), 0),
            0,
            Geometry::new(2, 300_000),
            4,
            6,
        )
        .unwrap(),
    );
    sender.add_rank(0, Arc::clone(&store), None);
    sender.stream_to(1, holder.endpoint().to_string());
    let deadline = Instant::now() + Duration::from_secs(30);
    for step in 1..=5u64 {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i as u64 * step) as u8).collect();
        let slot = store.writable_slot().unwrap();
        store
            .write_slot(slot, 0, step, 0, &[&data], &mut |_, _| true)
            .unwrap();
        loop {
            let r = sender.report();
            let stored = r
                .streams
                .first()
                .and_then(|s| s.ranks.first())
                .and_then(|k| k.replica_step);
            if stored == Some(step) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "step {step} not replicated: {r:?}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let replica = Store::open(&inbox::replica_path(b.path(), 0)).unwrap();
        let info = replica.find_step(step).expect("sealed and verified");
        let mut back = vec![0u8; data.len()];
        replica.read_slot(info.slot, &mut [&mut back]).unwrap();
        assert_eq!(back, data, "step {step}");
    }
    let r = sender.report();
    let k = &r.streams[0].ranks[0];
    assert_eq!(
        (k.local_step, k.lag_steps, k.lag_bytes),
        (Some(5), Some(0), 0)
    );
    assert!(r.streams[0].connected);
    assert!(!k.at_risk, "the peer holds the newest step: {k:?}");
    // The holder publishes what it holds at its next idle moment.
    let h = loop {
        let h = holder.report();
        if h.held.first().is_some_and(|x| x.steps.first() == Some(&5)) {
            break h;
        }
        assert!(
            Instant::now() < deadline,
            "the holder does not say it holds step 5: {h:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!((h.held[0].rank, h.held[0].from_node), (0, 0));
    assert_eq!(
        h.rejected_forged + h.rejected_malformed + h.rejected_replayed,
        0
    );
    holder.stop();
    assert!(
        !inbox::replica_path(b.path(), 0).exists(),
        "a stopped holder leaves no replica behind"
    );
}

/// A holder that never answers (a listener that takes the connection and
/// says nothing): the replica stays behind, and once the rank's store is
/// full, with the replica's step in no slot but the one its next commit
/// overwrites, the report marks the rank at risk.
#[test]
fn a_replica_left_behind_is_reported_at_risk() {
    let a = tempfile::tempdir().unwrap();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let sender = Replicator::listen(cfg(0, "127.0.0.1", a.path())).unwrap();
    let store = Arc::new(
        Store::create(
            &hatrain_shared::shm::store_path(a.path(), 0),
            0,
            Geometry::new(2, 4096),
            4,
            6,
        )
        .unwrap(),
    );
    sender.add_rank(0, Arc::clone(&store), None);
    sender.stream_to(1, format!("tcp://{}", silent.local_addr().unwrap()));
    let at_risk = || {
        let r = sender.report();
        r.streams
            .first()
            .and_then(|s| s.ranks.first())
            .is_some_and(|k| k.at_risk)
    };
    let write = |step: u64| {
        let slot = store.writable_slot().unwrap();
        store
            .write_slot(slot, 0, step, 0, &[&[step as u8; 4096]], &mut |_, _| true)
            .unwrap();
    };
    // One slot of two sealed: the next commit overwrites nothing.
    write(1);
    std::thread::sleep(Duration::from_millis(500));
    assert!(!at_risk(), "{:?}", sender.report());
    write(2);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !at_risk() {
        assert!(
            Instant::now() < deadline,
            "not marked at risk: {:?}",
            sender.report()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = sender.report();
    assert!(!r.streams[0].connected);
    assert_eq!(r.streams[0].ranks[0].replica_step, None);
    sender.stop();
}
