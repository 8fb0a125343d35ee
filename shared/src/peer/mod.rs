//! Frames between agents, one per ZeroMQ message: the peer-replica stream
//! (and, later, the controller's traffic).
//!
//! ```text
//!  0      4      6      8    9      16       24       32       40       44     48
//!  +------+------+------+----+------+--------+--------+--------+--------+------+-----------+------+
//!  |magic |major |minor |kind| zero | host   | epoch  | seq    | len    | zero | payload   | tag  |
//!  |"HTPR"| u16  | u16  | u8 | 7 B  | u64    | u64    | u64    | u32    | 4 B  | len bytes | 16 B |
//!  +------+------+------+----+------+--------+--------+--------+--------+------+-----------+------+
//!  every integer little-endian; `host` is the sender's node rank
//!
//!  hello:       tag = BLAKE3-keyed(secret, "hatrain-peer-hello-v2" | bytes 0..48+len)[..16]
//!  every other: tag = GMAC(key(direction), nonce = seq (u64 le) | 4 zero bytes,
//!                          bytes 0..48+len)
//!  key(direction) = BLAKE3-keyed(secret, "hatrain-peer-key-v2" | direction |
//!                                initiator's nonce | acceptor's nonce)
//! ```
//!
//! GMAC is AES-256-GCM with the frame as associated data and nothing to
//! encrypt (NIST SP 800-38D), through aws-lc: carry-less multiplication and
//! AES in hardware make it several times cheaper per byte than keyed BLAKE3,
//! and a replica's chunks are nearly all of the bytes the stream tags. Its
//! nonce must never repeat under a key: each session has two keys of its
//! own (one per direction, drawn from both ends' fresh nonces) and each
//! direction numbers its frames from 0. A frame sealed and then not sent
//! ([`Session::rewind`]) gives its number to the next: its tag was never
//! seen, so nothing under that nonce is.
//!
//! A connection is a session. The side that connects (the *initiator*)
//! sends [`Kind::Hello`] with a fresh nonce, tagged under the job's secret
//! alone (anyone holding it may open a session); the side that accepts
//! answers [`Kind::Welcome`] with a nonce of its own, and from then on every
//! frame in both directions, the welcome first, is tagged under the
//! session's key for its direction, with sequence numbers counting each
//! direction's frames from 0. So a frame that is forged, altered in any
//! byte, replayed on another connection, reflected back, or replayed or
//! reordered on its own connection fails: the first three fail their tag,
//! the last two their sequence number (a replayed frame's tag verifies only
//! under its own number). A replayed hello only opens a session whose frames
//! the replayer cannot tag. Tags are compared in constant time.
//!
//! A reader checks, in order: the size bounds, the magic, the version
//! (`major == ours && minor <= ours`), the kind, the length, then the tag,
//! then the sequence number, then the payload's own layout
//! ([`ChunkHeader::parse`] and the like). Nothing here panics on arbitrary
//! bytes.
//!
//! Chunk payload (the bytes of one snapshot slot, from `offset`):
//!
//! ```text
//!  0 rank  8 step  16 epoch of the snapshot  24 total length  32 offset
//! 40 slot capacity  48 layout hash  56 job hash  64 sealed at (unix ns)
//! 72 slot checksum  80 data (length: the frame's len - 80)
//! ```

use crate::auth::{NONCE_LEN, Secret};
use aws_lc_rs::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};

