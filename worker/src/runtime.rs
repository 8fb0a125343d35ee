//! The worker runtime: what a training loop calls so that the agent can keep
//! a consistent copy of its state and repair faults around it (DESIGN.md
//! section 3).
//!
//! 1. [`Runtime::connect`] registers the rank and its state layout with the
//!    agent (`HATRAIN_AGENT_SOCKET`) and maps the rank's snapshot store. The
//!    reply says whether to start fresh or, for a replacement process, to
//!    wait for the agent's directive and restore from shared memory. Without
//!    an agent the runtime is inert and the loop runs as before.
//! 2. [`Runtime::directive_pending`] at each step boundary: one atomic load
//!    of the control page's directive word, no syscall.
//! 3. [`Runtime::start_update`] / [`Runtime::end_update`] around the
//!    optimizer update. A fault between them leaves the live state torn.
//! 4. [`Runtime::commit`] hands the state to a background thread that copies
//!    it into the next free slot while the next step computes (the state is
//!    only read then); the next `start_update` waits for that copy.
//! 5. [`Runtime::await_directive`] after a failed collective or a pending
//!    directive: parks the rank (finishing its commit, so its slots are
//!    final) until the agent says which step to resume from.
//!
//! A watcher thread polls the directive word every millisecond and aborts
//! the current communicator when the agent pauses the job, which releases a
//! rank blocked in a collective on a hung peer.
//!
//! Deterministic fault injection for tests and demos comes from
//! `HATRAIN_FAULT_PLAN`: `RANK:STEP:POINT:ACTION` entries separated by `;`,
//! POINT one of `forward`, `update` (inside the fences), `commit` (halfway
//! through the snapshot copy), ACTION one of `stop` (SIGSTOP itself, for a
//! harness to SIGKILL), `kill` (SIGKILL itself), `exit` (exit code 17),
//! `hang` (block forever), `sleepMS` (sleep MS milliseconds: a slow rank). An
//! optional fifth field names the incarnation (restart count) the entry
//! fires in: a number (default 0, the first process) or `*` for every one.
//! An entry fires at most once per process.

use crate::collective::{AbortHandle, Communicator};
use hatrain_shared::control::{self, PROTOCOL, Request, Response, StartMode, StatePart};
use hatrain_shared::frame::FrameError;
use hatrain_shared::shm::{Directive, Injection, Phase, ShmError, Store};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// A state buffer the runtime snapshots: the training loop reads it freely,
/// and takes the write lock only inside the update fences.
pub type SharedBuf = Arc<RwLock<Vec<f32>>>;

