//! One host's job: the event loop around the recovery machine.
//!
//! The loop owns the workers (through the [`Supervisor`]), their snapshot
//! stores, the control socket and the persister. It decides nothing: it
//! gathers what happened into [`Event`]s for the [`Machine`] (worker exits,
//! the control pages read at every tick, registrations, memory errors,
//! `agentctl` requests, snapshot collections and written checkpoints,
//! shutdown) and carries out the [`Command`]s it returns (post a directive,
//! kill, restart, collect, write, answer, finish).
//!
//! INVARIANT: nothing slow runs on the loop's thread. Verifying every
//! rank's snapshots runs on a blocking thread, and checkpoints (periodic
//! saves and dumps) on the persister's writer thread, so exits are reaped,
//! signals seen and `agentctl` answered while gigabytes are hashed and
//! written. The tick has a deadline of its own, so a stream of requests
//! cannot starve the machine.
//!
//! - [`observe`]: control pages into [`RankView`]s and fault reports;
//! - [`requests`]: the control socket's requests (registration, status,
//!   injection);
//! - [`peers`]: joining the other agents of a job of several nodes
//!   (heartbeats, peer replicas);
//! - [`decider`]: who decides for the host: the job's controller (the
//!   machine runs here), or a follower of it on another host;
//! - [`orders`]: reports and orders between the hosts, and lost hosts;
//! - [`standby`]: a standby taking a lost host's ranks.

mod clock;
mod decider;

/// The job's controller as one machine, for what drives it from outside
/// the agent (the decision bench): see [`Controller::step`].
pub mod cluster {
    pub use super::decider::{
        Adopt, Controller, Down, Facts, Give, Input, Mirror, Ready, Rules, Up, WriteEnd, WritePart,
        WriteStart,
    };
}
mod device;
mod elastic;
mod kept;
mod lastwords;
mod observe;
mod orders;
mod peers;
mod relay;
mod requests;
mod role;
mod saves;
mod setup;
mod specs;
mod standby;
mod stragglers;
mod takeover;
#[cfg(test)]
mod tests;
mod verify;
mod warm;

use clock::job_clock;
use setup::{decider_for, stores_and_peers};
use specs::{SpecsFor, specs_for};

pub(crate) use kept::write_atomic;
pub use kept::{Kept, Served};
use observe::log;
pub use observe::root_cause;

use decider::Decider;
use orders::recv;
use verify::verify_side_by_side;

use crate::config::{LaunchConfig, LaunchError};
use crate::control::{self, ControlMsg};
use crate::jobdir::{self, JobDir};
use crate::oom::OomWatch;
use crate::output::RunDir;
use crate::persister::{self, Persister};
use crate::reaper::Reaper;
use crate::recovery::{Command, Event, MachineConfig, Outcome};
use crate::supervisor::{Spawner, Supervisor};
use hatrain_shared::control::{FaultRecord, PersistReport, Response};
use hatrain_shared::shm::{Directive, Store};
use hatrain_shared::statemap::StateMap;
use hatrain_shared::store::StoreServer;
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

/// What a finished job reports.
#[derive(Debug)]
pub struct JobReport {
    pub outcome: Outcome,
    pub faults: Vec<FaultRecord>,
    /// The last-words checkpoint written as the job stopped: its iteration
    /// and the save directory.
    pub last_words: Option<(u64, PathBuf)>,
    /// The final checkpoint the agent wrote for a job that succeeded (when
    /// it saves for the trainer), or why it could not.
    pub final_save: Option<Result<(u64, PathBuf), persister::PersistError>>,
    /// What the agent-side persister did.
    pub persist: Option<PersistReport>,
    /// How often the whole group was restarted.
    pub group_restarts: u32,
    /// What the failed worker's error file says ended it (its rank and
    /// message), when it wrote one.
    pub root_cause: Option<(usize, String)>,
    /// Other hosts of the job that were lost, in words.
    pub lost_hosts: Vec<String>,
    /// Why this host stopped, when no fault record says it.
    pub stop_reason: Option<String>,
}

