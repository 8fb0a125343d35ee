//! How a flat buffer of `numel` elements is split across the `world` ranks
//! of a data-parallel group (ZeRO-1): rank `r` owns [`shard_range`]`(numel,
//! world, r)`. The trainer shards its optimizer this way, checkpoints record
//! each rank's range, and a snapshot keeps only a rank's slice of a
//! replicated part.

use std::ops::Range;

/// The element range of the flat buffer that `rank` of `world` owns.
///
/// The first `numel % world` ranks get one element more, so the ranges are
/// contiguous, in rank order, cover `0..numel` exactly and differ in length by
/// at most one.
pub fn shard_range(numel: usize, world: usize, rank: usize) -> Range<usize> {
    assert!(
        world > 0 && rank < world,
        "rank {rank} outside world {world}"
    );
    let base = numel / world;
    let rem = numel % world;
    let start = rank * base + rank.min(rem);
    let len = base + usize::from(rank < rem);
    start..start + len
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn shards_partition_the_buffer(numel in 0usize..100_000, world in 1usize..64) {
            let mut next = 0;
            let mut lens = Vec::new();
            for r in 0..world {
                let range = shard_range(numel, world, r);
                prop_assert_eq!(range.start, next);
                next = range.end;
                lens.push(range.len());
            }
            prop_assert_eq!(next, numel);
            let (min, max) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
            prop_assert!(max - min <= 1);
        }
    }
}
