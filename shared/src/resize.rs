//! The moves of a resize (elastic training): which pieces of the state go
//! from which rank to which, so that every rank of the new group holds its
//! part of every piece, and only the pieces whose owner changes travel.
//!
//! A part is laid out over a data-parallel group one of two ways
//! ([`Layout`]): replicated (every rank holds all of it, as DDP's
//! parameters) or sliced (rank `i` of `w` holds
//! [`shard_range`]`(numel, w, i)`, as a ZeRO shard of the optimizer state
//! or a sliced snapshot). Before the resize, old rank `r`'s slices are with
//! the new place that brings them ([`Resize::brought_by`]): `r`'s own new
//! place if it stays, or the place of the rank whose host holds `r`'s
//! replica (a donation) if it was lost.
//!
//! [`plan`] is pure. Every element a new place needs is either there
//! already or arrives exactly once, and nothing else moves, so the bytes
//! moved are the least the two layouts allow. A replicated part that a
//! joining place lacks is split evenly among the places that hold it all,
//! each joining place starting with another holder, so that no holder
//! sends more than its share. Pieces between places of one host go through
//! shared memory, between hosts over the network: the plan says what
//! moves, the transport how.

use crate::shard::shard_range;
use std::ops::Range;

/// How a part is laid out over the ranks of a data-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Every rank holds all of it.
    Replicated,
    /// Rank `i` of `w` holds `shard_range(numel, w, i)`.
    Sliced,
}

/// One part of the state: its elements, their size, its layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub numel: usize,
    pub elem_bytes: usize,
    pub layout: Layout,
}

/// A piece that moves: elements `range` of part `part`, from new place
/// `from` to new place `to`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Move {
    pub part: usize,
    pub range: Range<usize>,
    pub from: usize,
    pub to: usize,
}

impl Move {
    /// Its bytes.
    pub fn bytes(&self, parts: &[Part]) -> u64 {
        (self.range.len() * parts[self.part].elem_bytes) as u64
    }
}

/// The group before and after a resize.
#[derive(Debug, Clone, Copy)]
pub struct Resize<'a> {
    /// The size of the old group.
    pub old_world: usize,
    /// The size of the new group.
    pub new_world: usize,
    /// For each old rank, the new place that brings its slices: its own,
    /// or its donor's; `None` when no rank of the new group has them.
    pub brought_by: &'a [Option<usize>],
    /// For each new place, whether it holds every replicated part (a rank
    /// that stays, or a donor; a joining rank holds none).
    pub whole: &'a [bool],
}

/// A resize that cannot be carried out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResizeError {
    #[error(
        "a resize from {old_world} to {new_world} ranks needs a place for each old rank ({brought} given) and a flag for each new place ({whole} given)"
    )]
    Shape {
        old_world: usize,
        new_world: usize,
        brought: usize,
        whole: usize,
    },
    #[error("a resize to {new_world} ranks names new place {place}")]
    Place { new_world: usize, place: usize },
    #[error(
        "elements {range:?} of part {part} come from no rank of the new group (old rank {old}'s slice, which no rank brings)"
    )]
    NoSource {
        part: usize,
        range: Range<usize>,
        old: usize,
    },
    #[error("part {part} is replicated and no rank of the new group holds it")]
    NoWhole { part: usize },
    #[error("elements {range:?} of part {part}, which place {to} needs, are held by no place")]
    Unheld {
        part: usize,
        range: Range<usize>,
        to: usize,
    },
}

