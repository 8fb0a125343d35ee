//! Helpers shared by the benchmark harnesses.
#![allow(dead_code)]

pub mod costs;
/// The tests' etcd launcher (Debian's `etcd-server` on loopback ports).
#[path = "../../tests/common/etcd.rs"]
pub mod etcd;
pub mod hosts;
/// The tests' `hatrain-agent launch` command lines.
#[path = "../../tests/common/launch.rs"]
pub mod launch;
#[path = "../../tests/common/ports.rs"]
pub mod ports;

use hatrain_trainer::config::ModelConfig;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The `hatrain-agent` binary, built first in the bench profile.
pub fn agent() -> PathBuf {
    hatrain_demo::bins::locate("hatrain-agent").expect("hatrain-agent")
}

/// The `hatrain-train` binary.
pub fn trainer() -> PathBuf {
    hatrain_demo::bins::locate("hatrain-train").expect("hatrain-train")
}

/// The median of `v` (upper median for an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `HATRAIN_BENCH_MIB`, or `default`.
pub fn bench_mib(default: usize) -> usize {
    std::env::var("HATRAIN_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A model whose parameters and two AdamW moments (three flat f32
/// buffers) add up to about `mib` MiB.
pub fn model_of_mib(mib: usize) -> ModelConfig {
    let per_buffer = mib * (1 << 20) / 12;
    ModelConfig {
        vocab: 1024,
        context: 8,
        d_embed: 64,
        d_model: 1024,
        d_ff: 1024,
        layers: (per_buffer / (2 * 1024 * 1024)).max(1),
    }
}

/// Trainer arguments of the end-to-end benchmarks: global batch 16 × 32
/// tokens, a JSON log, and `extra`.
pub fn train_args(size: &str, iters: u64, log: &Path, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "--model-size",
        size,
        "--global-batch",
        "16",
        "--seq-len",
        "32",
        "--log-interval",
        "1000",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend([
        "--train-iters".into(),
        iters.to_string(),
        "--log-jsonl".into(),
        log.display().to_string(),
    ]);
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// Seconds since the Unix epoch.
pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The JSON lines of a trainer's `--log-jsonl`.
pub fn events(log: &Path) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Its step events.
pub fn steps(log: &Path) -> Vec<Value> {
    events(log)
        .into_iter()
        .filter(|e| e["event"] == "step")
        .collect()
}

/// The workers under `launcher` (its descendants with a `RANK` in their
/// environment: its children, or a fork server's), by rank.
pub fn worker_pids(launcher: u32) -> Vec<(usize, i32)> {
    let mut out = Vec::new();
    let mut parents = vec![launcher as i32];
    // The launcher, a fork server, the workers: a few levels at most.
    for _ in 0..4 {
        let mut next = Vec::new();
        for parent in parents {
            for t in std::fs::read_dir(format!("/proc/{parent}/task"))
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
                    match rank {
                        Some(r) => out.push((r, pid)),
                        None => next.push(pid),
                    }
                }
            }
        }
        parents = next;
    }
    out
}

/// Waits until `log` has a step event satisfying `f` (bounded).
pub fn wait_step(log: &Path, limit: Duration, f: impl Fn(&Value) -> bool) -> Option<Value> {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if let Some(e) = steps(log).into_iter().find(|e| f(e)) {
            return Some(e);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}
