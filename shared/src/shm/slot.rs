//! Snapshot slots: each a header page and `capacity` data bytes.
//!
//! INVARIANT: a writer never touches the newest sealed slot
//! ([`Store::writable_slot`]), and seals a slot by writing its header last:
//! `seq` goes odd and `state` to writing first; then the data is copied and
//! hashed in one pass; then rank, step, epoch, length, identities and the
//! checksum are stored; then `state` becomes sealed and `seq` even, with
//! release ordering. Whatever instant the writer dies at, another slot still
//! holds a sealed, verifiable snapshot.
//!
//! The checksum is XXH3-64 (twox-hash, which picks AVX2 at run time) over
//! the data followed by the header words it
//! vouches for (rank, step, epoch, length, job hash, layout hash, sealed
//! at), so a header changed after sealing fails verification as surely as
//! a flipped data bit. Readers ([`Store::verify`], [`Store::read_slot`])
//! check magic, version, seq, state, bounds, identities and the checksum,
//! and reject anything else.

use super::mapping::Words;
use super::{PAGE, ShmError, Store, VERSION_WORD};
use std::hash::Hasher;
use std::sync::atomic::{AtomicU64, Ordering, fence};
use twox_hash::XxHash3_64;

pub const SLOT_MAGIC: u64 = u64::from_le_bytes(*b"HTRSLOT\x02");
/// Bytes copied and hashed per piece: the source piece is still in cache
/// when it is hashed, so the data is read from memory once.
const COPY_PIECE: usize = 64 * 1024;
/// A slot this large or larger is read by two threads, one copying and
/// one hashing ([`Store::read_slot`]).
const PARALLEL_READ: usize = 64 << 20;

const STATE_EMPTY: u64 = 0;
const STATE_WRITING: u64 = 1;
const STATE_SEALED: u64 = 2;

/// A slot's header page, word by word (see the diagram in [`super`]).
#[repr(C)]
#[derive(Debug)]
pub(super) struct SlotHeader {
    magic: AtomicU64,
    version: AtomicU64,
    seq: AtomicU64,
    state: AtomicU64,
    rank: AtomicU64,
    step: AtomicU64,
    epoch: AtomicU64,
    len: AtomicU64,
    job: AtomicU64,
    layout: AtomicU64,
    sealed_at: AtomicU64,
    checksum: AtomicU64,
}

// SAFETY: repr(C), only AtomicU64 fields.
unsafe impl Words for SlotHeader {}

const _: () = {
    use std::mem::offset_of;
    assert!(offset_of!(SlotHeader, seq) == 16);
    assert!(offset_of!(SlotHeader, step) == 40);
    assert!(offset_of!(SlotHeader, len) == 56);
    assert!(offset_of!(SlotHeader, checksum) == 88);
    assert!(size_of::<SlotHeader>() <= PAGE);
};

/// A header word that a fault-injection test may overwrite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderWord {
    Rank,
    Step,
    Epoch,
    Len,
    Checksum,
}

/// What a slot holds, read from its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SlotInfo {
    pub slot: usize,
    pub rank: u64,
    pub step: u64,
    pub epoch: u64,
    pub len: u64,
    pub checksum: u64,
    pub sealed_at_unix_ns: u64,
}

