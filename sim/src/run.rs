//! Many seeds, on both cores: every policy (and setting) meets the same
//! trace per seed; results are kept by seed index, so the output does not
//! depend on how many threads ran or in which order they finished.

use crate::engine::simulate;
use crate::policy::{Cause, Outcome, Params, Policy, Setting, disk_interval, step_ratio};
use crate::trace::{Fault, draw};
use serde::Serialize;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// A median with its spread over seeds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    pub median: f64,
    /// The 10th and 90th percentiles.
    pub p10: f64,
    pub p90: f64,
    pub mean: f64,
    /// The standard error of the mean.
    pub stderr: f64,
}

impl Spread {
    /// Of a non-empty sample.
    pub fn of(mut v: Vec<f64>) -> Self {
        assert!(!v.is_empty(), "a spread of no values");
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let q = |p: f64| v[((n - 1) as f64 * p).round() as usize];
        let mean = v.iter().sum::<f64>() / n as f64;
        let var = if n > 1 {
            v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64
        } else {
            0.0
        };
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Self {
            median,
            p10: q(0.1),
            p90: q(0.9),
            mean,
            stderr: (var / n as f64).sqrt(),
        }
    }
}

/// One policy and setting over many seeds.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub policy: Policy,
    pub setting: Setting,
    /// The disk interval it ran with, seconds (∞ as null: no saves).
    pub disk_interval_s: Option<f64>,
    /// Step time with its per-step work ÷ without.
    pub step_ratio: f64,
    pub goodput: Spread,
    /// Mean share of the span lost, by cause.
    pub lost: Vec<(Cause, f64)>,
    pub stops: Spread,
    /// Mean faults per run.
    pub faults: f64,
}

/// The seed of run `i` of a study seeded `seed`.
pub fn run_seed(seed: u64, i: u64) -> u64 {
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(i)
}

/// Runs every `(policy, setting)` over `runs` seeds on `threads` threads.
pub fn study(
    params: &Params,
    cases: &[(Policy, Setting)],
    seed: u64,
    runs: u64,
    threads: usize,
) -> Vec<Summary> {
    let outcomes = outcomes(params, cases, seed, runs, threads);
    let span = params.shape.span_s;
    cases
        .iter()
        .enumerate()
        .map(|(c, (policy, setting))| {
            let of = |f: &dyn Fn(&Outcome) -> f64| {
                Spread::of(outcomes.iter().map(|o| f(&o[c])).collect())
            };
            // Means need no sorting.
            let mean = |f: &dyn Fn(&Outcome) -> f64| {
                outcomes.iter().map(|o| f(&o[c])).sum::<f64>() / outcomes.len() as f64
            };
            let interval = disk_interval(*policy, setting, params);
            Summary {
                policy: *policy,
                setting: *setting,
                disk_interval_s: interval.is_finite().then_some(interval),
                step_ratio: step_ratio(*policy, setting, params, interval),
                goodput: of(&|o| o.goodput),
                lost: Cause::ALL
                    .iter()
                    .map(|cause| (*cause, mean(&|o| o.lost[*cause as usize] / span)))
                    .collect(),
                stops: of(&|o| f64::from(o.stops)),
                faults: mean(&|o| f64::from(o.faults.iter().sum::<u32>())),
            }
        })
        .collect()
}

/// Every outcome, `[run][case]`.
pub fn outcomes(
    params: &Params,
    cases: &[(Policy, Setting)],
    seed: u64,
    runs: u64,
    threads: usize,
) -> Vec<Vec<Outcome>> {
    let next = AtomicU64::new(0);
    let slots: Mutex<Vec<Option<Vec<Outcome>>>> = Mutex::new(vec![None; runs as usize]);
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                let mut trace: Vec<Fault> = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= runs {
                        return;
                    }
                    draw(&params.shape, &params.rates, run_seed(seed, i), &mut trace);
                    let row: Vec<Outcome> = cases
                        .iter()
                        .map(|(p, st)| simulate(*p, st, params, &trace))
                        .collect();
                    slots.lock().expect("no thread panics holding it")[i as usize] = Some(row);
                }
            });
        }
    });
    slots
        .into_inner()
        .expect("no thread panicked holding it")
        .into_iter()
        .map(|r| r.expect("every run filled"))
        .collect()
}

/// Threads to use: every core this process may run on.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
