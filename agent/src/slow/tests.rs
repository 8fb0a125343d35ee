//! The detector's windows, comparisons and findings.

use super::*;

/// Cumulative times of `steps` steps of (data, compute, collective,
/// update) ms each, the step their sum plus `other` ms.
fn add(t: &mut StepTimes, steps: u64, [d, c, k, u]: [f64; 4], other: f64) {
    let ns = |ms: f64| (ms * 1e6) as u64 * steps;
    t.steps += steps;
    for (i, ms) in [d, c, k, u, d + c + k + u + other].into_iter().enumerate() {
        t.ns[i] += ns(ms);
    }
}

/// Runs `windows` windows of 4 ranks; `phase(rank, window)` gives each
/// rank's phases in that window. Returns the changes.
fn run(
    d: &mut Detector,
    at: &mut [StepTimes; 4],
    step: &mut u64,
    windows: usize,
    phase: impl Fn(usize, usize) -> [f64; 4],
) -> Vec<Change> {
    let mut changes = Vec::new();
    for w in 0..windows {
        *step += WINDOW;
        for (r, t) in at.iter_mut().enumerate() {
            add(t, WINDOW, phase(r, w), 1.0);
        }
        let readings: Vec<_> = at.iter().enumerate().map(|(r, t)| (r, *step, *t)).collect();
        changes.extend(d.observe(&readings));
    }
    changes
}

const HEALTHY: [f64; 4] = [1.0, 80.0, 5.0, 10.0];

/// Rank 2's compute 30 ms longer; the others wait that long.
fn rank_2_slow(r: usize, _: usize) -> [f64; 4] {
    if r == 2 {
        [1.0, 110.0, 5.0, 10.0]
    } else {
        [1.0, 80.0, 35.0, 10.0]
    }
}

#[test]
fn a_rank_whose_compute_grew_while_the_others_waited_is_named_then_ended() {
    let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
    assert!(run(&mut d, &mut at, &mut step, 4, |_, _| HEALTHY).is_empty());
    // Rank 2's compute grows by 30 ms; the others wait that long.
    let slowed = rank_2_slow;
    let changes = run(&mut d, &mut at, &mut step, CONFIRM as usize, slowed);
    let [Change::Began(f)] = &changes[..] else {
        panic!("one finding: {changes:?}");
    };
    assert_eq!((f.rank, f.phase.as_str()), (2, "compute"));
    assert!((f.excess_ms - 30.0).abs() < 0.5, "{f:?}");
    assert!((f.over_own_history_ms - 30.0).abs() < 0.5, "{f:?}");
    assert!(f.cause.starts_with("one rank alone"), "{f:?}");
    // Still slow: nothing new; then healthy again: it ends.
    assert!(run(&mut d, &mut at, &mut step, 5, slowed).is_empty());
    let changes = run(&mut d, &mut at, &mut step, CONFIRM as usize, |_, _| HEALTHY);
    assert!(
        matches!(&changes[..], [Change::Ended(f)] if f.rank == 2 && f.ended),
        "{changes:?}"
    );
    assert_eq!(d.findings().len(), 1);
}

#[test]
fn short_steps_close_a_window_only_once_it_spans_half_a_second() {
    // Steps of 10 ms: a rank that lost 2 ms a step for 30 steps (a
    // scheduler's burst) is judged over 50 steps at least, and a burst
    // that short is no finding; one lasting is.
    let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
    let short = [0.1, 7.0, 1.0, 0.9];
    let burst = |r: usize| {
        if r == 0 {
            [0.1, 9.0, 0.0, 0.9]
        } else {
            [0.1, 7.0, 3.0, 0.9]
        }
    };
    // 10 steps per reading, as the agent reads every 100 ms.
    let mut read = |d: &mut Detector, at: &mut [StepTimes; 4], slow: bool| {
        step += 10;
        for (r, t) in at.iter_mut().enumerate() {
            add(t, 10, if slow { burst(r) } else { short }, 0.0);
        }
        let readings: Vec<_> = at.iter().enumerate().map(|(r, t)| (r, step, *t)).collect();
        d.observe(&readings)
    };
    let mut changes = Vec::new();
    for k in 0..60 {
        // Slow in 3 readings of 10 steps out of each 10.
        changes.extend(read(&mut d, &mut at, k % 10 < 3));
    }
    assert!(changes.is_empty(), "{changes:?}");
    for _ in 0..30 {
        changes.extend(read(&mut d, &mut at, true));
    }
    let [Change::Began(f)] = &changes[..] else {
        panic!("one finding: {changes:?}");
    };
    assert_eq!((f.rank, f.phase.as_str()), (0, "compute"));
    assert!(f.last_step - f.since_step + 1 >= 3 * 50, "{f:?}");
}

