//! The control socket's requests: a worker's registration (its store and
//! state map), `agentctl` status, workers and faults, fault injection, and
//! `agentctl dump` (answered when the machine's dump is done).

use super::{Decider, Driver};
use crate::control::ControlMsg;
use crate::persister::Persister;
use crate::recovery::Event;
use crate::supervisor::Supervisor;
use hatrain_shared::control::{
    CopyReport, HeldTimeReport, InjectKind, MembershipReport, ReplicaReport, Request, Response,
    SnapshotReport, StartMode, StatusReport, WorkerReport,
};
use hatrain_shared::shm::{self, Geometry, Injection, Phase, StepTimesReport, Store};
use hatrain_shared::statemap::StateMap;
use hatrain_shared::store::StoreServer;
use std::sync::Arc;

/// Most snapshot slots a worker may ask for (`Register::slots`).
const MAX_ASKED_SLOTS: usize = 4;
use std::time::{SystemTime, UNIX_EPOCH};

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("no state part named {name:?}; the rank's parts are {parts:?}")]
    NoSuchPart { name: String, parts: Vec<String> },
    #[error("rank {rank} saves into {dir} but other ranks into {others}")]
    SaveDirs {
        rank: usize,
        dir: String,
        others: String,
    },
}

/// The injection `agentctl inject` asks for, against a rank's state map:
/// a UCE goes into the part named `buffer` (default: the largest part).
pub fn injection(
    map: &StateMap,
    kind: InjectKind,
    buffer: Option<&str>,
    offset: u64,
) -> Result<Injection, RequestError> {
    Ok(match kind {
        InjectKind::Crash => Injection::Crash,
        InjectKind::Hang => Injection::Hang,
        InjectKind::Uce => {
            let part = match buffer {
                Some(name) => map.part(name).ok_or_else(|| RequestError::NoSuchPart {
                    name: name.to_string(),
                    parts: map.parts.iter().map(|p| p.name.clone()).collect(),
                })?,
                // A validated map has at least one part.
                None => map.largest_part().unwrap_or(0),
            };
            Injection::Uce {
                part: part as u64,
                offset,
            }
        }
    })
}

/// Why a rank's snapshot store cannot be made on this host.
#[derive(Debug)]
pub(super) struct Unfit(String);