/// Tick period while the job runs, and while a recovery or dump is in
/// progress (followed closely).
const TICK: Duration = Duration::from_millis(50);
const TICK_RECOVERING: Duration = Duration::from_millis(2);

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Runs one host's part of the job until it ends or `shutdown` fires.
pub async fn run(
    cfg: &LaunchConfig,
    shutdown: CancellationToken,
) -> Result<JobReport, LaunchError> {
    run_on(cfg, None, shutdown).await
}

/// Runs a job whose ranks' exec shims start its workers (`serve`), or
/// re-adopts one whose workers run already.
pub async fn run_served(
    cfg: &LaunchConfig,
    served: Served,
    shutdown: CancellationToken,
) -> Result<JobReport, LaunchError> {
    run_on(cfg, Some(served), shutdown).await
}

async fn run_on(
    cfg: &LaunchConfig,
    served: Option<Served>,
    shutdown: CancellationToken,
) -> Result<JobReport, LaunchError> {
    cfg.validate()?;
    let mut dir = match served.as_ref().is_some_and(|s| s.resume.is_some()) {
        true => JobDir::reopen(&cfg.ha.shm_root, &cfg.job_id)?,
        false => JobDir::open(&cfg.ha.shm_root, &cfg.job_id)?,
    };
    let logs = cfg.output.redirects.any() || cfg.output.tee.any();
    let run_dir = match RunDir::create(cfg.output.log_dir.as_deref(), cfg.job_id.as_str(), logs) {
        Ok(r) => r,
        Err(source) => {
            dir.remove();
            return Err(LaunchError::Io {
                path: cfg
                    .output
                    .log_dir
                    .clone()
                    .unwrap_or_else(std::env::temp_dir),
                source,
            });
        }
    };
    let path = dir.path().to_path_buf();
    let result = run_with(cfg, &mut dir, run_dir.path(), served, shutdown).await;
    // No shared memory is left behind, whatever happened.
    dir.remove();
    run_dir.finish();
    tracing::debug!(dir = %path.display(), "job folder removed");
    result
}

/// The snapshots of every rank, verified off the loop's thread.
#[derive(Debug)]
struct Collected {
    epoch: u64,
    steps: Vec<(usize, Vec<u64>)>,
    /// The replicas held of lost hosts' ranks, verified.
    replicas: Vec<(usize, Vec<u64>)>,
    rejected: Vec<(usize, String)>,
}

