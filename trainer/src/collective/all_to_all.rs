//! Point-to-point moves over the ring: every rank sends each other rank
//! its own bytes, and only those ([`Communicator::all_to_all_bytes`]).
//!
//! The ring connects each rank to the next, so a message for the rank `k`
//! places on travels `k` hops, forwarded by the ranks between: in each of
//! the `W − 1` rounds a rank sends the next one a bundle of the messages
//! it still carries (its own, and those it received for ranks further on)
//! and keeps, of the bundle it receives, the messages for itself. A byte
//! crosses as many links as its destination is places away, against
//! `W − 1` for every byte in an all-gather. Empty messages are not sent.
//!
//! ```text
//! bundle: n u64, then n × ( to u64 | from u64 | len u64 | len bytes )
//! ```

use super::{CollectiveError, Communicator, MsgError};
use std::io::{self, BufWriter, Read, Write};

/// One message in a bundle.
struct Message {
    to: usize,
    from: usize,
    bytes: Vec<u8>,
}

impl Communicator {
    /// Sends `out[t]` to rank `t` (nothing for an empty one, and `out[r]`,
    /// this rank's own, stays here); returns what each rank sent this one,
    /// in rank order. `out` has one entry per rank.
    ///
    /// A message's bytes are never copied: a bundle is written to the
    /// socket message by message and read into one buffer per message, and
    /// a message carried on is moved, so a rank holds what it sends and
    /// receives once (a resize of several GB per rank needs that).
    pub fn all_to_all_bytes(
        &mut self,
        mut out: Vec<Vec<u8>>,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let (w, r) = (self.world, self.rank);
        assert_eq!(out.len(), w, "all_to_all_bytes takes one message per rank");
        let mut got: Vec<Vec<u8>> = vec![Vec::new(); w];
        got[r] = std::mem::take(&mut out[r]);
        let mut carry: Vec<Message> = out
            .into_iter()
            .enumerate()
            .filter(|(to, b)| *to != r && !b.is_empty())
            .map(|(to, bytes)| Message { to, from: r, bytes })
            .collect();
        let prev = (r + w - 1) % w.max(1);
        for _ in 0..w.saturating_sub(1) {
            let out_len = bundle_len(&carry);
            self.exchange(&out_len.to_le_bytes(), 8)?;
            let in_len = u64::from_le_bytes(self.scratch[..8].try_into().expect("8 bytes"));
            let sending = &carry;
            let incoming = self.exchange_with(
                out_len,
                |s| write_bundle(s, sending),
                in_len,
                |body| read_bundle(body, in_len, w),
            )?;
            carry.clear();
            for m in incoming {
                if m.to == r {
                    got[m.from] = m.bytes;
                } else {
                    carry.push(m);
                }
            }
        }
        if let Some(m) = carry.first() {
            return Err(self.malformed(
                prev,
                &format!("a message for rank {} left over after every round", m.to),
            ));
        }
        Ok(got)
    }

    fn malformed(&self, peer: usize, detail: &str) -> CollectiveError {
        CollectiveError::Protocol {
            epoch: self.epoch,
            peer,
            detail: detail.to_string(),
        }
    }
}

/// The bytes [`write_bundle`] writes for `carry`.
fn bundle_len(carry: &[Message]) -> u64 {
    8 + carry.iter().map(|m| 24 + m.bytes.len() as u64).sum::<u64>()
}

/// Writes the bundle of `carry` to `w`: the words through a small buffer,
/// each message's bytes straight from where they are.
fn write_bundle(w: &mut impl Write, carry: &[Message]) -> io::Result<()> {
    let mut w = BufWriter::with_capacity(64 << 10, w);
    w.write_all(&(carry.len() as u64).to_le_bytes())?;
    for m in carry {
        for word in [m.to as u64, m.from as u64, m.bytes.len() as u64] {
            w.write_all(&word.to_le_bytes())?;
        }
        w.write_all(&m.bytes)?;
    }
    w.flush()
}

