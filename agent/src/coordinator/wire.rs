//! The embedded coordinator's driver: heartbeats between the job's agents
//! over ZeroMQ, in authenticated frames ([`hatrain_shared::peer`]).
//!
//! One thread owns every socket: a ROUTER that takes the other agents'
//! heartbeats, and one DEALER per other agent that carries this agent's.
//! Each DEALER is watched by a socket monitor, so a connection that drops
//! (the peer's process died, its host went away) is reported to the
//! coordinator at once ([`Observed::Dropped`]) instead of after the host
//! timeout. Unlike the replica streams, this thread runs at normal
//! priority: a heartbeat that waits for an idle core would declare a busy
//! host lost.
//!
//! The same sessions carry the job's control messages (a host's reports to
//! the controller, the controller's orders to a host) as
//! [`Kind::Control`] frames: [`Membership::send`] queues one for a node
//! (kept, in order, while its session is not open), and the frames that
//! come in are handed over by [`Membership::take_inbox`]'s channel.

use super::etcd::{Etcd, EtcdConfig};
use super::{Coordinator, Embedded, EmbeddedConfig, Heartbeat, Observed, View};
use hatrain_shared::auth::{NONCE_LEN, Secret};
use hatrain_shared::peer::{Beat, Kind, Pending, Session};
use std::collections::HashMap;
use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Heartbeat period.
pub const BEAT: Duration = Duration::from_millis(500);
/// Sessions the ROUTER keeps at most (other agents, and strangers' tries).
const MAX_SESSIONS: usize = 256;
/// How long a hello waits for its welcome before another is sent; a
/// connection not made yet is tried this often.
const GREET: Duration = Duration::from_millis(100);
/// The largest frame the ROUTER takes (a control message, with room).
const MAX_FRAME: i64 = 1 << 20;
/// Control messages kept for one node while its session is not open; the
/// oldest go first beyond that (a node away that long is lost anyway).
const MAX_QUEUED: usize = 4096;

/// Tells apart the wake-up sockets of the memberships of one process.
static WAKE: AtomicU64 = AtomicU64::new(0);

/// Control messages that came in: the sending node, and the payload.
pub type Inbox = tokio::sync::mpsc::UnboundedReceiver<(u64, Vec<u8>)>;

#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    #[error("cannot listen for heartbeats on {addr}")]
    Listen {
        addr: String,
        #[source]
        source: zmq::Error,
    },
}

/// Which coordinator keeps membership and leadership.
#[derive(Debug, Clone)]
pub enum Backend {
    /// Agent to agent, over the heartbeats.
    Embedded(EmbeddedConfig),
    /// Leases and a leader key in etcd; the heartbeats still carry the
    /// control messages (and the newest term).
    Etcd(EtcdConfig),
}

impl Backend {
    fn node(&self) -> u64 {
        match self {
            Self::Embedded(c) => c.node,
            Self::Etcd(c) => c.node,
        }
    }

    fn start(self) -> Box<dyn Coordinator> {
        match self {
            Self::Embedded(c) => Box::new(Embedded::new(c)),
            Self::Etcd(c) => Box::new(Etcd::start(c)),
        }
    }
}

/// How the membership runs.
#[derive(Debug, Clone)]
pub struct MembershipConfig {
    pub secret: Secret,
    pub coordinator: Backend,
    pub bind: IpAddr,
}

/// Membership, as last seen by the driver's thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub view: View,
    /// Nodes heard at least once: a node never heard is starting, not
    /// lost.
    pub joined: Vec<u64>,
}

impl Seen {
    /// Nodes that joined and are not heard now.
    pub fn lost(&self) -> Vec<u64> {
        self.view
            .lost
            .iter()
            .copied()
            .filter(|n| self.joined.contains(n))
            .collect()
    }
}