/// The moves of resize `r` of `parts` (see the module's doc), ordered by
/// part, then receiving place.
pub fn plan(parts: &[Part], r: &Resize) -> Result<Vec<Move>, ResizeError> {
    let shape = ResizeError::Shape {
        old_world: r.old_world,
        new_world: r.new_world,
        brought: r.brought_by.len(),
        whole: r.whole.len(),
    };
    if r.old_world == 0
        || r.new_world == 0
        || r.brought_by.len() != r.old_world
        || r.whole.len() != r.new_world
    {
        return Err(shape);
    }
    if let Some(&place) = r.brought_by.iter().flatten().find(|&&p| p >= r.new_world) {
        return Err(ResizeError::Place {
            new_world: r.new_world,
            place,
        });
    }
    let holders: Vec<usize> = (0..r.new_world).filter(|&p| r.whole[p]).collect();
    let mut moves = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        match part.layout {
            Layout::Sliced => sliced(i, part.numel, r, &mut moves)?,
            Layout::Replicated => replicated(i, part.numel, r, &holders, &mut moves)?,
        }
    }
    Ok(moves)
}

/// The moves that give every place the elements it needs of each part
/// from the places that hold them, whatever they hold: `holds[place][part]`
/// and `needs[place][part]` are element ranges. What a place holds already
/// does not move; each element it lacks comes exactly once, from the first
/// place after it (in ring order) that holds it, so that the places that
/// lack a part take it from different holders. Ordered by receiving place,
/// then part. This is [`plan`] for holdings that are not whole slices (a
/// rank whose snapshots hold only its slice of a replicated part).
pub fn route(
    holds: &[Vec<Vec<Range<usize>>>],
    needs: &[Vec<Vec<Range<usize>>>],
) -> Result<Vec<Move>, ResizeError> {
    let world = needs.len();
    if holds.len() != world {
        return Err(ResizeError::Shape {
            old_world: holds.len(),
            new_world: world,
            brought: holds.len(),
            whole: needs.len(),
        });
    }
    let mut moves = Vec::new();
    for (to, need) in needs.iter().enumerate() {
        for (part, wanted) in need.iter().enumerate() {
            let held = |p: usize| holds[p].get(part).map_or(&[][..], Vec::as_slice);
            let mut lack: Vec<Range<usize>> =
                wanted.iter().filter(|r| !r.is_empty()).cloned().collect();
            for k in 0..world {
                let from = (to + k) % world;
                for have in held(from) {
                    let mut rest = Vec::with_capacity(lack.len());
                    for r in lack.drain(..) {
                        let (lo, hi) = (r.start.max(have.start), r.end.min(have.end));
                        if lo >= hi {
                            rest.push(r);
                            continue;
                        }
                        if from != to {
                            moves.push(Move {
                                part,
                                range: lo..hi,
                                from,
                                to,
                            });
                        }
                        rest.extend(
                            [r.start..lo, hi..r.end]
                                .into_iter()
                                .filter(|x| !x.is_empty()),
                        );
                    }
                    lack = rest;
                }
            }
            if let Some(range) = lack.into_iter().min_by_key(|r| r.start) {
                return Err(ResizeError::Unheld { part, range, to });
            }
        }
    }
    Ok(moves)
}

/// The bytes each new place receives in `moves`.
pub fn received(parts: &[Part], moves: &[Move], new_world: usize) -> Vec<u64> {
    let mut per = vec![0; new_world];
    for m in moves {
        per[m.to] += m.bytes(parts);
    }
    per
}

/// What an all-gather of every rank's slices would send each new place:
/// every sliced part whole but its own slice, and every replicated part,
/// the baseline a plan is measured against.
pub fn all_gather_bytes(parts: &[Part], new_world: usize) -> u64 {
    parts
        .iter()
        .map(|p| {
            let whole = (p.numel * p.elem_bytes) as u64;
            match p.layout {
                Layout::Replicated => whole,
                Layout::Sliced => whole - (whole / new_world as u64),
            }
        })
        .sum()
}

