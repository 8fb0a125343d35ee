//! One host's job: the agent's event loop.
//!
//! It owns the workers (through the [`Supervisor`]), their snapshot stores,
//! the control socket and the recovery state machine, and reacts to four
//! things: a worker exit, a control request, a tick, and shutdown.
//!
//! # Recovery (worker reboot)
//!
//! When a worker dies and [`recovery::on_exit`] says to restart it:
//! 1. the dead rank is started again in place (its store, and so its
//!    sealed snapshots, survive it);
//! 2. a new epoch is opened and `Pause` is posted to every rank's control
//!    page; survivors abort their communicator, finish their snapshot copy
//!    and acknowledge; the replacement registers and acknowledges;
//! 3. once every rank is paused, s\* is computed from the verified slots of
//!    all ranks ([`recovery::consistent_step`]) and `Resume { epoch, s* }`
//!    is posted: ranks whose live state is not exactly s\* restore it from
//!    shared memory, and all rebuild their communicator under the new epoch;
//! 4. recovery is complete when every rank has completed step s\*+1; the
//!    time from detection to then is the fault's recovery time.
//!
//! A second fault during recovery opens another epoch and pauses again. A
//! recovery that cannot finish (a rank does not pause, no common step) stops
//! the job with the reason.

use crate::control::{self, ControlMsg};
use crate::gpu::GpuFault;
use crate::launch::{LaunchConfig, LaunchError};
use crate::persister;
use crate::reaper::{ExitEvent, Reaper};
use crate::recovery::{self, ExitDecision, RankHistory};
use crate::supervisor::{Outcome, Supervisor};
use hatrain_shared::checkpoint;
use hatrain_shared::control::{
    FaultKind, FaultRecord, InjectKind, PersistReport, Request, Response, SnapshotReport,
    StartMode, StatusReport, WorkerReport,
};
use hatrain_shared::shm::{self, Directive, FaultFlags, Geometry, Injection, Phase, Store};
use hatrain_shared::statemap::StateMap;
use hatrain_shared::store::StoreServer;
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// What a finished job reports.
#[derive(Debug, Clone)]
pub struct JobReport {
    pub outcome: Outcome,
    pub faults: Vec<FaultRecord>,
    /// The last-words checkpoint written as the job stopped: its iteration
    /// and directory.
    pub last_words: Option<(u64, PathBuf)>,
    /// The final checkpoint the agent wrote for a job that succeeded (when
    /// it saves for the trainer), or why it could not.
    pub final_save: Option<Result<(u64, PathBuf), String>>,
    /// What the agent-side persister did.
    pub persist: Option<PersistReport>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RecoveryPhase {
    Pausing,
    Resuming { s_star: u64 },
}

#[derive(Debug)]
struct Recovery {
    epoch: u64,
    phase: RecoveryPhase,
    /// Indices into the fault list of the faults this recovery repairs.
    faults: Vec<usize>,
    /// Highest step any rank had completed when the first fault was seen.
    max_step: u64,
    deadline: Instant,
    pause_seq: HashMap<usize, u64>,
}

struct JobState<'a> {
    cfg: &'a LaunchConfig,
    dir: PathBuf,
    started: Instant,
    epoch: u64,
    stores: HashMap<usize, Arc<Store>>,
    history: HashMap<usize, RankHistory>,
    faults: Vec<FaultRecord>,
    detected: Vec<Instant>,
    recovery: Option<Recovery>,
    registrations: HashMap<usize, Arc<StateMap>>,
    watch: HashMap<usize, Progress>,
    /// Recent step durations, over all ranks (for the adaptive hang bound).
    step_samples: VecDeque<Duration>,
    /// Ranks killed as hung, with what was seen, until they are reaped.
    hung: HashMap<usize, String>,
    /// The agent-side checkpoint writer, once a rank asked for saves.
    persister: Option<persister::Persister>,
}

/// A rank found without progress.
#[derive(Debug, Clone, Copy)]
struct Stalled {
    rank: usize,
    pid: i32,
    stalled_for: Duration,
    bound: Duration,
    phase: Phase,
    in_collective: bool,
    step: u64,
}

