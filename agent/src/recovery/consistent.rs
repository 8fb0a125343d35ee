//! s\*: the consistent step every recovery and dump restores to (DESIGN.md
//! section 5): the newest step for which every rank has a sealed,
//! checksum-valid snapshot. A rank mid-update never has one of the step it
//! was updating to, so it can never be chosen.

use std::collections::BTreeSet;

/// s\*: the newest step for which every rank has a sealed, verified
/// snapshot. `per_rank[r]` lists rank r's verified snapshot steps.
pub fn consistent_step(per_rank: &[Vec<u64>]) -> Option<u64> {
    let mut iter = per_rank.iter();
    let first: BTreeSet<u64> = iter.next()?.iter().copied().collect();
    iter.fold(first, |acc, steps| {
        let s: BTreeSet<u64> = steps.iter().copied().collect();
        acc.intersection(&s).copied().collect()
    })
    .last()
    .copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn consistent_step_cases() {
        assert_eq!(consistent_step(&[]), None);
        assert_eq!(consistent_step(&[vec![4, 5], vec![5, 4], vec![4]]), Some(4));
        assert_eq!(consistent_step(&[vec![4, 5], vec![6, 7]]), None);
        assert_eq!(consistent_step(&vec![vec![9, 10]; 4]), Some(10));
    }

    /// What the `k` slots of a rank hold after a fault: the rank completed
    /// `done` steps; if `sealed_newest`, its commit of `done` finished (else
    /// that copy was torn and does not count). A rank killed inside the
    /// update of `done + 1` has the same slots: a state mid-update is never
    /// sealed, which is why it can never be chosen.
    fn slots(done: u64, sealed_newest: bool, k: u64) -> Vec<u64> {
        let newest = if sealed_newest {
            done
        } else {
            done.saturating_sub(1)
        };
        (0..k).filter_map(|i| newest.checked_sub(i)).collect()
    }

    proptest! {
        #[test]
        fn s_star_with_a_rank_mid_update_and_one_behind(
            s in 2u64..1000,
            ranks in proptest::collection::vec((any::<bool>(), any::<bool>()), 2..9),
            k in 2u64..4,
        ) {
            // Ranks run in lockstep: each has completed s or s-1 steps. No
            // rank completes step s before every rank passed the start-update
            // fence of s, which waits for its commit of s-1: so when some
            // rank completed s, the ranks behind have sealed s-1.
            let someone_ahead = ranks.iter().any(|r| !r.0);
            let per_rank: Vec<Vec<u64>> = ranks
                .iter()
                .map(|&(behind, sealed)| slots(s - u64::from(behind), sealed || (behind && someone_ahead), k))
                .collect();
            let newest: Vec<u64> = per_rank.iter().map(|v| v[0]).collect();
            // s* is the oldest rank's newest sealed step: every other rank
            // still holds it, and no torn or mid-update state is ever used.
            prop_assert_eq!(consistent_step(&per_rank), newest.iter().min().copied());
        }

        #[test]
        fn consistent_step_is_the_newest_common(ranks in proptest::collection::vec(proptest::collection::vec(0u64..20, 0..4), 1..6)) {
            let got = consistent_step(&ranks);
            let common = (0..20u64).filter(|s| ranks.iter().all(|r| r.contains(s))).max();
            prop_assert_eq!(got, common);
        }
    }
}