/// The loop's state: what it owns and what it has been asked.
struct Driver<'a> {
    cfg: &'a LaunchConfig,
    dir: &'a mut JobDir,
    /// When this agent started, on the monotonic clock (tokio's: paused in
    /// tests) and the wall clock.
    started: tokio::time::Instant,
    started_unix_s: f64,
    decider: Decider,
    stores: HashMap<usize, Arc<Store>>,
    maps: HashMap<usize, Arc<StateMap>>,
    /// The checkpoint writer, once a rank registered a checkpoint layout.
    persister: Option<Persister>,
    /// `agentctl dump` requests waiting for the dump to finish.
    dump_waiters: Vec<oneshot::Sender<Response>>,
    collected: mpsc::UnboundedSender<Collected>,
    outcome: Option<Outcome>,
    /// Why this host stopped, when no fault record says it.
    stop_reason: Option<String>,
    /// The store this agent hosts (the job's, on node 0; with several
    /// hosts every agent hosts one, in use while it controls the job): it
    /// outlives every worker.
    store: Option<StoreServer>,
    /// The workers' memory cgroups, to tell an OOM kill.
    oom: OomWatch,
    /// A group restart the machine asked for, carried out between events
    /// (it waits for the workers to stop).
    group_restart: Option<u32>,
    /// The other agents of a job of several nodes: heartbeats, and peer
    /// replicas (this host's snapshots streamed out, other hosts' held).
    peers: Option<peers::Peers>,
    /// Hosts already reported lost.
    lost: Vec<u64>,
    /// Registrations a follower answers once the controller acknowledged
    /// them: the reply, and the answer but for the start.
    unanswered: HashMap<usize, (oneshot::Sender<Response>, Response)>,
    /// Warm standbys waiting for a rank, oldest first: pid and reply.
    parked: std::collections::VecDeque<(u32, oneshot::Sender<Response>)>,
    /// The device fault sources' reports and decisions, newest last.
    device_faults: std::collections::VecDeque<hatrain_shared::control::DeviceFaultRecord>,
    /// The worker specs of the ranks named (a standby takes a lost
    /// host's, wherever they ran last).
    specs_for: SpecsFor<'a>,
    /// Ranks of a lost host this standby took, and those whose stores were
    /// filled from their replicas.
    adopted: BTreeSet<usize>,
    filled: BTreeSet<usize>,
    /// The steps the stores keep for the peer replicas, as the controller
    /// last said (`decider::hold`).
    kept: hatrain_shared::shm::Kept,
    /// The slow-rank detector over this host's ranks, and the findings
    /// handed over (`--on-slow replace`), by rank and first slow step.
    slow: crate::slow::Detector,
    slow_handed: BTreeSet<(usize, u64)>,
    /// Ranks this host took to join a growing group that have not
    /// registered yet: they start by waiting for the reshape that takes
    /// them in, whatever this host has heard of the controller so far.
    joining: BTreeSet<usize>,
    /// Per rank of this host, the leaving ranks whose replicas it brings to
    /// a shrink (elastic training).
    donations: std::collections::BTreeMap<usize, (u64, BTreeSet<usize>)>,
    /// Registrations of adopted ranks waiting for their replicas: the
    /// reply, the answer, and whether the rank has a checkpoint layout.
    filling: HashMap<usize, (oneshot::Sender<Response>, Response, bool)>,
    /// A served job's state file, kept for the next agent.
    keeper: Option<kept::Keeper>,
    /// This host leaves the job (its device is lost, or it holds the job
    /// back), and how the agent ends: the loop ends at once, as if the
    /// host had vanished.
    leaving: Option<LaunchError>,
}

impl<'a> Driver<'a> {
    /// The shell of a job whose ranks have registered nothing yet, decided
    /// by `decider`: no store, no peers, nothing kept.
    fn new(
        cfg: &'a LaunchConfig,
        dir: &'a mut JobDir,
        decider: Decider,
        specs_for: SpecsFor<'a>,
        collected: mpsc::UnboundedSender<Collected>,
    ) -> Self {
        let mut d = Self {
            cfg,
            dir,
            started: tokio::time::Instant::now(),
            started_unix_s: unix_now(),
            decider,
            stores: HashMap::new(),
            maps: HashMap::new(),
            persister: None,
            dump_waiters: Vec::new(),
            collected,
            outcome: None,
            stop_reason: None,
            store: None,
            oom: OomWatch::default(),
            group_restart: None,
            peers: None,
            lost: Vec::new(),
            unanswered: HashMap::new(),
            parked: Default::default(),
            device_faults: Default::default(),
            specs_for,
            adopted: BTreeSet::new(),
            filled: BTreeSet::new(),
            joining: BTreeSet::new(),
            kept: Default::default(),
            slow: Default::default(),
            slow_handed: BTreeSet::new(),
            donations: std::collections::BTreeMap::new(),
            filling: HashMap::new(),
            keeper: None,
            leaving: None,
        };
        let rules = d.rules();
        if let Decider::Controller(c) = &mut d.decider {
            c.rules = rules;
        }
        d
    }
}

