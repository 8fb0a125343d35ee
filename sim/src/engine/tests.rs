//! Every event kind under every policy, on hand-made traces whose costs
//! can be added up by hand.

use super::*;
use crate::costs::{Measured, Published};
use crate::rates::Rates;
use crate::trace::Shape;

const DAY: f64 = 86_400.0;

/// 8 hosts of 8, one day, round costs.
fn params() -> Params {
    let mut measured = Measured::checked_in();
    measured.snapshot_step_ratio = 1.05;
    measured.replica_step_ratio = 1.05;
    measured.persist_step_ratio = 1.04;
    measured.persist_duty = 0.05;
    measured.uce_pause_s = 0.2;
    measured.crash_pause_s = 0.5;
    measured.host_standby_pause_s = 1.5;
    measured.shrink_pause_s = 1.0;
    measured.grow_pause_s = 3.0;
    measured.dump_time_ratio = 1.1;
    Params {
        shape: Shape {
            accelerators: 64,
            per_host: 8,
            span_s: DAY,
        },
        rates: Rates {
            domain_hosts: 4,
            slow_speed: 0.8,
            ..Rates::none()
        },
        published: Published {
            step_s: 10.0,
            ckpt_write_s: 100.0,
            disk_load_s: 50.0,
            init_s: 200.0,
            requeue_s: 300.0,
            detect_crash_s: 30.0,
            detect_timeout_s: 600.0,
            mem_load_s: 10.0,
            host_timeout_s: 3.0,
        },
        measured,
    }
}

fn setting(standby_hosts: u32, replicas: u32, interval: Option<f64>) -> Setting {
    Setting {
        standby_hosts,
        replicas,
        disk_interval_s: interval,
        min_hosts_frac: 0.5,
        snapshot_every: 1,
        on_slow_replace: true,
    }
}

fn fault(t: f64, kind: Kind, dur: f64, u: f64) -> Fault {
    Fault { t, kind, dur, u }
}

/// A run whose trace is the one fault `f`.
fn one(policy: Policy, s: &Setting, p: &Params, f: Fault) -> Outcome {
    simulate(policy, s, p, &[f])
}

fn lost(o: &Outcome, c: Cause) -> f64 {
    o.lost[c as usize]
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6 * (1.0 + b.abs())
}

/// Every second of the span is either kept or lost to one cause.
fn assert_accounted(o: &Outcome) {
    let total = o.goodput + o.lost.iter().sum::<f64>() / DAY;
    assert!((total - 1.0).abs() < 1e-9, "{total}: {o:?}");
    assert!(o.lost.iter().all(|l| *l > -1e-6), "{o:?}");
}

#[test]
fn with_no_faults_hatrain_loses_only_its_per_step_overhead() {
    let p = params();
    for policy in [Policy::Hatrain, Policy::Elastic] {
        let s = setting(2, 1, None);
        let o = simulate(policy, &s, &p, &[]);
        // One replica, no rollback to disk: no periodic saves at all.
        let ratio = 1.0 + 0.05 * 2.0;
        assert!(close(o.goodput, 1.0 / ratio), "{o:?}");
        assert!(close(lost(&o, Cause::Overhead), DAY * (1.0 - 1.0 / ratio)));
        assert_accounted(&o);
    }
}

#[test]
fn with_no_faults_disk_restart_loses_its_blocking_saves() {
    let p = params();
    let o = simulate(Policy::Disk, &setting(0, 0, Some(900.0)), &p, &[]);
    let expect = 900.0 / 1000.0;
    assert!((o.goodput - expect).abs() < 1000.0 / DAY, "{o:?}");
    assert!(close(lost(&o, Cause::Checkpoint), DAY - o.goodput * DAY));
    assert_accounted(&o);
}

#[test]
fn a_uce_costs_hatrain_its_repair_and_the_partial_step() {
    let p = params();
    let s = setting(2, 1, None);
    let clean = simulate(Policy::Hatrain, &s, &p, &[]);
    let o = one(Policy::Hatrain, &s, &p, fault(1000.0, Kind::Uce, 0.0, 0.5));
    assert!(close(lost(&o, Cause::Restart), 0.2));
    assert!(close(lost(&o, Cause::Redone), 5.0));
    assert!(o.goodput < clean.goodput);
    assert_eq!(o.faults[Kind::Uce as usize], 1);
    assert_eq!(o.stops, 0);
    assert_accounted(&o);
}

