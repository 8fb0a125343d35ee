//! What the peer frames carry: a chunk's header, heartbeats, receipts,
//! credit and state maps, each with a parser that refuses by name whatever
//! breaks its layout (the frame itself is checked in the parent module).

use super::{CHUNK_HEADER_LEN, Kind, PeerError, u32_at, u64_at};

/// The header of a chunk: which snapshot it belongs to, and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub rank: u64,
    pub step: u64,
    /// The epoch the snapshot was taken under.
    pub epoch: u64,
    /// The snapshot's length in bytes.
    pub total: u64,
    pub offset: u64,
    /// The data bytes of a slot of the sender's store.
    pub capacity: u64,
    pub layout_hash: u64,
    pub job_hash: u64,
    pub sealed_at_unix_ns: u64,
    /// The slot's checksum (`crate::shm`): the receiver seals only when
    /// what arrived hashes to it.
    pub checksum: u64,
}

impl ChunkHeader {
    pub fn encode(&self) -> [u8; CHUNK_HEADER_LEN] {
        let mut b = [0u8; CHUNK_HEADER_LEN];
        for (i, w) in [
            self.rank,
            self.step,
            self.epoch,
            self.total,
            self.offset,
            self.capacity,
            self.layout_hash,
            self.job_hash,
            self.sealed_at_unix_ns,
            self.checksum,
        ]
        .into_iter()
        .enumerate()
        {
            b[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    /// The header and data of a chunk's payload, checked for consistency:
    /// the data lies inside the snapshot, which fits its slot.
    pub fn parse(payload: &[u8]) -> Result<(Self, &[u8]), PeerError> {
        let bad = |detail: String| PeerError::Payload {
            kind: Kind::Chunk,
            detail,
        };
        if payload.len() < CHUNK_HEADER_LEN {
            return Err(bad(format!(
                "{} bytes, shorter than a chunk header",
                payload.len()
            )));
        }
        let w = |i: usize| u64_at(payload, i * 8);
        let h = Self {
            rank: w(0),
            step: w(1),
            epoch: w(2),
            total: w(3),
            offset: w(4),
            capacity: w(5),
            layout_hash: w(6),
            job_hash: w(7),
            sealed_at_unix_ns: w(8),
            checksum: w(9),
        };
        let data = &payload[CHUNK_HEADER_LEN..];
        let end = h.offset.checked_add(data.len() as u64);
        if end.is_none_or(|e| e > h.total) {
            return Err(bad(format!(
                "{} bytes at offset {} run past the snapshot's {} bytes",
                data.len(),
                h.offset,
                h.total
            )));
        }
        if h.total > h.capacity {
            return Err(bad(format!(
                "a snapshot of {} bytes does not fit slots of {} bytes",
                h.total, h.capacity
            )));
        }
        if data.is_empty() && h.total != 0 {
            return Err(bad("a chunk without data".into()));
        }
        Ok((h, data))
    }
}

/// A heartbeat's payload: what the embedded coordinator says every other
/// agent. `u64::MAX` stands for "none" in `follows` and `echo_ns`.
///
/// ```text
///  0 stamp (ns, the sender's clock)  8 follows  16 echo (ns)  24 term
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beat {
    pub stamp_ns: u64,
    pub follows: Option<u64>,
    pub echo_ns: Option<u64>,
    pub term: u64,
}

impl Beat {
    pub const LEN: usize = 32;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        let none = u64::MAX;
        for (i, w) in [
            self.stamp_ns,
            self.follows.unwrap_or(none),
            self.echo_ns.unwrap_or(none),
            self.term,
        ]
        .into_iter()
        .enumerate()
        {
            b[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    pub fn parse(payload: &[u8]) -> Result<Self, PeerError> {
        if payload.len() != Self::LEN {
            return Err(PeerError::Payload {
                kind: Kind::Heartbeat,
                detail: format!("{} bytes, a heartbeat has {}", payload.len(), Self::LEN),
            });
        }
        let some = |w: u64| (w != u64::MAX).then_some(w);
        Ok(Self {
            stamp_ns: u64_at(payload, 0),
            follows: some(u64_at(payload, 8)),
            echo_ns: some(u64_at(payload, 16)),
            term: u64_at(payload, 24),
        })
    }
}

/// A [`Kind::Stored`] receipt's payload: rank and step.
pub fn receipt(rank: u64, step: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&rank.to_le_bytes());
    b[8..].copy_from_slice(&step.to_le_bytes());
    b
}

/// Why a holder dropped a snapshot: the byte after a [`Kind::Dropped`]
/// receipt's rank and step. The sender branches on it, never on the text
/// that follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum DropCode {
    /// The holder takes no replica of this rank from this sender: not its
    /// to hold (yet: its orders may come after the stream), or no longer
    /// (a standby that filled the rank's store holds the rank itself).
    NotHolder = 1,
    /// The snapshot could not be stored (no room, a torn or unverifiable
    /// transfer, a bad layout): the text says why.
    Failed = 2,
}

impl DropCode {
    fn from_byte(b: u8) -> Option<Self> {
        match b {
            1 => Some(Self::NotHolder),
            2 => Some(Self::Failed),
            _ => None,
        }
    }
}

/// A [`Kind::Dropped`] receipt's payload: rank, step, why (the code, then
/// a UTF-8 text for the log).
pub fn dropped(rank: u64, step: u64, code: DropCode, text: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(17 + text.len());
    b.extend_from_slice(&receipt(rank, step));
    b.push(code as u8);
    b.extend_from_slice(text.as_bytes());
    b
}

/// A holder's receipt for one snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    pub rank: u64,
    pub step: u64,
    /// `None`: stored; else dropped, with why.
    pub dropped: Option<(DropCode, String)>,
}

/// Parses a [`Kind::Stored`] or [`Kind::Dropped`] payload.
pub fn parse_receipt(kind: Kind, payload: &[u8]) -> Result<Receipt, PeerError> {
    let bad = |detail: String| PeerError::Payload { kind, detail };
    let (rank, step) = match payload.get(..16) {
        Some(_) => (u64_at(payload, 0), u64_at(payload, 8)),
        None => return Err(bad(format!("{} bytes for a receipt", payload.len()))),
    };
    let dropped = match kind {
        Kind::Stored if payload.len() == 16 => None,
        Kind::Stored => return Err(bad(format!("{} bytes for a receipt", payload.len()))),
        Kind::Dropped => {
            let byte = *payload
                .get(16)
                .ok_or_else(|| bad("a drop receipt without its reason code".into()))?;
            let code = DropCode::from_byte(byte)
                .ok_or_else(|| bad(format!("unknown drop reason code {byte}")))?;
            Some((code, String::from_utf8_lossy(&payload[17..]).into_owned()))
        }
        other => return Err(bad(format!("a {other:?} frame is not a receipt"))),
    };
    Ok(Receipt {
        rank,
        step,
        dropped,
    })
}

/// The largest state map a [`Kind::Map`] frame carries.
pub const MAX_MAP: usize = 1 << 20;

/// Parses a [`Kind::Map`] payload: the rank, and its map's JSON (not
/// parsed here).
pub fn parse_map(payload: &[u8]) -> Result<(u64, &[u8]), PeerError> {
    if payload.len() < 8 || payload.len() > 8 + MAX_MAP {
        return Err(PeerError::Payload {
            kind: Kind::Map,
            detail: format!(
                "{} bytes for a state map (8 to {} bytes)",
                payload.len(),
                8 + MAX_MAP
            ),
        });
    }
    Ok((u64_at(payload, 0), &payload[8..]))
}

/// Parses a [`Kind::Credit`] payload.
pub fn parse_credit(payload: &[u8]) -> Result<u32, PeerError> {
    if payload.len() != 4 {
        return Err(PeerError::Payload {
            kind: Kind::Credit,
            detail: format!("{} bytes for a credit", payload.len()),
        });
    }
    Ok(u32_at(payload, 0))
}
