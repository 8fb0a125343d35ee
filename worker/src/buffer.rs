//! The state buffers a runtime snapshots: vectors it shares with the
//! training loop ([`SharedBuf`]), or memory another runtime owns, such as a
//! Python process's numpy arrays and torch tensors ([`Borrowed`]).
//!
//! The runtime copies a buffer's bytes out on a commit (while the next step
//! computes) and in on a restore (while the rank is parked). A shared vector
//! is guarded by its lock; borrowed memory by the update fences alone: its
//! owner writes it only between [`start_update`] and [`end_update`], and not
//! at all from [`restore`] until it returns.
//!
//! [`start_update`]: crate::runtime::Runtime::start_update
//! [`end_update`]: crate::runtime::Runtime::end_update
//! [`restore`]: crate::runtime::Runtime::restore

use hatrain_shared::statemap::Dtype;
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// A state buffer the runtime snapshots: the training loop reads it freely,
/// and takes the write lock only inside the update fences.
pub type SharedBuf = Arc<RwLock<Vec<f32>>>;

/// Memory the runtime does not own, registered without a copy.
pub struct Borrowed {
    ptr: NonNull<u8>,
    len: usize,
    dtype: Dtype,
    /// Keeps the memory alive (the Python object that owns it).
    _owner: Box<dyn Send + Sync>,
}

impl fmt::Debug for Borrowed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Borrowed")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("dtype", &self.dtype)
            .finish_non_exhaustive()
    }
}

// SAFETY: the memory is plain bytes; who touches it when is the contract of
// `Borrowed::new` (the update fences), which makes sharing it between the
// training thread and the commit thread sound.
unsafe impl Send for Borrowed {}
// SAFETY: as for Send.
unsafe impl Sync for Borrowed {}

impl Borrowed {
    /// `len` bytes at `ptr`, holding elements of `dtype`, kept alive by
    /// `owner`.
    ///
    /// # Safety
    ///
    /// The memory must stay valid, at the same address, for as long as
    /// `owner` lives, and its owner must write it only inside the update
    /// fences, never while a restore runs, and never concurrently read it
    /// while a restore runs.
    pub unsafe fn new(
        ptr: NonNull<u8>,
        len: usize,
        dtype: Dtype,
        owner: Box<dyn Send + Sync>,
    ) -> Self {
        Self {
            ptr,
            len,
            dtype,
            _owner: owner,
        }
    }
}

/// One registered state buffer.
#[derive(Debug, Clone)]
pub enum Buffer {
    Shared(SharedBuf),
    Borrowed(Arc<Borrowed>),
}

impl From<SharedBuf> for Buffer {
    fn from(b: SharedBuf) -> Self {
        Self::Shared(b)
    }
}

