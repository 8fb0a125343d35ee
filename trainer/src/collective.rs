//! Ring collectives over TCP: reduce-scatter, all-gather and small gathers,
//! for a ZeRO-1 data-parallel job.
//!
//! A [`Communicator`] belongs to one epoch. Each rank listens on a fresh port,
//! publishes it in the rendezvous store under `epoch/<e>/ring/<rank>`,
//! connects to rank `r+1` and accepts rank `r-1`. After a fault every rank
//! builds a new communicator under a new epoch; nothing from the old one is
//! reused.
//!
//! # Chunking
//!
//! The flat buffer is cut into `W` chunks, chunk `c` being
//! [`shard_range`]`(n, W, c)`, the same ranges the optimizer shards use. In
//! ring step `i` (`0 ≤ i < W-1`) rank `r`
//! - for reduce-scatter sends chunk `(r-i-1) mod W` and receives, then adds,
//!   chunk `(r-i-2) mod W`, so after `W-1` steps it holds the full sum of its
//!   own chunk `r`; every element is summed in the same ring order on every
//!   run, so results are bit-for-bit repeatable;
//! - for all-gather sends chunk `(r-i) mod W` and receives chunk
//!   `(r-i-1) mod W`.
//!
//! # Handshake
//!
//! Each link is proven in four messages, ordered so that no rank waits on
//! a rank that waits on it around the ring:
//!
//! ```text
//! (a) connector -> acceptor   "HTRC" | epoch | rank | nonce Nc
//! (b) acceptor  -> connector  nonce Na | tag("ring-accept", epoch, acceptor, connector, Nc, Na)
//! (c) connector -> acceptor   tag("ring-connect", epoch, connector, acceptor, Na, Nc)
//! (d) the acceptor checks (c)
//! ```
//!
//! The tags are keyed under the job's secret (`hatrain_shared::auth`), so
//! each end proves to the other that it holds the secret, bound to the
//! epoch, both ranks and fresh nonces. A connection to our listener that
//! sends no valid hello or proof is closed and the next one accepted, until
//! the deadline; no tensor byte is read from it. Without a secret (a
//! trainer run by hand) the tags are zero and not checked.
//!
//! # Messages
//!
//! ```text
//!  0        4          12       16        24
//!  +--------+----------+--------+---------+-----------------+
//!  | "HTRC" | epoch u64| seq u32| len u64 | len bytes       |
//!  +--------+----------+--------+---------+-----------------+
//! ```
//! `seq` counts messages on the link, so a desynchronised peer is detected
//! instead of summing the wrong bytes.
//!
//! # Abort
//!
//! [`AbortHandle::abort`] (from any thread) shuts both sockets down; a call
//! blocked in `read` or `write` then returns [`CollectiveError::Aborted`].
//! This is how a rank stuck on a hung peer is released.

mod all_to_all;
mod handshake;

use crate::stop::Stop;
use handshake::{CANCEL_SLICE, HELLO, Link, RING_ACCEPT, RING_CONNECT, link_bytes, read_full};
use hatrain_shared::auth::{NONCE_LEN, Secret, TAG_LEN};
use hatrain_shared::rendezvous::ring_key;
use hatrain_shared::shard::shard_range;
use hatrain_shared::store::{RendezvousError, StoreClient};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

const MAGIC: [u8; 4] = *b"HTRC";
const MSG_HEADER: usize = 24;

#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("epoch {epoch}: rendezvous failed")]
    Rendezvous {
        epoch: u64,
        #[source]
        source: RendezvousError,
    },
    #[error("epoch {epoch}: cannot set up the ring listener")]
    Listen {
        epoch: u64,
        #[source]
        source: io::Error,
    },
    #[error("epoch {epoch}: cannot connect to rank {peer} at {addr:?}")]
    Connect {
        epoch: u64,
        peer: usize,
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("epoch {epoch}: rank {peer} did not connect within {waited:?}")]
    AcceptTimeout {
        epoch: u64,
        peer: usize,
        waited: Duration,
    },
    #[error("epoch {epoch}: bad handshake from the ring: {detail}")]
    Handshake { epoch: u64, detail: String },
    #[error("epoch {epoch}: {op} with rank {peer} failed")]
    Io {
        epoch: u64,
        op: &'static str,
        peer: usize,
        #[source]
        source: io::Error,
    },
    #[error("epoch {epoch}: protocol error from rank {peer}: {detail}")]
    Protocol {
        epoch: u64,
        peer: usize,
        detail: String,
    },
    #[error("epoch {epoch}: communicator aborted")]
    Aborted { epoch: u64 },
}

