//! One outgoing replica stream: connect, say hello, then send what the
//! [`Outbox`] says while the holder grants credit, each snapshot's first
//! chunk after its rank's state map. It runs on a thread of its own at idle
//! priority and never blocks a worker's commit: it reads a sealed slot in
//! place and checks after each chunk that the slot was not rewritten.

use super::outbox::{Offer, Outbox, at_risk};
use super::{HELLO_AGAIN, POLL, RankStore, ReplicatorConfig, SCAN, SILENCE, Shared, nonce, poll};
use hatrain_shared::peer::{self, ChunkHeader, DropCode, Kind, Pending, Receipt, Session};
use hatrain_shared::shm::{SlotInfo, Store};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

/// Sends `frame` once there is room, unless the stream is stopped first
/// (`Ok(false)`). `Err(EAGAIN)`: the room went away again (the peer's
/// connection dropped meanwhile).
fn send_until(sock: &zmq::Socket, frame: Vec<u8>, stop: &AtomicBool) -> Result<bool, zmq::Error> {
    while poll(sock, zmq::POLLOUT, POLL)? == 0 {
        if stop.load(Ordering::Relaxed) {
            return Ok(false);
        }
    }
    // Without copying the frame. A signal here loses it like a dropped
    // connection: the caller opens a new session.
    match sock.send(frame, zmq::DONTWAIT) {
        Err(zmq::Error::EINTR) => Err(zmq::Error::EAGAIN),
        r => r.map(|()| true),
    }
}

/// A snapshot the peer refused as not its to hold goes again after this
/// long (its orders may come after the stream: a standby told to take a
/// lost host's ranks while their holder already hands them over)...
const REFUSED_AGAIN: Duration = Duration::from_millis(100);
/// ...for this long after the first refusal.
const REFUSED_FOR: Duration = Duration::from_secs(10);
/// After that, or once a holder that took the rank's snapshots refuses
/// it (it holds the rank itself now), an own stream offers the rank once
/// in this long (the placement may turn back to the holder); a hand-over
/// offers it no more.
const DECLINED_AGAIN: Duration = Duration::from_secs(30);

/// What a stream carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Carries {
    /// This host's own ranks, to a holder of their replicas.
    Own,
    /// Replicas this host holds of a lost host's ranks, to the standby
    /// that takes them: done once the standby holds each rank itself.
    HandOver,
}

/// What a stream does next with a rank its holder refused as not its to
/// hold ([`DropCode::NotHolder`](hatrain_shared::peer::DropCode)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// Offer it again at this instant.
    Again(Instant),
    /// Offer it no more.
    Declined,
}

#[derive(Debug, Clone, Copy)]
struct Refusal {
    first: Instant,
    /// When the rank goes again; `None` while it is not held back.
    again: Option<Instant>,
}

/// The refusals of one stream's holder, by rank, without I/O: the instant
/// comes in.
#[derive(Debug)]
struct Refusals {
    carries: Carries,
    ranks: BTreeMap<u64, Refusal>,
    /// Ranks the holder stored a snapshot of on this stream.
    taken: std::collections::BTreeSet<u64>,
}

impl Refusals {
    fn new(carries: Carries) -> Self {
        Self {
            carries,
            ranks: BTreeMap::new(),
            taken: Default::default(),
        }
    }

    /// The holder stored a snapshot of `rank`: its refusals are over.
    fn stored(&mut self, rank: u64) {
        self.taken.insert(rank);
        self.ranks.remove(&rank);
    }

    /// The holder refused `rank` at `now` as not its to hold.
    fn refused(&mut self, rank: u64, now: Instant) -> Verdict {
        let r = self.ranks.entry(rank).or_insert(Refusal {
            first: now,
            again: None,
        });
        let settled =
            self.taken.contains(&rank) || now.saturating_duration_since(r.first) >= REFUSED_FOR;
        if !settled {
            r.again = Some(now + REFUSED_AGAIN);
        } else if self.carries == Carries::HandOver {
            self.ranks.remove(&rank);
            self.taken.remove(&rank);
            return Verdict::Declined;
        } else {
            r.again = Some(now + DECLINED_AGAIN);
        }
        Verdict::Again(r.again.expect("set above"))
    }

