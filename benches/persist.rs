//! Step time with periodic checkpoints, end to end with real processes.
//!
//! The same run (`10m` model, 2 ranks, 40 steps, a snapshot every step, 3
//! slots so a held slot never costs a snapshot) in three configurations,
//! interleaved, `HATRAIN_BENCH_REPS` times (default 3):
//! - `none`: no `--save` at all (the baseline);
//! - `agent`: `--save --save-interval 10`, written by the agent from the
//!   held snapshots, off the training path (the default);
//! - `trainer`: the same with `--trainer-saves`: the trainer's collective
//!   save on the training path.
//!
//! The step time of a run is the wall time from the end of step 5 to the end
//! of step 40 over 35 steps, so the saves of iterations 10, 20 and 30 are
//! inside it (the final save of iteration 40 is after it in both save
//! configurations). Reported: each run's step time, the medians and the
//! ratios against `none`, and for the agent the checkpoints it wrote, their
//! write times and any steps it skipped. `HATRAIN_BENCH_SIZE` picks another
//! model size.

mod common;
use common::launch::Launch;
use common::{median, train_args};
use serde_json::Value;
use std::path::Path;
use std::process::Stdio;

const ITERS: u64 = 40;
const FROM: u64 = 5;
const SAVE_INTERVAL: u64 = 10;

fn step_times(log: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["event"] == "step")
        .map(|e| (e["step"].as_u64().unwrap(), e["unix_s"].as_f64().unwrap()))
        .collect()
}

/// One run; returns its mean step time and the agent's log.
fn run(size: &str, mode: &str, dir: &Path, rep: usize) -> (f64, String) {
    let log = dir.join(format!("{mode}-{rep}.jsonl"));
    let ckpt = dir.join(format!("{mode}-{rep}-ckpt"));
    let mut train = train_args(size, ITERS, &log, &[]);
    if mode != "none" {
        train.extend(["--save".into(), ckpt.display().to_string()]);
        train.extend(["--save-interval".into(), SAVE_INTERVAL.to_string()]);
    }
    let mut launch = Launch::bare(2)
        .option("--snapshot-slots", "3")
        .job(format!("bench-persist-{}", std::process::id()))
        .shm_root(dir.join("shm"));
    if mode == "trainer" {
        launch = launch.flags(["--trainer-saves"]);
    }
    let out = launch
        .args(&train)
        .env("RUST_LOG", "info")
        .command()
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .expect("run hatrain-agent");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{mode} run failed:\n{stderr}");
    let t: std::collections::BTreeMap<u64, f64> = step_times(&log).into_iter().collect();
    let mean = (t[&ITERS] - t[&FROM]) / (ITERS - FROM) as f64;
    let _ = std::fs::remove_dir_all(&ckpt);
    (mean, stderr)
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let at = line.find(&format!("{key}="))? + key.len() + 1;
    line[at..].split_whitespace().next()
}

fn main() {
    let size = std::env::var("HATRAIN_BENCH_SIZE").unwrap_or_else(|_| "10m".into());
    let reps: usize = std::env::var("HATRAIN_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let dir = tempfile::tempdir().expect("temp dir");
    let modes = ["none", "agent", "trainer"];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    // The agent's write times of the saves inside the measured steps.
    let mut write_s = Vec::new();
    println!(
        "model {size}, 2 ranks, {ITERS} steps, save every {SAVE_INTERVAL}, step time over steps {FROM}..{ITERS}"
    );
    for rep in 0..reps {
        for (i, mode) in modes.iter().enumerate() {
            let (mean, stderr) = run(&size, mode, dir.path(), rep);
            times[i].push(mean);
            let mut note = String::new();
            if *mode == "agent" {
                let writes: Vec<String> = stderr
                    .lines()
                    .filter(|l| l.contains("checkpoint written from the snapshots"))
                    .filter_map(|l| {
                        let step = field(l, "step")?;
                        let secs: f64 = field(l, "seconds")?.parse().ok()?;
                        if step.parse::<u64>().is_ok_and(|s| s > FROM && s < ITERS) {
                            write_s.push(secs);
                        }
                        Some(format!("{step}:{secs:.3}s"))
                    })
                    .collect();
                let skips = stderr
                    .lines()
                    .filter(|l| l.contains("skipping to the newest held step"))
                    .count();
                note = format!(" | agent wrote [{}], skip events {skips}", writes.join(" "));
            }
            println!("rep {rep} {mode:>7}: {:8.1} ms/step{note}", mean * 1e3);
        }
    }
    let med: Vec<f64> = times.iter().map(|t| median(t.clone())).collect();
    for (i, mode) in modes.iter().enumerate() {
        println!(
            "median {mode:>7}: {:8.1} ms/step, {:.3} × none",
            med[i] * 1e3,
            med[i] / med[0]
        );
    }

    // The simulator's costs: the agent's saves against none, and the
    // fraction of the time its writer is busy: one checkpoint's write time
    // (the median of the saves inside the measured steps, written while
    // training went on) over the time between two saves at the step time
    // without saves.
    common::costs::record(
        "persist_step_ratio",
        med[1] / med[0],
        &format!(
            "cargo bench -p hatrain-scenarios --bench persist: step time with saves written by the agent ÷ no saves (2 ranks, {size} model, save every {SAVE_INTERVAL} steps)"
        ),
    );
    if write_s.is_empty() {
        println!("no agent checkpoint write seen in the measured steps: persist_duty not recorded");
    } else {
        let n = write_s.len();
        let write = median(write_s);
        let between = SAVE_INTERVAL as f64 * med[0];
        println!(
            "agent writer duty: median write {write:.3} s (of {n}) ÷ {between:.3} s between saves = {:.3}",
            write / between
        );
        common::costs::record(
            "persist_duty",
            write / between,
            "cargo bench -p hatrain-scenarios --bench persist: agent's checkpoint write time ÷ time between saves (save interval × step time without saves)",
        );
    }
}
