//! The receiving side of the replica streams: the sessions of the peers
//! that send to this agent, and the replica stores their snapshots land in.
//!
//! It takes one message at a time with the identity of the connection it
//! came on ([`Inbox::handle`]) and returns the frames to send back; the
//! sockets are the caller's. Its only I/O is the replica stores: one file
//! per remote rank, `replica_NNNNN.shm` in the job folder, in the format of
//! a local snapshot store (same slots, same seal, same verification), made
//! with the owner's job and layout hashes so a sealed replica slot is
//! byte-identical to the owner's, header included.
//!
//! - A frame is checked before anything else happens: header, tag,
//!   sequence number ([`hatrain_shared::peer`]). A refused one is counted
//!   by class and changes nothing; its connection gets no answer.
//! - A chunk is written in place in order; the slot is sealed only when
//!   the whole snapshot arrived and hashes to its owner's checksum. A chunk
//!   at offset 0 starts a newer snapshot and abandons an unfinished one
//!   (its slot stays torn); a chunk that continues nothing is ignored.
//! - Every chunk taken, whatever became of it, returns one credit.
//! - A peer may send only the ranks this agent holds replicas of.
//! - With each rank's snapshots comes the state map it registered
//!   ([`Kind::Map`]), kept beside the replica: what the bytes mean, for a
//!   checkpoint written from the replica once the rank's host is gone.

use hatrain_shared::auth::{NONCE_LEN, Secret};
use hatrain_shared::peer::{self, ChunkHeader, DropCode, Kind, PeerError, Rejection, Session};
use hatrain_shared::shm::{Geometry, Kept, Receiving, Store};
use hatrain_shared::statemap::StateMap;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Sessions kept at most; the oldest goes when one more opens.
pub const MAX_SESSIONS: usize = 64;

/// What a holder says of one snapshot: rank, step, and `None` when it was
/// stored, or why it was dropped.
type Receipt = (u64, u64, Option<(DropCode, String)>);

/// Why a snapshot of a remote rank cannot be held.
#[derive(Debug, thiserror::Error)]
pub enum HoldError {
    #[error("impossible slot capacity {0}")]
    Capacity(u64),
    #[error("cannot make the replica store")]
    Create(#[source] hatrain_shared::shm::ShmError),
    #[error("no writable slot")]
    NoSlot,
    #[error("cannot receive into the replica store")]
    Receive(#[source] hatrain_shared::shm::ShmError),
}

/// Whether a state map was taken.
enum MapTaken {
    Yes,
    /// Of a rank this host holds no replica of from that sender.
    NotHolder {
        rank: u64,
    },
}

/// Refused frames, by class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rejected {
    pub malformed: u64,
    pub forged: u64,
    pub replayed: u64,
}

impl Rejected {
    fn count(&mut self, e: &PeerError) {
        match e.class() {
            Rejection::Malformed => self.malformed += 1,
            Rejection::Forged => self.forged += 1,
            Rejection::Replayed => self.replayed += 1,
        }
    }
}

/// A remote rank's replica store.
#[derive(Debug)]
struct Holding {
    from: u64,
    store: Store,
    incoming: Option<(ChunkHeader, Receiving)>,
    stored: u64,
    dropped: u64,
}

/// What this agent holds of one remote rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Held {
    pub rank: u64,
    /// The node that sent it.
    pub from: u64,
    /// Sealed steps, newest first (headers only: verified when used), and
    /// the epoch each was sealed in.
    pub steps: Vec<u64>,
    pub epochs: Vec<u64>,
    pub stored: u64,
    pub dropped: u64,
    pub path: PathBuf,
    /// The state map the rank registered, once its sender sent it.
    pub map: Option<Arc<StateMap>>,
}