    /// Whether `rank` is held back at `now` (no new snapshot of it is
    /// offered): refused, and its next try not due.
    fn holds_back(&self, rank: u64, now: Instant) -> bool {
        self.ranks
            .get(&rank)
            .and_then(|r| r.again)
            .is_some_and(|at| now < at)
    }

    /// The ranks whose next try is due at `now` (each returned once).
    fn due(&mut self, now: Instant) -> Vec<u64> {
        let mut out = Vec::new();
        for (rank, r) in &mut self.ranks {
            if r.again.is_some_and(|at| now >= at) {
                r.again = None;
                out.push(*rank);
            }
        }
        out
    }

    /// `rank` is fed to the stream anew (registered again): a fresh start.
    fn fed(&mut self, rank: u64) {
        self.ranks.remove(&rank);
    }
}

/// How often the stream checks whether a rank's replica is still safe
/// ([`at_risk`])...
const RISK_CHECK: Duration = Duration::from_millis(100);
/// ...and how often at most it says so again for one rank.
const RISK_WARN_AGAIN: Duration = Duration::from_secs(60);

/// Says when a rank's replica has fallen so far behind that a loss of this
/// host could not be recovered from memory: when it first happens, then at
/// most once a minute while it happens again or goes on, with how often it
/// began meanwhile.
#[derive(Debug, Default)]
struct LagWatch {
    ranks: BTreeMap<u64, RiskSeen>,
}

#[derive(Debug, Default)]
struct RiskSeen {
    /// At risk at the last check.
    was: bool,
    /// When it was last said.
    said: Option<Instant>,
    /// How often it began since.
    times: u64,
}

impl LagWatch {
    /// Whether `rank`'s replica is [`at_risk`] now, given the steps the
    /// peer holds of it; says so as above.
    fn check(&mut self, rank: u64, store: &Store, peer: &[u64], endpoint: &str) -> bool {
        let held: Vec<(usize, u64)> = store.sealed().iter().map(|i| (i.slot, i.step)).collect();
        let risk = at_risk(&held, store.writable_slot(), peer);
        let seen = self.ranks.entry(rank).or_default();
        if risk && !seen.was {
            seen.times += 1;
        }
        seen.was = risk;
        if risk && seen.times > 0 && seen.said.is_none_or(|at| at.elapsed() >= RISK_WARN_AGAIN) {
            let steps: Vec<u64> = held.iter().map(|(_, s)| *s).collect();
            tracing::warn!(
                rank,
                endpoint,
                replica_steps = ?peer,
                held = ?steps,
                slots = store.geometry().slots,
                times = seen.times,
                "this holder's replica of the rank is behind every step but the one this host's next snapshot overwrites: were this host to fail now, with no other holder current, no step would be common to the replica and the other ranks, and the job could not recover from memory. The stream uses idle CPU only; give more --snapshot-slots, or leave the host some idle CPU"
            );
            seen.said = Some(Instant::now());
            seen.times = 0;
        }
        risk
    }
}

