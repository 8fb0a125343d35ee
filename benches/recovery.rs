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
    let pid = pids
        .iter()
        .find(|(r, _)| *r == 1)
        .unwrap_or_else(|| {
            let tree = std::process::Command::new("ps")
                .args(["-e", "-o", "pid,ppid,args"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            panic!("no rank 1 under {} ({pids:?}):\n{tree}", child.id())
        })
        .1;
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
    let r = ha_recovery_of(dir, "10m", k, slices, &[]);
    (r.first_s, r.back_s, r.redone, r.step_s)
}

/// What one worker-reboot recovery measured.
struct Recovery {
    /// Seconds from the kill to the first step after it, and to step K.
    first_s: f64,
    back_s: f64,
    redone: usize,
    /// Median step time of steps 3.. before the kill.
    step_s: f64,
    /// Bytes of rank 0's snapshots (its sealed bytes over its snapshots).
    snapshot_bytes: Option<f64>,
}

/// [`ha_recovery`] of the model `size`, with more trainer flags.
fn ha_recovery_of(dir: &Path, size: &str, k: u64, slices: &str, extra: &[&str]) -> Recovery {
    let log = dir.join(format!("ha-{size}-{k}-{slices}.jsonl"));
    // A log of an earlier repetition would be read as this one's.
    let _ = std::fs::remove_file(&log);
    let mut c = launch(2, true, dir, slices, &train_args(size, k + 2, &log, extra));
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
    // Rank 0's log ends with its snapshot copies over the run.
    let snapshot_bytes = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .rfind(|e| e["event"] == "final")
        .and_then(|e| {
            let c = &e["snapshot_copies"];
            Some(c["bytes"].as_f64()? / c["sealed"].as_f64().filter(|n| *n > 0.0)?)
        });
    Recovery {
        first_s,
        back_s: back["unix_s"].as_f64().unwrap() - t_kill,
        redone,
        step_s: median(before),
        snapshot_bytes,
    }
}

/// `HATRAIN_BENCH_PART=per-gb`: how recovery grows with the state. The
/// recovery above (SIGKILL of rank 1 in step 13, worker reboot) on the
/// `10m` and the `100m` model, `HATRAIN_BENCH_REPS` times each,
/// interleaved: the pause beyond one step against each rank's snapshot
/// size, and the slope between the two in seconds per GB. With
/// `HATRAIN_BENCH_EMULATE_MS` the ranks run on an emulated device of that
/// many ms per forward and backward (`--emulate-device`): the step is
/// then nearly the same at both sizes, and the slope is what the bytes
/// cost, not the larger model's longer compute.
fn per_gb(dir: &Path, reps: usize) {
    let emulate = std::env::var("HATRAIN_BENCH_EMULATE_MS").ok();
    let extra: Vec<&str> = match &emulate {
        Some(ms) => vec!["--emulate-device", ms],
        None => Vec::new(),
    };
    let device = match &emulate {
        Some(ms) => format!("an emulated device of {ms} ms"),
        None => "the model on the CPU".into(),
    };
    println!(
        "recovery from SIGKILL of rank 1 in step 13 (2 ranks, worker reboot, {device}): first step after the kill less one step, median of {reps}"
    );
    println!(
        "{:<6} {:>14} {:>10} {:>10}",
        "model", "snapshot GB", "pause s", "spread"
    );
    let mut rows = Vec::new();
    let mut runs: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); 2];
    for _ in 0..reps {
        for (i, size) in ["10m", "100m"].iter().enumerate() {
            let r = ha_recovery_of(dir, size, 13, "on", &extra);
            runs[i].0.push(r.first_s - r.step_s);
            if let Some(b) = r.snapshot_bytes {
                runs[i].1.push(b / 1e9);
            }
        }
    }
    for (size, (pauses, gbs)) in ["10m", "100m"].iter().zip(runs) {
        let lo = pauses.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = pauses.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let (p, g) = (median(pauses), median(gbs));
        println!("{size:<6} {g:>14.4} {p:>10.3} {lo:.3}-{hi:.3}");
        rows.push((g, p));
    }
    let ((g0, p0), (g1, p1)) = (rows[0], rows[1]);
    let slope = ((p1 - p0) / (g1 - g0)).max(0.0);
    println!("recovery grows by {slope:.3} s per GB of snapshot per rank");
    let how = match &emulate {
        Some(ms) => format!("HATRAIN_BENCH_EMULATE_MS={ms} "),
        None => String::new(),
    };
    common::costs::record(
        "recovery_s_per_gb",
        slope,
        &format!(
            "{how}HATRAIN_BENCH_PART=per-gb cargo bench -p hatrain-scenarios --bench recovery: (pause of the 100m model − pause of the 10m) ÷ (their snapshot GB per rank); pause = SIGKILL → first step, less one step ({device})"
        ),
    );
    common::costs::record(
        "pause_state_gb",
        g0,
        "HATRAIN_BENCH_PART=per-gb cargo bench -p hatrain-scenarios --bench recovery: snapshot GB per rank of the 10m model, which the pauses are measured with",
    );
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
    if std::env::var("HATRAIN_BENCH_PART").as_deref() == Ok("per-gb") {
        per_gb(dir.path(), reps);
        return;
    }
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
