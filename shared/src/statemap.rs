//! The state map: a self-describing account of what a rank's snapshot holds,
//! sent by the worker when it registers.
//!
//! A snapshot is the concatenation of the map's [`Part`]s, in order, each
//! `len` elements of its [`Dtype`]. With a [`CheckpointMap`] the map also says
//! how a snapshot becomes a checkpoint rank directory (the format of
//! [`crate::checkpoint`]): which slice of which part goes into which tensor of
//! which file, and which named fields `meta.json` carries, each either a
//! constant JSON value or a little-endian `u64` read from the snapshot. The
//! agent writes periodic saves and last-words checkpoints from the map
//! alone; it knows no model.
//!
//! ```text
//! snapshot bytes:  | part 0 (len0 × size0) | part 1 (len1 × size1) | ...
//! checkpoint:      <rank dir>/<file>: safetensors, tensor = part[range]
//!                  <rank dir>/meta.json: format, version, iteration,
//!                  world_size, rank, <fields in map order>, files
//! ```
//!
//! A **sliced** snapshot (the default) holds each unique part whole and only
//! this rank's slice of each replicated part: elements
//! [`shard_range`](crate::shard::shard_range)`(len, group, index)`, the
//! slice the group's all-gather gives each rank. The other slices are on the
//! other ranks' snapshots; a restore rebuilds the part with one all-gather.
//! A full snapshot holds every part whole (`--snapshot-slices off`).
//!
//! ```text
//! slot data, sliced: | part 0 (held 0..len0) | part 1 (held slice of len1) | ...
//!                      each part's held elements, in map order, packed
//! ```
//!
//! A map is external input: [`StateMap::validate`] checks every index, range
//! and name before the agent uses it, and every error names what is wrong.

use serde::{Deserialize, Serialize};
use std::hash::Hasher;
use std::ops::Range;
use std::path::PathBuf;

/// Most parts a map may have.
pub const MAX_PARTS: usize = 64;
/// Most files and fields a checkpoint map may have.
pub const MAX_FILES: usize = 64;
pub const MAX_FIELDS: usize = 256;
/// Longest part, tensor, file or field name.
pub const MAX_NAME: usize = 128;

/// Field names `meta.json` always has; a map may not redefine them.
pub const RESERVED_FIELDS: [&str; 6] = [
    "format",
    "version",
    "iteration",
    "world_size",
    "rank",
    "files",
];

/// Element type of a part, with safetensors' names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Dtype {
    U8,
    I8,
    U16,
    I16,
    F16,
    BF16,
    U32,
    I32,
    F32,
    U64,
    I64,
    F64,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::U8 | Self::I8 => 1,
            Self::U16 | Self::I16 | Self::F16 | Self::BF16 => 2,
            Self::U32 | Self::I32 | Self::F32 => 4,
            Self::U64 | Self::I64 | Self::F64 => 8,
        }
    }

    /// The same type in the `safetensors` crate.
    pub fn safetensors(self) -> safetensors::Dtype {
        use safetensors::Dtype as S;
        match self {
            Self::U8 => S::U8,
            Self::I8 => S::I8,
            Self::U16 => S::U16,
            Self::I16 => S::I16,
            Self::F16 => S::F16,
            Self::BF16 => S::BF16,
            Self::U32 => S::U32,
            Self::I32 => S::I32,
            Self::F32 => S::F32,
            Self::U64 => S::U64,
            Self::I64 => S::I64,
            Self::F64 => S::F64,
        }
    }
}

/// Whether a part exists only on this rank or identically on every rank of
/// its data-parallel group.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Sharing {
    /// Held by this rank alone (its optimizer shard, RNG, data position).
    #[default]
    Unique,
    /// The same bytes on each of the `group` ranks of the data-parallel
    /// group; this rank is number `index` in it.
    Replicated { group: usize, index: usize },
}

/// One part of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Part {
    pub name: String,
    pub dtype: Dtype,
    /// Elements of `dtype`.
    pub len: u64,
    #[serde(default)]
    pub sharing: Sharing,
}

impl Part {
    pub fn bytes(&self) -> u64 {
        self.len.saturating_mul(self.dtype.size() as u64)
    }
}

/// Most dimensions a checkpoint tensor may have.
pub const MAX_DIMS: usize = 8;

