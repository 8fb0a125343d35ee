//! The job's secret, and messages authenticated under it.
//!
//! Every job has a 32-byte secret, made by the launching agent (or read
//! from `--secret-file`) and handed to the job's workers through a file of
//! mode 0600 in the job's 0700 folder, never on a command line and never
//! logged. Whoever holds it is part of the job; whoever does not cannot
//! speak to the job's rendezvous store or its ranks.
//!
//! A tag is keyed BLAKE3 over a domain string and length-prefixed parts, so
//! parts cannot be shifted between fields. [`Session`] authenticates a
//! stream of frames in both directions:
//!
//! ```text
//! server -> client   hello: "HTAH" | u8 version | u8 auth | 16-byte nonce
//! each frame         frame bytes (crate::frame) | 32-byte tag
//! tag = BLAKE3-keyed(secret, "hatrain-frame-v1" | direction | nonce |
//!                    sequence number (u64 le) | frame bytes)
//! ```
//!
//! The nonce is the server's, fresh per connection, and the sequence
//! numbers count the frames in each direction from 0: a frame changed in any
//! byte, replayed (on this connection or another) or reordered fails its
//! tag. Comparison is constant-time (BLAKE3's `Hash` equality).

use crate::frame::{FrameError, HEADER_LEN, Protocol};
use crate::trust::{self, Kind, TrustError};
use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Bytes of a secret, a nonce and a tag.
pub const KEY_LEN: usize = 32;
pub const NONCE_LEN: usize = 16;
pub const TAG_LEN: usize = 32;

/// Environment variable naming the secret file, set for workers.
pub const ENV_SECRET_FILE: &str = "HATRAIN_SECRET_FILE";

const HELLO_MAGIC: [u8; 4] = *b"HTAH";
const HELLO_VERSION: u8 = 1;
/// Bytes of the hello.
pub const HELLO_LEN: usize = 4 + 1 + 1 + NONCE_LEN;

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Untrusted(#[from] TrustError),
    #[error(
        "{path} has mode {mode:04o}: a secret file must not be readable by group or others (chmod 600)"
    )]
    Readable { path: PathBuf, mode: u32 },
    #[error("{path}: not a secret (expected {} hexadecimal digits)", 2 * KEY_LEN)]
    Format { path: PathBuf },
    #[error("cannot draw random bytes")]
    Random(#[source] getrandom::Error),
}

/// A job's secret. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret([u8; KEY_LEN]);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Random bytes from the operating system.
pub fn random<const N: usize>() -> Result<[u8; N], AuthError> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(AuthError::Random)?;
    Ok(b)
}

impl Secret {
    /// A fresh secret.
    pub fn generate() -> Result<Self, AuthError> {
        Ok(Self(random()?))
    }

    pub fn from_bytes(b: [u8; KEY_LEN]) -> Self {
        Self(b)
    }

    /// Reads a secret file: a regular file of this user's or root's that
    /// nobody else can read or write, holding the secret in hex.
    pub fn load(path: &Path) -> Result<Self, AuthError> {
        let meta = trust::check(path, Kind::File, trust::me())?;
        let mode = meta.mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(AuthError::Readable {
                path: path.to_path_buf(),
                mode,
            });
        }
        let text = std::fs::read_to_string(path).map_err(|source| AuthError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_hex(text.trim()).ok_or_else(|| AuthError::Format {
            path: path.to_path_buf(),
        })
    }

    fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 2 * KEY_LEN {
            return None;
        }
        let mut b = [0u8; KEY_LEN];
        for (i, out) in b.iter_mut().enumerate() {
            *out = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Self(b))
    }

    /// Writes the secret in hex (to a file the caller made with mode 0600).
    pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        let hex: String = self.0.iter().map(|b| format!("{b:02x}")).collect();
        w.write_all(hex.as_bytes())?;
        w.write_all(b"\n")
    }

    /// The tag of `parts` under this secret in `domain`.
    pub fn tag(&self, domain: &str, parts: &[&[u8]]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(&(domain.len() as u64).to_le_bytes());
        h.update(domain.as_bytes());
        for p in parts {
            h.update(&(p.len() as u64).to_le_bytes());
            h.update(p);
        }
        h.finalize()
    }

    /// A tag whose last part is fed piece by piece (so a large part is
    /// hashed while it is still in cache): the leading `parts` whole, then
    /// [`Tagger::last_part`] and its pieces. Equal to [`Secret::tag`] over
    /// the same parts.
    pub fn tagger(&self, domain: &str, parts: &[&[u8]]) -> Tagger {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(&(domain.len() as u64).to_le_bytes());
        h.update(domain.as_bytes());
        for p in parts {
            h.update(&(p.len() as u64).to_le_bytes());
            h.update(p);
        }
        Tagger(h)
    }

    /// Whether `tag` is the tag of `parts` (constant-time comparison).
    pub fn verify(&self, domain: &str, parts: &[&[u8]], tag: &[u8]) -> bool {
        <[u8; TAG_LEN]>::try_from(tag)
            .is_ok_and(|t| self.tag(domain, parts) == blake3::Hash::from(t))
    }
}

