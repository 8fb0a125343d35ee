//! The worker runtime: what a training loop calls so that the agent can keep
//! a consistent copy of its state and repair faults around it (DESIGN.md
//! section 3).
//!
//! 1. [`Runtime::connect`] registers the rank and its [`StateMap`] with the
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
//! the current communicator (through [`crate::comm::Abort`]) when the agent
//! pauses the job, which releases a rank blocked in a collective on a hung
//! peer.
//!
//! The snapshot is the state map's parts in order: part 0 is the metadata
//! block the loop passes to each commit, parts 1.. are the registered
//! buffers.

mod background;
mod reshape;
mod siblings;
mod timing;
mod uce;
mod window;

pub use reshape::Donated;

use crate::comm::{Abort, Communicator, Hooks};
use background::{CommitJob, CommitProgress, Committer, commit_loop, watch_loop};
use hatrain_shared::control::{self, PROTOCOL, Request, Response, StartMode};
use hatrain_shared::frame::FrameError;
use hatrain_shared::shm::{Directive, Injection, Phase, ShmError, Store};
use hatrain_shared::statemap::{Dtype, StateMap, StateMapError};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};
use window::HeldClock;
pub use window::{Window, WindowError};

pub use crate::buffer::{Borrowed, Buffer, SharedBuf};