/// One tensor of a checkpoint file: elements `range` of part `part`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorMap {
    pub name: String,
    pub part: usize,
    pub range: Range<u64>,
    /// Its shape in the file (row-major, `range`'s elements); one
    /// dimension when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<u64>>,
    /// Where this piece lies in the whole tensor it is a shard of, one
    /// offset per dimension of `shape` (`torch.distributed.checkpoint`'s
    /// `saved_offsets`). A file with any tensor that has offsets says, in
    /// its safetensors metadata, each tensor's (`DCP_SHARDING_INFO`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offsets: Option<Vec<u64>>,
}

impl TensorMap {
    /// The shape it is written with.
    pub fn dims(&self) -> Vec<u64> {
        self.shape
            .clone()
            .unwrap_or_else(|| vec![self.range.end.saturating_sub(self.range.start)])
    }
}

/// One file of a checkpoint rank directory (a safetensors file).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileMap {
    pub name: String,
    pub tensors: Vec<TensorMap>,
}

/// Where a `meta.json` field's value comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum FieldValue {
    /// The same value in every checkpoint of this rank.
    Const(serde_json::Value),
    /// A little-endian u64 at byte `offset` of part `part` of the snapshot.
    U64 { part: usize, offset: u64 },
    /// The JSON document at the start of part `part` (a `U8` part), after
    /// its length as a little-endian u32: a worker's own metadata block.
    Json { part: usize },
}

/// One named `meta.json` field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetaField {
    pub name: String,
    pub value: FieldValue,
}

/// How a snapshot is written as one rank's checkpoint directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointMap {
    /// The save directory (the trainer's `--save`).
    pub dir: PathBuf,
    /// Save every `interval` steps (0: only the last step).
    pub interval: u64,
    /// Ranks that write a checkpoint of this job.
    pub world_size: usize,
    pub files: Vec<FileMap>,
    pub fields: Vec<MetaField>,
    /// A folder of the checkpoint's iteration in which every rank's files
    /// are also linked (hard links, `rank_NNNNN-<file>`, and each rank's
    /// `meta.json` as `rank_NNNNN-meta.json`), for readers that take one
    /// folder of safetensors files, such as
    /// `torch.distributed.checkpoint.HuggingFaceStorageReader`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linked: Option<String>,
}

/// What a rank's snapshot holds and how it maps to a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateMap {
    pub parts: Vec<Part>,
    /// Absent when checkpoints of this worker are not the agent's to write.
    #[serde(default)]
    pub checkpoint: Option<CheckpointMap>,
    /// The samples of one step across the whole group, when the worker
    /// keeps it whatever the group's size: a resize then chooses a size
    /// that divides it (the others stand by).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_batch: Option<u64>,
}

/// Why a map was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateMapError {
    #[error("state map: {0}")]
    Invalid(String),
}

fn name_ok(what: &str, name: &str) -> Result<(), StateMapError> {
    if name.is_empty() || name.len() > MAX_NAME || name.chars().any(char::is_control) {
        return Err(StateMapError::Invalid(format!(
            "{what} name {name:?} must be 1 to {MAX_NAME} printable characters"
        )));
    }
    Ok(())
}

impl StateMap {
    /// Bytes of the whole snapshot (`None` on overflow).
    pub fn total_bytes(&self) -> Option<u64> {
        self.parts.iter().try_fold(0u64, |a, p| {
            a.checked_add(p.len.checked_mul(p.dtype.size() as u64)?)
        })
    }

    /// Byte range of each part in the snapshot.
    pub fn offsets(&self) -> Vec<Range<usize>> {
        let mut at = 0usize;
        self.parts
            .iter()
            .map(|p| {
                let len = p.bytes() as usize;
                let r = at..at + len;
                at += len;
                r
            })
            .collect()
    }

    /// The elements of part `i` a snapshot of this rank holds: all of them,
    /// or, `sliced`, this rank's slice of a replicated part (validated map).
    pub fn held(&self, i: usize, sliced: bool) -> Range<u64> {
        let p = &self.parts[i];
        match p.sharing {
            Sharing::Replicated { group, index } if sliced && group > 1 => {
                let r = crate::shard::shard_range(p.len as usize, group, index);
                r.start as u64..r.end as u64
            }
            _ => 0..p.len,
        }
    }