#[test]
fn slow_data_is_named_as_data() {
    let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
    let slowed = |r: usize, _| {
        if r == 1 {
            [40.0, 80.0, 5.0, 10.0]
        } else {
            [1.0, 80.0, 44.0, 10.0]
        }
    };
    assert!(run(&mut d, &mut at, &mut step, 4, |_, _| HEALTHY).is_empty());
    let changes = run(&mut d, &mut at, &mut step, CONFIRM as usize, slowed);
    let [Change::Began(f)] = &changes[..] else {
        panic!("one finding: {changes:?}");
    };
    assert_eq!((f.rank, f.phase.as_str()), (1, "data"));
    assert_eq!((f.since_step, f.last_step), (41, 70), "{f:?}");
    assert!(f.cause.contains("data loading"), "{f:?}");
}

#[test]
fn no_finding_when_every_rank_slows_or_the_excess_is_small_or_brief() {
    let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
    // Every rank twice as slow: nobody stands out.
    assert!(
        run(&mut d, &mut at, &mut step, 8, |_, _| [
            2.0, 160.0, 5.0, 20.0
        ])
        .is_empty()
    );
    // One rank 5% slower (under the minimum effect), persistently.
    let small = |r: usize, _| {
        if r == 3 {
            [1.0, 85.0, 5.0, 10.0]
        } else {
            [1.0, 80.0, 10.0, 10.0]
        }
    };
    assert!(run(&mut d, &mut at, &mut step, 8, small).is_empty());
    // One rank much slower in single windows, never CONFIRM in a row.
    let brief = |r: usize, w: usize| {
        if r == 0 && w.is_multiple_of(2) {
            [1.0, 140.0, 5.0, 10.0]
        } else if w.is_multiple_of(2) {
            [1.0, 80.0, 65.0, 10.0]
        } else {
            HEALTHY
        }
    };
    assert!(run(&mut d, &mut at, &mut step, 12, brief).is_empty());
    // One rank with more work whom nobody waits for (as much collective
    // as the others): not slow.
    let unwaited = |r: usize, _| {
        if r == 0 {
            [1.0, 100.0, 5.0, 10.0]
        } else {
            HEALTHY
        }
    };
    assert!(run(&mut d, &mut at, &mut step, 8, unwaited).is_empty());
    assert!(d.findings().is_empty());
}

#[test]
fn a_difference_there_from_the_start_is_no_change() {
    // Rank 3 always took 15 ms more, and the others waited: it did not
    // grow against its own history.
    let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
    let always = |r: usize, _| {
        if r == 3 {
            [1.0, 95.0, 5.0, 10.0]
        } else {
            [1.0, 80.0, 20.0, 10.0]
        }
    };
    assert!(run(&mut d, &mut at, &mut step, 12, always).is_empty());
    // Nor is a rank judged before its history: slow from the first
    // window, it is never seen healthy.
    let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
    let slowed = rank_2_slow;
    assert!(run(&mut d, &mut at, &mut step, 8, slowed).is_empty());
}

/// A slow rank's process replaced (its host handed over): absent from
/// the readings a while, its finding stays open; read again and not
/// slow, the finding ends.
#[test]
fn a_slow_rank_read_again_after_a_while_away_ends_its_finding() {
    let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
    assert!(run(&mut d, &mut at, &mut step, 4, |_, _| HEALTHY).is_empty());
    let slowed = rank_2_slow;
    let began = run(&mut d, &mut at, &mut step, CONFIRM as usize, slowed);
    assert!(
        matches!(&began[..], [Change::Began(f)] if f.rank == 2),
        "{began:?}"
    );
    // Rank 2 unread for two windows (its new process not registered).
    for _ in 0..2 {
        step += WINDOW;
        for t in &mut at {
            add(t, WINDOW, HEALTHY, 1.0);
        }
        let without: Vec<_> = (at.iter().enumerate())
            .filter(|(r, _)| *r != 2)
            .map(|(r, t)| (r, step, *t))
            .collect();
        assert!(d.observe(&without).is_empty());
    }
    assert!(!d.findings()[0].ended);
    // Read again from a fresh process (its sums start over).
    at[2] = StepTimes::default();
    let ended = run(&mut d, &mut at, &mut step, CONFIRM as usize + 1, |_, _| {
        HEALTHY
    });
    assert!(
        matches!(&ended[..], [Change::Ended(f)] if f.rank == 2 && f.ended),
        "{ended:?}"
    );
}

#[test]
fn several_ranks_at_once_are_named_as_imbalance() {
    let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
    let band = |r: usize, _| {
        if r < 2 {
            [1.0, 110.0, 5.0, 10.0]
        } else {
            [1.0, 80.0, 35.0, 10.0]
        }
    };
    assert!(run(&mut d, &mut at, &mut step, 4, |_, _| HEALTHY).is_empty());
    let changes = run(&mut d, &mut at, &mut step, CONFIRM as usize, band);
    assert_eq!(changes.len(), 2, "{changes:?}");
    for c in &changes {
        let Change::Began(f) = c else { panic!("{c:?}") };
        assert!(f.cause.contains("imbalance"), "{f:?}");
    }
}

