//! End-to-end benchmarks of worker reboot, with real trainer processes.
//!
//! 1. Snapshot overhead: median step time with a snapshot every step,
//!    divided by the median step time with snapshots off
//!    (`--snapshot-interval` larger than the run), for the `10m` and `100m`
//!    models on 2 ranks (`HATRAIN_BENCH_SIZES` narrows it).
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
//!    after the kill (the first step after recovery) and to step K; for the
//!    baseline the time to step K; steps redone; the medians and ratios.

mod common;
use common::{agent, median, train_args, trainer};
use serde_json::Value;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn events(log: &Path) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn steps(log: &Path) -> Vec<Value> {
    events(log)
        .into_iter()
        .filter(|e| e["event"] == "step")
        .collect()
}

fn launch(nproc: usize, ha: bool, shm: &Path, train: &[String]) -> Child {
    let mut c = Command::new(agent());
    c.args([
        "launch",
        "--nproc-per-node",
        &nproc.to_string(),
        "--stop-grace-secs",
        "2",
    ])
    .arg("--shm-root")
    .arg(shm);
    if ha {
        c.args(["--enable-high-availability", "--enable-worker-reboot"]);
    }
    c.arg("--").arg(trainer()).args(train);
    c.env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c.spawn().expect("start hatrain-agent")
}

fn worker_pids(launcher: u32) -> Vec<(usize, i32)> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{launcher}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let kids = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        for pid in kids
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let rank = env
                .split(|b| *b == 0)
                .find_map(|kv| kv.strip_prefix(b"RANK="))
                .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok());
            if let Some(r) = rank {
                out.push((r, pid));
            }
        }
    }
    out
}

/// Waits until `log` has a step event satisfying `f` (bounded).
fn wait_step(log: &Path, limit: Duration, f: impl Fn(&Value) -> bool) -> Option<Value> {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if let Some(e) = steps(log).into_iter().find(|e| f(e)) {
            return Some(e);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

fn kill_rank1(child: &Child) -> f64 {
    let pids = worker_pids(child.id());
    let pid = pids.iter().find(|(r, _)| *r == 1).expect("rank 1").1;
    let t = now();
    // SAFETY: kill(2) with plain integers.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    t
}

fn overhead(dir: &Path, size: &str) -> (f64, f64) {
    let mut out = Vec::new();
    for interval in ["1", "1000000"] {
        let log = dir.join(format!("overhead-{size}-{interval}.jsonl"));
        let mut c = launch(
            2,
            true,
            dir,
            &train_args(size, 9, &log, &["--snapshot-interval", interval]),
        );
        assert!(c.wait().unwrap().success());
        let t: Vec<f64> = steps(&log)
            .iter()
            .filter(|e| e["step"].as_u64() > Some(2))
            .map(|e| e["step_time_s"].as_f64().unwrap())
            .collect();
        out.push(median(t));
    }
    (out[0], out[1])
}

fn main() {
    let dir = tempfile::Builder::new()
        .prefix("hatrain-bench-")
        .tempdir_in("/dev/shm")
        .expect("tempdir");
    let sizes = std::env::var("HATRAIN_BENCH_SIZES").unwrap_or_else(|_| "10m,100m".into());
    println!("snapshot overhead (2 ranks, global batch 16 x 32, median of steps 3-9)");
    println!(
        "{:<6} {:>16} {:>16} {:>8}",
        "model", "snapshot ms/step", "no snapshot", "ratio"
    );
    for size in sizes.split(',') {
        let (with, without) = overhead(dir.path(), size);
        println!(
            "{size:<6} {:>16.1} {:>16.1} {:>8.3}",
            with * 1e3,
            without * 1e3,
            with / without
        );
    }

    println!(
        "\nrecovery from SIGKILL of rank 1 during step K (10m model, 2 ranks, disk save every 10 steps)"
    );
    println!(
        "{:>3} {:>16} {:>14} {:>8} {:>14} {:>8}",
        "K", "hatrain 1st s", "hatrain K s", "redone", "baseline K s", "redone"
    );
    let (mut first, mut ours, mut base) = (Vec::new(), Vec::new(), Vec::new());
    for k in [13u64, 16, 19] {
        // hatrain: worker reboot.
        let log = dir.path().join(format!("ha-{k}.jsonl"));
        let mut c = launch(2, true, dir.path(), &train_args("10m", k + 2, &log, &[]));
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
        let ha_s = back["unix_s"].as_f64().unwrap() - t_kill;
        let first_s = steps(&log)
            .iter()
            .filter_map(|e| e["unix_s"].as_f64())
            .find(|t| *t > t_kill)
            .expect("a step after the kill")
            - t_kill;

        // Baseline: stop, relaunch from the disk checkpoint, redo.
        let log = dir.path().join(format!("base-{k}.jsonl"));
        let ckpt = dir.path().join(format!("ckpt-{k}"));
        let ck = ckpt.display().to_string();
        let mut c = launch(
            2,
            false,
            dir.path(),
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
        println!("{k:>3} {first_s:>16.3} {ha_s:>14.3} {redone:>8} {base_s:>14.3} {base_redone:>8}");
        first.push(first_s);
        ours.push(ha_s);
        base.push(base_s);
    }
    let (f, o, b) = (median(first), median(ours), median(base));
    println!(
        "median: hatrain {f:.3} s to the first step after recovery, {o:.3} s to step K; baseline {b:.3} s to step K"
    );
    println!(
        "ratios to the baseline: first step {:.3}, step K {:.3}",
        f / b,
        o / b
    );
}
