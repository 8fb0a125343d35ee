//! The on-disk checkpoint format, Megatron-style:
//!
//! ```text
//! <save>/latest_checkpointed_iteration.txt        "500\n"
//! <save>/iter_0000500/rank_00003/model.safetensors  params      f32[len]
//! <save>/iter_0000500/rank_00003/optim.safetensors  exp_avg     f32[len]
//!                                                   exp_avg_sq  f32[len]
//! <save>/iter_0000500/rank_00003/meta.json          Meta (below)
//! ```
//!
//! Each rank writes only its shard: the element range
//! [`shard_range`]`(numel, world, rank)` of the flat parameter buffer and of
//! the two AdamW moments, so a checkpoint holds every byte once and the ranks
//! share the disk bandwidth. `meta.json` names the range, the model shape, the
//! iteration, RNG state and data position, and the size and xxh3-64 of every
//! file beside it; a reader verifies all of them before using a byte.
//!
//! # Atomicity
//!
//! INVARIANT: the tracker file only ever names a complete, fsynced iteration
//! directory. A save goes
//! 1. [`begin_save`]: `iter_XXXXXXX_tmp/` is (re)created empty;
//! 2. [`write_shard`] per rank: data files, then `meta.json` last, each
//!    fsynced, so a rank directory with a `meta.json` is complete;
//! 3. [`commit_save`]: every rank's `meta.json` is checked, the directory is
//!    fsynced and renamed to `iter_XXXXXXX/`, the parent fsynced, and only
//!    then the tracker is replaced by write-to-temp, fsync, rename.
//!
//! A save killed or failing (disk full) at any point before the tracker's
//! rename leaves the previous checkpoint and the tracker as they were.
//!
//! A reader ([`load_shard`]) may ask for any element range, so a checkpoint
//! saved by `W` ranks loads at any other world size.

use crate::model::{ModelConfig, shard_range};
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Name of the file that records the newest complete iteration.
pub const TRACKER_FILE: &str = "latest_checkpointed_iteration.txt";
/// `format` field of every `meta.json`.
pub const FORMAT: &str = "hatrain-checkpoint";
/// Format version this build writes; it reads `major == 1, minor <= 0`.
pub const VERSION: (u16, u16) = (1, 0);

pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIM_FILE: &str = "optim.safetensors";
pub const META_FILE: &str = "meta.json";

/// A meta.json larger than this is refused before it is parsed.
const MAX_META_BYTES: u64 = 1 << 20;

/// Size and digest of one data file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileDigest {
    pub bytes: u64,
    /// xxh3-64 of the whole file, as 16 lowercase hex digits.
    pub xxh3: String,
}

/// Contents of one rank's `meta.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Meta {
    pub format: String,
    pub version: (u16, u16),
    /// Number of completed training steps.
    pub iteration: u64,
    pub world_size: usize,
    pub rank: usize,
    /// This rank's element range of the flat buffers.
    pub shard: Range<usize>,
    /// Elements in the whole flat buffer.
    pub numel: usize,
    pub model: ModelConfig,
    /// State of the data sampler's RNG after `iteration` steps.
    pub rng_state: u64,
    /// Training sequences consumed so far.
    pub data_position: u64,
    pub files: BTreeMap<String, FileDigest>,
    /// The training arguments, for the record.
    pub args: serde_json::Value,
}

/// What one rank contributes to a checkpoint (everything but the digests,
/// which the writer computes).
#[derive(Debug, Clone)]
pub struct ShardHeader {
    pub iteration: u64,
    pub world_size: usize,
    pub rank: usize,
    pub model: ModelConfig,
    pub rng_state: u64,
    pub data_position: u64,
    pub args: serde_json::Value,
}