    /// Byte range, in the snapshot, of each part's held elements.
    pub fn slot_offsets(&self, sliced: bool) -> Vec<Range<usize>> {
        let mut at = 0usize;
        (0..self.parts.len())
            .map(|i| {
                let h = self.held(i, sliced);
                let len = ((h.end - h.start) * self.parts[i].dtype.size() as u64) as usize;
                let r = at..at + len;
                at += len;
                r
            })
            .collect()
    }

    /// Bytes of a snapshot (validated map).
    pub fn slot_bytes(&self, sliced: bool) -> u64 {
        self.slot_offsets(sliced).last().map_or(0, |r| r.end as u64)
    }

    /// The rank directory a checkpoint of this map goes to: the rank's
    /// index in its data-parallel group (a replicated part of the
    /// checkpoint's world size says it; after an elastic resize it is not
    /// the process's launch rank), else `rank`.
    pub fn checkpoint_rank(&self, rank: usize) -> usize {
        let world = self.checkpoint.as_ref().map(|c| c.world_size);
        self.parts
            .iter()
            .find_map(|p| match p.sharing {
                Sharing::Replicated { group, index } if Some(group) == world => Some(index),
                _ => None,
            })
            .unwrap_or(rank)
    }

    /// Whether slicing changes anything: some part is replicated over a
    /// group of more than one rank.
    pub fn has_replicated(&self) -> bool {
        self.parts
            .iter()
            .any(|p| matches!(p.sharing, Sharing::Replicated { group, .. } if group > 1))
    }

    /// A hash identifying what a snapshot's bytes are: the layout, and for
    /// a sliced snapshot which slice of each replicated part.
    pub fn slot_layout_hash(&self, sliced: bool) -> u64 {
        if !sliced || !self.has_replicated() {
            return self.layout_hash();
        }
        let mut h = twox_hash::XxHash3_64::new();
        h.write(&self.layout_hash().to_le_bytes());
        for i in 0..self.parts.len() {
            let r = self.held(i, true);
            h.write(&r.start.to_le_bytes());
            h.write(&r.end.to_le_bytes());
        }
        h.finish()
    }

    /// The index of the part named `name`.
    pub fn part(&self, name: &str) -> Option<usize> {
        self.parts.iter().position(|p| p.name == name)
    }

    /// The part with the most bytes (the default target of an injected
    /// memory error).
    pub fn largest_part(&self) -> Option<usize> {
        (0..self.parts.len()).max_by_key(|&i| (self.parts[i].bytes(), usize::MAX - i))
    }

    /// A hash identifying the snapshot layout: part names, types and lengths,
    /// in order.
    pub fn layout_hash(&self) -> u64 {
        let mut h = twox_hash::XxHash3_64::new();
        for p in &self.parts {
            h.write(p.name.as_bytes());
            h.write(&[0]);
            h.write(format!("{:?}", p.dtype).as_bytes());
            h.write(&p.len.to_le_bytes());
        }
        h.finish()
    }