/// The hang watchdog's view of one rank.
#[derive(Debug, Clone, Copy)]
struct Progress {
    step: u64,
    heartbeat: u64,
    since: Instant,
    last_step_at: Instant,
    steps_seen: u64,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Creates the job's shared-memory directory (mode 0700), clearing what a
/// killed earlier agent of the same job left there.
fn prepare_dir(dir: &Path) -> Result<(), LaunchError> {
    use std::os::unix::fs::DirBuilderExt;
    let io = |source| LaunchError::Io {
        path: dir.to_path_buf(),
        source,
    };
    if dir.exists() {
        tracing::warn!(dir = %dir.display(), "removing a stale store directory of this job");
        std::fs::remove_dir_all(dir).map_err(io)?;
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io)
}

/// Runs one host's part of the job until it ends or `shutdown` fires.
pub async fn run(
    cfg: &LaunchConfig,
    shutdown: CancellationToken,
) -> Result<JobReport, LaunchError> {
    cfg.validate()?;
    let dir = cfg.ha.shm_root.join(&cfg.job_id);
    prepare_dir(&dir)?;
    let result = run_in(cfg, &dir, shutdown).await;
    // No shared memory is left behind, whatever happened.
    if let Err(e) = std::fs::remove_dir_all(&dir) {
        tracing::error!(dir = %dir.display(), error = %e, "cannot remove the store directory");
    }
    result
}

async fn run_in(
    cfg: &LaunchConfig,
    dir: &Path,
    shutdown: CancellationToken,
) -> Result<JobReport, LaunchError> {
    // The rendezvous store lives as long as this function: it outlives every
    // worker.
    let (_store, port) = if cfg.node_rank == 0 {
        let addr = crate::launch::resolve(&cfg.master_addr, cfg.master_port.unwrap_or(0))?;
        let store = StoreServer::bind(addr).map_err(LaunchError::Store)?;
        let port = store.local_addr().port();
        tracing::info!(addr = %store.local_addr(), "rendezvous store listening");
        (Some(store), port)
    } else {
        (
            None,
            cfg.master_port.expect("validated: set with several nodes"),
        )
    };
    let socket = dir.join("agent.sock");
    let (ctl_tx, mut ctl_rx) = mpsc::channel::<ControlMsg>(64);
    let ctl_stop = shutdown.child_token();
    control::serve(&socket, ctl_tx, ctl_stop.clone())?;
    // The reaper outlives the event loop: stopping the workers needs it.
    let reaper_stop = CancellationToken::new();
    let reaper = Reaper::start(reaper_stop.clone())?;
    let mut specs = cfg.worker_specs(port);
    for s in &mut specs {
        s.env.push((
            hatrain_shared::control::ENV_SOCKET.into(),
            socket.display().to_string(),
        ));
    }
    tracing::info!(
        world_size = cfg.world_size(),
        node_rank = cfg.node_rank,
        nproc = cfg.nproc_per_node,
        modes = ?cfg.ha.modes.names(),
        socket = %socket.display(),
        "starting workers"
    );
    let mut sup = Supervisor::start(&specs, &reaper, cfg.stop_grace).await?;
    let (gpu_tx, mut gpu_rx) = mpsc::channel::<GpuFault>(16);
    crate::gpu::watch(gpu_tx);
    let mut st = JobState {
        cfg,
        dir: dir.to_path_buf(),
        started: Instant::now(),
        epoch: 0,
        stores: HashMap::new(),
        history: HashMap::new(),
        faults: Vec::new(),
        detected: Vec::new(),
        recovery: None,
        registrations: HashMap::new(),
        watch: HashMap::new(),
        step_samples: VecDeque::new(),
        hung: HashMap::new(),
        persister: None,
    };

    enum Event {
        Shutdown,
        Exit(Option<(usize, ExitEvent)>),
        Control(ControlMsg),
        Gpu(GpuFault),
        Tick,
    }
    // INVARIANT: the tick has a deadline of its own, so a stream of other
    // events (control requests) cannot starve the watchdog and recovery.
    let mut next_tick = tokio::time::Instant::now();
    let outcome = loop {
        if st.recovery.is_some() {
            // A recovery in progress is followed closely.
            next_tick = next_tick.min(tokio::time::Instant::now() + Duration::from_millis(2));
        }
        let event = tokio::select! {
            _ = shutdown.cancelled() => Event::Shutdown,
            ev = sup.next_exit() => Event::Exit(ev),
            Some(msg) = ctl_rx.recv() => Event::Control(msg),
            Some(f) = gpu_rx.recv() => Event::Gpu(f),
            _ = tokio::time::sleep_until(next_tick) => {
                let period = if st.recovery.is_some() { 2 } else { 50 };
                next_tick = tokio::time::Instant::now() + Duration::from_millis(period);
                Event::Tick
            }
        };
        match event {
            Event::Shutdown => {
                tracing::warn!("shutdown requested: stopping the workers");
                break Outcome::Interrupted;
            }
            Event::Exit(None) => break Outcome::Interrupted,
            Event::Exit(Some((rank, ev))) => {
                if let Some(outcome) = st.on_exit(&mut sup, rank, ev) {
                    break outcome;
                }
            }
            Event::Gpu(f) => st.on_gpu_fault(&sup, f),
            Event::Control(msg) if msg.request == Request::Dump => {
                let response = st.dump(&sup, true).await;
                let _ = msg.reply.send(response);
            }
            Event::Control(msg) => {
                let response = st.on_request(&sup, msg.request);
                let _ = msg.reply.send(response);
            }
            Event::Tick => {
                st.persist(&sup);
                if let Some(outcome) = st.progress(&sup) {
                    break outcome;
                }
                if st.recovery.is_none() && cfg.ha.modes.any() {
                    if let Some(outcome) = st.watch_uces(&sup) {
                        break outcome;
                    }
                    st.watch_hangs(&sup);
                }
            }
        }
    };
    // A job that succeeded ends with its final checkpoint on disk; whatever
    // else stopped it, the newest consistent state goes to disk first when
    // the dump mode is on.
    let final_save = match st.persister.as_mut() {
        Some(p) if outcome == Outcome::Succeeded => {
            let sources: Vec<persister::OwnedSource> = sup
                .ranks()
                .iter()
                .filter_map(|&r| owned_source(&st.stores, &st.registrations, r))
                .collect();
            p.finish(&sources).transpose()
        }
        Some(p) => {
            p.wait();
            None
        }
        None => None,
    };
    let mut last_words = None;
    if cfg.ha.modes.dump
        && outcome != Outcome::Succeeded
        && let Response::Dumped {
            iteration: Some(it),
            dir: Some(dir),
            ..
        } = st.dump(&sup, false).await
    {
        last_words = Some((it, dir));
    }
    sup.stop_all().await;
    reaper_stop.cancel();
    ctl_stop.cancel();
    Ok(JobReport {
        outcome,
        faults: st.faults,
        last_words,
        final_save,
        persist: st.persister.as_ref().map(persister::Persister::report),
    })
}

/// The injection `agentctl inject` asks for, against a rank's state map:
/// a UCE goes into the part named `buffer` (default: the largest part).
pub fn injection(
    map: &StateMap,
    kind: InjectKind,
    buffer: Option<&str>,
    offset: u64,
) -> Result<Injection, String> {
    Ok(match kind {
        InjectKind::Crash => Injection::Crash,
        InjectKind::Hang => Injection::Hang,
        InjectKind::Uce => {
            let part = match buffer {
                Some(name) => map.part(name).ok_or_else(|| {
                    let names: Vec<&str> = map.parts.iter().map(|p| p.name.as_str()).collect();
                    format!("no state part named {name:?}; the rank's parts are {names:?}")
                })?,
                None => map
                    .largest_part()
                    .ok_or("the rank registered no state parts")?,
            };
            Injection::Uce {
                part: part as u64,
                offset,
            }
        }
    })
}

/// A rank's store and registered layout, for the persister.
fn owned_source(
    stores: &HashMap<usize, Arc<Store>>,
    registrations: &HashMap<usize, Arc<StateMap>>,
    rank: usize,
) -> Option<persister::OwnedSource> {
    let map = registrations.get(&rank)?;
    map.checkpoint.as_ref()?;
    Some(persister::OwnedSource {
        rank,
        store: Arc::clone(stores.get(&rank)?),
        map: Arc::clone(map),
    })
}

impl JobState<'_> {
    /// Starts the next periodic save when every rank holds its step.
    fn persist(&mut self, sup: &Supervisor) {
        let (stores, regs) = (&self.stores, &self.registrations);
        if let Some(p) = self.persister.as_mut() {
            p.poll(sup.ranks(), |r| owned_source(stores, regs, r));
        }
    }

