//! The etcd coordinator: membership by lease, leadership by a lease-bound
//! key created with a compare-and-swap, for clusters that already run etcd
//! and should not rest "who leads, who is alive" on this project's own
//! consensus.
//!
//! Under the job's prefix (`/hatrain/<job>/`):
//!
//! - `members/<node>`: each agent's key (its node, whether it is a standby,
//!   its failure domain), bound to its lease. The lease's TTL is the host
//!   timeout and the agent keeps it alive three times per TTL; a host is
//!   lost when its key goes (its lease expired, or it was revoked on a
//!   clean leave).
//! - `leader`: the controller's node, bound to its lease, created only
//!   where it does not exist (`create_revision == 0`). Its create revision
//!   is the controller's **term**: the fencing epoch its orders carry. An
//!   agent refuses orders of a term older than the newest it has seen (in
//!   etcd, or in a heartbeat), so a controller that lost its lease without
//!   noticing (paused, cut off) cannot act.
//!
//! Who campaigns: node 0 at the start (the job starts with its
//! controller); after that, when the key is gone, the live members in node
//! order, [`STAGGER`] apart, so that the lowest live node takes over as
//! with the embedded coordinator.
//!
//! What each reads: the controller (and everyone while the key is vacant)
//! reads the members' keys (keys only) every [`POLL`]; a follower watches
//! the leader key and reads nothing while it stands, so the load on etcd
//! grows with the hosts, not with their square. A follower reports no loss
//! but its controller's: the controller decides on the others.
//!
//! An agent acts only while its own lease is valid by its clock: the last
//! keep-alive's answer plus the TTL, counted from when it was sent. While
//! etcd cannot be reached, nothing new is known: nobody is declared lost by
//! lease and nobody acts once its lease has run out, so training goes on
//! while no fault happens. A host whose heartbeats stop meanwhile is
//! reported lost (from the heartbeats), for the controller to hold back
//! until etcd answers again or `--coordinator-timeout` passes.
//!
//! Snapshot bytes and replica streams never go through etcd.

use super::{Coordinator, Heartbeat, Observed, View};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp, WatchOptions,
};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Between two live members' tries at an empty leader key.
pub const STAGGER: Duration = Duration::from_millis(300);
/// How often the members and the leader are read.
const POLL: Duration = Duration::from_millis(200);
/// One request's limit.
const REQUEST: Duration = Duration::from_secs(1);
/// A follower reads the leader key again this often, should its watch
/// have missed a change.
const REREAD: Duration = Duration::from_secs(5);

/// Where etcd is and what this agent puts there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `host:port` of each member.
    pub endpoints: Vec<String>,
    /// The job's prefix, ending in `/`.
    pub prefix: String,
    /// Agents in the job (node ranks `0..nodes`).
    pub nodes: u64,
    pub node: u64,
    /// The lease's TTL: the host timeout (whole seconds, at least 2: etcd
    /// grants no shorter lease).
    pub ttl: Duration,
    /// This agent's membership record (JSON).
    pub about: String,
}

impl EtcdConfig {
    /// The TTL etcd is asked for, in seconds.
    pub fn ttl_secs(&self) -> i64 {
        (self.ttl.as_secs_f64().ceil() as i64).max(2)
    }

    fn member_key(&self, node: u64) -> String {
        format!("{}members/{node}", self.prefix)
    }

    fn leader_key(&self) -> String {
        format!("{}leader", self.prefix)
    }
}

/// What went wrong with etcd: a `--coordinator` URL that does not parse,
/// or a request that failed or was not answered in time.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("coordinator {url:?}: expected etcd://HOST:PORT[,HOST:PORT...]")]
    NotEtcd { url: String },
    #[error("coordinator {url:?}: member {member:?} is not HOST:PORT")]
    Member { url: String, member: String },
    #[error(transparent)]
    Request(#[from] etcd_client::Error),
    #[error("no answer in {} s", REQUEST.as_secs_f64())]
    Timeout,
    #[error("the lease keep-alive stream ended")]
    StreamEnded,
}

/// gRPC's NOT_FOUND status code (google.rpc.Code 5): what etcd answers for
/// a lease that expired.
const GRPC_NOT_FOUND: i32 = 5;

impl EtcdError {
    /// etcd does not know what was asked for (a lease that expired).
    fn not_found(&self) -> bool {
        matches!(self, Self::Request(etcd_client::Error::GRpcStatus(s)) if i32::from(s.code()) == GRPC_NOT_FOUND)
    }
}