pub const MAGIC: [u8; 4] = *b"HTPR";
/// 2.0: GMAC tags of 16 bytes under per-session keys (1.x tagged every
/// frame with keyed BLAKE3). 1.1: a drop receipt carries a [`DropCode`]
/// before its text.
pub const VERSION: (u16, u16) = (2, 0);
/// Bytes of a frame's tag.
pub const TAG_LEN: usize = 16;
/// Bytes of the fixed header.
pub const HEADER_LEN: usize = 48;
/// Bytes of a chunk's own header, before its data.
pub const CHUNK_HEADER_LEN: usize = 80;
/// The largest chunk of snapshot data a frame carries.
pub const MAX_CHUNK: usize = 8 << 20;
/// The largest payload a frame may carry.
pub const MAX_PAYLOAD: usize = CHUNK_HEADER_LEN + MAX_CHUNK;
const HELLO_DOMAIN: &str = "hatrain-peer-hello-v2";
const KEY_DOMAIN: &str = "hatrain-peer-key-v2";

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Initiator → acceptor: its nonce (16 bytes).
    Hello = 1,
    /// Acceptor → initiator: the initiator's nonce, its own, and the
    /// chunks the initiator may send before it is granted more (u32).
    Welcome = 2,
    /// Initiator → acceptor: a piece of a sealed snapshot.
    Chunk = 3,
    /// Acceptor → initiator: this many more chunks may be sent (u32).
    Credit = 4,
    /// Acceptor → initiator: a snapshot arrived whole, verified and sealed
    /// (rank u64, step u64).
    Stored = 5,
    /// Acceptor → initiator: a snapshot was dropped (rank u64, step u64,
    /// a [`DropCode`] u8, then a UTF-8 reason; since version 1.1).
    Dropped = 6,
    /// Initiator → acceptor: membership ([`Beat`]).
    Heartbeat = 7,
    /// Initiator → acceptor: a message between an agent and the job's
    /// controller (a host's report, or the controller's orders), as JSON
    /// the agent parses.
    Control = 8,
    /// Initiator → acceptor: the state map a rank registered (rank u64,
    /// then the map as JSON), sent before that rank's first chunk in a
    /// session: the holder of a replica needs it to write the rank's
    /// checkpoint when the rank's host is gone.
    Map = 9,
}

impl Kind {
    fn from_byte(b: u8) -> Option<Self> {
        Some(match b {
            1 => Self::Hello,
            2 => Self::Welcome,
            3 => Self::Chunk,
            4 => Self::Credit,
            5 => Self::Stored,
            6 => Self::Dropped,
            7 => Self::Heartbeat,
            8 => Self::Control,
            9 => Self::Map,
            _ => return None,
        })
    }
}

/// Which side of a session a frame comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Connected (sends the hello, the chunks).
    Initiator,
    /// Accepted (sends the welcome, credits and receipts).
    Acceptor,
}

impl Role {
    fn direction(self) -> &'static [u8] {
        match self {
            Self::Initiator => b"i2a",
            Self::Acceptor => b"a2i",
        }
    }
}

/// Why a frame was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    #[error("peer frame of {len} bytes is shorter than a header and tag")]
    Short { len: usize },
    #[error("peer frame payload of {len} bytes exceeds the limit of {MAX_PAYLOAD} bytes")]
    TooLarge { len: u64 },
    #[error("peer frame: bad magic {found:02x?}, expected {MAGIC:02x?}")]
    BadMagic { found: [u8; 4] },
    #[error("peer frame: unsupported version {major}.{minor}, this build speaks {}.{}", VERSION.0, VERSION.1)]
    Version { major: u16, minor: u16 },
    #[error("peer frame: unknown kind {0}")]
    UnknownKind(u8),
    #[error("peer frame: header says {said} payload bytes, {came} came")]
    Length { said: u64, came: usize },
    #[error(
        "peer frame {kind:?} (seq {seq}) fails its tag: forged, altered or from another session"
    )]
    BadTag { kind: Kind, seq: u64 },
    #[error(
        "peer frame {kind:?} has sequence number {seq}, {expected} expected: replayed or reordered"
    )]
    Replayed { kind: Kind, seq: u64, expected: u64 },
    #[error("peer frame: expected {expected:?}, {came:?} came")]
    Unexpected { expected: Kind, came: Kind },
    #[error("peer frame {kind:?}: {detail}")]
    Payload { kind: Kind, detail: String },
}