/// The receiving side.
pub struct Inbox {
    secret: Secret,
    host: u64,
    dir: PathBuf,
    slots: usize,
    credit: u32,
    allowed: Box<dyn Fn(u64, u64) -> bool + Send>,
    sessions: HashMap<Vec<u8>, Session>,
    order: VecDeque<Vec<u8>>,
    stores: BTreeMap<u64, Holding>,
    /// The state map of each remote rank, as its sender last sent it.
    maps: BTreeMap<u64, Arc<StateMap>>,
    pub rejected: Rejected,
    /// Snapshot bytes written into the replicas held.
    pub received_bytes: u64,
    /// The steps the job keeps for the replicas: each replica store keeps
    /// them too.
    kept: Kept,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("host", &self.host)
            .field("dir", &self.dir)
            .field("sessions", &self.sessions.len())
            .field("stores", &self.stores.len())
            .field("rejected", &self.rejected)
            .finish_non_exhaustive()
    }
}

/// Path of the replica store of `rank` under `dir`.
pub fn replica_path(dir: &Path, rank: u64) -> PathBuf {
    dir.join(format!("replica_{rank:05}.shm"))
}

impl Inbox {
    /// An inbox of node `host` keeping `slots` slots per remote rank in
    /// `dir`, granting each session `credit` chunks in flight; `allowed(node,
    /// rank)` says whose ranks it holds.
    pub fn new(
        secret: Secret,
        host: u64,
        dir: PathBuf,
        slots: usize,
        credit: u32,
        allowed: impl Fn(u64, u64) -> bool + Send + 'static,
    ) -> Self {
        Self {
            secret,
            host,
            dir,
            slots,
            credit,
            allowed: Box::new(allowed),
            sessions: HashMap::new(),
            order: VecDeque::new(),
            stores: BTreeMap::new(),
            maps: BTreeMap::new(),
            rejected: Rejected::default(),
            received_bytes: 0,
            kept: Kept::default(),
        }
    }

    /// The steps the job keeps for the replicas now: every replica store
    /// keeps them ([`Store::writable_slot`]).
    pub fn set_kept(&mut self, kept: Kept) {
        self.kept = kept;
        for h in self.stores.values() {
            h.store.page().set_kept(kept);
        }
    }

    /// Handles one message that came on connection `peer`; returns what to
    /// send back on it.
    pub fn handle(
        &mut self,
        peer: &[u8],
        wire: &[u8],
        nonce: impl FnOnce() -> [u8; NONCE_LEN],
    ) -> Vec<Vec<u8>> {
        let Some(session) = self.sessions.get_mut(peer) else {
            return self.hello(peer, wire, nonce);
        };
        let f = match session.open(wire) {
            Ok(f) => f,
            Err(e) => {
                // A sender that heard no welcome (or lost its session) says
                // hello again on the same connection: a new session.
                if peer::decode(wire).is_ok_and(|f| f.kind == Kind::Hello)
                    && let Ok(back) = self.rehello(peer, wire, nonce)
                {
                    return back;
                }
                tracing::debug!(error = %e, "peer frame refused");
                self.rejected.count(&e);
                return Vec::new();
            }
        };
        let from = session.peer;
        match f.kind {
            Kind::Chunk => {
                let receipt = self.chunk(from, f.payload);
                let session = self.sessions.get_mut(peer).expect("looked up above");
                let mut out = vec![session.seal(Kind::Credit, &[&1u32.to_le_bytes()])];
                match receipt {
                    Some((rank, step, None)) => {
                        out.push(session.seal(Kind::Stored, &[&peer::receipt(rank, step)]));
                    }
                    Some((rank, step, Some((code, why)))) => {
                        out.push(
                            session.seal(Kind::Dropped, &[&peer::dropped(rank, step, code, &why)]),
                        );
                    }
                    None => {}
                }
                out
            }
            Kind::Map => {
                match self.map(from, f.payload) {
                    Ok(MapTaken::Yes) => {}
                    // A rank not this host's to hold: its chunks' drop
                    // receipts tell the sender; a well-formed frame, not
                    // counted as a bad one.
                    Ok(MapTaken::NotHolder { rank }) => {
                        tracing::debug!(node = from, rank, "a state map of a rank not held here")
                    }
                    Err(e) => {
                        tracing::warn!(node = from, error = %e, "a state map refused");
                        self.rejected.count(&e);
                    }
                }
                Vec::new()
            }
            other => {
                self.rejected.count(&PeerError::Payload {
                    kind: other,
                    detail: "not a frame a sender sends".into(),
                });
                Vec::new()
            }
        }
    }