async fn run_with(
    cfg: &LaunchConfig,
    dir: &mut JobDir,
    run_dir: &std::path::Path,
    served: Option<Served>,
    shutdown: CancellationToken,
) -> Result<JobReport, LaunchError> {
    let resume = served.as_ref().and_then(|s| s.resume.clone());
    // The job's secret: only its holders speak to the store and the ranks.
    // It reaches the workers in a 0600 file of the 0700 job folder.
    let (secret, secret_file) = kept::secret(cfg, dir, resume.is_some())?;
    let relay_stop = CancellationToken::new();
    let (store, peers, workers_store, store_addr) =
        stores_and_peers(cfg, dir, (&secret, resume.as_ref()), relay_stop.clone()).await?;
    let master_port = match (cfg.master_port, &resume) {
        (Some(p), _) => p,
        (None, Some(k)) => k.master_port,
        (None, None) => crate::config::free_port(&cfg.master_addr)?,
    };
    let socket = dir.path().join(jobdir::SOCKET);
    let scratch = dir.workers_dir()?.display().to_string();
    let (ctl_tx, mut ctl_rx) = mpsc::channel::<ControlMsg>(64);
    let ctl_stop = shutdown.child_token();
    dir.made(jobdir::SOCKET);
    control::serve(&socket, ctl_tx, ctl_stop.clone())?;
    // The reaper outlives the event loop: stopping the workers needs it.
    // Workers that exec shims start are theirs to reap.
    let reaper_stop = CancellationToken::new();
    let spawner = match &served {
        Some(s) => Spawner::Shims(Arc::clone(&s.shims)),
        None => Spawner::Own(Reaper::start(reaper_stop.clone())?),
    };
    let specs_for = specs_for(
        cfg,
        (master_port, workers_store),
        run_dir,
        [
            (hatrain_shared::control::ENV_WORKER_DIR, scratch),
            (
                hatrain_shared::control::ENV_SOCKET,
                socket.display().to_string(),
            ),
            (
                hatrain_shared::auth::ENV_SECRET_FILE,
                secret_file.display().to_string(),
            ),
        ],
    );
    // A standby starts no worker: it takes a lost host's ranks when told.
    let specs = if cfg.ha.standby {
        Vec::new()
    } else {
        let first = cfg.node_rank * cfg.nproc_per_node;
        specs_for(&(first..first + cfg.nproc_per_node).collect::<Vec<_>>())
    };
    if cfg.env_var("OMP_NUM_THREADS").is_none() && cfg.nproc_per_node > 1 {
        tracing::warn!(
            "OMP_NUM_THREADS is set to 1 for each worker, as torchrun does, so that the host is not overloaded; set it yourself to tune it"
        );
    }
    tracing::info!(
        world_size = cfg.world_size(),
        node_rank = cfg.node_rank,
        nproc = cfg.nproc_per_node,
        modes = ?cfg.ha.modes.names(),
        master = %format!("{}:{master_port}", cfg.master_addr),
        socket = %socket.display(),
        "starting workers"
    );
    let mut sup = match (&served, &resume) {
        (Some(s), Some(_)) => {
            let pids = s.shims.pids();
            Supervisor::resume(&specs, spawner, &pids, cfg.stop_grace, run_dir.into())
        }
        _ => {
            let (out, preload) = ((cfg.output.clone(), run_dir.to_path_buf()), &cfg.ha.preload);
            let mut sup = Supervisor::start(&specs, spawner, cfg.stop_grace, out, preload).await?;
            sup.keep_warm(cfg.ha.warm_standbys);
            sup
        }
    };
    let (device_tx, mut device_rx) = mpsc::channel(64);
    device::start(&mut sup, cfg, device_tx);
    let (collected_tx, mut collected_rx) = mpsc::unbounded_channel();
    let joined = peers.is_some();
    let (decider, interrupted) = decider_for(cfg, dir, resume.as_ref(), joined, sup.ranks());
    let mut peer_rx = peers.as_ref().and_then(|p| p.membership.take_inbox());
    let mut d = Driver::new(cfg, dir, decider, specs_for, collected_tx);
    d.store = store;
    d.peers = peers;
    d.keeper = served.map(|s| kept::Keeper::new(s.state_file, master_port, store_addr));
    if let Some(k) = &resume {
        d.resume(&sup, k)?;
        if interrupted {
            d.feed(&mut sup, Event::Interrupted);
        }
    }
    // Kept from the start: an agent that dies before its first tick leaves
    // its job to the next one.
    d.keep();
    for (rank, pid) in sup.running() {
        d.oom.started(rank, pid);
    }

    let mut next_tick = tokio::time::Instant::now();
    let mut shutdown_seen = false;
    let outcome = loop {
        if d.leaving.is_some() {
            break Outcome::Interrupted;
        }
        if let Some(o) = d.outcome {
            break o;
        }
        if let Some(restart) = d.group_restart.take() {
            d.restart_group(&mut sup, restart).await;
            continue;
        }
        let period = if d.decider.recovering() {
            TICK_RECOVERING
        } else {
            sup.release_refill();
            TICK
        };
        next_tick = next_tick.min(tokio::time::Instant::now() + period);
        tokio::select! {
            _ = shutdown.cancelled(), if !shutdown_seen => {
                shutdown_seen = true;
                d.feed(&mut sup, Event::Shutdown);
            }
            ev = sup.next_exit() => match ev {
                None => break Outcome::Interrupted,
                Some((rank, ev)) => {
                    // The machine judges an exit against fresh control pages.
                    let views = d.views(&sup);
                    d.feed(&mut sup, Event::Tick(views));
                    let cause = d.exit_cause(rank, ev.pid, ev.status);
                    d.feed(&mut sup, Event::Exited { rank, status: ev.status, cause });
                }
            },
            Some(msg) = ctl_rx.recv() => d.on_request(&mut sup, msg),
            Some(f) = device_rx.recv() => d.on_device_fault(&mut sup, f),
            Some(c) = collected_rx.recv() => d.on_collected(&mut sup, c),
            Some((from, bytes)) = recv(&mut peer_rx) => d.on_peer(&mut sup, from, &bytes),
            _ = tokio::time::sleep_until(next_tick) => {
                next_tick = tokio::time::Instant::now() + period;
                d.on_tick(&mut sup);
            }
        }
    };
    if let Some(left) = d.leaving.take() {
        // Its workers are gone; nothing is saved or said: the other hosts
        // see its connections drop, as from a vanished host.
        if let Some(p) = d.peers.take() {
            p.stop();
        }
        reaper_stop.cancel();
        relay_stop.cancel();
        ctl_stop.cancel();
        return Err(left);
    }
    // A job that succeeded ends with its final checkpoint on disk.
    let sources: Vec<persister::OwnedSource> =
        sup.ranks().iter().filter_map(|&r| d.source(r)).collect();
    let mut final_save = match d.persister.as_mut() {
        Some(p) if outcome == Outcome::Succeeded && p.periodic() && p.in_parts() => {
            let own = d.final_share(&sources);
            match &d.decider {
                Decider::Follower(_) => Some(d.await_final(&mut sup, &mut peer_rx, own).await),
                // The controller's, once the followers' shares are in.
                Decider::Controller(_) => None,
            }
        }
        Some(p) if outcome == Outcome::Succeeded && p.periodic() => p.finish(&sources).transpose(),
        Some(p) => {
            p.wait();
            None
        }
        None => None,
    };
    sup.stop_all().await;
    d.wait_for_followers(&mut sup, &mut peer_rx).await;
    if let Some(committed) = d.final_committed() {
        d.final_settled();
        final_save = Some(committed);
    }
    let mut lost_hosts: Vec<String> = d
        .decider
        .faults()
        .iter()
        .filter(|f| {
            f.kind == hatrain_shared::control::FaultKind::HostLost && f.recovery_s.is_none()
        })
        .map(|f| format!("ranks {:?}: {}; {}", f.ranks, f.detail, f.reason))
        .collect();
    let controls = matches!(d.decider, Decider::Controller(_));
    if outcome != Outcome::Succeeded && d.peers.is_some() && controls && lost_hosts.is_empty() {
        // A host that dies takes its peers' collectives down at once, often
        // before its heartbeats are missed: wait out the host timeout, so
        // the summary names the host rather than only the rank that failed
        // here.
        let deadline = Instant::now() + cfg.ha.host_timeout + Duration::from_millis(500);
        while lost_hosts.is_empty() && Instant::now() < deadline {
            for l in d.take_lost_hosts() {
                lost_hosts.push(format!("ranks {:?}: {}", l.ranks, l.detail));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let root_cause = match outcome {
        Outcome::WorkerFailed { rank, .. } => sup
            .ranks()
            .iter()
            .position(|&r| r == rank)
            .and_then(|lr| root_cause(&crate::spec::error_file(run_dir, sup.attempt(), lr)))
            .map(|m| (rank, m)),
        _ => None,
    };
    if let Some(p) = d.peers.take() {
        // Its replica stores go before the job folder does.
        p.stop();
    }
    reaper_stop.cancel();
    relay_stop.cancel();
    ctl_stop.cancel();
    for w in d.dump_waiters.drain(..) {
        let _ = w.send(Response::Error {
            message: "the job ended".into(),
        });
    }
    Ok(JobReport {
        outcome,
        faults: d.decider.faults().to_vec(),
        last_words: d.decider.last_words().map(|w| (w.iteration, w.dir.clone())),
        final_save,
        persist: d.persister.as_ref().map(Persister::report),
        group_restarts: d.decider.group_restarts(),
        root_cause,
        lost_hosts,
        stop_reason: d.stop_reason.take(),
    })
}

/// The recovery machine's configuration, from the launch's.
fn machine_config(cfg: &LaunchConfig) -> MachineConfig {
    MachineConfig {
        modes: cfg.ha.modes,
        restart: cfg.ha.policy,
        hang: cfg.ha.hang,
        pause_timeout: cfg.ha.pause_timeout,
        group_restarts: cfg.group_restarts,
        register_timeout: cfg.ha.register_timeout,
        min_nodes: cfg.ha.min_nodes,
    }
}

impl Driver<'_> {
    /// The machine's clock: the time since the job started. This agent
    /// may have started later than the job (a successor, or the next agent
    /// of a served job), so its own uptime is moved by the difference of
    /// the two starts; the wall clock is read once, at this agent's start.
    fn now(&self) -> Duration {
        let uptime = self.started.elapsed();
        match &self.decider {
            Decider::Controller(c) => {
                job_clock(uptime, self.started_unix_s, c.machine.started_unix_s())
            }
            Decider::Follower(_) => uptime,
        }
    }

    /// A rank's store and map, for the persister (when it has a layout).
    fn source(&self, rank: usize) -> Option<persister::OwnedSource> {
        let map = self.maps.get(&rank)?;
        map.checkpoint.as_ref()?;
        Some(persister::OwnedSource {
            rank,
            store: Arc::clone(self.stores.get(&rank)?),
            map: Arc::clone(map),
            sliced: self.cfg.ha.slices,
        })
    }

    /// Carries out one command; some produce an event at once.
    fn carry_out(&mut self, sup: &mut Supervisor, c: Command) -> Option<Event> {
        match c {
            Command::Post { rank, directive } => {
                if matches!(directive, Directive::Reshape { .. }) {
                    self.retire_lost();
                }
                if let Some(s) = self.stores.get(&rank) {
                    s.page().post(directive);
                }
                None
            }
            Command::Kill { rank } => {
                sup.kill(rank);
                None
            }
            Command::Respawn { rank, restarts } => match self.restart_rank(sup, rank, restarts) {
                Ok((pid, standby)) => {
                    tracing::info!(rank, pid, restarts, standby, "replacement started");
                    self.oom.started(rank, pid);
                    None
                }
                Err(e) => Some(Event::SpawnFailed {
                    rank,
                    error: crate::error_chain(&e),
                }),
            },
            Command::Collect { epoch } => {
                self.collect(epoch);
                None
            }
            Command::Donate { step, leaving } => {
                self.donate(sup, step, leaving);
                None
            }
            Command::Write { epoch, step } => {
                let sources: Vec<persister::OwnedSource> =
                    sup.ranks().iter().filter_map(|&r| self.source(r)).collect();
                match self.persister.as_mut() {
                    Some(p) => {
                        p.dump(epoch, step, sources, persister::Share::Whole);
                        // Started at once when the writer is idle.
                        self.poll_persister(sup)
                    }
                    None => Some(Event::Written {
                        epoch,
                        result: Err("no rank registered a checkpoint layout".into()),
                    }),
                }
            }
            Command::DumpDone(result) => {
                let response = match result {
                    Ok(w) => Response::Dumped {
                        iteration: Some(w.iteration),
                        dir: Some(w.dir.clone()),
                        message: if w.written {
                            format!(
                                "last-words checkpoint of iteration {} written to {} in {:.3} s; resume with --load {}",
                                w.iteration,
                                hatrain_shared::checkpoint::iter_dir(&w.dir, w.iteration).display(),
                                w.seconds,
                                w.dir.display()
                            )
                        } else {
                            format!(
                                "iteration {} is already on disk in {}; resume with --load {}",
                                w.iteration,
                                hatrain_shared::checkpoint::iter_dir(&w.dir, w.iteration).display(),
                                w.dir.display()
                            )
                        },
                    },
                    Err(why) => Response::Dumped {
                        iteration: None,
                        dir: None,
                        message: why.to_string(),
                    },
                };
                for w in self.dump_waiters.drain(..) {
                    let _ = w.send(response.clone());
                }
                None
            }
            Command::RestartGroup { restart } => {
                self.group_restart = Some(restart);
                None
            }
            Command::Finish(outcome) => {
                self.outcome = Some(outcome);
                None
            }
        }
    }

    /// Stops every worker and starts the group again (torchrun's restart).
    /// The loop waits for the workers to stop: at most the grace period,
    /// then the SIGKILL.
    async fn restart_group(&mut self, sup: &mut Supervisor, restart: u32) {
        tracing::warn!(
            restart,
            limit = self.cfg.group_restarts,
            "stopping every worker to restart the group"
        );
        match sup.restart_all(restart).await {
            Ok(started) => {
                for (rank, pid) in started {
                    self.oom.started(rank, pid);
                }
                tracing::info!(restart, "the group is started again");
            }
            Err(e) => {
                let rank = match &e {
                    crate::supervisor::SupervisorError::Spawn { rank, .. }
                    | crate::supervisor::SupervisorError::Output { rank, .. }
                    | crate::supervisor::SupervisorError::NotHere { rank } => *rank,
                };
                let error = crate::error_chain(&e);
                self.feed(sup, Event::SpawnFailed { rank, error });
            }
        }
    }

    /// Verifies every rank's snapshots on a blocking thread; the result
    /// comes back on the `collected` channel.
    fn collect(&self, epoch: u64) {
        let stores: Vec<(usize, Arc<Store>)> = self
            .stores
            .iter()
            .map(|(r, s)| (*r, Arc::clone(s)))
            .collect();
        // The replicas held of ranks no live host holds (with their maps):
        // what a checkpoint takes those ranks from.
        let orphans = match &self.decider {
            Decider::Controller(c) => c.orphans(),
            Decider::Follower(f) => f.orphans.clone(),
        };
        let replicas: Vec<(usize, Arc<Store>)> = self
            .peers
            .as_ref()
            .and_then(|p| p.replicator.as_ref())
            .map(|r| {
                orphans
                    .iter()
                    .filter_map(|&rank| Some((rank, r.replica(rank)?.0)))
                    .collect()
            })
            .unwrap_or_default();
        let tx = self.collected.clone();
        tokio::task::spawn_blocking(move || {
            let mut rejected = Vec::new();
            let mut verify = |stores: Vec<(usize, Arc<Store>)>| {
                let mut steps = Vec::new();
                for (rank, (ok, bad)) in verify_side_by_side(&stores) {
                    steps.push((rank, ok));
                    rejected.extend(bad.into_iter().map(|e| (rank, e.to_string())));
                }
                steps
            };
            let steps = verify(stores);
            let replicas = verify(replicas);
            let _ = tx.send(Collected {
                epoch,
                steps,
                replicas,
                rejected,
            });
        });
    }

    fn on_tick(&mut self, sup: &mut Supervisor) {
        if let Some(e) = self.poll_persister(sup) {
            self.feed(sup, e);
        }
        for e in self.take_uces(sup) {
            self.feed(sup, e);
        }
        for e in self.take_rebuild_failures(sup) {
            self.feed(sup, e);
        }
        let lost = self.take_lost_hosts();
        self.on_hosts_lost(sup, lost);
        self.follow_successor(sup);
        self.shutdown_unanswered();
        self.fill_adopted(sup);
        self.tick_views(sup);
        self.keep();
        self.watch_slow(sup);
    }
}
