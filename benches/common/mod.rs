//! Helpers shared by the benchmark harnesses.
#![allow(dead_code)]

use hatrain_shared::model::ModelConfig;

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
