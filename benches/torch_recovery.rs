//! Recovery of a PyTorch DDP job from a SIGKILL of one rank, side by side
//! in one run: `examples/torch_ddp.py`, 2 ranks, gloo, about 252 MiB of
//! state per rank (parameters and AdamW's two moments: an MLP of 6 layers
//! of 2090), rank 1 SIGKILLed at a step between 13 and 19, three times
//! each, interleaved:
//!
//! - `torchrun` (`--plain`: torch.distributed alone) with a `torch.save`
//!   checkpoint every 10 steps, which restarts the group and resumes from
//!   the newest checkpoint (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, without
//!   which its second restart fails);
//! - `hatrain-agent launch` with worker reboot (only rank 1 restarts, and
//!   refills from shared memory);
//! - the same with `--preload torch,torch._dynamo` (rank 1's new process
//!   is forked from a server that has imported them: it builds the model
//!   and refills);
//! - the same with `--warm-standby 1` (rank 1's place goes to a process
//!   that has imported torch and built the model already).
//!
//! For each: the time from the kill to the first step the restarted rank
//! completes, and the steps redone. Also the step time before the kill
//! under hatrain (a snapshot every step) against the plain script under
//! torchrun (its checkpoint steps left out).
//!
//! `HATRAIN_BENCH_HIDDEN` and `HATRAIN_BENCH_LAYERS` change the model.
//!
//! `HATRAIN_BENCH_MODEL=gpt` runs `examples/torch_gpt.py` instead, sharded
//! with FSDP2 (bf16 autocast, AdamW, clipping): 12 layers of width 1024
//! (about 155M parameters, 0.93 GB of parameters and moments per rank),
//! 16 tokens a step per rank so that a step takes seconds on two cores, 20
//! steps; torchrun saves with `torch.distributed.checkpoint` every 10 steps
//! (`--save`), and the modes are torchrun, `--preload` and the warm
//! standby. `HATRAIN_BENCH_LAYERS` and `HATRAIN_BENCH_WIDTH` change it.

mod common;
#[path = "../tests/common/python.rs"]
#[allow(dead_code)]
mod python;

// `python` builds its command lines with `super::launch` and finds the
// agent with `super::agent`.
use common::agent;
use common::launch::{self, Launch};
use common::{median, now};
use serde_json::Value;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The steps of a run: of the DDP example, and of the GPT one.
const STEPS: u64 = 24;
const GPT_STEPS: u64 = 20;
const LIMIT: Duration = Duration::from_secs(600);
const KILL_AT: [u64; 3] = [13, 16, 19];

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Torchrun,
    Reboot,
    Preload,
    Standby,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::Torchrun if gpt() => "torchrun + DCP save every 10 steps",
            Self::Torchrun => "torchrun + torch.save every 10 steps",
            Self::Reboot => "hatrain worker reboot",
            Self::Preload => "hatrain worker reboot + --preload torch",
            Self::Standby => "hatrain worker reboot + warm standby",
        }
    }
}

