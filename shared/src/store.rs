//! The rendezvous store (server and client): a tiny key-value store over TCP
//! that the ranks of one epoch meet in, in the role torchrun's TCPStore plays.
//!
//! The agent hosts the server (DESIGN.md section 6: never a rank, because any
//! rank may be the one that died). A trainer started by another launcher has
//! rank 0 host it in-process instead.
//!
//! # Who may speak to it
//!
//! With the job's [`Secret`] every frame in both directions is authenticated
//! ([`crate::auth::Session`]): the server opens each connection with a
//! hello carrying a fresh nonce, and a request that is forged, altered or
//! replayed is refused, counted in [`StoreStats`], and changes nothing; the
//! connection is closed. The client checks the server's answers the same
//! way, so a process of another user listening on a stale address cannot
//! pose as the store. Without a secret (a trainer run by hand) nothing is
//! authenticated.
//!
//! # Bounds
//!
//! The server runs on one thread of its own with an asynchronous runtime:
//! no thread per connection. At most [`MAX_UNAUTHENTICATED`] connections may
//! be waiting to send their first valid request; when one more arrives, the
//! oldest of them is closed (a job's rank sends its request within
//! milliseconds of connecting, so idle strangers are the ones that go; a
//! rank closed that way all the same connects again within its timeout). A
//! connection that has sent no valid request within [`AUTH_DEADLINE`] is
//! closed. Waits are bounded by the client's `wait_ms` and by [`MAX_WAIT`].

use crate::auth::{HELLO_LEN, Hello, NONCE_LEN, Role, Secret, Session, SessionError};
use crate::frame::{FrameError, HEADER_LEN};
use crate::rendezvous::{PROTOCOL, Request, Response};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::io::{self, Read};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, Semaphore, oneshot, watch};

/// The longest a single `get` may wait on the server.
pub const MAX_WAIT: Duration = Duration::from_secs(600);
/// Connections that have not yet sent a valid request, at most.
pub const MAX_UNAUTHENTICATED: usize = 64;
/// How long a connection has to send its first valid request.
pub const AUTH_DEADLINE: Duration = Duration::from_secs(5);
/// Authenticated connections, at most (a job's ranks and agents).
pub const MAX_CONNECTIONS: usize = 4096;
/// Connections in a row a client lets the store close before its first
/// answer, before it takes its secret for the wrong one.
pub const MAX_UNANSWERED: u32 = 8;

#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("cannot bind the rendezvous store on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("cannot reach the rendezvous store at {addr} within {waited:?}")]
    Connect {
        addr: SocketAddr,
        waited: Duration,
        #[source]
        source: io::Error,
    },
    #[error("rendezvous store at {addr}")]
    Frame {
        addr: SocketAddr,
        #[source]
        source: SessionError,
    },
    #[error(
        "the rendezvous store at {addr} authenticates and this process has no secret (run it under hatrain-agent, which sets HATRAIN_SECRET_FILE)"
    )]
    NeedSecret { addr: SocketAddr },
    #[error("the server at {addr} does not authenticate: it is not this job's rendezvous store")]
    NotOurs { addr: SocketAddr },
    #[error(
        "the rendezvous store at {addr} closed the connection before answering, {times} times: this process's secret is not the job's (HATRAIN_SECRET_FILE), or the store is overrun by connections"
    )]
    Unanswered { addr: SocketAddr, times: u32 },
    #[error("rendezvous store at {addr}: timed out after {waited:?} waiting for {key:?}")]
    Timeout {
        addr: SocketAddr,
        key: String,
        waited: Duration,
    },
    #[error("rendezvous store at {addr}: expected {expected}, got {got:?}")]
    Unexpected {
        addr: SocketAddr,
        expected: &'static str,
        got: Response,
    },
}

/// What the server has seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreStats {
    /// Requests answered.
    pub served: u64,
    /// Frames refused: a bad tag (forged, altered, replayed) or bad framing.
    pub refused: u64,
    /// Connections closed for sending no valid request in time.
    pub timed_out: u64,
    /// Connections closed because too many waited to authenticate (the
    /// oldest waiting ones), or because the server was full.
    pub over_limit: u64,
    /// Connections open now.
    pub open: u64,
}

#[derive(Debug, Default)]
struct Counters {
    served: AtomicU64,
    refused: AtomicU64,
    timed_out: AtomicU64,
    over_limit: AtomicU64,
    open: AtomicU64,
}

#[derive(Debug, Default)]
struct Table {
    values: HashMap<String, String>,
    counters: HashMap<String, i64>,
}

