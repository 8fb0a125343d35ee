//! The trainer's checkpoints: its state map (what a rank's snapshot holds
//! and how it becomes a rank directory of the format in
//! [`hatrain_shared::checkpoint`]) and its loader, which re-slices a
//! checkpoint saved at any world size.
//!
//! ```text
//! snapshot:  meta (24 B: step, RNG state, data position as u64)
//!            params      f32[numel]   (the same on every rank)
//!            exp_avg     f32[shard]   (this rank's AdamW moments)
//!            exp_avg_sq  f32[shard]
//! rank dir:  model.safetensors  params = params[shard]
//!            optim.safetensors  exp_avg, exp_avg_sq
//!            meta.json          ... shard, numel, model, rng_state,
//!                               data_position, args, files
//! ```

use crate::config::ModelConfig;
use hatrain_shared::checkpoint::{
    self, CheckpointError, RankMeta, iter_dir, rank_dir, read_rank_meta, read_verified,
    tensor_bytes,
};
use hatrain_shared::shard::shard_range;
use hatrain_shared::statemap::{
    CheckpointMap, Dtype, FieldValue, FileMap, MetaField, Part, Sharing, StateMap, TensorMap,
};
use serde::Deserialize;
use std::ops::Range;
use std::path::{Path, PathBuf};

pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIM_FILE: &str = "optim.safetensors";
/// Bytes of the snapshot's metadata block: step, RNG state, data position.
pub const META_LEN: u64 = 24;

/// Where the trainer saves: its `--save` directory and `--save-interval`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaveTo {
    pub dir: PathBuf,
    pub interval: u64,
}

/// The state map of rank `rank` of `world` training `model`.
pub fn state_map(
    model: &ModelConfig,
    world: usize,
    rank: usize,
    save: Option<&SaveTo>,
    args: serde_json::Value,
) -> StateMap {
    // The trainer keeps its global batch at every size (`--global-batch`).
    let global_batch = args.get("global_batch").and_then(serde_json::Value::as_u64);
    let numel = model.numel();
    let shard = shard_range(numel, world, rank);
    let n = shard.len() as u64;
    let part = |name: &str, dtype, len, sharing| Part {
        name: name.into(),
        dtype,
        len,
        sharing,
    };
    let parts = vec![
        part("meta", Dtype::U8, META_LEN, Sharing::Unique),
        part(
            "params",
            Dtype::F32,
            numel as u64,
            Sharing::Replicated {
                group: world,
                index: rank,
            },
        ),
        part("exp_avg", Dtype::F32, n, Sharing::Unique),
        part("exp_avg_sq", Dtype::F32, n, Sharing::Unique),
    ];
    let tensor = |name: &str, part, range: Range<usize>| TensorMap {
        name: name.into(),
        part,
        range: range.start as u64..range.end as u64,
        shape: None,
        offsets: None,
    };
    let field = |name: &str, value| MetaField {
        name: name.into(),
        value,
    };
    let constant = |v: serde_json::Value| FieldValue::Const(v);
    let checkpoint = save.map(|s| CheckpointMap {
        dir: s.dir.clone(),
        interval: s.interval,
        world_size: world,
        files: vec![
            FileMap {
                name: MODEL_FILE.into(),
                tensors: vec![tensor("params", 1, shard.clone())],
            },
            FileMap {
                name: OPTIM_FILE.into(),
                tensors: vec![
                    tensor("exp_avg", 2, 0..shard.len()),
                    tensor("exp_avg_sq", 3, 0..shard.len()),
                ],
            },
        ],
        fields: vec![
            field(
                "shard",
                constant(serde_json::json!({"start": shard.start, "end": shard.end})),
            ),
            field("numel", constant(serde_json::json!(numel))),
            field(
                "model",
                constant(serde_json::to_value(model).unwrap_or_default()),
            ),
            field("rng_state", FieldValue::U64 { part: 0, offset: 8 }),
            field(
                "data_position",
                FieldValue::U64 {
                    part: 0,
                    offset: 16,
                },
            ),
            field("args", constant(args)),
        ],
        linked: None,
    });
    StateMap {
        parts,
        checkpoint,
        global_batch,
    }
}