    /// Whether the agent writes this rank's checkpoints: with `--save`, one
    /// host holding every rank, and unless `--trainer-saves`. The first such
    /// registration sets up the persister.
    fn agent_saves(&mut self, rank: usize, map: &StateMap) -> Result<bool, String> {
        let Some(info) = map.checkpoint.as_ref() else {
            return Ok(false);
        };
        let dir = info.dir.clone();
        if self.cfg.ha.trainer_saves {
            return Ok(false);
        }
        if self.cfg.nnodes > 1 {
            if self.persister.is_none() && rank == self.cfg.node_rank * self.cfg.nproc_per_node {
                tracing::info!(
                    "checkpoints are saved by the trainer: the agent writes them only when one host holds every rank"
                );
            }
            return Ok(false);
        }
        match &self.persister {
            Some(p) if p.dir() != dir => Err(format!(
                "rank {rank} saves into {} but other ranks into {}",
                dir.display(),
                p.dir().display()
            )),
            Some(_) => Ok(true),
            None => {
                tracing::info!(
                    dir = %dir.display(),
                    interval = info.interval,
                    "checkpoints are written by the agent from the snapshots"
                );
                self.persister = Some(persister::Persister::new(
                    dir,
                    info.interval,
                    info.world_size,
                ));
                Ok(true)
            }
        }
    }