/// Part `i`, sliced: each new place's slice comes from the old slices it
/// overlaps, through whoever brings them.
fn sliced(i: usize, numel: usize, r: &Resize, moves: &mut Vec<Move>) -> Result<(), ResizeError> {
    for to in 0..r.new_world {
        let need = shard_range(numel, r.new_world, to);
        for old in 0..r.old_world {
            let have = shard_range(numel, r.old_world, old);
            let range = need.start.max(have.start)..need.end.min(have.end);
            if range.is_empty() {
                continue;
            }
            let from = r.brought_by[old].ok_or(ResizeError::NoSource {
                part: i,
                range: range.clone(),
                old,
            })?;
            if from != to {
                moves.push(Move {
                    part: i,
                    range,
                    from,
                    to,
                });
            }
        }
    }
    Ok(())
}

/// Part `i`, replicated: each place that lacks it takes an even piece from
/// every holder.
fn replicated(
    i: usize,
    numel: usize,
    r: &Resize,
    holders: &[usize],
    moves: &mut Vec<Move>,
) -> Result<(), ResizeError> {
    let lacking: Vec<usize> = (0..r.new_world).filter(|&p| !r.whole[p]).collect();
    if lacking.is_empty() || numel == 0 {
        return Ok(());
    }
    if holders.is_empty() {
        return Err(ResizeError::NoWhole { part: i });
    }
    for (j, &to) in lacking.iter().enumerate() {
        for k in 0..holders.len() {
            let range = shard_range(numel, holders.len(), k);
            if !range.is_empty() {
                moves.push(Move {
                    part: i,
                    range,
                    from: holders[(k + j) % holders.len()],
                    to,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn part(numel: usize, layout: Layout) -> Part {
        Part {
            numel,
            elem_bytes: 4,
            layout,
        }
    }

    /// Four ranks, rank 1 lost and its replica held by old rank 2's host:
    /// three places (old 0, 2, 3 at 0, 1, 2) take the 12-element moments.
    #[test]
    fn a_shrink_moves_only_the_slices_that_change_owner() {
        let parts = [part(12, Layout::Sliced), part(8, Layout::Replicated)];
        let r = Resize {
            old_world: 4,
            new_world: 3,
            brought_by: &[Some(0), Some(1), Some(1), Some(2)],
            whole: &[true, true, true],
        };
        let moves = plan(&parts, &r).unwrap();
        // Old slices 0..3, 3..6, 6..9, 9..12; new 0..4, 4..8, 8..12.
        // Place 1 holds old slices 1 and 2 (3..9) and keeps 4..8.
        assert_eq!(
            moves,
            [
                Move {
                    part: 0,
                    range: 3..4,
                    from: 1,
                    to: 0
                },
                Move {
                    part: 0,
                    range: 8..9,
                    from: 1,
                    to: 2
                },
            ]
        );
        assert_eq!(received(&parts, &moves, 3), [4, 0, 4]);
        // An all-gather sends each place 8 of the 12 moments and all 8
        // parameters: 64 bytes, against 4 at most here.
        assert_eq!(all_gather_bytes(&parts, 3), 64);
    }

    /// Three ranks grow to four, the joining rank at place 1: it takes the
    /// replicated part in three pieces, one from each holder.
    #[test]
    fn a_grow_splits_a_replicated_part_among_the_holders() {
        let parts = [part(9, Layout::Replicated), part(12, Layout::Sliced)];
        let r = Resize {
            old_world: 3,
            new_world: 4,
            brought_by: &[Some(0), Some(2), Some(3)],
            whole: &[true, false, true, true],
        };
        let moves = plan(&parts, &r).unwrap();
        let replicated: Vec<_> = moves.iter().filter(|m| m.part == 0).cloned().collect();
        assert_eq!(
            replicated,
            [
                Move {
                    part: 0,
                    range: 0..3,
                    from: 0,
                    to: 1
                },
                Move {
                    part: 0,
                    range: 3..6,
                    from: 2,
                    to: 1
                },
                Move {
                    part: 0,
                    range: 6..9,
                    from: 3,
                    to: 1
                },
            ]
        );
        // Old slices 0..4 (at 0), 4..8 (at 2), 8..12 (at 3); new 0..3,
        // 3..6, 6..9, 9..12.
        let sliced: Vec<_> = moves.iter().filter(|m| m.part == 1).cloned().collect();
        assert_eq!(
            sliced,
            [
                Move {
                    part: 1,
                    range: 3..4,
                    from: 0,
                    to: 1
                },
                Move {
                    part: 1,
                    range: 4..6,
                    from: 2,
                    to: 1
                },
                Move {
                    part: 1,
                    range: 8..9,
                    from: 3,
                    to: 2
                },
            ]
        );
    }

    #[test]
    fn what_no_rank_brings_is_named() {
        let parts = [part(8, Layout::Sliced), part(4, Layout::Replicated)];
        let lost = Resize {
            old_world: 2,
            new_world: 1,
            brought_by: &[Some(0), None],
            whole: &[true],
        };
        let e = plan(&parts, &lost).unwrap_err();
        assert_eq!(
            e,
            ResizeError::NoSource {
                part: 0,
                range: 4..8,
                old: 1
            }
        );
        assert!(e.to_string().contains("old rank 1"), "{e}");
        let nobody = Resize {
            old_world: 1,
            new_world: 2,
            brought_by: &[Some(0)],
            whole: &[false, false],
        };
        assert_eq!(
            plan(&parts[1..], &nobody).unwrap_err(),
            ResizeError::NoWhole { part: 0 }
        );
        let bad = Resize {
            old_world: 2,
            new_world: 2,
            brought_by: &[Some(0), Some(2)],
            whole: &[true, true],
        };
        assert!(matches!(
            plan(&parts, &bad),
            Err(ResizeError::Place { place: 2, .. })
        ));
        let short = Resize {
            whole: &[true],
            ..bad
        };
        assert!(matches!(
            plan(&parts, &short),
            Err(ResizeError::Shape { .. })
        ));
    }

    #[test]
    fn a_route_takes_what_a_place_lacks_from_the_next_holder() {
        // Three places hold thirds of a part that each needs whole, and
        // halves of another: each takes the thirds it lacks from the
        // places after it, and nothing it holds.
        let thirds = |p: usize| vec![vec![p * 10..(p + 1) * 10]];
        let holds: Vec<_> = (0..3).map(thirds).collect();
        let needs = vec![vec![vec![0..30]]; 3];
        let moves = route(&holds, &needs).unwrap();
        assert_eq!(moves.len(), 6);
        assert!(moves.contains(&Move {
            part: 0,
            range: 10..20,
            from: 1,
            to: 0
        }));
        assert!(moves.contains(&Move {
            part: 0,
            range: 0..10,
            from: 0,
            to: 2
        }));
        assert!(moves.iter().all(|m| m.from != m.to));
        // What no place holds is named.
        let holds = vec![vec![vec![0..5]], vec![vec![]]];
        let needs = vec![vec![vec![]], vec![vec![0..8]]];
        assert_eq!(
            route(&holds, &needs),
            Err(ResizeError::Unheld {
                part: 0,
                range: 5..8,
                to: 1
            })
        );
    }

    proptest! {
        /// Whatever the places hold, each element a place needs and lacks
        /// arrives once from a place holding it, and nothing else moves.
        #[test]
        fn a_route_brings_each_lacking_element_once(
            world in 1usize..6,
            numel in 1usize..80,
            cuts in proptest::collection::vec((0usize..6, 0usize..80, 0usize..80), 0..16),
            needs_whole in proptest::collection::vec(any::<bool>(), 6),
        ) {
            // Every element is held somewhere: slices of an old layout,
            // plus arbitrary extra ranges.
            let mut holds: Vec<Vec<Vec<Range<usize>>>> =
                (0..world).map(|p| vec![vec![shard_range(numel, world, p)]]).collect();
            for (p, a, b) in cuts {
                let (lo, hi) = (a.min(b).min(numel), a.max(b).min(numel));
                holds[p % world][0].push(lo..hi);
            }
            let needs: Vec<Vec<Vec<Range<usize>>>> = (0..world)
                .map(|p| vec![vec![if needs_whole[p] { 0..numel } else { shard_range(numel, world, (p + 1) % world) }]])
                .collect();
            let moves = route(&holds, &needs).unwrap();
            for (to, need) in needs.iter().enumerate() {
                let held = |p: usize, e: usize| holds[p][0].iter().any(|r| r.contains(&e));
                let mut got = vec![0u32; numel];
                for m in moves.iter().filter(|m| m.to == to) {
                    prop_assert_ne!(m.from, m.to);
                    for e in m.range.clone() {
                        prop_assert!(held(m.from, e), "{:?} from a place without element {}", m, e);
                        got[e] += 1;
                    }
                }
                for (e, n) in got.iter().enumerate() {
                    let want = u32::from(need[0][0].contains(&e) && !held(to, e));
                    prop_assert_eq!(*n, want, "element {} at place {}", e, to);
                }
            }
        }
    }

    proptest! {
        /// Every element each new place needs is there already or arrives
        /// exactly once, nothing else moves, and the bytes moved are the
        /// least: the elements a place needs and does not hold.
        #[test]
        fn every_piece_lands_exactly_once_and_nothing_else_moves(
            numels in proptest::collection::vec(0usize..200, 1..4),
            replicated in proptest::collection::vec(any::<bool>(), 4),
            old_world in 1usize..7,
            new_world in 1usize..7,
            seed in any::<u64>(),
        ) {
            let parts: Vec<Part> = numels
                .iter()
                .zip(&replicated)
                .map(|(&n, &rep)| part(n, if rep { Layout::Replicated } else { Layout::Sliced }))
                .collect();
            let mut x = seed | 1;
            let mut next = |m: usize| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % m as u64) as usize
            };
            let brought_by: Vec<Option<usize>> = (0..old_world).map(|_| Some(next(new_world))).collect();
            let mut whole: Vec<bool> = (0..new_world).map(|_| next(2) == 0).collect();
            whole[next(new_world)] = true;
            let r = Resize { old_world, new_world, brought_by: &brought_by, whole: &whole };
            let moves = plan(&parts, &r).unwrap();
            let mut least = 0u64;
            for (i, p) in parts.iter().enumerate() {
                for to in 0..new_world {
                    // What `to` holds before, and needs after.
                    let (held, need): (Vec<bool>, Vec<bool>) = (0..p.numel)
                        .map(|e| match p.layout {
                            Layout::Replicated => (whole[to], true),
                            Layout::Sliced => {
                                let old = (0..old_world)
                                    .find(|&o| shard_range(p.numel, old_world, o).contains(&e))
                                    .unwrap();
                                (brought_by[old] == Some(to), shard_range(p.numel, new_world, to).contains(&e))
                            }
                        })
                        .unzip();
                    let mut got = vec![0u32; p.numel];
                    for m in moves.iter().filter(|m| m.part == i && m.to == to) {
                        prop_assert_ne!(m.from, m.to);
                        // The sender holds what it sends.
                        let holds = match p.layout {
                            Layout::Replicated => whole[m.from],
                            Layout::Sliced => (0..old_world).any(|o| {
                                let s = shard_range(p.numel, old_world, o);
                                brought_by[o] == Some(m.from)
                                    && s.start <= m.range.start
                                    && m.range.end <= s.end
                            }),
                        };
                        prop_assert!(holds, "{:?} from a place that does not hold it", m);
                        for e in m.range.clone() {
                            got[e] += 1;
                        }
                    }
                    for e in 0..p.numel {
                        let want = u32::from(need[e] && !held[e]);
                        prop_assert_eq!(got[e], want, "part {} element {} at place {}", i, e, to);
                        least += u64::from(want) * p.elem_bytes as u64;
                    }
                }
            }
            prop_assert_eq!(moves.iter().map(|m| m.bytes(&parts)).sum::<u64>(), least);
        }
    }
}
