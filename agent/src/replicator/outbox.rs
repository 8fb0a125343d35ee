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

    /// The peer grants `n` more chunks.
    pub fn credit(&mut self, n: u32) {
        self.credit = self.credit.saturating_add(u64::from(n));
    }

    /// Credit left.
    pub fn credit_left(&self) -> u64 {
        self.credit
    }

    /// The newest step the peer stored of `rank`.
    pub fn stored_step(&self, rank: u64) -> Option<u64> {
        self.progress.get(&rank).and_then(|p| p.stored_step)
    }

    /// Whether `rank`'s replica is [`at_risk`] now.
    pub fn set_at_risk(&mut self, rank: u64, risk: bool) {
        match self.progress.get_mut(&rank) {
            Some(p) => p.at_risk = risk,
            None if risk => {
                self.progress.entry(rank).or_default().at_risk = true;
            }
            None => {}
        }
    }

    /// The peer stored `rank`'s snapshot of `step`.
    pub fn stored(&mut self, rank: u64, step: u64) {
        let p = self.progress.entry(rank).or_default();
        if p.stored_step.is_none_or(|s| s < step) {
            p.stored_step = Some(step);
        }
    }

    /// The peer dropped `rank`'s snapshot of `step`: a transfer of it in
    /// progress ends (the peer would drop the rest of its chunks too), and
    /// it counts once as abandoned however many of its chunks were dropped.
    pub fn dropped(&mut self, rank: u64, step: u64) {
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

/// Whether the newest replica the peer stored of a rank (`stored`) is no
/// longer safe: the rank's own store (`held`, its sealed steps newest
/// first, of `slots`) keeps that step only in the slot its next commit
/// overwrites, or not at all. The other ranks commit in step with it, so
/// from then on a loss of this host leaves no step common to the replica
/// and the survivors: the job cannot recover from memory.
///
/// `filled`: the store has had every slot sealed. Before that a commit
/// overwrites nothing; after, a slot missing from `held` is one a commit is
/// rewriting, and the one after it is the oldest held.
///
/// A replica newer than every step held is of a timeline a recovery
/// abandoned (its older steps held beside it serve): not at risk.
pub fn at_risk(held: &[u64], slots: usize, stored: Option<u64>, filled: bool) -> bool {
    if slots < 2 || !filled || held.is_empty() || stored > held.first().copied() {
        return false;
    }
    let safe = &held[..held.len().min(slots - 1)];
    stored.is_none_or(|s| !safe.contains(&s))
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

    #[test]
    fn a_replica_is_at_risk_once_only_the_slot_overwritten_next_holds_its_step() {
        // Never full yet: the next commit overwrites nothing.
        assert!(!at_risk(&[3], 2, None, false));
        assert!(!at_risk(&[3, 2], 2, Some(3), true));
        assert!(
            at_risk(&[3, 2], 2, Some(2), true),
            "step 2 goes at the next commit"
        );
        assert!(at_risk(&[5, 4], 2, Some(3), true), "step 3 is gone");
        assert!(at_risk(&[5, 4], 2, None, true), "no replica yet, and full");
        assert!(!at_risk(&[9, 8, 7, 6], 4, Some(7), true));
        assert!(at_risk(&[9, 8, 7, 6], 4, Some(6), true));
        // A commit rewrites a slot (it is missing from the sealed ones):
        // the oldest held goes at the commit after, not now.
        assert!(!at_risk(&[5], 2, Some(5), true));
        assert!(at_risk(&[5], 2, Some(4), true), "step 4 is being rewritten");
        assert!(!at_risk(&[9, 8, 7], 4, Some(7), true));
        // After a rollback to step 6: the replica of step 8 was of the
        // abandoned timeline.
        assert!(!at_risk(&[6], 2, Some(8), true));
        // One slot: nothing to compare with (no consistent step but the
        // newest anyway).
        assert!(!at_risk(&[9], 1, Some(3), true));
    }
}