/// The rank's slices of the flat buffers.
#[derive(Debug, Clone, Copy)]
pub struct ShardData<'a> {
    pub params: &'a [f32],
    pub exp_avg: &'a [f32],
    pub exp_avg_sq: &'a [f32],
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

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: no checkpoint tracker here (is this a checkpoint directory?)")]
    NoTracker { path: PathBuf },
    #[error("{path}: tracker file is garbled: expected an iteration number, found {content:?}")]
    GarbledTracker { path: PathBuf, content: String },
    #[error("{path}: the tracker names iteration {iteration}, but its directory is missing")]
    MissingIteration { path: PathBuf, iteration: u64 },
    #[error("{path}: rank directory missing (the checkpoint was saved by {world_size} ranks)")]
    MissingRank { path: PathBuf, world_size: usize },
    #[error("{path}: not a valid meta.json: {detail}")]
    BadMeta { path: PathBuf, detail: String },
    #[error(
        "{path}: file is truncated or resized: meta.json records {expected} bytes, found {found}"
    )]
    SizeMismatch {
        path: PathBuf,
        expected: u64,
        found: u64,
    },
    #[error(
        "{path}: checksum mismatch (xxh3 {found}, meta.json records {expected}): the file is corrupt"
    )]
    ChecksumMismatch {
        path: PathBuf,
        expected: String,
        found: String,
    },
    #[error("{path}: not a valid safetensors file: {detail}")]
    BadTensorFile { path: PathBuf, detail: String },
    #[error("{path}: checkpoint is of another model shape: saved {saved}, this run has {ours}")]
    ModelMismatch {
        path: PathBuf,
        saved: String,
        ours: String,
    },
    #[error("{path}: save of iteration {iteration} is incomplete: {detail}")]
    Incomplete {
        path: PathBuf,
        iteration: u64,
        detail: String,
    },
    #[error("requested range {start}..{end} lies outside the {numel} parameters of the model")]
    RangeOutOfBounds {
        start: usize,
        end: usize,
        numel: usize,
    },
}

type Result<T> = std::result::Result<T, CheckpointError>;

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub fn iter_dir(save: &Path, iteration: u64) -> PathBuf {
    save.join(format!("iter_{iteration:07}"))
}

pub fn tmp_iter_dir(save: &Path, iteration: u64) -> PathBuf {
    save.join(format!("iter_{iteration:07}_tmp"))
}

pub fn rank_dir(iter_dir: &Path, rank: usize) -> PathBuf {
    iter_dir.join(format!("rank_{rank:05}"))
}

/// xxh3-64 as 16 hex digits.
pub fn digest_hex(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

fn fsync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(io_err(path))
}

/// Creates (or truncates) `path` for writing.
fn create(path: &Path) -> Result<File> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(io_err(path))
}

/// Writes `bytes` to `path` and fsyncs the file.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = create(path)?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(io_err(path))
}

/// Step 1 of a save: creates an empty `iter_XXXXXXX_tmp/` (removing what a
/// killed earlier save left there). Run by one rank before any rank writes.
pub fn begin_save(save: &Path, iteration: u64) -> Result<PathBuf> {
    fs::create_dir_all(save).map_err(io_err(save))?;
    let tmp = tmp_iter_dir(save, iteration);
    match fs::remove_dir_all(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&tmp)(e)),
    }
    fs::create_dir(&tmp).map_err(io_err(&tmp))?;
    Ok(tmp)
}

/// Bytes hashed and written per piece: small enough to stay in cache
/// between the hash and the write, so the data is read from memory once.
const WRITE_PIECE: usize = 1 << 20;

/// Writes a safetensors file of `F32[len]` tensors straight from the slices
/// (no serialised copy of the data), hashing in the same pass, and fsyncs
/// it. Returns its size and digest.
fn write_tensor_file(path: &Path, tensors: &[(&str, &[f32])]) -> Result<FileDigest> {
    let bad = |detail: String| CheckpointError::BadTensorFile {
        path: path.to_path_buf(),
        detail,
    };
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0;
    for (name, data) in tensors {
        let len = data.len() * 4;
        infos.push((
            name.to_string(),
            TensorInfo {
                dtype: Dtype::F32,
                shape: vec![data.len()],
                data_offsets: (offset, offset + len),
            },
        ));
        offset += len;
    }
    let meta = Metadata::new(None, infos).map_err(|e| bad(e.to_string()))?;
    let mut header = serde_json::to_vec(&meta).map_err(|e| bad(e.to_string()))?;
    // The safetensors format pads the header with spaces to 8-byte alignment.
    header.resize(header.len().next_multiple_of(8), b' ');
    let header_len = (header.len() as u64).to_le_bytes();

    let mut f = create(path)?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut put = |bytes: &[u8]| -> Result<()> {
        hasher.update(bytes);
        f.write_all(bytes).map_err(io_err(path))
    };
    put(&header_len)?;
    put(&header)?;
    for (_, data) in tensors {
        for piece in bytemuck::cast_slice::<f32, u8>(data).chunks(WRITE_PIECE) {
            put(piece)?;
        }
    }
    f.sync_all().map_err(io_err(path))?;
    Ok(FileDigest {
        bytes: (8 + header.len() + offset) as u64,
        xxh3: format!("{:016x}", hasher.digest()),
    })
}

