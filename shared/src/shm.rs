//! The shared-memory snapshot store of one rank: a control page and `K ≥ 2`
//! snapshot slots in one file under `/dev/shm/hatrain/<job>/`.
//!
//! The agent creates the file (mode 0600) and owns it, so it outlives the
//! worker; the worker maps it to commit snapshots and read directives; the
//! agent maps it to read slots (for s\*, dumps) and to write directives.
//!
//! ```text
//! file: rank_NNNNN.shm
//! 0            4096           4096+H        4096+H+C      ...
//! +------------+--------------+-------------+-------------+------------
//! | control    | slot 0 header| slot 0 data | slot 1 hdr  | slot 1 data ...
//! | page       | (4096 B)     | (C bytes)   |             |
//! +------------+--------------+-------------+-------------+------------
//!
//! control page (every field a little-endian u64, accessed atomically):
//!   0 magic "HTRCTL\0\1"  8 version (major<<16|minor)  16 rank  24 slots K
//!  32 slot capacity C     40 layout hash               48 job hash
//!  64 pid                 72 phase                     80 last completed step
//!  88 epoch               96 heartbeat                104 restart count
//! 128 directive seq      136 directive kind           144 directive epoch
//! 152 directive step     160 acknowledged directive seq
//! 168 fault flags        176 fault address            184 fault detail
//! 192 last commit ns     200 last commit blocking ns  208 commits
//! 216 injected fault (0 none, 1 crash, 2 hang), taken at the next step
//! 224 1 while the rank waits in a collective (on its peers), else 0
//! 232 injection argument (UCE: buffer index << 48 | byte offset)
//! 240 persist hold: 0 none, else step << 16 | claimed << 8 | (slot + 1)
//! 248 step the injected fault waits for (0: the next step)
//!
//! slot header (u64 fields):
//!   0 magic "HTRSLOT\1"   8 version   16 seq (odd while written)   24 rank
//!  32 step               40 epoch    48 length                     56 xxh3-64
//!  64 state (0 empty, 1 writing, 2 sealed)   72 job hash   80 sealed at (unix ns)
//! ```
//!
//! # Sealing
//!
//! INVARIANT: a writer never touches the newest sealed slot
//! ([`Store::writable_slot`]), and seals a slot by writing its header last:
//! `seq` goes odd and `state` to writing first; then the data is copied and
//! hashed in one pass; then step, epoch, length and checksum are stored; then
//! `state` becomes sealed and `seq` even, with release ordering. Whatever
//! instant the writer dies at, the other slot still holds a sealed,
//! verifiable snapshot. Readers ([`Store::verify`]) check magic, version,
//! seq, state, bounds and the checksum, and reject anything else.
//!
//! # Directives
//!
//! The agent posts a directive with a sequence lock on the directive fields
//! (seq odd while writing); the worker polls `directive seq` with one atomic
//! load (no syscall) at every step boundary, and acknowledges a directive by
//! storing its seq in `acknowledged directive seq`.
//!
//! # Persist holds
//!
//! A step the agent is to save to disk is *held*: after sealing it, the
//! worker records `(step, slot)` in the hold word, and no writer touches a
//! held slot until the hold is gone. The agent *claims* a hold (a CAS that
//! sets the claimed bit) before it reads the slot and releases it when done.
//! Only the worker names a slot in the hold word, and it replaces a hold
//! with a newer one only while it is unclaimed (a CAS), so a claimed slot
//! cannot be rewritten while the agent reads it: a slow disk makes the agent
//! skip to the newest held step instead of queueing.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering, fence};

pub const PAGE: usize = 4096;
pub const CONTROL_MAGIC: u64 = u64::from_le_bytes(*b"HTRCTL\0\x01");
pub const SLOT_MAGIC: u64 = u64::from_le_bytes(*b"HTRSLOT\x01");
pub const VERSION: (u16, u16) = (1, 0);
const VERSION_WORD: u64 = ((VERSION.0 as u64) << 16) | VERSION.1 as u64;
/// Most slots a store may have.
pub const MAX_SLOTS: usize = 16;
/// Bytes hashed per piece while copying: the piece is still in cache when
/// it is hashed, so the data is read from memory once.
const COPY_PIECE: usize = 256 * 1024;

/// Control-page field offsets (bytes).
mod ctl {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 8;
    pub const RANK: usize = 16;
    pub const SLOTS: usize = 24;
    pub const CAPACITY: usize = 32;
    pub const LAYOUT: usize = 40;
    pub const JOB: usize = 48;
    pub const PID: usize = 64;
    pub const PHASE: usize = 72;
    pub const STEP: usize = 80;
    pub const EPOCH: usize = 88;
    pub const HEARTBEAT: usize = 96;
    pub const RESTARTS: usize = 104;
    pub const DIR_SEQ: usize = 128;
    pub const DIR_KIND: usize = 136;
    pub const DIR_EPOCH: usize = 144;
    pub const DIR_STEP: usize = 152;
    pub const ACK: usize = 160;
    pub const FAULT_FLAGS: usize = 168;
    pub const FAULT_ADDR: usize = 176;
    pub const FAULT_DETAIL: usize = 184;
    pub const COMMIT_NS: usize = 192;
    pub const COMMIT_BLOCK_NS: usize = 200;
    pub const COMMITS: usize = 208;
    pub const INJECT: usize = 216;
    pub const IN_COLLECTIVE: usize = 224;
    pub const INJECT_ARG: usize = 232;
    pub const HOLD: usize = 240;
    pub const INJECT_AT: usize = 248;
}