impl PeerError {
    /// How a refusal is counted.
    pub fn class(&self) -> Rejection {
        match self {
            Self::BadTag { .. } => Rejection::Forged,
            Self::Replayed { .. } => Rejection::Replayed,
            _ => Rejection::Malformed,
        }
    }
}

/// Counted classes of refused frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// Not a frame of this protocol, or a payload that breaks its layout.
    Malformed,
    /// A tag that does not verify: forged, altered, or of another session.
    Forged,
    /// A valid tag with a sequence number already used or out of order.
    Replayed,
}

/// A frame whose header was checked; its tag not yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame<'a> {
    pub kind: Kind,
    /// The sender's node rank.
    pub host: u64,
    pub epoch: u64,
    pub seq: u64,
    pub payload: &'a [u8],
    /// Bytes 0..48+len: what the tag covers.
    signed: &'a [u8],
    tag: &'a [u8],
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Checks a frame's header and length (not its tag).
pub fn decode(wire: &[u8]) -> Result<Frame<'_>, PeerError> {
    if wire.len() < HEADER_LEN + TAG_LEN {
        return Err(PeerError::Short { len: wire.len() });
    }
    let len = u32_at(wire, 40) as u64;
    if len > MAX_PAYLOAD as u64 {
        return Err(PeerError::TooLarge { len });
    }
    let found: [u8; 4] = [wire[0], wire[1], wire[2], wire[3]];
    if found != MAGIC {
        return Err(PeerError::BadMagic { found });
    }
    let (major, minor) = (u16_at(wire, 4), u16_at(wire, 6));
    if major != VERSION.0 || minor > VERSION.1 {
        return Err(PeerError::Version { major, minor });
    }
    let kind = Kind::from_byte(wire[8]).ok_or(PeerError::UnknownKind(wire[8]))?;
    let came = wire.len() - HEADER_LEN - TAG_LEN;
    if len != came as u64 {
        return Err(PeerError::Length { said: len, came });
    }
    let end = HEADER_LEN + came;
    Ok(Frame {
        kind,
        host: u64_at(wire, 16),
        epoch: u64_at(wire, 24),
        seq: u64_at(wire, 32),
        payload: &wire[HEADER_LEN..end],
        signed: &wire[..end],
        tag: &wire[end..],
    })
}

/// The header fields a sender chooses.
#[derive(Debug, Clone, Copy)]
struct Head {
    kind: Kind,
    host: u64,
    epoch: u64,
    seq: u64,
}