/// Bytes that an unprivileged user may still write to the file system of
/// `path` (statvfs(3): available blocks × fragment size).
pub fn space_left(path: &std::path::Path) -> std::io::Result<u64> {
    let v = nix::sys::statvfs::statvfs(path)?;
    Ok(v.blocks_available() as u64 * v.fragment_size() as u64)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// The refusal of a store that does not fit: the root, the bytes needed
/// and free, and the flags that change them.
pub fn unfit_message(
    root: &std::path::Path,
    needed: u64,
    free: u64,
    stores: u64,
    geometry: Geometry,
) -> String {
    format!(
        "the shm root {} has {free} bytes ({}) free, but {stores} snapshot store(s) of {} slots of {} need {needed} bytes ({}): give a --shm-root with more room, or fewer --snapshot-slots (at least 2)",
        root.display(),
        mib(free),
        geometry.slots,
        mib(geometry.capacity as u64),
        mib(needed),
    )
}

impl Driver<'_> {
    /// A rank's registration, as the machine takes it.
    pub(super) fn registered_event(&self, rank: usize, checkpoint: bool) -> Event {
        Event::Registered {
            rank,
            checkpoint,
            global_batch: self.maps.get(&rank).and_then(|m| m.global_batch),
        }
    }

    pub(super) fn on_request(&mut self, sup: &mut Supervisor, msg: ControlMsg) {
        let response = match msg.request {
            Request::Dump => {
                // Answered when the dump is done (or refused).
                self.dump_waiters.push(msg.reply);
                self.feed(sup, Event::DumpRequested);
                return;
            }
            Request::Register {
                rank,
                pid,
                map,
                slots,
            } => {
                let r = match self.register(sup, rank, pid, map, slots) {
                    Ok(r) => r,
                    Err(Unfit(reason)) => {
                        let _ = msg.reply.send(Response::Error {
                            message: reason.clone(),
                        });
                        self.feed(sup, Event::Unfit { rank, reason });
                        return;
                    }
                };
                if matches!(r, Response::Registered { .. }) {
                    let checkpoint = self.maps.get(&rank).is_some_and(|m| m.checkpoint.is_some());
                    if self.adopted.contains(&rank) && !self.filled.contains(&rank) {
                        // A lost host's rank on this standby: its store is
                        // filled from its replica before it goes on.
                        self.filling.insert(rank, (msg.reply, r, checkpoint));
                        self.fill_adopted(sup);
                        return;
                    }
                    match self.decider {
                        // A follower answers once the controller knows the
                        // rank, with the start it says: a fault decided on
                        // meanwhile then counts the rank as protected, and
                        // a replacement joins the recovery in progress.
                        Decider::Follower(_) => {
                            if let Some((old, _)) = self.unanswered.insert(rank, (msg.reply, r)) {
                                let _ = old.send(Response::Error {
                                    message: format!("rank {rank} registered again"),
                                });
                            }
                        }
                        Decider::Controller(_) => {
                            let _ = msg.reply.send(r);
                        }
                    }
                    self.feed(sup, self.registered_event(rank, checkpoint));
                    return;
                }
                r
            }
            Request::Standby { pid } => {
                self.park_standby(sup, pid, msg.reply);
                return;
            }
            Request::Donations { rank, step } => self.donations(rank, step),
            Request::Reshape {
                rank,
                pid,
                epoch,
                map,
            } => self.reshape(sup, rank, pid, epoch, map),
            Request::Inject {
                rank,
                fault,
                buffer,
                offset,
                at_step,
            } => self.inject(sup, rank, fault, buffer.as_deref(), offset, at_step),
            Request::Status => Response::Status(Box::new(self.status(sup))),
            Request::Workers => Response::Workers(self.workers(sup)),
            Request::Faults => Response::Faults(self.decider.faults().to_vec()),
            Request::DeviceFaults => Response::DeviceFaults(self.device_fault_records()),
        };
        let _ = msg.reply.send(response);
    }

    /// Whether the agent writes this rank's periodic checkpoints: with a
    /// checkpoint layout, unless `--trainer-saves`. The first layout sets
    /// up the persister (which also writes the dumps); in a job of several
    /// hosts it writes this host's share of each, which the controller
    /// commits.
    pub(super) fn set_up_persister(
        &mut self,
        rank: usize,
        map: &StateMap,
    ) -> Result<bool, RequestError> {
        let Some(info) = map.checkpoint.as_ref() else {
            return Ok(false);
        };
        // Several hosts share a checkpoint through their controller: with
        // a mode on, or they have none.
        let periodic =
            !self.cfg.ha.trainer_saves && (self.cfg.nnodes == 1 || self.cfg.ha.modes.any());
        match &self.persister {
            Some(p) if p.dir() != info.dir => Err(RequestError::SaveDirs {
                rank,
                dir: info.dir.display().to_string(),
                others: p.dir().display().to_string(),
            }),
            Some(p) => Ok(p.periodic()),
            None => {
                if periodic {
                    tracing::info!(
                        dir = %info.dir.display(),
                        interval = info.interval,
                        "checkpoints are written by the agent from the snapshots"
                    );
                }
                let p = Persister::new(info.dir.clone(), info.interval, info.world_size, periodic);
                self.persister = Some(if self.cfg.nnodes > 1 { p.in_part() } else { p });
                Ok(periodic)
            }
        }
    }

    /// Registers a rank: its state map, and its store (made at its first
    /// registration, reused by its replacements). `Err` when the store
    /// cannot be made: the job cannot run on this host.
    fn register(
        &mut self,
        sup: &Supervisor,
        rank: usize,
        pid: u32,
        map: StateMap,
        slots: Option<usize>,
    ) -> Result<Response, Unfit> {
        let refuse = |message: String| Ok(Response::Error { message });
        if !sup.ranks().contains(&rank) {
            return refuse(format!(
                "rank {rank} is not one of this host's ranks {:?}",
                sup.ranks()
            ));
        }
        if let Err(e) = map.validate() {
            return refuse(format!("rank {rank}: {e}"));
        }
        let agent_saves = match self.set_up_persister(rank, &map) {
            Ok(yes) => yes,
            Err(e) => return refuse(e.to_string()),
        };
        // Validated: the map's bytes fit this host.
        let sliced = self.cfg.ha.slices && map.has_replicated();
        let total = map.slot_bytes(sliced) as usize;
        let layout = map.slot_layout_hash(sliced);
        let reuse = self
            .stores
            .get(&rank)
            .is_some_and(|s| s.page().layout_hash() == layout && s.geometry().capacity >= total);
        if !reuse {
            let name = format!("rank_{rank:05}.shm");
            // The worker's loop may need more slots than the flag gives
            // (bounded: each is a whole copy of its state).
            let slots = self
                .cfg
                .ha
                .slots
                .max(slots.unwrap_or(0).min(MAX_ASKED_SLOTS));
            let geometry = Geometry::new(slots, total);
            let root = self.dir.root().to_path_buf();
            if self.stores.is_empty() {
                // INVARIANT: before the first store is made, the space for
                // every store of this host is checked at once (each sized
                // like this rank's: shards differ by a page at most), so a
                // job that cannot fit is refused before any rank trains.
                // Space taken after the check makes a later creation fail
                // with ENOSPC (the pages are reserved, never left sparse).
                let stores = sup.ranks().len() as u64;
                let needed = geometry.file_len() as u64 * stores;
                match space_left(&root) {
                    Ok(free) if free < needed => {
                        return Err(Unfit(unfit_message(&root, needed, free, stores, geometry)));
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(root = %root.display(), error = %e, "cannot tell the space left in the shm root")
                    }
                }
            }
            let created =
                self.dir
                    .create(&name)
                    .map_err(|e| e.to_string())
                    .and_then(|(file, path)| {
                        Store::create_in(
                        file,
                        &path,
                        rank,
                        geometry,
                        layout,
                        shm::hash_str(self.cfg.job_id.as_str()),
                    )
                    .map_err(|e| match e {
                        shm::ShmError::NoSpace {
                            bytes,
                            path,
                            source,
                        } => format!(
                            "cannot reserve the snapshot store of rank {rank} ({}: {source}); {}",
                            path.display(),
                            unfit_message(
                                &root,
                                bytes,
                                space_left(&root).unwrap_or(0),
                                1,
                                geometry,
                            )
                        ),
                        e => format!("cannot make the snapshot store of rank {rank}: {e}"),
                    })
                    });
            match created {
                Ok(s) => {
                    tracing::info!(rank, pid, bytes = total, sliced, slots = geometry.slots, path = %s.path().display(), "snapshot store created");
                    s.page().set_kept(self.kept);
                    self.stores.insert(rank, Arc::new(s));
                }
                Err(e) => {
                    // Whatever the creation made is gone already.
                    self.dir.forget(&name);
                    return Err(Unfit(e));
                }
            }
        }
        let start = if self.joining.remove(&rank) {
            StartMode::AwaitDirective
        } else {
            self.decider.start_mode()
        };
        tracing::info!(rank, pid, ?start, "worker registered");
        if let Some(r) = self.peers.as_ref().and_then(|p| p.replicator.as_ref()) {
            // The replicas go with the map that says what their bytes are
            // (sent again when a replacement registers).
            match serde_json::to_vec(&map) {
                Ok(json) => r.add_rank(rank, Arc::clone(&self.stores[&rank]), Some(json.into())),
                Err(e) => {
                    tracing::error!(rank, error = %e, "state map not encoded for the replicas");
                    r.add_rank(rank, Arc::clone(&self.stores[&rank]), None);
                }
            }
        }
        self.maps.insert(rank, Arc::new(map));
        Ok(Response::Registered {
            store: self.stores[&rank].path().to_path_buf(),
            start,
            // Ranks wait on a failed collective whenever the agent may pause
            // them: for a recovery or for a last-words dump.
            recover: self.cfg.ha.modes.any(),
            agent_saves,
            sliced,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn inject(
        &self,
        sup: &Supervisor,
        rank: usize,
        fault: InjectKind,
        buffer: Option<&str>,
        offset: u64,
        at_step: Option<u64>,
    ) -> Response {
        let refuse = |message: String| Response::Error { message };
        let (Some(store), Some(map), Some(_)) =
            (self.stores.get(&rank), self.maps.get(&rank), sup.pid(rank))
        else {
            return refuse(format!(
                "rank {rank} is not a running, registered rank of this host"
            ));
        };
        let done = store.page().step();
        if let Some(at) = at_step.filter(|at| *at <= done) {
            return refuse(format!(
                "rank {rank} has completed step {done}; --at-step {at} must be later"
            ));
        }
        let injection = match injection(map, fault, buffer, offset) {
            Ok(i) => i,
            Err(e) => return refuse(e.to_string()),
        };
        if !store.page().inject(injection, at_step.unwrap_or(0)) {
            return refuse(format!(
                "rank {rank} has not yet taken the fault injected before; try again"
            ));
        }
        tracing::warn!(rank, ?injection, ?at_step, "fault injected on request");
        Response::Injected {
            message: match at_step {
                Some(at) => format!("rank {rank} will give itself a {fault:?} at step {at}"),
                None => format!("rank {rank} will give itself a {fault:?} at its next step"),
            },
        }
    }

    fn status(&self, sup: &Supervisor) -> StatusReport {
        StatusReport {
            job: self.cfg.job_id.to_string(),
            world_size: self.decider.world_size().unwrap_or(self.cfg.world_size()),
            local_ranks: self.cfg.nproc_per_node,
            epoch: self.decider.epoch(),
            modes: self.cfg.ha.modes,
            uptime_s: self.started.elapsed().as_secs_f64(),
            recovering: self.decider.recovering(),
            activity: Some(self.decider.activity()),
            store: self.store.as_ref().map(StoreServer::stats),
            store_addr: self.store.as_ref().map(|s| s.local_addr().to_string()),
            workers: self.workers(sup),
            step_time_s: self.decider.median_step().map(|d| d.as_secs_f64()),
            slow: self.slow.findings().to_vec(),
            faults: self.decider.faults().to_vec(),
            persist: self
                .persister
                .as_ref()
                .filter(|p| p.periodic())
                .map(Persister::report),
            replicas: self
                .peers
                .as_ref()
                .and_then(|p| p.replicator.as_ref())
                .map(|r| ReplicaReport {
                    kept: self.kept,
                    ..r.report()
                }),
            membership: self.peers.as_ref().map(|p| {
                let seen = p.membership.seen();
                let lost = seen.lost();
                MembershipReport {
                    listen: p.membership.endpoint().to_string(),
                    starting: seen
                        .view
                        .lost
                        .iter()
                        .copied()
                        .filter(|n| !lost.contains(n))
                        .collect(),
                    live: seen.view.live,
                    lost,
                    follows: seen.view.follows,
                    acting: seen.view.acting,
                    term: seen.view.term,
                    waiting_faults: match &self.decider {
                        Decider::Controller(c) => c.waiting.as_ref().map_or(0, |w| w.events.len()),
                        Decider::Follower(_) => 0,
                    },
                }
            }),
            resizes: self.decider.resizes().to_vec(),
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
                    restarts: u64::from(self.decider.restarts(rank)),
                    last_snapshot: last.map(|i| SnapshotReport {
                        step: i.step,
                        age_s: now_ns.saturating_sub(i.sealed_at_unix_ns) as f64 / 1e9,
                        bytes: i.len,
                    }),
                    last_commit_ms: (commits > 0).then(|| commit_ns as f64 / 1e6),
                    last_commit_blocking_ms: (commits > 0).then(|| block_ns as f64 / 1e6),
                    protected: self.decider.protected(rank),
                    held_time: s.and_then(|s| HeldTimeReport::of(&s.page().held_stats())),
                    copies: stats.as_ref().and_then(CopyReport::of),
                    step_times: s.and_then(|s| StepTimesReport::of(&s.page().step_times())),
                }
            })
            .collect()
    }
}
