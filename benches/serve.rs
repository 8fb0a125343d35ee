//! Agent restart under `hatrain-agent serve`: how long the next agent takes
//! to re-adopt every worker of a running job, and the step time the
//! workers saw while no agent ran, against the steps before. The baseline,
//! in the same run: a fresh start of the same job to its first step, the
//! least an agent restart costs when the workers die with their agent (as
//! under `launch`), before any checkpoint is read.
//!
//! 4 ranks under the real `mpirun` (each `hatrain-agent exec`), the `small`
//! model (`HATRAIN_BENCH_MODEL`). Five times: SIGKILL the agent, start the
//! next one 2 s later, and time from its start until `agentctl workers`
//! answers with all four workers (re-adopted); the step times come from
//! the trainer's log (steps finished while no agent ran, against those of
//! the 2 s before the kill). Then three fresh jobs are timed from `mpirun`
//! to their first step.

mod common;
use common::{agent, median, steps, train_args, trainer, wait_step};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(300);
const KILLS: usize = 5;

fn model() -> String {
    std::env::var("HATRAIN_BENCH_MODEL").unwrap_or_else(|_| "small".into())
}

fn agentctl() -> PathBuf {
    hatrain_demo::bins::locate("agentctl").expect("agentctl")
}

fn serve(dir: &Path) -> Child {
    let socket = dir.join("run/agent.sock");
    let _ = std::fs::remove_file(&socket);
    let child = Command::new(agent())
        .arg("serve")
        .arg("--socket")
        .arg(&socket)
        .arg("--shm-root")
        .arg(dir.join("shm"))
        .env("RUST_LOG", "warn")
        .stderr(Stdio::null())
        .spawn()
        .expect("hatrain-agent serve");
    let end = Instant::now() + LIMIT;
    while !socket.exists() {
        assert!(Instant::now() < end, "the agent made no socket");
        std::thread::sleep(Duration::from_millis(2));
    }
    child
}

fn mpirun(dir: &Path, job: &str, log: &Path, iters: u64) -> Child {
    let socket = dir.join("run/agent.sock");
    Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "4"])
        .args(["-x", "HATRAIN_AGENT_SOCKET", "-x", "HATRAIN_JOB_ID"])
        .arg(agent())
        .args([
            "exec",
            "--enable-high-availability",
            "--enable-worker-reboot",
            "--",
        ])
        .arg(trainer())
        .args(train_args(&model(), iters, log, &[]))
        .env("HATRAIN_AGENT_SOCKET", socket)
        .env("HATRAIN_JOB_ID", job)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("mpirun (Debian's openmpi-bin: scripts/system-packages.sh openmpi-bin)")
}

/// Whether the agent at the job's socket answers with all four workers.
fn all_adopted(socket: &Path) -> bool {
    Command::new(agentctl())
        .arg("--socket")
        .arg(socket)
        .args(["--json", "workers"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok())
        .and_then(|v| {
            v["workers"]
                .as_array()
                .map(|w| w.len() == 4 && w.iter().all(|w| w["pid"].is_number()))
        })
        .unwrap_or(false)
}

/// The median step time of the steps finished within `from..to` (Unix s).
fn step_time(log: &Path, from: f64, to: f64) -> Option<f64> {
    let v: Vec<f64> = steps(log)
        .iter()
        .filter(|e| e["unix_s"].as_f64().is_some_and(|t| t > from && t <= to))
        .filter_map(|e| e["step_time_s"].as_f64())
        .collect();
    (!v.is_empty()).then(|| median(v))
}

fn now() -> f64 {
    common::now()
}

fn main() {
    let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/system-packages.sh");
    assert!(
        Command::new(scripts)
            .arg("openmpi-bin")
            .status()
            .unwrap()
            .success()
    );
    let d = tempfile::tempdir().unwrap();
    let log = d.path().join("run.jsonl");
    let mut agent_proc = serve(d.path());
    let job = format!("bench-serve-{}", std::process::id());
    let mut run = mpirun(d.path(), &job, &log, 1_000_000);
    let socket = d.path().join("shm").join(&job).join("agent.sock");
    wait_step(&log, LIMIT, |e| e["step"].as_u64() == Some(20)).expect("the job trains");
    println!(
        "model {}, 4 ranks under mpirun; agent SIGKILLed, the next started 2 s later",
        model()
    );
    println!(
        "{:>4} {:>13} {:>12} {:>12} {:>7} {:>12}",
        "kill", "re-adopt (s)", "step before", "step in gap", "ratio", "steps in gap"
    );
    let (mut adopt, mut ratios) = (Vec::new(), Vec::new());
    for k in 1..=KILLS {
        std::thread::sleep(Duration::from_secs(2));
        let t_kill = now();
        let _ = agent_proc.kill();
        let _ = agent_proc.wait();
        std::thread::sleep(Duration::from_secs(2));
        let started = Instant::now();
        agent_proc = serve(d.path());
        while !all_adopted(&socket) {
            assert!(
                started.elapsed() < LIMIT,
                "the next agent did not re-adopt the job"
            );
        }
        let secs = started.elapsed().as_secs_f64();
        let t_ready = now();
        let before = step_time(&log, t_kill - 2.0, t_kill).expect("steps before the kill");
        let gap = step_time(&log, t_kill, t_ready).expect("steps while no agent ran");
        let done = steps(&log)
            .iter()
            .filter(|e| {
                e["unix_s"]
                    .as_f64()
                    .is_some_and(|t| t > t_kill && t <= t_ready)
            })
            .count();
        println!(
            "{k:>4} {secs:>13.4} {before:>12.4} {gap:>12.4} {:>7.3} {done:>12}",
            gap / before
        );
        adopt.push(secs);
        ratios.push(gap / before);
    }
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(run.id().to_string())
        .status();
    let _ = run.wait();

    let mut fresh = Vec::new();
    for i in 0..3 {
        let log = d.path().join(format!("fresh{i}.jsonl"));
        let t0 = Instant::now();
        let mut r = mpirun(d.path(), &format!("{job}-fresh{i}"), &log, 5);
        wait_step(&log, LIMIT, |e| e["step"].as_u64() == Some(1)).expect("first step");
        fresh.push(t0.elapsed().as_secs_f64());
        let _ = r.wait();
    }
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(agent_proc.id().to_string())
        .status();
    let _ = agent_proc.wait();
    let (a, f) = (median(adopt), median(fresh.clone()));
    println!("fresh start of the same job to its first step (s): {fresh:.3?}");
    println!(
        "median re-adopt {a:.4} s; median fresh start {f:.3} s; re-adopt / fresh start = {:.3}",
        a / f
    );
    println!(
        "median step time in the gap / before = {:.3}",
        median(ratios)
    );
}