    fn hello(
        &mut self,
        peer: &[u8],
        wire: &[u8],
        nonce: impl FnOnce() -> [u8; NONCE_LEN],
    ) -> Vec<Vec<u8>> {
        self.rehello(peer, wire, nonce).unwrap_or_else(|e| {
            tracing::debug!(error = %e, "peer hello refused");
            self.rejected.count(&e);
            Vec::new()
        })
    }

    /// Opens a session on connection `peer` from a hello, in place of any
    /// session it had; the welcome to send back.
    fn rehello(
        &mut self,
        peer: &[u8],
        wire: &[u8],
        nonce: impl FnOnce() -> [u8; NONCE_LEN],
    ) -> Result<Vec<Vec<u8>>, PeerError> {
        let (session, welcome) = Session::accept(
            self.secret.clone(),
            self.host,
            0,
            wire,
            nonce(),
            self.credit,
        )?;
        tracing::info!(peer = session.peer, "replica stream opened");
        self.order.retain(|o| o != peer);
        if self.order.len() >= MAX_SESSIONS
            && let Some(old) = self.order.pop_front()
        {
            self.sessions.remove(&old);
        }
        self.order.push_back(peer.to_vec());
        self.sessions.insert(peer.to_vec(), session);
        Ok(vec![welcome])
    }

    /// Takes a rank's state map from node `from`: checked like the map of a
    /// local registration, and only for a rank it sends.
    fn map(&mut self, from: u64, payload: &[u8]) -> Result<MapTaken, PeerError> {
        let bad = |detail: String| PeerError::Payload {
            kind: Kind::Map,
            detail,
        };
        let (rank, json) = peer::parse_map(payload)?;
        if !(self.allowed)(from, rank) {
            return Ok(MapTaken::NotHolder { rank });
        }
        let map: StateMap = serde_json::from_slice(json)
            .map_err(|e| bad(format!("rank {rank}'s state map: {e}")))?;
        map.validate()
            .map_err(|e| bad(format!("rank {rank}'s state map: {e}")))?;
        self.maps.insert(rank, Arc::new(map));
        Ok(MapTaken::Yes)
    }

    /// Takes one chunk from node `from`; a receipt when a snapshot was
    /// stored or dropped.
    fn chunk(&mut self, from: u64, payload: &[u8]) -> Option<Receipt> {
        let (h, data) = match ChunkHeader::parse(payload) {
            Ok(x) => x,
            Err(e) => {
                self.rejected.count(&e);
                return None;
            }
        };
        let drop = |why: String| Some((h.rank, h.step, Some((DropCode::Failed, why))));
        if !(self.allowed)(from, h.rank) {
            // Once per snapshot, not per chunk.
            if h.offset != 0 {
                return None;
            }
            let why = format!(
                "node {} holds no replica of rank {} from node {from}",
                self.host, h.rank
            );
            return Some((h.rank, h.step, Some((DropCode::NotHolder, why))));
        }
        if h.offset == 0
            && let Err(e) = self.begin(from, &h)
        {
            tracing::warn!(rank = h.rank, step = h.step, error = %crate::error_chain(&e), "cannot hold a replica");
            return drop(crate::error_chain(&e));
        }
        let holding = self.stores.get_mut(&h.rank)?;
        let continues = holding
            .incoming
            .as_ref()
            .is_some_and(|(cur, r)| cur.step == h.step && r.received() == h.offset);
        if !continues {
            // The tail of a snapshot abandoned for a newer one.
            return None;
        }
        let (cur, mut r) = holding.incoming.take().expect("checked above");
        if let Err(e) = r.write(&holding.store, data) {
            holding.dropped += 1;
            return drop(e.to_string());
        }
        self.received_bytes += data.len() as u64;
        if r.received() < cur.total {
            holding.incoming = Some((cur, r));
            return None;
        }
        match r.seal(
            &holding.store,
            cur.rank,
            cur.step,
            cur.epoch,
            cur.sealed_at_unix_ns,
            cur.checksum,
        ) {
            Ok(_) => {
                holding.stored += 1;
                Some((cur.rank, cur.step, None))
            }
            Err(e) => {
                holding.dropped += 1;
                tracing::warn!(rank = cur.rank, step = cur.step, error = %e, "replica dropped");
                drop(e.to_string())
            }
        }
    }

