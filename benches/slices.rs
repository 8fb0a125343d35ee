//! Bytes per rank per snapshot, sliced against full, as the agent measures
//! them: for each model size and world size, one real `hatrain-agent
//! launch` of the reference trainer with `--snapshot-slices on` and one
//! with `off`, for two steps; the figure is the length of the sealed
//! snapshot of every rank, as `agentctl workers` reports it (the `bytes`
//! of its last snapshot), read while the job runs.
//!
//! Cases: `10m` and `100m` (`HATRAIN_BENCH_SIZES` narrows it), 2 and 4
//! ranks. The ratio the state map predicts is printed beside the measured
//! one: (meta + params/N + 2 moments/N) ÷ (meta + params + 2 moments/N).

mod common;
use common::launch::Launch;
use common::train_args;
use hatrain_shared::control::Response;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Snapshot bytes of every rank of one launch.
fn measure(size: &str, world: usize, slices: &str) -> Vec<u64> {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let shm = dir.path().join("shm");
    let log = dir.path().join("log.jsonl");
    let job = format!("bench-slices-{}", std::process::id());
    // Rank 0 naps at step 2, so the job is still there to be asked.
    let mut child = Launch::bare(world)
        .job(&job)
        .option("--snapshot-slices", slices)
        .worker_reboot()
        .shm_root(&shm)
        .args(train_args(size, 3, &log, &[]))
        .fault_plan("0:3:forward:sleep30000")
        .env("RUST_LOG", "warn")
        .command()
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start hatrain-agent");
    let socket = shm.join(&job).join("agent.sock");
    let deadline = Instant::now() + Duration::from_secs(600);
    let bytes = loop {
        assert!(Instant::now() < deadline, "no snapshot of every rank");
        std::thread::sleep(Duration::from_millis(200));
        let Ok(Response::Workers(w)) = hatrain_shared::control::request(
            &socket,
            &hatrain_shared::control::Request::Workers,
            Duration::from_secs(5),
        ) else {
            continue;
        };
        let b: Vec<u64> = w
            .iter()
            .filter_map(|r| {
                r.last_snapshot
                    .as_ref()
                    .filter(|s| s.step >= 2)
                    .map(|s| s.bytes)
            })
            .collect();
        if b.len() == world {
            break b;
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    bytes
}

fn main() {
    let sizes = std::env::var("HATRAIN_BENCH_SIZES").unwrap_or_else(|_| "10m,100m".into());
    println!(
        "{:<6} {:>5} {:>16} {:>16} {:>10} {:>10}",
        "model", "ranks", "full B/rank", "sliced B/rank", "ratio", "expected"
    );
    for size in sizes.split(',') {
        for world in [2usize, 4] {
            let full = measure(size, world, "off");
            let sliced = measure(size, world, "on");
            let (f, s) = (
                full.iter().sum::<u64>() as f64 / world as f64,
                sliced.iter().sum::<u64>() as f64 / world as f64,
            );
            // From the model: params P replicated, moments 2P/N unique.
            let cfg = size
                .parse::<hatrain_trainer::config::ModelSize>()
                .expect("a model size")
                .config();
            let p = hatrain_trainer::model::Model::new(cfg).numel() as f64 * 4.0;
            let n = world as f64;
            let expected = (p / n + 2.0 * p / n) / (p + 2.0 * p / n);
            println!(
                "{size:<6} {world:>5} {f:>16.0} {s:>16.0} {:>10.4} {expected:>10.4}",
                s / f
            );
            println!("         per rank: full {full:?}, sliced {sliced:?}");
        }
    }
}
