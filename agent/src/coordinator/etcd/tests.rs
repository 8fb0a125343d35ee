//! The etcd coordinator's view, without etcd: what etcd said is set by
//! hand.

use super::*;

fn cfg(node: u64) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec!["127.0.0.1:1".into()],
        prefix: "/hatrain/j/".into(),
        nodes: 4,
        node,
        ttl: Duration::from_secs(3),
        about: "{}".into(),
    }
}

/// A coordinator with no thread: what etcd said is set by hand.
fn detached(node: u64) -> Etcd {
    Etcd {
        cfg: cfg(node),
        known: Arc::new(Mutex::new(Known::default())),
        stop: Arc::new(AtomicBool::new(false)),
        thread: None,
        heard_term: 0,
        heard: Heard {
            at: vec![None; 4],
            dropped: vec![false; 4],
        },
        acted: 0,
    }
}

/// What etcd said: the members read (`None`: not read, a follower),
/// the leader key's node and term (bound to lease 100 + node), this
/// agent's lease (100 + its node) valid or not.
fn told(e: &Etcd, live: Option<&[u64]>, leader: Option<(u64, u64)>, valid: bool) {
    let mut k = e.known.lock().unwrap();
    k.live = live.map(|l| l.iter().copied().collect());
    k.ever.extend(live.unwrap_or_default());
    k.ever.extend(leader.map(|(n, _)| n));
    k.leader = leader.map(|(node, term)| Leader {
        node,
        term,
        lease: 100 + node as i64,
    });
    k.lease = Some(100 + e.cfg.node as i64);
    let now = Instant::now();
    k.valid_until = Some(if valid {
        now + Duration::from_secs(3)
    } else {
        now
    });
    k.answered = Some(now);
}

#[test]
fn an_agent_acts_only_with_a_valid_lease_and_the_leader_key_of_the_newest_term() {
    let mut e = detached(0);
    told(&e, Some(&[0, 1, 2]), Some((0, 7)), true);
    let v = e.view(Duration::ZERO);
    assert!(v.acting);
    assert_eq!((v.follows, v.term, v.acted), (Some(0), 7, 7));
    // Its lease ran out by its own clock: it stops acting, whatever
    // etcd said last.
    told(&e, Some(&[0, 1, 2]), Some((0, 7)), false);
    assert!(!e.view(Duration::ZERO).acting);
    // A new lease of its own, and the key still read as bound to the
    // old one (it went with it): not acting.
    told(&e, Some(&[0, 1, 2]), Some((0, 7)), true);
    e.known.lock().unwrap().lease = Some(555);
    assert!(!e.view(Duration::ZERO).acting);
    // Another's key: it follows that one, and remembers the term it
    // acted under.
    told(&e, Some(&[0, 1, 2]), Some((1, 9)), true);
    let v = e.view(Duration::ZERO);
    assert!(!v.acting);
    assert_eq!((v.follows, v.term, v.acted), (Some(1), 9, 7));
}

#[test]
fn a_newer_term_heard_in_a_heartbeat_stops_the_old_leader_acting() {
    let mut e = detached(0);
    told(&e, Some(&[0, 1]), Some((0, 7)), true);
    assert!(e.view(Duration::ZERO).acting);
    e.observe(
        Duration::from_secs(1),
        Observed::Heartbeat(Heartbeat {
            from: 1,
            stamp: Duration::ZERO,
            follows: Some(1),
            echo: None,
            term: 12,
        }),
    );
    let v = e.view(Duration::from_secs(1));
    assert!(!v.acting, "a newer leader exists");
    assert_eq!((v.term, v.acted), (12, 7));
    assert_eq!(e.heartbeat(Duration::from_secs(1)).term, 12);
}

#[test]
fn the_controller_sees_a_host_lost_when_its_key_goes_and_a_follower_only_its_controller() {
    let mut e = detached(0);
    // Node 3 heartbeats, and has no key yet: starting, not lost.
    e.observe(
        Duration::ZERO,
        Observed::Heartbeat(Heartbeat {
            from: 3,
            stamp: Duration::ZERO,
            follows: Some(0),
            echo: None,
            term: 7,
        }),
    );
    told(&e, Some(&[0, 1, 2]), Some((0, 7)), true);
    assert!(e.view(Duration::ZERO).lost.is_empty());
    // Never seen with a key and silent past the TTL: gone before this
    // agent read the members.
    assert_eq!(e.view(Duration::from_secs(4)).lost, vec![3]);
    told(&e, Some(&[0, 2, 3]), Some((0, 7)), true);
    let v = e.view(Duration::ZERO);
    assert_eq!((v.live, v.lost), (vec![0, 2, 3], vec![1]));
    // Its heartbeats alone do not bring it back while etcd answers.
    e.observe(
        Duration::from_secs(1),
        Observed::Heartbeat(Heartbeat {
            from: 1,
            stamp: Duration::ZERO,
            follows: Some(0),
            echo: None,
            term: 7,
        }),
    );
    assert_eq!(e.view(Duration::from_secs(1)).lost, vec![1]);
    // A follower reads no members while its controller stands: no loss.
    let mut f = detached(2);
    told(&f, None, Some((0, 7)), true);
    let v = f.view(Duration::ZERO);
    assert!(v.lost.is_empty() && !v.acting);
    assert_eq!(v.follows, Some(0));
    // The controller's key went (with its lease): it reads them, and
    // its controller is lost.
    told(&f, Some(&[1, 2, 3]), None, true);
    let v = f.view(Duration::ZERO);
    assert_eq!((v.lost, v.follows), (vec![0], None));
}

#[test]
fn while_etcd_is_silent_a_host_whose_heartbeats_stop_is_lost_and_nobody_else() {
    let mut e = detached(0);
    told(&e, Some(&[0, 1, 2, 3]), Some((0, 7)), true);
    for from in [1, 2] {
        e.observe(
            Duration::ZERO,
            Observed::Heartbeat(Heartbeat {
                from,
                stamp: Duration::ZERO,
                follows: Some(0),
                echo: None,
                term: 7,
            }),
        );
    }
    e.observe(Duration::from_secs(1), Observed::Dropped { node: 2 });
    // etcd answers: a dropped connection alone loses nobody.
    assert!(e.view(Duration::from_secs(1)).lost.is_empty());
    // etcd silent past the TTL: host 2's drop counts, host 1 (heard)
    // does not; nobody acts once the lease is gone.
    {
        let mut k = e.known.lock().unwrap();
        k.answered = Some(Instant::now() - Duration::from_secs(4));
        k.valid_until = Some(Instant::now());
    }
    let v = e.view(Duration::from_secs(1));
    assert_eq!(v.lost, vec![2]);
    assert!(!v.acting);
    assert!(v.live.contains(&1));
}

#[test]
fn coordinator_urls_name_every_member_or_say_what_is_wrong() {
    assert_eq!(
        parse_url("etcd://127.0.0.1:2379").unwrap(),
        vec!["127.0.0.1:2379"]
    );
    assert_eq!(
        parse_url("etcd://a:1,b:2, c:3").unwrap(),
        vec!["a:1", "b:2", "c:3"]
    );
    for bad in [
        "http://a:1",
        "etcd://",
        "etcd://a",
        "etcd://a:x",
        "etcd://:1",
        "etcd://a:0",
    ] {
        let e = parse_url(bad).unwrap_err();
        assert!(e.to_string().contains(bad), "{e}");
    }
}
