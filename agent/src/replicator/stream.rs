//! One outgoing replica stream: connect, say hello, then send what the
//! [`Outbox`] says while the holder grants credit, each snapshot's first
//! chunk after its rank's state map. It runs on a thread of its own at idle
//! priority and never blocks a worker's commit: it reads a sealed slot in
//! place and checks after each chunk that the slot was not rewritten.

use super::outbox::{Offer, Outbox, at_risk};
use super::{HELLO_AGAIN, POLL, RankStore, ReplicatorConfig, SCAN, SILENCE, Shared, nonce, poll};
use hatrain_shared::peer::{self, ChunkHeader, Kind, Pending, Session};
use hatrain_shared::shm::Store;
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

/// One outgoing stream: connect, say hello, then send what the outbox
/// says while the peer grants credit.
/// A snapshot the peer refused as not its to hold goes again after this
/// long (its orders may come after the stream: a standby told to take a
/// lost host's ranks while their holder already hands them over)...
const REFUSED_AGAIN: Duration = Duration::from_millis(100);
/// ...for this long after the first refusal.
const REFUSED_FOR: Duration = Duration::from_secs(10);

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

pub(super) fn send(
    cfg: &ReplicatorConfig,
    sock: zmq::Socket,
    endpoint: &str,
    feed: mpsc::Receiver<RankStore>,
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
    // Ranks the peer refused as not its to hold (yet): first and last
    // refusal, and whether a try waits. Their newest snapshot goes again
    // after a pause.
    let mut refused: BTreeMap<u64, (Instant, Instant, bool)> = BTreeMap::new();
    let mut watch = LagWatch::default();
    let mut checked = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        for (rank, (_, last, waits)) in &mut refused {
            if *waits && last.elapsed() >= REFUSED_AGAIN {
                outbox.again(*rank);
                *waits = false;
            }
        }
        while let Ok((rank, store, map)) = feed.try_recv() {
            stores.insert(rank, store);
            if let Some(m) = map {
                maps.insert(rank, m);
            }
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
            for (rank, store) in &stores {
                if let Some(newest) = store.sealed().into_iter().next() {
                    outbox.offer(Offer {
                        rank: *rank,
                        step: newest.step,
                        slot: newest.slot,
                        len: newest.len,
                    });
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
                                Ok((rank, step, _)) if f.kind == Kind::Stored => {
                                    outbox.stored(rank, step)
                                }
                                Ok((rank, step, why)) => {
                                    tracing::warn!(rank, step, reason = %why, "the peer dropped a replica");
                                    outbox.dropped(rank, step);
                                    if why.contains("holds no replica of rank") {
                                        let now = Instant::now();
                                        let r = refused.entry(rank).or_insert((now, now, false));
                                        if r.0.elapsed() < REFUSED_FOR {
                                            (r.1, r.2) = (now, true);
                                        }
                                    }
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
            st.chunks_sent = outbox.chunks_sent;
            st.ranks = outbox.progress();
        }
    }
    Ok(())
}