/// Slot-header field offsets (bytes).
mod hdr {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 8;
    pub const SEQ: usize = 16;
    pub const RANK: usize = 24;
    pub const STEP: usize = 32;
    pub const EPOCH: usize = 40;
    pub const LEN: usize = 48;
    pub const SUM: usize = 56;
    pub const STATE: usize = 64;
    pub const JOB: usize = 72;
    pub const SEALED_AT: usize = 80;
}

const STATE_WRITING: u64 = 1;
const STATE_SEALED: u64 = 2;

/// What a worker is doing, as its control page says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Starting,
    Computing,
    Updating,
    Paused,
    Restoring,
    Finished,
    Unknown,
}

impl Phase {
    pub fn word(self) -> u64 {
        match self {
            Self::Starting => 0,
            Self::Computing => 1,
            Self::Updating => 2,
            Self::Paused => 3,
            Self::Restoring => 4,
            Self::Finished => 5,
            Self::Unknown => 99,
        }
    }

    pub fn from_word(w: u64) -> Self {
        match w {
            0 => Self::Starting,
            1 => Self::Computing,
            2 => Self::Updating,
            3 => Self::Paused,
            4 => Self::Restoring,
            5 => Self::Finished,
            _ => Self::Unknown,
        }
    }
}

/// A fault `agentctl inject` asks a worker to give itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Injection {
    /// SIGKILL itself.
    Crash = 1,
    /// Block inside the step forever.
    Hang = 2,
    /// An uncorrectable memory error in a state buffer.
    Uce = 3,
}

/// A snapshot held for the agent's persister (see "Persist holds").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    pub step: u64,
    pub slot: usize,
    /// The agent is reading the slot.
    pub claimed: bool,
}

impl Hold {
    const CLAIMED: u64 = 1 << 8;

    fn encode(self) -> u64 {
        let claimed = if self.claimed { Self::CLAIMED } else { 0 };
        (self.step << 16) | claimed | (self.slot as u64 + 1)
    }

    fn decode(w: u64) -> Option<Self> {
        let slot = (w & 0xff) as usize;
        (slot != 0).then(|| Self {
            step: w >> 16,
            slot: slot - 1,
            claimed: w & Self::CLAIMED != 0,
        })
    }
}

/// Why a worker could not hold a step for the persister.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldRefused {
    /// The agent is still writing this older step out.
    Busy(Hold),
}

/// An instruction from the agent to a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Directive {
    None,
    /// Abort the communicator, finish any commit, wait for the next
    /// directive. `epoch` is the epoch being formed.
    Pause {
        epoch: u64,
    },
    /// Roll back to `step` (restoring from the sealed slot of that step
    /// unless the live state is exactly there) and rebuild the communicator
    /// under `epoch`.
    Resume {
        epoch: u64,
        step: u64,
    },
    /// Leave the training loop and exit.
    Stop,
}

impl Directive {
    fn encode(self) -> (u64, u64, u64) {
        match self {
            Self::None => (0, 0, 0),
            Self::Pause { epoch } => (1, epoch, 0),
            Self::Resume { epoch, step } => (2, epoch, step),
            Self::Stop => (3, 0, 0),
        }
    }

    fn decode(kind: u64, epoch: u64, step: u64) -> Self {
        match kind {
            1 => Self::Pause { epoch },
            2 => Self::Resume { epoch, step },
            3 => Self::Stop,
            _ => Self::None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: not a snapshot store: {detail}")]
    Format { path: PathBuf, detail: String },
    #[error("{path}: slot {slot} is unusable: {detail}")]
    BadSlot {
        path: PathBuf,
        slot: usize,
        detail: String,
    },
    #[error("{path}: state of {len} bytes does not fit slots of {capacity} bytes")]
    TooLarge {
        path: PathBuf,
        len: usize,
        capacity: usize,
    },
}

/// The geometry of a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub slots: usize,
    /// Data bytes per slot (a multiple of the page size).
    pub capacity: usize,
}

impl Geometry {
    pub fn new(slots: usize, state_len: usize) -> Self {
        Self {
            slots,
            capacity: state_len.next_multiple_of(PAGE).max(PAGE),
        }
    }

    /// Offset of slot `i`'s header.
    pub fn slot_offset(&self, i: usize) -> usize {
        PAGE + i * (PAGE + self.capacity)
    }

    /// Total file size.
    pub fn file_len(&self) -> usize {
        self.slot_offset(self.slots)
    }
}

/// What a slot holds, read from its header (not yet checksum-verified).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SlotInfo {
    pub slot: usize,
    pub step: u64,
    pub epoch: u64,
    pub len: u64,
    pub checksum: u64,
    pub sealed_at_unix_ns: u64,
}

/// A shared mapping of a whole store file; unmapped on drop.
#[derive(Debug)]
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all access to it goes through
// atomics or through copies whose races are excluded by the sealing
// protocol, so it may be used from any thread.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len came from a successful mmap and are unmapped once.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

impl Mapping {
    fn map(file: &std::fs::File, len: usize, populate: bool) -> io::Result<Self> {
        use std::os::fd::AsRawFd;
        let flags = libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 };
        // SAFETY: mapping a file we hold open, with a length equal to its
        // size; the result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        assert!(
            offset.is_multiple_of(8) && offset + 8 <= self.len,
            "word offset {offset} out of bounds"
        );
        // SAFETY: in bounds (checked), 8-byte aligned (the mapping is page
        // aligned and offset is a multiple of 8), and AtomicU64 has the
        // layout of u64. Shared memory is only ever accessed atomically at
        // these offsets.
        unsafe { &*self.ptr.add(offset).cast::<AtomicU64>() }
    }

    /// The bytes `offset..offset+len`.
    ///
    /// # Safety
    /// The caller must ensure no one writes these bytes while the slice
    /// lives, or accept torn contents (readers verify checksums).
    unsafe fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset + len <= self.len, "range out of bounds");
        // SAFETY: in bounds; aliasing is the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr.add(offset), len) }
    }

    /// # Safety
    /// The caller must be the only writer of these bytes while the slice
    /// lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        assert!(offset + len <= self.len, "range out of bounds");
        // SAFETY: in bounds; exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset), len) }
    }
}

