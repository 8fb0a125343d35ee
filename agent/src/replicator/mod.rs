//! Peer replicas: each agent streams the sealed snapshots of its ranks to
//! `--replicas R` other hosts over ZeroMQ, and holds theirs.
//!
//! ```text
//!  host k (sender)                               host t (holder)
//!  rank store ─ sealed slot ─► Outbox ─ DEALER ══ tcp ══► ROUTER ─► Inbox ─► replica_NNNNN.shm
//!                               ▲  credits, receipts  ◄══════════════┘
//! ```
//!
//! - [`outbox`]: what a stream sends next (newest first, credit-bounded),
//!   with no I/O; [`inbox`]: sessions and replica stores of the holder.
//! - This module is the thin driver: one thread per outgoing stream and one
//!   for the listening socket, each polling its socket with a short timeout
//!   and a stop flag. Nothing here runs on the training path: a worker's
//!   commit never waits for a stream, and a stream reads a sealed slot in
//!   place, checking after each chunk that the slot was not rewritten.
//!   Every thread of the replicator, ZeroMQ's included, uses only idle CPU
//!   time ([`lower_priority`]).
//! - Every frame is authenticated ([`hatrain_shared::peer`]); chunks are
//!   verified twice, by their tag on arrival and by the slot checksum when
//!   the holder seals.
//! - Placement ([`targets`]): host (k+1) mod N, then k+2, ..., never the
//!   host itself and never one with the same `--failure-domain` label.

pub mod inbox;
pub mod outbox;
mod ring;
mod stream;
use ring::{Ring, resolve};

