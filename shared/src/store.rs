//! The rendezvous store (server and client): a tiny key-value store over TCP
//! that the ranks of one epoch meet in, in the role torchrun's TCPStore plays.
//!
//! The agent hosts the server (DESIGN.md section 6: never a rank, because any
//! rank may be the one that died). A trainer started by another launcher has
//! rank 0 host it in-process instead.
//!
//! The server is plain blocking code: one thread accepts, one thread serves
//! each connection. Waits are bounded by the client's `wait_ms` and by
//! [`MAX_WAIT`], so no request parks a thread forever.

use crate::frame::FrameError;
use crate::rendezvous::{PROTOCOL, Request, Response};
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// The longest a single `get` may wait on the server.
pub const MAX_WAIT: Duration = Duration::from_secs(600);

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
        source: FrameError,
    },
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

#[derive(Debug, Default)]
struct Table {
    values: HashMap<String, String>,
    counters: HashMap<String, i64>,
}

#[derive(Debug, Default)]
struct Shared {
    table: Mutex<Table>,
    changed: Condvar,
    stop: AtomicBool,
}

/// A running store. Dropping it stops accepting and wakes every waiter.
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving.
    pub fn bind(addr: SocketAddr) -> Result<Self, RendezvousError> {
        let listener =
            TcpListener::bind(addr).map_err(|source| RendezvousError::Bind { addr, source })?;
        let local = listener
            .local_addr()
            .map_err(|source| RendezvousError::Bind { addr, source })?;
        let shared = Arc::new(Shared::default());
        let acceptor = {
            let shared = Arc::clone(&shared);
            thread::Builder::new()
                .name("rdzv-accept".into())
                .spawn(move || accept_loop(listener, shared))
                .map_err(|source| RendezvousError::Bind { addr, source })?
        };
        Ok(Self {
            addr: local,
            shared,
            acceptor: Some(acceptor),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        // The acceptor blocks in accept(); one connection wakes it to see the
        // stop flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = conn else { continue };
        let shared = Arc::clone(&shared);
        // Connection threads are detached: each ends when its client hangs up
        // or when the store stops.
        let _ = thread::Builder::new()
            .name("rdzv-conn".into())
            .spawn(move || serve(stream, &shared));
    }
}

fn serve(mut stream: TcpStream, shared: &Shared) {
    let _ = stream.set_nodelay(true);
    // A client that sends nothing for this long is gone; its thread ends.
    let _ = stream.set_read_timeout(Some(MAX_WAIT + Duration::from_secs(60)));
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let response = match PROTOCOL.recv_json::<_, Request>(&mut stream) {
            Ok(req) => handle(req, shared),
            Err(FrameError::Decode { source, .. }) => Response::Refused {
                message: format!("malformed request: {source}"),
            },
            // Bad framing leaves the stream out of sync: answer once, hang up.
            Err(
                e @ (FrameError::TooLarge { .. }
                | FrameError::BadMagic { .. }
                | FrameError::Version { .. }),
            ) => {
                let _ = PROTOCOL.send_json(
                    &mut stream,
                    &Response::Refused {
                        message: e.to_string(),
                    },
                );
                let _ = stream.shutdown(Shutdown::Both);
                return;
            }
            Err(_) => return,
        };
        if PROTOCOL.send_json(&mut stream, &response).is_err() {
            return;
        }
    }
}