/// One rank's store, mapped.
#[derive(Debug)]
pub struct Store {
    path: PathBuf,
    map: Mapping,
    geometry: Geometry,
}

/// Stable 64-bit identity of a string (job ids, layouts).
pub fn hash_str(s: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(s.as_bytes())
}

/// Path of `rank`'s store under `dir`.
pub fn store_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank_{rank:05}.shm"))
}

fn now_unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl Store {
    /// Creates (or re-creates) the store file with mode 0600 and pre-faults
    /// every page, so later commits copy into touched memory.
    pub fn create(
        path: &Path,
        rank: usize,
        geometry: Geometry,
        layout_hash: u64,
        job_hash: u64,
    ) -> Result<Self, ShmError> {
        let io_err = |source| ShmError::Io {
            path: path.to_path_buf(),
            source,
        };
        if !(2..=MAX_SLOTS).contains(&geometry.slots) {
            return Err(ShmError::Format {
                path: path.to_path_buf(),
                detail: format!(
                    "{} slots requested; 2 to {MAX_SLOTS} allowed",
                    geometry.slots
                ),
            });
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)
            .map_err(io_err)?;
        file.set_len(geometry.file_len() as u64).map_err(io_err)?;
        let map = Mapping::map(&file, geometry.file_len(), false).map_err(io_err)?;
        // Pre-fault writable: first touch of shm runs at about a tenth of
        // memcpy speed, so pay it once here rather than in the first commits.
        // SAFETY: madvise on our own fresh mapping.
        let rc = unsafe { libc::madvise(map.ptr.cast(), map.len, libc::MADV_POPULATE_WRITE) };
        if rc != 0 {
            // Older kernels lack MADV_POPULATE_WRITE (5.14+): touch each page.
            for off in (0..map.len).step_by(PAGE) {
                map.word(off).fetch_add(0, Ordering::Relaxed);
            }
        }
        let store = Self {
            path: path.to_path_buf(),
            map,
            geometry,
        };
        for (off, v) in [
            (ctl::VERSION, VERSION_WORD),
            (ctl::RANK, rank as u64),
            (ctl::SLOTS, geometry.slots as u64),
            (ctl::CAPACITY, geometry.capacity as u64),
            (ctl::LAYOUT, layout_hash),
            (ctl::JOB, job_hash),
        ] {
            store.map.word(off).store(v, Ordering::Relaxed);
        }
        store
            .map
            .word(ctl::MAGIC)
            .store(CONTROL_MAGIC, Ordering::Release);
        Ok(store)
    }

    /// Opens an existing store, checking its control page.
    pub fn open(path: &Path) -> Result<Self, ShmError> {
        let io_err = |source| ShmError::Io {
            path: path.to_path_buf(),
            source,
        };
        let fmt = |detail: String| ShmError::Format {
            path: path.to_path_buf(),
            detail,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io_err)?;
        let len = usize::try_from(file.metadata().map_err(io_err)?.len())
            .map_err(|_| fmt("file too large".into()))?;
        if len < PAGE {
            return Err(fmt(format!("{len} bytes, smaller than a control page")));
        }
        let map = Mapping::map(&file, len, true).map_err(io_err)?;
        let magic = map.word(ctl::MAGIC).load(Ordering::Acquire);
        if magic != CONTROL_MAGIC {
            return Err(fmt(format!("bad magic {magic:#018x}")));
        }
        let version = map.word(ctl::VERSION).load(Ordering::Relaxed);
        if version >> 16 != VERSION.0 as u64 || version & 0xffff > VERSION.1 as u64 {
            return Err(fmt(format!(
                "version {}.{} is not readable by this build ({}.{})",
                version >> 16,
                version & 0xffff,
                VERSION.0,
                VERSION.1
            )));
        }
        let slots = map.word(ctl::SLOTS).load(Ordering::Relaxed);
        let capacity = map.word(ctl::CAPACITY).load(Ordering::Relaxed);
        let geometry = match (usize::try_from(slots), usize::try_from(capacity)) {
            (Ok(s), Ok(c)) if (2..=MAX_SLOTS).contains(&s) && c.is_multiple_of(PAGE) && c > 0 => {
                Geometry {
                    slots: s,
                    capacity: c,
                }
            }
            _ => {
                return Err(fmt(format!(
                    "impossible geometry: {slots} slots of {capacity} bytes"
                )));
            }
        };
        if geometry.file_len() != len {
            return Err(fmt(format!(
                "{len} bytes, but {} slots of {} bytes need {}",
                geometry.slots,
                geometry.capacity,
                geometry.file_len()
            )));
        }
        Ok(Self {
            path: path.to_path_buf(),
            map,
            geometry,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn ctl(&self, off: usize) -> &AtomicU64 {
        self.map.word(off)
    }

    pub fn rank(&self) -> u64 {
        self.ctl(ctl::RANK).load(Ordering::Relaxed)
    }
    pub fn layout_hash(&self) -> u64 {
        self.ctl(ctl::LAYOUT).load(Ordering::Relaxed)
    }
    pub fn job_hash(&self) -> u64 {
        self.ctl(ctl::JOB).load(Ordering::Relaxed)
    }

    // ---- worker-side status ----

    pub fn set_pid(&self, pid: u32) {
        self.ctl(ctl::PID).store(u64::from(pid), Ordering::Release);
    }
    pub fn pid(&self) -> u64 {
        self.ctl(ctl::PID).load(Ordering::Acquire)
    }
    pub fn set_phase(&self, p: Phase) {
        self.ctl(ctl::PHASE).store(p.word(), Ordering::Release);
    }
    pub fn phase(&self) -> Phase {
        Phase::from_word(self.ctl(ctl::PHASE).load(Ordering::Acquire))
    }
    pub fn set_step(&self, step: u64) {
        self.ctl(ctl::STEP).store(step, Ordering::Release);
    }
    pub fn step(&self) -> u64 {
        self.ctl(ctl::STEP).load(Ordering::Acquire)
    }
    pub fn set_epoch(&self, e: u64) {
        self.ctl(ctl::EPOCH).store(e, Ordering::Release);
    }
    pub fn epoch(&self) -> u64 {
        self.ctl(ctl::EPOCH).load(Ordering::Acquire)
    }
    pub fn beat(&self) {
        self.ctl(ctl::HEARTBEAT).fetch_add(1, Ordering::Release);
    }
    pub fn heartbeat(&self) -> u64 {
        self.ctl(ctl::HEARTBEAT).load(Ordering::Acquire)
    }
    pub fn set_restarts(&self, n: u64) {
        self.ctl(ctl::RESTARTS).store(n, Ordering::Release);
    }
    pub fn restarts(&self) -> u64 {
        self.ctl(ctl::RESTARTS).load(Ordering::Acquire)
    }
    /// Records a sealed commit and how long its copy took.
    pub fn record_commit(&self, total_ns: u64) {
        self.ctl(ctl::COMMIT_NS).store(total_ns, Ordering::Relaxed);
        self.ctl(ctl::COMMITS).fetch_add(1, Ordering::Release);
    }
    /// Records how long the training loop last waited for a commit.
    pub fn record_commit_blocking(&self, ns: u64) {
        self.ctl(ctl::COMMIT_BLOCK_NS).store(ns, Ordering::Relaxed);
    }
    /// (last commit ns, last blocking ns, commits)
    pub fn commit_stats(&self) -> (u64, u64, u64) {
        (
            self.ctl(ctl::COMMIT_NS).load(Ordering::Relaxed),
            self.ctl(ctl::COMMIT_BLOCK_NS).load(Ordering::Relaxed),
            self.ctl(ctl::COMMITS).load(Ordering::Acquire),
        )
    }
    /// Records a fault seen by the worker (flags, address, detail).
    pub fn record_fault(&self, flags: u64, addr: u64, detail: u64) {
        self.ctl(ctl::FAULT_ADDR).store(addr, Ordering::Relaxed);
        self.ctl(ctl::FAULT_DETAIL).store(detail, Ordering::Relaxed);
        self.ctl(ctl::FAULT_FLAGS)
            .fetch_or(flags, Ordering::Release);
    }
    pub fn fault(&self) -> (u64, u64, u64) {
        (
            self.ctl(ctl::FAULT_FLAGS).load(Ordering::Acquire),
            self.ctl(ctl::FAULT_ADDR).load(Ordering::Relaxed),
            self.ctl(ctl::FAULT_DETAIL).load(Ordering::Relaxed),
        )
    }

    /// Marks whether the rank is waiting in a collective: a stalled rank
    /// that is not is the one the others wait for.
    pub fn set_in_collective(&self, yes: bool) {
        self.ctl(ctl::IN_COLLECTIVE)
            .store(u64::from(yes), Ordering::Release);
    }
    pub fn in_collective(&self) -> bool {
        self.ctl(ctl::IN_COLLECTIVE).load(Ordering::Acquire) != 0
    }

    /// Asks the worker to inject a fault at step `at` (0: its next step;
    /// agent side).
    pub fn inject(&self, kind: Injection, arg: u64, at: u64) {
        self.ctl(ctl::INJECT_ARG).store(arg, Ordering::Relaxed);
        self.ctl(ctl::INJECT_AT).store(at, Ordering::Relaxed);
        self.ctl(ctl::INJECT).store(kind as u64, Ordering::Release);
    }

    /// Takes a pending injected fault due at `step` and its argument
    /// (worker side): one atomic load on the fast path.
    pub fn take_injection(&self, step: u64) -> Option<(Injection, u64)> {
        let word = self.ctl(ctl::INJECT);
        if word.load(Ordering::Acquire) == 0
            || self.ctl(ctl::INJECT_AT).load(Ordering::Relaxed) > step
        {
            return None;
        }
        let kind = match word.swap(0, Ordering::AcqRel) {
            1 => Injection::Crash,
            2 => Injection::Hang,
            3 => Injection::Uce,
            _ => return None,
        };
        Some((kind, self.ctl(ctl::INJECT_ARG).load(Ordering::Relaxed)))
    }

    /// The fault-flags word, for a signal handler to set bits in.
    pub fn fault_word(&self) -> &AtomicU64 {
        self.ctl(ctl::FAULT_FLAGS)
    }

    /// Clears fault flags (agent side, once handled).
    pub fn clear_fault(&self, flags: u64) {
        self.ctl(ctl::FAULT_FLAGS)
            .fetch_and(!flags, Ordering::AcqRel);
    }

    // ---- persist holds ----

    /// The current hold, if any.
    pub fn held(&self) -> Option<Hold> {
        Hold::decode(self.ctl(ctl::HOLD).load(Ordering::Acquire))
    }

    /// Holds the freshly sealed `slot` (of `step`) for the persister (worker
    /// side). An unclaimed older hold is replaced, and its slot freed; a
    /// claimed one stays, and this step is not held.
    pub fn hold(&self, step: u64, slot: usize) -> Result<(), HoldRefused> {
        let word = self.ctl(ctl::HOLD);
        let new = Hold {
            step,
            slot,
            claimed: false,
        }
        .encode();
        let mut cur = word.load(Ordering::Acquire);
        loop {
            if let Some(h) = Hold::decode(cur).filter(|h| h.claimed) {
                return Err(HoldRefused::Busy(h));
            }
            match word.compare_exchange(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(()),
                Err(now) => cur = now,
            }
        }
    }

    /// Claims the hold of `step` (agent side): true if it was held and not
    /// claimed, and now is; from then on the worker leaves its slot alone.
    pub fn claim_hold(&self, step: u64) -> Option<Hold> {
        let h = self.held().filter(|h| h.step == step && !h.claimed)?;
        let claimed = Hold { claimed: true, ..h };
        self.ctl(ctl::HOLD)
            .compare_exchange(
                h.encode(),
                claimed.encode(),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .ok()
            .map(|_| claimed)
    }

    /// Drops `hold` if it is still the current one (either side): the agent
    /// when it is done with the slot, the worker when the step is abandoned.
    pub fn release_hold(&self, hold: Hold) -> bool {
        self.ctl(ctl::HOLD)
            .compare_exchange(hold.encode(), 0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Puts a claimed hold back to unclaimed (agent side), when not every
    /// rank's hold of the step could be claimed.
    pub fn unclaim_hold(&self, hold: Hold) -> bool {
        let open = Hold {
            claimed: false,
            ..hold
        };
        self.ctl(ctl::HOLD)
            .compare_exchange(
                hold.encode(),
                open.encode(),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    // ---- directives ----

    /// Posts a directive (agent side). Returns its sequence number.
    pub fn post(&self, d: Directive) -> u64 {
        let (kind, epoch, step) = d.encode();
        let seq = self.ctl(ctl::DIR_SEQ);
        let start = seq.fetch_add(1, Ordering::AcqRel) + 1; // odd: writing
        debug_assert!(start % 2 == 1);
        self.ctl(ctl::DIR_KIND).store(kind, Ordering::Relaxed);
        self.ctl(ctl::DIR_EPOCH).store(epoch, Ordering::Relaxed);
        self.ctl(ctl::DIR_STEP).store(step, Ordering::Relaxed);
        seq.fetch_add(1, Ordering::Release) + 1
    }

    /// The directive sequence number: one atomic load, the step-boundary
    /// fast path.
    pub fn directive_seq(&self) -> u64 {
        self.ctl(ctl::DIR_SEQ).load(Ordering::Acquire)
    }

    /// Reads the current directive and its sequence number consistently.
    pub fn directive(&self) -> (u64, Directive) {
        let seq = self.ctl(ctl::DIR_SEQ);
        loop {
            let s1 = seq.load(Ordering::Acquire);
            if s1 % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let kind = self.ctl(ctl::DIR_KIND).load(Ordering::Relaxed);
            let epoch = self.ctl(ctl::DIR_EPOCH).load(Ordering::Relaxed);
            let step = self.ctl(ctl::DIR_STEP).load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) == s1 {
                return (s1, Directive::decode(kind, epoch, step));
            }
        }
    }

    pub fn acknowledge(&self, seq: u64) {
        self.ctl(ctl::ACK).store(seq, Ordering::Release);
    }

    pub fn acknowledged(&self) -> u64 {
        self.ctl(ctl::ACK).load(Ordering::Acquire)
    }

    // ---- slots ----

    fn slot_word(&self, slot: usize, off: usize) -> &AtomicU64 {
        self.map.word(self.geometry.slot_offset(slot) + off)
    }

    /// The header of `slot` if it claims to be sealed (not verified).
    pub fn slot_info(&self, slot: usize) -> Option<SlotInfo> {
        let w = |off| self.slot_word(slot, off);
        let seq = w(hdr::SEQ).load(Ordering::Acquire);
        if seq % 2 == 1
            || w(hdr::MAGIC).load(Ordering::Relaxed) != SLOT_MAGIC
            || w(hdr::STATE).load(Ordering::Relaxed) != STATE_SEALED
        {
            return None;
        }
        let info = SlotInfo {
            slot,
            step: w(hdr::STEP).load(Ordering::Relaxed),
            epoch: w(hdr::EPOCH).load(Ordering::Relaxed),
            len: w(hdr::LEN).load(Ordering::Relaxed),
            checksum: w(hdr::SUM).load(Ordering::Relaxed),
            sealed_at_unix_ns: w(hdr::SEALED_AT).load(Ordering::Relaxed),
        };
        fence(Ordering::Acquire);
        (w(hdr::SEQ).load(Ordering::Relaxed) == seq).then_some(info)
    }

    /// Headers of every slot that claims to be sealed, newest step first.
    pub fn sealed(&self) -> Vec<SlotInfo> {
        let mut v: Vec<SlotInfo> = (0..self.geometry.slots)
            .filter_map(|s| self.slot_info(s))
            .collect();
        v.sort_by(|a, b| {
            b.step
                .cmp(&a.step)
                .then(b.sealed_at_unix_ns.cmp(&a.sealed_at_unix_ns))
        });
        v
    }

    /// The slot a new snapshot may be written to: never the newest sealed
    /// one nor a held one; an unsealed slot if there is one, else the oldest
    /// sealed. `None` when every other slot is held for the persister.
    pub fn writable_slot(&self) -> Option<usize> {
        let sealed = self.sealed();
        let held = self.held().map(|h| h.slot);
        let newest = sealed.first().map(|i| i.slot);
        let usable = |s: &usize| Some(*s) != held && Some(*s) != newest;
        if let Some(free) = (0..self.geometry.slots)
            .filter(usable)
            .find(|s| !sealed.iter().any(|i| i.slot == *s))
        {
            return Some(free);
        }
        sealed.iter().rev().map(|i| i.slot).find(usable)
    }

    /// Empties every sealed slot newer than `step` (writer side, while no
    /// commit runs). After a rollback to `step` those snapshots belong to an
    /// abandoned timeline; emptied, they are the first to be rewritten, so
    /// the slot holding `step` survives the next commit.
    pub fn discard_newer_than(&self, step: u64) {
        if let Some(h) = self.held().filter(|h| h.step > step) {
            // A claimed one too: the agent's check after reading the slot
            // sees it emptied and drops that save.
            self.release_hold(h);
        }
        for slot in 0..self.geometry.slots {
            if self.slot_info(slot).is_some_and(|i| i.step > step) {
                let w = |off| self.slot_word(slot, off);
                let seq = w(hdr::SEQ).load(Ordering::Acquire);
                w(hdr::SEQ).store(seq + 1, Ordering::Relaxed);
                fence(Ordering::Release);
                w(hdr::STATE).store(0, Ordering::Relaxed);
                w(hdr::SEQ).store(seq + 2, Ordering::Release);
            }
        }
    }

    /// Fully verifies `slot`: header, bounds and checksum. Returns its info.
    pub fn verify(&self, slot: usize) -> Result<SlotInfo, ShmError> {
        let info = self.check_header(slot)?;
        // SAFETY: reading sealed bytes; a concurrent writer would first make
        // seq odd, which the re-check below detects.
        let data = unsafe {
            self.map
                .bytes(self.geometry.slot_offset(slot) + PAGE, info.len as usize)
        };
        let sum = xxhash_rust::xxh3::xxh3_64(data);
        self.check_sum(slot, &info, sum)?;
        Ok(info)
    }

    /// Checks that the slot was not rewritten since `info` was read and that
    /// `sum` (of its data) matches the header.
    fn check_sum(&self, slot: usize, info: &SlotInfo, sum: u64) -> Result<(), ShmError> {
        let bad = |detail: String| ShmError::BadSlot {
            path: self.path.clone(),
            slot,
            detail,
        };
        if self.slot_info(slot).as_ref() != Some(info) {
            return Err(bad("overwritten while read".into()));
        }
        if sum != info.checksum {
            return Err(bad(format!(
                "checksum mismatch (data {sum:016x}, header {:016x}): corrupt",
                info.checksum
            )));
        }
        Ok(())
    }

    /// Checks `slot`'s header: magic, version, sealed state and bounds.
    fn check_header(&self, slot: usize) -> Result<SlotInfo, ShmError> {
        let bad = |detail: String| ShmError::BadSlot {
            path: self.path.clone(),
            slot,
            detail,
        };
        if slot >= self.geometry.slots {
            return Err(bad(format!("only {} slots", self.geometry.slots)));
        }
        let w = |off| self.slot_word(slot, off);
        let magic = w(hdr::MAGIC).load(Ordering::Acquire);
        if magic != SLOT_MAGIC {
            return Err(bad(if magic == 0 {
                "empty".into()
            } else {
                format!("bad magic {magic:#018x}")
            }));
        }
        if w(hdr::VERSION).load(Ordering::Relaxed) != VERSION_WORD {
            return Err(bad("unknown slot version".into()));
        }
        let seq = w(hdr::SEQ).load(Ordering::Acquire);
        let state = w(hdr::STATE).load(Ordering::Relaxed);
        if seq % 2 == 0 && state == 0 {
            return Err(bad("empty (discarded after a rollback)".into()));
        }
        if seq % 2 == 1 || state != STATE_SEALED {
            return Err(bad("torn: its writer did not finish".into()));
        }
        let info = self
            .slot_info(slot)
            .ok_or_else(|| bad("changed while read".into()))?;
        let len = usize::try_from(info.len).unwrap_or(usize::MAX);
        if len > self.geometry.capacity {
            return Err(bad(format!(
                "length {len} exceeds capacity {}",
                self.geometry.capacity
            )));
        }
        Ok(info)
    }

    /// The newest slot holding `step` that verifies, if any.
    pub fn find_step(&self, step: u64) -> Option<SlotInfo> {
        self.sealed()
            .into_iter()
            .filter(|i| i.step == step)
            .find_map(|i| self.verify(i.slot).ok())
    }

    /// Writes `parts` (concatenated) into `slot` as the snapshot of `step`,
    /// copying and hashing in one pass, and seals it. `progress` is called
    /// after each piece with the bytes copied so far; if it returns false the
    /// slot is left unsealed (torn) and the write fails: the copy cannot be
    /// trusted (a memory error hit the source meanwhile).
    ///
    /// The caller must be the store's only writer.
    pub fn write_slot(
        &self,
        slot: usize,
        rank: u64,
        step: u64,
        epoch: u64,
        parts: &[&[u8]],
        progress: &mut dyn FnMut(usize, usize) -> bool,
    ) -> Result<SlotInfo, ShmError> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len > self.geometry.capacity {
            return Err(ShmError::TooLarge {
                path: self.path.clone(),
                len,
                capacity: self.geometry.capacity,
            });
        }
        let w = |off| self.slot_word(slot, off);
        // Open: seq odd, state writing, before any data byte changes.
        let seq = w(hdr::SEQ).load(Ordering::Acquire);
        let open = if seq % 2 == 0 { seq + 1 } else { seq + 2 };
        w(hdr::SEQ).store(open, Ordering::Relaxed);
        w(hdr::STATE).store(STATE_WRITING, Ordering::Relaxed);
        w(hdr::VERSION).store(VERSION_WORD, Ordering::Relaxed);
        w(hdr::MAGIC).store(SLOT_MAGIC, Ordering::Relaxed);
        fence(Ordering::Release);

        // SAFETY: this slot is not the newest sealed one and we are the only
        // writer; readers see seq odd and ignore its bytes.
        let dst = unsafe {
            self.map
                .bytes_mut(self.geometry.slot_offset(slot) + PAGE, len)
        };
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut at = 0;
        for part in parts {
            for piece in part.chunks(COPY_PIECE) {
                let out = &mut dst[at..at + piece.len()];
                out.copy_from_slice(piece);
                hasher.update(out);
                at += piece.len();
                if !progress(at, len) {
                    return Err(ShmError::BadSlot {
                        path: self.path.clone(),
                        slot,
                        detail: "copy abandoned: its source was hit by a memory error".into(),
                    });
                }
            }
        }
        let info = SlotInfo {
            slot,
            step,
            epoch,
            len: len as u64,
            checksum: hasher.digest(),
            sealed_at_unix_ns: now_unix_ns(),
        };
        // Seal: header fields, then state and an even seq, released.
        w(hdr::RANK).store(rank, Ordering::Relaxed);
        w(hdr::STEP).store(step, Ordering::Relaxed);
        w(hdr::EPOCH).store(epoch, Ordering::Relaxed);
        w(hdr::LEN).store(info.len, Ordering::Relaxed);
        w(hdr::SUM).store(info.checksum, Ordering::Relaxed);
        w(hdr::JOB).store(self.job_hash(), Ordering::Relaxed);
        w(hdr::SEALED_AT).store(info.sealed_at_unix_ns, Ordering::Relaxed);
        w(hdr::STATE).store(STATE_SEALED, Ordering::Relaxed);
        w(hdr::SEQ).store(open + 1, Ordering::Release);
        Ok(info)
    }

    /// Copies a verified slot's bytes into `out` (which must be exactly the
    /// slot's length), verifying the checksum of what was copied.
    pub fn read_slot(&self, slot: usize, out: &mut [&mut [u8]]) -> Result<SlotInfo, ShmError> {
        let info = self.check_header(slot)?;
        let total: usize = out.iter().map(|o| o.len()).sum();
        let bad = |detail: String| ShmError::BadSlot {
            path: self.path.clone(),
            slot,
            detail,
        };
        if total as u64 != info.len {
            return Err(bad(format!(
                "holds {} bytes, the state has {total}",
                info.len
            )));
        }
        // SAFETY: as in `verify`; the checksum of the copy is checked below.
        let src = unsafe {
            self.map
                .bytes(self.geometry.slot_offset(slot) + PAGE, total)
        };
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut at = 0;
        for o in out.iter_mut() {
            for piece in o.chunks_mut(COPY_PIECE) {
                piece.copy_from_slice(&src[at..at + piece.len()]);
                hasher.update(piece);
                at += piece.len();
            }
        }
        self.check_sum(slot, &info, hasher.digest())?;
        Ok(info)
    }

    /// Read-only view of a verified slot's bytes (agent side: dumps).
    ///
    /// # Safety
    /// The caller must make sure the slot is not rewritten while the slice
    /// is in use (the worker is paused or gone), or re-verify afterwards.
    pub unsafe fn slot_bytes(&self, slot: usize) -> Result<&[u8], ShmError> {
        let info = self.verify(slot)?;
        // SAFETY: verified bounds; rewrites are excluded by the caller.
        Ok(unsafe {
            self.map
                .bytes(self.geometry.slot_offset(slot) + PAGE, info.len as usize)
        })
    }

    /// Flips one bit of a slot's data (test and fault-injection use only:
    /// simulates memory corruption).
    pub fn corrupt_slot_byte(&self, slot: usize, offset: usize) {
        let off = self.geometry.slot_offset(slot) + PAGE + (offset % self.geometry.capacity);
        let word = off & !7;
        self.map
            .word(word)
            .fetch_xor(1 << ((off % 8) * 8), Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn store(dir: &Path, len: usize) -> Store {
        Store::create(&store_path(dir, 3), 3, Geometry::new(2, len), 7, 9).unwrap()
    }

    #[test]
    fn create_open_and_mode() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let s = store(d.path(), 10_000);
        let mode = std::fs::metadata(s.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let o = Store::open(s.path()).unwrap();
        assert_eq!((o.rank(), o.layout_hash(), o.job_hash()), (3, 7, 9));
        assert_eq!(o.geometry(), s.geometry());
        std::fs::write(d.path().join("junk"), vec![1u8; 8192]).unwrap();
        let e = Store::open(&d.path().join("junk")).unwrap_err().to_string();
        assert!(e.contains("junk") && e.contains("bad magic"), "{e}");
    }

    #[test]
    fn seal_alternates_and_never_touches_the_newest() {
        let d = tempfile::tempdir().unwrap();
        let s = store(d.path(), 1000);
        let data: Vec<u8> = (0..1000).map(|i| i as u8).collect();
        let mut slots = Vec::new();
        for step in 1..=5u64 {
            let slot = s.writable_slot().unwrap();
            if let Some(newest) = s.sealed().first() {
                assert_ne!(slot, newest.slot);
            }
            s.write_slot(
                slot,
                3,
                step,
                0,
                &[&data[..400], &data[400..]],
                &mut |_, _| true,
            )
            .unwrap();
            slots.push(slot);
        }
        assert_eq!(slots, vec![0, 1, 0, 1, 0]);
        let sealed = s.sealed();
        assert_eq!(
            sealed.iter().map(|i| i.step).collect::<Vec<_>>(),
            vec![5, 4]
        );
        let mut a = vec![0u8; 300];
        let mut b = vec![0u8; 700];
        s.read_slot(sealed[0].slot, &mut [&mut a, &mut b]).unwrap();
        assert_eq!([a, b].concat(), data);
    }

    #[test]
    fn torn_and_bit_flipped_slots_are_rejected() {
        let d = tempfile::tempdir().unwrap();
        let s = store(d.path(), 5000);
        let data = vec![7u8; 5000];
        s.write_slot(0, 3, 1, 0, &[&data], &mut |_, _| true)
            .unwrap();
        // A writer that dies mid-copy: the progress hook panics halfway.
        let torn = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            s.write_slot(1, 3, 2, 0, &[&data], &mut |at, _| {
                if at > 0 {
                    panic!("killed mid-copy")
                }
                true
            })
        }));
        assert!(torn.is_err());
        let e = s.verify(1).unwrap_err().to_string();
        assert!(e.contains("slot 1") && e.contains("torn"), "{e}");
        assert_eq!(s.sealed().len(), 1);
        assert_eq!(s.find_step(2), None);
        assert_eq!(s.find_step(1).unwrap().slot, 0);
        // The torn slot is the one rewritten next.
        assert_eq!(s.writable_slot(), Some(1));
        s.write_slot(1, 3, 2, 0, &[&data], &mut |_, _| true)
            .unwrap();
        s.corrupt_slot_byte(1, 1234);
        let e = s.verify(1).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch"), "{e}");
        assert_eq!(s.find_step(2), None);
        assert_eq!(s.find_step(1).unwrap().slot, 0);
    }

    #[test]
    fn rollback_discards_the_abandoned_timeline() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::create(&store_path(d.path(), 0), 0, Geometry::new(3, 64), 1, 1).unwrap();
        let seal = |step: u64, epoch: u64| {
            let slot = s.writable_slot().unwrap();
            s.write_slot(slot, 0, step, epoch, &[&[step as u8; 64]], &mut |_, _| true)
                .unwrap();
        };
        for step in 3..=5 {
            seal(step, 0);
        }
        s.discard_newer_than(3);
        assert_eq!(
            s.sealed().iter().map(|i| i.step).collect::<Vec<_>>(),
            vec![3]
        );
        // Redoing steps 4 and 5 keeps step 3 until newer steps exist.
        for step in 4..=5 {
            seal(step, 1);
        }
        assert_eq!(
            s.sealed().iter().map(|i| i.step).collect::<Vec<_>>(),
            vec![5, 4, 3]
        );
    }

    #[test]
    fn held_slots_are_kept_until_released() {
        let d = tempfile::tempdir().unwrap();
        let s = store(d.path(), 64);
        let w = Store::open(s.path()).unwrap();
        let seal = |step: u64| {
            let slot = w.writable_slot()?;
            w.write_slot(slot, 3, step, 0, &[&[step as u8; 64]], &mut |_, _| true)
                .unwrap();
            Some(slot)
        };
        let slot10 = seal(10).unwrap();
        w.hold(10, slot10).unwrap();
        // With two slots, one newest and one held, nothing is writable.
        seal(11).unwrap();
        assert_eq!(seal(12), None);
        // An unclaimed hold is replaced by a newer step's.
        let slot20 = {
            let h = s.held().unwrap();
            assert_eq!((h.step, h.slot, h.claimed), (10, slot10, false));
            w.release_hold(h);
            seal(20).unwrap()
        };
        w.hold(20, slot20).unwrap();
        assert_eq!(s.claim_hold(10), None, "no longer held");
        let claimed = s.claim_hold(20).unwrap();
        assert!(claimed.claimed && claimed.slot == slot20);
        // Claimed: the worker cannot move it, nor write its slot.
        seal(21).unwrap();
        assert_eq!(w.hold(30, 1 - slot20), Err(HoldRefused::Busy(claimed)));
        assert_eq!(seal(22), None);
        assert_eq!(s.verify(slot20).unwrap().step, 20);
        assert!(s.release_hold(claimed));
        assert_eq!(s.held(), None);
        assert_eq!(seal(22), Some(slot20));
        // A rollback below a held step drops the hold.
        let slot23 = seal(23).unwrap();
        w.hold(23, slot23).unwrap();
        let c = s.claim_hold(23).unwrap();
        assert!(s.unclaim_hold(c));
        w.discard_newer_than(22);
        assert_eq!(s.held(), None);
        assert!(!s.release_hold(c));
    }

    #[test]
    fn directives_round_trip() {
        let d = tempfile::tempdir().unwrap();
        let s = store(d.path(), 10);
        assert_eq!(s.directive(), (0, Directive::None));
        let seq = s.post(Directive::Pause { epoch: 2 });
        assert_eq!(s.directive(), (seq, Directive::Pause { epoch: 2 }));
        let seq2 = s.post(Directive::Resume { epoch: 2, step: 40 });
        assert!(seq2 > seq && seq2.is_multiple_of(2));
        let w = Store::open(s.path()).unwrap();
        assert_eq!(
            w.directive(),
            (seq2, Directive::Resume { epoch: 2, step: 40 })
        );
        w.acknowledge(seq2);
        assert_eq!(s.acknowledged(), seq2);
    }

    proptest! {
        #[test]
        fn slot_offsets_never_overlap(slots in 2usize..=MAX_SLOTS, len in 0usize..1_000_000) {
            let g = Geometry::new(slots, len);
            prop_assert!(g.capacity >= len && g.capacity.is_multiple_of(PAGE));
            for i in 0..slots {
                let start = g.slot_offset(i);
                prop_assert_eq!(start % PAGE, 0);
                prop_assert!(start >= PAGE);
                prop_assert_eq!(g.slot_offset(i + 1), start + PAGE + g.capacity);
            }
            prop_assert_eq!(g.file_len(), g.slot_offset(slots));
        }

        #[test]
        fn garbage_store_files_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..3 * PAGE)) {
            let d = tempfile::tempdir().unwrap();
            let p = d.path().join("x.shm");
            std::fs::write(&p, &bytes).unwrap();
            // Either refused, or (vanishingly unlikely) a valid header; never a panic.
            let _ = Store::open(&p);
        }
    }
}
