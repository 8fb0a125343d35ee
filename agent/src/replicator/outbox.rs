//! The sending side of one replica stream, as a state machine without I/O.
//!
//! It is told which snapshots seal ([`Outbox::offer`]), what the peer
//! grants ([`Outbox::credit`]) and what it stored ([`Outbox::stored`]), and
//! answers which chunk to send next ([`Outbox::next_chunk`]).
//!
//! - **Newest first.** Of each rank only the newest sealed snapshot waits;
//!   an older one that has not started is replaced, never queued. A
//!   transfer in progress runs to its end (so a link slower than one
//!   snapshot per step still completes some), unless its slot is rewritten
//!   meanwhile ([`Outbox::torn`]); then the newest one starts.
//! - **Bounded.** Every chunk sent spends one credit, and only the peer
//!   grants credit (one per chunk it has taken), so at most the granted
//!   window of chunks is in flight: memory on both sides is bounded, and
//!   nothing waits on the training path.
//! - **Fair.** Ranks with a transfer take turns, chunk by chunk.

use std::collections::BTreeMap;

/// A sealed snapshot of a local rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    pub rank: u64,
    pub step: u64,
    pub slot: usize,
    pub len: u64,
}

/// One chunk to read from `slot` and send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkPlan {
    pub offer: Offer,
    pub offset: u64,
    pub len: u64,
}

/// The snapshot kept as a rank's replicas' next common step: its step,
/// whether all of it went out, and whether the peer stored it (in this
/// session).
#[derive(Debug, Clone, Copy)]
struct Target {
    step: u64,
    sent: bool,
    stored: bool,
}

#[derive(Debug, Clone, Copy)]
struct Transfer {
    offer: Offer,
    next: u64,
}

/// What one rank's stream has done, for `agentctl status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankProgress {
    /// The newest step sealed locally.
    pub local_step: Option<u64>,
    pub local_len: u64,
    /// The newest step the peer stored.
    pub stored_step: Option<u64>,
    /// Bytes of the newest local snapshot the peer does not hold yet.
    pub lag_bytes: u64,
    /// Snapshots given up: rewritten while sent, or dropped by the peer.
    pub abandoned: u64,
    /// The newest step the peer dropped.
    pub dropped_step: Option<u64>,
    /// See [`at_risk`]; set by the stream, which sees the rank's store.
    pub at_risk: bool,
}

/// The sending side of one stream.
#[derive(Debug)]
pub struct Outbox {
    chunk: u64,
    credit: u64,
    waiting: BTreeMap<u64, Offer>,
    sending: BTreeMap<u64, Transfer>,
    /// The rank served last, for taking turns.
    last: Option<u64>,
    progress: BTreeMap<u64, RankProgress>,
    /// Per rank, the steps the peer stored in this session, newest first
    /// ([`PEER_STEPS`] at most).
    peer_steps: BTreeMap<u64, Vec<u64>>,
    /// Per rank, the snapshot kept as the replicas' next common step.
    targets: BTreeMap<u64, Target>,
    /// Per rank, the snapshot of the replicas' common step, for a replica
    /// made after it was named (see [`Outbox::offer_common`]).
    commons: BTreeMap<u64, Target>,
    pub chunks_sent: u64,
    pub bytes_sent: u64,
}

impl Outbox {
    /// An outbox sending chunks of at most `chunk` bytes, with no credit
    /// until the peer grants some.
    pub fn new(chunk: u64) -> Self {
        assert!(chunk > 0, "a chunk of no bytes");
        Self {
            chunk,
            credit: 0,
            waiting: BTreeMap::new(),
            sending: BTreeMap::new(),
            last: None,
            progress: BTreeMap::new(),
            peer_steps: BTreeMap::new(),
            targets: BTreeMap::new(),
            commons: BTreeMap::new(),
            chunks_sent: 0,
            bytes_sent: 0,
        }
    }

    /// A snapshot sealed. An older one of the same rank that has not
    /// started is dropped; the same or an older step than known is ignored.
    pub fn offer(&mut self, o: Offer) {
        let p = self.progress.entry(o.rank).or_default();
        if p.local_step.is_some_and(|s| s >= o.step) {
            return;
        }
        p.local_step = Some(o.step);
        p.local_len = o.len;
        self.waiting.insert(o.rank, o);
    }

