//! The shared-memory snapshot store of one rank: a control page and `K ≥ 2`
//! snapshot slots in one file under `/dev/shm/hatrain/<job>/`.
//!
//! The agent creates the file (mode 0600) and owns it, so it outlives the
//! worker; the worker maps it to commit snapshots and read directives; the
//! agent maps it to read slots (for s\*, checkpoints) and to write
//! directives. Every word, bit and packing of the protocol is defined here
//! once: the layout in [`page`] and the slot header in [`slot`], and one
//! module per protocol on the page ([`directive`], [`hold`], [`fault`],
//! [`kept`]).
//!
//! ```text
//! file: rank_NNNNN.shm
//! 0            4096           8192          8192+C        ...
//! +------------+--------------+-------------+-------------+------------
//! | control    | slot 0 header| slot 0 data | slot 1 hdr  | slot 1 data ...
//! | page       | (4096 B)     | (C bytes)   |             |
//! +------------+--------------+-------------+-------------+------------
//!
//! control page (every field a little-endian u64, accessed atomically):
//!   0 magic "HTRCTL\0\2"  8 version (major<<16|minor)  16 rank  24 slots K
//!  32 slot capacity C    40 layout hash   48 job hash
//!  56 epoch whose communicator the rank could not rebuild
//!  64 pid                72 phase         80 last completed step
//!  88 epoch              96 heartbeat    104 restart count
//! 112 1 while the rank waits in a collective (on its peers), else 0
//! 120 the peer it could not reach then (u64::MAX: unknown)
//! 128 directive seq     136 directive kind  144 directive epoch
//! 152 directive step    160 acknowledged directive seq
//! 168 fault flags       176 fault part      184 fault offset
//! 192 last commit ns    200 last commit blocking ns  208 commits
//! 216 injection kind    224 injection part  232 injection offset
//! 240 step the injection waits for (0: the next step)
//! 248 persist hold: 0 none, else step << 16 | claimed << 8 | (slot + 1)
//! 256 directive rank    264 directive world (a reshape's place; 2.1)
//! 272 steps held        280 held ns total   288 held ns max  296 held ns last
//! 304..432 held-time histogram: 16 counts, bucket k below 16 µs << k (2.2)
//! 432 sealed snapshots' copy ns total   440 their bytes   448 the commit
//!     thread's CPU ns for them   456 snapshots skipped (missed their window)
//! 464 updates that waited for a copy after too many misses
//! 472 snapshots sealed
//! 480 step kept for the replicas, held everywhere; 488 the step to be
//!     kept next (each 0: none, else step + 1) (2.3)
//! 496 snapshots not taken for want of a slot (2.3)
//! 504 steps timed   512.. ns in each phase, summed over them: data,
//!     compute, collective, update, and the whole step (2.4)
//! 552 a Python worker's garbage collections: their ns   560 how many
//! 568 the sum of the steps they ran in (2.5)
//!
//! slot header (u64 fields):
//!   0 magic "HTRSLOT\2"   8 version   16 seq (odd while written)
//!  24 state (0 empty, 1 writing, 2 sealed)   32 rank   40 step   48 epoch
//!  56 length   64 job hash   72 layout hash   80 sealed at (unix ns)
//!  88 checksum: xxh3-64 of the data, then of words 32..88
//! ```
//!
//! The sealing invariant is in [`slot`], the directive sequence lock in
//! [`directive`], persist holds in [`hold`] and faults and injections in
//! [`fault`].

mod copy;
mod directive;
mod fault;
mod hold;
mod kept;
mod mapping;
mod page;
mod slot;
mod timing;

pub use directive::Directive;
pub use fault::{FaultFlags, Injection, UceSite};
pub use hold::{Hold, HoldRefused};
pub use kept::Kept;
pub use page::{CommitStats, ControlPage, HELD_BUCKETS, HeldStats, Phase, held_bucket_le_ns};
pub use slot::{HeaderWord, Receiving, SLOT_MAGIC, SlotInfo};
pub use timing::{StepPhase, StepTimes, StepTimesReport};

use mapping::Mapping;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

