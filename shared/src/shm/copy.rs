//! The snapshot copy: bytes from a rank's state into a shared-memory slot,
//! at the speed of the machine's `memcpy`.
//!
//! A slot is written once per snapshot and read only on recovery, so its
//! bytes are stored with non-temporal stores where the CPU has them
//! (AVX2, detected at run time): they go to memory without first being
//! read into the cache, as a large `memcpy` does. A piecewise copy with
//! plain stores reads every destination line first, which costs a third
//! more memory traffic. The checksum is then taken over the *source*
//! piece, which the copy has just brought into the cache.
//!
//! INVARIANT: non-temporal stores are weakly ordered, so [`fence`] must
//! run after the last copy and before anything that publishes the bytes
//! (the slot's seal).

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| std::arch::is_x86_feature_detected!("avx2"))
}

/// Copies `src` into `dst` (same length), bypassing the cache where the
/// CPU allows.
pub(crate) fn copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy between equal lengths");
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 was detected on this CPU just above.
        unsafe { copy_avx2(dst, src) };
        return;
    }
    dst.copy_from_slice(src);
}

/// Orders every copy made so far before the stores that follow it.
pub(crate) fn fence() {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: sfence has no preconditions (SSE, part of x86_64).
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_avx2(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    // The head up to the first 32-byte boundary of `dst` is copied plainly,
    // since streaming stores need aligned addresses.
    let head = dst.as_ptr().align_offset(32).min(dst.len());
    dst[..head].copy_from_slice(&src[..head]);
    let (dst, src) = (&mut dst[head..], &src[head..]);
    let body = dst.len() / 32 * 32;
    let mut i = 0;
    while i < body {
        // SAFETY: `i + 32 <= body <= len` for both slices; the load is
        // unaligned, the store's address is 32-aligned (`head` above).
        unsafe {
            let v = _mm256_loadu_si256(src.as_ptr().add(i).cast::<__m256i>());
            _mm256_stream_si256(dst.as_mut_ptr().add(i).cast::<__m256i>(), v);
        }
        i += 32;
    }
    dst[body..].copy_from_slice(&src[body..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn copies_every_byte_at_any_alignment(
            data in proptest::collection::vec(any::<u8>(), 0..2000),
            skew in 0usize..64,
        ) {
            let mut buf = vec![0u8; data.len() + 64];
            copy(&mut buf[skew..skew + data.len()], &data);
            fence();
            prop_assert_eq!(&buf[skew..skew + data.len()], &data[..]);
            prop_assert!(buf[..skew].iter().all(|b| *b == 0));
            prop_assert!(buf[skew + data.len()..].iter().all(|b| *b == 0));
        }
    }
}
