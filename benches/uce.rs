//! UCE step-repair time at about 256 MiB of state per rank, end to end.
//!
//! 2 ranks train a model of about 36M parameters (parameters plus the two
//! AdamW moment shards: about 290 MB per rank) with step repair on. At step
//! 6, rank 1 receives an uncorrectable memory error in its parameters
//! (a SIGBUS with BUS_MCEERR_AR, see `worker/src/uce.rs`). The agent reports
//! the recovery time, from the UCE report to the first completed step
//! after it; the repair time is that minus the recomputed step (the median
//! step time of the run). Each of `RUNS` runs prints its numbers; the last
//! line gives the medians.

mod common;
use common::launch::Launch;
use common::median;

const RUNS: usize = 3;

fn main() {
    let dir = tempfile::Builder::new()
        .prefix("hatrain-bench-")
        .tempdir_in("/dev/shm")
        .expect("tempdir");
    println!("UCE repair, 2 ranks, d_model 1024, d_ff 4096, 4 layers");
    println!(
        "{:>4} {:>12} {:>12} {:>14} {:>12}",
        "run", "state MB", "redone step s", "recovery s", "repair s"
    );
    let (mut recov, mut repair) = (Vec::new(), Vec::new());
    for run in 0..RUNS {
        let log = dir.path().join(format!("uce-{run}.jsonl"));
        let out = Launch::bare(2)
            .high_availability()
            .flags(["--enable-hbmfault-repair"])
            .shm_root(dir.path())
            .args([
                "--model-size",
                "10m",
                "--d-model",
                "1024",
                "--d-ff",
                "4096",
                "--layers",
                "4",
            ])
            .args([
                "--global-batch",
                "4",
                "--seq-len",
                "16",
                "--train-iters",
                "9",
                "--log-interval",
                "1000",
            ])
            .arg("--log-jsonl")
            .arg(&log)
            .fault_plan("1:6:forward:uce-params-4096")
            .env("RUST_LOG", "info")
            .command()
            .output()
            .expect("run hatrain-agent");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        let line = stderr
            .lines()
            .find(|l| l.contains("recovered: first step after the fault completed"))
            .expect("a UCE recovery in the agent log");
        let field = |name: &str| -> f64 {
            line.split(&format!("{name}="))
                .nth(1)
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .expect("field in the recovery line")
        };
        let (recovery, s_star) = (field("recovery_s"), field("s_star") as u64);
        let bytes: f64 = stderr
            .lines()
            .find(|l| l.contains("snapshot store created rank=1"))
            .and_then(|l| l.split("bytes=").nth(1))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .expect("store size");
        // The recomputed step is the last logged step s*+1.
        let step = std::fs::read_to_string(&log)
            .expect("log")
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|e| e["event"] == "step" && e["step"].as_u64() == Some(s_star + 1))
            .filter_map(|e| e["step_time_s"].as_f64())
            .next_back()
            .expect("the recomputed step in the log");
        println!(
            "{run:>4} {:>12.0} {step:>12.3} {recovery:>14.3} {:>12.3}",
            bytes / 1e6,
            recovery - step
        );
        recov.push(recovery);
        repair.push(recovery - step);
    }
    let repair = median(repair);
    println!(
        "median: recovery {:.3} s, repair excluding the recomputed step {repair:.3} s",
        median(recov),
    );
    common::costs::record(
        "uce_pause_s",
        repair,
        "cargo bench -p hatrain-scenarios --bench uce: UCE repair, excluding the recomputed step",
    );
}