    /// The snapshot the job keeps as its replicas' next common step
    /// ([`hatrain_shared::shm::Kept`]): it waits to go ahead of newer ones
    /// (after the transfer in progress), unless the peer stored it, or it
    /// went and is not acknowledged yet. True until the peer stored it:
    /// the rank's newer snapshots are not offered meanwhile.
    pub fn offer_target(&mut self, o: Offer) -> bool {
        self.offer_kept(o, false)
    }

    /// The snapshot of the replicas' common step, as
    /// [`Outbox::offer_target`], ahead of the target's: a replica made
    /// after the common step was named (its stream began late) gets that
    /// step too, so that the common step is held by every replica of the
    /// rank, not only by those that existed when it was named. True until
    /// it went (or the peer stored it) in this session; one the peer drops
    /// is not sent again in it.
    pub fn offer_common(&mut self, o: Offer) -> bool {
        self.offer_kept(o, true)
    }

    fn offer_kept(&mut self, o: Offer, common: bool) -> bool {
        let stored = self
            .peer_steps
            .get(&o.rank)
            .is_some_and(|s| s.contains(&o.step));
        let fresh = Target {
            step: o.step,
            sent: false,
            stored: false,
        };
        let kept = if common {
            &mut self.commons
        } else {
            &mut self.targets
        };
        let target = kept.entry(o.rank).or_insert(fresh);
        if target.step != o.step {
            *target = fresh;
        }
        target.stored |= stored;
        if target.stored {
            return false;
        }
        // Under way, or all sent and not acknowledged yet. The common
        // step holds newer snapshots back only until it is sent: a holder
        // that never acknowledges it does not stop the stream.
        if target.sent {
            return !common;
        }
        if self
            .sending
            .get(&o.rank)
            .is_some_and(|t| t.offer.step == o.step)
        {
            return true;
        }
        self.waiting.insert(o.rank, o);
        // A newer snapshot is offered again once it went.
        self.progress.entry(o.rank).or_default().local_step = Some(o.step);
        true
    }

    /// The peer grants `n` more chunks.
    pub fn credit(&mut self, n: u32) {
        self.credit = self.credit.saturating_add(u64::from(n));
    }

    /// Credit left.
    pub fn credit_left(&self) -> u64 {
        self.credit
    }

    /// The newest `n` steps the peer stored of `rank` in this session,
    /// newest first: what its replica store of `n` slots holds.
    pub fn peer_steps(&self, rank: u64, n: usize) -> &[u64] {
        self.peer_steps
            .get(&rank)
            .map_or(&[][..], |s| &s[..s.len().min(n)])
    }

    /// Whether `rank`'s replica is [`at_risk`] now.
    pub fn set_at_risk(&mut self, rank: u64, risk: bool) {
        if risk || self.progress.contains_key(&rank) {
            self.progress.entry(rank).or_default().at_risk = risk;
        }
    }

    /// The peer stored `rank`'s snapshot of `step`.
    pub fn stored(&mut self, rank: u64, step: u64) {
        let p = self.progress.entry(rank).or_default();
        if p.stored_step.is_none_or(|s| s < step) {
            p.stored_step = Some(step);
        }
        for kept in [&mut self.targets, &mut self.commons] {
            if let Some(t) = kept.get_mut(&rank).filter(|t| t.step == step) {
                t.stored = true;
            }
        }
        let steps = self.peer_steps.entry(rank).or_default();
        if !steps.contains(&step) {
            steps.push(step);
            steps.sort_unstable_by(|a, b| b.cmp(a));
            steps.truncate(PEER_STEPS);
        }
    }