/// Parses `etcd://HOST:PORT[,HOST:PORT...]` into the members' endpoints.
pub fn parse_url(url: &str) -> Result<Vec<String>, EtcdError> {
    let rest = url
        .strip_prefix("etcd://")
        .ok_or_else(|| EtcdError::NotEtcd {
            url: url.to_string(),
        })?;
    let endpoints: Vec<String> = rest.split(',').map(|e| e.trim().to_string()).collect();
    for e in &endpoints {
        let port = e.rsplit_once(':').map(|(h, p)| (h, p.parse::<u16>()));
        match port {
            Some((h, Ok(p))) if !h.is_empty() && p != 0 => {}
            _ => {
                return Err(EtcdError::Member {
                    url: url.to_string(),
                    member: e.clone(),
                });
            }
        }
    }
    Ok(endpoints)
}

/// The leader key as last read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Leader {
    node: u64,
    /// Its create revision: the term.
    term: u64,
    /// The lease it is bound to.
    lease: i64,
}

/// What the etcd thread knows.
#[derive(Debug, Default)]
struct Known {
    /// Nodes with a membership key at the last read of them (`None`: not
    /// read since the leader key was last held by another).
    live: Option<BTreeSet<u64>>,
    /// Nodes seen with a key in any read.
    ever: BTreeSet<u64>,
    leader: Option<Leader>,
    /// This agent's lease, and until when it holds by this agent's clock.
    lease: Option<i64>,
    valid_until: Option<Instant>,
    /// When etcd last answered.
    answered: Option<Instant>,
}

/// Heartbeats, for while etcd does not answer.
#[derive(Debug)]
struct Heard {
    at: Vec<Option<Duration>>,
    dropped: Vec<bool>,
}

