//! Length-prefixed, versioned frames for every hatrain socket protocol.
//!
//! ```text
//!  0       4       6       8              12
//!  +-------+-------+-------+--------------+------------------------+
//!  | magic | major | minor | payload len  | payload (len bytes)    |
//!  | 4 B   | u16le | u16le | u32le        |                        |
//!  +-------+-------+-------+--------------+------------------------+
//! ```
//!
//! Each protocol has its own magic and version. A reader checks, in this
//! order: the length bound (before allocating anything), the magic, then
//! `major == ours && minor <= ours`. A newer minor version may only add
//! optional content, so a newer reader still accepts an older writer's
//! frames; an older reader refuses a newer minor's, naming both versions.

use std::io::{self, Read, Write};

/// Size of the fixed frame header.
pub const HEADER_LEN: usize = 12;

/// Identity of one protocol: its magic, version and the largest payload it
/// accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Protocol {
    pub name: &'static str,
    pub magic: [u8; 4],
    pub major: u16,
    pub minor: u16,
    pub max_payload: u32,
}

/// Why a frame was refused.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("{protocol}: frame payload of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        protocol: &'static str,
        len: u64,
        max: u32,
    },
    #[error("{protocol}: bad magic {found:02x?}, expected {expected:02x?}")]
    BadMagic {
        protocol: &'static str,
        found: [u8; 4],
        expected: [u8; 4],
    },
    #[error(
        "{protocol}: unsupported version {major}.{minor}, this build speaks {our_major}.{our_minor}"
    )]
    Version {
        protocol: &'static str,
        major: u16,
        minor: u16,
        our_major: u16,
        our_minor: u16,
    },
    #[error("{protocol}: frame header truncated ({len} of {HEADER_LEN} bytes)")]
    ShortHeader { protocol: &'static str, len: usize },
    #[error("{protocol}: connection closed")]
    Closed { protocol: &'static str },
    #[error("{protocol}: i/o error")]
    Io {
        protocol: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{protocol}: payload is not a valid message")]
    Decode {
        protocol: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

impl Protocol {
    /// Encodes the header for a payload of `len` bytes.
    pub fn header(&self, len: usize) -> Result<[u8; HEADER_LEN], FrameError> {
        let len32 = u32::try_from(len)
            .ok()
            .filter(|l| *l <= self.max_payload)
            .ok_or(FrameError::TooLarge {
                protocol: self.name,
                len: len as u64,
                max: self.max_payload,
            })?;
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&self.magic);
        h[4..6].copy_from_slice(&self.major.to_le_bytes());
        h[6..8].copy_from_slice(&self.minor.to_le_bytes());
        h[8..12].copy_from_slice(&len32.to_le_bytes());
        Ok(h)
    }

    /// Checks a header and returns the payload length it announces.
    pub fn parse_header(&self, h: &[u8]) -> Result<usize, FrameError> {
        if h.len() < HEADER_LEN {
            return Err(FrameError::ShortHeader {
                protocol: self.name,
                len: h.len(),
            });
        }
        let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
        if len > self.max_payload {
            return Err(FrameError::TooLarge {
                protocol: self.name,
                len: u64::from(len),
                max: self.max_payload,
            });
        }
        let magic = [h[0], h[1], h[2], h[3]];
        if magic != self.magic {
            return Err(FrameError::BadMagic {
                protocol: self.name,
                found: magic,
                expected: self.magic,
            });
        }
        let major = u16::from_le_bytes([h[4], h[5]]);
        let minor = u16::from_le_bytes([h[6], h[7]]);
        if major != self.major || minor > self.minor {
            return Err(FrameError::Version {
                protocol: self.name,
                major,
                minor,
                our_major: self.major,
                our_minor: self.minor,
            });
        }
        Ok(len as usize)
    }

    /// Encodes a whole frame (header and payload) into one buffer.
    pub fn encode(&self, payload: &[u8]) -> Result<Vec<u8>, FrameError> {
        let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
        out.extend_from_slice(&self.header(payload.len())?);
        out.extend_from_slice(payload);
        Ok(out)
    }

    /// Decodes one whole frame held in `buf`, returning its payload.
    pub fn decode<'a>(&self, buf: &'a [u8]) -> Result<&'a [u8], FrameError> {
        let len = self.parse_header(buf)?;
        let body = &buf[HEADER_LEN..];
        if body.len() != len {
            return Err(FrameError::Io {
                protocol: self.name,
                source: io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "frame announces {len} payload bytes but {} follow",
                        body.len()
                    ),
                ),
            });
        }
        Ok(body)
    }

    /// Writes one frame to a blocking stream.
    pub fn write_frame<W: Write>(&self, w: &mut W, payload: &[u8]) -> Result<(), FrameError> {
        let h = self.header(payload.len())?;
        w.write_all(&h)
            .and_then(|()| w.write_all(payload))
            .and_then(|()| w.flush())
            .map_err(|source| self.io(source))
    }

    /// Reads one frame from a blocking stream. A clean end of stream before
    /// the first header byte is [`FrameError::Closed`].
    pub fn read_frame<R: Read>(&self, r: &mut R) -> Result<Vec<u8>, FrameError> {
        let mut h = [0u8; HEADER_LEN];
        let mut got = 0;
        while got < HEADER_LEN {
            match r.read(&mut h[got..]) {
                Ok(0) if got == 0 => {
                    return Err(FrameError::Closed {
                        protocol: self.name,
                    });
                }
                Ok(0) => {
                    return Err(FrameError::ShortHeader {
                        protocol: self.name,
                        len: got,
                    });
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => return Err(self.io(source)),
            }
        }
        let len = self.parse_header(&h)?;
        let mut payload = vec![0u8; len];
        r.read_exact(&mut payload)
            .map_err(|source| self.io(source))?;
        Ok(payload)
    }

    /// Serialises `msg` as JSON and writes it as one frame.
    pub fn send_json<W: Write, T: serde::Serialize>(
        &self,
        w: &mut W,
        msg: &T,
    ) -> Result<(), FrameError> {
        let payload = serde_json::to_vec(msg).map_err(|source| FrameError::Decode {
            protocol: self.name,
            source,
        })?;
        self.write_frame(w, &payload)
    }

    /// Reads one frame and parses its payload as the JSON of `T`.
    pub fn recv_json<R: Read, T: serde::de::DeserializeOwned>(
        &self,
        r: &mut R,
    ) -> Result<T, FrameError> {
        let payload = self.read_frame(r)?;
        self.parse_json(&payload)
    }

    /// Parses a payload as the JSON of `T`.
    pub fn parse_json<T: serde::de::DeserializeOwned>(
        &self,
        payload: &[u8],
    ) -> Result<T, FrameError> {
        serde_json::from_slice(payload).map_err(|source| FrameError::Decode {
            protocol: self.name,
            source,
        })
    }

    fn io(&self, source: io::Error) -> FrameError {
        FrameError::Io {
            protocol: self.name,
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const P: Protocol = Protocol {
        name: "test",
        magic: *b"TEST",
        major: 1,
        minor: 2,
        max_payload: 1 << 16,
    };

    #[test]
    fn rejects_in_the_documented_order() {
        // Oversized length is refused before the magic is even looked at.
        let mut h = P.header(3).unwrap();
        h[0] = b'X';
        h[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            P.parse_header(&h),
            Err(FrameError::TooLarge { .. })
        ));
        let mut h = P.header(3).unwrap();
        h[0] = b'X';
        assert!(matches!(
            P.parse_header(&h),
            Err(FrameError::BadMagic { .. })
        ));
        let mut h = P.header(3).unwrap();
        h[4..6].copy_from_slice(&2u16.to_le_bytes());
        assert!(matches!(
            P.parse_header(&h),
            Err(FrameError::Version { major: 2, .. })
        ));
        let mut h = P.header(3).unwrap();
        h[6..8].copy_from_slice(&3u16.to_le_bytes());
        assert!(matches!(
            P.parse_header(&h),
            Err(FrameError::Version { minor: 3, .. })
        ));
        // An older minor is accepted.
        let mut h = P.header(3).unwrap();
        h[6..8].copy_from_slice(&0u16.to_le_bytes());
        assert_eq!(P.parse_header(&h).unwrap(), 3);
    }

    #[test]
    fn stream_round_trip_and_clean_close() {
        let mut buf = Vec::new();
        P.write_frame(&mut buf, b"hello").unwrap();
        P.write_frame(&mut buf, b"").unwrap();
        let mut r = &buf[..];
        assert_eq!(P.read_frame(&mut r).unwrap(), b"hello");
        assert_eq!(P.read_frame(&mut r).unwrap(), b"");
        assert!(matches!(
            P.read_frame(&mut r),
            Err(FrameError::Closed { .. })
        ));
    }

    proptest! {
        #[test]
        fn round_trip(payload in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let frame = P.encode(&payload).unwrap();
            prop_assert_eq!(P.decode(&frame).unwrap(), &payload[..]);
        }

        #[test]
        fn decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = P.decode(&bytes);
            let _ = P.read_frame(&mut &bytes[..]);
        }
    }
}
