//! The on-disk checkpoint format, Megatron-style:
//!
//! ```text
//! <save>/latest_checkpointed_iteration.txt        "500\n"
//! <save>/iter_0000500/rank_00003/<file>            safetensors, one tensor
//!                                                  per slice of a state part
//! <save>/iter_0000500/rank_00003/meta.json         RankMeta (below)
//! ```
//!
//! What each rank directory holds is given by the rank's
//! [`StateMap`](crate::statemap::StateMap): its files, the tensors in each
//! (a slice of a snapshot part), and the named fields of `meta.json`. Every
//! `meta.json` starts with `format`, `version`, `iteration`, `world_size` and
//! `rank`, then the map's fields in order, then `files`: the size and xxh3-64
//! of every file beside it. A reader verifies a file's size and digest
//! before using a byte of it. The trainer and the agent write checkpoints
//! with the same function, [`write_rank`], so what the agent writes from a
//! snapshot is byte for byte what the trainer would have written.
//!
//! # Atomicity
//!
//! INVARIANT: the tracker file only ever names a complete, fsynced iteration
//! directory. A save goes
//! 1. [`begin_save`]: `iter_XXXXXXX_tmp/` is (re)created empty;
//! 2. [`write_rank`] per rank: data files, then `meta.json` last, each
//!    fsynced, so a rank directory with a `meta.json` is complete;
//! 3. [`commit_save`]: every rank's `meta.json` is checked, the directory is
//!    fsynced and renamed to `iter_XXXXXXX/`, the parent fsynced, and only
//!    then the tracker is replaced by write-to-temp, fsync, rename.
//!
//! A save killed or failing (disk full) at any point before the tracker's
//! rename leaves the previous checkpoint and the tracker as they were.
//!
//! # Reading untrusted files
//!
//! A checkpoint directory is input: every file is opened without blocking
//! (a FIFO in place of a file must not hang the reader), checked to be a
//! regular file, and bounded in size before it is read; a path that is
//! missing, a symlink loop or of another kind is an error naming it.

use crate::statemap::{PartView, StateMap};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Name of the file that records the newest complete iteration.
pub const TRACKER_FILE: &str = "latest_checkpointed_iteration.txt";
/// `format` field of every `meta.json`.
pub const FORMAT: &str = "hatrain-checkpoint";
/// Format version this build writes; it reads `major == 1, minor <= 0`.
pub const VERSION: (u16, u16) = (1, 0);
pub const META_FILE: &str = "meta.json";

/// A meta.json or tracker larger than this is refused before it is parsed.
const MAX_META_BYTES: u64 = 1 << 20;

/// Size and digest of one data file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileDigest {
    pub bytes: u64,
    /// xxh3-64 of the whole file, as 16 lowercase hex digits.
    pub xxh3: String,
}