fn env_num(k: &str, default: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn read(log: &Path) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Whether the GPT example is measured (`HATRAIN_BENCH_MODEL=gpt`).
fn gpt() -> bool {
    std::env::var("HATRAIN_BENCH_MODEL").is_ok_and(|m| m == "gpt")
}

/// The GPT example's arguments.
fn gpt_args(dir: &Path, mode: Mode) -> Vec<String> {
    let script = python::example("torch_gpt.py");
    let log = dir.join("log.{rank}.jsonl");
    let mut args: Vec<String> = vec![
        script.display().to_string(),
        "--steps".into(),
        GPT_STEPS.to_string(),
        "--layers".into(),
        env_num("HATRAIN_BENCH_LAYERS", 12).to_string(),
        "--width".into(),
        env_num("HATRAIN_BENCH_WIDTH", 1024).to_string(),
        "--heads".into(),
        "16".into(),
        "--vocab".into(),
        "4096".into(),
        "--seq".into(),
        "16".into(),
        "--batch".into(),
        "1".into(),
        "--log-jsonl".into(),
        log.display().to_string(),
    ];
    if mode == Mode::Torchrun {
        args.extend([
            "--save".into(),
            dir.join("ck").display().to_string(),
            "--save-interval".into(),
            "10".into(),
        ]);
    }
    args
}

fn start(mode: Mode, dir: &Path) -> Child {
    let py = python::python();
    let script = python::example("torch_ddp.py");
    let hidden = env_num("HATRAIN_BENCH_HIDDEN", 2090).to_string();
    let layers = env_num("HATRAIN_BENCH_LAYERS", 6).to_string();
    let log = dir.join("log.{rank}.jsonl");
    let mut args: Vec<String> = [
        script.to_str().unwrap(),
        "--steps",
        &STEPS.to_string(),
        "--hidden",
        &hidden,
        "--layers",
        &layers,
        "--log-jsonl",
        log.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if gpt() {
        args = gpt_args(dir, mode);
    }
    let mut cmd = match mode {
        Mode::Torchrun if gpt() => {
            let mut c = Command::new(py);
            c.args(["-m", "torch.distributed.run", "--nproc-per-node", "2"])
                .args(["--max-restarts", "3", "--monitor-interval", "0.1"])
                .args(&args)
                .env("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1");
            c
        }
        Mode::Torchrun => {
            let ck = dir.join("ck");
            args.extend([
                "--plain".into(),
                "--checkpoint".into(),
                ck.display().to_string(),
            ]);
            let mut c = Command::new(py);
            c.args(["-m", "torch.distributed.run", "--nproc-per-node", "2"])
                .args(["--max-restarts", "3", "--monitor-interval", "0.1"])
                .args(&args)
                .env("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1");
            c
        }
        Mode::Reboot | Mode::Preload | Mode::Standby => {
            let mut launch = Launch::bare(2).stop_grace_secs(3).worker_reboot();
            if mode == Mode::Standby {
                launch = launch.option("--warm-standby", "1");
            }
            if mode == Mode::Preload {
                launch = launch.option("--preload", "torch,torch._dynamo");
            }
            launch
                .program(py)
                .args(&args)
                .env("RUST_LOG", "warn")
                .command()
        }
    };
    cmd.current_dir(dir)
        .env_remove("HATRAIN_FAULT_PLAN")
        .env_remove("OMP_NUM_THREADS")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the launcher")
}

struct Sample {
    /// Bytes of a snapshot of rank 1 (hatrain's modes).
    snapshot_bytes: Option<u64>,
    recovery_s: f64,
    redone: u64,
    step_time_s: f64,
}

fn run(mode: Mode, kill_at: u64) -> Sample {
    let dir = tempfile::tempdir().unwrap();
    let mut launcher = start(mode, dir.path());
    let (log0, log1) = (
        dir.path().join("log.0.jsonl"),
        dir.path().join("log.1.jsonl"),
    );
    let end = Instant::now() + LIMIT;
    let step_of = |e: &Value| e["step"].as_u64().unwrap_or(0);
    // Rank 0 at the kill step: SIGKILL rank 1 (its pid from its own log).
    let victim = loop {
        assert!(Instant::now() < end, "{mode:?}: no step {kill_at}");
        if let Some(st) = launcher.try_wait().expect("poll the launcher") {
            panic!("{mode:?}: the launcher exited ({st}) before step {kill_at}");
        }
        let at = read(&log0)
            .iter()
            .any(|e| e["event"] == "step" && step_of(e) >= kill_at);
        let pid = read(&log1)
            .iter()
            .find(|e| e["event"] == "start")
            .and_then(|e| e["pid"].as_i64());
        if let (true, Some(pid)) = (at, pid) {
            break pid as i32;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let t_kill = now();
    // SAFETY: kill(2) with plain integers.
    unsafe { libc::kill(victim, libc::SIGKILL) };
    // The replacement's first completed step.
    let first = loop {
        assert!(Instant::now() < end, "{mode:?}: rank 1 never came back");
        let ev = read(&log1);
        let replaced = ev
            .iter()
            .skip_while(|e| !(e["event"] == "start" && e["pid"].as_i64() != Some(victim as i64)))
            .find(|e| e["event"] == "step")
            .cloned();
        if let Some(e) = replaced {
            break e;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let done_before = read(&log0)
        .iter()
        .filter(|e| e["event"] == "step" && e["unix_s"].as_f64().unwrap_or(f64::MAX) < t_kill)
        .map(step_of)
        .max()
        .unwrap_or(0);
    let pre: Vec<f64> = read(&log0)
        .iter()
        .filter(|e| {
            let s = step_of(e);
            e["event"] == "step" && (3..=12).contains(&s) && s % 10 != 0
        })
        .filter_map(|e| e["step_time_s"].as_f64())
        .collect();
    let status = launcher.wait().expect("wait for the launcher");
    assert!(status.success(), "{mode:?}: the job failed: {status}");
    let snapshot_bytes = read(&log1)
        .iter()
        .find(|e| e["event"] == "start")
        .and_then(|e| e["snapshot_bytes"].as_u64());
    Sample {
        snapshot_bytes,
        recovery_s: first["unix_s"].as_f64().unwrap() - t_kill,
        redone: done_before.saturating_sub(step_of(&first) - 1),
        step_time_s: median(pre),
    }
}

fn main() {
    let modes: &[Mode] = if gpt() {
        &[Mode::Torchrun, Mode::Preload, Mode::Standby]
    } else {
        &[Mode::Torchrun, Mode::Reboot, Mode::Preload, Mode::Standby]
    };
    let mut samples: Vec<(Mode, Sample)> = Vec::new();
    // Interleaved: each repetition runs every mode once.
    for (rep, &k) in KILL_AT.iter().enumerate() {
        for &mode in modes {
            let s = run(mode, k);
            println!(
                "rep {rep} kill at step {k:>2} | {:<40} | kill -> first step {:>6.3} s | redone {:>2} | step {:.3} s",
                mode.name(),
                s.recovery_s,
                s.redone,
                s.step_time_s
            );
            samples.push((mode, s));
        }
    }
    let of = |m: Mode, f: &dyn Fn(&Sample) -> f64| {
        median(
            samples
                .iter()
                .filter(|(x, _)| *x == m)
                .map(|(_, s)| f(s))
                .collect(),
        )
    };
    let base = of(Mode::Torchrun, &|s| s.recovery_s);
    println!();
    let bytes = samples.iter().find_map(|(_, s)| s.snapshot_bytes);
    println!(
        "median of {} runs each, 2 ranks, gloo, a snapshot of rank 1: {:.1} MiB:",
        KILL_AT.len(),
        bytes.unwrap_or(0) as f64 / (1 << 20) as f64
    );
    for &m in modes {
        let r = of(m, &|s| s.recovery_s);
        println!(
            "  {:<40} kill -> first step {r:>6.3} s  ({:.3}x torchrun)  steps redone {}",
            m.name(),
            r / base,
            of(m, &|s| s.redone as f64)
        );
    }
    let plain = of(Mode::Torchrun, &|s| s.step_time_s);
    let snap = median(
        samples
            .iter()
            .filter(|(m, _)| *m != Mode::Torchrun)
            .map(|(_, s)| s.step_time_s)
            .collect(),
    );
    println!(
        "  step time: the plain script {plain:.4} s, hatrain with a snapshot every step {snap:.4} s: {:.3}x",
        snap / plain
    );
}