    fn on_exit(&mut self, sup: &mut Supervisor, rank: usize, ev: ExitEvent) -> Option<Outcome> {
        let crash_step = self.stores.get(&rank).map_or(0, |s| s.page().step());
        let now = self.started.elapsed();
        let history = self.history.entry(rank).or_default();
        let (decision, reason) = recovery::on_exit(
            now,
            rank,
            ev.status,
            crash_step,
            sup.running().len(),
            history,
            &self.cfg.ha.modes,
            &self.cfg.ha.policy,
        );
        match decision {
            ExitDecision::Wait => {
                tracing::info!(rank, pid = ev.pid, status = %ev.status, %reason, "worker exited");
                None
            }
            ExitDecision::Finished => {
                tracing::info!(rank, pid = ev.pid, %reason, "job finished");
                Some(Outcome::Succeeded)
            }
            ExitDecision::Stop { rank, .. } => {
                tracing::error!(rank, pid = ev.pid, status = %ev.status, %reason, "worker failed");
                self.record_fault(
                    vec![rank],
                    FaultKind::Crash,
                    ev.status.to_string(),
                    "stop the job".into(),
                    reason,
                );
                Some(Outcome::WorkerFailed {
                    rank,
                    status: ev.status,
                })
            }
            ExitDecision::Restart { rank } => {
                history.record_restart(now, crash_step, &self.cfg.ha.policy);
                let restarts = history.restarts;
                tracing::warn!(rank, pid = ev.pid, status = %ev.status, %reason, "worker failed: recovering");
                let (kind, detail) = self.what_failed(rank, ev);
                let fault = self.record_fault(
                    vec![rank],
                    kind,
                    detail,
                    format!("restart rank {rank} in place (restart {restarts})"),
                    reason,
                );
                match sup.respawn(rank, restarts) {
                    Ok(pid) => tracing::info!(rank, pid, restarts, "replacement started"),
                    Err(e) => {
                        tracing::error!(rank, error = %e, "cannot restart the rank");
                        self.faults[fault].action = format!("stop the job: {e}");
                        return Some(Outcome::WorkerFailed {
                            rank,
                            status: ev.status,
                        });
                    }
                }
                self.begin_recovery(fault);
                None
            }
        }
    }

    /// The kind and detail of a failed rank's fault: a hang the watchdog
    /// acted on, or a crash.
    fn what_failed(&mut self, rank: usize, ev: ExitEvent) -> (FaultKind, String) {
        if let Some(seen) = self.hung.remove(&rank) {
            let kind = if seen.starts_with("SIGBUS") {
                FaultKind::Uce
            } else {
                FaultKind::Hang
            };
            return (kind, format!("{seen}; then {}", ev.status));
        }
        let flags = self
            .stores
            .get(&rank)
            .map_or(FaultFlags::empty(), |s| s.page().faults().0);
        if flags.contains(FaultFlags::UCE_FATAL) {
            if let Some(s) = self.stores.get(&rank) {
                s.page().clear_faults(FaultFlags::UCE_FATAL);
            }
            return (
                FaultKind::Uce,
                format!(
                    "SIGBUS BUS_MCEERR outside the registered state: the process could not trust its memory; {}",
                    ev.status
                ),
            );
        }
        (FaultKind::Crash, ev.status.to_string())
    }

    /// A GPU memory error: its rank is asked to treat it as a UCE in its
    /// state, so the step is recomputed from s\* (see [`crate::gpu`]).
    fn on_gpu_fault(&mut self, sup: &Supervisor, f: GpuFault) {
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let local = crate::gpu::local_rank_of(f.device, visible.as_deref(), sup.ranks().len());
        match local
            .map(|l| sup.ranks()[l])
            .and_then(|r| Some((r, self.stores.get(&r)?)))
        {
            Some((rank, store)) => {
                tracing::warn!(
                    rank,
                    device = f.device,
                    xid = f.xid,
                    "GPU uncorrectable memory error: handled as a UCE"
                );
                let part = self
                    .registrations
                    .get(&rank)
                    .and_then(|m| m.largest_part())
                    .unwrap_or(0) as u64;
                store.page().inject(Injection::Uce { part, offset: 0 }, 0);
            }
            None => tracing::warn!(
                device = f.device,
                xid = f.xid,
                "GPU memory error on a device no local rank uses"
            ),
        }
    }

    /// UCE reports in the control pages: with step repair (`retry`) every
    /// rank returns to s\* and the step is recomputed, with no process
    /// restarted; without it, worker reboot replaces the rank; without
    /// either, the job stops (after the last-words dump).
    fn watch_uces(&mut self, sup: &Supervisor) -> Option<Outcome> {
        let hit: Vec<(usize, u64, u64)> = sup
            .ranks()
            .iter()
            .filter_map(|r| {
                let s = self.stores.get(r)?;
                let (flags, site) = s.page().faults();
                flags.contains(FaultFlags::UCE_REPAIRABLE).then(|| {
                    s.page().clear_faults(FaultFlags::UCE_REPAIRABLE);
                    (*r, site.offset, site.part)
                })
            })
            .collect();
        for (rank, offset, part) in hit {
            let name = self
                .registrations
                .get(&rank)
                .and_then(|m| m.parts.get(part as usize))
                .map_or("?".into(), |p| p.name.clone());
            let detail = format!("SIGBUS BUS_MCEERR in {name} at byte {offset}");
            let modes = self.cfg.ha.modes;
            if modes.retry {
                let reason = format!(
                    "rank {rank}: uncorrectable memory error in {name}: every rank returns to s* and recomputes (no restart)"
                );
                tracing::warn!(rank, %detail, %reason, "UCE: step repair");
                let f = self.record_fault(
                    vec![rank],
                    FaultKind::Uce,
                    detail,
                    "restore s* and recompute the step".into(),
                    reason,
                );
                self.begin_recovery(f);
            } else if modes.recover {
                let reason = format!(
                    "rank {rank}: uncorrectable memory error in {name}, step repair not enabled: rebooting the rank"
                );
                tracing::warn!(rank, %detail, %reason, "UCE: worker reboot");
                if let Some(pid) = sup.pid(rank) {
                    self.hung.insert(rank, detail);
                    crate::supervisor::signal(pid, nix::sys::signal::Signal::SIGKILL);
                }
            } else {
                let reason = format!(
                    "rank {rank}: uncorrectable memory error in {name} and no repair is enabled"
                );
                tracing::error!(rank, %detail, %reason, "UCE: stopping the job");
                self.record_fault(
                    vec![rank],
                    FaultKind::Uce,
                    detail,
                    "stop the job".into(),
                    reason,
                );
                return Some(Outcome::RecoveryFailed);
            }
        }
        None
    }