/// Contents of one rank's `meta.json`: the fixed fields, and the fields its
/// state map named (in `fields`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankMeta {
    pub format: String,
    pub version: (u16, u16),
    /// Number of completed training steps.
    pub iteration: u64,
    pub world_size: usize,
    pub rank: usize,
    pub files: BTreeMap<String, FileDigest>,
    /// The state map's fields.
    #[serde(flatten)]
    pub fields: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: is a {kind}, not a regular file")]
    NotAFile { path: PathBuf, kind: &'static str },
    #[error("{path}: {len} bytes, more than the {max} allowed for this file")]
    TooLarge { path: PathBuf, len: u64, max: u64 },
    #[error("{path}: no checkpoint tracker here (is this a checkpoint directory?)")]
    NoTracker { path: PathBuf },
    #[error("{path}: tracker file is garbled: expected an iteration number, found {content:?}")]
    GarbledTracker { path: PathBuf, content: String },
    #[error("{path}: the tracker names iteration {iteration}, but its directory is missing")]
    MissingIteration { path: PathBuf, iteration: u64 },
    #[error("{path}: rank directory missing (the checkpoint was saved by {world_size} ranks)")]
    MissingRank { path: PathBuf, world_size: usize },
    #[error("{path}: file missing")]
    MissingFile { path: PathBuf },
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
    #[error("{0}")]
    Map(#[from] crate::statemap::StateMapError),
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
    format!("{:016x}", twox_hash::XxHash3_64::oneshot(bytes))
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

/// What kind of file `t` is, for messages.
fn kind_of(t: fs::FileType) -> &'static str {
    if t.is_dir() {
        "directory"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_socket() {
        "socket"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_symlink() {
        "symbolic link"
    } else {
        "special file"
    }
}

/// Opens `path` for reading only if it is (or a symlink resolves to) a
/// regular file of at most `max` bytes; never blocks on a FIFO. Returns the
/// file and its length.
pub fn open_regular(path: &Path, max: u64) -> Result<(File, u64)> {
    let file = OpenOptions::new()
        .read(true)
        // A FIFO opened for reading blocks until a writer appears, unless
        // O_NONBLOCK (fifo(7)); for a regular file the flag changes nothing.
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => CheckpointError::MissingFile {
                path: path.to_path_buf(),
            },
            _ => io_err(path)(e),
        })?;
    let meta = file.metadata().map_err(io_err(path))?;
    if !meta.file_type().is_file() {
        return Err(CheckpointError::NotAFile {
            path: path.to_path_buf(),
            kind: kind_of(meta.file_type()),
        });
    }
    if meta.len() > max {
        return Err(CheckpointError::TooLarge {
            path: path.to_path_buf(),
            len: meta.len(),
            max,
        });
    }
    Ok((file, meta.len()))
}

/// Reads a whole regular file of at most `max` bytes (see [`open_regular`]).
pub fn read_regular(path: &Path, max: u64) -> Result<Vec<u8>> {
    let (mut f, len) = open_regular(path, max)?;
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    // Bounded even if the file grows while it is read.
    Read::by_ref(&mut f)
        .take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io_err(path))?;
    if bytes.len() as u64 > max {
        return Err(CheckpointError::TooLarge {
            path: path.to_path_buf(),
            len: bytes.len() as u64,
            max,
        });
    }
    Ok(bytes)
}

/// Whether anything at all (even a dangling symlink) is at `path`.
fn present(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok()
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

/// One tensor to write: name, dtype, shape, where it lies in the tensor it
/// is a shard of (if it is one), and its bytes.
struct TensorBytes<'a> {
    name: &'a str,
    dtype: crate::statemap::Dtype,
    shape: Vec<u64>,
    offsets: Option<&'a [u64]>,
    bytes: &'a [u8],
}

/// The safetensors metadata key under which `torch.distributed.checkpoint`
/// reads each tensor's place in the whole (`saved_offsets`).
pub const DCP_SHARDING_INFO: &str = "DCP_SHARDING_INFO";

/// Writes a safetensors file straight from the slices (no serialised copy
/// of the data), hashing in the same pass, and fsyncs it. When a tensor is
/// a shard, the file's metadata gives every tensor's offsets
/// ([`DCP_SHARDING_INFO`]). Returns its size and digest.
fn write_tensor_file(path: &Path, tensors: &[TensorBytes<'_>]) -> Result<FileDigest> {
    use safetensors::tensor::{Metadata, TensorInfo};
    let bad = |detail: String| CheckpointError::BadTensorFile {
        path: path.to_path_buf(),
        detail,
    };
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0;
    for t in tensors {
        infos.push((
            t.name.to_string(),
            TensorInfo {
                dtype: t.dtype.safetensors(),
                shape: t.shape.iter().map(|&d| d as usize).collect(),
                data_offsets: (offset, offset + t.bytes.len()),
            },
        ));
        offset += t.bytes.len();
    }
    let sharding = tensors.iter().any(|t| t.offsets.is_some()).then(|| {
        let info: serde_json::Map<String, serde_json::Value> = tensors
            .iter()
            .map(|t| {
                let at = t
                    .offsets
                    .map_or_else(|| vec![0; t.shape.len()], <[u64]>::to_vec);
                (
                    t.name.to_string(),
                    serde_json::json!({ "saved_offsets": at }),
                )
            })
            .collect();
        std::collections::HashMap::from([(
            DCP_SHARDING_INFO.to_string(),
            serde_json::Value::Object(info).to_string(),
        )])
    });
    let meta = Metadata::new(sharding, infos).map_err(|e| bad(e.to_string()))?;
    let mut header = serde_json::to_vec(&meta).map_err(|e| bad(e.to_string()))?;
    // The safetensors format pads the header with spaces to 8-byte alignment.
    header.resize(header.len().next_multiple_of(8), b' ');
    let header_len = (header.len() as u64).to_le_bytes();

    let mut f = create(path)?;
    let mut hasher = twox_hash::XxHash3_64::new();
    let mut put = |bytes: &[u8]| -> Result<()> {
        std::hash::Hasher::write(&mut hasher, bytes);
        f.write_all(bytes).map_err(io_err(path))
    };
    put(&header_len)?;
    put(&header)?;
    for t in tensors {
        for piece in t.bytes.chunks(WRITE_PIECE) {
            put(piece)?;
        }
    }
    f.sync_all().map_err(io_err(path))?;
    Ok(FileDigest {
        bytes: (8 + header.len() + offset) as u64,
        xxh3: format!("{:016x}", std::hash::Hasher::finish(&hasher)),
    })
}

/// A JSON object written with its keys in the given order.
struct Ordered<'a>(Vec<(&'a str, serde_json::Value)>);