/// What a frame's tag is made under.
#[derive(Clone, Copy)]
enum Signer<'a> {
    /// The hello: the job's secret (no session yet).
    Hello(&'a Secret),
    /// Every other frame: its session's key for its direction.
    Session(&'a LessSafeKey),
}

/// The GMAC nonce of frame `seq`.
fn nonce(seq: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[..8].copy_from_slice(&seq.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

impl Signer<'_> {
    /// The tag of frame `seq`, whose tagged bytes are `signed`.
    fn tag(self, seq: u64, signed: &[u8]) -> [u8; TAG_LEN] {
        let mut t = [0u8; TAG_LEN];
        match self {
            Self::Hello(secret) => {
                t.copy_from_slice(&secret.tag(HELLO_DOMAIN, &[signed]).as_bytes()[..TAG_LEN]);
            }
            Self::Session(key) => {
                let tag = key
                    .seal_in_place_separate_tag(nonce(seq), Aad::from(signed), &mut [])
                    .expect("GMAC takes any frame: its length is bounded by MAX_PAYLOAD");
                t.copy_from_slice(tag.as_ref());
            }
        }
        t
    }

    /// Whether `tag` is frame `seq`'s (constant-time comparison).
    fn verifies(self, seq: u64, signed: &[u8], tag: &[u8]) -> bool {
        match self {
            Self::Hello(_) => {
                aws_lc_rs::constant_time::verify_slices_are_equal(&self.tag(seq, signed), tag)
                    .is_ok()
            }
            Self::Session(key) => <[u8; TAG_LEN]>::try_from(tag).is_ok_and(|mut t| {
                key.open_in_place(nonce(seq), Aad::from(signed), &mut t)
                    .is_ok()
            }),
        }
    }
}

/// Encodes a frame from payload pieces and tags it.
fn encode(signer: Signer<'_>, head: Head, parts: &[&[u8]]) -> Vec<u8> {
    let Head {
        kind,
        host,
        epoch,
        seq,
    } = head;
    let len: usize = parts.iter().map(|p| p.len()).sum();
    assert!(len <= MAX_PAYLOAD, "a peer payload of {len} bytes");
    let mut out = Vec::with_capacity(HEADER_LEN + len + TAG_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.0.to_le_bytes());
    out.extend_from_slice(&VERSION.1.to_le_bytes());
    out.push(kind as u8);
    out.extend_from_slice(&[0; 7]);
    out.extend_from_slice(&host.to_le_bytes());
    out.extend_from_slice(&epoch.to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    for p in parts {
        out.extend_from_slice(p);
    }
    let tag = signer.tag(seq, &out);
    out.extend_from_slice(&tag);
    out
}

fn verify(signer: Signer<'_>, f: &Frame<'_>) -> Result<(), PeerError> {
    if signer.verifies(f.seq, f.signed, f.tag) {
        Ok(())
    } else {
        Err(PeerError::BadTag {
            kind: f.kind,
            seq: f.seq,
        })
    }
}

/// An initiator that sent its hello and waits for the welcome.
#[derive(Debug)]
pub struct Pending {
    secret: Secret,
    host: u64,
    nonce: [u8; NONCE_LEN],
}

/// One end of an authenticated session.
#[derive(Debug)]
pub struct Session {
    /// The key this end tags with.
    sends: LessSafeKey,
    /// The key the other end tags with.
    receives: LessSafeKey,
    host: u64,
    /// The peer's node rank, from its first frame.
    pub peer: u64,
    /// The epoch this end stamps on what it sends.
    pub epoch: u64,
    sent: u64,
    received: u64,
}

/// What a welcome grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Welcome {
    pub credit: u32,
}

impl Pending {
    /// Opens a session as node `host`: the hello to send, and the pending
    /// end. `nonce` must be fresh ([`crate::auth::random`]).
    pub fn hello(secret: Secret, host: u64, nonce: [u8; NONCE_LEN]) -> (Self, Vec<u8>) {
        let wire = encode(
            Signer::Hello(&secret),
            Head {
                kind: Kind::Hello,
                host,
                epoch: 0,
                seq: 0,
            },
            &[&nonce],
        );
        (
            Self {
                secret,
                host,
                nonce,
            },
            wire,
        )
    }

    /// Checks the acceptor's welcome; the session is open. A refused
    /// welcome (one to an earlier hello, late) leaves this end waiting for
    /// its own.
    pub fn welcomed(&self, wire: &[u8]) -> Result<(Session, Welcome), PeerError> {
        let f = decode(wire)?;
        if f.kind != Kind::Welcome {
            return Err(PeerError::Unexpected {
                expected: Kind::Welcome,
                came: f.kind,
            });
        }
        if f.payload.len() != 2 * NONCE_LEN + 4 || f.payload[..NONCE_LEN] != self.nonce {
            // A welcome to another hello: it cannot be this session's.
            return Err(PeerError::BadTag {
                kind: f.kind,
                seq: f.seq,
            });
        }
        let keys = SessionKeys::new(
            &self.secret,
            &self.nonce,
            &f.payload[NONCE_LEN..2 * NONCE_LEN],
        );
        verify(Signer::Session(&keys.acceptor), &f)?;
        if f.seq != 0 {
            return Err(PeerError::Replayed {
                kind: f.kind,
                seq: f.seq,
                expected: 0,
            });
        }
        let credit = u32_at(f.payload, 2 * NONCE_LEN);
        Ok((
            Session {
                sends: keys.initiator,
                receives: keys.acceptor,
                host: self.host,
                peer: f.host,
                epoch: f.epoch,
                sent: 0,
                received: 1,
            },
            Welcome { credit },
        ))
    }
}

/// A session's two keys, one per direction, drawn from the job's secret
/// and both ends' nonces.
struct SessionKeys {
    initiator: LessSafeKey,
    acceptor: LessSafeKey,
}

impl SessionKeys {
    fn new(secret: &Secret, initiator: &[u8], acceptor: &[u8]) -> Self {
        let key = |role: Role| {
            let k = secret.tag(KEY_DOMAIN, &[role.direction(), initiator, acceptor]);
            LessSafeKey::new(
                UnboundKey::new(&AES_256_GCM, k.as_bytes()).expect("AES-256 takes a 32-byte key"),
            )
        };
        Self {
            initiator: key(Role::Initiator),
            acceptor: key(Role::Acceptor),
        }
    }
}

impl Session {
    /// Accepts a hello as node `host`: the session and the welcome to send
    /// back, granting `credit` chunks. `nonce` must be fresh.
    pub fn accept(
        secret: Secret,
        host: u64,
        epoch: u64,
        hello: &[u8],
        nonce: [u8; NONCE_LEN],
        credit: u32,
    ) -> Result<(Self, Vec<u8>), PeerError> {
        let f = decode(hello)?;
        if f.kind != Kind::Hello {
            return Err(PeerError::Unexpected {
                expected: Kind::Hello,
                came: f.kind,
            });
        }
        verify(Signer::Hello(&secret), &f)?;
        if f.payload.len() != NONCE_LEN {
            return Err(PeerError::Payload {
                kind: f.kind,
                detail: format!("{} bytes, a nonce has {NONCE_LEN}", f.payload.len()),
            });
        }
        let keys = SessionKeys::new(&secret, f.payload, &nonce);
        let wire = encode(
            Signer::Session(&keys.acceptor),
            Head {
                kind: Kind::Welcome,
                host,
                epoch,
                seq: 0,
            },
            &[f.payload, &nonce, &credit.to_le_bytes()],
        );
        Ok((
            Self {
                sends: keys.acceptor,
                receives: keys.initiator,
                host,
                peer: f.host,
                epoch,
                sent: 1,
                received: 0,
            },
            wire,
        ))
    }

    /// Encodes and tags the next frame of this end.
    pub fn seal(&mut self, kind: Kind, parts: &[&[u8]]) -> Vec<u8> {
        let wire = encode(
            Signer::Session(&self.sends),
            Head {
                kind,
                host: self.host,
                epoch: self.epoch,
                seq: self.sent,
            },
            parts,
        );
        self.sent += 1;
        wire
    }

    /// Takes back the last frame [`Session::seal`] made, which was never
    /// sent: the next frame gets its sequence number (and its nonce, under
    /// which no tag was seen).
    pub fn rewind(&mut self) {
        self.sent = self.sent.saturating_sub(1);
    }

    /// Checks a received frame of this session: header, tag, then its
    /// sequence number. A refused frame changes nothing.
    pub fn open<'a>(&mut self, wire: &'a [u8]) -> Result<Frame<'a>, PeerError> {
        let f = decode(wire)?;
        verify(Signer::Session(&self.receives), &f)?;
        if f.seq != self.received {
            return Err(PeerError::Replayed {
                kind: f.kind,
                seq: f.seq,
                expected: self.received,
            });
        }
        self.received += 1;
        Ok(f)
    }
}

mod payload;
pub use payload::*;

#[cfg(test)]
mod tests;