/// Read access to a buffer's bytes.
#[derive(Debug)]
pub(crate) enum ReadGuard<'a> {
    Shared(RwLockReadGuard<'a, Vec<f32>>),
    Borrowed(&'a Borrowed),
}

/// Write access to a buffer's bytes.
#[derive(Debug)]
pub(crate) enum WriteGuard<'a> {
    Shared(RwLockWriteGuard<'a, Vec<f32>>),
    Borrowed(&'a Borrowed),
}

impl Buffer {
    pub fn dtype(&self) -> Dtype {
        match self {
            Self::Shared(_) => Dtype::F32,
            Self::Borrowed(b) => b.dtype,
        }
    }

    /// Elements of its dtype.
    pub fn len(&self) -> usize {
        match self {
            Self::Shared(v) => v.read().unwrap_or_else(|p| p.into_inner()).len(),
            Self::Borrowed(b) => b.len / b.dtype.size(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where its memory is and how many bytes: watched for memory errors.
    pub(crate) fn region(&self) -> (*const u8, usize) {
        match self {
            Self::Shared(v) => {
                let g = v.read().unwrap_or_else(|p| p.into_inner());
                (g.as_ptr().cast(), g.len() * 4)
            }
            Self::Borrowed(b) => (b.ptr.as_ptr().cast_const(), b.len),
        }
    }

    pub(crate) fn read(&self) -> ReadGuard<'_> {
        match self {
            Self::Shared(v) => ReadGuard::Shared(v.read().unwrap_or_else(|p| p.into_inner())),
            Self::Borrowed(b) => ReadGuard::Borrowed(b),
        }
    }

    pub(crate) fn write(&self) -> WriteGuard<'_> {
        match self {
            Self::Shared(v) => WriteGuard::Shared(v.write().unwrap_or_else(|p| p.into_inner())),
            Self::Borrowed(b) => WriteGuard::Borrowed(b),
        }
    }
}

impl ReadGuard<'_> {
    /// Elements `range` (of its dtype), as bytes.
    pub(crate) fn bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        match self {
            Self::Shared(g) => bytemuck::cast_slice(&g[range]),
            Self::Borrowed(b) => {
                let size = b.dtype.size();
                // SAFETY: `Borrowed::new`'s contract: valid for `len` bytes,
                // and not written while a commit reads it (the update
                // fences). The range is checked against the length here.
                let all = unsafe { std::slice::from_raw_parts(b.ptr.as_ptr().cast_const(), b.len) };
                &all[range.start * size..range.end * size]
            }
        }
    }
}

impl WriteGuard<'_> {
    /// Elements `range` (of its dtype), as bytes to fill.
    pub(crate) fn bytes_mut(&mut self, range: std::ops::Range<usize>) -> &mut [u8] {
        match self {
            Self::Shared(g) => bytemuck::cast_slice_mut(&mut g[range]),
            Self::Borrowed(b) => {
                let size = b.dtype.size();
                // SAFETY: `Borrowed::new`'s contract: valid for `len` bytes,
                // and neither read nor written by its owner while a restore
                // runs; one guard per buffer exists at a time (a restore
                // takes each once).
                let all = unsafe { std::slice::from_raw_parts_mut(b.ptr.as_ptr(), b.len) };
                &mut all[range.start * size..range.end * size]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::RwLock;

    /// Memory owned elsewhere (here a boxed slice, as Python's would be):
    /// read and written in place through the guards, by element range.
    /// Memory held by raw pointer, freed when dropped (as an exporter's
    /// buffer is released).
    struct Owner(*mut [u16]);
    // SAFETY: the allocation is only freed, once, by its one owner.
    unsafe impl Send for Owner {}
    // SAFETY: as for Send; the owner itself never reads the memory.
    unsafe impl Sync for Owner {}
    impl Drop for Owner {
        fn drop(&mut self) {
            // SAFETY: made by Box::into_raw below, freed once here.
            drop(unsafe { Box::from_raw(self.0) });
        }
    }

    #[test]
    fn borrowed_memory_is_read_and_written_in_place_by_element_range() {
        let raw = Box::into_raw((0..64u16).collect::<Box<[u16]>>());
        let ptr = NonNull::new(raw.cast::<u8>()).unwrap();
        let len = 64 * 2;
        // SAFETY: `Owner` frees the allocation only when the buffer goes;
        // this test touches it only through the guards.
        let b = Buffer::Borrowed(Arc::new(unsafe {
            Borrowed::new(ptr, len, Dtype::U16, Box::new(Owner(raw)))
        }));
        assert_eq!((b.dtype(), b.len()), (Dtype::U16, 64));
        assert_eq!(b.region(), (ptr.as_ptr().cast_const(), 128));
        assert_eq!(b.read().bytes(2..4), [2, 0, 3, 0]);
        b.write().bytes_mut(63..64).copy_from_slice(&[0xff, 0xff]);
        assert_eq!(b.read().bytes(62..64), [62, 0, 0xff, 0xff]);
    }

    #[test]
    fn a_shared_vector_is_f32_and_read_under_its_lock() {
        let v: SharedBuf = Arc::new(RwLock::new(vec![1.0f32, 2.0]));
        let b = Buffer::from(Arc::clone(&v));
        assert_eq!((b.dtype(), b.len()), (Dtype::F32, 2));
        assert_eq!(b.read().bytes(1..2), 2.0f32.to_le_bytes());
        b.write()
            .bytes_mut(0..1)
            .copy_from_slice(&5.0f32.to_le_bytes());
        assert_eq!(v.read().unwrap()[0], 5.0);
    }
}