#[test]
fn sparser_snapshots_cost_less_per_step_and_redo_more_per_fault() {
    let p = params();
    let every = |k| Setting {
        snapshot_every: k,
        ..setting(2, 1, None)
    };
    let f = [fault(1000.0, Kind::Crash, 0.0, 0.5)];
    let (one, ten) = (
        simulate(Policy::Hatrain, &every(1), &p, &f),
        simulate(Policy::Hatrain, &every(10), &p, &f),
    );
    assert!(close(lost(&one, Cause::Redone), 5.0));
    assert!(close(lost(&ten, Cause::Redone), 50.0));
    let ratio = 1.0 + 0.05 * 2.0 / 10.0;
    // Training runs the whole day but the reboot's 0.5 s.
    assert!(close(
        lost(&ten, Cause::Overhead),
        (DAY - 0.5) * (1.0 - 1.0 / ratio)
    ));
    assert_accounted(&ten);
}

#[test]
fn a_crash_reboots_one_worker_and_a_hang_waits_for_the_watchdog_first() {
    let p = params();
    let s = setting(2, 1, None);
    let o = one(
        Policy::Hatrain,
        &s,
        &p,
        fault(1000.0, Kind::Crash, 0.0, 0.3),
    );
    assert!(close(lost(&o, Cause::Restart), 0.5));
    assert!(close(lost(&o, Cause::Redone), 3.0));
    let o = one(Policy::Hatrain, &s, &p, fault(1000.0, Kind::Hang, 0.0, 0.3));
    // The agent's adaptive default: 10 steps of 10 s.
    assert!(close(lost(&o, Cause::Detection), 100.0));
    assert!(close(lost(&o, Cause::Restart), 0.5));
    assert_accounted(&o);
}

#[test]
fn a_lost_host_moves_to_a_standby_then_with_none_left_hatrain_stops_with_last_words() {
    let p = params();
    let s = setting(1, 1, None);
    let two = [
        fault(1000.0, Kind::Host, 20_000.0, 0.0),
        fault(2000.0, Kind::Host, 20_000.0, 0.0),
    ];
    let o = simulate(Policy::Hatrain, &s, &p, &two[..1]);
    assert!(close(lost(&o, Cause::Restart), 1.5));
    assert_eq!(o.stops, 0);
    let o = simulate(Policy::Hatrain, &s, &p, &two);
    assert_eq!(o.stops, 1);
    // Standby, then requeue and restart; the dump is the last words.
    assert!(close(lost(&o, Cause::Restart), 1.5 + 300.0 + 200.0));
    assert!(close(lost(&o, Cause::Checkpoint), 110.0));
    assert!(close(lost(&o, Cause::Load), 50.0));
    assert!(
        close(lost(&o, Cause::Redone), 0.0),
        "last words lose nothing"
    );
    assert_accounted(&o);
}

#[test]
fn elastic_shrinks_when_no_standby_is_left_and_grows_back_after_the_repair() {
    let p = params();
    let s = setting(0, 1, None);
    let o = one(
        Policy::Elastic,
        &s,
        &p,
        fault(1000.0, Kind::Host, 10_000.0, 0.0),
    );
    assert_eq!(o.stops, 0);
    assert!(close(lost(&o, Cause::Restart), 1.0));
    assert!(close(lost(&o, Cause::Resync), 3.0));
    // One host of 8 missing for the repair's 10,000 s (less the pause).
    let ratio = 1.0 + 0.05 * 2.0;
    let shrunk = (10_000.0 - 1.0) / ratio / 8.0;
    assert!(close(lost(&o, Cause::Shrunk), shrunk), "{o:?}");
    assert_accounted(&o);
}

#[test]
fn a_repaired_host_refills_the_standby_pool() {
    let p = params();
    let s = setting(1, 1, None);
    let o = simulate(
        Policy::Hatrain,
        &s,
        &p,
        &[
            fault(1000.0, Kind::Host, 500.0, 0.0),
            fault(5000.0, Kind::Host, 500.0, 0.0),
        ],
    );
    assert_eq!(
        o.stops, 0,
        "the first host came back before the second loss"
    );
    assert!(close(lost(&o, Cause::Restart), 3.0));
}

