//! The steps kept for the peer replicas (the replica hold's words on the
//! control page, 2.3): a common step every rank's store and a replica of
//! every rank hold, and a target, the step to become the next one. The
//! agent writes them (the target last); a store of three slots or more
//! never overwrites a slot holding them ([`Store::writable_slot`]). How
//! they are chosen: `hatrain-agent`'s controller (`decider::hold`).
//!
//! ```text
//! control page 480: common step + 1 (0: none)   488: target + 1 (0: none)
//! ```
//!
//! [`Store::writable_slot`]: super::Store::writable_slot

use super::{ControlPage, SlotInfo, Store};
use std::sync::atomic::Ordering;

/// The steps a store keeps for the job's peer replicas, so that whichever
/// host is lost, its ranks' replicas and every other rank's store have a
/// step in common.
///
/// - `common`: a step that every rank's store and a replica of every rank
///   hold (confirmed by the controller from every host's reports).
/// - `target`: the step that is to become the next common one, named
///   before any rank seals it. Each store keeps the first snapshot it
///   seals at or after it ([`Store::kept_for_target`]), and each stream
///   sends that one to the rank's holder, ahead of newer snapshots.
///
/// Once every store and a replica of every rank hold the target, it
/// becomes the common step and the old one is let go: at every moment
/// some step is held everywhere. A store of three slots or more never
/// overwrites a slot holding either ([`Store::writable_slot`]); while the
/// replicas lag, its newest snapshot is rewritten instead.
///
/// [`Store::writable_slot`]: super::Store::writable_slot
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Kept {
    pub common: Option<u64>,
    pub target: Option<u64>,
}

impl ControlPage {
    /// The steps every rank's store keeps for the peer replicas (see
    /// [`Kept`]); written by the agent.
    pub fn set_kept(&self, kept: Kept) {
        let word = |s: Option<u64>| s.map_or(0, |s| s.saturating_add(1));
        self.keep.store(word(kept.common), Ordering::Release);
        self.keep_target.store(word(kept.target), Ordering::Release);
    }
    pub fn kept(&self) -> Kept {
        // The target first: the agent writes it last, so a new target is
        // read with the common step that came with it (the snapshot kept
        // for the old target, which became the common one, is never let go
        // in between).
        let target = self.keep_target.load(Ordering::Acquire).checked_sub(1);
        Kept {
            common: self.keep.load(Ordering::Acquire).checked_sub(1),
            target,
        }
    }
}

impl Store {
    /// The snapshot kept for the replicas' target ([`ControlPage::kept`]):
    /// the first this store sealed at or after it (the target itself,
    /// unless the rank does not snapshot every step).
    ///
    /// [`ControlPage::kept`]: super::ControlPage::kept
    pub fn kept_for_target(&self) -> Option<SlotInfo> {
        first_at_or_after(&self.sealed(), self.page().kept().target)
    }
}

/// Of `sealed`, the snapshot of the lowest step at or after `target`.
pub(super) fn first_at_or_after(sealed: &[SlotInfo], target: Option<u64>) -> Option<SlotInfo> {
    let t = target?;
    sealed
        .iter()
        .filter(|i| i.step >= t)
        .min_by_key(|i| i.step)
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::tests::seal;
    use crate::shm::{Geometry, store_path};

    /// The steps kept for the replicas are never overwritten in a store
    /// of three slots (the others rotate; with both kept and sealed, the
    /// newest is rewritten), nor kept in one of two, where they would leave
    /// no slot to write; the job's last snapshot takes one.
    #[test]
    fn the_steps_kept_for_the_replicas_are_not_overwritten_where_a_slot_is_left() {
        let d = tempfile::tempdir().unwrap();
        let s = Store::create(&store_path(d.path(), 3), 3, Geometry::new(3, 64), 7, 9).unwrap();
        let data = [1u8; 64];
        let steps = |s: &Store| {
            let mut v: Vec<u64> = s.sealed().iter().map(|i| i.step).collect();
            v.sort_unstable();
            v
        };
        for step in 1..=3 {
            seal(&s, step, &data);
        }
        let kept = |common, target| Kept { common, target };
        s.page().set_kept(kept(Some(2), Some(6)));
        assert_eq!(s.page().kept(), kept(Some(2), Some(6)));
        for step in 4..=6 {
            seal(&s, step, &data);
            assert_eq!(steps(&s), [2, step - 1, step], "after step {step}");
        }
        // Both kept steps sealed, and the newest: the newest is rewritten,
        // the kept ones stay.
        seal(&s, 7, &data);
        assert_eq!(steps(&s), [2, 6, 7]);
        seal(&s, 8, &data);
        assert_eq!(steps(&s), [2, 6, 8]);
        // Held for the persister as well: nothing is left.
        let newest = s.find_step(8).unwrap().slot;
        s.page().hold(8, newest).unwrap();
        assert_eq!(s.writable_slot(), None);
        assert_eq!(
            s.writable_slot_keeping(false),
            s.find_step(2).map(|i| i.slot)
        );
        s.page().release_hold(s.page().held().unwrap());
        // The target became the common step: step 2 goes.
        s.page().set_kept(kept(Some(6), Some(10)));
        seal(&s, 9, &data);
        assert_eq!(steps(&s), [6, 8, 9]);
        // A step no slot holds keeps nothing.
        s.page().set_kept(kept(Some(40), None));
        seal(&s, 10, &data);
        seal(&s, 11, &data);
        assert_eq!(steps(&s), [9, 10, 11]);
        // A rank snapshotting every other step keeps the first snapshot at
        // or after the target.
        s.page().set_kept(kept(None, Some(13)));
        for step in [12, 14, 16, 18, 20] {
            seal(&s, step, &data);
        }
        assert_eq!(steps(&s), [14, 18, 20]);
        assert_eq!(s.kept_for_target().map(|i| i.step), Some(14));
        s.page().set_kept(Kept::default());
        assert_eq!(s.page().kept(), Kept::default());
        assert_eq!(s.kept_for_target(), None);

        let two = Store::create(&store_path(d.path(), 4), 4, Geometry::new(2, 64), 7, 9).unwrap();
        for step in 1..=2 {
            seal(&two, step, &data);
        }
        two.page().set_kept(kept(Some(1), None));
        assert!(two.writable_slot().is_some(), "two slots keep nothing");
    }
}