use hatrain_shared::auth::{NONCE_LEN, Secret};
use hatrain_shared::control::{HeldReport, RankReplicaReport, ReplicaReport, StreamReport};
use hatrain_shared::peer;
use hatrain_shared::shm::{Kept, Store};
use hatrain_shared::statemap::StateMap;
use inbox::Inbox;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Bytes of snapshot data per chunk.
pub const CHUNK: usize = 1 << 20;
/// Chunks a holder lets each sender have in flight.
pub const WINDOW: u32 = 32;
/// How long a socket poll waits, so stop flags are seen.
const POLL: Duration = Duration::from_millis(20);
/// How often an idle stream looks for a newly sealed snapshot: a short
/// wait, so a replica starts within milliseconds of the seal (a look reads
/// two slot headers per rank).
const SCAN: Duration = Duration::from_millis(2);
/// A stream whose peer says nothing for this long while it waits for
/// credit opens a new session (the peer's agent may have restarted).
const SILENCE: Duration = Duration::from_secs(3);
/// How long a hello waits for its welcome before another is sent.
const HELLO_AGAIN: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum ReplicatorError {
    #[error("cannot listen for peer replicas on {addr}")]
    Listen {
        addr: String,
        #[source]
        source: zmq::Error,
    },
    #[error("cannot draw a nonce")]
    Random(#[source] hatrain_shared::auth::AuthError),
}

/// The hosts that hold node `node`'s replicas: (k+1) mod N, (k+2) mod N,
/// ..., skipping the node itself and any node with the same failure-domain
/// label (`domains[i]`, where given), `replicas` of them at most. Fewer
/// when fewer qualify.
pub fn targets(node: usize, domains: &[Option<String>], replicas: usize) -> Vec<usize> {
    let n = domains.len();
    let mine = domains.get(node).cloned().flatten();
    (1..n)
        .map(|i| (node + i) % n)
        .filter(|t| mine.is_none() || domains[*t] != mine)
        .take(replicas)
        .collect()
}

/// A rank whose snapshots a stream sends: its store, and the state map it
/// registered (JSON) when known.
type RankStore = (u64, Arc<Store>, Option<Arc<[u8]>>);

/// How the replicator runs.
#[derive(Debug, Clone)]
pub struct ReplicatorConfig {
    pub secret: Secret,
    /// This agent's node rank.
    pub node: u64,
    /// The address to listen on for peers.
    pub bind: IpAddr,
    /// The job folder, where replica stores go.
    pub dir: PathBuf,
    /// Slots per replica store.
    pub slots: usize,
    /// Ranks per node (rank r belongs to node r / ranks_per_node).
    pub ranks_per_node: usize,
    pub chunk: usize,
    pub window: u32,
}

#[derive(Debug, Default)]
struct StreamState {
    node: u64,
    endpoint: String,
    connected: bool,
    bytes_sent: u64,
    chunks_sent: u64,
    ranks: BTreeMap<u64, outbox::RankProgress>,
    cpu_ns: u64,
}

#[derive(Debug, Default)]
struct Shared {
    streams: Vec<StreamState>,
    held: Vec<inbox::Held>,
    rejected: inbox::Rejected,
    received_bytes: u64,
    receive_cpu_ns: u64,
    /// Replicas to give up (the inbox's thread removes them).
    release: Vec<u64>,
    /// The steps the job keeps for the replicas (the inbox's thread gives
    /// them to the replica stores), and those the stores kept when `held`
    /// was read.
    kept: Kept,
    held_kept: Kept,
}

/// The replicator of one agent: its listening socket, and its streams.
pub struct Replicator {
    cfg: ReplicatorConfig,
    ctx: zmq::Context,
    endpoint: String,
    stop: Arc<AtomicBool>,
    shared: Arc<Mutex<Shared>>,
    /// Nodes whose ranks this agent holds.
    sources: Arc<RwLock<HashSet<u64>>>,
    /// Ranks of a lost host this (standby) agent takes over: their
    /// replicas are taken from whichever host of the job holds them.
    adopted: Arc<RwLock<HashSet<u64>>>,
    /// Which host plays a lost node now (a standby that took its ranks).
    replaced: Arc<RwLock<HashMap<u64, u64>>>,
    ring: Mutex<Ring>,
    /// The local ranks' stores and maps, for streams started later.
    ranks: Mutex<Vec<RankStore>>,
    feeds: Mutex<Vec<mpsc::Sender<RankStore>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// The last report made, for when the figures are being updated.
    last_report: Mutex<Option<ReplicaReport>>,
}

impl std::fmt::Debug for Replicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replicator")
            .field("node", &self.cfg.node)
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

fn nonce() -> [u8; NONCE_LEN] {
    hatrain_shared::auth::random().unwrap_or_else(|_| {
        // The OS's random source failed once already at start-up for
        // anything to get here; a time-based nonce still differs per
        // session, which is what a nonce must do.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut b = [0u8; NONCE_LEN];
        b.copy_from_slice(&t.to_le_bytes());
        b
    })
}

impl Replicator {
    /// Listens for peers on `cfg.bind` (a free port) and starts taking
    /// replicas.
    pub fn listen(cfg: ReplicatorConfig) -> Result<Arc<Self>, ReplicatorError> {
        hatrain_shared::auth::random::<1>().map_err(ReplicatorError::Random)?;
        keep_c_heap();
        let addr = match cfg.bind {
            IpAddr::V4(a) => format!("tcp://{a}:*"),
            IpAddr::V6(a) => format!("tcp://[{a}]:*"),
        };
        let ipv6 = cfg.bind.is_ipv6();
        // ZeroMQ starts its I/O thread with the first socket, and a thread
        // inherits its creator's scheduling policy: so the first socket is
        // made on a thread of the lowest priority.
        let made = std::thread::Builder::new()
            .name("replica-start".into())
            .spawn(move || -> Result<_, ReplicatorError> {
                lower_priority();
                let ctx = zmq::Context::new();
                let listen_err = |source| ReplicatorError::Listen {
                    addr: addr.clone(),
                    source,
                };
                let sock = ctx.socket(zmq::ROUTER).map_err(listen_err)?;
                sock.set_linger(0).map_err(listen_err)?;
                if ipv6 {
                    sock.set_ipv6(true).map_err(listen_err)?;
                }
                // Frames of strangers are not let grow without bound.
                sock.set_maxmsgsize((peer::HEADER_LEN + peer::MAX_PAYLOAD + peer::TAG_LEN) as i64)
                    .map_err(listen_err)?;
                sock.bind(&addr).map_err(listen_err)?;
                let endpoint = sock
                    .get_last_endpoint()
                    .map_err(listen_err)?
                    .unwrap_or_default();
                Ok((ctx, sock, endpoint))
            })
            .expect("a thread starts")
            .join()
            .expect("making a socket does not panic");
        let (ctx, sock, endpoint) = made?;
        let r = Arc::new(Self {
            ctx,
            endpoint,
            stop: Arc::new(AtomicBool::new(false)),
            shared: Arc::new(Mutex::new(Shared::default())),
            sources: Arc::new(RwLock::new(HashSet::new())),
            adopted: Arc::new(RwLock::new(HashSet::new())),
            replaced: Arc::new(RwLock::new(HashMap::new())),
            ring: Mutex::new(Ring::default()),
            ranks: Mutex::new(Vec::new()),
            feeds: Mutex::new(Vec::new()),
            threads: Mutex::new(Vec::new()),
            last_report: Mutex::new(None),
            cfg,
        });
        let sources = Arc::clone(&r.sources);
        let adopted = Arc::clone(&r.adopted);
        let replaced = Arc::clone(&r.replaced);
        let per_node = r.cfg.ranks_per_node.max(1) as u64;
        let inbox = Inbox::new(
            r.cfg.secret.clone(),
            r.cfg.node,
            r.cfg.dir.clone(),
            r.cfg.slots,
            r.cfg.window,
            move |from, rank| {
                // A rank's snapshots come from the host that plays its
                // node now.
                let node = rank / per_node;
                (sources.read().is_ok_and(|s| s.contains(&node))
                    && replaced.read().is_ok_and(|m| resolve(&m, node) == from))
                    || adopted.read().is_ok_and(|a| a.contains(&rank))
            },
        );
        let (stop, shared) = (Arc::clone(&r.stop), Arc::clone(&r.shared));
        let t = std::thread::Builder::new()
            .name("replica-in".into())
            .spawn(move || {
                lower_priority();
                hold(sock, inbox, &stop, &shared)
            })
            .expect("a thread starts");
        r.threads.lock().expect("not poisoned").push(t);
        tracing::info!(endpoint = %r.endpoint, "taking peer replicas");
        Ok(r)
    }

    /// This agent's node rank.
    pub fn node(&self) -> u64 {
        self.cfg.node
    }

    /// Where this agent takes replicas (`tcp://ADDR:PORT`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// This agent holds the replicas of node `node`'s ranks.
    pub fn hold_for(&self, node: u64) {
        if let Ok(mut s) = self.sources.write() {
            s.insert(node);
        }
    }

    /// Takes the replicas of `rank` (of a lost host, which this agent
    /// takes over) from any host of the job.
    pub fn adopt_rank(&self, rank: u64) {
        if let Ok(mut a) = self.adopted.write() {
            a.insert(rank);
        }
    }

    /// Starts streaming this host's snapshots to node `node` at `endpoint`.
    pub fn stream_to(&self, node: u64, endpoint: String) {
        self.ring
            .lock()
            .expect("not poisoned")
            .streaming
            .insert(node);
        let (tx, rx) = mpsc::channel();
        for r in self.ranks.lock().expect("not poisoned").iter() {
            let _ = tx.send(r.clone());
        }
        self.feeds.lock().expect("not poisoned").push(tx);
        self.open_stream(node, endpoint, rx, stream::Carries::Own);
    }

    /// Streams `stores` (replicas this agent holds of a lost host's ranks)
    /// to node `node` at `endpoint`, the standby that takes those ranks,
    /// with the same frames, checks and priority as its own snapshots.
    pub fn hand_over(&self, node: u64, endpoint: String, stores: Vec<RankStore>) {
        let (tx, rx) = mpsc::channel();
        for s in stores {
            let _ = tx.send(s);
        }
        // The sender is dropped here: the stream ends once the standby
        // holds every rank it was given.
        self.open_stream(node, endpoint, rx, stream::Carries::HandOver);
    }

    fn open_stream(
        &self,
        node: u64,
        endpoint: String,
        rx: mpsc::Receiver<RankStore>,
        carries: stream::Carries,
    ) {
        let index = {
            let mut sh = self.shared.lock().expect("not poisoned");
            sh.streams.push(StreamState {
                node,
                endpoint: endpoint.clone(),
                ..StreamState::default()
            });
            sh.streams.len() - 1
        };
        let sock = match self.ctx.socket(zmq::DEALER) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(node, error = %e, "cannot make a socket for a replica stream");
                return;
            }
        };
        let cfg = self.cfg.clone();
        let (stop, shared) = (Arc::clone(&self.stop), Arc::clone(&self.shared));
        let t = std::thread::Builder::new()
            .name(format!("replica-out-{node}"))
            .spawn(move || {
                lower_priority();
                if let Err(e) =
                    stream::send(&cfg, sock, &endpoint, rx, carries, &stop, &shared, index)
                {
                    tracing::error!(node, endpoint = %endpoint, error = %e, "replica stream stopped");
                }
            })
            .expect("a thread starts");
        self.threads.lock().expect("not poisoned").push(t);
    }

    /// A local rank's snapshot store and state map (JSON): streamed from
    /// now on.
    pub fn add_rank(&self, rank: usize, store: Arc<Store>, map: Option<Arc<[u8]>>) {
        let entry: RankStore = (rank as u64, store, map);
        let mut ranks = self.ranks.lock().expect("not poisoned");
        ranks.retain(|(r, _, _)| *r != entry.0);
        ranks.push(entry.clone());
        for f in self.feeds.lock().expect("not poisoned").iter() {
            let _ = f.send(entry.clone());
        }
    }

    /// The replica this agent holds of remote rank `rank` with the state
    /// map its sender sent: what a checkpoint of the rank is written from
    /// once its host is gone. `None` when it holds no replica of the rank,
    /// or not its map.
    pub fn replica(&self, rank: usize) -> Option<(Arc<Store>, Arc<StateMap>)> {
        let path = inbox::replica_path(&self.cfg.dir, rank as u64);
        let map = {
            let sh = self.shared.lock().expect("not poisoned");
            sh.held
                .iter()
                .find(|h| h.rank == rank as u64)
                .and_then(|h| h.map.clone())?
        };
        let store = Store::open(&path).ok()?;
        Some((Arc::new(store), map))
    }

    /// Gives up the replica of `rank`, a rank this (standby) agent took and
    /// filled from it: its store is removed, and no more of it is taken.
    pub fn release(&self, rank: usize) {
        if let Ok(mut a) = self.adopted.write() {
            a.remove(&(rank as u64));
        }
        // The name goes now; the memory once the inbox's thread lets go of
        // its mapping.
        let path = inbox::replica_path(&self.cfg.dir, rank as u64);
        match std::fs::remove_file(&path) {
            Ok(()) => {
                tracing::info!(rank, path = %path.display(), "replica store removed: this host holds the rank itself")
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove a replica store")
            }
        }
        self.shared
            .lock()
            .expect("not poisoned")
            .release
            .push(rank as u64);
    }

    /// The steps the job keeps for the replicas: the replica stores held
    /// here keep them (within the inbox's next turn).
    pub fn set_kept(&self, kept: Kept) {
        self.shared.lock().expect("not poisoned").kept = kept;
    }

    /// The sealed steps of each replica held here, with their epochs, by
    /// rank; none until the replica stores keep the steps the job keeps
    /// now (a step seen before could be rewritten before they did).
    pub fn replica_steps(&self) -> Vec<(usize, Vec<(u64, u64)>)> {
        let sh = self.shared.lock().expect("not poisoned");
        let current = sh.held_kept == sh.kept;
        sh.held
            .iter()
            .map(|h| {
                let sealed = h.steps.iter().copied().zip(h.epochs.iter().copied());
                (h.rank as usize, sealed.filter(|_| current).collect())
            })
            .collect()
    }

    /// The state map (JSON) each replica held came with, by rank.
    pub fn replica_maps(&self) -> HashMap<u64, Arc<[u8]>> {
        let sh = self.shared.lock().expect("not poisoned");
        sh.held
            .iter()
            .filter_map(|h| {
                let json = serde_json::to_vec(h.map.as_deref()?).ok()?;
                Some((h.rank, Arc::from(json)))
            })
            .collect()
    }

    /// What this agent streams and holds, now; the last report again if a
    /// replica thread holds the figures at this instant (the caller never
    /// waits for one: see [`lower_priority`]).
    pub fn report(&self) -> ReplicaReport {
        let mut last = self.last_report.lock().expect("not poisoned");
        match self.shared.try_lock() {
            Ok(sh) => {
                let r = self.report_of(&sh);
                *last = Some(r.clone());
                r
            }
            Err(_) => last.clone().unwrap_or_else(|| ReplicaReport {
                listen: self.endpoint.clone(),
                streams: Vec::new(),
                held: Vec::new(),
                rejected_malformed: 0,
                rejected_forged: 0,
                rejected_replayed: 0,
                received_bytes: 0,
                receive_cpu_s: 0.0,
                kept: Kept::default(),
            }),
        }
    }

    fn report_of(&self, sh: &Shared) -> ReplicaReport {
        ReplicaReport {
            listen: self.endpoint.clone(),
            streams: sh
                .streams
                .iter()
                .map(|s| StreamReport {
                    node: s.node,
                    endpoint: s.endpoint.clone(),
                    connected: s.connected,
                    bytes_sent: s.bytes_sent,
                    chunks_sent: s.chunks_sent,
                    cpu_s: s.cpu_ns as f64 / 1e9,
                    ranks: s
                        .ranks
                        .iter()
                        .map(|(rank, p)| RankReplicaReport {
                            rank: *rank,
                            local_step: p.local_step,
                            replica_step: p.stored_step,
                            // None while the peer holds no snapshot yet.
                            lag_steps: p
                                .local_step
                                .zip(p.stored_step)
                                .map(|(l, s)| l.saturating_sub(s)),
                            lag_bytes: p.lag_bytes,
                            abandoned: p.abandoned,
                            at_risk: p.at_risk,
                        })
                        .collect(),
                })
                .collect(),
            held: sh
                .held
                .iter()
                .map(|h| HeldReport {
                    rank: h.rank,
                    from_node: h.from,
                    steps: h.steps.clone(),
                    stored: h.stored,
                    dropped: h.dropped,
                    path: h.path.clone(),
                })
                .collect(),
            rejected_malformed: sh.rejected.malformed,
            rejected_forged: sh.rejected.forged,
            rejected_replayed: sh.rejected.replayed,
            received_bytes: sh.received_bytes,
            receive_cpu_s: sh.receive_cpu_ns as f64 / 1e9,
            kept: sh.kept,
        }
    }

    /// Whether [`Replicator::stop`] was called.
    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Stops every stream and removes the replica stores.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        let threads = std::mem::take(&mut *self.threads.lock().expect("not poisoned"));
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for Replicator {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Makes the calling thread use only CPU time nothing else wants
/// (`SCHED_IDLE`, sched(7)): a replica stream takes the cores training
/// leaves idle (while ranks wait in collectives, or on hosts whose cores
/// feed accelerators) and never competes with a step for a busy one. When
/// it falls behind, newer snapshots replace older ones ([`outbox`]), and
/// `agentctl status` shows the lag. Where the policy is refused, nice 19.
///
/// INVARIANT: such a thread may be left without CPU for a while, so the
/// agent's event loop never waits on a lock one of them holds
/// ([`Replicator::report`] does not wait).
fn lower_priority() {
    let tid = nix::unistd::gettid().as_raw();
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: plain system calls with integer arguments and a pointer to a
    // live sched_param. On Linux the policy and the nice value are per
    // thread: a thread id as `pid` changes that thread alone
    // (sched_setscheduler(2); setpriority(2), NOTES).
    let idle = unsafe { libc::sched_setscheduler(tid, libc::SCHED_IDLE, &param) } == 0;
    if !idle {
        // SAFETY: as above.
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19) };
        if rc != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "replica thread keeps its priority");
        }
    }
}