/// A tag being computed ([`Secret::tagger`]).
pub struct Tagger(blake3::Hasher);

impl std::fmt::Debug for Tagger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tagger(..)")
    }
}

impl Tagger {
    /// Begins the last part, of `len` bytes.
    pub fn last_part(&mut self, len: u64) {
        self.0.update(&len.to_le_bytes());
    }

    /// The next piece of the last part.
    pub fn update(&mut self, piece: &[u8]) {
        self.0.update(piece);
    }

    pub fn finalize(self) -> blake3::Hash {
        self.0.finalize()
    }
}

/// Which end of a session a tag was made by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Client,
    Server,
}

impl Role {
    fn direction(self) -> &'static [u8] {
        match self {
            Self::Client => b"c2s",
            Self::Server => b"s2c",
        }
    }

    fn other(self) -> Self {
        match self {
            Self::Client => Self::Server,
            Self::Server => Self::Client,
        }
    }
}

/// A server's hello: whether it authenticates, and its nonce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub auth: bool,
    pub nonce: [u8; NONCE_LEN],
}

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC);
        b[4] = HELLO_VERSION;
        b[5] = u8::from(self.auth);
        b[6..].copy_from_slice(&self.nonce);
        b
    }

    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != HELLO_LEN || b[0..4] != HELLO_MAGIC || b[4] != HELLO_VERSION || b[5] > 1 {
            return None;
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[6..]);
        Some(Self {
            auth: b[5] == 1,
            nonce,
        })
    }
}