#[derive(Debug)]
struct Shared {
    table: Mutex<Table>,
    changed: Notify,
    counters: Counters,
    secret: Option<Secret>,
    /// Connections that have not sent a valid request yet, oldest first,
    /// each with the switch that closes it.
    pending: Mutex<VecDeque<(u64, oneshot::Sender<()>)>>,
    connections: Arc<Semaphore>,
}

impl Shared {
    /// Enters connection `id` among the pending ones, closing the oldest
    /// when they are too many.
    fn admit(&self, id: u64) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        while p.len() >= MAX_UNAUTHENTICATED {
            if let Some((_, evict)) = p.pop_front() {
                let _ = evict.send(());
                self.counters.over_limit.fetch_add(1, Ordering::Relaxed);
            }
        }
        p.push_back((id, tx));
        rx
    }

    /// Connection `id` authenticated, or ended: it is no longer pending.
    fn leave(&self, id: u64) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        p.retain(|(i, _)| *i != id);
    }
}

/// A running store. Dropping it stops it and wakes every waiter.
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    thread: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving; with a
    /// secret, only holders of it are answered.
    pub fn bind(addr: SocketAddr, secret: Option<Secret>) -> Result<Self, RendezvousError> {
        let bind = |source| RendezvousError::Bind { addr, source };
        let std_listener = std::net::TcpListener::bind(addr).map_err(bind)?;
        std_listener.set_nonblocking(true).map_err(bind)?;
        let local = std_listener.local_addr().map_err(bind)?;
        let shared = Arc::new(Shared {
            table: Mutex::default(),
            changed: Notify::new(),
            counters: Counters::default(),
            secret,
            pending: Mutex::default(),
            connections: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
        });
        let (stop, stopped) = watch::channel(false);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(bind)?;
        let thread = {
            let shared = Arc::clone(&shared);
            thread::Builder::new()
                .name("rdzv-store".into())
                .spawn(move || {
                    runtime.block_on(async move {
                        match tokio::net::TcpListener::from_std(std_listener) {
                            Ok(l) => accept_loop(l, shared, stopped).await,
                            Err(e) => tracing::error!(error = %e, "rendezvous store cannot listen"),
                        }
                    });
                })
                .map_err(bind)?
        };
        Ok(Self {
            addr: local,
            shared,
            stop,
            thread: Some(thread),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether requests must be authenticated.
    pub fn authenticates(&self) -> bool {
        self.shared.secret.is_some()
    }

    /// What the server has seen so far.
    pub fn stats(&self) -> StoreStats {
        let c = &self.shared.counters;
        StoreStats {
            served: c.served.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            timed_out: c.timed_out.load(Ordering::Relaxed),
            over_limit: c.over_limit.load(Ordering::Relaxed),
            open: c.open.load(Ordering::Relaxed),
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.shared.changed.notify_waiters();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut next_id = 0u64;
    loop {
        let conn = tokio::select! {
            _ = stopped.changed() => return,
            c = listener.accept() => c,
        };
        let Ok((stream, _)) = conn else {
            // Out of descriptors, say: back off a little, then go on.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let Ok(slot) = Arc::clone(&shared.connections).try_acquire_owned() else {
            shared.counters.over_limit.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        next_id += 1;
        let id = next_id;
        let evicted = shared.admit(id);
        let shared = Arc::clone(&shared);
        let mut stopped = stopped.clone();
        tokio::spawn(async move {
            shared.counters.open.fetch_add(1, Ordering::Relaxed);
            tokio::select! {
                _ = stopped.changed() => {}
                _ = serve(stream, &shared, id, evicted) => {}
            }
            shared.leave(id);
            shared.counters.open.fetch_sub(1, Ordering::Relaxed);
            drop(slot);
        });
    }
}

/// Reads one whole frame (header, payload, tag) of `trailer` tag bytes.
async fn read_wire(
    stream: &mut tokio::net::TcpStream,
    trailer: usize,
) -> Result<Vec<u8>, FrameError> {
    let io = |source| FrameError::Io {
        protocol: PROTOCOL.name,
        source,
    };
    let mut header = [0u8; HEADER_LEN];
    match stream.read_exact(&mut header).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(FrameError::Closed {
                protocol: PROTOCOL.name,
            });
        }
        Err(e) => return Err(io(e)),
    }
    let len = PROTOCOL.parse_header(&header)?;
    let mut wire = vec![0u8; HEADER_LEN + len + trailer];
    wire[..HEADER_LEN].copy_from_slice(&header);
    stream
        .read_exact(&mut wire[HEADER_LEN..])
        .await
        .map_err(io)?;
    Ok(wire)
}

async fn serve(
    mut stream: tokio::net::TcpStream,
    shared: &Shared,
    id: u64,
    mut evicted: oneshot::Receiver<()>,
) {
    let _ = stream.set_nodelay(true);
    let Ok(nonce) = crate::auth::random::<NONCE_LEN>() else {
        return;
    };
    let hello = Hello {
        auth: shared.secret.is_some(),
        nonce,
    };
    if stream.write_all(&hello.encode()).await.is_err() {
        return;
    }
    let mut session = Session::new(PROTOCOL, Role::Server, hello, shared.secret.clone());
    let trailer = session.trailer_len();
    let mut pending = true;
    let refuse = || {
        shared.counters.refused.fetch_add(1, Ordering::Relaxed);
    };
    loop {
        // Until its first valid request a connection has a deadline; after,
        // a client that sends nothing is only bounded by MAX_WAIT.
        let limit = if pending {
            AUTH_DEADLINE
        } else {
            MAX_WAIT + Duration::from_secs(60)
        };
        let read = tokio::time::timeout(limit, read_wire(&mut stream, trailer));
        let got = tokio::select! {
            r = read => r,
            _ = &mut evicted, if pending => return,
        };
        let wire = match got {
            Err(_) => {
                if pending {
                    shared.counters.timed_out.fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
            Ok(Err(FrameError::Closed { .. })) => return,
            Ok(Err(_)) => {
                // Bad framing leaves the stream out of sync: hang up.
                refuse();
                return;
            }
            Ok(Ok(w)) => w,
        };
        let request = match session.open(&wire) {
            Err(_) => {
                // Forged, altered or replayed: nothing is done, nothing is
                // answered, and the connection (which may not be the
                // job's) is closed.
                refuse();
                return;
            }
            Ok(payload) => PROTOCOL.parse_json::<Request>(payload),
        };
        if pending {
            pending = false;
            shared.leave(id);
        }
        let response = match request {
            Ok(req) => handle(req, shared).await,
            Err(e) => Response::Refused {
                message: format!("malformed request: {e}"),
            },
        };
        let Ok(bytes) = serde_json::to_vec(&response) else {
            return;
        };
        let Ok(frame) = session.seal(&bytes) else {
            return;
        };
        if stream.write_all(&frame).await.is_err() {
            return;
        }
        shared.counters.served.fetch_add(1, Ordering::Relaxed);
    }
}

async fn handle(req: Request, shared: &Shared) -> Response {
    match req {
        Request::Ping => Response::Done,
        Request::Set { key, value } => {
            shared
                .table
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values
                .insert(key, value);
            shared.changed.notify_waiters();
            Response::Done
        }
        Request::Add { key, delta } => {
            let value = {
                let mut t = shared.table.lock().unwrap_or_else(|p| p.into_inner());
                let c = t.counters.entry(key).or_insert(0);
                *c = c.saturating_add(delta);
                *c
            };
            shared.changed.notify_waiters();
            Response::Counter { value }
        }
        Request::Get { key, wait_ms } => {
            let deadline =
                tokio::time::Instant::now() + Duration::from_millis(wait_ms).min(MAX_WAIT);
            loop {
                // Registered before the look, so a set in between wakes it.
                let changed = shared.changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                if let Some(v) = shared
                    .table
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .values
                    .get(&key)
                {
                    return Response::Value { value: v.clone() };
                }
                if tokio::time::timeout_at(deadline, changed).await.is_err() {
                    return Response::Timeout { key };
                }
            }
        }
    }
}

/// A connection to a store.
#[derive(Debug)]
pub struct StoreClient {
    addr: SocketAddr,
    stream: TcpStream,
    session: Session,
}

impl StoreClient {
    /// Connects, retrying until `timeout` passes (the store may still be
    /// starting, or closing strangers), and checks the server's hello
    /// against `secret`.
    pub fn connect(
        addr: SocketAddr,
        timeout: Duration,
        secret: Option<Secret>,
    ) -> Result<Self, RendezvousError> {
        let start = Instant::now();
        let mut delay = Duration::from_millis(5);
        let mut unanswered = 0;
        loop {
            let source = match Self::try_connect(addr, timeout) {
                Ok((stream, hello)) => {
                    match (hello.auth, secret.is_some()) {
                        (true, false) => return Err(RendezvousError::NeedSecret { addr }),
                        (false, true) => return Err(RendezvousError::NotOurs { addr }),
                        _ => {}
                    }
                    let mut client = Self {
                        addr,
                        stream,
                        session: Session::new(PROTOCOL, Role::Client, hello, secret.clone()),
                    };
                    // Authenticated at once, so that the connection does not
                    // count as a stranger's while the caller gets ready.
                    match client.call(&Request::Ping) {
                        Ok(Response::Done) => return Ok(client),
                        Ok(got) => {
                            return Err(RendezvousError::Unexpected {
                                addr,
                                expected: "done",
                                got,
                            });
                        }
                        // Closed before the first request was answered: under
                        // a flood of strangers the store closes the oldest
                        // unauthenticated connections, and this one may have
                        // been among them; another try is due. The store
                        // also closes, without an answer, a request that
                        // fails authentication (the wrong secret): after
                        // MAX_UNANSWERED in a row, that is what it is taken
                        // for. A bad tag on the answer is not retried (not
                        // this job's store).
                        Err(RendezvousError::Frame {
                            source: SessionError::Frame(e),
                            ..
                        }) if matches!(e, FrameError::Closed { .. } | FrameError::Io { .. }) => {
                            unanswered += 1;
                            if unanswered >= MAX_UNANSWERED {
                                return Err(RendezvousError::Unanswered {
                                    addr,
                                    times: unanswered,
                                });
                            }
                            io::Error::new(io::ErrorKind::ConnectionReset, e)
                        }
                        Err(e) => return Err(e),
                    }
                }
                Err(source) => source,
            };
            if start.elapsed() >= timeout {
                return Err(RendezvousError::Connect {
                    addr,
                    waited: start.elapsed(),
                    source,
                });
            }
            thread::sleep(delay);
            delay = (delay * 2).min(Duration::from_millis(200));
        }
    }

    /// One connection attempt: connect and read the hello.
    fn try_connect(addr: SocketAddr, timeout: Duration) -> io::Result<(TcpStream, Hello)> {
        let mut stream = TcpStream::connect_timeout(&addr, timeout.max(Duration::from_millis(1)))?;
        let _ = stream.set_nodelay(true);
        let mut hello = [0u8; HELLO_LEN];
        stream.set_read_timeout(Some(
            timeout.clamp(Duration::from_secs(1), Duration::from_secs(10)),
        ))?;
        stream.read_exact(&mut hello)?;
        stream.set_read_timeout(None)?;
        let hello = Hello::decode(&hello).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidData, "not a rendezvous store's hello")
        })?;
        Ok((stream, hello))
    }
}

impl StoreClient {
    /// The address this host reaches the store from: the one to publish
    /// for peers on other hosts.
    pub fn local_ip(&self) -> io::Result<IpAddr> {
        self.stream.local_addr().map(|a| a.ip())
    }

    fn call(&mut self, req: &Request) -> Result<Response, RendezvousError> {
        let addr = self.addr;
        let err = |source| RendezvousError::Frame { addr, source };
        let payload = serde_json::to_vec(req).map_err(|source| {
            err(SessionError::Frame(FrameError::Decode {
                protocol: PROTOCOL.name,
                source,
            }))
        })?;
        self.session.send(&mut self.stream, &payload).map_err(err)?;
        let reply = self.session.recv(&mut self.stream).map_err(err)?;
        PROTOCOL
            .parse_json(&reply)
            .map_err(|e| err(SessionError::Frame(e)))
    }

    pub fn set(&mut self, key: &str, value: &str) -> Result<(), RendezvousError> {
        match self.call(&Request::Set {
            key: key.into(),
            value: value.into(),
        })? {
            Response::Done => Ok(()),
            got => Err(RendezvousError::Unexpected {
                addr: self.addr,
                expected: "done",
                got,
            }),
        }
    }

    /// Waits up to `wait` for `key` and returns its value.
    pub fn get(&mut self, key: &str, wait: Duration) -> Result<String, RendezvousError> {
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        match self.call(&Request::Get {
            key: key.into(),
            wait_ms,
        })? {
            Response::Value { value } => Ok(value),
            Response::Timeout { key } => Err(RendezvousError::Timeout {
                addr: self.addr,
                key,
                waited: wait,
            }),
            got => Err(RendezvousError::Unexpected {
                addr: self.addr,
                expected: "a value",
                got,
            }),
        }
    }

    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, RendezvousError> {
        match self.call(&Request::Add {
            key: key.into(),
            delta,
        })? {
            Response::Counter { value } => Ok(value),
            got => Err(RendezvousError::Unexpected {
                addr: self.addr,
                expected: "a counter",
                got,
            }),
        }
    }
}

#[cfg(test)]
mod tests;