impl Serialize for Ordered<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// Step 2 of a save: writes rank `rank`'s directory of iteration
/// `iteration` into the `_tmp` directory that [`begin_save`] made, from the
/// bytes of each part of its state (`parts[i]` is part `i` of `map`, whole
/// or the elements its view holds: every tensor and field must lie in it).
/// `meta.json` is written last, so its presence marks a complete rank
/// directory.
pub fn write_rank(
    tmp_dir: &Path,
    map: &StateMap,
    rank: usize,
    iteration: u64,
    parts: &[PartView<'_>],
) -> Result<()> {
    map.validate()?;
    let dir = rank_dir(tmp_dir, rank);
    let incomplete = |detail: String| CheckpointError::Incomplete {
        path: dir.clone(),
        iteration,
        detail,
    };
    let Some(ck) = &map.checkpoint else {
        return Err(incomplete("the state map has no checkpoint layout".into()));
    };
    if rank >= ck.world_size {
        return Err(incomplete(format!(
            "rank {rank} is outside the checkpoint's {} ranks",
            ck.world_size
        )));
    }
    if parts.len() != map.parts.len() {
        return Err(incomplete(format!(
            "{} parts given, the state map has {}",
            parts.len(),
            map.parts.len()
        )));
    }
    for (p, v) in map.parts.iter().zip(parts) {
        let size = p.dtype.size() as u64;
        let fits = (v.bytes.len() as u64).is_multiple_of(size)
            && v.first
                .checked_add(v.bytes.len() as u64 / size)
                .is_some_and(|end| end <= p.len);
        if !fits {
            return Err(incomplete(format!(
                "part {:?} is given {} bytes from element {}, beyond its {} elements",
                p.name,
                v.bytes.len(),
                v.first,
                p.len
            )));
        }
    }
    // Every tensor must lie in what its part's view holds.
    let mut tensor_views = Vec::new();
    for f in &ck.files {
        let mut views = Vec::new();
        for t in &f.tensors {
            let (dtype, v) = (map.parts[t.part].dtype, parts[t.part]);
            let size = dtype.size() as u64;
            let held = v.first..v.first + v.bytes.len() as u64 / size;
            if t.range.start < held.start || t.range.end > held.end {
                return Err(incomplete(format!(
                    "tensor {:?} needs elements {:?} of part {:?}, but only {held:?} were given",
                    t.name, t.range, map.parts[t.part].name
                )));
            }
            let r = ((t.range.start - held.start) * size) as usize
                ..((t.range.end - held.start) * size) as usize;
            views.push(TensorBytes {
                name: &t.name,
                dtype,
                shape: t.dims(),
                offsets: t.offsets.as_deref(),
                bytes: &v.bytes[r],
            });
        }
        tensor_views.push(views);
    }
    fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let mut files = BTreeMap::new();
    for (f, tensors) in ck.files.iter().zip(tensor_views) {
        files.insert(
            f.name.clone(),
            write_tensor_file(&dir.join(&f.name), &tensors)?,
        );
    }
    let mut obj = vec![
        ("format", serde_json::json!(FORMAT)),
        ("version", serde_json::json!(VERSION)),
        ("iteration", serde_json::json!(iteration)),
        ("world_size", serde_json::json!(ck.world_size)),
        ("rank", serde_json::json!(rank)),
    ];
    for m in &ck.fields {
        let value = map.field(&m.value, parts).ok_or_else(|| {
            incomplete(format!(
                "field {:?} reads bytes its part's view does not hold",
                m.name
            ))
        })?;
        obj.push((&m.name, value));
    }
    let path = dir.join(META_FILE);
    let json_err = |e: serde_json::Error| CheckpointError::BadMeta {
        path: path.clone(),
        detail: e.to_string(),
    };
    obj.push(("files", serde_json::to_value(&files).map_err(json_err)?));
    let json = serde_json::to_vec_pretty(&Ordered(obj)).map_err(json_err)?;
    write_synced(&path, &json)?;
    fsync_dir(&dir)?;
    if let Some(linked) = &ck.linked {
        link_rank(
            &dir,
            &tmp_dir.join(linked),
            rank,
            ck.files.iter().map(|f| f.name.as_str()),
        )?;
    }
    Ok(())
}

/// Links rank `rank`'s files (in `dir`) and its `meta.json` into `linked`,
/// each as `rank_NNNNN-<name>`, and fsyncs that folder.
fn link_rank<'a>(
    dir: &Path,
    linked: &Path,
    rank: usize,
    files: impl Iterator<Item = &'a str>,
) -> Result<()> {
    fs::create_dir_all(linked).map_err(io_err(linked))?;
    for name in files.chain([META_FILE]) {
        let to = linked.join(format!("rank_{rank:05}-{name}"));
        match fs::remove_file(&to) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&to)(e)),
        }
        fs::hard_link(dir.join(name), &to).map_err(io_err(&to))?;
    }
    fsync_dir(linked)
}