    /// The peer dropped `rank`'s snapshot of `step`: a transfer of it in
    /// progress ends (the peer would drop the rest of its chunks too), and
    /// it counts once as abandoned however many of its chunks were dropped.
    pub fn dropped(&mut self, rank: u64, step: u64) {
        if let Some(t) = self.targets.get_mut(&rank).filter(|t| t.step == step) {
            // It goes again.
            t.sent = false;
        }
        if let Some(c) = self.commons.get_mut(&rank).filter(|c| c.step == step) {
            // Not again in this session: a holder that refuses it (a
            // snapshot of another epoch, no slot) would refuse it again,
            // and the newer snapshots wait for nothing.
            c.stored = true;
        }
        let p = self.progress.entry(rank).or_default();
        if p.dropped_step != Some(step) {
            p.dropped_step = Some(step);
            p.abandoned += 1;
        }
        if self
            .sending
            .get(&rank)
            .is_some_and(|t| t.offer.step == step)
        {
            self.sending.remove(&rank);
        }
    }

    /// `rank`'s snapshots may go again from the one it holds now (the peer
    /// refused one it was not told to take yet: a standby whose orders
    /// come after the hand-over).
    pub fn again(&mut self, rank: u64) {
        if let Some(p) = self.progress.get_mut(&rank) {
            p.local_step = None;
        }
    }

    /// `rank` is sent no more (its holder will not take it): whatever of
    /// it waits or is under way is dropped, and its figures with it.
    pub fn forget(&mut self, rank: u64) {
        self.waiting.remove(&rank);
        self.sending.remove(&rank);
        self.progress.remove(&rank);
        self.peer_steps.remove(&rank);
        self.targets.remove(&rank);
        self.commons.remove(&rank);
    }

    /// The slot of `rank`'s transfer was rewritten while it was read: the
    /// transfer ends, and the newest snapshot goes next.
    pub fn torn(&mut self, rank: u64) {
        if self.sending.remove(&rank).is_some() {
            self.progress.entry(rank).or_default().abandoned += 1;
        }
    }

    /// A new session: no credit until it grants some, and transfers in
    /// progress start again from their first byte (the newest waiting
    /// snapshot of a rank goes instead, if there is one).
    pub fn reset(&mut self) {
        self.credit = 0;
        // A new session may be with a holder that lost what it held.
        self.peer_steps.clear();
        self.targets.clear();
        self.commons.clear();
        for (rank, t) in std::mem::take(&mut self.sending) {
            self.waiting.entry(rank).or_insert(t.offer);
        }
    }

    /// The next chunk to send, spending one credit; `None` without credit
    /// or without anything to send.
    pub fn next_chunk(&mut self) -> Option<ChunkPlan> {
        if self.credit == 0 {
            return None;
        }
        let ranks: Vec<u64> = self
            .sending
            .keys()
            .chain(self.waiting.keys())
            .copied()
            .collect();
        // Take turns: the first rank after the one served last.
        let rank = ranks
            .iter()
            .copied()
            .filter(|r| self.last.is_none_or(|l| *r > l))
            .min()
            .or_else(|| ranks.iter().copied().min())?;
        let t = match self.sending.get(&rank) {
            Some(t) => *t,
            None => {
                let offer = self.waiting.remove(&rank)?;
                Transfer { offer, next: 0 }
            }
        };
        let len = self.chunk.min(t.offer.len - t.next);
        let plan = ChunkPlan {
            offer: t.offer,
            offset: t.next,
            len,
        };
        let next = t.next + len;
        if next >= t.offer.len {
            self.sending.remove(&rank);
            for kept in [&mut self.targets, &mut self.commons] {
                if let Some(k) = kept.get_mut(&rank).filter(|x| x.step == t.offer.step) {
                    k.sent = true;
                }
            }
        } else {
            self.sending.insert(rank, Transfer { next, ..t });
        }
        self.last = Some(rank);
        self.credit -= 1;
        self.chunks_sent += 1;
        self.bytes_sent += len;
        Some(plan)
    }

    /// Each rank's progress, with its lag computed now.
    pub fn progress(&self) -> BTreeMap<u64, RankProgress> {
        let mut out = self.progress.clone();
        for (rank, p) in &mut out {
            let behind = match (p.local_step, p.stored_step) {
                (Some(l), Some(s)) => l > s,
                (Some(_), None) => true,
                _ => false,
            };
            let sent = self
                .sending
                .get(rank)
                .filter(|t| Some(t.offer.step) == p.local_step)
                .map_or(0, |t| t.next);
            p.lag_bytes = if behind { p.local_len - sent } else { 0 };
        }
        out
    }
}