/// Step 2 of a save: writes one rank's shard into the `_tmp` directory that
/// [`begin_save`] made. `meta.json` is written last, so its presence marks a
/// complete rank directory.
pub fn write_shard(tmp_dir: &Path, header: &ShardHeader, data: ShardData<'_>) -> Result<()> {
    let numel = header.model.numel();
    let shard = shard_range(numel, header.world_size, header.rank);
    let dir = rank_dir(tmp_dir, header.rank);
    for (what, len) in [
        ("params", data.params.len()),
        ("exp_avg", data.exp_avg.len()),
        ("exp_avg_sq", data.exp_avg_sq.len()),
    ] {
        if len != shard.len() {
            return Err(CheckpointError::Incomplete {
                path: dir,
                iteration: header.iteration,
                detail: format!("{what} holds {len} elements, the shard has {}", shard.len()),
            });
        }
    }
    fs::create_dir_all(&dir).map_err(io_err(&dir))?;

    let mut files = BTreeMap::new();
    for (file, tensors) in [
        (MODEL_FILE, vec![("params", data.params)]),
        (
            OPTIM_FILE,
            vec![("exp_avg", data.exp_avg), ("exp_avg_sq", data.exp_avg_sq)],
        ),
    ] {
        let digest = write_tensor_file(&dir.join(file), &tensors)?;
        files.insert(file.to_string(), digest);
    }
    let meta = Meta {
        format: FORMAT.to_string(),
        version: VERSION,
        iteration: header.iteration,
        world_size: header.world_size,
        rank: header.rank,
        shard,
        numel,
        model: header.model,
        rng_state: header.rng_state,
        data_position: header.data_position,
        files,
        args: header.args.clone(),
    };
    let path = dir.join(META_FILE);
    let json = serde_json::to_vec_pretty(&meta).map_err(|e| CheckpointError::BadMeta {
        path: path.clone(),
        detail: e.to_string(),
    })?;
    write_synced(&path, &json)?;
    fsync_dir(&dir)
}

/// Step 3 of a save: checks that all `world_size` ranks wrote their shard,
/// publishes the directory and then the tracker. Run by one rank after all
/// ranks finished [`write_shard`].
pub fn commit_save(save: &Path, iteration: u64, world_size: usize) -> Result<PathBuf> {
    let tmp = tmp_iter_dir(save, iteration);
    for rank in 0..world_size {
        let meta_path = rank_dir(&tmp, rank).join(META_FILE);
        let meta = read_meta(&meta_path).map_err(|e| CheckpointError::Incomplete {
            path: tmp.clone(),
            iteration,
            detail: format!("rank {rank}: {e}"),
        })?;
        if meta.iteration != iteration || meta.world_size != world_size {
            return Err(CheckpointError::Incomplete {
                path: tmp.clone(),
                iteration,
                detail: format!(
                    "rank {rank} wrote iteration {} of a {}-rank job",
                    meta.iteration, meta.world_size
                ),
            });
        }
        fsync_dir(&rank_dir(&tmp, rank))?;
    }
    fsync_dir(&tmp)?;

    let fin = iter_dir(save, iteration);
    // A directory for this iteration from an earlier run is moved aside, not
    // deleted, until the new one is in place.
    let aside = save.join(format!("iter_{iteration:07}_old"));
    let had_old = fin.exists();
    if had_old {
        let _ = fs::remove_dir_all(&aside);
        fs::rename(&fin, &aside).map_err(io_err(&fin))?;
    }
    fs::rename(&tmp, &fin).map_err(io_err(&tmp))?;
    fsync_dir(save)?;

    let tracker = save.join(TRACKER_FILE);
    let tracker_tmp = save.join(format!("{TRACKER_FILE}.tmp"));
    write_synced(&tracker_tmp, format!("{iteration}\n").as_bytes())?;
    fs::rename(&tracker_tmp, &tracker).map_err(io_err(&tracker))?;
    fsync_dir(save)?;
    if had_old {
        fs::remove_dir_all(&aside).map_err(io_err(&aside))?;
    }
    Ok(fin)
}

/// Reads the iteration the tracker file names.
pub fn read_tracker(load: &Path) -> Result<u64> {
    let path = load.join(TRACKER_FILE);
    let content = match fs::read(&path) {
        Ok(c) => c,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(CheckpointError::NoTracker { path });
        }
        Err(e) => return Err(io_err(&path)(e)),
    };
    let text = String::from_utf8_lossy(&content);
    text.trim()
        .parse::<u64>()
        .map_err(|_| CheckpointError::GarbledTracker {
            path,
            content: text.chars().take(64).collect(),
        })
}