/// One outgoing stream: connect, say hello, then send what the outbox
/// says while the peer grants credit. A hand-over ends once the standby
/// holds each of its ranks itself.
#[allow(clippy::too_many_arguments)]
pub(super) fn send(
    cfg: &ReplicatorConfig,
    sock: zmq::Socket,
    endpoint: &str,
    feed: mpsc::Receiver<RankStore>,
    carries: Carries,
    stop: &AtomicBool,
    shared: &Mutex<Shared>,
    index: usize,
) -> Result<(), zmq::Error> {
    sock.set_linger(0)?;
    sock.set_maxmsgsize((peer::HEADER_LEN + 1024) as i64)?;
    sock.connect(endpoint)?;
    sock.set_immediate(true)?;
    let mut stores: BTreeMap<u64, Arc<Store>> = BTreeMap::new();
    // The ranks' state maps.
    let mut maps: BTreeMap<u64, Arc<[u8]>> = BTreeMap::new();
    let mut outbox = Outbox::new(cfg.chunk as u64);
    let mut session: Option<Session> = None;
    let mut pending: Option<(Pending, Instant)> = None;
    let mut heard = Instant::now();
    // Ranks the peer refused as not its to hold: held back, then their
    // newest snapshot goes again, or (a hand-over done) no more.
    let mut refusals = Refusals::new(carries);
    let mut fed_all = false;
    let mut watch = LagWatch::default();
    let mut checked = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        for rank in refusals.due(Instant::now()) {
            outbox.again(rank);
        }
        loop {
            match feed.try_recv() {
                Ok((rank, store, map)) => {
                    refusals.fed(rank);
                    stores.insert(rank, store);
                    if let Some(m) = map {
                        maps.insert(rank, m);
                    }
                }
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    fed_all = true;
                    break;
                }
            }
        }
        if carries == Carries::HandOver && fed_all && stores.is_empty() {
            tracing::info!(
                endpoint,
                "hand-over done: the standby holds every rank itself"
            );
            if let Ok(mut sh) = shared.lock()
                && let Some(st) = sh.streams.get_mut(index)
            {
                st.connected = false;
                st.ranks.clear();
            }
            return Ok(());
        }
        if session.is_none()
            && pending
                .as_ref()
                .is_none_or(|(_, at)| at.elapsed() > HELLO_AGAIN)
        {
            let (p, hello) = Pending::hello(cfg.secret.clone(), cfg.node, nonce());
            match sock.send(hello, zmq::DONTWAIT) {
                Ok(()) | Err(zmq::Error::EAGAIN | zmq::Error::EINTR) => {}
                Err(e) => return Err(e),
            }
            pending = Some((p, Instant::now()));
        }
        let mut lost = false;
        if let Some(s) = session.as_mut() {
            let now = Instant::now();
            for (rank, store) in &stores {
                if refusals.holds_back(*rank, now) {
                    continue;
                }
                // The snapshot of the replicas' common step goes first
                // to a replica that lacks it (one made after it was
                // named), then the one kept for the next common step: the
                // job keeps both until every holder has them.
                let sealed = store.sealed();
                let offer = |i: &SlotInfo| Offer {
                    rank: *rank,
                    step: i.step,
                    slot: i.slot,
                    len: i.len,
                };
                let common = store.page().kept().common;
                if let Some(c) = sealed.iter().find(|i| Some(i.step) == common)
                    && outbox.offer_common(offer(c))
                {
                    continue;
                }
                if let Some(t) = store.kept_for_target()
                    && outbox.offer_target(offer(&t))
                {
                    continue;
                }
                if let Some(newest) = sealed.first() {
                    outbox.offer(offer(newest));
                }
            }
            while let Some(plan) = outbox.next_chunk() {
                let rank = plan.offer.rank;
                // The transfer reads the slot it began with, as long as
                // that slot still holds its step.
                let info = stores.get(&rank).and_then(|store| {
                    Some((
                        store,
                        store
                            .slot_info(plan.offer.slot)
                            .filter(|i| i.step == plan.offer.step)?,
                    ))
                });
                let Some((store, info)) = info else {
                    outbox.torn(rank);
                    continue;
                };
                // Each snapshot's first chunk goes after the rank's map: a
                // holder that refused it earlier (a standby still filling)
                // takes it with the snapshot it takes.
                if let Some(m) = maps.get(&rank).filter(|_| plan.offset == 0) {
                    let frame = s.seal(Kind::Map, &[&rank.to_le_bytes(), m]);
                    match send_until(&sock, frame, stop) {
                        Ok(true) => {}
                        Ok(false) => return Ok(()),
                        Err(zmq::Error::EAGAIN) => {
                            lost = true;
                            break;
                        }
                        Err(e) => return Err(e),
                    }
                }
                let h = ChunkHeader {
                    rank,
                    step: info.step,
                    epoch: info.epoch,
                    total: info.len,
                    offset: plan.offset,
                    capacity: store.geometry().capacity as u64,
                    layout_hash: store.page().layout_hash(),
                    job_hash: store.page().job_hash(),
                    sealed_at_unix_ns: info.sealed_at_unix_ns,
                    checksum: info.checksum,
                };
                let mut sealed = false;
                match store.with_range(&info, plan.offset, plan.len, |bytes| {
                    sealed = true;
                    s.seal(Kind::Chunk, &[&h.encode(), bytes])
                }) {
                    Ok(frame) => match send_until(&sock, frame, stop) {
                        Ok(true) => {}
                        Ok(false) => return Ok(()),
                        Err(zmq::Error::EAGAIN) => {
                            tracing::warn!(
                                endpoint,
                                "the holder's connection dropped; opening a new session"
                            );
                            lost = true;
                            break;
                        }
                        Err(e) => return Err(e),
                    },
                    Err(e) => {
                        tracing::debug!(rank, error = %e, "snapshot rewritten while streamed");
                        if sealed {
                            // That frame is never sent: its sequence
                            // number goes to the next one.
                            s.rewind();
                        }
                        outbox.torn(rank);
                        // Its credit was not used.
                        outbox.credit(1);
                    }
                }
            }
        }
        if lost {
            session = None;
            pending = None;
            outbox.reset();
        }
        if poll(&sock, zmq::POLLIN, SCAN)? > 0 {
            while let Ok(wire) = sock.recv_bytes(zmq::DONTWAIT) {
                heard = Instant::now();
                if let Some((p, _)) = &pending {
                    // A welcome to an earlier hello (answered late) is
                    // refused; this hello's own may still come.
                    match p.welcomed(&wire) {
                        Ok((s, w)) => {
                            tracing::info!(node = s.peer, "replica stream open");
                            outbox.reset();
                            outbox.credit(w.credit);
                            session = Some(s);
                            pending = None;
                        }
                        Err(e) => tracing::debug!(error = %e, "replica welcome refused"),
                    }
                    continue;
                }
                let Some(s) = session.as_mut() else { continue };
                match s.open(&wire) {
                    Ok(f) => match f.kind {
                        Kind::Credit => match peer::parse_credit(f.payload) {
                            Ok(n) => outbox.credit(n),
                            Err(e) => tracing::warn!(error = %e, "credit refused"),
                        },
                        Kind::Stored | Kind::Dropped => {
                            match peer::parse_receipt(f.kind, f.payload) {
                                Ok(Receipt {
                                    rank,
                                    step,
                                    dropped: None,
                                }) => {
                                    refusals.stored(rank);
                                    outbox.stored(rank, step);
                                    // Judged again at once: the report that
                                    // shows this step stored never shows a
                                    // risk judged before it was.
                                    if let Some(store) = stores.get(&rank) {
                                        let peer = outbox.peer_steps(rank, store.geometry().slots);
                                        let risk = watch.check(rank, store, peer, endpoint);
                                        outbox.set_at_risk(rank, risk);
                                    }
                                }
                                Ok(Receipt {
                                    rank,
                                    step,
                                    dropped: Some((DropCode::NotHolder, why)),
                                }) => {
                                    outbox.dropped(rank, step);
                                    match refusals.refused(rank, Instant::now()) {
                                        Verdict::Again(_) => {
                                            tracing::debug!(rank, step, reason = %why, "the peer does not hold this rank (yet)")
                                        }
                                        Verdict::Declined => {
                                            tracing::info!(
                                                rank,
                                                endpoint,
                                                "the standby holds the rank itself: its replica goes there no more"
                                            );
                                            stores.remove(&rank);
                                            maps.remove(&rank);
                                            outbox.forget(rank);
                                        }
                                    }
                                }
                                Ok(Receipt {
                                    rank,
                                    step,
                                    dropped: Some((DropCode::Failed, why)),
                                }) => {
                                    tracing::warn!(rank, step, reason = %why, "the peer dropped a replica");
                                    outbox.dropped(rank, step);
                                }
                                Err(e) => tracing::warn!(error = %e, "receipt refused"),
                            }
                        }
                        other => tracing::warn!(kind = ?other, "unexpected frame from a holder"),
                    },
                    Err(e) => tracing::warn!(error = %e, "frame from a holder refused"),
                }
            }
        }
        if session.is_some() && outbox.credit_left() == 0 && heard.elapsed() > SILENCE {
            tracing::warn!(endpoint, "the holder went silent; opening a new session");
            session = None;
            pending = None;
            heard = Instant::now();
        }
        if checked.elapsed() >= RISK_CHECK {
            checked = Instant::now();
            for (rank, store) in &stores {
                let peer = outbox.peer_steps(*rank, store.geometry().slots);
                let risk = watch.check(*rank, store, peer, endpoint);
                outbox.set_at_risk(*rank, risk);
            }
        }
        if let Ok(mut sh) = shared.lock()
            && let Some(st) = sh.streams.get_mut(index)
        {
            st.connected = session.is_some();
            st.bytes_sent = outbox.bytes_sent;
            // The thread's CPU time since it began (it only streams).
            st.cpu_ns = hatrain_shared::thread_cpu_ns();
            st.chunks_sent = outbox.chunks_sent;
            st.ranks = outbox.progress();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_refused_before_the_holders_orders_goes_again_soon_then_rarely() {
        let t0 = Instant::now();
        let mut r = Refusals::new(Carries::Own);
        assert_eq!(r.refused(3, t0), Verdict::Again(t0 + REFUSED_AGAIN));
        assert!(r.holds_back(3, t0));
        assert!(!r.holds_back(4, t0), "other ranks go on");
        assert!(r.due(t0).is_empty());
        assert_eq!(r.due(t0 + REFUSED_AGAIN), vec![3]);
        assert!(!r.holds_back(3, t0 + REFUSED_AGAIN));
        // Still refused past the window: tried once in a long while.
        let late = t0 + REFUSED_FOR;
        assert_eq!(r.refused(3, late), Verdict::Again(late + DECLINED_AGAIN));
        assert!(r.holds_back(3, late + REFUSED_FOR));
        // Taken at last: its refusals are over.
        r.stored(3);
        assert!(!r.holds_back(3, late));
        assert!(r.due(late + DECLINED_AGAIN).is_empty());
    }

    #[test]
    fn a_hand_over_ends_a_rank_once_the_standby_that_took_its_snapshots_refuses_it() {
        let t0 = Instant::now();
        let mut r = Refusals::new(Carries::HandOver);
        // Orders late: refused at first, then taken.
        assert_eq!(r.refused(0, t0), Verdict::Again(t0 + REFUSED_AGAIN));
        r.stored(0);
        // The standby filled the rank's store and holds it itself.
        assert_eq!(r.refused(0, t0), Verdict::Declined);
        assert!(!r.holds_back(0, t0));
        // A rank never taken is given up after the window.
        assert!(matches!(r.refused(1, t0), Verdict::Again(_)));
        assert_eq!(r.refused(1, t0 + REFUSED_FOR), Verdict::Declined);
    }

    #[test]
    fn an_own_rank_taken_then_refused_is_held_back_not_dropped_and_a_new_feed_starts_afresh() {
        let t0 = Instant::now();
        let mut r = Refusals::new(Carries::Own);
        r.stored(2);
        assert_eq!(r.refused(2, t0), Verdict::Again(t0 + DECLINED_AGAIN));
        assert!(r.holds_back(2, t0 + REFUSED_FOR));
        r.fed(2);
        assert!(!r.holds_back(2, t0));
    }
}