/// Environment variable with the fault plan.
pub const ENV_FAULT_PLAN: &str = "HATRAIN_FAULT_PLAN";
/// Environment variable with the restart count of this rank.
pub const ENV_RESTART_COUNT: &str = "HATRAIN_RESTART_COUNT";

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("cannot reach the agent at {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("agent protocol")]
    Frame(#[from] FrameError),
    #[error("agent refused: {0}")]
    Refused(String),
    #[error("unexpected reply from the agent: expected {expected}, got {got}")]
    Unexpected { expected: &'static str, got: String },
    #[error(transparent)]
    Shm(#[from] ShmError),
    #[error("snapshot store {path} was made for another state layout")]
    Layout { path: PathBuf },
    #[error("no verified snapshot of step {step} in {path}")]
    NoSnapshot { step: u64, path: PathBuf },
    #[error("invalid {ENV_FAULT_PLAN} entry {entry:?}: {detail}")]
    Plan { entry: String, detail: String },
    #[error("cannot start the {what} thread")]
    Thread {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// Where in a step a planned fault fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    Forward,
    Update,
    Commit,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Action {
    Stop,
    Kill,
    Exit,
    /// Block forever, as a rank stuck in a driver call would.
    Hang,
    /// Sleep this many milliseconds: a slow but live rank.
    Sleep(u64),
    /// An uncorrectable memory error at a byte of a state buffer (by
    /// name), or outside every registered buffer (`None`).
    Uce(Option<String>, usize),
}

/// Blocks the calling thread forever.
fn hang() -> ! {
    loop {
        thread::sleep(Duration::from_secs(3600));
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct PlanEntry {
    rank: usize,
    step: u64,
    point: Point,
    action: Action,
}

/// The planned faults of this rank.
#[derive(Debug, Default)]
pub struct FaultPlan {
    entries: Vec<(PlanEntry, AtomicBool)>,
    /// The state buffers a planned UCE may hit: name, address, bytes.
    targets: Vec<(String, usize, usize)>,
}

impl FaultPlan {
    /// Parses a plan, keeping the entries of `rank` that fire in
    /// `incarnation`.
    pub fn parse(text: &str, rank: usize, incarnation: u64) -> Result<Self, RuntimeError> {
        let mut entries = Vec::new();
        for entry in text.split(';').map(str::trim).filter(|e| !e.is_empty()) {
            let bad = |detail: &str| RuntimeError::Plan {
                entry: entry.to_string(),
                detail: detail.to_string(),
            };
            let f: Vec<&str> = entry.split(':').collect();
            let (r, s, p, a, inc) = match f[..] {
                [r, s, p, a] => (r, s, p, a, "0"),
                [r, s, p, a, inc] => (r, s, p, a, inc),
                _ => return Err(bad("expected RANK:STEP:POINT:ACTION[:INCARNATION]")),
            };
            let fires_now = match inc {
                "*" => true,
                n => {
                    n.parse::<u64>()
                        .map_err(|_| bad("INCARNATION must be a number or *"))?
                        == incarnation
                }
            };
            let e = PlanEntry {
                rank: r.parse().map_err(|_| bad("RANK is not a number"))?,
                step: s.parse().map_err(|_| bad("STEP is not a number"))?,
                point: match p {
                    "forward" => Point::Forward,
                    "update" => Point::Update,
                    "commit" => Point::Commit,
                    _ => return Err(bad("POINT must be forward, update or commit")),
                },
                action: match a {
                    "stop" => Action::Stop,
                    "kill" => Action::Kill,
                    "exit" => Action::Exit,
                    "hang" => Action::Hang,
                    "uce-outside" => Action::Uce(None, 0),
                    other => match (other.strip_prefix("sleep"), other.strip_prefix("uce-")) {
                        (Some(ms), _) => {
                            Action::Sleep(ms.parse().map_err(|_| bad("sleepMS needs a number"))?)
                        }
                        (_, Some(target)) => {
                            let (buf, off) = target
                                .rsplit_once('-')
                                .ok_or_else(|| bad("uce-BUFFER-OFFSET or uce-outside"))?;
                            Action::Uce(
                                Some(buf.to_string()),
                                off.parse().map_err(|_| bad("OFFSET is not a number"))?,
                            )
                        }
                        _ => {
                            return Err(bad(
                                "ACTION must be stop, kill, exit, hang, sleepMS, uce-BUFFER-OFFSET or uce-outside",
                            ));
                        }
                    },
                },
            };
            if e.rank == rank && fires_now {
                entries.push((e, AtomicBool::new(false)));
            }
        }
        Ok(Self {
            entries,
            targets: Vec::new(),
        })
    }

    /// Fires the entry for (`step`, `point`), if any and not yet fired.
    pub fn hit(&self, step: u64, point: Point) {
        for (e, fired) in &self.entries {
            if e.step == step && e.point == point && !fired.swap(true, Ordering::SeqCst) {
                eprintln!(
                    "fault plan: rank {} {:?} at step {step} ({point:?})",
                    e.rank, e.action
                );
                if let Action::Uce(target, offset) = &e.action {
                    self.inject_uce(target.as_deref(), *offset);
                    continue;
                }
                // SAFETY: raise(3) and _exit(2) take plain integers.
                unsafe {
                    match e.action {
                        Action::Stop => {
                            libc::raise(libc::SIGSTOP);
                        }
                        Action::Kill => {
                            libc::raise(libc::SIGKILL);
                        }
                        Action::Exit => libc::_exit(17),
                        Action::Hang => hang(),
                        Action::Sleep(ms) => thread::sleep(Duration::from_millis(ms)),
                        Action::Uce(..) => {}
                    }
                }
            }
        }
    }
}

impl FaultPlan {
    /// Injects a UCE into state buffer `target` at byte `offset` (or, with
    /// `None`, outside every registered buffer).
    pub fn inject_uce(&self, target: Option<&str>, offset: usize) {
        let outside = [0u8; 64];
        let addr = match target {
            None => outside.as_ptr(),
            Some(name) => match self.targets.iter().find(|t| t.0 == name) {
                Some(&(_, start, len)) => (start + offset.min(len.saturating_sub(1))) as *const u8,
                None => {
                    eprintln!("fault plan: no state buffer named {name:?}");
                    return;
                }
            },
        };
        // SAFETY: `addr` is in a registered state buffer (its page is lost
        // and restored from the snapshot) or in `outside`, a local scratch
        // buffer that lives until after the injection.
        match unsafe { crate::uce::inject(addr) } {
            Ok(path) => eprintln!("UCE injected at {addr:p} ({target:?} + {offset}) via {path:?}"),
            Err(e) => eprintln!("UCE injection failed: {e}"),
        }
        std::hint::black_box(&outside);
    }
}

#[derive(Debug, Default)]
struct CommitProgress {
    requested: u64,
    done: u64,
    last_error: Option<String>,
    /// The step of the newest snapshot sealed.
    sealed: Option<u64>,
}

struct CommitJob {
    step: u64,
    epoch: u64,
    meta: Vec<u8>,
    seq: u64,
    /// Repaired UCEs when the commit was asked for: the state is known good
    /// then, and a copy that sees the count change is not sealed.
    uces: u64,
    /// Hold the sealed snapshot for the agent's persister.
    hold: bool,
    /// The final step: its snapshot is never skipped.
    last: bool,
}

#[derive(Debug)]
struct Attached {
    store: Arc<Store>,
    recover: bool,
    jobs: Option<mpsc::Sender<CommitJob>>,
    progress: Arc<(Mutex<CommitProgress>, Condvar)>,
    abort: Arc<Mutex<Option<AbortHandle>>>,
    handled: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

/// Which state a commit snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitOf {
    /// The starting state (fresh, or just loaded from disk): never saved.
    Start,
    /// A completed step.
    Step,
    /// The final step.
    Last,
}

/// How the training loop should start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// No agent: run as a plain process.
    Standalone,
    /// Start normally (or `--load`) under this epoch.
    Fresh { epoch: u64 },
    /// A replacement process: call [`Runtime::await_directive`] first.
    AwaitDirective,
}

/// The runtime of one rank.
#[derive(Debug)]
pub struct Runtime {
    rank: usize,
    buffers: Vec<SharedBuf>,
    meta_len: usize,
    interval: u64,
    /// `Some(save interval)` when the agent writes the checkpoints (0: only
    /// the last step).
    agent_saves: Option<u64>,
    plan: Arc<FaultPlan>,
    attached: Option<Attached>,
    commit_seq: u64,
}

impl Runtime {
    /// Registers with the agent named by `HATRAIN_AGENT_SOCKET` (if any).
    /// `parts` are the named state buffers in snapshot order, after a
    /// `meta_len`-byte metadata block.
    pub fn connect(
        rank: usize,
        parts: Vec<(String, SharedBuf)>,
        meta_len: usize,
        snapshot_interval: u64,
        checkpoint: Option<control::CheckpointInfo>,
    ) -> Result<(Self, Start), RuntimeError> {
        let incarnation: u64 = std::env::var(ENV_RESTART_COUNT)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let mut plan = match std::env::var(ENV_FAULT_PLAN) {
            Ok(text) => FaultPlan::parse(&text, rank, incarnation)?,
            Err(_) => FaultPlan::default(),
        };
        // The buffers' memory is watched for UCEs. INVARIANT: the training
        // loop never reallocates a registered buffer, so these stay valid.
        for (i, (name, buf)) in parts.iter().enumerate() {
            let g = buf.read().unwrap_or_else(|p| p.into_inner());
            let (start, len) = (g.as_ptr() as usize, g.len() * 4);
            crate::uce::register(i, start as *const u8, len);
            plan.targets.push((name.clone(), start, len));
        }
        let plan = Arc::new(plan);
        let mut rt = Self {
            rank,
            buffers: parts.iter().map(|(_, b)| Arc::clone(b)).collect(),
            meta_len,
            interval: snapshot_interval.max(1),
            agent_saves: None,
            plan,
            attached: None,
            commit_seq: 0,
        };
        let Some(socket) = std::env::var_os(control::ENV_SOCKET).map(PathBuf::from) else {
            return Ok((rt, Start::Standalone));
        };
        let mut layout = vec![StatePart {
            name: "meta".into(),
            bytes: meta_len as u64,
        }];
        for (name, buf) in &parts {
            let len = buf.read().unwrap_or_else(|p| p.into_inner()).len();
            layout.push(StatePart {
                name: name.clone(),
                bytes: (len * 4) as u64,
            });
        }
        let save_interval = checkpoint.as_ref().map(|c| c.save_interval);
        let mut conn = UnixStream::connect(&socket).map_err(|source| RuntimeError::Connect {
            path: socket.clone(),
            source,
        })?;
        PROTOCOL.send_json(
            &mut conn,
            &Request::Register {
                rank,
                pid: std::process::id(),
                parts: layout.clone(),
                checkpoint,
            },
        )?;
        let (store_path, start, recover) = match PROTOCOL.recv_json(&mut conn)? {
            Response::Registered {
                store,
                start,
                recover,
                agent_saves,
            } => {
                rt.agent_saves = agent_saves.then(|| save_interval.unwrap_or(0));
                (store, start, recover)
            }
            Response::Error { message } => return Err(RuntimeError::Refused(message)),
            other => {
                return Err(RuntimeError::Unexpected {
                    expected: "registered",
                    got: format!("{other:?}"),
                });
            }
        };
        let store = Arc::new(Store::open(&store_path)?);
        crate::uce::install(Some(store.fault_word())).map_err(|source| RuntimeError::Thread {
            what: "SIGBUS handler",
            source,
        })?;
        if store.layout_hash() != control::layout_hash(&layout) {
            return Err(RuntimeError::Layout { path: store_path });
        }
        store.set_pid(std::process::id());
        store.set_restarts(incarnation);
        store.set_phase(Phase::Starting);
        let handled = Arc::new(AtomicU64::new(store.acknowledged()));
        let progress = Arc::new((Mutex::new(CommitProgress::default()), Condvar::new()));
        let abort = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel::<CommitJob>();
        let committer = {
            let (store, bufs, progress, plan) = (
                Arc::clone(&store),
                rt.buffers.clone(),
                Arc::clone(&progress),
                Arc::clone(&rt.plan),
            );
            thread::Builder::new()
                .name("hatrain-commit".into())
                .spawn(move || commit_loop(rx, &store, &bufs, &progress, &plan, rank as u64))
                .map_err(|source| RuntimeError::Thread {
                    what: "commit",
                    source,
                })?
        };
        let watcher = {
            let (store, abort, handled, stop) = (
                Arc::clone(&store),
                Arc::clone(&abort),
                Arc::clone(&handled),
                Arc::clone(&stop),
            );
            thread::Builder::new()
                .name("hatrain-watch".into())
                .spawn(move || watch_loop(&store, &abort, &handled, &stop))
                .map_err(|source| RuntimeError::Thread {
                    what: "watcher",
                    source,
                })?
        };
        rt.attached = Some(Attached {
            store,
            recover,
            jobs: Some(tx),
            progress,
            abort,
            handled,
            stop,
            threads: vec![committer, watcher],
        });
        let start = match start {
            StartMode::Fresh { epoch } => Start::Fresh { epoch },
            StartMode::AwaitDirective => Start::AwaitDirective,
        };
        Ok((rt, start))
    }

    /// Whether a failed collective should wait for the agent's recovery.
    pub fn recovers(&self) -> bool {
        self.attached.as_ref().is_some_and(|a| a.recover)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Step boundary: true if the agent has posted a directive not yet
    /// handled. One atomic load; no syscall.
    pub fn directive_pending(&self) -> bool {
        self.attached.as_ref().is_some_and(|a| {
            a.store.beat();
            a.store.directive_seq() != a.handled.load(Ordering::Acquire)
        })
    }

    /// The forward and backward passes of `step` begin.
    pub fn begin_step(&self, step: u64) {
        if let Some(a) = &self.attached {
            a.store.set_phase(Phase::Computing);
            match a.store.take_injection(step) {
                Some((Injection::Uce, arg)) => {
                    let (buffer, offset) = ((arg >> 48) as usize, (arg & ((1 << 48) - 1)) as usize);
                    match self.plan.targets.get(buffer) {
                        Some((name, ..)) => self.plan.inject_uce(Some(&name.clone()), offset),
                        None => self.plan.inject_uce(None, 0),
                    }
                }
                Some((Injection::Crash, _)) => {
                    eprintln!("rank {}: injected crash at step {step}", self.rank);
                    // SAFETY: raise(3) with a plain signal number.
                    unsafe { libc::raise(libc::SIGKILL) };
                }
                Some((Injection::Hang, _)) => {
                    eprintln!("rank {}: injected hang at step {step}", self.rank);
                    hang();
                }
                None => {}
            }
        }
        self.plan.hit(step, Point::Forward);
    }

    /// The UCE the SIGBUS handler repaired since the last check, if any:
    /// the live state is then torn and the step must be recomputed from the
    /// last consistent snapshot. Reports it in the control page.
    pub fn check_uce(&self) -> Option<crate::uce::Uce> {
        let u = crate::uce::take_pending()?;
        let name = self
            .plan
            .targets
            .get(u.buffer)
            .map_or("?", |t| t.0.as_str());
        eprintln!(
            "rank {}: uncorrectable memory error in {name} at byte {}: the step is thrown away and recomputed",
            self.rank, u.offset
        );
        if let Some(a) = &self.attached {
            a.store.record_fault(
                crate::uce::FAULT_UCE_REPAIRABLE,
                u.offset as u64,
                u.buffer as u64,
            );
        }
        Some(u)
    }

    /// Runs a collective, marked in the control page as waiting on peers, so
    /// that the agent can tell a hung rank from the ranks waiting for it.
    pub fn collective<T>(&self, f: impl FnOnce() -> T) -> T {
        let store = self.attached.as_ref().map(|a| &a.store);
        if let Some(s) = store {
            s.set_in_collective(true);
        }
        let r = f();
        if let Some(s) = store {
            s.set_in_collective(false);
        }
        r
    }

    /// Start-update fence: waits for the running snapshot copy (the update
    /// may now change the state), then marks the state as being updated.
    pub fn start_update(&self, step: u64) {
        if let Some(a) = &self.attached {
            let t = Instant::now();
            self.wait_commit();
            let blocked = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
            a.store.record_commit_blocking(blocked);
            a.store.set_phase(Phase::Updating);
        }
        self.plan.hit(step, Point::Update);
    }

    /// End-update fence: the state is consistent again at `step`.
    pub fn end_update(&self, step: u64) {
        if let Some(a) = &self.attached {
            a.store.set_step(step);
            a.store.set_phase(Phase::Computing);
        }
    }

    /// Whether the agent writes this rank's checkpoints (from the snapshots
    /// of save steps, which [`Runtime::commit`] holds for it), so the
    /// training loop does not save.
    pub fn agent_saves(&self) -> bool {
        self.agent_saves.is_some()
    }

    /// Snapshot the state of `step` (every `--snapshot-interval` steps, and
    /// every step the agent is to save: each save-interval step and the
    /// last): `meta` is copied now, the buffers in the background.
    pub fn commit(&mut self, step: u64, epoch: u64, meta: Vec<u8>, of: CommitOf) {
        assert_eq!(meta.len(), self.meta_len, "meta block has a fixed size");
        let Some(a) = &self.attached else { return };
        let hold = self.agent_saves.is_some_and(|n| match of {
            CommitOf::Start => false,
            CommitOf::Step => n > 0 && step.is_multiple_of(n),
            CommitOf::Last => true,
        });
        if !(hold || step.is_multiple_of(self.interval)) || crate::uce::pending() {
            // A UCE not yet acted on: this state is not snapshotted.
            return;
        }
        let uces = crate::uce::count();
        self.commit_seq += 1;
        a.progress
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .requested = self.commit_seq;
        if let Some(tx) = &a.jobs {
            let _ = tx.send(CommitJob {
                step,
                epoch,
                meta,
                seq: self.commit_seq,
                uces,
                hold,
                last: of == CommitOf::Last,
            });
        }
    }

    /// Waits until the last requested snapshot is sealed (or failed).
    pub fn wait_commit(&self) {
        let Some(a) = &self.attached else { return };
        let (lock, cv) = &*a.progress;
        let mut p = lock.lock().unwrap_or_else(|p| p.into_inner());
        while p.done < p.requested {
            p = cv.wait(p).unwrap_or_else(|p| p.into_inner());
        }
        if let Some(e) = p.last_error.take() {
            eprintln!("rank {}: snapshot commit failed: {e}", self.rank);
        }
    }

    /// Tells the watcher which communicator to abort on a pause.
    pub fn set_communicator(&self, comm: &Communicator) {
        if let Some(a) = &self.attached {
            *a.abort.lock().unwrap_or_else(|p| p.into_inner()) = Some(comm.abort_handle());
            a.store.set_epoch(comm.epoch());
        }
    }

    /// Parks the rank until the agent says how to go on: acknowledges
    /// pauses (after finishing any snapshot copy) and returns the first
    /// `Resume` or `Stop`. Without an agent, returns `Stop` at once.
    pub fn await_directive(&mut self) -> Directive {
        let Some(a) = &self.attached else {
            return Directive::Stop;
        };
        if let Some(h) = a.abort.lock().unwrap_or_else(|p| p.into_inner()).take() {
            h.abort();
        }
        self.wait_commit();
        let store = Arc::clone(&a.store);
        loop {
            let (seq, d) = store.directive();
            let handled = a.handled.load(Ordering::Acquire);
            if seq != handled {
                match d {
                    Directive::Pause { .. } | Directive::None => {
                        store.set_phase(Phase::Paused);
                        a.handled.store(seq, Ordering::Release);
                        store.acknowledge(seq);
                    }
                    Directive::Resume { step, .. } => {
                        // Snapshots past the step every rank returns to are
                        // of an abandoned timeline (no commit runs now).
                        store.discard_newer_than(step);
                        a.handled.store(seq, Ordering::Release);
                        store.acknowledge(seq);
                        store.set_phase(Phase::Restoring);
                        return d;
                    }
                    Directive::Stop => {
                        a.handled.store(seq, Ordering::Release);
                        store.acknowledge(seq);
                        return d;
                    }
                }
            } else if store.phase() != Phase::Paused {
                // Nothing posted yet (the rank noticed the fault first).
                store.set_phase(Phase::Paused);
            }
            store.beat();
            thread::sleep(Duration::from_millis(1));
        }
    }

    /// Copies the sealed snapshot of `step` into the state buffers (taking
    /// their write locks) and returns its metadata block.
    pub fn restore(&self, step: u64) -> Result<Vec<u8>, RuntimeError> {
        let a = self
            .attached
            .as_ref()
            .ok_or_else(|| RuntimeError::NoSnapshot {
                step,
                path: PathBuf::from("(no agent)"),
            })?;
        self.wait_commit();
        let mut meta = vec![0u8; self.meta_len];
        let mut guards: Vec<_> = self
            .buffers
            .iter()
            .map(|b| b.write().unwrap_or_else(|p| p.into_inner()))
            .collect();
        // Newest candidate first; each copy is verified as it is made.
        let mut last_err = None;
        let mut restored = false;
        for info in a.store.sealed().into_iter().filter(|i| i.step == step) {
            let mut outs: Vec<&mut [u8]> = vec![&mut meta[..]];
            for g in guards.iter_mut() {
                outs.push(bytemuck::cast_slice_mut(&mut g[..]));
            }
            match a.store.read_slot(info.slot, &mut outs) {
                Ok(_) => {
                    restored = true;
                    break;
                }
                Err(e) => last_err = Some(e),
            }
        }
        if !restored {
            return Err(match last_err {
                Some(e) => e.into(),
                None => RuntimeError::NoSnapshot {
                    step,
                    path: a.store.path().to_path_buf(),
                },
            });
        }
        drop(guards);
        a.store.set_step(step);
        Ok(meta)
    }

    /// The loop has finished at `step`: waits for the last snapshot and says
    /// whether it is sealed (true without an agent).
    pub fn finish(&self, step: u64) -> bool {
        self.wait_commit();
        let Some(a) = &self.attached else { return true };
        a.store.set_phase(Phase::Finished);
        a.progress
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .sealed
            == Some(step)
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if let Some(mut a) = self.attached.take() {
            a.jobs.take(); // closes the commit channel
            a.stop.store(true, Ordering::SeqCst);
            for t in a.threads.drain(..) {
                let _ = t.join();
            }
        }
    }
}

fn commit_loop(
    rx: mpsc::Receiver<CommitJob>,
    store: &Store,
    bufs: &[SharedBuf],
    progress: &(Mutex<CommitProgress>, Condvar),
    plan: &FaultPlan,
    rank: u64,
) {
    // Whether a hold has cost a snapshot yet (said once).
    let mut said_blocked = false;
    while let Ok(job) = rx.recv() {
        let t = Instant::now();
        let result = match free_slot(store, &job) {
            Some(slot) => {
                let guards: Vec<_> = bufs
                    .iter()
                    .map(|b| b.read().unwrap_or_else(|p| p.into_inner()))
                    .collect();
                let mut parts: Vec<&[u8]> = vec![&job.meta];
                parts.extend(
                    guards
                        .iter()
                        .map(|g| bytemuck::cast_slice::<f32, u8>(&g[..])),
                );
                let mut halfway = false;
                let uces = job.uces;
                store
                    .write_slot(slot, rank, job.step, job.epoch, &parts, &mut |at, len| {
                        if !halfway && at * 2 >= len {
                            halfway = true;
                            plan.hit(job.step, Point::Commit);
                        }
                        // A UCE repaired meanwhile may have zeroed bytes being
                        // copied.
                        crate::uce::count() == uces
                    })
                    .map(|info| {
                        // Refused only while the agent still writes an older
                        // step; it then skips to a newer one and says so.
                        if job.hold {
                            let _ = store.hold(job.step, info.slot);
                        }
                        Some(job.step)
                    })
                    .map_err(|e| e.to_string())
            }
            None => {
                if !said_blocked && let Some(h) = store.held() {
                    said_blocked = true;
                    eprintln!(
                        "rank {rank}: snapshot of step {} skipped: its slot is held while the agent writes iteration {} to disk (with --snapshot-slots 3 snapshots go on meanwhile; said once)",
                        job.step, h.step
                    );
                }
                Ok(None)
            }
        };
        let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
        store.record_commit(ns);
        let (lock, cv) = progress;
        let mut p = lock.lock().unwrap_or_else(|p| p.into_inner());
        p.done = job.seq;
        match result {
            Ok(Some(step)) => p.sealed = Some(step),
            Ok(None) => {}
            Err(e) => p.last_error = Some(e),
        }
        cv.notify_all();
    }
}

/// The slot for `job`'s snapshot, when every slot but the newest is held
/// for the persister: a save step takes the place of an unclaimed hold (the
/// persister skips to the newest), and the final step waits for a claimed
/// one to be written out; any other step is not snapshotted (`None`).
fn free_slot(store: &Store, job: &CommitJob) -> Option<usize> {
    loop {
        if let Some(slot) = store.writable_slot() {
            return Some(slot);
        }
        let h = store.held()?;
        if !job.hold {
            return None;
        }
        if !h.claimed {
            store.release_hold(h);
        } else if job.last {
            // Alive, not hung: the training loop waits for this commit.
            store.beat();
            thread::sleep(Duration::from_millis(1));
        } else {
            return None;
        }
    }
}

fn watch_loop(
    store: &Store,
    abort: &Mutex<Option<AbortHandle>>,
    handled: &AtomicU64,
    stop: &AtomicBool,
) {
    let mut aborted_for = 0;
    while !stop.load(Ordering::SeqCst) {
        let seq = store.directive_seq();
        if seq != handled.load(Ordering::Acquire) && seq != aborted_for {
            let (seq, d) = store.directive();
            if matches!(d, Directive::Pause { .. } | Directive::Stop) {
                if let Some(h) = abort.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                    h.abort();
                }
                aborted_for = seq;
            }
        }
        thread::sleep(Duration::from_millis(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_plans_parse_and_filter() {
        let p =
            FaultPlan::parse("1:12:forward:stop; 2:20:update:kill;1:30:commit:exit", 1, 0).unwrap();
        assert_eq!(p.entries.len(), 2);
        assert_eq!(p.entries[1].0.point, Point::Commit);
        assert!(
            FaultPlan::parse("1:12:forward:stop", 1, 1)
                .unwrap()
                .entries
                .is_empty()
        );
        for bad in [
            "1:12:forward",
            "x:1:forward:stop",
            "1:1:sideways:stop",
            "1:1:forward:nap",
        ] {
            let e = FaultPlan::parse(bad, 1, 0).unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
    }
}