    /// Starts receiving a snapshot: the rank's store (made, or made again
    /// for another geometry or layout), and a writable slot in it.
    fn begin(&mut self, from: u64, h: &ChunkHeader) -> Result<(), HoldError> {
        let fits = |s: &Store| {
            s.geometry().capacity as u64 == h.capacity
                && s.page().layout_hash() == h.layout_hash
                && s.page().job_hash() == h.job_hash
        };
        if self.stores.get(&h.rank).is_some_and(|x| !fits(&x.store)) {
            self.stores.remove(&h.rank);
        }
        if !self.stores.contains_key(&h.rank) {
            let capacity = usize::try_from(h.capacity)
                .ok()
                .filter(|c| c.is_multiple_of(hatrain_shared::shm::PAGE) && *c > 0)
                .ok_or(HoldError::Capacity(h.capacity))?;
            let geometry = Geometry {
                slots: self.slots,
                capacity,
            };
            let path = replica_path(&self.dir, h.rank);
            let store = Store::create(&path, h.rank as usize, geometry, h.layout_hash, h.job_hash)
                .map_err(HoldError::Create)?;
            tracing::info!(rank = h.rank, from, path = %path.display(), bytes = geometry.file_len(), "replica store made");
            store.page().set_kept(self.kept);
            self.stores.insert(
                h.rank,
                Holding {
                    from,
                    store,
                    incoming: None,
                    stored: 0,
                    dropped: 0,
                },
            );
        }
        let holding = self.stores.get_mut(&h.rank).expect("made above");
        holding.from = from;
        // An unfinished older snapshot is abandoned; its slot stays torn.
        holding.incoming = None;
        let slot = holding.store.writable_slot().ok_or(HoldError::NoSlot)?;
        let r = holding
            .store
            .receive(slot, h.total)
            .map_err(HoldError::Receive)?;
        holding.incoming = Some((*h, r));
        Ok(())
    }

    /// What this agent holds.
    pub fn held(&self) -> Vec<Held> {
        self.stores
            .iter()
            .map(|(rank, h)| Held {
                rank: *rank,
                from: h.from,
                steps: h.store.sealed().iter().map(|i| i.step).collect(),
                epochs: h.store.sealed().iter().map(|i| i.epoch).collect(),
                stored: h.stored,
                dropped: h.dropped,
                path: h.store.path().to_path_buf(),
                map: self.maps.get(rank).cloned(),
            })
            .collect()
    }

    /// Removes the replica store of `rank`, and its map.
    pub fn release(&mut self, rank: u64) {
        self.maps.remove(&rank);
        if let Some(h) = self.stores.remove(&rank) {
            let path = h.store.path().to_path_buf();
            drop(h);
            if let Err(e) = std::fs::remove_file(&path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove a replica store");
            }
        }
    }