/// Reads and validates one `meta.json`.
pub fn read_meta(path: &Path) -> Result<Meta> {
    let bad = |detail: String| CheckpointError::BadMeta {
        path: path.to_path_buf(),
        detail,
    };
    let len = fs::metadata(path).map_err(io_err(path))?.len();
    if len > MAX_META_BYTES {
        return Err(bad(format!(
            "{len} bytes, more than the {MAX_META_BYTES} allowed"
        )));
    }
    let bytes = fs::read(path).map_err(io_err(path))?;
    let meta: Meta = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
    if meta.format != FORMAT {
        return Err(bad(format!(
            "format is {:?}, expected {FORMAT:?}",
            meta.format
        )));
    }
    if meta.version.0 != VERSION.0 || meta.version.1 > VERSION.1 {
        return Err(bad(format!(
            "format version {}.{} is not readable by this build ({}.{})",
            meta.version.0, meta.version.1, VERSION.0, VERSION.1
        )));
    }
    if meta.world_size == 0 || meta.rank >= meta.world_size {
        return Err(bad(format!(
            "rank {} of world size {} is impossible",
            meta.rank, meta.world_size
        )));
    }
    if meta.model.validate().is_err() || meta.model.numel() != meta.numel {
        return Err(bad(format!(
            "numel {} does not match its model shape {:?}",
            meta.numel, meta.model
        )));
    }
    if meta.shard != shard_range(meta.numel, meta.world_size, meta.rank) {
        return Err(bad(format!(
            "shard {:?} is not rank {}'s range of {} elements over {} ranks",
            meta.shard, meta.rank, meta.numel, meta.world_size
        )));
    }
    Ok(meta)
}

/// Reads a data file, checking its size and digest against `meta.json`.
fn read_verified(dir: &Path, meta: &Meta, file: &str) -> Result<Vec<u8>> {
    let path = dir.join(file);
    let digest = meta
        .files
        .get(file)
        .ok_or_else(|| CheckpointError::BadMeta {
            path: dir.join(META_FILE),
            detail: format!("no digest recorded for {file}"),
        })?;
    let bytes = fs::read(&path).map_err(io_err(&path))?;
    if bytes.len() as u64 != digest.bytes {
        return Err(CheckpointError::SizeMismatch {
            path,
            expected: digest.bytes,
            found: bytes.len() as u64,
        });
    }
    let found = digest_hex(&bytes);
    if found != digest.xxh3 {
        return Err(CheckpointError::ChecksumMismatch {
            path,
            expected: digest.xxh3.clone(),
            found,
        });
    }
    Ok(bytes)
}