/// Makes the C allocator keep the memory it is given back. ZeroMQ
/// allocates every message it receives there (`malloc`), a 1 MiB chunk at a
/// time; with glibc's defaults each was a fresh mapping, or heap the
/// allocator had just returned to the kernel, so each chunk first faulted
/// in and zeroed 256 new pages (about 5% of the replica bench's samples,
/// on ZeroMQ's I/O threads). With
/// a fixed mapping threshold above the largest frame and a trim threshold
/// above what a stream's credit keeps in flight, freed chunks are reused.
/// Process-wide and once; the agent's own allocations are mimalloc's.
fn keep_c_heap() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: mallopt(3) takes two integers and changes only the
        // allocator's thresholds; it is safe to call at any time.
        let ok = unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 16 << 20) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20) == 1
        };
        if !ok {
            tracing::debug!("the C allocator keeps its default thresholds");
        }
    });
}

/// The holder's loop: every message through the inbox, answers back.
fn hold(sock: zmq::Socket, mut inbox: Inbox, stop: &AtomicBool, shared: &Mutex<Shared>) {
    let mut published = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        match poll(&sock, zmq::POLLIN, POLL) {
            Ok(n) if n > 0 => {}
            Ok(_) => {
                publish(&mut inbox, shared, &mut published, true);
                continue;
            }
            Err(e) => {
                tracing::error!(error = %e, "replica socket failed");
                break;
            }
        }
        // Drain what is there, answering each message. Messages are read
        // into ZeroMQ's own buffers, not copied out.
        let (mut id, mut wire) = (zmq::Message::new(), zmq::Message::new());
        loop {
            match sock.recv(&mut id, zmq::DONTWAIT) {
                Ok(()) => {}
                Err(zmq::Error::EAGAIN | zmq::Error::EINTR) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "replica receive failed");
                    break;
                }
            }
            // A ROUTER message is the identity, then the frame.
            if !id.get_more() || recv_rest(&sock, &mut wire).is_err() {
                inbox.rejected.malformed += 1;
                continue;
            }
            if wire.get_more() {
                // More parts than a message of the protocol has.
                let mut rest = zmq::Message::new();
                while recv_rest(&sock, &mut rest).is_ok() && rest.get_more() {}
                inbox.rejected.malformed += 1;
                continue;
            }
            for out in inbox.handle(&id, &wire, nonce) {
                // A lost credit would shrink the sender's window for
                // good: an interrupted send is sent again.
                let sent = loop {
                    match sock.send_multipart([&id[..], &out[..]], zmq::DONTWAIT) {
                        Err(zmq::Error::EINTR) => continue,
                        r => break r,
                    }
                };
                if let Err(e) = sent {
                    tracing::debug!(error = %e, "replica answer not sent");
                }
            }
        }
        publish(&mut inbox, shared, &mut published, false);
    }
    inbox.close();
    if let Ok(mut sh) = shared.lock() {
        sh.held.clear();
    }
}