    /// Checks every name, index and range, so that nothing derived from the
    /// map can be out of bounds.
    pub fn validate(&self) -> Result<(), StateMapError> {
        let bad = |m: String| Err(StateMapError::Invalid(m));
        if self.parts.is_empty() || self.parts.len() > MAX_PARTS {
            return bad(format!(
                "{} parts; 1 to {MAX_PARTS} allowed",
                self.parts.len()
            ));
        }
        for (i, p) in self.parts.iter().enumerate() {
            name_ok("part", &p.name)?;
            if self.parts[..i].iter().any(|q| q.name == p.name) {
                return bad(format!("part name {:?} is used twice", p.name));
            }
            if let Sharing::Replicated { group, index } = p.sharing
                && (group == 0 || index >= group)
            {
                return bad(format!(
                    "part {:?}: index {index} in a replicated group of {group}",
                    p.name
                ));
            }
        }
        if self.global_batch == Some(0) {
            return bad("a global batch of 0 samples".into());
        }
        let Some(total) = self.total_bytes() else {
            return bad("the parts' sizes overflow".into());
        };
        if usize::try_from(total).is_err() {
            return bad(format!("{total} bytes do not fit this host"));
        }
        let Some(ck) = &self.checkpoint else {
            return Ok(());
        };
        if ck.world_size == 0 {
            return bad("checkpoint world_size must be at least 1".into());
        }
        if ck.files.is_empty() || ck.files.len() > MAX_FILES {
            return bad(format!(
                "{} checkpoint files; 1 to {MAX_FILES} allowed",
                ck.files.len()
            ));
        }
        if ck.fields.len() > MAX_FIELDS {
            return bad(format!(
                "{} meta fields; at most {MAX_FIELDS} allowed",
                ck.fields.len()
            ));
        }
        for (i, f) in ck.files.iter().enumerate() {
            name_ok("file", &f.name)?;
            let plain = std::path::Path::new(&f.name)
                .file_name()
                .is_some_and(|n| n == f.name.as_str());
            if !plain || f.name.starts_with('.') || f.name == crate::checkpoint::META_FILE {
                return bad(format!(
                    "file name {:?} must be a plain file name, not {:?} and not hidden",
                    f.name,
                    crate::checkpoint::META_FILE
                ));
            }
            if ck.files[..i].iter().any(|g| g.name == f.name) {
                return bad(format!("file {:?} is named twice", f.name));
            }
            if f.tensors.is_empty() {
                return bad(format!("file {:?} has no tensors", f.name));
            }
            for (j, t) in f.tensors.iter().enumerate() {
                name_ok("tensor", &t.name)?;
                if f.tensors[..j].iter().any(|u| u.name == t.name) {
                    return bad(format!(
                        "tensor {:?} is named twice in {:?}",
                        t.name, f.name
                    ));
                }
                let Some(part) = self.parts.get(t.part) else {
                    return bad(format!(
                        "tensor {:?} of {:?} names part {}, but there are {}",
                        t.name,
                        f.name,
                        t.part,
                        self.parts.len()
                    ));
                };
                if t.range.start > t.range.end || t.range.end > part.len {
                    return bad(format!(
                        "tensor {:?} of {:?}: elements {:?} are outside part {:?} of {} elements",
                        t.name, f.name, t.range, part.name, part.len
                    ));
                }
                if let Some(shape) = &t.shape {
                    let elements = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
                    if shape.len() > MAX_DIMS || elements != Some(t.range.end - t.range.start) {
                        return bad(format!(
                            "tensor {:?} of {:?}: shape {shape:?} does not hold its {} elements \
                             (at most {MAX_DIMS} dimensions)",
                            t.name,
                            f.name,
                            t.range.end - t.range.start
                        ));
                    }
                }
                if let Some(offsets) = &t.offsets
                    && offsets.len() != t.dims().len()
                {
                    return bad(format!(
                        "tensor {:?} of {:?}: {} offsets for {} dimensions",
                        t.name,
                        f.name,
                        offsets.len(),
                        t.dims().len()
                    ));
                }
            }
        }
        if let Some(linked) = &ck.linked {
            name_ok("linked folder", linked)?;
            let plain = std::path::Path::new(linked)
                .file_name()
                .is_some_and(|n| n == linked.as_str());
            if !plain || linked.starts_with('.') || linked.starts_with("rank_") {
                return bad(format!(
                    "linked folder {linked:?} must be a plain name, not hidden, not rank_*"
                ));
            }
        }
        for (i, m) in ck.fields.iter().enumerate() {
            name_ok("field", &m.name)?;
            if RESERVED_FIELDS.contains(&m.name.as_str()) {
                return bad(format!(
                    "meta field {:?} is reserved ({RESERVED_FIELDS:?})",
                    m.name
                ));
            }
            if ck.fields[..i].iter().any(|n| n.name == m.name) {
                return bad(format!("meta field {:?} is named twice", m.name));
            }
            if let FieldValue::Json { part } = m.value
                && self
                    .parts
                    .get(part)
                    .is_none_or(|p| p.dtype != Dtype::U8 || p.len < 4)
            {
                return bad(format!(
                    "meta field {:?}: part {part} is not a U8 part that can hold a JSON block",
                    m.name
                ));
            }
            if let FieldValue::U64 { part, offset } = m.value {
                let fits = self
                    .parts
                    .get(part)
                    .is_some_and(|p| offset.checked_add(8).is_some_and(|end| end <= p.bytes()));
                if !fits {
                    return bad(format!(
                        "meta field {:?}: 8 bytes at offset {offset} of part {part} are outside the snapshot",
                        m.name
                    ));
                }
            }
        }
        Ok(())
    }