    /// The hang watchdog: a rank without progress (a completed step or a
    /// step-boundary heartbeat) for longer than the bound is killed, and its
    /// exit is handled as a crash. Ranks waiting in a collective are waiting
    /// for the hung one and are spared while some rank is not waiting.
    fn watch_hangs(&mut self, sup: &Supervisor) {
        let now = Instant::now();
        let mut sorted: Vec<Duration> = self.step_samples.iter().copied().collect();
        sorted.sort();
        let median = sorted.get(sorted.len() / 2).copied();
        let mut stalled = Vec::new();
        for &rank in sup.ranks() {
            let (Some(pid), Some(store)) = (sup.pid(rank), self.stores.get(&rank)) else {
                self.watch.remove(&rank);
                continue;
            };
            let (step, beat) = (store.page().step(), store.page().heartbeat());
            let p = self.watch.entry(rank).or_insert(Progress {
                step,
                heartbeat: beat,
                since: now,
                last_step_at: now,
                steps_seen: 0,
            });
            if step > p.step {
                let n = u32::try_from(step - p.step).unwrap_or(u32::MAX);
                self.step_samples.push_back((now - p.last_step_at) / n);
                if self.step_samples.len() > 256 {
                    self.step_samples.pop_front();
                }
                p.steps_seen += u64::from(n);
                p.last_step_at = now;
            }
            if step != p.step || beat != p.heartbeat {
                p.since = now;
                p.step = step;
                p.heartbeat = beat;
            }
            if self.hung.contains_key(&rank) {
                continue;
            }
            let bound = recovery::hang_bound(&self.cfg.ha.hang, median, p.steps_seen);
            let stalled_for = now - p.since;
            if stalled_for > bound {
                stalled.push(Stalled {
                    rank,
                    pid,
                    stalled_for,
                    bound,
                    phase: store.page().phase(),
                    in_collective: store.page().in_collective(),
                    step,
                });
            }
        }
        let culprits: Vec<Stalled> = if stalled.iter().any(|s| !s.in_collective) {
            stalled.into_iter().filter(|s| !s.in_collective).collect()
        } else {
            stalled
        };
        for s in culprits {
            let seen = format!(
                "no progress for {:.1} s (bound {:.1} s) in phase {:?}{} after step {}",
                s.stalled_for.as_secs_f64(),
                s.bound.as_secs_f64(),
                s.phase,
                if s.in_collective {
                    ", waiting in a collective"
                } else {
                    ""
                },
                s.step
            );
            tracing::error!(rank = s.rank, pid = s.pid, %seen, "rank hung: killing it");
            crate::supervisor::signal(s.pid, nix::sys::signal::Signal::SIGKILL);
            self.hung.insert(s.rank, seen);
        }
    }

    fn record_fault(
        &mut self,
        ranks: Vec<usize>,
        kind: FaultKind,
        detail: String,
        action: String,
        reason: String,
    ) -> usize {
        self.faults.push(FaultRecord {
            id: self.faults.len() as u64 + 1,
            ranks,
            kind,
            detail,
            detected_unix_s: unix_now(),
            s_star: None,
            action,
            recovery_s: None,
            steps_lost: None,
            reason,
        });
        self.detected.push(Instant::now());
        self.faults.len() - 1
    }

    /// Opens a new epoch and pauses every rank.
    fn begin_recovery(&mut self, fault: usize) {
        self.epoch += 1;
        let epoch = self.epoch;
        let pause_seq: HashMap<usize, u64> = self
            .stores
            .iter()
            .map(|(&rank, s)| (rank, s.page().post(Directive::Pause { epoch })))
            .collect();
        let max_step = self
            .stores
            .values()
            .map(|s| s.page().step())
            .max()
            .unwrap_or(0);
        let deadline = Instant::now() + self.cfg.ha.pause_timeout;
        tracing::info!(epoch, "pausing every rank for recovery");
        match self.recovery.as_mut() {
            Some(r) => {
                r.faults.push(fault);
                r.epoch = epoch;
                r.phase = RecoveryPhase::Pausing;
                r.pause_seq = pause_seq;
                r.deadline = deadline;
            }
            None => {
                self.recovery = Some(Recovery {
                    epoch,
                    phase: RecoveryPhase::Pausing,
                    faults: vec![fault],
                    max_step,
                    deadline,
                    pause_seq,
                });
            }
        }
    }