pub const PAGE: usize = 4096;
pub const CONTROL_MAGIC: u64 = u64::from_le_bytes(*b"HTRCTL\0\x02");
pub const VERSION: (u16, u16) = (2, 5);
const VERSION_WORD: u64 = ((VERSION.0 as u64) << 16) | VERSION.1 as u64;
/// Most slots a store may have.
pub const MAX_SLOTS: usize = 16;

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
    #[error(
        "{path}: cannot reserve {bytes} bytes for the snapshot store: {source} (choose a larger --shm-root or fewer --snapshot-slots)"
    )]
    NoSpace {
        path: PathBuf,
        bytes: u64,
        #[source]
        source: io::Error,
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

/// One rank's store, mapped.
#[derive(Debug)]
pub struct Store {
    path: PathBuf,
    map: Mapping,
    geometry: Geometry,
}

/// Stable 64-bit identity of a string (job ids).
pub fn hash_str(s: &str) -> u64 {
    twox_hash::XxHash3_64::oneshot(s.as_bytes())
}

/// Path of `rank`'s store under `dir`.
pub fn store_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank_{rank:05}.shm"))
}

impl Store {
    /// Creates (or re-creates) the store file with mode 0600, reserves its
    /// pages and pre-faults them, so later commits copy into touched memory
    /// and a full file system is an error here, never a SIGBUS later. A
    /// symlink at `path` is refused, and a creation that fails removes the
    /// file.
    pub fn create(
        path: &Path,
        rank: usize,
        geometry: Geometry,
        layout_hash: u64,
        job_hash: u64,
    ) -> Result<Self, ShmError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(|source| ShmError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        Self::create_in(file, path, rank, geometry, layout_hash, job_hash)
    }

