//! The verification of every rank's snapshots when a recovery collects
//! them: each slot's checksum is computed over all its bytes, so the stores
//! are verified side by side, one thread per core. The ranks are paused
//! meanwhile, and their cores idle.

use hatrain_shared::shm::{ShmError, Store};
use std::sync::Arc;

/// The steps of a store's slots that verify (newest first) and why each
/// other sealed-looking slot was rejected ([`Store::verified_steps`]).
pub(super) type Verified = (Vec<u64>, Vec<ShmError>);

/// Per store, in the order given: its rank and what verified.
pub(super) fn verify_side_by_side(stores: &[(usize, Arc<Store>)]) -> Vec<(usize, Verified)> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_thread = stores.len().div_ceil(cores.max(1)).max(1);
    std::thread::scope(|s| {
        let running: Vec<_> = stores
            .chunks(per_thread)
            .map(|chunk| {
                s.spawn(move || {
                    chunk
                        .iter()
                        .map(|(rank, store)| (*rank, store.verified_steps()))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        running
            .into_iter()
            .flat_map(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use hatrain_shared::shm::{Geometry, store_path};
    use std::os::unix::fs::FileExt;

    fn sealed(dir: &std::path::Path, rank: usize, steps: &[u64]) -> Arc<Store> {
        let s = Store::create(&store_path(dir, rank), rank, Geometry::new(3, 8192), 7, 9).unwrap();
        for &step in steps {
            let slot = s.writable_slot().unwrap();
            let data = tag(rank, step).repeat(1024);
            s.write_slot(slot, rank as u64, step, 0, &[&data], &mut |_, _| true)
                .unwrap();
        }
        Arc::new(s)
    }

    /// 8 bytes found only in `rank`'s snapshot of `step`.
    fn tag(rank: usize, step: u64) -> [u8; 8] {
        (0xa5a5_0000_0000_0000 | step << 16 | rank as u64).to_le_bytes()
    }

    /// Flips a bit of the first copy of `pattern` in `rank`'s store file.
    fn corrupt(dir: &std::path::Path, rank: usize, pattern: &[u8]) {
        let path = store_path(dir, rank);
        let bytes = std::fs::read(&path).unwrap();
        let at = bytes
            .windows(pattern.len())
            .position(|w| w == pattern)
            .expect("the pattern is in the file");
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(&[bytes[at] ^ 1], at as u64).unwrap();
    }

    #[test]
    fn stores_verified_side_by_side_give_each_rank_its_own_steps_and_rejections() {
        let d = tempfile::tempdir().unwrap();
        let stores: Vec<(usize, Arc<Store>)> = (0..5)
            .map(|r| (r, sealed(d.path(), r, &[10, 11, 12 + r as u64])))
            .collect();
        // Rank 3's snapshot of step 11 loses a bit.
        corrupt(d.path(), 3, &tag(3, 11));
        let got = verify_side_by_side(&stores);
        assert_eq!(
            got.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4]
        );
        for (rank, (ok, bad)) in &got {
            let (want_ok, want_bad) = stores[*rank].1.verified_steps();
            assert_eq!(ok, &want_ok, "rank {rank}");
            assert_eq!(bad.len(), want_bad.len(), "rank {rank}");
            if *rank == 3 {
                assert_eq!(ok, &[15, 10], "rank 3's step 11 is rejected");
                assert_eq!(bad.len(), 1);
            } else {
                assert_eq!(ok, &[12 + *rank as u64, 11, 10], "rank {rank}");
                assert!(bad.is_empty());
            }
        }
        assert!(verify_side_by_side(&[]).is_empty());
    }
}
