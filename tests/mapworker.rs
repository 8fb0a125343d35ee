//! `hatrain-mapworker`: a small workload the agent has never seen, for the
//! tests of the generic persister and dump. Its state map has parts of its
//! own (a 40-byte header and two float buffers of sizes that differ by
//! rank), files that take slices of a part, a part in two files, and meta
//! fields of its own. Its state at every step is a pure function of (step,
//! rank), so a test can check any checkpoint byte for byte against the map.
//!
//! It runs under `hatrain-agent launch` with `RANK`/`WORLD_SIZE`, takes
//! `--save DIR --steps N --interval K --step-ms MS`, commits a snapshot
//! every step, and obeys the agent's directives (it has no collectives, so
//! a pause finds it at a step boundary).

use hatrain_shared::statemap::{
    CheckpointMap, Dtype, FieldValue, FileMap, MetaField, Part, Sharing, StateMap, TensorMap,
};
use std::path::Path;

/// Bytes of the header part: step, stamp, and three words of padding.
pub const HEADER: u64 = 40;
pub const BETA: u64 = 333;

/// Elements of rank `rank`'s `alpha` part.
pub fn alpha_len(rank: usize) -> u64 {
    1000 + 7 * rank as u64
}

/// Where `alpha` is cut between the two files.
pub fn alpha_cut(rank: usize) -> u64 {
    alpha_len(rank) / 2
}

/// Element `i` of `alpha` after `step` steps on `rank`.
pub fn alpha(step: u64, rank: usize, i: u64) -> f32 {
    (step as f32) * 0.5 + (rank as f32) * 1000.0 + i as f32 * 1e-3
}

/// Element `i` of `beta` after `step` steps on `rank`.
pub fn beta(step: u64, rank: usize, i: u64) -> f32 {
    -((step * 31 + i) as f32) - rank as f32 * 0.25
}

/// The header after `step` steps on `rank`.
pub fn header(step: u64, rank: usize) -> Vec<u8> {
    let stamp = 0xC0FFEE_u64 ^ (step << 8) ^ rank as u64;
    [step, stamp, 0, 0, 0]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect()
}

/// The state map of `rank` of `world`, saving into `dir` every `interval`
/// steps.
pub fn map(rank: usize, world: usize, dir: &Path, interval: u64) -> StateMap {
    let (n, cut) = (alpha_len(rank), alpha_cut(rank));
    let tensor = |name: &str, part, range| TensorMap {
        name: name.into(),
        part,
        range,
        shape: None,
        offsets: None,
    };
    StateMap {
        parts: vec![
            Part {
                name: "header".into(),
                dtype: Dtype::U8,
                len: HEADER,
                sharing: Sharing::Unique,
            },
            Part {
                name: "alpha".into(),
                dtype: Dtype::F32,
                len: n,
                sharing: Sharing::Unique,
            },
            Part {
                name: "beta".into(),
                dtype: Dtype::F32,
                len: BETA,
                sharing: Sharing::Unique,
            },
        ],
        checkpoint: Some(CheckpointMap {
            dir: dir.to_path_buf(),
            interval,
            world_size: world,
            files: vec![
                FileMap {
                    name: "first.safetensors".into(),
                    tensors: vec![tensor("alpha_head", 1, 0..cut), tensor("beta", 2, 0..BETA)],
                },
                FileMap {
                    name: "second.safetensors".into(),
                    tensors: vec![tensor("alpha_tail", 1, cut..n)],
                },
            ],
            fields: vec![
                MetaField {
                    name: "stamp".into(),
                    value: FieldValue::U64 { part: 0, offset: 8 },
                },
                MetaField {
                    name: "steps_done".into(),
                    value: FieldValue::U64 { part: 0, offset: 0 },
                },
                MetaField {
                    name: "label".into(),
                    value: FieldValue::Const(
                        serde_json::json!({"worker": "mapworker", "rank": rank}),
                    ),
                },
            ],
            linked: None,
        }),
        global_batch: None,
    }
}