#[test]
fn a_domain_loss_takes_its_hosts_at_once() {
    let p = params();
    let f = [fault(1000.0, Kind::Domain, 10_000.0, 0.0)];
    let o = simulate(Policy::Hatrain, &setting(4, 1, None), &p, &f);
    assert_eq!(o.stops, 0);
    let o = simulate(Policy::Hatrain, &setting(2, 1, None), &p, &f);
    assert_eq!(o.stops, 1);
    let o = simulate(Policy::Elastic, &setting(2, 1, None), &p, &f);
    assert_eq!(o.stops, 0);
    // Two of 8 hosts missing while the domain is repaired.
    assert!(lost(&o, Cause::Shrunk) > 0.2 * 9_000.0 / 1.1);
    assert!(close(lost(&o, Cause::Resync), 6.0));
    assert_accounted(&o);
}

#[test]
fn without_replicas_a_lost_host_rolls_back_to_the_last_disk_save() {
    let p = params();
    let s = setting(2, 0, Some(3600.0));
    let o = one(
        Policy::Hatrain,
        &s,
        &p,
        fault(5000.0, Kind::Host, 20_000.0, 0.0),
    );
    assert_eq!(o.stops, 0, "a standby took the host");
    // The save at 3600 s of progress was durable long before 5000 s.
    let ratio = step_ratio(Policy::Hatrain, &s, &p, 3600.0);
    let progress = 5000.0 / ratio;
    assert!(close(lost(&o, Cause::Redone), progress - 3600.0), "{o:?}");
    assert!(close(lost(&o, Cause::Load), 50.0));
    assert_accounted(&o);
}

#[test]
fn disk_restart_pays_detection_restart_load_and_the_work_since_its_save() {
    let p = params();
    let s = setting(0, 0, Some(900.0));
    let o = one(Policy::Disk, &s, &p, fault(2500.0, Kind::Crash, 0.0, 0.0));
    // Saves at 900 (900–1000 s) and 1800 (1900–2000 s): 500 s lost.
    assert!(close(lost(&o, Cause::Redone), 500.0), "{o:?}");
    assert!(close(lost(&o, Cause::Detection), 30.0));
    assert!(close(lost(&o, Cause::Restart), 200.0));
    assert!(close(lost(&o, Cause::Load), 50.0));
    let o = one(Policy::Disk, &s, &p, fault(2500.0, Kind::Hang, 0.0, 0.0));
    assert!(close(lost(&o, Cause::Detection), 600.0));
    let o = one(Policy::Disk, &s, &p, fault(2500.0, Kind::Host, 1.0, 0.0));
    assert_eq!(o.stops, 1);
    assert!(close(lost(&o, Cause::Restart), 500.0));
    assert_accounted(&o);
}

#[test]
fn a_fault_during_a_save_loses_the_save() {
    let p = params();
    let s = setting(0, 0, Some(900.0));
    // In the write of the save at 1800 (1900–2000 s).
    let o = one(Policy::Disk, &s, &p, fault(1950.0, Kind::Crash, 0.0, 0.0));
    assert!(close(lost(&o, Cause::Redone), 900.0), "{o:?}");
    assert_accounted(&o);
}

#[test]
fn a_fault_during_a_full_restart_starts_it_again() {
    let p = params();
    let s = setting(0, 0, Some(900.0));
    let o = simulate(
        Policy::Disk,
        &s,
        &p,
        &[
            fault(2500.0, Kind::Crash, 0.0, 0.0),
            fault(2600.0, Kind::Crash, 0.0, 0.0),
        ],
    );
    // The first restart ran 70 of its 200 s before the second fault.
    assert!(close(lost(&o, Cause::Detection), 60.0), "{o:?}");
    assert!(close(lost(&o, Cause::Restart), 270.0), "{o:?}");
    assert!(close(lost(&o, Cause::Load), 50.0), "{o:?}");
    assert_accounted(&o);
}

#[test]
fn memory_restart_reloads_from_memory_and_falls_back_to_disk_for_a_lost_host() {
    let p = params();
    let s = setting(0, 0, Some(3600.0));
    let o = one(Policy::Memory, &s, &p, fault(5000.0, Kind::Crash, 0.0, 0.5));
    assert!(close(lost(&o, Cause::Redone), 5.0));
    assert!(close(lost(&o, Cause::Load), 10.0));
    assert!(close(lost(&o, Cause::Restart), 200.0));
    assert_eq!(o.stops, 0);
    let o = one(Policy::Memory, &s, &p, fault(5000.0, Kind::Host, 1.0, 0.5));
    assert_eq!(o.stops, 1);
    assert!(close(lost(&o, Cause::Load), 50.0));
    // The background save at 3600 s of progress was durable 100 s later.
    let ratio = step_ratio(Policy::Memory, &s, &p, 3600.0);
    assert!(
        close(lost(&o, Cause::Redone), 5000.0 / ratio - 3600.0),
        "{o:?}"
    );
    assert_accounted(&o);
}