    /// Reads field `value` from a snapshot's parts (validated map); `None`
    /// when the word is outside what the views hold, or the JSON block is
    /// not one.
    pub fn field(&self, value: &FieldValue, parts: &[PartView<'_>]) -> Option<serde_json::Value> {
        match value {
            FieldValue::Const(v) => Some(v.clone()),
            FieldValue::U64 { part, offset } => {
                let view = parts.get(*part)?;
                let size = self.parts.get(*part)?.dtype.size() as u64;
                let at = offset.checked_sub(view.first.checked_mul(size)?)? as usize;
                let word = view
                    .bytes
                    .get(at..at.checked_add(8)?)
                    .and_then(|b| <[u8; 8]>::try_from(b).ok())
                    .map(u64::from_le_bytes)?;
                Some(serde_json::Value::from(word))
            }
            FieldValue::Json { part } => {
                let view = parts.get(*part)?;
                if view.first != 0 {
                    return None;
                }
                let len = view
                    .bytes
                    .get(..4)
                    .and_then(|b| <[u8; 4]>::try_from(b).ok())
                    .map(u32::from_le_bytes)?;
                let doc = view.bytes.get(4..4usize.checked_add(len as usize)?)?;
                serde_json::from_slice(doc).ok()
            }
        }
    }
}

/// What a writer has of one part: its elements from `first` on, as bytes
/// (the whole part, or a rank's slice of a replicated one).
#[derive(Debug, Clone, Copy)]
pub struct PartView<'a> {
    pub first: u64,
    pub bytes: &'a [u8],
}

