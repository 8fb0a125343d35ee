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

use super::{CollectiveError, Communicator};

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
            let bundle = encode(&carry);
            self.exchange(&(bundle.len() as u64).to_le_bytes(), 8)?;
            let len = u64::from_le_bytes(self.scratch[..8].try_into().expect("8 bytes"));
            let len = usize::try_from(len)
                .map_err(|_| self.malformed(prev, "a bundle larger than this host's memory"))?;
            self.exchange(&bundle, len)?;
            let incoming = decode(&self.scratch, w)
                .ok_or_else(|| self.malformed(prev, "a malformed bundle"))?;
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

fn encode(carry: &[Message]) -> Vec<u8> {
    let len = 8 + carry.iter().map(|m| 24 + m.bytes.len()).sum::<usize>();
    let mut b = Vec::with_capacity(len);
    b.extend_from_slice(&(carry.len() as u64).to_le_bytes());
    for m in carry {
        for word in [m.to as u64, m.from as u64, m.bytes.len() as u64] {
            b.extend_from_slice(&word.to_le_bytes());
        }
        b.extend_from_slice(&m.bytes);
    }
    b
}

/// The messages of a bundle for a ring of `world`; `None` unless every
/// message names ranks of the ring and the bytes end with the last one.
fn decode(b: &[u8], world: usize) -> Option<Vec<Message>> {
    let mut at = 0usize;
    let word = |at: &mut usize| -> Option<u64> {
        let w = u64::from_le_bytes(b.get(*at..at.checked_add(8)?)?.try_into().ok()?);
        *at += 8;
        Some(w)
    };
    let n = word(&mut at)?;
    let mut out = Vec::new();
    for _ in 0..n {
        let to = usize::try_from(word(&mut at)?).ok()?;
        let from = usize::try_from(word(&mut at)?).ok()?;
        let len = usize::try_from(word(&mut at)?).ok()?;
        if to >= world || from >= world {
            return None;
        }
        let bytes = b.get(at..at.checked_add(len)?)?.to_vec();
        at += len;
        out.push(Message { to, from, bytes });
    }
    (at == b.len()).then_some(out)
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
        let b = encode(&carry);
        let back = decode(&b, 4).unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(
            (back[0].to, back[0].from, back[0].bytes.as_slice()),
            (2, 0, &[1u8, 2, 3][..])
        );
        assert!(decode(&b, 2).is_none(), "a rank outside the ring");
        assert!(decode(&b[..b.len() - 1], 4).is_none());
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

    proptest! {
        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256), world in 0usize..8) {
            let _ = decode(&bytes, world);
        }
    }
}