#[test]
fn every_background_save_is_taken_and_the_last_durable_one_restored() {
    let p = params();
    let s = setting(0, 0, Some(1000.0));
    let ratio = step_ratio(Policy::Memory, &s, &p, 1000.0);
    // Saves at 1000, 2000, 3000 of progress; the host goes at 3500.
    let t = 3500.0 * ratio;
    let o = one(Policy::Memory, &s, &p, fault(t, Kind::Host, 1.0, 0.0));
    assert!(close(lost(&o, Cause::Redone), 500.0), "{o:?}");
    assert_accounted(&o);
}

#[test]
fn a_fault_during_a_requeue_does_not_shorten_it() {
    let p = params();
    let s = setting(0, 0, Some(900.0));
    // Host lost at 2500: detection 600, requeue 300 (3100 to 3400),
    // restart 200, load 50. A crash at 3200 restarts again after the 200 s
    // of requeue still owed.
    let o = simulate(
        Policy::Disk,
        &s,
        &p,
        &[
            fault(2500.0, Kind::Host, 1.0, 0.0),
            fault(3200.0, Kind::Crash, 0.0, 0.0),
        ],
    );
    assert!(close(lost(&o, Cause::Restart), 300.0 + 200.0), "{o:?}");
    assert!(close(lost(&o, Cause::Detection), 600.0 + 30.0), "{o:?}");
    assert!(close(lost(&o, Cause::Load), 50.0), "{o:?}");
    assert_eq!(o.stops, 1);
    assert_accounted(&o);
}

#[test]
fn hatrain_faults_during_its_requeue_cost_nothing_more() {
    let p = params();
    let s = setting(0, 1, None);
    let lone = [fault(1000.0, Kind::Host, 50_000.0, 0.0)];
    let base = simulate(Policy::Hatrain, &s, &p, &lone);
    assert_eq!(base.stops, 1);
    let mut more = lone.to_vec();
    // Within its detection, dump, requeue, restart and load (to 1663 s).
    more.push(fault(1200.0, Kind::Hang, 0.0, 0.5));
    more.push(fault(1300.0, Kind::Host, 50_000.0, 0.0));
    let o = simulate(Policy::Hatrain, &s, &p, &more);
    assert_eq!(o.stops, 1, "{o:?}");
    assert_eq!(o.lost, base.lost);
}

#[test]
fn a_uce_right_after_a_restore_redoes_only_what_was_done_since() {
    let p = params();
    let s = Setting {
        snapshot_every: 30,
        ..setting(2, 1, None)
    };
    // 1 s into the run a UCE with u = 0.9 would be 270 s of a 30-step
    // window, but only 1 s of work was done.
    let o = one(Policy::Hatrain, &s, &p, fault(1.0, Kind::Uce, 0.0, 0.9));
    let ratio = step_ratio(Policy::Hatrain, &s, &p, f64::INFINITY);
    assert!(close(lost(&o, Cause::Redone), 1.0 / ratio), "{o:?}");
    assert_accounted(&o);
}

#[test]
fn losing_the_only_failure_domain_leaves_no_replica() {
    let mut p = params();
    // 2 hosts in one failure domain of 4: no replica outside it.
    p.shape.accelerators = 16;
    let s = setting(2, 1, Some(3600.0));
    let o = one(
        Policy::Hatrain,
        &s,
        &p,
        fault(5000.0, Kind::Domain, 50_000.0, 0.0),
    );
    assert!(
        close(lost(&o, Cause::Load), 50.0),
        "restored from disk: {o:?}"
    );
    let ratio = step_ratio(Policy::Hatrain, &s, &p, 3600.0);
    assert!(
        close(lost(&o, Cause::Redone), 5000.0 / ratio - 3600.0),
        "{o:?}"
    );
    assert_accounted(&o);
}