    /// Advances the recovery state machine; `Some` ends the job.
    fn progress(&mut self, sup: &Supervisor) -> Option<Outcome> {
        let r = self.recovery.as_mut()?;
        let ranks = sup.ranks().to_vec();
        let now = Instant::now();
        match r.phase {
            RecoveryPhase::Pausing => {
                let waiting: Vec<usize> = ranks
                    .iter()
                    .copied()
                    .filter(|rank| {
                        let paused = self.stores.get(rank).is_some_and(|s| {
                            r.pause_seq
                                .get(rank)
                                .is_some_and(|seq| s.page().acknowledged() >= *seq)
                                && s.page().phase() == Phase::Paused
                        });
                        !(paused && sup.pid(*rank).is_some())
                    })
                    .collect();
                if !waiting.is_empty() {
                    if now > r.deadline {
                        return Some(self.fail(format!(
                            "rank(s) {waiting:?} did not pause within {:?}",
                            self.cfg.ha.pause_timeout
                        )));
                    }
                    return None;
                }
                let per_rank: Vec<Vec<u64>> = ranks
                    .iter()
                    .map(|rank| {
                        let (ok, rejected) = self.stores[rank].verified_steps();
                        for e in rejected {
                            tracing::warn!(rank, error = %e, "snapshot slot rejected");
                        }
                        ok
                    })
                    .collect();
                let Some(s_star) = recovery::consistent_step(&per_rank) else {
                    return Some(self.fail(format!(
                        "no step has a sealed, verified snapshot on every rank (per rank: {per_rank:?})"
                    )));
                };
                let epoch = r.epoch;
                for rank in &ranks {
                    self.stores[rank].page().post(Directive::Resume {
                        epoch,
                        step: s_star,
                    });
                }
                for &f in &r.faults {
                    self.faults[f].s_star = Some(s_star);
                }
                tracing::info!(s_star, epoch, snapshots = ?per_rank, "every rank paused: resuming from s*");
                r.phase = RecoveryPhase::Resuming { s_star };
                r.deadline = now + self.cfg.ha.pause_timeout * 2;
                None
            }
            RecoveryPhase::Resuming { s_star } => {
                let done = ranks.iter().all(|rank| {
                    self.stores
                        .get(rank)
                        .is_some_and(|s| s.page().step() > s_star && s.page().epoch() == r.epoch)
                });
                if !done {
                    if now > r.deadline {
                        let why = format!(
                            "ranks did not complete step {} under epoch {} in time",
                            s_star + 1,
                            r.epoch
                        );
                        return Some(self.fail(why));
                    }
                    return None;
                }
                let lost = r.max_step.saturating_sub(s_star);
                for &f in &r.faults {
                    let secs = self.detected[f].elapsed().as_secs_f64();
                    self.faults[f].recovery_s = Some(secs);
                    self.faults[f].steps_lost = Some(lost);
                    tracing::info!(
                        fault = self.faults[f].id,
                        ranks = ?self.faults[f].ranks,
                        s_star,
                        steps_lost = lost,
                        recovery_s = secs,
                        "recovered: first step after the fault completed"
                    );
                }
                self.recovery = None;
                // Paused time is not a hang.
                self.watch.clear();
                None
            }
        }
    }

    fn fail(&mut self, why: String) -> Outcome {
        tracing::error!(reason = %why, "recovery failed: stopping the job");
        if let Some(r) = self.recovery.take() {
            for f in r.faults {
                self.faults[f].action =
                    format!("{}; recovery failed: {why}", self.faults[f].action);
            }
        }
        Outcome::RecoveryFailed
    }

    fn on_request(&mut self, sup: &Supervisor, req: Request) -> Response {
        match req {
            Request::Register { rank, pid, map } => {
                if let Err(e) = map.validate() {
                    return Response::Error {
                        message: format!("rank {rank}: {e}"),
                    };
                }
                let agent_saves = match self.agent_saves(rank, &map) {
                    Ok(yes) => yes,
                    Err(message) => return Response::Error { message },
                };
                let r = self.register(sup, rank, pid, &map, agent_saves);
                if matches!(r, Response::Registered { .. }) {
                    self.registrations.insert(rank, Arc::new(map));
                }
                r
            }
            Request::Dump => Response::Error {
                message: "dump is handled by the event loop".into(),
            },
            Request::Inject {
                rank,
                fault,
                buffer,
                offset,
                at_step,
            } => match self.stores.get(&rank) {
                Some(store) if sup.pid(rank).is_some() => {
                    let done = store.page().step();
                    if let Some(at) = at_step.filter(|at| *at <= done) {
                        return Response::Error {
                            message: format!(
                                "rank {rank} has completed step {done}; --at-step {at} must be later"
                            ),
                        };
                    }
                    let Some(map) = self.registrations.get(&rank) else {
                        return Response::Error {
                            message: format!("rank {rank} has not registered yet"),
                        };
                    };
                    let injection = match injection(map, fault, buffer.as_deref(), offset) {
                        Ok(i) => i,
                        Err(message) => return Response::Error { message },
                    };
                    if !store.page().inject(injection, at_step.unwrap_or(0)) {
                        return Response::Error {
                            message: format!(
                                "rank {rank} has not yet taken the fault injected before; try again"
                            ),
                        };
                    }
                    tracing::warn!(rank, ?fault, ?at_step, "fault injected on request");
                    Response::Injected {
                        message: match at_step {
                            Some(at) => {
                                format!("rank {rank} will give itself a {fault:?} at step {at}")
                            }
                            None => {
                                format!("rank {rank} will give itself a {fault:?} at its next step")
                            }
                        },
                    }
                }
                _ => Response::Error {
                    message: format!("rank {rank} is not a running, registered rank of this host"),
                },
            },
            Request::Status => Response::Status(StatusReport {
                job: self.cfg.job_id.clone(),
                world_size: self.cfg.world_size(),
                local_ranks: self.cfg.nproc_per_node,
                epoch: self.epoch,
                modes: self.cfg.ha.modes,
                uptime_s: self.started.elapsed().as_secs_f64(),
                recovering: self.recovery.is_some(),
                workers: self.workers(sup),
                faults: self.faults.clone(),
                persist: self.persister.as_ref().map(persister::Persister::report),
            }),
            Request::Workers => Response::Workers(self.workers(sup)),
            Request::Faults => Response::Faults(self.faults.clone()),
        }
    }