fn now_unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl Store {
    fn header(&self, slot: usize) -> &SlotHeader {
        self.map.at(self.geometry.slot_offset(slot))
    }

    fn data_offset(&self, slot: usize) -> usize {
        self.geometry.slot_offset(slot) + PAGE
    }

    /// Feeds the header words the checksum covers into `h`, after the data.
    fn sum_header(&self, h: &mut XxHash3_64, info: &SlotInfo) -> u64 {
        let page = self.page();
        for w in [
            info.rank,
            info.step,
            info.epoch,
            info.len,
            page.job_hash(),
            page.layout_hash(),
            info.sealed_at_unix_ns,
        ] {
            h.write(&w.to_le_bytes());
        }
        h.finish()
    }

    /// The header of `slot` if it claims to be sealed (not verified).
    pub fn slot_info(&self, slot: usize) -> Option<SlotInfo> {
        if slot >= self.geometry.slots {
            return None;
        }
        let h = self.header(slot);
        let seq = h.seq.load(Ordering::Acquire);
        if seq % 2 == 1
            || h.magic.load(Ordering::Relaxed) != SLOT_MAGIC
            || h.state.load(Ordering::Relaxed) != STATE_SEALED
        {
            return None;
        }
        let info = SlotInfo {
            slot,
            rank: h.rank.load(Ordering::Relaxed),
            step: h.step.load(Ordering::Relaxed),
            epoch: h.epoch.load(Ordering::Relaxed),
            len: h.len.load(Ordering::Relaxed),
            checksum: h.checksum.load(Ordering::Relaxed),
            sealed_at_unix_ns: h.sealed_at.load(Ordering::Relaxed),
        };
        fence(Ordering::Acquire);
        (h.seq.load(Ordering::Relaxed) == seq).then_some(info)
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
    /// sealed. `None` when every other slot is held, for the persister or
    /// for the replicas.
    ///
    /// With three slots or more, the slots holding the steps kept for the
    /// replicas are held too: the common step, and the first step sealed
    /// at or after the target ([`Store::kept_for_target`]); when they
    /// leave no other slot, the newest is rewritten (a rank killed
    /// meanwhile returns to a kept step). With two, keeping one would
    /// leave only the newest: they are not kept (the replicas are then
    /// only watched).
    ///
    /// [`ControlPage::kept`]: super::ControlPage::kept
    pub fn writable_slot(&self) -> Option<usize> {
        self.writable_slot_keeping(true)
    }

    /// [`Store::writable_slot`], with the replicas' steps kept or not (the
    /// job's last snapshot is taken even where the replicas lag).
    pub fn writable_slot_keeping(&self, keep: bool) -> Option<usize> {
        let sealed = self.sealed();
        let held = self.page().held().map(|h| h.slot);
        let newest = sealed.first().map(|i| i.slot);
        let keeps = keep && self.geometry.slots >= 3;
        // Read once: a common step and the target it came with.
        let steps = self.page().kept();
        let target = keeps
            .then(|| super::kept::first_at_or_after(&sealed, steps.target))
            .flatten()
            .map(|i| i.slot);
        // One slot of the common step is kept: a second copy (a replica
        // sent it again) is rewritten like any other.
        let common = keeps
            .then(|| sealed.iter().find(|i| Some(i.step) == steps.common))
            .flatten()
            .map(|i| i.slot);
        let kept = |s: &usize| Some(*s) == target || Some(*s) == common;
        let usable = |s: &usize| Some(*s) != held && Some(*s) != newest && !kept(s);
        if let Some(free) = (0..self.geometry.slots)
            .filter(usable)
            .find(|s| !sealed.iter().any(|i| i.slot == *s))
        {
            return Some(free);
        }
        if let Some(oldest) = sealed.iter().rev().map(|i| i.slot).find(usable) {
            return Some(oldest);
        }
        // Every other slot is kept for the replicas: the newest is
        // rewritten. The kept steps are consistent steps every rank holds
        // to return to meanwhile, so the snapshots do not stop while a
        // replica catches up.
        newest.filter(|n| keeps && Some(*n) != held && !kept(n))
    }

    /// Empties every sealed slot newer than `step` (writer side, while no
    /// commit runs). After a rollback to `step` those snapshots belong to an
    /// abandoned timeline; emptied, they are the first to be rewritten, so
    /// the slot holding `step` survives the next commit.
    pub fn discard_newer_than(&self, step: u64) {
        let page = self.page();
        if let Some(h) = page.held().filter(|h| h.step > step) {
            // A claimed one too: the agent's check after reading the slot
            // sees it emptied and drops that save.
            page.release_hold(h);
        }
        for slot in 0..self.geometry.slots {
            if self.slot_info(slot).is_some_and(|i| i.step > step) {
                let h = self.header(slot);
                let seq = h.seq.load(Ordering::Acquire);
                h.seq.store(seq + 1, Ordering::Relaxed);
                fence(Ordering::Release);
                h.state.store(STATE_EMPTY, Ordering::Relaxed);
                h.seq.store(seq + 2, Ordering::Release);
            }
        }
    }

    /// Fully verifies `slot`: header, bounds, identities and checksum.
    pub fn verify(&self, slot: usize) -> Result<SlotInfo, ShmError> {
        let info = self.check_header(slot)?;
        // SAFETY: reading sealed bytes; a concurrent writer would first make
        // seq odd, which `check_sum` detects.
        let data = unsafe { self.map.bytes(self.data_offset(slot), info.len as usize) };
        let mut h = XxHash3_64::new();
        h.write(data);
        let sum = self.sum_header(&mut h, &info);
        self.check_sum(slot, &info, sum)?;
        Ok(info)
    }

    /// The newest slot holding `step` that verifies, if any.
    pub fn find_step(&self, step: u64) -> Option<SlotInfo> {
        self.sealed()
            .into_iter()
            .filter(|i| i.step == step)
            .find_map(|i| self.verify(i.slot).ok())
    }

    /// The steps of every slot that verifies, newest first, and why each
    /// other sealed-looking slot was rejected.
    pub fn verified_steps(&self) -> (Vec<u64>, Vec<ShmError>) {
        let mut ok = Vec::new();
        let mut rejected = Vec::new();
        for i in self.sealed() {
            match self.verify(i.slot) {
                Ok(v) => ok.push(v.step),
                Err(e) => rejected.push(e),
            }
        }
        (ok, rejected)
    }

    /// Writes `parts` (concatenated) into `slot` as rank `rank`'s snapshot
    /// of `step`, copying and hashing in one pass, and seals it. `progress`
    /// is called after each piece with the bytes copied so far; if it returns
    /// false the slot is left unsealed (torn) and the write fails: the copy
    /// cannot be trusted (a memory error hit the source meanwhile).
    ///
    /// The caller must be the store's only writer, and `slot` one that
    /// [`Store::writable_slot`] returned.
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
        if slot >= self.geometry.slots {
            return Err(self.bad(slot, format!("only {} slots", self.geometry.slots)));
        }
        let open = self.open_slot(slot);

        // SAFETY: this slot is not the newest sealed one and we are the only
        // writer; readers see seq odd and ignore its bytes.
        let dst = unsafe { self.map.bytes_mut(self.data_offset(slot), len) };
        let mut hasher = XxHash3_64::new();
        let mut at = 0;
        for part in parts {
            for piece in part.chunks(COPY_PIECE) {
                super::copy::copy(&mut dst[at..at + piece.len()], piece);
                hasher.write(piece);
                at += piece.len();
                if !progress(at, len) {
                    return Err(self.bad(
                        slot,
                        "copy abandoned: its source was hit by a memory error".into(),
                    ));
                }
            }
        }
        let mut info = SlotInfo {
            slot,
            rank,
            step,
            epoch,
            len: len as u64,
            checksum: 0,
            sealed_at_unix_ns: now_unix_ns(),
        };
        info.checksum = self.sum_header(&mut hasher, &info);
        self.seal_slot(slot, open, &info);
        Ok(info)
    }

    /// Opens `slot` to receive a snapshot of `len` bytes that arrives in
    /// pieces (a peer's replica): the slot is torn until
    /// [`Receiving::seal`] succeeds. The same rules as [`Store::write_slot`]
    /// hold: one writer, and a slot [`Store::writable_slot`] returned.
    pub fn receive(&self, slot: usize, len: u64) -> Result<Receiving, ShmError> {
        if slot >= self.geometry.slots {
            return Err(self.bad(slot, format!("only {} slots", self.geometry.slots)));
        }
        let len = usize::try_from(len)
            .ok()
            .filter(|l| *l <= self.geometry.capacity)
            .ok_or(ShmError::TooLarge {
                path: self.path.clone(),
                len: usize::try_from(len).unwrap_or(usize::MAX),
                capacity: self.geometry.capacity,
            })?;
        let open = self.open_slot(slot);
        Ok(Receiving {
            slot,
            open,
            at: 0,
            len,
            hasher: XxHash3_64::new(),
        })
    }

    /// Makes `slot`'s seq odd and its state writing, before any data byte
    /// changes; returns the odd seq.
    fn open_slot(&self, slot: usize) -> u64 {
        let h = self.header(slot);
        let seq = h.seq.load(Ordering::Acquire);
        let open = if seq.is_multiple_of(2) {
            seq + 1
        } else {
            seq + 2
        };
        h.seq.store(open, Ordering::Relaxed);
        h.state.store(STATE_WRITING, Ordering::Relaxed);
        h.version.store(VERSION_WORD, Ordering::Relaxed);
        h.magic.store(SLOT_MAGIC, Ordering::Relaxed);
        fence(Ordering::Release);
        open
    }

    /// Stores the header of a slot whose data is in place, and seals it.
    fn seal_slot(&self, slot: usize, open: u64, info: &SlotInfo) {
        // INVARIANT: the copy's streaming stores are ordered before the
        // seal that publishes them.
        super::copy::fence();
        let h = self.header(slot);
        h.rank.store(info.rank, Ordering::Relaxed);
        h.step.store(info.step, Ordering::Relaxed);
        h.epoch.store(info.epoch, Ordering::Relaxed);
        h.len.store(info.len, Ordering::Relaxed);
        h.job.store(self.page().job_hash(), Ordering::Relaxed);
        h.layout.store(self.page().layout_hash(), Ordering::Relaxed);
        h.sealed_at.store(info.sealed_at_unix_ns, Ordering::Relaxed);
        h.checksum.store(info.checksum, Ordering::Relaxed);
        h.state.store(STATE_SEALED, Ordering::Relaxed);
        h.seq.store(open + 1, Ordering::Release);
    }

    /// Copies a verified slot's bytes into `out` (which must be exactly the
    /// slot's length), verifying the checksum of what was copied.
    pub fn read_slot(&self, slot: usize, out: &mut [&mut [u8]]) -> Result<SlotInfo, ShmError> {
        let info = self.check_header(slot)?;
        let total: usize = out.iter().map(|o| o.len()).sum();
        if total as u64 != info.len {
            return Err(self.bad(
                slot,
                format!("holds {} bytes, the state has {total}", info.len),
            ));
        }
        // SAFETY: as in `verify`; the checksum of the copy is checked below.
        let src = unsafe { self.map.bytes(self.data_offset(slot), total) };
        if total < PARALLEL_READ {
            let mut hasher = XxHash3_64::new();
            let mut at = 0;
            for o in out.iter_mut() {
                for piece in o.chunks_mut(COPY_PIECE) {
                    piece.copy_from_slice(&src[at..at + piece.len()]);
                    hasher.write(piece);
                    at += piece.len();
                }
            }
            let sum = self.sum_header(&mut hasher, &info);
            self.check_sum(slot, &info, sum)?;
            return Ok(info);
        }
        // A large slot (a restore holds the job up): one thread hashes the
        // slot while this one copies it, so the read takes the longer of
        // the two rather than their sum. As in `verify`, the sum is of the
        // slot's bytes, and `check_sum` finds a writer that came meanwhile
        // (the copy is then refused whole).
        let sum = std::thread::scope(|s| {
            let hashing = s.spawn(|| {
                let mut hasher = XxHash3_64::new();
                hasher.write(src);
                self.sum_header(&mut hasher, &info)
            });
            let mut at = 0;
            for o in out.iter_mut() {
                o.copy_from_slice(&src[at..at + o.len()]);
                at += o.len();
            }
            hashing.join()
        })
        .map_err(|_| self.bad(slot, "the thread hashing it panicked".into()))?;
        self.check_sum(slot, &info, sum)?;
        Ok(info)
    }

    /// Runs `f` over a verified slot's bytes in place (agent side:
    /// checkpoints), then verifies the slot again: if it was rewritten
    /// meanwhile, whatever `f` made of the bytes is refused with an error
    /// (the worker may not be paused, so a rewrite is caught, not excluded).
    pub fn with_slot<R>(
        &self,
        slot: usize,
        f: impl FnOnce(&SlotInfo, &[u8]) -> R,
    ) -> Result<R, ShmError> {
        let info = self.verify(slot)?;
        // SAFETY: verified bounds. A concurrent writer first makes seq odd
        // and changes the header; the verification below then fails and
        // the result of `f` is dropped.
        let bytes = unsafe { self.map.bytes(self.data_offset(slot), info.len as usize) };
        let out = f(&info, bytes);
        match self.verify(slot) {
            Ok(again) if again == info => Ok(out),
            Ok(_) => Err(self.bad(slot, "rewritten while read".into())),
            Err(e) => Err(e),
        }
    }

    /// Runs `f` over bytes `offset..offset + len` of the sealed slot that
    /// `info` describes, without verifying the whole slot (a peer verifies
    /// what it receives), then checks the slot was not rewritten meanwhile:
    /// if it was, whatever `f` made of the bytes is refused with an error.
    pub fn with_range<R>(
        &self,
        info: &SlotInfo,
        offset: u64,
        len: u64,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, ShmError> {
        let slot = info.slot;
        if self.slot_info(slot).as_ref() != Some(info) {
            return Err(self.bad(slot, "no longer holds that snapshot".into()));
        }
        let end = offset.checked_add(len).filter(|e| *e <= info.len);
        let Some(end) = end.filter(|e| *e <= self.geometry.capacity as u64) else {
            return Err(self.bad(
                slot,
                format!("bytes {offset}+{len} outside its {} bytes", info.len),
            ));
        };
        // SAFETY: in bounds (checked above); a writer that reuses the slot
        // first makes seq odd, which the check below sees.
        let bytes = unsafe {
            self.map.bytes(
                self.data_offset(slot) + offset as usize,
                (end - offset) as usize,
            )
        };
        let out = f(bytes);
        if self.slot_info(slot).as_ref() != Some(info) {
            return Err(self.bad(slot, "rewritten while read".into()));
        }
        Ok(out)
    }

    /// Copies `from`'s sealed snapshots (the newest this store has slots
    /// for, one per step, oldest first, so that the newest stays the
    /// newest) into this store (a standby filling a rank's store from its
    /// peer replica): a replica may hold the step the other ranks kept for
    /// it ([`ControlPage::kept`](super::ControlPage::kept)) beside newer
    /// ones. Each is read once, checked against its owner's checksum on the
    /// way as a received replica is (a copy that fails it is left unsealed
    /// and the others go on); both stores must be made with the owner's job
    /// and layout hashes. The caller must be this store's only writer.
    /// Returns the newest copied, or the last error when none was.
    pub fn fill_from(&self, from: &Store) -> Result<SlotInfo, ShmError> {
        let mut infos = from.sealed();
        infos.dedup_by_key(|i| i.step);
        infos.truncate(self.geometry.slots);
        let mut newest = None;
        let mut failed = None;
        for info in infos.iter().rev() {
            match self.copy_in(from, info) {
                Ok(copied) => newest = Some(copied),
                Err(e) => failed = Some(e),
            }
        }
        newest.ok_or_else(|| {
            failed.unwrap_or_else(|| from.bad(0, "no sealed snapshot to copy".into()))
        })
    }

    /// Copies `from`'s snapshot `info` into a writable slot of this store.
    fn copy_in(&self, from: &Store, info: &SlotInfo) -> Result<SlotInfo, ShmError> {
        const PIECE: u64 = 4 << 20;
        let slot = self
            .writable_slot_keeping(false)
            .ok_or_else(|| self.bad(0, "no slot to write to".into()))?;
        let mut rx = self.receive(slot, info.len)?;
        let mut at = 0;
        while at < info.len {
            let len = PIECE.min(info.len - at);
            from.with_range(info, at, len, |bytes| rx.write(self, bytes))??;
            at += len;
        }
        rx.seal(
            self,
            info.rank,
            info.step,
            info.epoch,
            info.sealed_at_unix_ns,
            info.checksum,
        )
    }

    /// Flips one bit of a slot's data (fault-injection tests: simulates
    /// memory corruption).
    pub fn corrupt_slot_byte(&self, slot: usize, offset: usize) {
        let off = self.data_offset(slot) + (offset % self.geometry.capacity);
        let word: &AtomicU64 = self.map.at(off & !7);
        word.fetch_xor(1 << ((off % 8) * 8), Ordering::AcqRel);
    }

    /// Overwrites one header word of a slot (fault-injection tests: a header
    /// that lies about what the slot holds).
    pub fn tamper_header(&self, slot: usize, word: HeaderWord, value: u64) {
        let h = self.header(slot);
        let w = match word {
            HeaderWord::Rank => &h.rank,
            HeaderWord::Step => &h.step,
            HeaderWord::Epoch => &h.epoch,
            HeaderWord::Len => &h.len,
            HeaderWord::Checksum => &h.checksum,
        };
        w.store(value, Ordering::Release);
    }

    fn bad(&self, slot: usize, detail: String) -> ShmError {
        ShmError::BadSlot {
            path: self.path.clone(),
            slot,
            detail,
        }
    }

    /// Checks that the slot was not rewritten since `info` was read and that
    /// `sum` (of its data and header) matches the header.
    fn check_sum(&self, slot: usize, info: &SlotInfo, sum: u64) -> Result<(), ShmError> {
        if self.slot_info(slot).as_ref() != Some(info) {
            return Err(self.bad(slot, "overwritten while read".into()));
        }
        if sum != info.checksum {
            return Err(self.bad(
                slot,
                format!(
                    "checksum mismatch (data and header {sum:016x}, recorded {:016x}): corrupt or altered",
                    info.checksum
                ),
            ));
        }
        Ok(())
    }

    /// Checks `slot`'s header: magic, version, sealed state, bounds and the
    /// rank and identities it names.
    fn check_header(&self, slot: usize) -> Result<SlotInfo, ShmError> {
        if slot >= self.geometry.slots {
            return Err(self.bad(slot, format!("only {} slots", self.geometry.slots)));
        }
        let h = self.header(slot);
        let magic = h.magic.load(Ordering::Acquire);
        if magic != SLOT_MAGIC {
            return Err(self.bad(
                slot,
                if magic == 0 {
                    "empty".into()
                } else {
                    format!("bad magic {magic:#018x}")
                },
            ));
        }
        if h.version.load(Ordering::Relaxed) != VERSION_WORD {
            return Err(self.bad(slot, "unknown slot version".into()));
        }
        let seq = h.seq.load(Ordering::Acquire);
        let state = h.state.load(Ordering::Relaxed);
        if seq.is_multiple_of(2) && state == STATE_EMPTY {
            return Err(self.bad(slot, "empty (discarded after a rollback)".into()));
        }
        if seq % 2 == 1 || state != STATE_SEALED {
            return Err(self.bad(slot, "torn: its writer did not finish".into()));
        }
        let info = self
            .slot_info(slot)
            .ok_or_else(|| self.bad(slot, "changed while read".into()))?;
        if info.len > self.geometry.capacity as u64 {
            return Err(self.bad(
                slot,
                format!(
                    "length {} exceeds capacity {}",
                    info.len, self.geometry.capacity
                ),
            ));
        }
        if info.rank != self.page().rank() {
            return Err(self.bad(
                slot,
                format!(
                    "names rank {}, but the store is rank {}'s",
                    info.rank,
                    self.page().rank()
                ),
            ));
        }
        let page = self.page();
        if h.job.load(Ordering::Relaxed) != page.job_hash()
            || h.layout.load(Ordering::Relaxed) != page.layout_hash()
        {
            return Err(self.bad(
                slot,
                "sealed by another job or for another state layout".into(),
            ));
        }
        Ok(info)
    }
}

/// A snapshot being received into a slot, in order ([`Store::receive`]).
pub struct Receiving {
    slot: usize,
    open: u64,
    at: usize,
    len: usize,
    hasher: XxHash3_64,
}

impl std::fmt::Debug for Receiving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiving")
            .field("slot", &self.slot)
            .field("at", &self.at)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl Receiving {
    /// Bytes received so far.
    pub fn received(&self) -> u64 {
        self.at as u64
    }

    pub fn slot(&self) -> usize {
        self.slot
    }

    /// Copies the next piece into the slot and hashes it.
    pub fn write(&mut self, store: &Store, piece: &[u8]) -> Result<(), ShmError> {
        if piece.len() > self.len - self.at {
            return Err(store.bad(
                self.slot,
                format!(
                    "{} more bytes after {} of {}",
                    piece.len(),
                    self.at,
                    self.len
                ),
            ));
        }
        // SAFETY: in bounds (checked above and in `receive`); the slot is
        // open (seq odd), so readers ignore its bytes, and the caller is its
        // only writer.
        let dst = unsafe {
            store
                .map
                .bytes_mut(store.data_offset(self.slot) + self.at, piece.len())
        };
        for (d, p) in dst.chunks_mut(COPY_PIECE).zip(piece.chunks(COPY_PIECE)) {
            super::copy::copy(d, p);
            self.hasher.write(p);
        }
        self.at += piece.len();
        Ok(())
    }

    /// Seals the slot as rank `rank`'s snapshot `step` if every byte came
    /// and they hash, with the header words, to `checksum` (the one its
    /// owner sealed it with); else the slot stays torn. The store must be
    /// made with the owner's job and layout hashes.
    pub fn seal(
        mut self,
        store: &Store,
        rank: u64,
        step: u64,
        epoch: u64,
        sealed_at_unix_ns: u64,
        checksum: u64,
    ) -> Result<SlotInfo, ShmError> {
        if self.at != self.len {
            return Err(store.bad(
                self.slot,
                format!("{} of {} bytes arrived", self.at, self.len),
            ));
        }
        let info = SlotInfo {
            slot: self.slot,
            rank,
            step,
            epoch,
            len: self.len as u64,
            checksum,
            sealed_at_unix_ns,
        };
        let sum = store.sum_header(&mut self.hasher, &info);
        if sum != checksum {
            return Err(store.bad(
                self.slot,
                format!(
                    "checksum mismatch (received {sum:016x}, sealed with {checksum:016x}): corrupted on the way"
                ),
            ));
        }
        store.seal_slot(self.slot, self.open, &info);
        Ok(info)
    }
}

#[cfg(test)]
mod tests;