/// The trainer's fields of a `meta.json`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct TrainerFields {
    shard: Range<usize>,
    numel: usize,
    model: ModelConfig,
    rng_state: u64,
    data_position: u64,
    args: serde_json::Value,
}

fn trainer_fields(meta: &RankMeta, path: &Path) -> Result<TrainerFields, CheckpointError> {
    let bad = |detail: String| CheckpointError::BadMeta {
        path: path.to_path_buf(),
        detail,
    };
    let f: TrainerFields = serde_json::from_value(serde_json::Value::Object(meta.fields.clone()))
        .map_err(|e| bad(e.to_string()))?;
    if f.model.validate().is_err() || f.model.numel() != f.numel {
        return Err(bad(format!(
            "numel {} does not match its model shape {:?}",
            f.numel, f.model
        )));
    }
    if f.shard != shard_range(f.numel, meta.world_size, meta.rank) {
        return Err(bad(format!(
            "shard {:?} is not rank {}'s range of {} elements over {} ranks",
            f.shard, meta.rank, f.numel, meta.world_size
        )));
    }
    Ok(f)
}

/// What [`load_shard`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedShard {
    pub iteration: u64,
    pub rng_state: u64,
    pub data_position: u64,
    pub saved_world_size: usize,
    pub params: Vec<f32>,
    /// The two moments, when asked for.
    pub moments: Option<(Vec<f32>, Vec<f32>)>,
    pub args: serde_json::Value,
}

/// Copies elements `want` (flat-buffer indices) of 1-D tensor `name`,
/// holding the shard `shard`, out of a verified file into `out`, whose
/// first element is flat index `out_start`.
fn copy_tensor(
    path: &Path,
    bytes: &[u8],
    name: &str,
    shard: &Range<usize>,
    want: Range<usize>,
    out: &mut [f32],
    out_start: usize,
) -> Result<(), CheckpointError> {
    let data = tensor_bytes(path, bytes, name, Dtype::F32, shard.len())?;
    let src = &data[(want.start - shard.start) * 4..(want.end - shard.start) * 4];
    let dst = &mut out[want.start - out_start..want.end - out_start];
    // The tensor's bytes need not be 4-aligned inside the file, so decode
    // element by element rather than casting.
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
    Ok(())
}