/// Copies elements `want` (flat-buffer indices) of tensor `name` out of a
/// verified safetensors file holding the shard `shard`, into `out`, whose
/// first element is flat index `out_start`.
fn copy_tensor(
    path: &Path,
    bytes: &[u8],
    name: &str,
    shard: &Range<usize>,
    want: Range<usize>,
    out: &mut [f32],
    out_start: usize,
) -> Result<()> {
    let bad = |detail: String| CheckpointError::BadTensorFile {
        path: path.to_path_buf(),
        detail,
    };
    let st = SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
    let t = st
        .tensor(name)
        .map_err(|e| bad(format!("tensor {name:?}: {e}")))?;
    if t.dtype() != Dtype::F32 || t.shape() != [shard.len()] {
        return Err(bad(format!(
            "tensor {name:?} is {:?}{:?}, expected F32[{}]",
            t.dtype(),
            t.shape(),
            shard.len()
        )));
    }
    let src = &t.data()[(want.start - shard.start) * 4..(want.end - shard.start) * 4];
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
) -> Result<LoadedShard> {
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
    let first_path = rank_dir(&it_dir, 0).join(META_FILE);
    if !first_path.exists() {
        return Err(CheckpointError::MissingRank {
            path: rank_dir(&it_dir, 0),
            world_size: 0,
        });
    }
    let first = read_meta(&first_path)?;
    let check_same = |meta: &Meta, path: &Path| -> Result<()> {
        if meta.model != *model {
            return Err(CheckpointError::ModelMismatch {
                path: path.to_path_buf(),
                saved: format!("{:?} ({} parameters)", meta.model, meta.numel),
                ours: format!("{model:?} ({numel} parameters)"),
            });
        }
        if meta.iteration != iteration
            || meta.world_size != first.world_size
            || meta.rng_state != first.rng_state
            || meta.data_position != first.data_position
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
    check_same(&first, &first_path)?;

    let mut params = vec![0f32; range.len()];
    let mut moments = with_moments.then(|| (vec![0f32; range.len()], vec![0f32; range.len()]));
    for rank in 0..first.world_size {
        let dir = rank_dir(&it_dir, rank);
        let meta_path = dir.join(META_FILE);
        if !meta_path.exists() {
            return Err(CheckpointError::MissingRank {
                path: dir,
                world_size: first.world_size,
            });
        }
        let shard = shard_range(numel, first.world_size, rank);
        let want = shard.start.max(range.start)..shard.end.min(range.end);
        if want.is_empty() {
            continue;
        }
        let meta = read_meta(&meta_path)?;
        check_same(&meta, &meta_path)?;
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
        rng_state: first.rng_state,
        data_position: first.data_position,
        saved_world_size: first.world_size,
        params,
        moments,
        args: first.args,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelSize;
    use proptest::prelude::*;

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

    fn save(dir: &Path, iteration: u64, world: usize, seed: f32) {
        let (p, m, v) = buffers(seed);
        let tmp = begin_save(dir, iteration).unwrap();
        for rank in 0..world {
            let r = shard_range(p.len(), world, rank);
            let header = ShardHeader {
                iteration,
                world_size: world,
                rank,
                model: model(),
                rng_state: 42 + iteration,
                data_position: iteration * 8,
                args: serde_json::json!({"seed": 1}),
            };
            let data = ShardData {
                params: &p[r.clone()],
                exp_avg: &m[r.clone()],
                exp_avg_sq: &v[r],
            };
            write_shard(&tmp, &header, data).unwrap();
        }
        commit_save(dir, iteration, world).unwrap();
    }

    fn load_all(dir: &Path, world: usize) -> Result<Vec<f32>> {
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
    }

    #[test]
    fn resave_of_same_iteration_replaces_it() {
        let d = tempfile::tempdir().unwrap();
        save(d.path(), 10, 2, 1.0);
        save(d.path(), 10, 3, 2.0);
        assert_eq!(load_all(d.path(), 2).unwrap(), buffers(2.0).0);
        assert!(!d.path().join("iter_0000010_old").exists());
    }

    #[test]
    fn tracker_errors_name_the_file() {
        let d = tempfile::tempdir().unwrap();
        let e = read_tracker(d.path()).unwrap_err().to_string();
        assert!(
            e.contains(TRACKER_FILE) && e.contains("no checkpoint tracker"),
            "{e}"
        );
        fs::write(d.path().join(TRACKER_FILE), "fifty\n").unwrap();
        let e = read_tracker(d.path()).unwrap_err().to_string();
        assert!(
            e.contains(TRACKER_FILE) && e.contains("garbled") && e.contains("fifty"),
            "{e}"
        );
        fs::write(d.path().join(TRACKER_FILE), "50\n").unwrap();
        let e = load_all(d.path(), 1).unwrap_err().to_string();
        assert!(e.contains("iter_0000050") && e.contains("missing"), "{e}");
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
        let meta = rank_dir(&it, 0).join(META_FILE);
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

    #[test]
    fn a_failed_save_leaves_the_previous_checkpoint() {
        let d = tempfile::tempdir().unwrap();
        save(d.path(), 10, 2, 3.0);
        // The save of iteration 20 dies after rank 0 wrote its shard.
        let tmp = begin_save(d.path(), 20).unwrap();
        let (p, m, v) = buffers(9.0);
        let r = shard_range(p.len(), 2, 0);
        let header = ShardHeader {
            iteration: 20,
            world_size: 2,
            rank: 0,
            model: model(),
            rng_state: 0,
            data_position: 0,
            args: serde_json::Value::Null,
        };
        let data = ShardData {
            params: &p[r.clone()],
            exp_avg: &m[r.clone()],
            exp_avg_sq: &v[r],
        };
        write_shard(&tmp, &header, data).unwrap();
        let e = commit_save(d.path(), 20, 2).unwrap_err().to_string();
        assert!(e.contains("incomplete") && e.contains("rank 1"), "{e}");
        assert_eq!(read_tracker(d.path()).unwrap(), 10);
        assert_eq!(load_all(d.path(), 2).unwrap(), buffers(3.0).0);
        // The next attempt starts from a clean directory and succeeds.
        save(d.path(), 20, 2, 9.0);
        assert_eq!(load_all(d.path(), 1).unwrap(), buffers(9.0).0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn meta_parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let d = tempfile::tempdir().unwrap();
            let p = d.path().join(META_FILE);
            fs::write(&p, &bytes).unwrap();
            prop_assert!(read_meta(&p).is_err());
        }

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