impl<'a> PartView<'a> {
    /// A whole part.
    pub fn whole(bytes: &'a [u8]) -> Self {
        Self { first: 0, bytes }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn sample() -> StateMap {
        StateMap {
            parts: vec![
                Part {
                    name: "meta".into(),
                    dtype: Dtype::U8,
                    len: 16,
                    sharing: Sharing::Unique,
                },
                Part {
                    name: "w".into(),
                    dtype: Dtype::F32,
                    len: 10,
                    sharing: Sharing::Replicated { group: 2, index: 1 },
                },
            ],
            checkpoint: Some(CheckpointMap {
                dir: "/tmp/x".into(),
                interval: 5,
                world_size: 2,
                files: vec![FileMap {
                    name: "w.safetensors".into(),
                    tensors: vec![TensorMap {
                        name: "w".into(),
                        part: 1,
                        range: 5..10,
                        shape: None,
                        offsets: None,
                    }],
                }],
                fields: vec![MetaField {
                    name: "seed".into(),
                    value: FieldValue::U64 { part: 0, offset: 8 },
                }],
                linked: None,
            }),
            global_batch: None,
        }
    }

    #[test]
    fn sizes_offsets_and_fields() {
        let m = sample();
        m.validate().unwrap();
        assert_eq!(m.total_bytes(), Some(56));
        assert_eq!(m.offsets(), vec![0..16, 16..56]);
        assert_eq!(m.largest_part(), Some(1));
        let meta: Vec<u8> = (0..16u8).collect();
        let views = [PartView::whole(&meta), PartView::whole(&[])];
        let v = m.field(&FieldValue::U64 { part: 0, offset: 8 }, &views);
        assert_eq!(
            v,
            Some(serde_json::json!(u64::from_le_bytes([
                8, 9, 10, 11, 12, 13, 14, 15
            ])))
        );
        assert_eq!(
            m.field(&FieldValue::U64 { part: 0, offset: 9 }, &views),
            None,
            "a word beyond the view"
        );
    }

    #[test]
    fn a_sliced_snapshot_holds_each_replicated_part_once_across_the_group() {
        let mut m = sample();
        // Rank 1 of 2: the second half of "w".
        assert_eq!(m.held(1, true), 5..10);
        assert_eq!(m.held(1, false), 0..10);
        assert_eq!(m.held(0, true), 0..16, "unique parts are whole");
        assert_eq!(m.slot_offsets(true), vec![0..16, 16..36]);
        assert_eq!(m.slot_bytes(true), 36);
        assert_eq!(m.slot_bytes(false), 56);
        assert_ne!(m.slot_layout_hash(true), m.slot_layout_hash(false));
        assert_eq!(m.slot_layout_hash(false), m.layout_hash());
        // Every element of a replicated part is held by exactly one rank.
        for (group, len) in [(1usize, 7u64), (3, 10), (4, 3), (8, 1001)] {
            let mut covered = vec![0u32; len as usize];
            for index in 0..group {
                m.parts[1] = Part {
                    len,
                    sharing: Sharing::Replicated { group, index },
                    ..m.parts[1].clone()
                };
                for e in m.held(1, true) {
                    covered[e as usize] += 1;
                }
            }
            assert!(covered.iter().all(|c| *c == 1), "{group} {len}");
        }
    }

    #[test]
    fn bad_maps_are_named() {
        type Change = Box<dyn Fn(&mut StateMap)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|m| m.parts.clear()), "0 parts"),
            (Box::new(|m| m.parts[1].name = "meta".into()), "used twice"),
            (Box::new(|m| m.parts[1].name = String::new()), "part name"),
            (Box::new(|m| m.parts[1].len = u64::MAX), "overflow"),
            (
                Box::new(|m| m.parts[1].sharing = Sharing::Replicated { group: 2, index: 2 }),
                "replicated group",
            ),
            (
                Box::new(|m| m.checkpoint.as_mut().unwrap().files[0].tensors[0].part = 7),
                "names part 7",
            ),
            (
                Box::new(|m| m.checkpoint.as_mut().unwrap().files[0].tensors[0].range = 5..11),
                "outside part",
            ),
            (
                Box::new(|m| m.checkpoint.as_mut().unwrap().files[0].name = "../x".into()),
                "plain file name",
            ),
            (
                Box::new(|m| m.checkpoint.as_mut().unwrap().files[0].name = "meta.json".into()),
                "plain file name",
            ),
            (
                Box::new(|m| m.checkpoint.as_mut().unwrap().fields[0].name = "iteration".into()),
                "reserved",
            ),
            (
                Box::new(|m| {
                    m.checkpoint.as_mut().unwrap().fields[0].value =
                        FieldValue::U64 { part: 0, offset: 9 }
                }),
                "outside the snapshot",
            ),
            (
                Box::new(|m| m.checkpoint.as_mut().unwrap().world_size = 0),
                "world_size",
            ),
        ];
        for (change, want) in cases {
            let mut m = sample();
            change(&mut m);
            let e = m.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{want:?} not in {e:?}");
        }
    }

    proptest! {
        #[test]
        fn any_json_is_refused_or_valid_never_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            if let Ok(m) = serde_json::from_slice::<StateMap>(&bytes) {
                let _ = m.validate();
            }
        }

        #[test]
        fn validated_maps_stay_in_bounds(lens in proptest::collection::vec(0u64..1000, 1..6), start in 0u64..2000, len in 0u64..2000, offset in 0u64..4000) {
            let parts: Vec<Part> = lens.iter().enumerate().map(|(i, &len)| Part {
                name: format!("p{i}"), dtype: if i % 2 == 0 { Dtype::U8 } else { Dtype::F32 }, len, sharing: Sharing::Unique,
            }).collect();
            let last = parts.len() - 1;
            let m = StateMap {
                parts,
                checkpoint: Some(CheckpointMap {
                    dir: "/d".into(), interval: 1, world_size: 1,
                    files: vec![FileMap { name: "f".into(), tensors: vec![TensorMap { name: "t".into(), part: last, range: start..start + len, shape: None, offsets: None }] }],
                    fields: vec![MetaField { name: "x".into(), value: FieldValue::U64 { part: 0, offset } }],
                    linked: None,
                }),
                global_batch: None,
            };
            if m.validate().is_ok() {
                let offs = m.offsets();
                let t = &m.checkpoint.as_ref().unwrap().files[0].tensors[0];
                let size = m.parts[t.part].dtype.size() as u64;
                prop_assert!(offs[t.part].start as u64 + t.range.end * size <= offs[t.part].end as u64);
                prop_assert!(offset + 8 <= m.parts[0].bytes());
            }
        }
    }
}
