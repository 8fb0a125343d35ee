//! Trainer step time and tokens/s, end to end: `hatrain-agent launch` runs
//! the real trainer processes, and the numbers come from their JSON logs.
//!
//! Cases: model sizes `10m` and `100m` × 1, 2 and 4 ranks on this host.
//! Each case runs `STEPS` steps; the first 2 are warm-up and excluded; the
//! table gives the median step time and tokens/s of the rest.
//! `HATRAIN_BENCH_SIZES` (e.g. `10m`) and `HATRAIN_BENCH_RANKS` (e.g. `1,4`)
//! narrow the matrix.

mod common;
use common::launch::Launch;
use common::{median, train_args};

const STEPS: u64 = 7;

fn main() {
    let sizes = std::env::var("HATRAIN_BENCH_SIZES").unwrap_or_else(|_| "10m,100m".into());
    let ranks = std::env::var("HATRAIN_BENCH_RANKS").unwrap_or_else(|_| "1,2,4".into());
    let dir = tempfile::tempdir().expect("tempdir");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "trainer benchmark: global batch 16 × 32 tokens, {STEPS} steps (2 warm-up), {cores} cores"
    );
    println!(
        "{:<6} {:>5} {:>12} {:>12}",
        "model", "ranks", "ms/step", "tokens/s"
    );
    for size in sizes.split(',') {
        for nproc in ranks.split(',') {
            let nproc: usize = nproc.parse().expect("rank count");
            let log = dir.path().join(format!("{size}-{nproc}.jsonl"));
            let status = Launch::bare(nproc)
                .args(train_args(size, STEPS, &log, &[]))
                .env("RUST_LOG", "warn")
                .command()
                .status()
                .expect("run hatrain-agent");
            assert!(status.success(), "{size} × {nproc} failed: {status}");
            let text = std::fs::read_to_string(&log).expect("log");
            let steps: Vec<serde_json::Value> = text
                .lines()
                .map(|l| serde_json::from_str(l).expect("json"))
                .filter(|e: &serde_json::Value| {
                    e["event"] == "step" && e["step"].as_u64() > Some(2)
                })
                .collect();
            let dt = median(
                steps
                    .iter()
                    .map(|e| e["step_time_s"].as_f64().unwrap())
                    .collect(),
            );
            let tps = median(
                steps
                    .iter()
                    .map(|e| e["tokens_per_s"].as_f64().unwrap())
                    .collect(),
            );
            println!("{size:<6} {nproc:>5} {:>12.1} {tps:>12.0}", dt * 1e3);
        }
    }
}