/// Why a frame was refused by a session.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error(
        "{protocol}: frame {seq} fails its authentication tag (forged, altered, replayed or out of order)"
    )]
    BadTag { protocol: &'static str, seq: u64 },
    #[error("{protocol}: frame of {len} bytes is too short to carry a tag")]
    Short { protocol: &'static str, len: usize },
}

/// One end of an authenticated stream of frames.
#[derive(Debug)]
pub struct Session {
    protocol: Protocol,
    secret: Option<Secret>,
    nonce: [u8; NONCE_LEN],
    role: Role,
    sent: u64,
    received: u64,
}

impl Session {
    /// A session of `role` under `hello` (`secret` is `None` when the server
    /// does not authenticate).
    pub fn new(protocol: Protocol, role: Role, hello: Hello, secret: Option<Secret>) -> Self {
        Self {
            protocol,
            secret: secret.filter(|_| hello.auth),
            nonce: hello.nonce,
            role,
            sent: 0,
            received: 0,
        }
    }

    /// Whether frames carry tags.
    pub fn authenticates(&self) -> bool {
        self.secret.is_some()
    }

    fn tag_of(&self, role: Role, seq: u64, frame: &[u8]) -> Option<blake3::Hash> {
        let s = self.secret.as_ref()?;
        Some(s.tag(
            "hatrain-frame-v1",
            &[role.direction(), &self.nonce, &seq.to_le_bytes(), frame],
        ))
    }

    /// Encodes `payload` as a frame of this session, with its tag.
    pub fn seal(&mut self, payload: &[u8]) -> Result<Vec<u8>, FrameError> {
        let mut out = self.protocol.encode(payload)?;
        if let Some(tag) = self.tag_of(self.role, self.sent, &out) {
            out.extend_from_slice(tag.as_bytes());
        }
        self.sent += 1;
        Ok(out)
    }

    /// Bytes that follow a frame's payload on the wire.
    pub fn trailer_len(&self) -> usize {
        if self.authenticates() { TAG_LEN } else { 0 }
    }

    /// Checks a whole received frame (header, payload, tag) and returns its
    /// payload. A frame that fails its tag is refused and changes nothing.
    pub fn open<'a>(&mut self, wire: &'a [u8]) -> Result<&'a [u8], SessionError> {
        let t = self.trailer_len();
        if wire.len() < HEADER_LEN + t {
            return Err(SessionError::Short {
                protocol: self.protocol.name,
                len: wire.len(),
            });
        }
        let (frame, tag) = wire.split_at(wire.len() - t);
        let payload = self.protocol.decode(frame)?;
        if let Some(want) = self.tag_of(self.role.other(), self.received, frame)
            && !<[u8; TAG_LEN]>::try_from(tag).is_ok_and(|t| want == blake3::Hash::from(t))
        {
            return Err(SessionError::BadTag {
                protocol: self.protocol.name,
                seq: self.received,
            });
        }
        self.received += 1;
        Ok(payload)
    }

    /// Writes one sealed frame to a blocking stream.
    pub fn send<W: Write>(&mut self, w: &mut W, payload: &[u8]) -> Result<(), SessionError> {
        let bytes = self.seal(payload)?;
        w.write_all(&bytes)
            .and_then(|()| w.flush())
            .map_err(|source| FrameError::Io {
                protocol: self.protocol.name,
                source,
            })?;
        Ok(())
    }

    /// Reads and checks one frame from a blocking stream.
    pub fn recv<R: Read>(&mut self, r: &mut R) -> Result<Vec<u8>, SessionError> {
        let mut header = [0u8; HEADER_LEN];
        let io = |source| FrameError::Io {
            protocol: self.protocol.name,
            source,
        };
        match r.read_exact(&mut header) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                return Err(FrameError::Closed {
                    protocol: self.protocol.name,
                }
                .into());
            }
            Err(e) => return Err(io(e).into()),
        }
        let len = self.protocol.parse_header(&header)?;
        let mut wire = vec![0u8; HEADER_LEN + len + self.trailer_len()];
        wire[..HEADER_LEN].copy_from_slice(&header);
        r.read_exact(&mut wire[HEADER_LEN..]).map_err(io)?;
        Ok(self.open(&wire)?.to_vec())
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
        minor: 0,
        max_payload: 1 << 16,
    };

    fn pair(secret: &Secret) -> (Session, Session) {
        let hello = Hello {
            auth: true,
            nonce: [7; NONCE_LEN],
        };
        (
            Session::new(P, Role::Client, hello, Some(secret.clone())),
            Session::new(P, Role::Server, hello, Some(secret.clone())),
        )
    }

    #[test]
    fn frames_pass_once_in_order_and_not_under_another_key_or_nonce() {
        let key = Secret::from_bytes([1; KEY_LEN]);
        let (mut c, mut s) = pair(&key);
        let f1 = c.seal(b"first").unwrap();
        let f2 = c.seal(b"second").unwrap();
        assert_eq!(s.open(&f1).unwrap(), b"first");
        // Replayed: the sequence has moved on.
        assert!(matches!(
            s.open(&f1),
            Err(SessionError::BadTag { seq: 1, .. })
        ));
        assert_eq!(s.open(&f2).unwrap(), b"second");
        // The server's answer is not valid as a client frame.
        let answer = s.seal(b"ok").unwrap();
        assert_eq!(c.open(&answer).unwrap(), b"ok");
        // Another key, or another connection's nonce.
        let (_, mut other) = pair(&Secret::from_bytes([2; KEY_LEN]));
        let (mut c2, _) = pair(&key);
        assert!(other.open(&c2.seal(b"x").unwrap()).is_err());
        let mut s3 = Session::new(
            P,
            Role::Server,
            Hello {
                auth: true,
                nonce: [8; NONCE_LEN],
            },
            Some(key.clone()),
        );
        let (mut c3, _) = pair(&key);
        assert!(s3.open(&c3.seal(b"x").unwrap()).is_err());
        // Without a tag at all.
        let (_, mut s4) = pair(&key);
        assert!(s4.open(&P.encode(b"plain").unwrap()).is_err());
    }

    #[test]
    fn secrets_round_trip_and_readable_files_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("secret");
        let s = Secret::generate().unwrap();
        let mut f = std::fs::File::create(&p).unwrap();
        s.write_to(&mut f).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(Secret::load(&p).unwrap(), s);
        assert_eq!(format!("{s:?}"), "Secret(..)");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = Secret::load(&p).unwrap_err().to_string();
        assert!(
            e.contains("0640") && e.contains("must not be readable"),
            "{e}"
        );
        std::fs::write(&p, b"nothex").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(
            Secret::load(&p)
                .unwrap_err()
                .to_string()
                .contains("not a secret")
        );
    }

    proptest! {
        #[test]
        fn any_changed_byte_is_refused(payload in proptest::collection::vec(any::<u8>(), 0..200), at in any::<usize>(), x in 1u8..=255) {
            let key = Secret::from_bytes([3; KEY_LEN]);
            let (mut c, mut s) = pair(&key);
            let mut f = c.seal(&payload).unwrap();
            let i = at % f.len();
            f[i] ^= x;
            prop_assert!(s.open(&f).is_err());
        }

        #[test]
        fn the_decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let key = Secret::from_bytes([4; KEY_LEN]);
            let (_, mut s) = pair(&key);
            let _ = s.open(&bytes);
            let _ = s.recv(&mut &bytes[..]);
            let _ = Hello::decode(&bytes);
        }
    }
}