fn publish(inbox: &mut Inbox, shared: &Mutex<Shared>, last: &mut Instant, force: bool) {
    if !force && last.elapsed() < Duration::from_millis(50) {
        return;
    }
    *last = Instant::now();
    if let Ok(mut sh) = shared.lock() {
        for rank in std::mem::take(&mut sh.release) {
            inbox.release(rank);
        }
        inbox.set_kept(sh.kept);
        sh.held_kept = sh.kept;
        sh.held = inbox.held();
        sh.rejected = inbox.rejected;
        sh.received_bytes = inbox.received_bytes;
        // The thread's CPU time since it began (it only holds).
        sh.receive_cpu_ns = hatrain_shared::thread_cpu_ns();
    }
}

/// Polls `sock` for `events` up to `wait`. A signal that interrupts the
/// wait (the agent takes SIGCHLD on any thread) is no event, not an
/// error.
fn poll(sock: &zmq::Socket, events: zmq::PollEvents, wait: Duration) -> Result<i32, zmq::Error> {
    match sock.poll(events, wait.as_millis() as i64) {
        Err(zmq::Error::EINTR) => Ok(0),
        r => r,
    }
}

/// Receives the next part of a message that has begun (it is there
/// already: ZeroMQ delivers a message's parts together), again when a
/// signal interrupts.
fn recv_rest(sock: &zmq::Socket, msg: &mut zmq::Message) -> Result<(), zmq::Error> {
    loop {
        match sock.recv(msg, 0) {
            Err(zmq::Error::EINTR) => continue,
            r => return r,
        }
    }
}

#[cfg(test)]
mod tests;