    fn register(
        &mut self,
        sup: &Supervisor,
        rank: usize,
        pid: u32,
        map: &StateMap,
        agent_saves: bool,
    ) -> Response {
        if !sup.ranks().contains(&rank) {
            return Response::Error {
                message: format!(
                    "rank {rank} is not one of this host's ranks {:?}",
                    sup.ranks()
                ),
            };
        }
        let Some(total) = map.total_bytes() else {
            return Response::Error {
                message: "state size overflows".into(),
            };
        };
        let Ok(total) = usize::try_from(total) else {
            return Response::Error {
                message: format!("state of {total} bytes does not fit this host"),
            };
        };
        let layout = map.layout_hash();
        let reuse = self
            .stores
            .get(&rank)
            .is_some_and(|s| s.page().layout_hash() == layout && s.geometry().capacity >= total);
        if !reuse {
            let path = shm::store_path(&self.dir, rank);
            let geometry = Geometry::new(self.cfg.ha.slots, total);
            match Store::create(
                &path,
                rank,
                geometry,
                layout,
                shm::hash_str(&self.cfg.job_id),
            ) {
                Ok(s) => {
                    tracing::info!(rank, pid, bytes = total, slots = geometry.slots, path = %path.display(), "snapshot store created");
                    self.stores.insert(rank, Arc::new(s));
                }
                Err(e) => {
                    return Response::Error {
                        message: e.to_string(),
                    };
                }
            }
        }
        let store = &self.stores[&rank];
        let start = match self.recovery.as_mut() {
            Some(r) => {
                if !r.pause_seq.contains_key(&rank) {
                    let seq = store.page().post(Directive::Pause { epoch: r.epoch });
                    r.pause_seq.insert(rank, seq);
                }
                StartMode::AwaitDirective
            }
            None => StartMode::Fresh { epoch: self.epoch },
        };
        tracing::info!(rank, pid, ?start, "worker registered");
        Response::Registered {
            store: store.path().to_path_buf(),
            start,
            // Ranks wait on a failed collective whenever the agent may pause
            // them: for a recovery or for a last-words dump.
            recover: self.cfg.ha.modes.any(),
            agent_saves,
        }
    }