    /// Removes every replica store.
    pub fn close(&mut self) {
        for (_, h) in std::mem::take(&mut self.stores) {
            let path = h.store.path().to_path_buf();
            drop(h);
            if let Err(e) = std::fs::remove_file(&path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove a replica store");
            }
        }
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hatrain_shared::peer::Pending;

    fn secret() -> Secret {
        Secret::from_bytes([3; 32])
    }

    struct Source {
        _dir: tempfile::TempDir,
        store: Store,
        data: Vec<u8>,
    }

    fn source(rank: usize, step: u64, len: usize) -> Source {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::create(
            &hatrain_shared::shm::store_path(dir.path(), rank),
            rank,
            Geometry::new(2, len),
            11,
            22,
        )
        .unwrap();
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ step as u8).collect();
        let slot = store.writable_slot().unwrap();
        store
            .write_slot(slot, rank as u64, step, 1, &[&data], &mut |_, _| true)
            .unwrap();
        Source {
            _dir: dir,
            store,
            data,
        }
    }

    fn chunks(src: &Source, step: u64, size: usize) -> Vec<Vec<u8>> {
        let info = src
            .store
            .sealed()
            .into_iter()
            .find(|i| i.step == step)
            .unwrap();
        src.data
            .chunks(size)
            .enumerate()
            .map(|(i, d)| {
                let h = ChunkHeader {
                    rank: info.rank,
                    step,
                    epoch: info.epoch,
                    total: info.len,
                    offset: (i * size) as u64,
                    capacity: src.store.geometry().capacity as u64,
                    layout_hash: 11,
                    job_hash: 22,
                    sealed_at_unix_ns: info.sealed_at_unix_ns,
                    checksum: info.checksum,
                };
                [&h.encode()[..], d].concat()
            })
            .collect()
    }

    fn open(inbox: &mut Inbox, id: &[u8], host: u64, n: u8) -> Session {
        let (p, hello) = Pending::hello(secret(), host, [n; NONCE_LEN]);
        let back = inbox.handle(id, &hello, || [n + 100; NONCE_LEN]);
        p.welcomed(&back[0]).unwrap().0
    }

    /// A sender whose welcome came late says hello again on the same
    /// connection: the new session replaces the old one, whose frames are
    /// refused from then on.
    #[test]
    fn a_second_hello_on_a_connection_opens_a_new_session_in_place_of_the_first() {
        let dir = tempfile::tempdir().unwrap();
        let mut inbox = Inbox::new(secret(), 1, dir.path().into(), 2, 4, |_, _| true);
        let src = source(0, 3, 1000);
        let frame = &chunks(&src, 3, 4096)[0];
        let mut first = open(&mut inbox, b"a", 0, 1);
        let mut second = open(&mut inbox, b"a", 0, 2);
        assert!(
            inbox
                .handle(b"a", &first.seal(Kind::Chunk, &[frame]), || unreachable!())
                .is_empty(),
            "the first session is gone"
        );
        let back = inbox.handle(b"a", &second.seal(Kind::Chunk, &[frame]), || unreachable!());
        let kinds: Vec<Kind> = back.iter().map(|b| second.open(b).unwrap().kind).collect();
        assert_eq!(kinds, vec![Kind::Credit, Kind::Stored]);
        assert_eq!(inbox.rejected.forged, 1);
        assert_eq!(inbox.sessions.len(), 1);
    }

