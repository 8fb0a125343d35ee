//! The shared mapping of one store file: the only place where the store's
//! memory is reached through raw pointers.
//!
//! INVARIANT: the mapping covers the whole file, is page aligned and lives
//! until [`Mapping`] is dropped; every typed view handed out ([`Mapping::at`],
//! [`Mapping::bytes`]) is bounds-checked against it first.

use std::io;
use std::os::fd::AsFd;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

/// A `MAP_SHARED` mapping of a whole store file; unmapped on drop.
#[derive(Debug)]
pub(super) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all access to it goes through
// atomics or through copies whose races are excluded (or detected) by the
// sealing protocol, so it may be used from any thread.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len came from a successful mmap and are unmapped once;
        // no view outlives `self` (they borrow it).
        let _ = unsafe { nix::sys::mman::munmap(self.ptr.cast(), self.len) };
    }
}

/// Types that may be viewed in place in the mapping: `#[repr(C)]` structs
/// made only of `AtomicU64` words (any bit pattern is valid for them, and
/// they are only ever accessed atomically).
///
/// # Safety
/// Implementors must be `#[repr(C)]`, consist only of `AtomicU64` fields (or
/// arrays of them) and have an alignment of at most 8.
pub(super) unsafe trait Words: Sized {}

// SAFETY: a single atomic word.
unsafe impl Words for AtomicU64 {}

impl Mapping {
    /// Maps `len` bytes of `file` shared and writable; `populate` pre-faults
    /// the page tables (the pages themselves already exist for a store the
    /// agent created).
    pub(super) fn map(file: &std::fs::File, len: usize, populate: bool) -> io::Result<Self> {
        use nix::sys::mman::{MapFlags, ProtFlags, mmap};
        let size = std::num::NonZeroUsize::new(len)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty store file"))?;
        let flags = if populate {
            MapFlags::MAP_SHARED | MapFlags::MAP_POPULATE
        } else {
            MapFlags::MAP_SHARED
        };
        // SAFETY: mapping a file we hold open, with a length equal to its
        // size; nothing else is mapped at the address the kernel picks.
        let ptr = unsafe {
            mmap(
                None,
                size,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                flags,
                file.as_fd(),
                0,
            )
        }?;
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Asks the kernel to fault in every page writable now
    /// (`MADV_POPULATE_WRITE`, Linux 5.14+): first touch of shm runs at a
    /// tenth of memcpy speed, so it is paid here rather than in the first
    /// commits. False if the kernel refused.
    pub(super) fn populate_write(&self) -> bool {
        // SAFETY: madvise on our own mapping, whole range; it changes no
        // contents.
        let rc = unsafe {
            libc::madvise(
                self.ptr.as_ptr().cast(),
                self.len,
                libc::MADV_POPULATE_WRITE,
            )
        };
        rc == 0
    }

    /// A view of a `T` at byte `offset`.
    pub(super) fn at<T: Words>(&self, offset: usize) -> &T {
        assert!(
            offset.is_multiple_of(8) && offset.saturating_add(size_of::<T>()) <= self.len,
            "view of {} bytes at {offset} outside a mapping of {}",
            size_of::<T>(),
            self.len
        );
        // SAFETY: in bounds (checked), 8-byte aligned (the mapping is page
        // aligned, the offset a multiple of 8 and T's alignment at most 8),
        // and every bit pattern is a valid T (`Words`). The view borrows
        // `self`, so it cannot outlive the mapping.
        unsafe { &*self.ptr.as_ptr().add(offset).cast::<T>() }
    }

    /// The bytes `offset..offset+len`.
    ///
    /// # Safety
    /// The caller must ensure no one writes these bytes while the slice
    /// lives, or accept torn contents (readers verify checksums).
    pub(super) unsafe fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        assert!(
            offset.saturating_add(len) <= self.len,
            "range out of bounds"
        );
        // SAFETY: in bounds; aliasing is the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) }
    }

    /// # Safety
    /// The caller must be the only writer of these bytes while the slice
    /// lives, and no reader may rely on them until it is done.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn bytes_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        assert!(
            offset.saturating_add(len) <= self.len,
            "range out of bounds"
        );
        // SAFETY: in bounds; exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) }
    }
}
