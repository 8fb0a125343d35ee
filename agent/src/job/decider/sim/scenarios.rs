//! Multi-host faults on the simulated cluster, each over many seeds
//! (message delays, and when each fault strikes).

use super::*;
use hatrain_shared::control::FaultKind;
use proptest::prelude::*;

/// The same cases on every run, so that a failure is the code's, never
/// the draw's; `HATRAIN_SIM_SEED` (a number) draws other cases, and
/// `HATRAIN_SIM_CASES` more of them, for a wider search by hand.
fn cases() -> ProptestConfig {
    let var = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    ProptestConfig {
        cases: var("HATRAIN_SIM_CASES").map_or(24, |n| n as u32),
        rng_seed: proptest::test_runner::RngSeed::Fixed(var("HATRAIN_SIM_SEED").unwrap_or(0x5eed)),
        ..ProptestConfig::default()
    }
}

fn delays() -> impl Strategy<Value = Vec<u64>> {
    proptest::collection::vec(1u64..6, 1..16)
}

/// 3 hosts of 1 rank and a standby; after `first` steps the controller
/// stops hearing a majority and host 2 is killed; `held` ticks pass.
fn cut_off_as_host_2_is_lost(delays: Vec<u64>, first: u64, held: u32) -> Cluster {
    let mut c = Cluster::new(3, 1, 1, delays);
    c.run_until("the first steps", 2_000, |c| c.step() >= first);
    c.acting = false;
    c.kill(2);
    c.run_until("host 2 unheard", 1_000, |c| !c.hosts_left().contains(&2));
    for _ in 0..held {
        c.tick();
    }
    c
}

fn kinds(c: &Cluster) -> Vec<FaultKind> {
    c.faults().iter().map(|f| f.kind).collect()
}

