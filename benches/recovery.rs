//! End-to-end benchmarks of worker reboot, with real trainer processes.
//!
//! 1. Snapshot overhead: median step time with a snapshot every step
//!    (sliced, the default, and full with `--snapshot-slices off`), divided
//!    by the median step time with snapshots off (`--snapshot-interval`
//!    larger than the run), for the `10m` and `100m` models on 2 ranks
//!    (`HATRAIN_BENCH_SIZES` narrows it). The three configurations run
//!    interleaved `HATRAIN_BENCH_REPS` times (default 3); each run's figure
//!    is its median step time over steps 3-9, and the table gives the
//!    median over runs.
//! 2. Recovery: one rank is killed with SIGKILL during step K; the time is
//!    from the kill until step K has been completed again.
//!    - hatrain: worker reboot (`--enable-worker-reboot`), the agent restarts
//!      the rank in place and every rank resumes from shared memory;
//!    - baseline, what users have today: the job stops, is launched again
//!      with `--load` of the newest disk checkpoint (saved every 10 steps),
//!      and redoes the lost steps.
//!
//!    K takes the values 13, 16 and 19 (3, 6 and 9 steps after a save, 6 on
//!    average = save-interval/2 + 1), on the `10m` model, 2 ranks.
//!    Reported per run: for hatrain the time to the first step completed
//!    after the kill (the first step after recovery) and to step K, with
//!    sliced snapshots and with full ones; for the baseline the time to
//!    step K; steps redone; the medians and ratios.

mod common;
use common::launch::Launch;
use common::{median, now, steps, train_args, wait_step, worker_pids};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Duration;

fn launch(nproc: usize, ha: bool, shm: &Path, slices: &str, train: &[String]) -> Child {
    let mut launch = Launch::bare(nproc)
        .stop_grace_secs(2)
        .option("--snapshot-slices", slices)
        .shm_root(shm);
    if ha {
        launch = launch.worker_reboot();
    }
    launch
        .args(train)
        .env("RUST_LOG", "warn")
        .command()
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start hatrain-agent")
}

fn kill_rank1(child: &Child) -> f64 {
    let pids = worker_pids(child.id());
    let pid = pids.iter().find(|(r, _)| *r == 1).expect("rank 1").1;
    let t = now();
    // SAFETY: kill(2) with plain integers.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    t
}

/// Median step time (steps 3-9) of one run of `size` on 2 ranks.
fn step_time(dir: &Path, size: &str, interval: &str, slices: &str) -> f64 {
    let log = dir.join(format!("overhead-{size}-{interval}-{slices}.jsonl"));
    let _ = std::fs::remove_file(&log);
    let mut c = launch(
        2,
        true,
        dir,
        slices,
        &train_args(size, 9, &log, &["--snapshot-interval", interval]),
    );
    assert!(c.wait().unwrap().success());
    let t: Vec<f64> = steps(&log)
        .iter()
        .filter(|e| e["step"].as_u64() > Some(2))
        .map(|e| e["step_time_s"].as_f64().unwrap())
        .collect();
    median(t)
}

/// Interleaved runs: (sliced, full, none) median step times, each the
/// median over `reps` runs, and every run's figures.
fn overhead(dir: &Path, size: &str, reps: usize) -> ([f64; 3], Vec<[f64; 3]>) {
    let mut runs = Vec::new();
    for _ in 0..reps {
        runs.push([
            step_time(dir, size, "1", "on"),
            step_time(dir, size, "1", "off"),
            step_time(dir, size, "1000000", "on"),
        ]);
    }
    let col = |i: usize| median(runs.iter().map(|r| r[i]).collect());
    ([col(0), col(1), col(2)], runs)
}

/// One worker-reboot recovery from a SIGKILL of rank 1 during step `k`:
/// seconds to the first step after the kill, to step `k` again, the steps
/// redone, and the median step time of steps 3.. completed before the kill.
fn ha_recovery(dir: &Path, k: u64, slices: &str) -> (f64, f64, usize, f64) {
    let log = dir.join(format!("ha-{k}-{slices}.jsonl"));
    let mut c = launch(2, true, dir, slices, &train_args("10m", k + 2, &log, &[]));
    wait_step(&log, Duration::from_secs(300), |e| {
        e["step"].as_u64() == Some(k - 1)
    })
    .expect("reach K-1");
    let t_kill = kill_rank1(&c);
    let back = wait_step(&log, Duration::from_secs(300), |e| {
        e["step"].as_u64() >= Some(k) && e["unix_s"].as_f64() > Some(t_kill)
    })
    .expect("step K again");
    assert!(c.wait().unwrap().success(), "worker reboot run failed");
    let redone = steps(&log)
        .iter()
        .filter(|e| e["unix_s"].as_f64() > Some(t_kill) && e["step"].as_u64() < Some(k))
        .count();
    let first_s = steps(&log)
        .iter()
        .filter_map(|e| e["unix_s"].as_f64())
        .find(|t| *t > t_kill)
        .expect("a step after the kill")
        - t_kill;
    let before: Vec<f64> = steps(&log)
        .iter()
        .filter(|e| e["unix_s"].as_f64() < Some(t_kill) && e["step"].as_u64() > Some(2))
        .filter_map(|e| e["step_time_s"].as_f64())
        .collect();
    (
        first_s,
        back["unix_s"].as_f64().unwrap() - t_kill,
        redone,
        median(before),
    )
}