#[test]
fn a_slowdown_left_alone_slows_every_policy_for_its_length() {
    let p = params();
    for policy in Policy::ALL {
        let s = Setting {
            on_slow_replace: false,
            ..setting(0, 1, Some(50_000.0))
        };
        let o = one(policy, &s, &p, fault(1000.0, Kind::Slow, 3600.0, 0.0));
        let ratio = step_ratio(policy, &s, &p, disk_interval(policy, &s, &p));
        assert!(
            close(lost(&o, Cause::Slowdown), 3600.0 * 0.2 / ratio),
            "{policy:?}: {o:?}"
        );
        assert_accounted(&o);
    }
}

/// hatrain's detector names the slowdown after 20 slow steps (250 s at
/// 0.8 of 10 s steps); the hand-over's price is paid back by 7.5 s of it
/// (1.5 s ÷ 0.2): it acts at 250 s, onto a standby host, and the slow host
/// is back when the slowdown is over. Elastic with no standby shrinks
/// without it, and grows back then. A slowdown over before it is detected,
/// or hatrain with nothing to hand over to, is left alone.
#[test]
fn a_slowdown_is_handed_over_once_detected_and_paid_for() {
    let mut p = params();
    p.measured.slow_detect_steps = Some(20.0);
    let slow = |dur| fault(1000.0, Kind::Slow, dur, 0.0);
    let ratio = |policy, s: &Setting| step_ratio(policy, s, &p, disk_interval(policy, s, &p));
    let s = setting(2, 1, Some(50_000.0));
    let o = one(Policy::Hatrain, &s, &p, slow(3600.0));
    assert!(
        close(
            lost(&o, Cause::Slowdown),
            250.0 * 0.2 / ratio(Policy::Hatrain, &s)
        ),
        "{o:?}"
    );
    assert!(close(lost(&o, Cause::Restart), 1.5), "{o:?}");
    assert_accounted(&o);
    let none = setting(0, 1, Some(50_000.0));
    let o = one(Policy::Elastic, &none, &p, slow(3600.0));
    assert!(
        close(
            lost(&o, Cause::Slowdown),
            250.0 * 0.2 / ratio(Policy::Elastic, &none)
        ),
        "{o:?}"
    );
    assert!(close(lost(&o, Cause::Restart), 1.0), "{o:?}");
    assert!(close(lost(&o, Cause::Resync), 3.0), "grown back: {o:?}");
    assert!(lost(&o, Cause::Shrunk) > 0.0, "{o:?}");
    assert_accounted(&o);
    for (policy, s, dur) in [(Policy::Hatrain, none, 3600.0), (Policy::Hatrain, s, 200.0)] {
        let o = one(policy, &s, &p, slow(dur));
        assert!(
            close(lost(&o, Cause::Slowdown), dur * 0.2 / ratio(policy, &s)),
            "{o:?}"
        );
        assert_eq!(lost(&o, Cause::Restart), 0.0, "{o:?}");
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// Whatever the trace, every second is accounted for once and goodput
    /// stays in [0, 1].
    #[test]
    fn any_trace_is_accounted_for(
        raw in proptest::collection::vec((0.0..DAY, 0usize..6, 0.0..50_000.0f64, 0.0..1.0f64), 0..60),
        standby in 0u32..4,
        replicas in 0u32..3,
        interval in proptest::option::of(200.0..20_000.0f64),
        snapshot_every in 1u32..40,
        min_hosts_frac in 0.1f64..1.0,
        accelerators in 1u32..80,
    ) {
        let mut trace: Vec<Fault> = raw
            .into_iter()
            .map(|(t, k, dur, u)| fault(t, Kind::ALL[k], dur, u))
            .collect();
        trace.sort_by(|a, b| a.t.total_cmp(&b.t));
        let mut p = params();
        p.shape.accelerators = accelerators;
        let s = Setting {
            snapshot_every,
            min_hosts_frac,
            ..setting(standby, replicas, interval)
        };
        for policy in Policy::ALL {
            let o = simulate(policy, &s, &p, &trace);
            proptest::prop_assert!((0.0..=1.0).contains(&o.goodput), "{:?}", o);
            // Nothing is redone that was never trained.
            let paused: f64 = [Cause::Detection, Cause::Restart, Cause::Load, Cause::Resync, Cause::Checkpoint]
                .iter()
                .map(|c| lost(&o, *c))
                .sum();
            proptest::prop_assert!(lost(&o, Cause::Redone) <= DAY - paused + 1e-6, "{:?}", o);
            assert_accounted(&o);
        }
    }
}