    /// As [`Store::create`], in a file the caller opened (the agent opens it
    /// relative to a folder it holds); `path` names it in messages, and is
    /// removed if the creation fails.
    pub fn create_in(
        file: std::fs::File,
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
            let _ = std::fs::remove_file(path);
            return Err(ShmError::Format {
                path: path.to_path_buf(),
                detail: format!(
                    "{} slots requested; 2 to {MAX_SLOTS} allowed",
                    geometry.slots
                ),
            });
        }
        file.set_len(0).map_err(io_err)?;
        let created = (|| {
            let len = geometry.file_len();
            // posix_fallocate(3) allocates every block now: on a tmpfs that
            // is short of space it fails with ENOSPC, where a sparse file
            // would fail later with SIGBUS on first touch.
            // SAFETY: a plain syscall on a file descriptor we own.
            let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
            if rc != 0 {
                return Err(ShmError::NoSpace {
                    path: path.to_path_buf(),
                    bytes: len as u64,
                    source: io::Error::from_raw_os_error(rc),
                });
            }
            let map = Mapping::map(&file, len, false).map_err(io_err)?;
            if !map.populate_write() {
                // Older kernels lack MADV_POPULATE_WRITE: touch each page
                // (safe now that every block is allocated).
                for off in (0..map.len()).step_by(PAGE) {
                    map.at::<std::sync::atomic::AtomicU64>(off)
                        .fetch_add(0, Ordering::Relaxed);
                }
            }
            Ok(map)
        })();
        let map = match created {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_file(path);
                return Err(e);
            }
        };
        let store = Self {
            path: path.to_path_buf(),
            map,
            geometry,
        };
        let page = store.page();
        page.version.store(VERSION_WORD, Ordering::Relaxed);
        page.rank.store(rank as u64, Ordering::Relaxed);
        page.slots.store(geometry.slots as u64, Ordering::Relaxed);
        page.capacity
            .store(geometry.capacity as u64, Ordering::Relaxed);
        page.layout.store(layout_hash, Ordering::Relaxed);
        page.job.store(job_hash, Ordering::Relaxed);
        page.magic.store(CONTROL_MAGIC, Ordering::Release);
        Ok(store)
    }

    /// Opens an existing store, checking its control page, with every page
    /// mapped now (its writer's commits copy into mapped memory).
    pub fn open(path: &Path) -> Result<Self, ShmError> {
        Self::open_mapped(path, true)
    }

    /// Opens an existing store, as [`Store::open`], with its pages mapped
    /// as they are touched, not all of them ahead: for a reader of one
    /// slot, or a writer that has to be quick to start.
    pub fn open_lazily(path: &Path) -> Result<Self, ShmError> {
        Self::open_mapped(path, false)
    }

    fn open_mapped(path: &Path, populate: bool) -> Result<Self, ShmError> {
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
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .map_err(io_err)?;
        let meta = file.metadata().map_err(io_err)?;
        if !meta.file_type().is_file() {
            return Err(fmt("not a regular file".into()));
        }
        let len = usize::try_from(meta.len()).map_err(|_| fmt("file too large".into()))?;
        if len < PAGE {
            return Err(fmt(format!("{len} bytes, smaller than a control page")));
        }
        let map = Mapping::map(&file, len, populate).map_err(io_err)?;
        let page: &ControlPage = map.at(0);
        let magic = page.magic.load(Ordering::Acquire);
        if magic != CONTROL_MAGIC {
            return Err(fmt(format!("bad magic {magic:#018x}")));
        }
        let version = page.version.load(Ordering::Relaxed);
        if version >> 16 != VERSION.0 as u64 || version & 0xffff > VERSION.1 as u64 {
            return Err(fmt(format!(
                "version {}.{} is not readable by this build ({}.{})",
                version >> 16,
                version & 0xffff,
                VERSION.0,
                VERSION.1
            )));
        }
        let slots = page.slots.load(Ordering::Relaxed);
        let capacity = page.capacity.load(Ordering::Relaxed);
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
        if geometry
            .capacity
            .checked_add(PAGE)
            .and_then(|s| s.checked_mul(geometry.slots))
            .and_then(|s| s.checked_add(PAGE))
            != Some(len)
        {
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

    /// The control page.
    pub fn page(&self) -> &ControlPage {
        self.map.at(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn store(dir: &Path, len: usize) -> Store {
        Store::create(&store_path(dir, 3), 3, Geometry::new(2, len), 7, 9).unwrap()
    }

    /// Seals `data` as rank 3's snapshot of `step` in a writable slot.
    pub(super) fn seal(s: &Store, step: u64, data: &[u8]) -> usize {
        let slot = s.writable_slot().unwrap();
        s.write_slot(slot, 3, step, 0, &[data], &mut |_, _| true)
            .unwrap();
        slot
    }

    #[test]
    fn a_directive_posted_in_one_mapping_wakes_a_waiter_in_another() {
        use std::time::{Duration, Instant};
        let d = tempfile::tempdir().unwrap();
        let agent = store(d.path(), 64);
        let worker = Store::open(&store_path(d.path(), 3)).unwrap();
        // A sequence that has moved on returns at once.
        let seen = worker.page().directive_seq();
        agent.page().post(Directive::Pause {
            epoch: 1,
            upto: None,
        });
        let t = Instant::now();
        worker.page().wait_directive(seen, Duration::from_secs(60));
        assert!(t.elapsed() < Duration::from_secs(60));
        // A waiter on the current sequence sleeps until the next post: the
        // one wait returns with the post made.
        let seen = worker.page().directive_seq();
        let woke = std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let t = Instant::now();
                worker.page().wait_directive(seen, Duration::from_secs(60));
                (t.elapsed(), worker.page().directive())
            });
            std::thread::sleep(Duration::from_millis(100));
            agent.page().post(Directive::Stop);
            waiter.join().unwrap()
        });
        assert_eq!(woke.1, (seen + 2, Directive::Stop), "{woke:?}");
        assert!(woke.0 < Duration::from_secs(60), "{woke:?}");
    }

    #[test]
    fn a_snapshot_received_in_pieces_seals_identical_to_its_source_and_a_flipped_bit_never_seals() {
        let d = tempfile::tempdir().unwrap();
        let src = store(d.path(), 10_000);
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let slot = seal(&src, 12, &data);
        let info = src.verify(slot).unwrap();
        let replica_path = d.path().join("replica_00003.shm");
        let dst = Store::create(&replica_path, 3, src.geometry(), 7, 9).unwrap();
        let receive = |flip: Option<usize>| {
            let slot = dst.writable_slot().unwrap();
            let mut r = dst.receive(slot, info.len).unwrap();
            for piece in data.chunks(4096) {
                let mut piece = piece.to_vec();
                if let Some(at) = flip.filter(|&at| {
                    r.received() as usize <= at && at < r.received() as usize + piece.len()
                }) {
                    piece[at - r.received() as usize] ^= 1;
                }
                r.write(&dst, &piece).unwrap();
            }
            assert!(r.write(&dst, &[0]).is_err(), "past the end");
            r.seal(
                &dst,
                3,
                12,
                info.epoch,
                info.sealed_at_unix_ns,
                info.checksum,
            )
        };
        let e = receive(Some(5000)).unwrap_err().to_string();
        assert!(e.contains("corrupted on the way"), "{e}");
        assert!(
            dst.verified_steps().0.is_empty(),
            "a corrupt replica is never sealed"
        );
        let sealed = receive(None).unwrap();
        assert_eq!(dst.verify(sealed.slot).unwrap().checksum, info.checksum);
        let mut back = vec![0u8; data.len()];
        dst.read_slot(sealed.slot, &mut [&mut back]).unwrap();
        assert_eq!(back, data);
        // Short of bytes: not sealed.
        let slot = dst.writable_slot().unwrap();
        let mut r = dst.receive(slot, info.len).unwrap();
        r.write(&dst, &data[..100]).unwrap();
        assert!(r.seal(&dst, 3, 13, 0, 0, info.checksum).is_err());
        assert_eq!(dst.verified_steps().0, vec![12]);
    }

    #[test]
    fn a_store_filled_from_a_replica_holds_its_snapshots_identically() {
        let d = tempfile::tempdir().unwrap();
        let src = store(d.path(), 10_000);
        let empty = Store::create(&d.path().join("e.shm"), 3, src.geometry(), 7, 9).unwrap();
        let dst = Store::create(&d.path().join("d.shm"), 3, src.geometry(), 7, 9).unwrap();
        assert!(dst.fill_from(&empty).is_err(), "nothing to copy");
        let old: Vec<u8> = vec![1; 10_000];
        let new: Vec<u8> = (0..10_000u32).map(|i| (i * 3) as u8).collect();
        seal(&src, 4, &old);
        let slot = seal(&src, 5, &new);
        let info = dst.fill_from(&src).unwrap();
        assert_eq!(info.step, 5);
        assert_eq!(info.checksum, src.verify(slot).unwrap().checksum);
        let mut back = vec![0u8; new.len()];
        dst.read_slot(info.slot, &mut [&mut back]).unwrap();
        assert_eq!(back, new);
        // The older one too (it may be the step kept for the replicas),
        // and the newest stays the newest.
        let older = dst.find_step(4).unwrap();
        dst.read_slot(older.slot, &mut [&mut back]).unwrap();
        assert_eq!(back, old);
        assert_eq!(dst.sealed()[0].step, 5);
        // Another job's store: its checksum cannot match, nothing seals.
        let other = Store::create(&d.path().join("o.shm"), 3, src.geometry(), 8, 9).unwrap();
        assert!(other.fill_from(&src).is_err());
        assert!(other.verified_steps().0.is_empty());
    }

    #[test]
    fn create_open_and_mode() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let s = store(d.path(), 10_000);
        let mode = std::fs::metadata(s.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let o = Store::open(s.path()).unwrap();
        let p = o.page();
        assert_eq!((p.rank(), p.layout_hash(), p.job_hash()), (3, 7, 9));
        assert_eq!(o.geometry(), s.geometry());
        std::fs::write(d.path().join("junk"), vec![1u8; 8192]).unwrap();
        let e = Store::open(&d.path().join("junk")).unwrap_err().to_string();
        assert!(e.contains("junk") && e.contains("bad magic"), "{e}");
        // A symlink planted where a store is to be created is not followed.
        let target = d.path().join("target");
        std::fs::write(&target, b"keep").unwrap();
        let link = store_path(d.path(), 4);
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(Store::create(&link, 4, Geometry::new(2, 10), 1, 1).is_err());
        assert!(Store::open(&link).is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
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
        let (ok, rejected) = s.verified_steps();
        assert_eq!((ok, rejected.len()), (vec![1], 1));
    }

    #[test]
    fn a_header_that_lies_is_rejected() {
        let d = tempfile::tempdir().unwrap();
        for (word, value, want) in [
            (HeaderWord::Step, 38, "checksum mismatch"),
            (HeaderWord::Epoch, 5, "checksum mismatch"),
            (HeaderWord::Len, 100, "checksum mismatch"),
            (HeaderWord::Len, 1 << 40, "exceeds capacity"),
            (HeaderWord::Rank, 2, "names rank 2"),
            (HeaderWord::Checksum, 0, "checksum mismatch"),
        ] {
            let s = store(d.path(), 500);
            seal(&s, 38, &[1; 500]);
            let slot = seal(&s, 39, &[2; 500]);
            s.tamper_header(slot, word, value);
            let e = s.verify(slot).unwrap_err().to_string();
            assert!(e.contains(want), "{word:?}={value}: {e}");
            let mut out = vec![0u8; 500];
            assert!(s.read_slot(slot, &mut [&mut out]).is_err());
            // The older slot still verifies and is what s* falls back to.
            assert_eq!(s.verified_steps().0, vec![38], "{word:?}");
        }
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
        let (sp, wp) = (s.page(), w.page());
        let seal = |step: u64| {
            let slot = w.writable_slot()?;
            w.write_slot(slot, 3, step, 0, &[&[step as u8; 64]], &mut |_, _| true)
                .unwrap();
            Some(slot)
        };
        let slot10 = seal(10).unwrap();
        wp.hold(10, slot10).unwrap();
        // With two slots, one newest and one held, nothing is writable.
        seal(11).unwrap();
        assert_eq!(seal(12), None);
        // An unclaimed hold is replaced by a newer step's.
        let slot20 = {
            let h = sp.held().unwrap();
            assert_eq!((h.step, h.slot, h.claimed), (10, slot10, false));
            wp.release_hold(h);
            seal(20).unwrap()
        };
        wp.hold(20, slot20).unwrap();
        assert_eq!(sp.claim_hold(10), None, "no longer held");
        let claimed = sp.claim_hold(20).unwrap();
        assert!(claimed.claimed && claimed.slot == slot20);
        // Claimed: the worker cannot move it, nor write its slot.
        seal(21).unwrap();
        assert_eq!(wp.hold(30, 1 - slot20), Err(HoldRefused::Busy(claimed)));
        assert_eq!(seal(22), None);
        assert_eq!(s.verify(slot20).unwrap().step, 20);
        assert!(sp.release_hold(claimed));
        assert_eq!(sp.held(), None);
        assert_eq!(seal(22), Some(slot20));
        // A rollback below a held step drops the hold.
        let slot23 = seal(23).unwrap();
        wp.hold(23, slot23).unwrap();
        let c = sp.claim_hold(23).unwrap();
        assert!(sp.unclaim_hold(c));
        w.discard_newer_than(22);
        assert_eq!(sp.held(), None);
        assert!(!sp.release_hold(c));
    }

    #[test]
    fn directives_and_injections_cross_the_page() {
        let d = tempfile::tempdir().unwrap();
        let s = store(d.path(), 10);
        let w = Store::open(s.path()).unwrap();
        let (a, k) = (s.page(), w.page());
        assert_eq!(a.directive(), (0, Directive::None));
        assert_eq!(a.acknowledged_directive(), None);
        let seq = a.post(Directive::Pause {
            epoch: 2,
            upto: Some(7),
        });
        assert_eq!(
            k.directive(),
            (
                seq,
                Directive::Pause {
                    epoch: 2,
                    upto: Some(7)
                }
            )
        );
        k.acknowledge(seq);
        assert_eq!(
            a.acknowledged_directive(),
            Some(Directive::Pause {
                epoch: 2,
                upto: Some(7)
            })
        );
        let seq2 = a.post(Directive::Resume { epoch: 2, step: 40 });
        assert!(seq2 > seq && seq2.is_multiple_of(2));
        assert_eq!(a.acknowledged_directive(), None, "not yet acknowledged");
        assert!(a.inject(
            Injection::Uce {
                part: 2,
                offset: 4096
            },
            7
        ));
        assert!(!a.inject(Injection::Crash, 0), "one pending at a time");
        assert_eq!(k.take_injection(6), None, "waits for its step");
        assert_eq!(
            k.take_injection(7),
            Some(Injection::Uce {
                part: 2,
                offset: 4096
            })
        );
        assert_eq!(k.take_injection(8), None);
        k.record_uce(UceSite {
            part: 2,
            offset: 4100,
        });
        let (flags, site) = a.faults();
        assert!(flags.contains(FaultFlags::UCE_REPAIRABLE));
        assert_eq!((site.part, site.offset), (2, 4100));
        a.clear_faults(FaultFlags::UCE_REPAIRABLE);
        assert!(a.faults().0.is_empty());
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

        #[test]
        fn garbage_in_a_valid_store_is_never_trusted(words in proptest::collection::vec((0usize..(2 * PAGE / 8), any::<u64>()), 1..20)) {
            let d = tempfile::tempdir().unwrap();
            let s = store(d.path(), 64);
            seal(&s, 1, &[5; 64]);
            // Scribble over slot 0's header and data and slot 1's header.
            for (i, v) in words {
                let off = PAGE + i * 8;
                let w: &std::sync::atomic::AtomicU64 = s.map.at(off);
                w.store(v, Ordering::Relaxed);
            }
            for slot in 0..2 {
                if let Ok(info) = s.verify(slot) {
                    // Only an untouched sealed slot can still verify.
                    prop_assert_eq!((info.step, info.len), (1, 64));
                }
            }
            let _ = s.writable_slot();
            let _ = s.verified_steps();
        }
    }
}