/// Reads a bundle of exactly `len` bytes for a ring of `world` from `r`,
/// each message into its own buffer. Every message must name ranks of the
/// ring and fit in what is left of the bundle (so no length a peer sends
/// makes this rank allocate more than the bundle holds), and the last one
/// must end the bundle.
fn read_bundle(r: &mut impl Read, len: u64, world: usize) -> Result<Vec<Message>, MsgError> {
    let bad = |what: &str| MsgError::Protocol(format!("a malformed bundle: {what}"));
    let mut left = len;
    let word = |r: &mut dyn Read, left: &mut u64| -> Result<u64, MsgError> {
        *left = left
            .checked_sub(8)
            .ok_or_else(|| bad("it ends inside a word"))?;
        let mut b = [0u8; 8];
        r.read_exact(&mut b)?;
        Ok(u64::from_le_bytes(b))
    };
    let n = word(r, &mut left)?;
    if n > left / 24 {
        return Err(bad(&format!("{n} messages in {left} bytes")));
    }
    let mut out = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let to = word(r, &mut left)?;
        let from = word(r, &mut left)?;
        let bytes = word(r, &mut left)?;
        if to >= world as u64 || from >= world as u64 {
            return Err(bad(&format!(
                "a message from rank {from} to rank {to} in a ring of {world}"
            )));
        }
        if bytes > left {
            return Err(bad(&format!(
                "a message of {bytes} bytes with {left} left in the bundle"
            )));
        }
        left -= bytes;
        let mut buf = Vec::new();
        usize::try_from(bytes)
            .ok()
            .and_then(|n| buf.try_reserve_exact(n).ok())
            .ok_or_else(|| {
                bad(&format!(
                    "a message of {bytes} bytes, more than this host can hold"
                ))
            })?;
        if r.take(bytes).read_to_end(&mut buf)? as u64 != bytes {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
        }
        out.push(Message {
            to: to as usize,
            from: from as usize,
            bytes: buf,
        });
    }
    if left != 0 {
        return Err(bad(&format!("{left} bytes after its last message")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bundles_round_trip() {
        let carry = vec![
            Message {
                to: 2,
                from: 0,
                bytes: vec![1, 2, 3],
            },
            Message {
                to: 1,
                from: 3,
                bytes: vec![],
            },
        ];
        let mut b = Vec::new();
        write_bundle(&mut b, &carry).unwrap();
        assert_eq!(b.len() as u64, bundle_len(&carry));
        let read = |b: &[u8], world| read_bundle(&mut &b[..], b.len() as u64, world);
        let back = read(&b, 4).unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(
            (back[0].to, back[0].from, back[0].bytes.as_slice()),
            (2, 0, &[1u8, 2, 3][..])
        );
        assert!(read(&b, 2).is_err(), "a rank outside the ring");
        assert!(read(&b[..b.len() - 1], 4).is_err(), "cut short");
        let mut longer = b.clone();
        longer.push(0);
        assert!(read(&longer, 4).is_err(), "a byte after the last message");
    }

    /// Over a real ring: each rank's message to each other arrives whole,
    /// large ones (past the socket buffers) and empty ones alike.
    #[test]
    fn tcp_ring_all_to_all() {
        let len = |from: usize, to: usize| ((from * 7 + to * 3) % 5) * 100_001;
        let fill = |from: usize, to: usize| (from * 16 + to) as u8;
        for world in 1..=5 {
            let got = crate::collective::tests::run_ranks(world, move |mut c| {
                let r = c.rank();
                let out = (0..world).map(|t| vec![fill(r, t); len(r, t)]).collect();
                c.all_to_all_bytes(out).unwrap()
            });
            for (to, got) in got.iter().enumerate() {
                for (from, bytes) in got.iter().enumerate() {
                    assert_eq!(bytes.len(), len(from, to), "{from} to {to} of {world}");
                    assert!(bytes.iter().all(|&b| b == fill(from, to)));
                }
            }
        }
    }

    /// A resize of several GB per rank: one message of more than 4 GiB
    /// (past any 32-bit length) crosses the ring whole, while a small one
    /// goes the other way. The sender's buffer is untouched zero pages but
    /// for three marks (one past the 4 GiB line), so only the receiver
    /// holds the bytes: about 4 GiB of memory for this test.
    #[test]
    fn a_message_of_more_than_4_gib_crosses_the_ring_whole() {
        const LEN: usize = (4 << 30) + 4097;
        const MARKS: [(usize, u8); 3] = [(0, 1), (1 << 32, 2), (LEN - 1, 3)];
        let got = crate::collective::tests::run_ranks(2, |mut c| {
            let mut out = vec![Vec::new(), Vec::new()];
            if c.rank() == 0 {
                let mut big = vec![0u8; LEN];
                for (at, v) in MARKS {
                    big[at] = v;
                }
                out[1] = big;
            } else {
                out[0] = b"back".to_vec();
            }
            let got = c.all_to_all_bytes(out).unwrap();
            // What arrived, without keeping it: each message's length and
            // its bytes that are not zero.
            got.iter()
                .map(|b| {
                    let marks: Vec<(usize, u8)> = if b.len() == LEN {
                        b.iter()
                            .enumerate()
                            .filter(|(_, v)| **v != 0)
                            .map(|(i, v)| (i, *v))
                            .collect()
                    } else {
                        b.iter().map(|v| (0, *v)).collect()
                    };
                    (b.len(), marks)
                })
                .collect::<Vec<_>>()
        });
        assert_eq!(
            got[1][0],
            (LEN, MARKS.to_vec()),
            "rank 1 got rank 0's whole message"
        );
        assert_eq!(got[0][1].0, 4, "rank 0 got rank 1's");
        assert_eq!(got[0][1].1.iter().map(|m| m.1).collect::<Vec<_>>(), b"back");
    }

    proptest! {
        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256), world in 0usize..8) {
            let _ = read_bundle(&mut &bytes[..], bytes.len() as u64, world);
        }
    }
}