fn main() {
    let dir = tempfile::Builder::new()
        .prefix("hatrain-bench-")
        .tempdir_in("/dev/shm")
        .expect("tempdir");
    let sizes = std::env::var("HATRAIN_BENCH_SIZES").unwrap_or_else(|_| "10m,100m".into());
    let reps = std::env::var("HATRAIN_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    println!(
        "snapshot overhead (2 ranks, global batch 16 x 32; per run the median of steps 3-9, then the median of {reps} interleaved runs)"
    );
    println!(
        "{:<6} {:>12} {:>12} {:>12} {:>13} {:>11}",
        "model", "sliced ms", "full ms", "none ms", "sliced÷none", "full÷none"
    );
    // The 10m model's (sliced, none) medians, for the simulator's costs.
    let mut ten_m = None;
    for size in sizes.split(',') {
        let ([sliced, full, none], runs) = overhead(dir.path(), size, reps);
        if size == "10m" {
            ten_m = Some((sliced, none));
        }
        println!(
            "{size:<6} {:>12.1} {:>12.1} {:>12.1} {:>13.3} {:>11.3}",
            sliced * 1e3,
            full * 1e3,
            none * 1e3,
            sliced / none,
            full / none
        );
        for r in runs {
            println!(
                "       run: sliced {:.1} ms, full {:.1} ms, none {:.1} ms",
                r[0] * 1e3,
                r[1] * 1e3,
                r[2] * 1e3
            );
        }
    }

    println!(
        "\nrecovery from SIGKILL of rank 1 during step K (10m model, 2 ranks, disk save every 10 steps)"
    );
    println!(
        "{:>3} {:>12} {:>12} {:>12} {:>8} {:>14} {:>8}",
        "K", "sliced 1st s", "full 1st s", "sliced K s", "redone", "baseline K s", "redone"
    );
    let (mut first, mut first_full, mut ours, mut base, mut before) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for k in [13u64, 16, 19] {
        // hatrain: worker reboot, sliced snapshots and full ones.
        let (first_s, ha_s, redone, step_s) = ha_recovery(dir.path(), k, "on");
        let (full_s, _, _, _) = ha_recovery(dir.path(), k, "off");

        // Baseline: stop, relaunch from the disk checkpoint, redo.
        let log = dir.path().join(format!("base-{k}.jsonl"));
        let ckpt = dir.path().join(format!("ckpt-{k}"));
        let ck = ckpt.display().to_string();
        let mut c = launch(
            2,
            false,
            dir.path(),
            "on",
            &train_args(
                "10m",
                k + 2,
                &log,
                &["--save", &ck, "--save-interval", "10"],
            ),
        );
        wait_step(&log, Duration::from_secs(300), |e| {
            e["step"].as_u64() == Some(k - 1)
        })
        .expect("reach K-1");
        let t_kill = kill_rank1(&c);
        assert!(!c.wait().unwrap().success());
        let mut c = launch(
            2,
            false,
            dir.path(),
            "on",
            &train_args(
                "10m",
                k + 2,
                &log,
                &["--load", &ck, "--save", &ck, "--save-interval", "10"],
            ),
        );
        let back = wait_step(&log, Duration::from_secs(300), |e| {
            e["step"].as_u64() >= Some(k) && e["unix_s"].as_f64() > Some(t_kill)
        })
        .expect("baseline step K");
        assert!(c.wait().unwrap().success(), "baseline relaunch failed");
        let base_redone = steps(&log)
            .iter()
            .filter(|e| e["unix_s"].as_f64() > Some(t_kill) && e["step"].as_u64() < Some(k))
            .count();
        let base_s = back["unix_s"].as_f64().unwrap() - t_kill;
        println!(
            "{k:>3} {first_s:>12.3} {full_s:>12.3} {ha_s:>12.3} {redone:>8} {base_s:>14.3} {base_redone:>8}"
        );
        first.push(first_s);
        before.push(step_s);
        first_full.push(full_s);
        ours.push(ha_s);
        base.push(base_s);
    }
    let (f, ff, o, b) = (
        median(first),
        median(first_full),
        median(ours),
        median(base),
    );
    println!(
        "median: hatrain {f:.3} s to the first step after recovery ({ff:.3} s with full snapshots: sliced ÷ full {:.3}), {o:.3} s to step K; baseline {b:.3} s to step K",
        f / ff
    );
    println!(
        "ratios to the baseline: first step {:.3}, step K {:.3}",
        f / b,
        o / b
    );

    // The simulator's costs: the 10m model's snapshot overhead, and the
    // pause of a crash beyond the step it redoes. That step's time is the
    // 10m model's median with a snapshot every step (part 1; the recovery
    // runs snapshot every step too), else the median of the steps the
    // recovery runs completed before the kill.
    let step = match ten_m {
        Some((sliced, none)) => {
            common::costs::record(
                "snapshot_step_ratio",
                sliced / none,
                "cargo bench -p hatrain-scenarios --bench recovery: step time with a snapshot every step ÷ none (2 ranks, 10m model)",
            );
            sliced
        }
        None => {
            println!(
                "no snapshot overhead of the 10m model measured (HATRAIN_BENCH_SIZES={sizes}): snapshot_step_ratio not recorded"
            );
            median(before)
        }
    };
    println!(
        "crash pause: {f:.3} s to the first step after recovery less one step of {step:.3} s = {:.3} s",
        f - step
    );
    common::costs::record(
        "crash_pause_s",
        f - step,
        "cargo bench -p hatrain-scenarios --bench recovery: SIGKILL of a rank → first completed step, less one step",
    );
}