    /// The last-words dump: pauses the running ranks (so no snapshot copy
    /// runs), finds s\* over every rank's verified slots, writes it as a
    /// checkpoint into the trainer's `--save` directory, and, with `resume`,
    /// lets the ranks go on from s\*.
    async fn dump(&mut self, sup: &Supervisor, resume: bool) -> Response {
        let dumped = |iteration, dir, message: String| Response::Dumped {
            iteration,
            dir,
            message,
        };
        if !self.cfg.ha.modes.dump {
            return Response::Error {
                message:
                    "the last-words dump needs --enable-high-availability (or HIGH_AVAILABILITY)"
                        .into(),
            };
        }
        if self.recovery.is_some() {
            return Response::Error {
                message: "a recovery is in progress; try again when it is done".into(),
            };
        }
        let save_dir = self
            .registrations
            .values()
            .find_map(|m| m.checkpoint.as_ref().map(|c| c.dir.clone()));
        let Some(dir) = save_dir else {
            let m = "no last-words checkpoint: the trainer has no --save directory".to_string();
            tracing::warn!("{m}");
            return dumped(None, None, m);
        };
        // One writer at a time in the save directory.
        if let Some(p) = self.persister.as_mut() {
            p.wait();
        }
        let on_disk = self
            .persister
            .as_ref()
            .and_then(persister::Persister::last_saved);
        self.epoch += 1;
        let epoch = self.epoch;
        let t0 = Instant::now();
        let running: Vec<usize> = sup
            .ranks()
            .iter()
            .copied()
            .filter(|r| sup.pid(*r).is_some() && self.stores.contains_key(r))
            .collect();
        let seqs: Vec<(usize, u64)> = running
            .iter()
            .map(|r| (*r, self.stores[r].page().post(Directive::Pause { epoch })))
            .collect();
        let deadline = Instant::now() + self.cfg.ha.pause_timeout;
        loop {
            let waiting: Vec<usize> = seqs
                .iter()
                .filter(|(r, seq)| {
                    let s = &self.stores[r];
                    !(s.page().acknowledged() >= *seq && s.page().phase() == Phase::Paused)
                })
                .map(|(r, _)| *r)
                .collect();
            if waiting.is_empty() {
                break;
            }
            if Instant::now() > deadline {
                tracing::warn!(
                    ?waiting,
                    "ranks did not pause; dumping from their verified slots anyway"
                );
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let ranks = sup.ranks().to_vec();
        let per_rank: Vec<Vec<u64>> = ranks
            .iter()
            .map(|r| {
                self.stores
                    .get(r)
                    .map_or_else(Vec::new, |s| s.verified_steps().0)
            })
            .collect();
        // Ok((s*, the iteration on disk, its directory, whether written now)).
        let result = match recovery::consistent_step(&per_rank) {
            None => Err(format!(
                "no step has a verified snapshot on every rank (per rank: {per_rank:?}); nothing written, the previous checkpoint is untouched"
            )),
            // The periodic save already wrote it (or, after a corrupt
            // snapshot, a newer consistent step): the tracker stays.
            Some(s_star) if let Some(d) = on_disk.filter(|d| *d >= s_star) => {
                Ok((s_star, d, checkpoint::iter_dir(&dir, d), false))
            }
            Some(s_star) => {
                let sources: Result<Vec<persister::RankSource<'_>>, String> = ranks
                    .iter()
                    .map(|r| match (self.stores.get(r), self.registrations.get(r)) {
                        (Some(store), Some(map)) if map.checkpoint.is_some() => {
                            Ok(persister::RankSource {
                                rank: *r,
                                store,
                                map,
                            })
                        }
                        _ => Err(format!("rank {r} did not register a checkpoint layout")),
                    })
                    .collect();
                sources
                    .and_then(|src| {
                        persister::write_checkpoint(&src, s_star, &dir).map_err(|e| e.to_string())
                    })
                    .map(|path| (s_star, s_star, path, true))
            }
        };
        match result {
            Ok((s_star, iteration, path, written)) => {
                let m = if written {
                    format!(
                        "last-words checkpoint of iteration {iteration} written to {} in {:.3} s; resume with --load {}",
                        path.display(),
                        t0.elapsed().as_secs_f64(),
                        dir.display()
                    )
                } else {
                    format!(
                        "iteration {iteration} is already on disk in {} (the newest consistent step is {s_star}); resume with --load {}",
                        path.display(),
                        dir.display()
                    )
                };
                tracing::warn!("{m}");
                if resume {
                    for r in &running {
                        self.stores[r].page().post(Directive::Resume {
                            epoch,
                            step: s_star,
                        });
                    }
                }
                dumped(Some(iteration), Some(dir), m)
            }
            Err(m) => {
                tracing::error!(reason = %m, "last-words checkpoint failed");
                if resume {
                    // The ranks go on from where they are: each keeps or
                    // restores its own newest common step.
                    if let Some(s) = recovery::consistent_step(&per_rank) {
                        for r in &running {
                            self.stores[r]
                                .page()
                                .post(Directive::Resume { epoch, step: s });
                        }
                    }
                }
                dumped(None, None, m)
            }
        }
    }

    fn workers(&self, sup: &Supervisor) -> Vec<WorkerReport> {
        let now_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        sup.ranks()
            .iter()
            .enumerate()
            .map(|(local_rank, &rank)| {
                let s = self.stores.get(&rank);
                let last = s.and_then(|s| s.sealed().into_iter().next());
                let stats = s.map(|s| s.page().commit_stats());
                let (commit_ns, block_ns, commits) =
                    stats.map_or((0, 0, 0), |c| (c.last_ns, c.last_blocking_ns, c.commits));
                WorkerReport {
                    rank,
                    local_rank,
                    pid: sup.pid(rank),
                    phase: s.map_or(Phase::Starting, |s| s.page().phase()),
                    step: s.map_or(0, |s| s.page().step()),
                    epoch: s.map_or(0, |s| s.page().epoch()),
                    heartbeat: s.map_or(0, |s| s.page().heartbeat()),
                    restarts: self.history.get(&rank).map_or(0, |h| u64::from(h.restarts)),
                    last_snapshot: last.map(|i| SnapshotReport {
                        step: i.step,
                        age_s: now_ns.saturating_sub(i.sealed_at_unix_ns) as f64 / 1e9,
                        bytes: i.len,
                    }),
                    last_commit_ms: (commits > 0).then(|| commit_ns as f64 / 1e6),
                    last_commit_blocking_ms: (commits > 0).then(|| block_ns as f64 / 1e6),
                }
            })
            .collect()
    }
}