/// Membership and leadership kept in etcd.
pub struct Etcd {
    cfg: EtcdConfig,
    known: Arc<Mutex<Known>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// The newest term heard in a heartbeat.
    heard_term: u64,
    heard: Heard,
    /// The term it last acted under.
    acted: u64,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Etcd {
    /// Starts the thread that keeps this agent's lease and reads the job's
    /// keys. It connects in the background: etcd may come up later.
    pub fn start(cfg: EtcdConfig) -> Self {
        let known = Arc::new(Mutex::new(Known::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (k, s, c) = (Arc::clone(&known), Arc::clone(&stop), cfg.clone());
        let thread = std::thread::Builder::new()
            .name("etcd".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        tracing::error!(error = %e, "the etcd thread has no runtime");
                        return;
                    }
                };
                rt.block_on(Keeper::new(c, k).run(&s));
            })
            .expect("a thread starts");
        let n = cfg.nodes as usize;
        Self {
            cfg,
            known,
            stop,
            thread: Some(thread),
            heard_term: 0,
            heard: Heard {
                at: vec![None; n],
                dropped: vec![false; n],
            },
            acted: 0,
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Coordinator for Etcd {
    fn observe(&mut self, now: Duration, event: Observed) {
        match event {
            Observed::Heartbeat(hb) => {
                self.heard_term = self.heard_term.max(hb.term);
                if let Some(t) = self.heard.at.get_mut(hb.from as usize) {
                    *t = Some(now);
                    self.heard.dropped[hb.from as usize] = false;
                }
            }
            Observed::Dropped { node } => {
                if let Some(d) = self.heard.dropped.get_mut(node as usize) {
                    *d = true;
                }
            }
        }
    }

    fn heartbeat(&mut self, now: Duration) -> Heartbeat {
        let view = self.view(now);
        Heartbeat {
            from: self.cfg.node,
            stamp: now,
            follows: view.follows,
            echo: None,
            term: view.term,
        }
    }

    fn view(&mut self, now: Duration) -> View {
        let k = self.known.lock().expect("not poisoned");
        let me = self.cfg.node;
        let clock = Instant::now();
        let valid = k.valid_until.is_some_and(|t| clock < t);
        // While etcd does not answer, a host whose heartbeats stopped is
        // lost too: the controller holds it back (it does not act).
        let silent = k
            .answered
            .is_none_or(|a| clock.duration_since(a) > self.cfg.ttl);
        let unheard = |n: u64| {
            self.heard.dropped.get(n as usize).copied().unwrap_or(false)
                || self
                    .heard
                    .at
                    .get(n as usize)
                    .copied()
                    .flatten()
                    .is_some_and(|t| now.saturating_sub(t) > self.cfg.ttl)
        };
        let (mut live, mut lost) = (Vec::new(), Vec::new());
        for n in 0..self.cfg.nodes {
            // Without a read of the members (a follower while its
            // controller stands), nobody is lost by lease. With one, a node
            // is lost once its key went, or, never seen with one (it was
            // gone before this agent read them), once its heartbeats
            // stopped too: one that starts has no key yet.
            let keyless = k.live.as_ref().is_some_and(|l| !l.contains(&n));
            let gone = n != me
                && ((keyless && (k.ever.contains(&n) || unheard(n))) || (silent && unheard(n)));
            if gone {
                lost.push(n);
            } else {
                live.push(n);
            }
        }
        let term = k.leader.map_or(0, |l| l.term).max(self.heard_term);
        let acting = valid
            && k.lease.is_some()
            && k.leader
                .is_some_and(|l| l.node == me && Some(l.lease) == k.lease && l.term >= term);
        if acting {
            self.acted = term;
        }
        View {
            live,
            lost,
            follows: k.leader.map(|l| l.node),
            acting,
            term,
            acted: self.acted,
        }
    }
}

/// The etcd thread: this agent's lease, its key, the leader key.
struct Keeper {
    cfg: EtcdConfig,
    known: Arc<Mutex<Known>>,
    client: Option<Client>,
    lease: Option<Lease>,
    /// A leader key was seen (or held) once.
    followed: bool,
    /// The leader key as last read, and when.
    leader: Option<Leader>,
    read_at: Option<Instant>,
    /// The watch on the leader key (a follower's), and whether it saw a
    /// change not read yet.
    watch: Option<(etcd_client::Watcher, etcd_client::WatchStream)>,
    changed: bool,
    /// Since when the leader key has been missing.
    vacant_since: Option<Instant>,
    /// etcd has not answered since then (for the log, once).
    unreachable_since: Option<Instant>,
}

struct Lease {
    id: i64,
    /// The keep-alive stream, on the current connection.
    stream: Option<(etcd_client::LeaseKeeper, etcd_client::LeaseKeepAliveStream)>,
    /// When to keep it alive next.
    next: Instant,
}

async fn within<T>(
    f: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, EtcdError> {
    match tokio::time::timeout(REQUEST, f).await {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(EtcdError::Request(e)),
        Err(_) => Err(EtcdError::Timeout),
    }
}

impl Keeper {
    fn new(cfg: EtcdConfig, known: Arc<Mutex<Known>>) -> Self {
        Self {
            cfg,
            known,
            client: None,
            lease: None,
            followed: false,
            leader: None,
            read_at: None,
            watch: None,
            changed: false,
            vacant_since: None,
            unreachable_since: None,
        }
    }

    async fn run(mut self, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            match self.round().await {
                Ok(()) => {
                    if let Some(since) = self.unreachable_since.take() {
                        tracing::warn!(
                            after_s = since.elapsed().as_secs_f64(),
                            "etcd answers again"
                        );
                    }
                }
                Err(e) => {
                    if self.unreachable_since.is_none() {
                        tracing::warn!(error = %e, endpoints = ?self.cfg.endpoints, "etcd does not answer: nothing is decided by lease until it does");
                        self.unreachable_since = Some(Instant::now());
                    }
                    // A fresh connection next time; the lease is kept
                    // alive on it (or granted again, if it expired).
                    self.client = None;
                    self.watch = None;
                    if let Some(l) = &mut self.lease {
                        l.stream = None;
                        l.next = Instant::now();
                    }
                }
            }
            // Until the next round, or a change of the leader key.
            let watch = async {
                match &mut self.watch {
                    Some((_, w)) => w.message().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = tokio::time::sleep(POLL) => {}
                m = watch => match m {
                    Ok(Some(r)) if !r.canceled() => self.changed = true,
                    _ => self.watch = None,
                },
            }
        }
        // A clean leave: the keys go at once.
        if let Some(id) = self.lease.as_ref().map(|l| l.id)
            && let Ok(c) = self.client().await
        {
            let _ = within(c.lease_revoke(id)).await;
        }
    }

    async fn client(&mut self) -> Result<&mut Client, EtcdError> {
        if self.client.is_none() {
            let opts = ConnectOptions::new()
                .with_connect_timeout(REQUEST)
                .with_timeout(REQUEST);
            let c = within(Client::connect(&self.cfg.endpoints, Some(opts))).await?;
            self.client = Some(c);
        }
        Ok(self.client.as_mut().expect("set above"))
    }

    fn holds_key(&self) -> bool {
        let lease = self.lease.as_ref().map(|l| l.id);
        self.leader
            .is_some_and(|l| l.node == self.cfg.node && Some(l.lease) == lease)
    }

    /// One round: the lease kept alive (or taken again, with the key); the
    /// leader key read when it may have changed; the members read by the
    /// controller (and by everyone while the key is vacant); the key tried
    /// for when it is this agent's turn.
    async fn round(&mut self) -> Result<(), EtcdError> {
        self.keep_lease().await?;
        let reread = self.watch.is_none()
            || self.changed
            || self.read_at.is_none_or(|t| t.elapsed() >= REREAD);
        if reread || self.holds_key() || self.leader.is_none() {
            self.read_leader().await?;
        }
        let members = if self.holds_key() || self.leader.is_none() {
            Some(self.read_members().await?)
        } else {
            None
        };
        if self.leader.is_none()
            && let Some(live) = &members
            && self.turn(live)
            && let Some(l) = self.campaign().await?
        {
            self.leader = Some(l);
        }
        self.vacant_since = match self.leader {
            Some(_) => None,
            None => self.vacant_since.or(Some(Instant::now())),
        };
        self.followed |= self.leader.is_some();
        let mut k = self.known.lock().expect("not poisoned");
        if k.leader.map(|l| (l.node, l.term)) != self.leader.map(|l| (l.node, l.term)) {
            tracing::info!(leader = ?self.leader.map(|l| l.node), term = ?self.leader.map(|l| l.term), "etcd: the job's leader key");
        }
        // A follower keeps no view of the members: it reports no loss but
        // its controller's (whose key goes with its lease).
        if let Some(m) = &members {
            k.ever.extend(m.iter().copied());
        }
        // The leader's key is bound to the lease its member key is: it had
        // one.
        if let Some(l) = self.leader {
            k.ever.insert(l.node);
        }
        k.live = members;
        k.leader = self.leader;
        k.lease = self.lease.as_ref().map(|l| l.id);
        k.answered = Some(Instant::now());
        Ok(())
    }

    /// Reads the leader key, and watches it from there on.
    async fn read_leader(&mut self) -> Result<(), EtcdError> {
        let key = self.cfg.leader_key();
        let nodes = self.cfg.nodes;
        let c = self.client().await?;
        let got = within(c.get(key.as_bytes(), None)).await?;
        let revision = got.header().map_or(0, |h| h.revision());
        self.leader = got.kvs().first().and_then(|kv| {
            let node = std::str::from_utf8(kv.value())
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .filter(|&n| n < nodes);
            if node.is_none() {
                tracing::warn!(
                    value = %String::from_utf8_lossy(kv.value()),
                    "a leader key that names no node of the job: ignored"
                );
            }
            node.map(|node| Leader {
                node,
                term: kv.create_revision() as u64,
                lease: kv.lease(),
            })
        });
        self.read_at = Some(Instant::now());
        self.changed = false;
        if self.watch.is_none() {
            let opts = WatchOptions::new().with_start_revision(revision + 1);
            let c = self.client().await?;
            self.watch = Some(within(c.watch(key.as_bytes(), Some(opts))).await?);
        }
        Ok(())
    }

    /// The nodes with a membership key now.
    async fn read_members(&mut self) -> Result<BTreeSet<u64>, EtcdError> {
        let prefix = format!("{}members/", self.cfg.prefix);
        let nodes = self.cfg.nodes;
        let c = self.client().await?;
        let got = within(c.get(
            prefix.as_bytes(),
            Some(GetOptions::new().with_prefix().with_keys_only()),
        ))
        .await?;
        Ok(got
            .kvs()
            .iter()
            .filter_map(|kv| {
                std::str::from_utf8(kv.key())
                    .ok()?
                    .strip_prefix(&prefix)?
                    .parse::<u64>()
                    .ok()
            })
            .filter(|&n| n < nodes)
            .collect())
    }

    /// Whether this agent tries for the empty leader key now: node 0 at
    /// the start; after a leader was seen, the live members in node order,
    /// [`STAGGER`] apart from when the key went missing.
    fn turn(&self, live: &BTreeSet<u64>) -> bool {
        if !self.followed {
            return self.cfg.node == 0;
        }
        let place = live.iter().filter(|&&n| n < self.cfg.node).count() as u32;
        self.vacant_since
            .is_some_and(|t| t.elapsed() >= STAGGER * place)
    }

    /// Creates the leader key where there is none, bound to this agent's
    /// lease: the leader after, when this agent got it.
    async fn campaign(&mut self) -> Result<Option<Leader>, EtcdError> {
        let Some(lease) = self.lease.as_ref().map(|l| l.id) else {
            return Ok(None);
        };
        let (key, me) = (self.cfg.leader_key(), self.cfg.node);
        let c = self.client().await?;
        let txn = Txn::new()
            .when([Compare::create_revision(
                key.as_bytes(),
                CompareOp::Equal,
                0,
            )])
            .and_then([TxnOp::put(
                key.as_bytes(),
                me.to_string(),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let r = within(c.txn(txn)).await?;
        if !r.succeeded() {
            self.changed = true;
            return Ok(None);
        }
        let term = r.header().map_or(0, |h| h.revision()) as u64;
        tracing::warn!(term, "etcd: this agent holds the job's leader key");
        Ok(Some(Leader {
            node: me,
            term,
            lease,
        }))
    }

    /// Keeps this agent's lease alive, three times per TTL; a lease that
    /// expired (or was never granted) is granted again and the membership
    /// key put under it.
    async fn keep_lease(&mut self) -> Result<(), EtcdError> {
        if let Some(id) = self.lease.as_ref().map(|l| l.id) {
            if self.lease.as_ref().is_some_and(|l| Instant::now() < l.next) {
                return Ok(());
            }
            if self.lease.as_ref().is_some_and(|l| l.stream.is_none()) {
                // After a failure: the same lease, on a fresh connection
                // (a member of etcd went away, not necessarily the lease).
                let c = self.client().await?;
                match within(c.lease_keep_alive(id)).await {
                    Ok(stream) => {
                        if let Some(l) = &mut self.lease {
                            l.stream = Some(stream);
                        }
                    }
                    // It expired meanwhile: a new one, below.
                    Err(e) if e.not_found() => {
                        tracing::warn!(
                            lease = id,
                            "etcd: this agent's lease expired; joining again under a new one"
                        );
                        self.known.lock().expect("not poisoned").valid_until = None;
                        self.lease = None;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        if let Some(id) = self.lease.as_ref().map(|l| l.id) {
            let l = self.lease.as_mut().expect("checked above");
            let (keeper, answers) = l.stream.as_mut().expect("opened above");
            let sent = Instant::now();
            let answer = async {
                keeper.keep_alive().await?;
                answers.message().await
            };
            match within(answer).await? {
                Some(a) if a.ttl() > 0 => {
                    l.next = sent + self.cfg.ttl / 3;
                    self.known.lock().expect("not poisoned").valid_until =
                        Some(sent + Duration::from_secs(a.ttl() as u64));
                    return Ok(());
                }
                Some(_) => {
                    tracing::warn!(
                        lease = id,
                        "etcd: this agent's lease expired; joining again under a new one"
                    );
                    self.known.lock().expect("not poisoned").valid_until = None;
                    self.lease = None;
                }
                None => {
                    l.stream = None;
                    return Err(EtcdError::StreamEnded);
                }
            }
        }
        let ttl = self.cfg.ttl_secs();
        let (key, about) = (self.cfg.member_key(self.cfg.node), self.cfg.about.clone());
        let c = self.client().await?;
        let sent = Instant::now();
        let grant = within(c.lease_grant(ttl, None)).await?;
        let id = grant.id();
        within(c.put(key, about, Some(PutOptions::new().with_lease(id)))).await?;
        let stream = within(c.lease_keep_alive(id)).await?;
        self.known.lock().expect("not poisoned").valid_until =
            Some(sent + Duration::from_secs(grant.ttl().max(0) as u64));
        tracing::info!(lease = id, ttl_s = grant.ttl(), "etcd: joined the job");
        self.lease = Some(Lease {
            id,
            stream: Some(stream),
            next: sent + self.cfg.ttl / 3,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests;