    /// A rank's state map is kept beside its replica; one of a rank the
    /// sender does not send is passed over, and one that does not parse or
    /// validate is refused and counted.
    #[test]
    fn a_ranks_state_map_is_kept_beside_its_replica_and_a_bad_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut inbox = Inbox::new(secret(), 1, dir.path().into(), 2, 4, |from, rank| {
            from == 0 && rank < 2
        });
        let src = source(0, 9, 1000);
        let mut s = open(&mut inbox, b"a", 0, 1);
        let map = hatrain_shared::statemap::StateMap {
            parts: vec![hatrain_shared::statemap::Part {
                name: "w".into(),
                dtype: hatrain_shared::statemap::Dtype::U8,
                len: 1000,
                sharing: hatrain_shared::statemap::Sharing::Unique,
            }],
            checkpoint: None,
            global_batch: None,
        };
        let json = serde_json::to_vec(&map).unwrap();
        let mut frame = |rank: u64, body: &[u8]| s.seal(Kind::Map, &[&rank.to_le_bytes(), body]);
        let (good, stranger, garbage, invalid) = (
            frame(0, &json),
            frame(5, &json),
            frame(1, b"{not json"),
            frame(1, br#"{"parts":[]}"#),
        );
        for f in [&good, &stranger, &garbage, &invalid] {
            assert!(inbox.handle(b"a", f, || unreachable!()).is_empty());
        }
        // The stranger's is passed over (its chunks' drop receipts tell
        // the sender), not counted as a bad frame.
        assert_eq!(inbox.rejected.malformed, 2, "{:?}", inbox.rejected);
        for c in chunks(&src, 9, 4096) {
            let f = s.seal(Kind::Chunk, &[&c]);
            inbox.handle(b"a", &f, || unreachable!());
        }
        let held = inbox.held();
        assert_eq!(held[0].steps, vec![9]);
        assert_eq!(held[0].map.as_deref(), Some(&map));
        // Given up: store, file and map go.
        inbox.release(0);
        assert!(inbox.held().is_empty());
        assert!(!replica_path(dir.path(), 0).exists());
    }