proptest! {
    #![proptest_config(cases())]

    /// Defect A: 3 hosts of 1 rank and 2 standbys. The controller's host
    /// is killed, its successor gives rank 0 to standby 3; then host 3 is
    /// lost in turn (killed, or frozen past the host timeout and thawed),
    /// and standby 4 takes rank 0 from its replica.
    #[test]
    fn a_standby_that_took_over_and_is_lost_in_turn_is_replaced_by_the_next(
        delays in delays(),
        first in 5u64..25,
        gap in 5u64..20,
        freeze in any::<bool>(),
    ) {
        let mut c = Cluster::new(3, 1, 2, delays);
        c.run_until("the first steps", 2_000, |c| c.step() >= first);
        c.kill(0);
        c.run_until("standby 3 playing rank 0", 3_000, |c| {
            c.host_of(0) == 3 && c.step() > first
        });
        prop_assert_eq!(c.leader, 1);
        let second = c.step() + gap;
        c.run_until("more steps", 3_000, |c| c.step() >= second);
        if freeze {
            c.freeze(3, true);
        } else {
            c.kill(3);
        }
        c.run_until("standby 4 playing rank 0", 3_000, |c| c.host_of(0) == 4);
        if freeze {
            c.freeze(3, false);
        }
        c.run_until("the end", 20_000, |c| c.outcome.is_some());
        prop_assert_eq!(c.outcome, Some(Outcome::Succeeded), "{:?}", c.stop);
        c.assert_identical();
        prop_assert_eq!(kinds(&c), vec![FaultKind::HostLost, FaultKind::HostLost]);
        prop_assert_eq!(c.hosts_left(), BTreeSet::from([1, 2, 4]));
    }

    /// The controller's host is lost while it recovers from a crash on
    /// another host (at any moment of that recovery, the crash's report
    /// perhaps still in flight to it): the successor inherits the job,
    /// the crashed rank is restarted, and a standby takes the lost ranks.
    #[test]
    fn the_controller_lost_mid_recovery_leaves_a_successor_that_finishes_it(
        delays in delays(),
        first in 5u64..25,
        rank in 2usize..6,
        after in 0u32..60,
    ) {
        let mut c = Cluster::new(3, 2, 1, delays);
        c.target = 150;
        c.run_until("the first steps", 2_000, |c| c.step() >= first);
        c.crash(rank);
        for _ in 0..after {
            c.tick();
        }
        c.kill(0);
        c.run_until("the end", 20_000, |c| c.outcome.is_some());
        prop_assert_eq!(c.outcome, Some(Outcome::Succeeded), "{:?} {:#?}", c.stop, c.notes);
        c.assert_identical();
        prop_assert_eq!(c.leader, 1);
        prop_assert_eq!(c.host_of(0), 3);
        prop_assert_eq!(c.host_of(1), 3);
        let k = kinds(&c);
        prop_assert!(k.contains(&FaultKind::HostLost), "{:?}", k);
        prop_assert!(k.contains(&FaultKind::Crash), "{:?}", k);
        prop_assert!(c.faults().iter().all(|f| f.recovery_s.is_some()), "{:#?}", c.faults());
    }

    /// With etcd, a crash while the controller does not hold its lease
    /// waits; the controller decides it once it acts again, before
    /// `--coordinator-timeout`.
    #[test]
    fn a_fault_while_etcd_is_away_waits_and_is_decided_when_it_returns(
        delays in delays(),
        first in 5u64..25,
        rank in 0usize..4,
        away in 5u32..450,
    ) {
        let mut c = Cluster::new(2, 2, 0, delays);
        c.ctl.rules.etcd = Some("http://127.0.0.1:2379".into());
        c.ctl.rules.coordinator_timeout = Duration::from_secs(5);
        c.run_until("the first steps", 2_000, |c| c.step() >= first);
        c.acting = false;
        c.crash(rank);
        for _ in 0..away {
            c.tick();
        }
        prop_assert!(c.faults().is_empty(), "decided while not acting");
        c.acting = true;
        c.run_until("the end", 20_000, |c| c.outcome.is_some());
        prop_assert_eq!(c.outcome, Some(Outcome::Succeeded), "{:?}", c.stop);
        c.assert_identical();
        prop_assert_eq!(kinds(&c), vec![FaultKind::Crash]);
    }

    /// Past `--coordinator-timeout` the faults held go toward the last
    /// words, written from the snapshots, and the job stops saying why.
    #[test]
    fn a_fault_that_waits_past_the_coordinator_timeout_ends_in_the_last_words(
        delays in delays(),
        first in 5u64..25,
        rank in 0usize..4,
    ) {
        let mut c = Cluster::new(2, 2, 0, delays);
        c.ctl.rules.etcd = Some("http://127.0.0.1:2379".into());
        c.ctl.rules.coordinator_timeout = Duration::from_secs(3);
        c.run_until("the first steps", 2_000, |c| c.step() >= first);
        c.acting = false;
        c.crash(rank);
        // Nothing is decided before the timeout, though the rank is seen
        // dead all along.
        let held = c.now;
        while c.now < held + Duration::from_millis(2_900) {
            c.tick();
        }
        prop_assert!(c.faults().is_empty(), "decided while etcd was away: {:#?}", c.faults());
        c.run_until("the end", 20_000, |c| c.outcome.is_some());
        prop_assert_eq!(c.outcome, Some(Outcome::RecoveryFailed));
        let why = c.stop.clone().unwrap_or_default();
        prop_assert!(why.contains("--coordinator-timeout"), "{}", why);
        let words = c.ctl.machine.last_words().cloned();
        prop_assert!(words.is_some(), "no last words");
        // The last words are of a step every rank held.
        let it = words.map(|w| w.iteration).unwrap_or_default();
        prop_assert!(it >= first && it <= c.steps().into_iter().max().unwrap_or(0));
    }

    /// A controller cut off from the majority decides nothing on the host
    /// it stops hearing; when the partition mends before anyone takes
    /// over it decides, and the job ends as without it.
    #[test]
    fn a_controller_cut_off_holds_back_a_loss_until_it_hears_a_majority(
        delays in delays(),
        first in 5u64..25,
        held in 5u32..200,
    ) {
        let mut c = cut_off_as_host_2_is_lost(delays, first, held);
        prop_assert!(c.faults().is_empty(), "decided without a majority");
        prop_assert_eq!(c.host_of(2), 2, "its rank moved without a majority");
        c.acting = true;
        c.run_until("the end", 20_000, |c| c.outcome.is_some());
        prop_assert_eq!(c.outcome, Some(Outcome::Succeeded), "{:?}", c.stop);
        c.assert_identical();
        prop_assert_eq!(c.host_of(2), 3);
    }

    /// When another agent acts under a newer term instead (the majority
    /// side took over), the cut-off controller stops, deciding nothing on
    /// the loss it held back and sending no hand-over.
    #[test]
    fn a_controller_cut_off_and_replaced_stops_deciding_nothing(
        delays in delays(),
        first in 5u64..25,
        held in 5u32..200,
    ) {
        let mut c = cut_off_as_host_2_is_lost(delays, first, held);
        c.follows = Some(1);
        c.term = 2;
        c.run_until("the stop", 1_000, |c| c.outcome.is_some());
        prop_assert_eq!(c.outcome, Some(Outcome::RecoveryFailed));
        let why = c.stop.clone().unwrap_or_default();
        prop_assert!(why.contains("node 1 now (term 2)"), "{}", why);
        prop_assert!(c.faults().is_empty());
        prop_assert!(c.sent.iter().all(|(_, d)| d.adopt.is_none() && d.give.is_none()));
    }

    /// Defect C: a served job's agent dies and the next one takes over
    /// from what it kept. A worker killed while no agent ran, and one
    /// killed after, are each dated between their kill and when the
    /// next agent saw them, on the job's clock.
    #[test]
    fn a_served_jobs_next_agent_dates_faults_between_the_kill_and_its_sight(
        first in 5u64..25,
        down in 1u32..200,
        later in 1u32..50,
    ) {
        let mut c = Cluster::new(1, 2, 0, vec![1]);
        c.target = 200;
        c.run_until("the first steps", 2_000, |c| c.step() >= first);
        c.agent_dies();
        c.crash(1);
        let killed = c.now;
        for _ in 0..down {
            c.tick();
        }
        c.agent_starts();
        c.run_until("the first fault seen", 100, |c| !c.faults().is_empty());
        let seen = c.now;
        c.run_until("the first recovery", 5_000, |c| {
            c.faults().len() == 1 && c.faults()[0].recovery_s.is_some()
        });
        for _ in 0..later {
            c.tick();
        }
        c.crash(0);
        let killed_again = c.now;
        c.run_until("the second fault seen", 100, |c| c.faults().len() == 2);
        let seen_again = c.now;
        c.run_until("the end", 20_000, |c| c.outcome.is_some());
        prop_assert_eq!(c.outcome, Some(Outcome::Succeeded), "{:?}", c.stop);
        c.assert_identical();
        let at = |i: usize| Duration::from_secs_f64(c.faults()[i].detected_unix_s - 1_000.0);
        let close = |a: Duration, lo: Duration, hi: Duration| {
            a + Duration::from_micros(1) >= lo && a <= hi + Duration::from_micros(1)
        };
        prop_assert!(close(at(0), killed, seen), "{:?} not in {:?}..{:?}", at(0), killed, seen);
        prop_assert!(
            close(at(1), killed_again, seen_again),
            "{:?} not in {:?}..{:?}", at(1), killed_again, seen_again
        );
    }

    /// Elastic training: a host lost with no standby shrinks the group; a
    /// standby heard later grows it back; while it grows, another host is
    /// lost, and the group shrinks again in the same reshape.
    #[test]
    fn a_host_lost_while_the_group_grows_back_shrinks_it_again(
        delays in delays(),
        first in 5u64..25,
        after in 0u32..80,
    ) {
        let mut c = Cluster::with(4, 1, 1, delays, config(true));
        c.target = 200;
        c.silent.insert(4);
        c.run_until("the first steps", 2_000, |c| c.step() >= first);
        c.kill(3);
        c.run_until("the shrink", 3_000, |c| {
            c.ctl.machine.retired().contains(&3) && !c.ctl.machine.recovering()
        });
        let more = c.step() + 5;
        c.run_until("more steps", 3_000, |c| c.step() >= more);
        c.hear(4);
        c.run_until("the grow begins", 3_000, |c| c.host_of(3) == 4);
        for _ in 0..after {
            c.tick();
        }
        c.kill(2);
        c.run_until("the end", 20_000, |c| c.outcome.is_some());
        prop_assert_eq!(c.outcome, Some(Outcome::Succeeded), "{:?} {:#?}", c.stop, c.notes);
        c.assert_consistent();
        prop_assert_eq!(c.ctl.machine.retired(), &BTreeSet::from([2]));
        prop_assert_eq!(c.host_of(3), 4);
        prop_assert_eq!(kinds(&c), vec![FaultKind::HostLost, FaultKind::HostLost]);
    }

    /// The controller's host is lost during a shrink, at any moment of
    /// it (pausing, collecting, its reshape out but not yet seen to take):
    /// the successor inherits the reshape, and the group shrinks to the
    /// one host left.
    #[test]
    fn the_controller_lost_mid_reshape_leaves_a_successor_that_carries_it_on(
        delays in delays(),
        first in 5u64..25,
        after in 0u32..60,
    ) {
        let mut c = Cluster::with(3, 1, 0, delays, config(true));
        c.target = 150;
        c.run_until("the first steps", 2_000, |c| c.step() >= first);
        c.kill(2);
        c.run_until("the shrink begins", 3_000, |c| c.ctl.machine.recovering());
        for _ in 0..after {
            c.tick();
        }
        c.kill(0);
        c.run_until("the end", 20_000, |c| c.outcome.is_some());
        prop_assert_eq!(c.outcome, Some(Outcome::Succeeded), "{:?} {:#?}", c.stop, c.notes);
        prop_assert_eq!(c.leader, 1);
        c.assert_consistent();
        prop_assert_eq!(c.ctl.machine.retired(), &BTreeSet::from([0, 2]));
        prop_assert!(c.faults().iter().all(|f| f.recovery_s.is_some()), "{:#?}", c.faults());
    }

    /// `agentctl dump` on the controller's host: the last words are
    /// written from the snapshots, every host is shown the job going on,
    /// and training goes on to the end unchanged.
    #[test]
    fn a_dump_is_written_and_training_goes_on(
        delays in delays(),
        first in 5u64..40,
    ) {
        let mut c = Cluster::new(3, 2, 0, delays);
        c.run_until("the first steps", 2_000, |c| c.step() >= first);
        c.input(Input::Event(Event::DumpRequested));
        c.run_until("the dump", 2_000, |c| !c.dumps.is_empty());
        let written = c.dumps[0].as_ref().map(|w| w.iteration);
        prop_assert!(written.is_ok_and(|it| it >= first), "{:?}", c.dumps);
        c.run_until("the end", 20_000, |c| c.outcome.is_some());
        prop_assert_eq!(c.outcome, Some(Outcome::Succeeded), "{:?}", c.stop);
        c.assert_identical();
        prop_assert!(c.faults().is_empty());
        // Every host was shown the dump over and the job running.
        for n in 1..3 {
            let shown = c.hosts[n].mirror.as_ref().map(|m| m.recovering);
            prop_assert_eq!(shown, Some(false));
        }
    }

    /// A partition during a shared save: `agentctl dump` on a job of 3
    /// hosts of 2 ranks and a standby, and while the hosts write their
    /// shares host `cut` stops answering past the host timeout (and, in
    /// some runs, answers again once lost). Nothing on disk claims a
    /// checkpoint some rank is missing from: the dump is committed with
    /// every rank's directory, or fails naming the host, its `_tmp`
    /// directory gone. The host's ranks go to the standby, and the job
    /// ends as a run without faults.
    #[test]
    fn a_partition_during_a_shared_save_commits_nothing_that_is_not_whole(
        delays in delays(),
        first in 5u64..30,
        cut in 1u64..3,
        after in 0u32..(writes::SHARE_TICKS + 8),
        thaw in any::<bool>(),
    ) {
        let mut c = Cluster::new(3, 2, 1, delays);
        c.run_until("the first steps", 2_000, |c| c.step() >= first);
        c.input(Input::Event(Event::DumpRequested));
        c.run_until("the shares begin", 2_000, |c| c.disk.tmp.is_some());
        for _ in 0..after {
            c.tick();
        }
        c.freeze(cut, true);
        c.run_until("the dump's answer", 3_000, |c| !c.dumps.is_empty());
        match &c.dumps[0] {
            Ok(w) => {
                let holds = c.disk.committed.iter().find(|(s, _)| *s == w.iteration);
                prop_assert!(holds.is_some(), "{:?} {:?}", w, c.disk);
            }
            Err(why) => {
                prop_assert!(why.0.contains(&format!("host {cut}")), "{why}");
                prop_assert!(c.disk.committed.is_empty(), "{:?}", c.disk);
                prop_assert!(c.disk.tmp.is_none(), "{:?}", c.disk);
            }
        }
        if thaw {
            c.run_until("host cut off lost", 3_000, |c| !c.hosts_left().contains(&cut));
            c.freeze(cut, false);
        }
        c.run_until("the end", 20_000, |c| c.outcome.is_some());
        prop_assert_eq!(c.outcome, Some(Outcome::Succeeded), "{:?} {:#?}", c.stop, c.notes);
        c.assert_identical();
        for (step, ranks) in &c.disk.committed {
            prop_assert_eq!(ranks.len(), 6, "step {} committed with ranks {:?}", step, ranks);
        }
        prop_assert_eq!(c.host_of(2 * cut as usize), 3);
    }
}