/// The heartbeats of one agent.
pub struct Membership {
    endpoint: String,
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
    peers: Mutex<mpsc::Sender<(u64, String)>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Control messages for the driver's thread to send: the node, then
    /// the payload (an inproc socket, so that the thread wakes at once).
    outbox: Mutex<zmq::Socket>,
    inbox: Mutex<Option<Inbox>>,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

fn nonce() -> [u8; NONCE_LEN] {
    hatrain_shared::auth::random().unwrap_or_else(|_| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut b = [0u8; NONCE_LEN];
        b.copy_from_slice(&t.to_le_bytes());
        b
    })
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX - 1)
}

impl Membership {
    /// Listens on `cfg.bind` (a free port) and starts heartbeating the peers
    /// [`Membership::connect`] names.
    pub fn start(cfg: MembershipConfig) -> Result<Arc<Self>, MembershipError> {
        let addr = match cfg.bind {
            IpAddr::V4(a) => format!("tcp://{a}:*"),
            IpAddr::V6(a) => format!("tcp://[{a}]:*"),
        };
        let err = |source| MembershipError::Listen {
            addr: addr.clone(),
            source,
        };
        let ctx = zmq::Context::new();
        let router = ctx.socket(zmq::ROUTER).map_err(err)?;
        router.set_linger(0).map_err(err)?;
        router.set_ipv6(cfg.bind.is_ipv6()).map_err(err)?;
        router.set_maxmsgsize(MAX_FRAME).map_err(err)?;
        router.bind(&addr).map_err(err)?;
        let endpoint = router.get_last_endpoint().map_err(err)?.unwrap_or_default();
        let node = cfg.coordinator.node();
        let mut coordinator = cfg.coordinator.start();
        let start = Instant::now();
        let seen = Arc::new(Mutex::new(Seen {
            view: coordinator.view(Duration::ZERO),
            joined: vec![node],
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let wake_at = format!(
            "inproc://membership-wake-{}",
            WAKE.fetch_add(1, Ordering::Relaxed)
        );
        let wake = ctx.socket(zmq::PAIR).map_err(err)?;
        wake.set_rcvhwm(0).map_err(err)?;
        wake.bind(&wake_at).map_err(err)?;
        let outbox = ctx.socket(zmq::PAIR).map_err(err)?;
        outbox.set_sndhwm(0).map_err(err)?;
        outbox.set_linger(0).map_err(err)?;
        outbox.connect(&wake_at).map_err(err)?;
        let (in_tx, in_rx) = tokio::sync::mpsc::unbounded_channel();
        let driver = Driver {
            wake,
            early: HashMap::new(),
            inbox: in_tx,
            ctx,
            secret: cfg.secret,
            node,
            router,
            sessions: HashMap::new(),
            order: Vec::new(),
            peers: Vec::new(),
            coordinator,
            start,
            joined: vec![node],
        };
        let (s, st) = (Arc::clone(&seen), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("membership".into())
            .spawn(move || driver.run(rx, &st, &s))
            .expect("a thread starts");
        tracing::info!(endpoint = %endpoint, "heartbeats listening");
        Ok(Arc::new(Self {
            endpoint,
            stop,
            seen,
            peers: Mutex::new(tx),
            thread: Mutex::new(Some(thread)),
            outbox: Mutex::new(outbox),
            inbox: Mutex::new(Some(in_rx)),
        }))
    }

    /// Where this agent takes heartbeats.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Heartbeats node `node` at `endpoint` from now on.
    pub fn connect(&self, node: u64, endpoint: String) {
        let _ = self
            .peers
            .lock()
            .expect("not poisoned")
            .send((node, endpoint));
    }

    /// Sends `payload` to node `node` as a [`Kind::Control`] frame: at
    /// once when its session is open, else when it opens.
    pub fn send(&self, node: u64, payload: &[u8]) {
        let out = self.outbox.lock().expect("not poisoned");
        if let Err(e) = out.send_multipart([&node.to_le_bytes()[..], payload], 0) {
            tracing::error!(node, error = %e, "a control message could not be queued");
        }
    }

    /// The control messages that come in (once: the first caller takes
    /// them).
    pub fn take_inbox(&self) -> Option<Inbox> {
        self.inbox.lock().expect("not poisoned").take()
    }

    /// Membership as last seen.
    pub fn seen(&self) -> Seen {
        self.seen.lock().expect("not poisoned").clone()
    }

    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.lock().expect("not poisoned").take() {
            let _ = t.join();
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One outgoing heartbeat connection.
struct Peer {
    node: u64,
    sock: zmq::Socket,
    monitor: zmq::Socket,
    pending: Option<(Pending, Instant)>,
    session: Option<Session>,
    /// Control messages waiting for the session.
    queue: VecDeque<Vec<u8>>,
}

impl Peer {
    /// Sends a heartbeat if the session is open.
    fn beat(&mut self, beat: &Beat) {
        if let Some(s) = &mut self.session {
            let f = s.seal(Kind::Heartbeat, &[&beat.encode()]);
            if self.sock.send(f, zmq::DONTWAIT).is_err() {
                // Not connected: the frame's number is taken back and the
                // session starts again when it is.
                s.rewind();
                self.session = None;
            }
        }
    }

    /// Sends the waiting control messages while the session is open.
    fn flush(&mut self) {
        let Some(s) = &mut self.session else {
            return;
        };
        while let Some(payload) = self.queue.front() {
            let f = s.seal(Kind::Control, &[payload]);
            if self.sock.send(f, zmq::DONTWAIT).is_err() {
                s.rewind();
                self.session = None;
                return;
            }
            self.queue.pop_front();
        }
    }
}

struct Driver {
    wake: zmq::Socket,
    /// Control messages for nodes not connected yet.
    early: HashMap<u64, VecDeque<Vec<u8>>>,
    inbox: tokio::sync::mpsc::UnboundedSender<(u64, Vec<u8>)>,
    ctx: zmq::Context,
    secret: Secret,
    node: u64,
    router: zmq::Socket,
    sessions: HashMap<Vec<u8>, Session>,
    order: Vec<Vec<u8>>,
    peers: Vec<Peer>,
    coordinator: Box<dyn Coordinator>,
    start: Instant,
    joined: Vec<u64>,
}

impl Driver {
    fn now(&self) -> Duration {
        self.start.elapsed()
    }

    fn add_peer(&mut self, node: u64, endpoint: &str) -> Result<(), zmq::Error> {
        let sock = self.ctx.socket(zmq::DEALER)?;
        sock.set_linger(0)?;
        sock.set_immediate(true)?;
        sock.set_maxmsgsize(4096)?;
        let mon = format!("inproc://membership-{node}");
        sock.monitor(&mon, zmq::SocketEvent::DISCONNECTED as i32)?;
        let monitor = self.ctx.socket(zmq::PAIR)?;
        monitor.connect(&mon)?;
        sock.connect(endpoint)?;
        self.peers.push(Peer {
            node,
            sock,
            monitor,
            pending: None,
            session: None,
            queue: self.early.remove(&node).unwrap_or_default(),
        });
        Ok(())
    }

    fn run(mut self, peers: mpsc::Receiver<(u64, String)>, stop: &AtomicBool, seen: &Mutex<Seen>) {
        let mut next_beat = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            while let Ok((node, endpoint)) = peers.try_recv() {
                if let Err(e) = self.add_peer(node, &endpoint) {
                    tracing::error!(node, endpoint = %endpoint, error = %e, "cannot heartbeat a peer");
                }
            }
            if Instant::now() >= next_beat {
                next_beat = Instant::now() + BEAT;
                self.beat();
            }
            let greeting = self.peers.iter().any(|p| p.session.is_none());
            if greeting {
                self.greet();
            }
            let wait = next_beat
                .saturating_duration_since(Instant::now())
                .min(if greeting {
                    Duration::from_millis(10)
                } else {
                    Duration::from_millis(50)
                });
            let mut items: Vec<zmq::PollItem> = Vec::with_capacity(2 + 2 * self.peers.len());
            items.push(self.router.as_poll_item(zmq::POLLIN));
            items.push(self.wake.as_poll_item(zmq::POLLIN));
            for p in &self.peers {
                items.push(p.sock.as_poll_item(zmq::POLLIN));
                items.push(p.monitor.as_poll_item(zmq::POLLIN));
            }
            match zmq::poll(&mut items, wait.as_millis() as i64) {
                Ok(_) | Err(zmq::Error::EINTR) => {}
                Err(e) => {
                    tracing::error!(error = %e, "heartbeat poll failed");
                    break;
                }
            }
            let ready: Vec<bool> = items.iter().map(|i| i.is_readable()).collect();
            drop(items);
            if ready[0] {
                self.take_beats();
            }
            if ready[1] {
                self.take_outgoing();
            }
            for i in 0..self.peers.len() {
                if ready[2 + 2 * i] {
                    self.take_answers(i);
                }
                if ready[3 + 2 * i] {
                    self.take_monitor(i);
                }
            }
            let now = self.now();
            let view = self.coordinator.view(now);
            let mut s = seen.lock().expect("not poisoned");
            s.view = view;
            s.joined.clone_from(&self.joined);
        }
    }

    /// Control messages to send: queued for their node, and sent while its
    /// session is open.
    fn take_outgoing(&mut self) {
        while let Ok(parts) = self.wake.recv_multipart(zmq::DONTWAIT) {
            let [node, payload] = &parts[..] else {
                continue;
            };
            let Ok(node) = <[u8; 8]>::try_from(&node[..]).map(u64::from_le_bytes) else {
                continue;
            };
            // A node not connected yet gets its messages when it is.
            let queue = match self.peers.iter_mut().find(|p| p.node == node) {
                Some(p) => &mut p.queue,
                None => self.early.entry(node).or_default(),
            };
            if queue.len() >= MAX_QUEUED {
                queue.pop_front();
                tracing::warn!(
                    node,
                    "control messages queued too long for a node: the oldest dropped"
                );
            }
            queue.push_back(payload.clone());
        }
        for p in &mut self.peers {
            p.flush();
        }
    }

    /// Sends this agent's heartbeat on every open session, and a hello on
    /// every connection without one.
    fn beat(&mut self) {
        let beat = self.heartbeat();
        for p in &mut self.peers {
            p.beat(&beat);
        }
        self.greet();
    }

    /// This agent's heartbeat now.
    fn heartbeat(&mut self) -> Beat {
        let now = self.now();
        let hb = self.coordinator.heartbeat(now);
        Beat {
            stamp_ns: ns(hb.stamp),
            follows: hb.follows,
            echo_ns: hb.echo.map(ns),
            term: hb.term,
        }
    }

    /// Says hello on every connection without a session (again, after
    /// [`GREET`] without a welcome), so that a session opens as soon as its
    /// connection does: control messages wait for it.
    fn greet(&mut self) {
        for p in &mut self.peers {
            if p.session.is_some()
                || p.pending
                    .as_ref()
                    .is_some_and(|(_, at)| at.elapsed() < GREET)
            {
                continue;
            }
            let (pending, hello) = Pending::hello(self.secret.clone(), self.node, nonce());
            if p.sock.send(hello, zmq::DONTWAIT).is_ok() {
                p.pending = Some((pending, Instant::now()));
            }
        }
    }

    /// Heartbeats (and hellos) that came to the ROUTER.
    fn take_beats(&mut self) {
        let (mut id, mut wire) = (zmq::Message::new(), zmq::Message::new());
        while self.router.recv(&mut id, zmq::DONTWAIT).is_ok() {
            if !id.get_more() || self.router.recv(&mut wire, 0).is_err() || wire.get_more() {
                continue;
            }
            let now = self.now();
            match self.sessions.get_mut(&id[..]) {
                Some(s) => match s.open(&wire) {
                    Ok(f) if f.kind == Kind::Control => {
                        let _ = self.inbox.send((s.peer, f.payload.to_vec()));
                    }
                    Ok(f) if f.kind == Kind::Heartbeat => match Beat::parse(f.payload) {
                        Ok(b) => {
                            let from = s.peer;
                            if !self.joined.contains(&from) {
                                self.joined.push(from);
                                self.joined.sort_unstable();
                            }
                            self.coordinator.observe(
                                now,
                                Observed::Heartbeat(Heartbeat {
                                    from,
                                    stamp: Duration::from_nanos(b.stamp_ns),
                                    follows: b.follows,
                                    echo: b.echo_ns.map(Duration::from_nanos),
                                    term: b.term,
                                }),
                            );
                        }
                        Err(e) => tracing::debug!(error = %e, "heartbeat refused"),
                    },
                    Ok(f) => tracing::debug!(kind = ?f.kind, "not a heartbeat"),
                    Err(e) => {
                        // A peer that restarted says hello again on the
                        // same identity.
                        if self.accept(&id, &wire).is_err() {
                            tracing::debug!(error = %e, "heartbeat frame refused");
                        }
                    }
                },
                None => {
                    if let Err(e) = self.accept(&id, &wire) {
                        tracing::debug!(error = %e, "heartbeat hello refused");
                    }
                }
            }
        }
    }

    fn accept(&mut self, id: &[u8], wire: &[u8]) -> Result<(), hatrain_shared::peer::PeerError> {
        let (s, welcome) = Session::accept(self.secret.clone(), self.node, 0, wire, nonce(), 0)?;
        if self.order.len() >= MAX_SESSIONS {
            let old = self.order.remove(0);
            self.sessions.remove(&old);
        }
        self.order.retain(|o| o != id);
        self.order.push(id.to_vec());
        self.sessions.insert(id.to_vec(), s);
        let _ = self
            .router
            .send_multipart([id, &welcome[..]], zmq::DONTWAIT);
        Ok(())
    }

    /// Welcomes on a heartbeat connection.
    fn take_answers(&mut self, i: usize) {
        let beat = self.heartbeat();
        let p = &mut self.peers[i];
        while let Ok(wire) = p.sock.recv_bytes(zmq::DONTWAIT) {
            if let Some((pending, _)) = &p.pending {
                // A welcome to an earlier hello (answered late) is refused;
                // this hello's own may still come.
                match pending.welcomed(&wire) {
                    // A heartbeat first: the peer counts this agent as
                    // joined before any control message of it arrives.
                    Ok((s, _)) if s.peer == p.node => {
                        p.pending = None;
                        p.session = Some(s);
                        p.beat(&beat);
                        p.flush();
                    }
                    Ok((s, _)) => tracing::warn!(
                        expected = p.node,
                        answered = s.peer,
                        "another node answers at this node's heartbeat address"
                    ),
                    Err(e) => tracing::debug!(error = %e, "heartbeat welcome refused"),
                }
            }
        }
    }

    /// A dropped connection: the peer is lost at once.
    fn take_monitor(&mut self, i: usize) {
        let node = self.peers[i].node;
        let mut dropped = false;
        while let Ok(parts) = self.peers[i].monitor.recv_multipart(zmq::DONTWAIT) {
            let event = parts
                .first()
                .filter(|p| p.len() >= 2)
                .map(|p| u16::from_le_bytes([p[0], p[1]]));
            dropped |= event == Some(zmq::SocketEvent::DISCONNECTED as u16);
        }
        if dropped {
            tracing::warn!(node, "heartbeat connection dropped");
            self.peers[i].session = None;
            self.peers[i].pending = None;
            let now = self.now();
            self.coordinator.observe(now, Observed::Dropped { node });
        }
    }
}