/// Releases a communicator from another thread.
#[derive(Debug, Clone)]
pub struct AbortHandle {
    streams: Arc<Vec<TcpStream>>,
    aborted: Arc<Stop>,
}

impl AbortHandle {
    /// Makes every current and later call on the communicator fail, and
    /// stops the rank's compute (see [`crate::stop`]).
    pub fn abort(&self) {
        self.aborted.set();
        for s in self.streams.iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl hatrain_worker::comm::Abort for AbortHandle {
    fn abort(&self) {
        AbortHandle::abort(self);
    }
}

impl hatrain_worker::comm::Communicator for Communicator {
    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn abort_handle(&self) -> std::sync::Arc<dyn hatrain_worker::comm::Abort> {
        std::sync::Arc::new(self.abort.clone())
    }
}

/// Chunk sent in ring step `step` of a reduce-scatter.
pub fn reduce_scatter_send(rank: usize, step: usize, world: usize) -> usize {
    (rank + 2 * world - step - 1) % world
}

/// Chunk received (and accumulated) in ring step `step` of a reduce-scatter.
pub fn reduce_scatter_recv(rank: usize, step: usize, world: usize) -> usize {
    (rank + 2 * world - step - 2) % world
}

/// Chunk sent in ring step `step` of an all-gather.
pub fn all_gather_send(rank: usize, step: usize, world: usize) -> usize {
    (rank + world - step) % world
}

/// Chunk received in ring step `step` of an all-gather.
pub fn all_gather_recv(rank: usize, step: usize, world: usize) -> usize {
    (rank + 2 * world - step - 1) % world
}

#[derive(Debug)]
struct Ring {
    /// To rank `r+1`.
    next: TcpStream,
    /// From rank `r-1`.
    prev: TcpStream,
    send_seq: u32,
    recv_seq: u32,
}

/// One rank's end of the ring for one epoch.
#[derive(Debug)]
pub struct Communicator {
    rank: usize,
    world: usize,
    epoch: u64,
    ring: Option<Ring>,
    aborted: Arc<Stop>,
    abort: AbortHandle,
    scratch: Vec<u8>,
}

impl Communicator {
    /// A communicator of one rank: every collective is the identity.
    pub fn single(epoch: u64) -> Self {
        let aborted = Arc::new(Stop::default());
        Self {
            rank: 0,
            world: 1,
            epoch,
            ring: None,
            abort: AbortHandle {
                streams: Arc::new(Vec::new()),
                aborted: Arc::clone(&aborted),
            },
            aborted,
            scratch: Vec::new(),
        }
    }

    /// Builds the ring for `epoch` through the store. With the job's
    /// secret both ends of each link prove they hold it (see "Handshake"
    /// in the module doc) before a tensor byte is exchanged.
    pub fn connect(
        store: &mut StoreClient,
        rank: usize,
        world: usize,
        epoch: u64,
        timeout: Duration,
        secret: Option<&Secret>,
        cancel: &dyn Fn() -> bool,
    ) -> Result<Self, CollectiveError> {
        assert!(rank < world, "rank {rank} outside world {world}");
        if world == 1 {
            return Ok(Self::single(epoch));
        }
        let deadline = Instant::now() + timeout;
        let listen_err = |source| CollectiveError::Listen { epoch, source };
        let ip = store.local_ip().map_err(listen_err)?;
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(listen_err)?;
        let my_addr = listener.local_addr().map_err(listen_err)?;
        let rdzv = |source| CollectiveError::Rendezvous { epoch, source };
        store
            .set(&ring_key(epoch, rank), &my_addr.to_string())
            .map_err(rdzv)?;

        let next_rank = (rank + 1) % world;
        let prev_rank = (rank + world - 1) % world;
        // Waited for in slices, so that a new directive (the agent giving up
        // on this epoch) cancels the build promptly.
        let next_addr = loop {
            if cancel() {
                return Err(CollectiveError::Aborted { epoch });
            }
            let slice = remaining(deadline).min(CANCEL_SLICE);
            match store.get(&ring_key(epoch, next_rank), slice) {
                Ok(a) => break a,
                Err(RendezvousError::Timeout { .. }) if !remaining(deadline).is_zero() => {}
                Err(e) => return Err(rdzv(e)),
            }
        };
        let connect_err = |source| CollectiveError::Connect {
            epoch,
            peer: next_rank,
            addr: next_addr.clone(),
            source,
        };
        let addr: SocketAddr = next_addr
            .parse()
            .map_err(|e| connect_err(io::Error::new(io::ErrorKind::InvalidData, format!("{e}"))))?;
        let nonce = || {
            hatrain_shared::auth::random::<NONCE_LEN>().map_err(|e| listen_err(io::Error::other(e)))
        };
        // (a) Connect to the next rank and say who we are.
        let mut next =
            TcpStream::connect_timeout(&addr, remaining(deadline).max(Duration::from_millis(1)))
                .map_err(connect_err)?;
        next.set_nodelay(true).map_err(connect_err)?;
        let nc = nonce()?;
        let mut hello = [0u8; HELLO];
        hello[0..4].copy_from_slice(&MAGIC);
        hello[4..12].copy_from_slice(&epoch.to_le_bytes());
        hello[12..20].copy_from_slice(&(rank as u64).to_le_bytes());
        hello[20..].copy_from_slice(&nc);
        next.write_all(&hello).map_err(connect_err)?;
        // (b) Accept the previous rank and answer its hello.
        let link = Link {
            epoch,
            rank,
            prev: prev_rank,
            secret,
            deadline,
            timeout,
            cancel,
        };
        let (mut prev, mut prev_nonce) = link.accept(&listener)?;
        let mut na = nonce()?;
        link.answer(&mut prev, &prev_nonce, &na)?;
        // (c) Check the next rank's answer, and prove ourselves to it.
        let mut answer = [0u8; NONCE_LEN + TAG_LEN];
        read_full(&mut next, &mut answer, deadline, cancel).map_err(|e| match e {
            None => CollectiveError::Aborted { epoch },
            Some(source) => CollectiveError::Io {
                epoch,
                op: "handshake",
                peer: next_rank,
                source,
            },
        })?;
        let (na_next, tag) = answer.split_at(NONCE_LEN);
        if let Some(k) = secret
            && !k.verify(
                RING_ACCEPT,
                &[&link_bytes(epoch, next_rank, rank, &nc, na_next)],
                tag,
            )
        {
            return Err(CollectiveError::Handshake {
                epoch,
                detail: format!(
                    "the listener of rank {next_rank} at {next_addr} does not hold the job's secret"
                ),
            });
        }
        let proof = match secret {
            Some(k) => *k
                .tag(
                    RING_CONNECT,
                    &[&link_bytes(epoch, rank, next_rank, na_next, &nc)],
                )
                .as_bytes(),
            None => [0u8; TAG_LEN],
        };
        next.write_all(&proof).map_err(connect_err)?;
        next.set_read_timeout(None).map_err(connect_err)?;
        // (d) Check the previous rank's proof; a stranger that got here is
        // closed and the next connection taken, until the deadline.
        loop {
            match link.proof(&mut prev, &prev_nonce, &na) {
                Ok(()) => break,
                Err(why) => {
                    eprintln!("rank {rank}: epoch {epoch}: closed a ring connection: {why}");
                    (prev, prev_nonce) = link.accept(&listener)?;
                    na = nonce()?;
                    link.answer(&mut prev, &prev_nonce, &na)?;
                }
            }
        }
        prev.set_nodelay(true).map_err(listen_err)?;
        let clones = [next.try_clone(), prev.try_clone()]
            .into_iter()
            .collect::<io::Result<Vec<_>>>()
            .map_err(listen_err)?;
        let aborted = Arc::new(Stop::default());
        Ok(Self {
            rank,
            world,
            epoch,
            ring: Some(Ring {
                next,
                prev,
                send_seq: 0,
                recv_seq: 0,
            }),
            abort: AbortHandle {
                streams: Arc::new(clones),
                aborted: Arc::clone(&aborted),
            },
            aborted,
            scratch: Vec::new(),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn abort_handle(&self) -> AbortHandle {
        self.abort.clone()
    }

    /// Set when the communicator is aborted: the compute between
    /// collectives stops on it.
    pub fn stop(&self) -> Arc<Stop> {
        Arc::clone(&self.aborted)
    }

    /// Sums `buf` across ranks; on return this rank's chunk
    /// (`shard_range(buf.len(), W, rank)`, also the return value) holds the
    /// sum. The other chunks hold partial sums and must not be used.
    pub fn reduce_scatter_sum(&mut self, buf: &mut [f32]) -> Result<Range<usize>, CollectiveError> {
        let (n, w, r) = (buf.len(), self.world, self.rank);
        for step in 0..w.saturating_sub(1) {
            let send = shard_range(n, w, reduce_scatter_send(r, step, w));
            let recv = shard_range(n, w, reduce_scatter_recv(r, step, w));
            self.exchange(bytemuck::cast_slice(&buf[send]), recv.len() * 4)?;
            for (acc, b) in buf[recv].iter_mut().zip(self.scratch.chunks_exact(4)) {
                *acc += f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Ok(shard_range(n, w, r))
    }

    /// Gathers every rank's chunk (`shard_range(buf.len(), W, rank)`) into
    /// all of `buf` on every rank.
    pub fn all_gather(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let (n, w, r) = (buf.len(), self.world, self.rank);
        for step in 0..w.saturating_sub(1) {
            let send = shard_range(n, w, all_gather_send(r, step, w));
            let recv = shard_range(n, w, all_gather_recv(r, step, w));
            self.exchange(bytemuck::cast_slice(&buf[send]), recv.len() * 4)?;
            let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut buf[recv]);
            dst.copy_from_slice(&self.scratch);
        }
        Ok(())
    }

    /// Gathers one `f64` from every rank, in rank order.
    pub fn all_gather_f64(&mut self, mine: f64) -> Result<Vec<f64>, CollectiveError> {
        let (w, r) = (self.world, self.rank);
        let mut all = vec![0f64; w];
        all[r] = mine;
        for step in 0..w.saturating_sub(1) {
            let send = all_gather_send(r, step, w);
            let recv = all_gather_recv(r, step, w);
            self.exchange(&all[send].to_le_bytes(), 8)?;
            all[recv] = f64::from_le_bytes(self.scratch[..8].try_into().expect("8 bytes"));
        }
        Ok(all)
    }

    /// Gathers every rank's bytes, of any length, in rank order.
    pub fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let lens = self.all_gather_f64(mine.len() as f64)?;
        let (w, r) = (self.world, self.rank);
        let mut all: Vec<Vec<u8>> = vec![Vec::new(); w];
        all[r] = mine.to_vec();
        for step in 0..w.saturating_sub(1) {
            let send = all_gather_send(r, step, w);
            let recv = all_gather_recv(r, step, w);
            let out = std::mem::take(&mut all[send]);
            let sent = self.exchange(&out, lens[recv] as usize);
            all[send] = out;
            sent?;
            all[recv] = std::mem::take(&mut self.scratch);
        }
        Ok(all)
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.all_gather_f64(0.0).map(drop)
    }

    /// Sends `out` to the next rank while receiving exactly `in_len` bytes
    /// from the previous one into `self.scratch`.
    fn exchange(&mut self, out: &[u8], in_len: usize) -> Result<(), CollectiveError> {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.resize(in_len, 0);
        let done = self.exchange_with(
            out.len() as u64,
            |s| s.write_all(out),
            in_len as u64,
            |r| Ok(r.read_exact(&mut scratch)?),
        );
        self.scratch = scratch;
        done
    }

    /// Sends the next rank one message of `out_len` bytes, which `write`
    /// writes, while receiving one of exactly `in_len` bytes from the
    /// previous rank, which `read` reads (it must read them all). The two
    /// directions run on two threads: with both ends writing a large
    /// message first and reading second, the ring would deadlock once the
    /// socket buffers fill.
    fn exchange_with<T>(
        &mut self,
        out_len: u64,
        write: impl FnOnce(&mut TcpStream) -> io::Result<()> + Send,
        in_len: u64,
        read: impl FnOnce(&mut io::Take<&mut TcpStream>) -> Result<T, MsgError>,
    ) -> Result<T, CollectiveError> {
        let epoch = self.epoch;
        if self.aborted.is_set() {
            return Err(CollectiveError::Aborted { epoch });
        }
        let (next_rank, prev_rank) = (
            (self.rank + 1) % self.world,
            (self.rank + self.world - 1) % self.world,
        );
        let streams = Arc::clone(&self.abort.streams);
        let ring = self
            .ring
            .as_mut()
            .expect("exchange needs a ring of 2 or more ranks");
        let (send_seq, recv_seq) = (ring.send_seq, ring.recv_seq);
        let Ring { next, prev, .. } = ring;
        let (sent, received) = thread::scope(|s| {
            let sender = s.spawn(move || -> Result<(), MsgError> {
                next.write_all(&header(epoch, send_seq, out_len))?;
                Ok(write(next)?)
            });
            let received = recv_msg(prev, epoch, recv_seq, in_len, read);
            // If the receive failed, the sender may be blocked on a peer that
            // is gone too; shutting our end releases it.
            if received.is_err() {
                let _ = streams[0].shutdown(Shutdown::Both);
            }
            let sent = sender.join().unwrap_or_else(|_| {
                Err(io::Error::other("collective send thread panicked").into())
            });
            (sent, received)
        });
        let aborted = self.aborted.is_set();
        let wrap = |e: MsgError, op: &'static str, peer: usize| {
            if aborted {
                return CollectiveError::Aborted { epoch };
            }
            match e {
                MsgError::Io(source) => CollectiveError::Io {
                    epoch,
                    op,
                    peer,
                    source,
                },
                MsgError::Protocol(detail) => CollectiveError::Protocol {
                    epoch,
                    peer,
                    detail,
                },
            }
        };
        let got = received.map_err(|e| wrap(e, "receive", prev_rank))?;
        sent.map_err(|e| wrap(e, "send", next_rank))?;
        ring.send_seq = ring.send_seq.wrapping_add(1);
        ring.recv_seq = ring.recv_seq.wrapping_add(1);
        Ok(got)
    }
}

#[derive(Debug)]
enum MsgError {
    Io(io::Error),
    Protocol(String),
}

impl From<io::Error> for MsgError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

/// A message's header: its epoch, its number on the link and its length.
fn header(epoch: u64, seq: u32, len: u64) -> [u8; MSG_HEADER] {
    let mut h = [0u8; MSG_HEADER];
    h[0..4].copy_from_slice(&MAGIC);
    h[4..12].copy_from_slice(&epoch.to_le_bytes());
    h[12..16].copy_from_slice(&seq.to_le_bytes());
    h[16..24].copy_from_slice(&len.to_le_bytes());
    h
}

/// `(epoch, seq, len)` of header `h`; `None` without the magic.
fn parse_header(h: &[u8; MSG_HEADER]) -> Option<(u64, u32, u64)> {
    if h[0..4] != MAGIC {
        return None;
    }
    let word = |r: std::ops::Range<usize>| {
        let mut b = [0u8; 8];
        b[..r.len()].copy_from_slice(&h[r]);
        u64::from_le_bytes(b)
    };
    Some((word(4..12), word(12..16) as u32, word(16..24)))
}

/// Reads message `seq` of `epoch`, which must be `len` bytes long, its
/// body through `read`, which must read all of it.
fn recv_msg<T>(
    s: &mut TcpStream,
    epoch: u64,
    seq: u32,
    len: u64,
    read: impl FnOnce(&mut io::Take<&mut TcpStream>) -> Result<T, MsgError>,
) -> Result<T, MsgError> {
    let mut h = [0u8; MSG_HEADER];
    s.read_exact(&mut h)?;
    let Some((their_epoch, their_seq, their_len)) = parse_header(&h) else {
        return Err(MsgError::Protocol(format!(
            "expected message {seq} of epoch {epoch}, got bytes that are not a ring message"
        )));
    };
    if their_epoch != epoch || their_seq != seq || their_len != len {
        return Err(MsgError::Protocol(format!(
            "expected message {seq} of epoch {epoch} with {len} bytes, got message {their_seq} of epoch {their_epoch} with {their_len} bytes"
        )));
    }
    let mut body = s.take(len);
    let got = read(&mut body)?;
    if body.limit() != 0 {
        return Err(MsgError::Protocol(format!(
            "message {seq} of epoch {epoch}: {} of its {len} bytes left unread",
            body.limit()
        )));
    }
    Ok(got)
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// Accepts one connection before `deadline`; `Err(None)` on timeout.
impl CollectiveError {
    /// The peer this rank could not reach, when the error names one.
    pub fn peer(&self) -> Option<usize> {
        match self {
            Self::Connect { peer, .. }
            | Self::AcceptTimeout { peer, .. }
            | Self::Io { peer, .. }
            | Self::Protocol { peer, .. } => Some(*peer),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests;
