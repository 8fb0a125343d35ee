//! Simulator throughput: 100,000 accelerators for 365 days, 1,000 seeds,
//! the four policies on every seed's trace, on every core.
//!
//! Cases: the wall time of the whole study (median of 3), and the same
//! study on one thread in the same run as the baseline, so the ratio shows
//! what the second core brings.

use hatrain_sim::cli::cases;
use hatrain_sim::run::{default_threads, study};
use hatrain_sim::{Measured, Params, Published, Rates, Setting, Shape};
use std::time::Instant;

fn main() {
    let params = Params {
        shape: Shape {
            accelerators: 100_000,
            per_host: 8,
            span_s: 365.0 * 86_400.0,
        },
        rates: Rates::llama3(),
        published: Published::default(),
        measured: Measured::checked_in(),
    };
    let runs: u64 = std::env::var("HATRAIN_SIM_BENCH_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let cases = cases(Setting::default());
    let threads = default_threads();
    let time = |threads: usize| {
        let t = Instant::now();
        let s = study(&params, &cases, 1, runs, threads);
        let secs = t.elapsed().as_secs_f64();
        (secs, s[0].faults)
    };
    let mut all = Vec::new();
    let mut one = Vec::new();
    let mut faults = 0.0;
    for _ in 0..3 {
        let (a, f) = time(threads);
        let (b, _) = time(1);
        all.push(a);
        one.push(b);
        faults = f;
    }
    let med = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (a, b) = (med(all.clone()), med(one.clone()));
    println!(
        "100,000 accelerators, 365 days, {runs} seeds, 4 policies ({faults:.0} faults per run on average)"
    );
    println!("{threads} threads: {all:.3?} s; 1 thread: {one:.3?} s");
    println!(
        "median: {a:.3} s on {threads} threads, {b:.3} s on 1 ({:.2}× the one-thread time)",
        a / b
    );
}