/// Step 3 of a save: checks that all `world_size` ranks wrote their shard,
/// publishes the directory and then the tracker. Run by one rank after all
/// ranks finished [`write_rank`].
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
    let had_old = present(&fin);
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
    let content = match read_regular(&path, MAX_META_BYTES) {
        Ok(c) => c,
        Err(CheckpointError::MissingFile { path }) => {
            return Err(CheckpointError::NoTracker { path });
        }
        Err(e) => return Err(e),
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
pub fn read_meta(path: &Path) -> Result<RankMeta> {
    let bad = |detail: String| CheckpointError::BadMeta {
        path: path.to_path_buf(),
        detail,
    };
    let bytes = read_regular(path, MAX_META_BYTES)?;
    let meta: RankMeta = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
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
    Ok(meta)
}

/// The `meta.json` of `rank` in iteration directory `it_dir`, telling a
/// missing rank directory from a missing or unreadable file.
pub fn read_rank_meta(it_dir: &Path, rank: usize, world_size: usize) -> Result<RankMeta> {
    let dir = rank_dir(it_dir, rank);
    let path = dir.join(META_FILE);
    if !present(&dir) {
        return Err(CheckpointError::MissingRank {
            path: dir,
            world_size,
        });
    }
    read_meta(&path)
}

/// Reads a data file of a rank directory, checking its size and digest
/// against `meta.json`.
pub fn read_verified(dir: &Path, meta: &RankMeta, file: &str) -> Result<Vec<u8>> {
    let path = dir.join(file);
    let digest = meta
        .files
        .get(file)
        .ok_or_else(|| CheckpointError::BadMeta {
            path: dir.join(META_FILE),
            detail: format!("no digest recorded for {file}"),
        })?;
    // A little slack, so that a grown file is reported as resized.
    let bytes = read_regular(&path, digest.bytes.saturating_add(1)).map_err(|e| match e {
        CheckpointError::TooLarge { path, len, .. } => CheckpointError::SizeMismatch {
            path,
            expected: digest.bytes,
            found: len,
        },
        other => other,
    })?;
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

/// The bytes of tensor `name` of `len` elements of `dtype` in a verified
/// safetensors file.
pub fn tensor_bytes<'a>(
    path: &Path,
    bytes: &'a [u8],
    name: &str,
    dtype: crate::statemap::Dtype,
    len: usize,
) -> Result<&'a [u8]> {
    let bad = |detail: String| CheckpointError::BadTensorFile {
        path: path.to_path_buf(),
        detail,
    };
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
    let t = st
        .tensor(name)
        .map_err(|e| bad(format!("tensor {name:?}: {e}")))?;
    // Any shape of `len` elements (a tensor is written with its own).
    let elements = t.shape().iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    if t.dtype() != dtype.safetensors() || elements != Some(len) {
        return Err(bad(format!(
            "tensor {name:?} is {:?}{:?}, expected {dtype:?} of {len} elements",
            t.dtype(),
            t.shape(),
        )));
    }
    Ok(t.data())
}

#[cfg(test)]
mod tests;