    #[test]
    fn a_snapshot_sent_in_chunks_is_held_identical_and_every_kind_of_bad_frame_is_counted() {
        let dir = tempfile::tempdir().unwrap();
        let mut inbox = Inbox::new(secret(), 1, dir.path().into(), 2, 4, |from, rank| {
            from == 0 && rank < 2
        });
        let src = source(0, 9, 10_000);
        let mut s = open(&mut inbox, b"a", 0, 1);
        let frames: Vec<Vec<u8>> = chunks(&src, 9, 4096)
            .iter()
            .map(|c| s.seal(Kind::Chunk, &[c]))
            .collect();
        let mut credits = 0;
        let mut receipts = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            for back in inbox.handle(b"a", f, || unreachable!()) {
                let f = s.open(&back).unwrap();
                match f.kind {
                    Kind::Credit => credits += peer::parse_credit(f.payload).unwrap(),
                    k => receipts.push(peer::parse_receipt(k, f.payload).unwrap()),
                }
            }
            if i == 0 {
                // Replayed, bit-flipped and forged frames between genuine ones.
                assert!(inbox.handle(b"a", f, || unreachable!()).is_empty());
                let mut flipped = frames[1].clone();
                flipped[200] ^= 4;
                assert!(inbox.handle(b"a", &flipped, || unreachable!()).is_empty());
                let (_, hello) = Pending::hello(Secret::from_bytes([9; 32]), 0, [7; NONCE_LEN]);
                assert!(inbox.handle(b"b", &hello, || [8; NONCE_LEN]).is_empty());
                assert!(inbox.handle(b"c", b"garbage", || [8; NONCE_LEN]).is_empty());
            }
        }
        assert_eq!(credits, 3);
        assert_eq!(
            receipts,
            vec![peer::Receipt {
                rank: 0,
                step: 9,
                dropped: None
            }]
        );
        assert_eq!(
            inbox.rejected,
            Rejected {
                malformed: 1,
                forged: 2,
                replayed: 1
            }
        );
        let held = inbox.held();
        assert_eq!(
            (held[0].rank, held[0].from, &held[0].steps),
            (0, 0, &vec![9])
        );
        let replica = Store::open(&replica_path(dir.path(), 0)).unwrap();
        let info = replica.find_step(9).expect("sealed and verified");
        let mut back = vec![0u8; src.data.len()];
        replica.read_slot(info.slot, &mut [&mut back]).unwrap();
        assert_eq!(back, src.data);
        assert_eq!(info.checksum, src.store.find_step(9).unwrap().checksum);
        inbox.close();
        assert!(!replica_path(dir.path(), 0).exists());
    }

    #[test]
    fn a_newer_snapshot_abandons_an_unfinished_one_and_strangers_ranks_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let mut inbox = Inbox::new(secret(), 1, dir.path().into(), 2, 4, |from, rank| {
            from == 0 && rank == 0
        });
        let mut s = open(&mut inbox, b"a", 0, 1);
        let old = source(0, 3, 9000);
        let new = source(0, 4, 9000);
        let send = |inbox: &mut Inbox, s: &mut Session, c: &[u8]| -> Vec<peer::Receipt> {
            let f = s.seal(Kind::Chunk, &[c]);
            inbox
                .handle(b"a", &f, || unreachable!())
                .iter()
                .filter_map(|b| {
                    let f = s.open(b).unwrap();
                    (f.kind != Kind::Credit)
                        .then(|| peer::parse_receipt(f.kind, f.payload).unwrap())
                })
                .collect()
        };
        let oc = chunks(&old, 3, 4096);
        assert!(send(&mut inbox, &mut s, &oc[0]).is_empty());
        let nc = chunks(&new, 4, 4096);
        assert!(send(&mut inbox, &mut s, &nc[0]).is_empty());
        // The old snapshot's tail continues nothing.
        assert!(send(&mut inbox, &mut s, &oc[1]).is_empty());
        assert!(send(&mut inbox, &mut s, &nc[1]).is_empty());
        assert_eq!(
            send(&mut inbox, &mut s, &nc[2]),
            vec![peer::Receipt {
                rank: 0,
                step: 4,
                dropped: None
            }]
        );
        assert_eq!(inbox.held()[0].steps, vec![4]);
        // Rank 1 is not this agent's to hold: its map is let pass, and its
        // snapshot dropped once, as not held here; no frame of it counts
        // as a bad one.
        let other = source(1, 4, 9000);
        let map = s.seal(Kind::Map, &[&1u64.to_le_bytes(), b"{}"]);
        assert!(inbox.handle(b"a", &map, || unreachable!()).is_empty());
        let oc = chunks(&other, 4, 4096);
        let r = send(&mut inbox, &mut s, &oc[0]);
        assert_eq!(r.len(), 1, "{r:?}");
        assert_eq!((r[0].rank, r[0].step), (1, 4));
        assert!(
            matches!(&r[0].dropped, Some((DropCode::NotHolder, why)) if why.contains("holds no replica of rank 1")),
            "{r:?}"
        );
        assert!(
            send(&mut inbox, &mut s, &oc[1]).is_empty(),
            "one receipt a snapshot"
        );
        assert_eq!(inbox.rejected, Rejected::default());
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use hatrain_shared::peer::Pending;
    use proptest::prelude::*;

    proptest! {
        /// Arbitrary bytes, as a stranger's first message or inside an open
        /// session (tagged, so they reach the chunk decoder), never panic,
        /// never seal anything, and never go unanswered by a count.
        #[test]
        fn arbitrary_frames_never_panic_nor_seal(
            strangers in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 1..8),
            payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 1..8),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let secret = Secret::from_bytes([3; 32]);
            let mut inbox = Inbox::new(secret.clone(), 1, dir.path().into(), 2, 4, |_, _| true);
            for s in &strangers {
                prop_assert!(inbox.handle(b"x", s, || [1; NONCE_LEN]).is_empty());
            }
            let (p, hello) = Pending::hello(secret, 0, [2; NONCE_LEN]);
            let back = inbox.handle(b"a", &hello, || [3; NONCE_LEN]);
            let (mut s, _) = p.welcomed(&back[0]).unwrap();
            for body in &payloads {
                let f = s.seal(Kind::Chunk, &[body]);
                let _ = inbox.handle(b"a", &f, || [4; NONCE_LEN]);
            }
            prop_assert!(inbox.held().iter().all(|h| h.steps.is_empty()), "nothing sealed");
            let r = inbox.rejected;
            prop_assert!(r.malformed + r.forged + r.replayed >= strangers.len() as u64);
        }
    }
}