/// Environment variable with the restart count of this rank.
pub const ENV_RESTART_COUNT: &str = "HATRAIN_RESTART_COUNT";

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Agent(#[from] hatrain_shared::control::ClientError),
    #[error("agent protocol")]
    Frame(#[from] FrameError),
    #[error("agent refused: {0}")]
    Refused(String),
    #[error("unexpected reply from the agent: expected {expected}, got {got}")]
    Unexpected { expected: &'static str, got: String },
    #[error(transparent)]
    Shm(#[from] ShmError),
    #[error(transparent)]
    Map(#[from] StateMapError),
    #[error("not trusting the agent's files")]
    Untrusted(#[from] hatrain_shared::trust::TrustError),
    #[error("the state map does not describe the buffers: {0}")]
    Buffers(String),
    #[error("snapshot store {path} was made for another state layout")]
    Layout { path: PathBuf },
    #[error("no verified snapshot of step {step} in {path}")]
    NoSnapshot { step: u64, path: PathBuf },
    #[error("cannot start the {what} thread")]
    Thread {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// Blocks the calling thread forever, as a rank stuck in a driver call
/// would.
pub fn hang() -> ! {
    loop {
        thread::sleep(Duration::from_secs(3600));
    }
}

/// Injects uncorrectable memory errors into the registered buffers of this
/// process (for `agentctl inject uce` and fault plans), or outside them.
#[derive(Debug, Clone, Copy, Default)]
pub struct UceInjector;

impl UceInjector {
    /// A UCE at byte `offset` (clamped) of state part `part`; a part that is
    /// not a registered buffer gets one outside the state instead.
    pub fn inject(&self, part: usize, offset: usize) {
        match crate::uce::inject_in(part, offset) {
            Ok(path) => eprintln!("UCE injected in part {part} + {offset} via {path:?}"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => self.inject_outside(),
            Err(e) => eprintln!("UCE injection failed: {e}"),
        }
    }

    /// A UCE outside every registered buffer: the process cannot trust its
    /// memory and dies of it.
    pub fn inject_outside(&self) {
        match crate::uce::inject_outside() {
            Ok(path) => eprintln!("UCE injected outside the state via {path:?}"),
            Err(e) => eprintln!("UCE injection failed: {e}"),
        }
    }
}

#[derive(Debug)]
struct Attached {
    store: Arc<Store>,
    recover: bool,
    /// Per buffer, the elements a snapshot holds: all, or this rank's
    /// slice of a replicated part (a sliced snapshot).
    held: Arc<Vec<std::ops::Range<usize>>>,
    /// The snapshots are sliced: a restore leaves the other ranks' slices
    /// of the replicated parts to [`Runtime::rebuild_replicated`].
    sliced: bool,
    jobs: Option<mpsc::Sender<CommitJob>>,
    progress: Arc<(Mutex<CommitProgress>, Condvar)>,
    /// The sequence number of a commit whose copy is to be abandoned.
    cancel: Arc<AtomicU64>,
    abort: Arc<Mutex<Option<Arc<dyn Abort>>>>,
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
    map: StateMap,
    buffers: Vec<Buffer>,
    meta_len: usize,
    interval: u64,
    /// `Some(save interval)` when the agent writes the checkpoints (0: only
    /// the last step).
    agent_saves: Option<u64>,
    hooks: Arc<dyn Hooks>,
    attached: Option<Attached>,
    commit_seq: u64,
    window: Window,
    /// Snapshots skipped in a row (see [`Window`]).
    misses: AtomicU64,
    held_clock: HeldClock,
    step_clock: timing::StepClock,
}

/// The store whose control page the SIGBUS handler records fatal faults
/// in. Its mapping must outlive every signal, so it is held here for the
/// life of the process, replaced only when a reshape attaches a new store.
static FAULT_PAGE: Mutex<Option<Arc<Store>>> = Mutex::new(None);

/// Points the SIGBUS handler at `store`'s fault word, then lets go of the
/// store it pointed at before. The previous store is dropped only after the
/// handler reads the new word; a reshape runs between steps, when no
/// registered buffer is touched, so no handler holds the old pointer.
fn fault_page(store: &Arc<Store>) -> Result<(), RuntimeError> {
    let mut held = FAULT_PAGE.lock().unwrap_or_else(|p| p.into_inner());
    // SAFETY: the word lives in `store`'s mapping, which stays in
    // FAULT_PAGE until the handler has been pointed at another word (by the
    // next call, before it drops this store).
    let word: &'static std::sync::atomic::AtomicU64 =
        unsafe { &*std::ptr::from_ref(store.page().fault_word()) };
    crate::uce::install(Some(word)).map_err(|source| RuntimeError::Thread {
        what: "SIGBUS handler",
        source,
    })?;
    let _previous = held.replace(Arc::clone(store));
    Ok(())
}

/// Checks that `map` describes a metadata block (part 0, bytes) and then
/// `buffers`, in order.
fn check_buffers(map: &StateMap, buffers: &[Buffer]) -> Result<usize, RuntimeError> {
    map.validate()?;
    let bad = |m: String| Err(RuntimeError::Buffers(m));
    if map.parts.len() != buffers.len() + 1 {
        return bad(format!(
            "{} parts for a metadata block and {} buffers",
            map.parts.len(),
            buffers.len()
        ));
    }
    if buffers.len() >= crate::uce::MAX_RANGES {
        return bad(format!(
            "{} buffers; at most {} can be watched for memory errors",
            buffers.len(),
            crate::uce::MAX_RANGES - 1
        ));
    }
    if map.parts[0].dtype != Dtype::U8 {
        return bad(format!(
            "part 0 ({:?}) must be the U8 metadata block",
            map.parts[0].name
        ));
    }
    for (p, b) in map.parts[1..].iter().zip(buffers) {
        let (dtype, len) = (b.dtype(), b.len() as u64);
        if p.dtype != dtype || p.len != len {
            return bad(format!(
                "part {:?} is {:?}[{}], its buffer {dtype:?}[{len}]",
                p.name, p.dtype, p.len
            ));
        }
    }
    Ok(map.parts[0].len as usize)
}

impl Runtime {
    /// Registers with the agent named by `HATRAIN_AGENT_SOCKET` (if any).
    /// `map` describes the snapshot: part 0 is the metadata block given to
    /// each [`Runtime::commit`], parts 1.. are `buffers`, in order.
    pub fn connect(
        rank: usize,
        map: StateMap,
        buffers: Vec<SharedBuf>,
        snapshot_interval: u64,
        hooks: Arc<dyn Hooks>,
    ) -> Result<(Self, Start), RuntimeError> {
        let buffers = buffers.into_iter().map(Buffer::from).collect();
        Self::connect_buffers(rank, map, buffers, snapshot_interval, 0, hooks)
    }

    /// [`Runtime::connect`] with buffers of any kind: memory another
    /// runtime owns, of any dtype, registered without a copy. `min_slots`
    /// (0: the agent's choice) is the fewest snapshot slots the loop
    /// needs: 3 when gradients are reduced before the update fences (see
    /// [`Request::Register`]).
    pub fn connect_buffers(
        rank: usize,
        map: StateMap,
        buffers: Vec<Buffer>,
        snapshot_interval: u64,
        min_slots: usize,
        hooks: Arc<dyn Hooks>,
    ) -> Result<(Self, Start), RuntimeError> {
        let meta_len = check_buffers(&map, &buffers)?;
        let incarnation = crate::standby::restart_count();
        // The buffers' memory is watched for UCEs, by part index.
        // INVARIANT: the training loop never reallocates a registered
        // buffer, so these stay valid.
        for (i, buf) in buffers.iter().enumerate() {
            let (at, len) = buf.region();
            crate::uce::register(i + 1, at, len);
        }
        let mut rt = Self {
            rank,
            buffers,
            meta_len,
            interval: snapshot_interval.max(1),
            agent_saves: None,
            hooks,
            attached: None,
            commit_seq: 0,
            window: Window::Wait,
            misses: AtomicU64::new(0),
            held_clock: HeldClock::default(),
            step_clock: timing::StepClock::default(),
            map,
        };
        let Some(socket) = std::env::var_os(control::ENV_SOCKET).map(PathBuf::from) else {
            return Ok((rt, Start::Standalone));
        };
        let save_interval = rt.map.checkpoint.as_ref().map(|c| c.interval);
        let mut conn = control::connect(&socket)?;
        PROTOCOL.send_json(
            &mut conn,
            &Request::Register {
                rank,
                pid: std::process::id(),
                map: rt.map.clone(),
                slots: (min_slots > 0).then_some(min_slots),
            },
        )?;
        let (store_path, start, recover, sliced) = match PROTOCOL.recv_json(&mut conn)? {
            Response::Registered {
                store,
                start,
                recover,
                agent_saves,
                sliced,
            } => {
                rt.agent_saves = agent_saves.then(|| save_interval.unwrap_or(0));
                (store, start, recover, sliced)
            }
            Response::Error { message } => return Err(RuntimeError::Refused(message)),
            other => {
                return Err(RuntimeError::Unexpected {
                    expected: "registered",
                    got: format!("{other:?}"),
                });
            }
        };
        // A fresh rank's first commits copy into mapped pages; a replacement
        // restores first, and every moment until it pauses holds the job
        // up: its pages are mapped as they are read and written.
        let populate = matches!(start, StartMode::Fresh { .. });
        rt.attach(store_path, recover, sliced, incarnation, populate)?;
        let start = match start {
            StartMode::Fresh { epoch } => Start::Fresh { epoch },
            StartMode::AwaitDirective => Start::AwaitDirective,
        };
        Ok((rt, start))
    }

    /// Maps the store the agent made for this rank (every page now, with
    /// `populate`) and starts the commit and watcher threads.
    fn attach(
        &mut self,
        store_path: PathBuf,
        recover: bool,
        sliced: bool,
        incarnation: u64,
        populate: bool,
    ) -> Result<(), RuntimeError> {
        let rank = self.rank as u64;
        // The store is the agent's: its file, in the agent's folder.
        let me = hatrain_shared::trust::me();
        if let Some(dir) = store_path.parent() {
            hatrain_shared::trust::check(dir, hatrain_shared::trust::Kind::Dir, me)?;
        }
        hatrain_shared::trust::check(&store_path, hatrain_shared::trust::Kind::File, me)?;
        let store = Arc::new(if populate {
            Store::open(&store_path)?
        } else {
            Store::open_lazily(&store_path)?
        });
        if store.page().layout_hash() != self.map.slot_layout_hash(sliced) {
            return Err(RuntimeError::Layout { path: store_path });
        }
        let held: Arc<Vec<std::ops::Range<usize>>> = Arc::new(
            (1..self.map.parts.len())
                .map(|i| {
                    let r = self.map.held(i, sliced);
                    r.start as usize..r.end as usize
                })
                .collect(),
        );
        fault_page(&store)?;
        let page = store.page();
        page.set_pid(std::process::id());
        page.set_restarts(incarnation);
        page.set_phase(Phase::Starting);
        let handled = Arc::new(AtomicU64::new(page.acknowledged()));
        let progress = Arc::new((Mutex::new(CommitProgress::default()), Condvar::new()));
        let abort = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let cancel = Arc::new(AtomicU64::new(0));
        let (tx, rx) = mpsc::channel::<CommitJob>();
        let committer = {
            let shared = Committer {
                store: Arc::clone(&store),
                bufs: self.buffers.clone(),
                held: Arc::clone(&held),
                progress: Arc::clone(&progress),
                cancel: Arc::clone(&cancel),
                hooks: Arc::clone(&self.hooks),
                rank,
            };
            thread::Builder::new()
                .name("hatrain-commit".into())
                .spawn(move || commit_loop(rx, &shared))
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
        self.attached = Some(Attached {
            store,
            recover,
            held,
            sliced,
            jobs: Some(tx),
            progress,
            cancel,
            abort,
            handled,
            stop,
            threads: vec![committer, watcher],
        });
        Ok(())
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
        let t = Instant::now();
        let pending = self.attached.as_ref().is_some_and(|a| {
            let page = a.store.page();
            page.beat();
            page.directive_seq() != a.handled.load(Ordering::Acquire)
        });
        self.held_clock.add(t);
        pending
    }

    /// The state map this rank registered.
    pub fn map(&self) -> &StateMap {
        &self.map
    }

    /// Injects memory errors into this rank's registered buffers.
    pub fn uce_injector(&self) -> UceInjector {
        UceInjector
    }

    /// The forward and backward passes of `step` begin: carries out a fault
    /// that `agentctl inject` left for this step.
    pub fn begin_step(&self, step: u64) {
        let t = Instant::now();
        self.time_step_begins();
        self.close_held_step(true);
        self.begin_step_injections(step);
        self.held_clock.add(t);
    }

    fn begin_step_injections(&self, step: u64) {
        let Some(a) = &self.attached else { return };
        let page = a.store.page();
        page.set_phase(Phase::Computing);
        match page.take_injection(step) {
            Some(Injection::Uce { part, offset }) => {
                let part = usize::try_from(part).unwrap_or(usize::MAX);
                UceInjector.inject(part, usize::try_from(offset).unwrap_or(usize::MAX));
            }
            Some(Injection::Crash) => {
                eprintln!("rank {}: injected crash at step {step}", self.rank);
                let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
            }
            Some(Injection::Hang) => {
                eprintln!("rank {}: injected hang at step {step}", self.rank);
                hang();
            }
            None => {}
        }
    }

    /// Runs a collective, marked in the control page as waiting on peers, so
    /// that the agent can tell a hung rank from the ranks waiting for it.
    pub fn collective<T>(&self, f: impl FnOnce() -> T) -> T {
        let page = self.attached.as_ref().map(|a| a.store.page());
        if let Some(p) = page {
            p.set_in_collective(true);
        }
        let before = self.time_collective_begins();
        let r = f();
        self.time_collective_ends(before);
        if let Some(p) = page {
            p.set_in_collective(false);
        }
        r
    }

    /// Whether the snapshot of `step` is held for the agent's checkpoint.
    fn held_for_save(&self, step: u64, of: CommitOf) -> bool {
        self.agent_saves.is_some_and(|n| match of {
            CommitOf::Start => false,
            CommitOf::Step => n > 0 && step.is_multiple_of(n),
            CommitOf::Last => true,
        })
    }

    /// Whether [`Runtime::commit`] of `step` takes a snapshot (with an
    /// agent: every `--snapshot-interval` steps and each step the agent
    /// saves), so that a loop that stages its state for the copy (out of
    /// device memory) stages it only then.
    pub fn snapshots(&self, step: u64, of: CommitOf) -> bool {
        self.attached.is_some()
            && (self.held_for_save(step, of) || step.is_multiple_of(self.interval))
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
        let t = Instant::now();
        self.hand_off(step, epoch, meta, of);
        self.held_clock.add(t);
    }

    fn hand_off(&mut self, step: u64, epoch: u64, meta: Vec<u8>, of: CommitOf) {
        assert_eq!(meta.len(), self.meta_len, "meta block has a fixed size");
        let Some(a) = &self.attached else { return };
        let hold = self.held_for_save(step, of);
        if !self.snapshots(step, of) || crate::uce::pending() {
            // A UCE not yet acted on: this state is not snapshotted.
            return;
        }
        let uces = crate::uce::count();
        self.commit_seq += 1;
        {
            let mut p = a.progress.0.lock().unwrap_or_else(|p| p.into_inner());
            p.requested = self.commit_seq;
            p.requested_step = step;
            p.skippable = !hold && of == CommitOf::Step;
        }
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

    /// The communicator of `epoch` could not be built (`peer`, if known, was
    /// unreachable): says so in the control page, where the agent takes it
    /// as a fault of the recovery, and tries again under a new epoch or
    /// stops the job. Call [`Runtime::await_directive`] next.
    pub fn rebuild_failed(&self, epoch: u64, peer: Option<usize>) {
        if let Some(a) = &self.attached {
            a.store
                .page()
                .record_rebuild_failure(epoch, peer.map(|p| p as u64));
        }
    }

    /// Tells the watcher which communicator to abort on a pause.
    pub fn set_communicator(&self, comm: &dyn Communicator) {
        if let Some(a) = &self.attached {
            *a.abort.lock().unwrap_or_else(|p| p.into_inner()) = Some(comm.abort_handle());
            a.store.page().set_epoch(comm.epoch());
        }
    }

    /// Parks the rank until the agent says how to go on: acknowledges
    /// pauses (after finishing any snapshot copy) and returns the first
    /// `Resume`, `Reshape` or `Stop`. Without an agent, returns `Stop` at
    /// once.
    pub fn await_directive(&mut self) -> Directive {
        let Some(a) = &self.attached else {
            return Directive::Stop;
        };
        if let Some(h) = a.abort.lock().unwrap_or_else(|p| p.into_inner()).take() {
            h.abort();
        }
        self.wait_commit_paused();
        let store = Arc::clone(&a.store);
        let page = store.page();
        loop {
            let (seq, d) = page.directive();
            let handled = a.handled.load(Ordering::Acquire);
            if seq != handled {
                match d {
                    Directive::Pause { .. } | Directive::None => {
                        page.set_phase(Phase::Paused);
                        a.handled.store(seq, Ordering::Release);
                        page.acknowledge(seq);
                    }
                    Directive::Resume { step, .. } | Directive::Reshape { step, .. } => {
                        // Snapshots past the step every rank returns to are
                        // of an abandoned timeline (no commit runs now).
                        store.discard_newer_than(step);
                        a.handled.store(seq, Ordering::Release);
                        page.acknowledge(seq);
                        page.set_phase(Phase::Restoring);
                        return d;
                    }
                    Directive::Stop => {
                        a.handled.store(seq, Ordering::Release);
                        page.acknowledge(seq);
                        return d;
                    }
                }
            } else if page.phase() != Phase::Paused {
                // Nothing posted yet (the rank noticed the fault first).
                page.set_phase(Phase::Paused);
            }
            page.beat();
            thread::sleep(Duration::from_millis(1));
        }
    }

    /// Whether the snapshots hold only this rank's slice of each replicated
    /// part: then a restore is complete only after
    /// [`Runtime::rebuild_replicated`].
    pub fn sliced(&self) -> bool {
        self.attached.as_ref().is_some_and(|a| a.sliced)
    }

    /// Whether the store holds any sealed snapshot (a rank started to join
    /// a growing group holds none).
    pub fn has_snapshots(&self) -> bool {
        self.attached
            .as_ref()
            .is_some_and(|a| !a.store.sealed().is_empty())
    }

    /// Per buffer, the elements a restore fills: all of it, or with sliced
    /// snapshots this rank's slice of a replicated part.
    pub fn held(&self) -> Vec<std::ops::Range<usize>> {
        match &self.attached {
            Some(a) => a.held.to_vec(),
            None => self.buffers.iter().map(|b| 0..b.len()).collect(),
        }
    }

    /// Bytes of one snapshot of this rank (0 without an agent).
    pub fn snapshot_bytes(&self) -> u64 {
        self.attached
            .as_ref()
            .map_or(0, |a| self.map.slot_bytes(a.sliced))
    }

    /// Rebuilds every replicated buffer from the slices the ranks of its
    /// group hold, with `all_gather` (the framework's collective over the
    /// new communicator): called by every rank after a resume, restored or
    /// not, since each contributes its slice. On entry a buffer holds this
    /// rank's slice, [`shard_range`](hatrain_shared::shard::shard_range)`(len,
    /// group, index)`; `all_gather` must leave all of it on every rank. A
    /// no-op for full snapshots.
    pub fn rebuild_replicated<E>(
        &self,
        mut all_gather: impl FnMut(&mut [f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        let Some(a) = self.attached.as_ref().filter(|a| a.sliced) else {
            return Ok(());
        };
        // A commit may still read borrowed memory (no lock guards it).
        self.wait_commit();
        for (i, buf) in self.buffers.iter().enumerate() {
            let part = &self.map.parts[i + 1];
            if a.held[i].len() as u64 == part.len {
                continue;
            }
            let len = buf.len();
            let mut g = buf.write();
            // Buffers of F32 only: the caller gathers others itself.
            if let Ok(all) = bytemuck::try_cast_slice_mut::<u8, f32>(g.bytes_mut(0..len)) {
                all_gather(all)?;
            }
        }
        Ok(())
    }

    /// Copies the sealed snapshot of `step` into the state buffers (taking
    /// their write locks) and returns its metadata block. With sliced
    /// snapshots only this rank's slice of a replicated part is restored:
    /// [`Runtime::rebuild_replicated`] completes it, or, for ranks on one
    /// host, [`Runtime::restore_sibling`] for each other rank.
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
        let mut guards: Vec<_> = self.buffers.iter().map(Buffer::write).collect();
        let mut outs: Vec<&mut [u8]> = vec![&mut meta[..]];
        for (g, held) in guards.iter_mut().zip(a.held.iter()) {
            outs.push(g.bytes_mut(held.clone()));
        }
        read_step(&a.store, step, &mut outs)?;
        drop(guards);
        a.store.page().set_step(step);
        Ok(meta)
    }

    /// The loop has finished at `step`: waits for the last snapshot and says
    /// whether it is sealed (true without an agent).
    pub fn finish(&self, step: u64) -> bool {
        let t = Instant::now();
        self.wait_commit();
        self.held_clock.add(t);
        self.close_held_step(false);
        let Some(a) = &self.attached else { return true };
        a.store.page().set_phase(Phase::Finished);
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
        // Its buffers' memory may be freed and reused after this: a memory
        // error there is no longer the state's to repair.
        for i in 1..=self.buffers.len() {
            crate::uce::register(i, std::ptr::null(), 0);
        }
        if let Some(mut a) = self.attached.take() {
            a.jobs.take(); // closes the commit channel
            a.stop.store(true, Ordering::SeqCst);
            a.store.page().wake_directive_waiters();
            for t in a.threads.drain(..) {
                let _ = t.join();
            }
        }
    }
}

/// Copies `store`'s sealed snapshot of `step` into `outs` (the slot's parts
/// in order), newest candidate first, each copy verified as it is made.
fn read_step(store: &Store, step: u64, outs: &mut [&mut [u8]]) -> Result<(), RuntimeError> {
    let mut last_err = None;
    for info in store.sealed().into_iter().filter(|i| i.step == step) {
        match store.read_slot(info.slot, outs) {
            Ok(read) if read.step == step => return Ok(()),
            Ok(read) => {
                last_err = Some(ShmError::BadSlot {
                    path: store.path().to_path_buf(),
                    slot: read.slot,
                    detail: format!("holds step {}, not {step}", read.step),
                })
            }
            Err(e) => last_err = Some(e),
        }
    }
    Err(match last_err {
        Some(e) => e.into(),
        None => RuntimeError::NoSnapshot {
            step,
            path: store.path().to_path_buf(),
        },
    })
}