/// Loads the element range `range` of the parameters (and, with
/// `with_moments`, of both AdamW moments) from iteration `iteration` of the
/// checkpoint in `load`, whatever world size saved it. Every file that is
/// read is verified against its `meta.json` first.
pub fn load_shard(
    load: &Path,
    iteration: u64,
    model: &ModelConfig,
    range: Range<usize>,
    with_moments: bool,
) -> Result<LoadedShard, CheckpointError> {
    let numel = model.numel();
    if range.start > range.end || range.end > numel {
        return Err(CheckpointError::RangeOutOfBounds {
            start: range.start,
            end: range.end,
            numel,
        });
    }
    let it_dir = iter_dir(load, iteration);
    if !it_dir.is_dir() {
        return Err(CheckpointError::MissingIteration {
            path: it_dir,
            iteration,
        });
    }
    let first_path = rank_dir(&it_dir, 0).join(checkpoint::META_FILE);
    let first = read_rank_meta(&it_dir, 0, 0)?;
    let first_fields = trainer_fields(&first, &first_path)?;
    let check_same = |meta: &RankMeta, f: &TrainerFields, path: &Path| {
        if f.model != *model {
            return Err(CheckpointError::ModelMismatch {
                path: path.to_path_buf(),
                saved: format!("{:?} ({} parameters)", f.model, f.numel),
                ours: format!("{model:?} ({numel} parameters)"),
            });
        }
        if meta.iteration != iteration
            || meta.world_size != first.world_size
            || f.rng_state != first_fields.rng_state
            || f.data_position != first_fields.data_position
        {
            return Err(CheckpointError::BadMeta {
                path: path.to_path_buf(),
                detail: format!(
                    "disagrees with rank 0 (iteration {} vs {iteration}, world {} vs {}, rng or data position)",
                    meta.iteration, meta.world_size, first.world_size
                ),
            });
        }
        Ok(())
    };
    check_same(&first, &first_fields, &first_path)?;

    let mut params = vec![0f32; range.len()];
    let mut moments = with_moments.then(|| (vec![0f32; range.len()], vec![0f32; range.len()]));
    for rank in 0..first.world_size {
        let dir = rank_dir(&it_dir, rank);
        let meta_path = dir.join(checkpoint::META_FILE);
        let shard = shard_range(numel, first.world_size, rank);
        let want = shard.start.max(range.start)..shard.end.min(range.end);
        let meta = read_rank_meta(&it_dir, rank, first.world_size)?;
        if want.is_empty() {
            continue;
        }
        let fields = trainer_fields(&meta, &meta_path)?;
        check_same(&meta, &fields, &meta_path)?;
        let model_bytes = read_verified(&dir, &meta, MODEL_FILE)?;
        copy_tensor(
            &dir.join(MODEL_FILE),
            &model_bytes,
            "params",
            &shard,
            want.clone(),
            &mut params,
            range.start,
        )?;
        if let Some((m, v)) = moments.as_mut() {
            let path = dir.join(OPTIM_FILE);
            let optim_bytes = read_verified(&dir, &meta, OPTIM_FILE)?;
            copy_tensor(
                &path,
                &optim_bytes,
                "exp_avg",
                &shard,
                want.clone(),
                m,
                range.start,
            )?;
            copy_tensor(
                &path,
                &optim_bytes,
                "exp_avg_sq",
                &shard,
                want,
                v,
                range.start,
            )?;
        }
    }
    Ok(LoadedShard {
        iteration,
        rng_state: first_fields.rng_state,
        data_position: first_fields.data_position,
        saved_world_size: first.world_size,
        params,
        moments,
        args: first_fields.args,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelSize;
    use hatrain_shared::checkpoint::{begin_save, commit_save, read_tracker, write_rank};
    use proptest::prelude::*;
    use std::fs;

    fn model() -> ModelConfig {
        ModelSize::Tiny.config()
    }

    /// Flat buffers whose values encode their index, so re-slicing errors show.
    fn buffers(seed: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let n = model().numel();
        let p = (0..n).map(|i| i as f32 + seed).collect();
        let m = (0..n).map(|i| -(i as f32) - seed).collect();
        let v = (0..n).map(|i| (i as f32) * 0.5 + seed).collect();
        (p, m, v)
    }

    fn meta_block(step: u64, rng: u64, pos: u64) -> Vec<u8> {
        [step, rng, pos]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()
    }

    fn save_rank(tmp: &Path, iteration: u64, world: usize, rank: usize, seed: f32) {
        let (p, m, v) = buffers(seed);
        let r = shard_range(p.len(), world, rank);
        let save = SaveTo {
            dir: "/unused".into(),
            interval: 0,
        };
        let map = state_map(
            &model(),
            world,
            rank,
            Some(&save),
            serde_json::json!({"seed": 1}),
        );
        let meta = meta_block(iteration, 42 + iteration, iteration * 8);
        let parts: [&[u8]; 4] = [
            &meta,
            bytemuck::cast_slice(&p),
            bytemuck::cast_slice(&m[r.clone()]),
            bytemuck::cast_slice(&v[r]),
        ];
        let views = parts.map(hatrain_shared::statemap::PartView::whole);
        write_rank(tmp, &map, rank, iteration, &views).unwrap();
    }

    fn save(dir: &Path, iteration: u64, world: usize, seed: f32) {
        let tmp = begin_save(dir, iteration).unwrap();
        for rank in 0..world {
            save_rank(&tmp, iteration, world, rank, seed);
        }
        commit_save(dir, iteration, world).unwrap();
    }

    fn load_all(dir: &Path, world: usize) -> Result<Vec<f32>, CheckpointError> {
        let it = read_tracker(dir)?;
        let n = model().numel();
        let mut out = Vec::new();
        for rank in 0..world {
            let l = load_shard(dir, it, &model(), shard_range(n, world, rank), true)?;
            out.extend(l.params);
        }
        Ok(out)
    }

    #[test]
    fn save_and_reslice_at_other_world_sizes() {
        let d = tempfile::tempdir().unwrap();
        save(d.path(), 20, 4, 0.25);
        assert_eq!(read_tracker(d.path()).unwrap(), 20);
        let (p, m, v) = buffers(0.25);
        for world in [1, 2, 3, 4, 7] {
            assert_eq!(load_all(d.path(), world).unwrap(), p, "world {world}");
        }
        let l = load_shard(d.path(), 20, &model(), 100..900, true).unwrap();
        let (lm, lv) = l.moments.unwrap();
        assert_eq!(
            (&l.params[..], &lm[..], &lv[..]),
            (&p[100..900], &m[100..900], &v[100..900])
        );
        assert_eq!(
            (l.rng_state, l.data_position, l.saved_world_size),
            (62, 160, 4)
        );
        assert_eq!(l.args, serde_json::json!({"seed": 1}));
    }

    #[test]
    fn corrupt_files_are_named() {
        let d = tempfile::tempdir().unwrap();
        save(d.path(), 5, 2, 0.0);
        let it = iter_dir(d.path(), 5);

        // A bit flip in the optimizer file of rank 1.
        let optim = rank_dir(&it, 1).join(OPTIM_FILE);
        let mut bytes = fs::read(&optim).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x10;
        fs::write(&optim, &bytes).unwrap();
        let e = load_all(d.path(), 2).unwrap_err().to_string();
        assert!(
            e.contains("rank_00001/optim.safetensors") && e.contains("checksum mismatch"),
            "{e}"
        );
        bytes[mid] ^= 0x10;
        fs::write(&optim, &bytes).unwrap();

        // A truncated model file of rank 0.
        let model_path = rank_dir(&it, 0).join(MODEL_FILE);
        let good = fs::read(&model_path).unwrap();
        fs::write(&model_path, &good[..good.len() - 100]).unwrap();
        let e = load_all(d.path(), 2).unwrap_err().to_string();
        assert!(
            e.contains("rank_00000/model.safetensors") && e.contains("truncated"),
            "{e}"
        );
        fs::write(&model_path, &good).unwrap();

        // A missing rank directory.
        fs::rename(rank_dir(&it, 1), d.path().join("elsewhere")).unwrap();
        let e = load_all(d.path(), 2).unwrap_err().to_string();
        assert!(
            e.contains("rank_00001") && e.contains("rank directory missing"),
            "{e}"
        );
        fs::rename(d.path().join("elsewhere"), rank_dir(&it, 1)).unwrap();

        // Another model shape.
        let other = ModelSize::Small.config();
        let e = load_shard(d.path(), 5, &other, 0..10, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank_00000/meta.json") && e.contains("another model shape"),
            "{e}"
        );

        // A garbled meta.json.
        let meta = rank_dir(&it, 0).join(checkpoint::META_FILE);
        let good_meta = fs::read(&meta).unwrap();
        fs::write(&meta, b"{\"format\": 3").unwrap();
        let e = load_all(d.path(), 2).unwrap_err().to_string();
        assert!(
            e.contains("rank_00000/meta.json") && e.contains("not a valid meta.json"),
            "{e}"
        );
        fs::write(&meta, &good_meta).unwrap();

        assert_eq!(load_all(d.path(), 2).unwrap(), buffers(0.0).0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn any_range_reloads_exactly(start in 0usize..2000, len in 0usize..3000, world in 1usize..6) {
            let d = tempfile::tempdir().unwrap();
            save(d.path(), 1, world, 0.5);
            let n = model().numel();
            let range = start.min(n)..(start + len).min(n);
            let l = load_shard(d.path(), 1, &model(), range.clone(), false).unwrap();
            prop_assert_eq!(&l.params[..], &buffers(0.5).0[range]);
        }

        #[test]
        fn corrupt_model_file_never_panics(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4)) {
            let d = tempfile::tempdir().unwrap();
            save(d.path(), 1, 1, 0.0);
            let path = rank_dir(&iter_dir(d.path(), 1), 0).join(MODEL_FILE);
            let mut bytes = fs::read(&path).unwrap();
            for (at, x) in flips {
                let i = at % bytes.len();
                bytes[i] ^= x | 1;
            }
            fs::write(&path, &bytes).unwrap();
            prop_assert!(load_all(d.path(), 1).is_err());
        }
    }
}