/// Receipts kept per rank: more than any replica store has slots.
const PEER_STEPS: usize = 16;

/// Whether a rank's replica is no longer safe: no step the peer holds of it
/// (`peer`) is kept by the rank's own store other than in the slot its next
/// commit overwrites. The other ranks commit in step with it, so from then
/// on a loss of this host leaves no step common to the replica and the
/// survivors: the job cannot recover from memory.
///
/// `held`: the store's sealed snapshots as (slot, step); `next`: the slot
/// its next commit writes ([`Store::writable_slot`]: an empty slot, or the
/// one a commit is writing now, while the store has one).
///
/// With no replica yet, a rank is at risk once its next commit discards a
/// sealed snapshot (not while its store is still filling up at the start).
///
/// [`Store::writable_slot`]: hatrain_shared::shm::Store::writable_slot
pub fn at_risk(held: &[(usize, u64)], next: Option<usize>, peer: &[u64]) -> bool {
    if peer.is_empty() {
        return next.is_some_and(|n| held.iter().any(|(s, _)| *s == n));
    }
    !held
        .iter()
        .any(|(slot, step)| Some(*slot) != next && peer.contains(step))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(rank: u64, step: u64, len: u64) -> Offer {
        Offer {
            rank,
            step,
            slot: (step % 2) as usize,
            len,
        }
    }

    fn drain(o: &mut Outbox) -> Vec<(u64, u64, u64)> {
        std::iter::from_fn(|| o.next_chunk())
            .map(|c| (c.offer.rank, c.offer.step, c.offset))
            .collect()
    }

    #[test]
    fn a_forgotten_rank_goes_no_more_and_the_others_go_on() {
        let mut o = Outbox::new(10);
        o.offer(offer(0, 1, 30));
        o.offer(offer(1, 1, 20));
        o.credit(2);
        assert_eq!(drain(&mut o), vec![(0, 1, 0), (1, 1, 0)]);
        o.stored(0, 0);
        o.forget(0);
        o.credit(10);
        assert_eq!(drain(&mut o), vec![(1, 1, 10)]);
        assert!(o.peer_steps(0, 4).is_empty());
        assert_eq!(o.progress().keys().copied().collect::<Vec<_>>(), vec![1]);
        // Offered again (the rank is fed to the stream anew), it goes.
        o.offer(offer(0, 2, 10));
        assert_eq!(drain(&mut o), vec![(0, 2, 0)]);
    }

    #[test]
    fn nothing_goes_without_credit_and_credit_bounds_what_is_in_flight() {
        let mut o = Outbox::new(10);
        o.offer(offer(0, 1, 35));
        assert_eq!(o.next_chunk(), None);
        o.credit(2);
        assert_eq!(drain(&mut o), vec![(0, 1, 0), (0, 1, 10)]);
        o.credit(5);
        assert_eq!(drain(&mut o), vec![(0, 1, 20), (0, 1, 30)]);
        assert_eq!(o.credit_left(), 3);
        assert_eq!(o.bytes_sent, 35);
    }

    #[test]
    fn only_the_newest_waiting_snapshot_is_sent_and_a_transfer_runs_to_its_end() {
        let mut o = Outbox::new(10);
        o.offer(offer(0, 1, 20));
        o.offer(offer(0, 2, 20));
        o.offer(offer(0, 3, 20));
        o.credit(1);
        assert_eq!(drain(&mut o), vec![(0, 3, 0)]);
        // Step 4 seals while 3 is half sent: 3 finishes, then 4.
        o.offer(offer(0, 4, 20));
        o.offer(offer(0, 2, 20));
        o.credit(10);
        assert_eq!(drain(&mut o), vec![(0, 3, 10), (0, 4, 0), (0, 4, 10)]);
    }

    #[test]
    fn a_rewritten_slot_ends_its_transfer_and_the_newest_goes_next() {
        let mut o = Outbox::new(10);
        o.offer(offer(0, 1, 30));
        o.credit(1);
        drain(&mut o);
        o.offer(offer(0, 2, 30));
        o.torn(0);
        o.credit(10);
        assert_eq!(drain(&mut o), vec![(0, 2, 0), (0, 2, 10), (0, 2, 20)]);
        assert_eq!(o.progress()[&0].abandoned, 1);
    }

    /// A holder that drops a snapshot would drop the rest of its chunks:
    /// its transfer ends at the first drop, which counts once.
    #[test]
    fn a_dropped_snapshot_is_sent_no_further_and_counts_once() {
        let mut o = Outbox::new(10);
        o.offer(offer(0, 1, 50));
        o.credit(2);
        drain(&mut o);
        o.dropped(0, 1);
        o.dropped(0, 1);
        o.credit(10);
        assert_eq!(drain(&mut o), vec![], "nothing more of step 1");
        assert_eq!(o.progress()[&0].abandoned, 1);
        o.offer(offer(0, 2, 20));
        assert_eq!(drain(&mut o), vec![(0, 2, 0), (0, 2, 10)]);
    }

    #[test]
    fn ranks_take_turns() {
        let mut o = Outbox::new(10);
        o.offer(offer(4, 1, 20));
        o.offer(offer(5, 1, 30));
        o.credit(10);
        assert_eq!(
            drain(&mut o),
            vec![(4, 1, 0), (5, 1, 0), (4, 1, 10), (5, 1, 10), (5, 1, 20)]
        );
    }

    #[test]
    fn lag_counts_what_the_peer_lacks_of_the_newest_snapshot() {
        let mut o = Outbox::new(10);
        o.offer(offer(0, 7, 25));
        assert_eq!(o.progress()[&0].lag_bytes, 25);
        o.credit(1);
        drain(&mut o);
        assert_eq!(o.progress()[&0].lag_bytes, 15);
        o.credit(2);
        drain(&mut o);
        o.stored(0, 7);
        let p = o.progress()[&0];
        assert_eq!(
            (p.local_step, p.stored_step, p.lag_bytes),
            (Some(7), Some(7), 0)
        );
        o.stored(0, 5);
        assert_eq!(
            o.progress()[&0].stored_step,
            Some(7),
            "receipts never go back"
        );
    }

    #[test]
    fn a_snapshot_the_peer_refused_goes_again_only_when_asked() {
        let mut o = Outbox::new(10);
        o.credit(100);
        o.offer(offer(3, 29, 25));
        let first = o.next_chunk().expect("the snapshot goes");
        assert_eq!((first.offer.step, first.offset), (29, 0));
        // Refused (a standby not told yet): the transfer ends, and the same
        // step is not offered again by itself.
        o.dropped(3, 29);
        o.offer(offer(3, 29, 25));
        assert_eq!(o.next_chunk(), None);
        // Asked again: it goes from its first byte.
        o.again(3);
        o.offer(offer(3, 29, 25));
        let again = o.next_chunk().expect("the snapshot goes again");
        assert_eq!((again.offer.step, again.offset), (29, 0));
    }

    /// The snapshot kept for the replicas' next common step goes ahead of
    /// newer ones, after the transfer in progress, once: stored, the
    /// newest go again, and it is not sent again when older steps fall out
    /// of what the peer is known to hold.
    #[test]
    fn the_kept_target_goes_once_ahead_of_newer_snapshots() {
        let mut o = Outbox::new(10);
        o.credit(100);
        o.offer(offer(0, 7, 20));
        assert_eq!(o.next_chunk().map(|c| c.offer.step), Some(7));
        o.offer(offer(0, 9, 20));
        assert!(o.offer_target(offer(0, 8, 20)));
        // The transfer of 7 ends first; then 8, not 9.
        assert_eq!(drain(&mut o), [(0, 7, 10), (0, 8, 0), (0, 8, 10)]);
        assert!(o.offer_target(offer(0, 8, 20)), "not stored yet");
        assert_eq!(o.next_chunk(), None, "all sent already");
        o.stored(0, 7);
        o.stored(0, 8);
        assert!(!o.offer_target(offer(0, 8, 20)));
        o.offer(offer(0, 9, 20));
        assert_eq!(drain(&mut o), [(0, 9, 0), (0, 9, 10)]);
        for step in 10..40 {
            o.stored(0, step);
        }
        assert!(!o.offer_target(offer(0, 8, 20)), "stored once is enough");
        // A new target goes; a new session sends it again.
        assert!(o.offer_target(offer(0, 41, 20)));
        o.stored(0, 41);
        assert!(!o.offer_target(offer(0, 41, 20)));
        o.reset();
        assert!(o.offer_target(offer(0, 41, 20)));
    }

    /// A replica made after the common step was named (its stream began
    /// late) gets the common step first, then the target, then the
    /// newest; stored once, the common step is not sent again.
    #[test]
    fn the_common_step_goes_first_to_a_replica_that_lacks_it() {
        let mut o = Outbox::new(10);
        o.credit(100);
        o.offer(offer(0, 30, 10));
        assert!(o.offer_common(offer(0, 2, 10)));
        assert_eq!(drain(&mut o), [(0, 2, 0)]);
        o.stored(0, 2);
        assert!(!o.offer_common(offer(0, 2, 10)));
        assert!(o.offer_target(offer(0, 24, 10)));
        assert_eq!(drain(&mut o), [(0, 24, 0)]);
        o.stored(0, 24);
        assert!(!o.offer_target(offer(0, 24, 10)));
        o.offer(offer(0, 31, 10));
        assert_eq!(drain(&mut o), [(0, 31, 0)]);
        for step in 32..60 {
            o.stored(0, step);
        }
        assert!(!o.offer_common(offer(0, 2, 10)), "stored once is enough");
        // Sent and not acknowledged, it holds nothing back; dropped by the
        // holder, it is not sent again in the session.
        o.reset();
        o.credit(100);
        assert!(o.offer_common(offer(0, 3, 10)));
        assert_eq!(drain(&mut o), [(0, 3, 0)]);
        assert!(!o.offer_common(offer(0, 3, 10)), "sent: the newer go on");
        o.dropped(0, 3);
        assert!(!o.offer_common(offer(0, 3, 10)), "refused once is enough");
        assert_eq!(o.next_chunk(), None);
    }

    #[test]
    fn a_replica_is_at_risk_once_only_the_slot_overwritten_next_holds_its_step() {
        // Two slots, 0 and 1. Still filling up: the next commit writes the
        // empty slot, and nothing is discarded yet.
        assert!(!at_risk(&[(0, 1)], Some(1), &[]));
        // Full, no replica yet: the next commit discards step 1.
        assert!(at_risk(&[(1, 2), (0, 1)], Some(0), &[]));
        assert!(!at_risk(&[(1, 2), (0, 1)], Some(0), &[2, 1]));
        assert!(
            at_risk(&[(1, 2), (0, 1)], Some(0), &[1]),
            "step 1 goes at the next commit"
        );
        assert!(at_risk(&[(1, 5), (0, 4)], Some(0), &[3, 2]), "gone");
        // While a commit writes slot 0, step 5 in slot 1 stays.
        assert!(!at_risk(&[(1, 5)], Some(0), &[5, 4]));
        assert!(at_risk(&[(1, 5)], Some(0), &[4, 3]));
        // A slot held for the persister is not the next to go.
        assert!(!at_risk(&[(2, 9), (0, 8), (1, 7)], Some(0), &[9]));
        assert!(!at_risk(&[(2, 9), (0, 8), (1, 7)], Some(0), &[7]));
        assert!(at_risk(&[(2, 9), (0, 8), (1, 7)], Some(0), &[8]));
        // After a rollback to step 6 (7 and 8 emptied): the peer's 8 and 7
        // are of no use until this store holds 7 again.
        assert!(at_risk(&[(0, 6)], Some(1), &[8, 7]));
        assert!(!at_risk(&[(1, 7), (0, 6)], Some(0), &[8, 7]));
    }

    #[test]
    fn the_peer_steps_are_the_newest_receipts_of_this_session() {
        let mut o = Outbox::new(10);
        for step in [3, 5, 4, 5] {
            o.stored(0, step);
        }
        assert_eq!(o.peer_steps(0, 2), &[5, 4]);
        assert_eq!(o.peer_steps(0, 9), &[5, 4, 3]);
        assert_eq!(o.peer_steps(1, 2), &[] as &[u64]);
        o.reset();
        assert_eq!(o.peer_steps(0, 2), &[] as &[u64]);
        assert_eq!(o.progress()[&0].stored_step, Some(5), "the report keeps it");
    }
}
