//! Helpers shared by the benchmark harnesses.
#![allow(dead_code)]

use hatrain_trainer::config::ModelConfig;
use std::path::{Path, PathBuf};

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