#[test]
fn a_restarted_rank_starts_its_windows_again() {
    let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
    run(&mut d, &mut at, &mut step, 2, |_, _| HEALTHY);
    // Rank 1's page sums restart lower: no window of negative time.
    at[1] = StepTimes::default();
    d.forget(1);
    assert!(run(&mut d, &mut at, &mut step, 6, |_, _| HEALTHY).is_empty());
}

#[test]
fn a_hand_over_pays_once_the_slowdown_cost_its_price_and_only_for_one_rank_slow_in_its_own_work() {
    let f = SlowFinding {
        rank: 1,
        phase: "compute".into(),
        excess_ms: 20.0,
        step_ms: 100.0,
        over_own_history_ms: 20.0,
        since_step: 100,
        last_step: 149,
        cause: String::new(),
        alone: true,
        host: None,
        whole_host: false,
        ended: false,
    };
    assert_eq!(f.cost_ms(), 1000.0, "50 steps of 20 ms");
    assert!(replace_pays(&f, 1000.0));
    assert!(!hand_host_over_pays(&f, 0.0), "one rank: not its host");
    assert!(!replace_pays(&f, 1000.1), "not yet");
    let data = SlowFinding {
        phase: "data".into(),
        ..f.clone()
    };
    assert!(
        !replace_pays(&data, 1.0),
        "its data loading: not cured by a new process"
    );
    let several = SlowFinding {
        alone: false,
        ..f.clone()
    };
    assert!(!replace_pays(&several, 1.0), "an imbalance across ranks");
    let ended = SlowFinding { ended: true, ..f };
    assert!(!replace_pays(&ended, 1.0));
}

#[test]
fn a_rank_whose_garbage_collector_took_the_excess_is_named_with_gc_and_not_handed_over() {
    let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
    assert!(run(&mut d, &mut at, &mut step, 4, |_, _| HEALTHY).is_empty());
    // Rank 3's compute grows by 30 ms, 25 of them in its collector.
    let mut changes = Vec::new();
    for _ in 0..CONFIRM {
        step += WINDOW;
        for (r, t) in at.iter_mut().enumerate() {
            if r == 3 {
                add(t, WINDOW, [1.0, 110.0, 5.0, 10.0], 1.0);
                t.gc_ns += 25_000_000 * WINDOW;
            } else {
                add(t, WINDOW, [1.0, 80.0, 35.0, 10.0], 1.0);
            }
        }
        let readings: Vec<_> = at.iter().enumerate().map(|(r, t)| (r, step, *t)).collect();
        changes.extend(d.observe(&readings));
    }
    let [Change::Began(f)] = &changes[..] else {
        panic!("one finding: {changes:?}");
    };
    assert_eq!((f.rank, f.phase.as_str()), (3, "gc"), "{f:?}");
    assert!(f.cause.starts_with("garbage collection"), "{f:?}");
    assert!(
        !replace_pays(f, 0.0),
        "a fresh process keeps the same collector"
    );
}

/// With the hosts known (a controller's detector): both ranks of host
/// 1 slow, and no other, is that host; one of them alone is not.
#[test]
fn every_rank_of_one_host_slow_together_is_that_host() {
    let hosts = BTreeMap::from([(0, 0), (1, 0), (2, 1), (3, 1)]);
    let (mut d, mut at, mut step) = (Detector::default(), [StepTimes::default(); 4], 0);
    d.set_hosts(hosts);
    assert!(run(&mut d, &mut at, &mut step, 4, |_, _| HEALTHY).is_empty());
    let host1 = |r: usize, _| {
        if r >= 2 {
            [1.0, 110.0, 5.0, 10.0]
        } else {
            [1.0, 80.0, 35.0, 10.0]
        }
    };
    let changes = run(&mut d, &mut at, &mut step, CONFIRM as usize, host1);
    assert_eq!(changes.len(), 2, "{changes:?}");
    for c in &changes {
        let Change::Began(f) = c else {
            panic!("{changes:?}")
        };
        assert_eq!(f.host, Some(1), "{f:?}");
        assert!(f.cause.contains("every rank of host 1"), "{f:?}");
        assert!(!f.alone && !replace_pays(f, 0.0), "{f:?}");
        assert!(f.whole_host && hand_host_over_pays(f, 0.0), "{f:?}");
        let data = SlowFinding {
            phase: "data".into(),
            ..f.clone()
        };
        assert!(!hand_host_over_pays(&data, 0.0), "{f:?}");
    }
}

#[test]
fn the_median_without_one_value_is_the_median_of_the_others() {
    let xs = [5.0, 1.0, 9.0, 3.0, 3.0, 7.0, 2.0];
    let s = Sorted::new(xs.to_vec());
    for (i, &v) in xs.iter().enumerate() {
        let rest: Vec<f64> = xs
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, x)| *x)
            .collect();
        assert_eq!(s.median_without(v), median(rest), "without {v}");
    }
    assert_eq!(Sorted::new(vec![4.0]).median_without(4.0), 0.0);
}