fn handle(req: Request, shared: &Shared) -> Response {
    let mut table = shared.table.lock().unwrap_or_else(|p| p.into_inner());
    match req {
        Request::Set { key, value } => {
            table.values.insert(key, value);
            shared.changed.notify_all();
            Response::Done
        }
        Request::Add { key, delta } => {
            let c = table.counters.entry(key).or_insert(0);
            *c = c.saturating_add(delta);
            let value = *c;
            shared.changed.notify_all();
            Response::Counter { value }
        }
        Request::Get { key, wait_ms } => {
            let deadline = Instant::now() + Duration::from_millis(wait_ms).min(MAX_WAIT);
            loop {
                if let Some(v) = table.values.get(&key) {
                    return Response::Value { value: v.clone() };
                }
                let now = Instant::now();
                if now >= deadline || shared.stop.load(Ordering::SeqCst) {
                    return Response::Timeout { key };
                }
                table = shared
                    .changed
                    .wait_timeout(table, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
    }
}

/// A connection to a store.
#[derive(Debug)]
pub struct StoreClient {
    addr: SocketAddr,
    stream: TcpStream,
}

impl StoreClient {
    /// Connects, retrying until `timeout` passes: the store may still be
    /// starting.
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<Self, RendezvousError> {
        let start = Instant::now();
        let mut delay = Duration::from_millis(5);
        loop {
            match TcpStream::connect_timeout(&addr, timeout.max(Duration::from_millis(1))) {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    return Ok(Self { addr, stream });
                }
                Err(source) if start.elapsed() >= timeout => {
                    return Err(RendezvousError::Connect {
                        addr,
                        waited: start.elapsed(),
                        source,
                    });
                }
                Err(_) => {
                    thread::sleep(delay);
                    delay = (delay * 2).min(Duration::from_millis(200));
                }
            }
        }
    }

    /// The address this host reaches the store from: the one to publish
    /// for peers on other hosts.
    pub fn local_ip(&self) -> io::Result<IpAddr> {
        self.stream.local_addr().map(|a| a.ip())
    }

    fn call(&mut self, req: &Request) -> Result<Response, RendezvousError> {
        let addr = self.addr;
        let frame = |source| RendezvousError::Frame { addr, source };
        PROTOCOL.send_json(&mut self.stream, req).map_err(frame)?;
        PROTOCOL.recv_json(&mut self.stream).map_err(frame)
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
mod tests {
    use super::*;
    use std::io::Write;

    fn local() -> SocketAddr {
        "127.0.0.1:0".parse().unwrap()
    }

    #[test]
    fn set_get_add_and_wait() {
        let server = StoreServer::bind(local()).unwrap();
        let addr = server.local_addr();
        let waiter = thread::spawn(move || {
            let mut c = StoreClient::connect(addr, Duration::from_secs(5)).unwrap();
            c.get("k", Duration::from_secs(10)).unwrap()
        });
        let mut c = StoreClient::connect(addr, Duration::from_secs(5)).unwrap();
        assert_eq!(c.add("n", 2).unwrap(), 2);
        assert_eq!(c.add("n", 3).unwrap(), 5);
        thread::sleep(Duration::from_millis(20));
        c.set("k", "v").unwrap();
        assert_eq!(waiter.join().unwrap(), "v");
        let e = c.get("absent", Duration::from_millis(10)).unwrap_err();
        assert!(e.to_string().contains("absent"), "{e}");
    }

    #[test]
    fn garbage_gets_an_error_reply_and_the_store_survives() {
        let server = StoreServer::bind(local()).unwrap();
        let addr = server.local_addr();
        let mut raw = TcpStream::connect(addr).unwrap();
        raw.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let reply: Response = PROTOCOL.recv_json(&mut raw).unwrap();
        assert!(
            matches!(reply, Response::Refused { ref message } if message.contains("exceeds the limit")),
            "{reply:?}"
        );
        // A well-framed but malformed request is answered and the connection kept.
        let mut raw = TcpStream::connect(addr).unwrap();
        PROTOCOL.write_frame(&mut raw, b"{\"nope\":1}").unwrap();
        let reply: Response = PROTOCOL.recv_json(&mut raw).unwrap();
        assert!(matches!(reply, Response::Refused { .. }));
        let mut c = StoreClient::connect(addr, Duration::from_secs(5)).unwrap();
        c.set("still", "up").unwrap();
        assert_eq!(c.get("still", Duration::ZERO).unwrap(), "up");
    }
}
