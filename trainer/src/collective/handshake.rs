//! The handshake of a ring link (see "Handshake" in [`super`]): the
//! acceptor's loop over connections, the proofs of both ends, and reads
//! that a new directive from the agent cancels.

use super::{CollectiveError, MAGIC, remaining};
use hatrain_shared::auth::{NONCE_LEN, Secret, TAG_LEN};
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

/// Bytes of a ring hello: magic, epoch, rank, nonce.
pub(super) const HELLO: usize = 20 + NONCE_LEN;
/// Tag domains of the two proofs of a link.
pub(super) const RING_ACCEPT: &str = "hatrain-ring-accept-v1";
pub(super) const RING_CONNECT: &str = "hatrain-ring-connect-v1";
/// How long a connection to our listener has for each handshake message.
const HANDSHAKE_STEP: Duration = Duration::from_secs(2);

/// What a link's proofs are tags of: the epoch, who proves to whom, and
/// both nonces (the prover's peer's first), each of a fixed length.
pub(super) fn link_bytes(
    epoch: u64,
    prover: usize,
    peer: usize,
    theirs: &[u8],
    ours: &[u8],
) -> Vec<u8> {
    let mut v = Vec::with_capacity(24 + 2 * NONCE_LEN);
    v.extend_from_slice(&epoch.to_le_bytes());
    v.extend_from_slice(&(prover as u64).to_le_bytes());
    v.extend_from_slice(&(peer as u64).to_le_bytes());
    v.extend_from_slice(theirs);
    v.extend_from_slice(ours);
    v
}

/// The accepting side of this rank's link with the previous rank.
pub(super) struct Link<'a> {
    pub(super) epoch: u64,
    pub(super) rank: usize,
    pub(super) prev: usize,
    pub(super) secret: Option<&'a Secret>,
    pub(super) deadline: Instant,
    pub(super) timeout: Duration,
    pub(super) cancel: &'a dyn Fn() -> bool,
}

impl Link<'_> {
    /// Accepts connections until one sends the previous rank's hello for
    /// this epoch; others are closed. Returns it and its nonce.
    pub(super) fn accept(
        &self,
        listener: &TcpListener,
    ) -> Result<(TcpStream, [u8; NONCE_LEN]), CollectiveError> {
        let epoch = self.epoch;
        loop {
            let mut conn =
                accept_until(listener, self.deadline, self.cancel).map_err(|e| match e {
                    Accept::Cancelled => CollectiveError::Aborted { epoch },
                    Accept::TimedOut => CollectiveError::AcceptTimeout {
                        epoch,
                        peer: self.prev,
                        waited: self.timeout,
                    },
                    Accept::Failed(source) => CollectiveError::Listen { epoch, source },
                })?;
            let step = remaining(self.deadline).clamp(Duration::from_millis(1), HANDSHAKE_STEP);
            let mut got = [0u8; HELLO];
            let read = conn
                .set_read_timeout(Some(step))
                .and_then(|()| conn.read_exact(&mut got));
            let their_epoch = u64::from_le_bytes(got[4..12].try_into().expect("8 bytes"));
            let their_rank = u64::from_le_bytes(got[12..20].try_into().expect("8 bytes"));
            if read.is_ok()
                && got[0..4] == MAGIC
                && their_epoch == epoch
                && their_rank == self.prev as u64
            {
                let mut nonce = [0u8; NONCE_LEN];
                nonce.copy_from_slice(&got[20..]);
                return Ok((conn, nonce));
            }
            eprintln!(
                "rank {}: epoch {epoch}: closed a ring connection that is not rank {}'s of this epoch",
                self.rank, self.prev
            );
        }
    }

    /// Sends our nonce and our proof over the connector's nonce.
    pub(super) fn answer(
        &self,
        conn: &mut TcpStream,
        theirs: &[u8],
        ours: &[u8; NONCE_LEN],
    ) -> Result<(), CollectiveError> {
        let mut out = [0u8; NONCE_LEN + TAG_LEN];
        out[..NONCE_LEN].copy_from_slice(ours);
        if let Some(k) = self.secret {
            out[NONCE_LEN..].copy_from_slice(
                k.tag(
                    RING_ACCEPT,
                    &[&link_bytes(self.epoch, self.rank, self.prev, theirs, ours)],
                )
                .as_bytes(),
            );
        }
        // A stranger that closed already is found out at the proof.
        let _ = conn.write_all(&out);
        Ok(())
    }

    /// Reads and checks the connector's proof over our nonce.
    pub(super) fn proof(
        &self,
        conn: &mut TcpStream,
        theirs: &[u8],
        ours: &[u8; NONCE_LEN],
    ) -> Result<(), String> {
        let step = remaining(self.deadline).clamp(Duration::from_millis(1), HANDSHAKE_STEP);
        let mut tag = [0u8; TAG_LEN];
        conn.set_read_timeout(Some(step))
            .and_then(|()| conn.read_exact(&mut tag))
            .map_err(|e| format!("no proof of the job's secret ({e})"))?;
        conn.set_read_timeout(None).map_err(|e| e.to_string())?;
        match self.secret {
            Some(k)
                if !k.verify(
                    RING_CONNECT,
                    &[&link_bytes(self.epoch, self.prev, self.rank, ours, theirs)],
                    &tag,
                ) =>
            {
                Err("its proof of the job's secret is wrong".into())
            }
            _ => Ok(()),
        }
    }
}

/// How a build is polled for cancellation while it waits.
pub(super) const CANCEL_SLICE: Duration = Duration::from_millis(200);

/// Why no connection was accepted.
pub(super) enum Accept {
    Cancelled,
    TimedOut,
    Failed(io::Error),
}

pub(super) fn accept_until(
    listener: &TcpListener,
    deadline: Instant,
    cancel: &dyn Fn() -> bool,
) -> Result<TcpStream, Accept> {
    listener.set_nonblocking(true).map_err(Accept::Failed)?;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(Accept::Failed)?;
                return Ok(s);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if cancel() {
                    return Err(Accept::Cancelled);
                }
                if Instant::now() >= deadline {
                    return Err(Accept::TimedOut);
                }
                thread::sleep(Duration::from_millis(2));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Accept::Failed(e)),
        }
    }
}

/// Fills `buf` from `s` by the deadline, in slices that check `cancel`;
/// `Err(None)` when cancelled.
pub(super) fn read_full(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    cancel: &dyn Fn() -> bool,
) -> Result<(), Option<io::Error>> {
    let mut at = 0;
    while at < buf.len() {
        if cancel() {
            return Err(None);
        }
        let left = remaining(deadline);
        if left.is_zero() {
            return Err(Some(io::ErrorKind::TimedOut.into()));
        }
        s.set_read_timeout(Some(left.min(CANCEL_SLICE)))
            .map_err(Some)?;
        match s.read(&mut buf[at..]) {
            Ok(0) => return Err(Some(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => at += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(Some(e)),
        }
    }
    s.set_read_timeout(None).map_err(Some)
}
