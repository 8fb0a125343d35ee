//! `hatrain-train`, the reference trainer: a small language model trained
//! with AdamW on a synthetic Markov-chain token stream, data-parallel over
//! `WORLD_SIZE` processes with a ZeRO-1 sharded optimizer.
//!
//! One step, on every rank:
//! 1. draw the global batch's sequence seeds from the sampler RNG (every rank
//!    draws all of them, so the RNG state is the same everywhere) and build
//!    this rank's slice of the batch;
//! 2. forward and backward over the full parameters;
//! 3. reduce-scatter the gradients (sum, then divide by `W`);
//! 4. AdamW on this rank's shard only: its moments exist on no other rank;
//! 5. all-gather the updated parameters.
//!
//! Everything is bit-for-bit deterministic for a given seed and world size.
//! The training state is [`TrainState`]: the flat parameters, this rank's two
//! moment shards, the step, the sampler RNG and the data position.

mod args;
mod disk;
mod local;
mod recover;
mod reshape;

pub use args::TrainArgs;

use crate::checkpoint::{self as ck, SaveTo};
use crate::collective::{CollectiveError, Communicator};
use crate::config::ModelConfig;
use crate::data::{MarkovChain, SplitMix64};
use crate::dist::{Dist, DistEnv};
use crate::emulate::Device;
use crate::faults::{ENV_FAULT_PLAN, FaultPlan, PlanError, Point};
use crate::model::{Model, ModelError};
use crate::optim::AdamW;
use hatrain_shared::checkpoint::{self, CheckpointError};
use hatrain_shared::shard::shard_range;
use hatrain_shared::shm::Directive;
use hatrain_shared::statemap::StateMap;
use hatrain_shared::store::RendezvousError;
use hatrain_worker::runtime::{CommitOf, Donated, Runtime, RuntimeError, SharedBuf, Start};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

/// Seeds of the independent random streams, derived from `--seed`.
const STREAM_INIT: u64 = 0x1A17;
const STREAM_DATA: u64 = 0xDA7A;
const STREAM_SAMPLER: u64 = 0x5A3B;

/// How long building a communicator may take before the rank gives up.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("invalid environment: {0}")]
    Env(String),
    #[error("invalid arguments: {0}")]
    Args(String),
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("cannot load the checkpoint")]
    Load(#[source] CheckpointError),
    #[error("saving iteration {iteration} failed; the previous checkpoint is intact")]
    Save {
        iteration: u64,
        #[source]
        source: CheckpointError,
    },
    #[error(
        "saving iteration {iteration} failed on rank(s) {ranks:?}; the previous checkpoint is intact"
    )]
    SaveElsewhere { iteration: u64, ranks: Vec<usize> },
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("the job's secret")]
    Secret(#[from] hatrain_shared::auth::AuthError),
    #[error("stopped by the agent")]
    Stopped,
    #[error("an uncorrectable memory error tore the state and step repair is not enabled")]
    Uce,
    #[error("cannot write the log {path}")]
    Log {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Everything that must survive for training to resume exactly. The large
/// buffers are shared with the runtime, which snapshots them.
#[derive(Debug, Clone)]
pub struct TrainState {
    /// The full flat parameter buffer (identical on every rank).
    pub params: SharedBuf,
    /// This rank's shard of the first AdamW moment.
    pub exp_avg: SharedBuf,
    /// This rank's shard of the second AdamW moment.
    pub exp_avg_sq: SharedBuf,
    pub scalars: Scalars,
}

/// The small part of the state: it lives in the snapshot's metadata block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scalars {
    /// Completed steps.
    pub step: u64,
    /// The sampler RNG.
    pub rng: SplitMix64,
    /// Sequences consumed.
    pub data_position: u64,
}

/// Size of [`Scalars`] in a snapshot: three little-endian u64.
pub const META_LEN: usize = ck::META_LEN as usize;

impl Scalars {
    pub fn encode(&self) -> Vec<u8> {
        [self.step, self.rng.state, self.data_position]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()
    }

    pub fn decode(b: &[u8]) -> Option<Self> {
        let word = |i: usize| {
            Some(u64::from_le_bytes(
                b.get(i * 8..i * 8 + 8)?.try_into().ok()?,
            ))
        };
        Some(Self {
            step: word(0)?,
            rng: SplitMix64::new(word(1)?),
            data_position: word(2)?,
        })
    }
}

fn shared(v: Vec<f32>) -> SharedBuf {
    Arc::new(RwLock::new(v))
}

fn read(b: &SharedBuf) -> RwLockReadGuard<'_, Vec<f32>> {
    b.read().unwrap_or_else(|p| p.into_inner())
}

fn write(b: &SharedBuf) -> RwLockWriteGuard<'_, Vec<f32>> {
    b.write().unwrap_or_else(|p| p.into_inner())
}

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub final_step: u64,
    pub final_loss: Option<f64>,
    pub param_xxh3: String,
    pub entropy_floor: f64,
}

/// xxh3-64 of the flat parameter buffer: the run's fingerprint.
pub fn param_checksum(params: &[f32]) -> String {
    checkpoint::digest_hex(bytemuck::cast_slice(params))
}

struct JsonLog {
    path: PathBuf,
    file: Option<File>,
}

impl JsonLog {
    fn open(path: Option<&Path>, enabled: bool) -> Result<Self, TrainError> {
        let path = path.map(Path::to_path_buf).unwrap_or_default();
        let file = match (enabled, path.as_os_str().is_empty()) {
            (true, false) => Some(
                OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .map_err(|source| TrainError::Log {
                        path: path.clone(),
                        source,
                    })?,
            ),
            _ => None,
        };
        Ok(Self { path, file })
    }

    fn write(&mut self, value: serde_json::Value) -> Result<(), TrainError> {
        if let Some(f) = self.file.as_mut() {
            let mut line = value.to_string();
            line.push('\n');
            f.write_all(line.as_bytes())
                .map_err(|source| TrainError::Log {
                    path: self.path.clone(),
                    source,
                })?;
        }
        Ok(())
    }
}

/// Why a step did not complete.
enum StepError {
    /// A collective failed: a peer died or the agent paused the job.
    Collective(CollectiveError),
    /// An uncorrectable memory error tore the live state.
    Uce,
    /// Anything else ends the run.
    Fatal(TrainError),
}

impl From<TrainError> for StepError {
    fn from(e: TrainError) -> Self {
        match e {
            TrainError::Collective(c) => Self::Collective(c),
            other => Self::Fatal(other),
        }
    }
}

impl From<CollectiveError> for StepError {
    fn from(e: CollectiveError) -> Self {
        Self::Collective(e)
    }
}

/// The parts of a run that a step needs.
struct Trainer<'a> {
    args: &'a TrainArgs,
    cfg: ModelConfig,
    model: Model,
    /// `--emulate-device`: the forward and backward, in the model's place.
    device: Option<Device>,
    chain: MarkovChain,
    opt: AdamW,
    rank: usize,
    world: usize,
    shard: Range<usize>,
    state: TrainState,
    grads: Vec<f32>,
    log: JsonLog,
    floor: f64,
    epoch: u64,
    /// Between the update fences: the live state cannot be trusted.
    torn: bool,
    last_loss: Option<f64>,
    /// The last commit's hand-off (counted in the next step's held time).
    handoff: Duration,
    /// The rank's state map: registered with the agent, and the layout of
    /// the trainer's own saves.
    map: StateMap,
    plan: Arc<FaultPlan>,
}

/// Runs the trainer to `--train-iters` and returns its summary.
pub fn run(args: &TrainArgs, env: DistEnv) -> Result<TrainSummary, TrainError> {
    let cfg = args.model_config();
    cfg.validate()
        .map_err(|e| TrainError::Args(e.to_string()))?;
    let (rank, world) = (env.rank, env.world_size);
    if args.global_batch == 0 || !args.global_batch.is_multiple_of(world) {
        return Err(TrainError::Args(format!(
            "--global-batch {} must be a positive multiple of the world size {world}",
            args.global_batch
        )));
    }
    if args.finetune && args.load.is_none() {
        return Err(TrainError::Args("--finetune needs --load".into()));
    }
    let model = Model::new(cfg);
    let numel = model.numel();
    let shard = shard_range(numel, world, rank);
    let chain = MarkovChain::new(args.seed ^ STREAM_DATA, cfg.vocab, args.branching);
    let floor = chain.entropy_rate();
    // Buffers are registered first and initialised only for a fresh start:
    // a replacement process gets its state from shared memory.
    let state = TrainState {
        params: shared(vec![0.0; numel]),
        exp_avg: shared(vec![0.0; shard.len()]),
        exp_avg_sq: shared(vec![0.0; shard.len()]),
        scalars: Scalars {
            step: 0,
            rng: SplitMix64::new(args.seed ^ STREAM_SAMPLER),
            data_position: 0,
        },
    };
    let incarnation = hatrain_worker::standby::restart_count();
    let plan = Arc::new(match std::env::var(ENV_FAULT_PLAN) {
        Ok(text) => FaultPlan::parse(&text, env.slot, incarnation)?,
        Err(_) => FaultPlan::default(),
    });
    let save = args.save.as_ref().map(|dir| SaveTo {
        dir: dir.clone(),
        interval: args.save_interval,
    });
    let map = ck::state_map(
        &cfg,
        world,
        rank,
        save.as_ref(),
        serde_json::to_value(args).unwrap_or(serde_json::Value::Null),
    );
    // Registered under the launcher's rank, its identity with the agent.
    let (mut rt, start) = Runtime::connect(
        env.slot,
        map.clone(),
        vec![
            Arc::clone(&state.params),
            Arc::clone(&state.exp_avg),
            Arc::clone(&state.exp_avg_sq),
        ],
        args.snapshot_interval,
        Arc::clone(&plan) as Arc<dyn hatrain_worker::comm::Hooks>,
    )?;
    rt.set_snapshot_window(args.snapshot_window);
    plan.set_targets(
        map.parts.iter().map(|p| p.name.clone()).collect(),
        rt.uce_injector(),
    );
    let mut t = Trainer {
        args,
        cfg,
        opt: args.optimizer(),
        model,
        device: args
            .emulate_device
            .map(|ms| Device::new(ms, args.seed, rank)),
        chain,
        rank,
        world,
        shard,
        state,
        grads: vec![0f32; numel],
        log: JsonLog::open(args.log_jsonl.as_deref(), rank == 0)?,
        floor,
        epoch: 0,
        torn: false,
        last_loss: None,
        handoff: Duration::ZERO,
        map,
        plan,
    };
    let mut dist = Dist::start(env.clone())?;

    let mut resumed_from = None;
    let mut comm = match start {
        Start::Standalone | Start::Fresh { .. } => {
            if let Start::Fresh { epoch } = start {
                t.epoch = epoch;
            }
            // Copied in place: the registered buffers never move.
            write(&t.state.params).copy_from_slice(&t.model.init(args.seed ^ STREAM_INIT));
            let mut comm = dist.communicator(t.epoch, &|| rt.directive_pending())?;
            rt.set_communicator(&comm);
            if let Some(dir) = &args.load {
                resumed_from = Some(t.load(dir, &mut comm)?);
            }
            // The starting state is snapshot 0 of this run, so even a fault
            // in the first step has a consistent step to return to.
            rt.commit(
                t.state.scalars.step,
                t.epoch,
                t.state.scalars.encode(),
                CommitOf::Start,
            );
            Some(comm)
        }
        Start::AwaitDirective => {
            // A replacement: its state comes from shared memory.
            t.torn = true;
            t.recover(&mut rt, &mut dist)?
        }
    };
    if rank == 0 {
        println!(
            "hatrain-train: {numel} parameters ({cfg:?}), {world} rank(s), global batch {} × {} tokens",
            args.global_batch, args.seq_len
        );
        println!(
            "data: Markov chain over {} tokens, branching {}; entropy rate {floor:.4} nats/token \
             is the loss floor (a uniform guess scores ln {} = {:.4})",
            cfg.vocab,
            args.branching,
            cfg.vocab,
            (cfg.vocab as f64).ln()
        );
        if let (Some(dir), true) = (&args.save, rt.agent_saves()) {
            println!(
                "checkpoints: written by the agent from the snapshots into {} (every {} steps and at the end), off the training path",
                dir.display(),
                args.save_interval
            );
        }
    }
    t.log.write(serde_json::json!({
        "event": "start", "world_size": world, "params": numel, "model": cfg,
        "entropy_floor": floor, "start_step": t.state.scalars.step, "resumed_from": resumed_from,
        "restart_count": hatrain_worker::standby::restart_count().to_string(),
        "standby_pid": hatrain_worker::standby::assigned().map(|_| std::process::id()),
        "args": args,
    }))?;

    while t.state.scalars.step < args.train_iters {
        // No communicator only after a resume at the last step.
        let Some(c) = comm.as_mut() else { break };
        let result = if rt.directive_pending() {
            Err(StepError::Collective(CollectiveError::Aborted {
                epoch: t.epoch,
            }))
        } else {
            t.step(&mut rt, c)
        };
        match result {
            Ok(()) => {}
            Err(StepError::Fatal(e)) => return Err(e),
            Err(StepError::Uce) if rt.recovers() => {
                // The live state is torn: it comes back from the snapshot.
                t.torn = true;
                comm = t.recover(&mut rt, &mut dist)?;
            }
            Err(StepError::Uce) => return Err(TrainError::Uce),
            Err(StepError::Collective(e)) if rt.recovers() => {
                eprintln!(
                    "rank {rank}: {}; waiting for the agent to recover",
                    error_chain(&e)
                );
                comm = t.recover(&mut rt, &mut dist)?;
            }
            Err(StepError::Collective(e)) => return Err(e.into()),
        }
    }
    let sealed = rt.finish(t.state.scalars.step);
    t.plan.hit(t.state.scalars.step, Point::End);
    // A rank resumed at the last step has no communicator: every rank's
    // snapshot of that step is sealed (the agent verified it for s*).
    if let (Some(dir), true, Some(comm)) = (&args.save, rt.agent_saves(), comm.as_mut()) {
        // The agent writes the final checkpoint from the final snapshot; if
        // any rank's could not be sealed, every rank saves it here instead.
        let unsealed = rt.collective(|| comm.all_gather_f64(if sealed { 0.0 } else { 1.0 }))?;
        if unsealed.iter().any(|u| *u > 0.0) {
            if rank == 0 {
                println!(
                    "the final snapshot is not sealed on every rank: the trainer saves iteration {} itself",
                    t.state.scalars.step
                );
            }
            let path = rt.collective(|| t.save(dir, comm))?;
            if rank == 0 {
                println!(
                    "saved iteration {} to {}",
                    t.state.scalars.step,
                    path.display()
                );
            }
        }
    }

    let sum = param_checksum(&read(&t.state.params));
    if rank == 0 {
        println!(
            "done: step {} | final loss {} | floor {floor:.4} | params xxh3 {sum}",
            t.state.scalars.step,
            t.last_loss.map_or("-".into(), |l| format!("{l:.4}"))
        );
    }
    // What this rank's snapshot copies cost, over the run.
    let copies = rt.commit_stats().map(|c| {
        serde_json::json!({
            "sealed": c.sealed, "bytes": c.sealed_bytes, "copy_s": c.sealed_ns as f64 / 1e9,
            "cpu_s": c.sealed_cpu_ns as f64 / 1e9, "skipped": c.skipped,
        })
    });
    t.log.write(serde_json::json!({
        "event": "final", "step": t.state.scalars.step, "loss": t.last_loss, "param_xxh3": sum,
        "entropy_floor": floor, "snapshot_copies": copies,
    }))?;
    Ok(TrainSummary {
        final_step: t.state.scalars.step,
        final_loss: t.last_loss,
        param_xxh3: sum,
        entropy_floor: floor,
    })
}

/// Evaluates `$e`, adding the time it took to `$held`.
macro_rules! held {
    ($held:ident, $e:expr) => {{
        let t = Instant::now();
        let r = $e;
        $held += t.elapsed();
        r
    }};
}

impl Trainer<'_> {
    /// One training step, from the batch to the snapshot commit.
    fn step(&mut self, rt: &mut Runtime, comm: &mut Communicator) -> Result<(), StepError> {
        let args = self.args;
        let t0 = Instant::now();
        let step = self.state.scalars.step + 1;
        // The time the training thread spends in hatrain's calls this
        // step (the fences, the UCE checks, the commit hand-off): the last
        // step's hand-off, made after its log line, counts in this one.
        let mut held = std::mem::take(&mut self.handoff);
        held!(held, rt.begin_step(step));
        // 1. The global batch's seeds (drawn from a copy of the RNG, which
        //    becomes the state only when the step is complete).
        let local_batch = args.global_batch / self.world;
        let ctx = self.cfg.context;
        let mut rng = self.state.scalars.rng;
        let mut inputs = Vec::with_capacity(local_batch * args.seq_len * ctx);
        let mut targets = Vec::with_capacity(local_batch * args.seq_len);
        let mut tokens = Vec::with_capacity(args.seq_len + ctx);
        for i in 0..args.global_batch {
            let seed = rng.next_u64();
            if i / local_batch != self.rank {
                continue;
            }
            tokens.clear();
            self.chain.sequence(seed, args.seq_len + ctx, &mut tokens);
            for t in ctx..tokens.len() {
                inputs.extend_from_slice(&tokens[t - ctx..t]);
                targets.push(tokens[t]);
            }
        }
        self.plan.hit(step, Point::Data);
        rt.batch_ready();
        self.plan.hit(step, Point::Forward);
        // 2. Forward and backward (on the model, or an emulated device),
        //    stopped when the job is paused: a peer has failed, and the
        //    rest of this step would be thrown away.
        let stop = comm.stop();
        let paused = || {
            StepError::Collective(CollectiveError::Aborted {
                epoch: comm.epoch(),
            })
        };
        let loss = match &self.device {
            Some(device) => device
                .forward_backward(step, &mut self.grads, &stop)
                .ok_or_else(paused)?,
            None => {
                let params = read(&self.state.params);
                match self
                    .model
                    .loss_and_grad(&params, &inputs, &targets, &mut self.grads, &stop)
                {
                    Ok(loss) => loss,
                    Err(ModelError::Stopped) => return Err(paused()),
                    Err(e) => return Err(StepError::Fatal(e.into())),
                }
            }
        };
        if held!(held, rt.check_uce()).is_some() {
            return Err(StepError::Uce);
        }
        // 3. Gradients summed, each rank keeping its shard.
        let mine = rt.collective(|| comm.reduce_scatter_sum(&mut self.grads))?;
        let scale = 1.0 / self.world as f32;
        self.grads[mine.clone()]
            .iter_mut()
            .for_each(|g| *g *= scale);
        // 4. and 5. AdamW on this rank's shard, then everyone gets the new
        //    parameters: the update fences enclose both.
        held!(held, rt.start_update());
        self.plan.hit(step, Point::Update);
        self.torn = true;
        if held!(held, rt.check_uce()).is_some() {
            return Err(StepError::Uce);
        }
        {
            let mut params = write(&self.state.params);
            let mut m = write(&self.state.exp_avg);
            let mut v = write(&self.state.exp_avg_sq);
            self.opt.step(
                step,
                &mut params[mine.clone()],
                &self.grads[mine],
                &mut m,
                &mut v,
            );
            rt.collective(|| comm.all_gather(&mut params))?;
        }
        self.state.scalars = Scalars {
            step,
            rng,
            data_position: self.state.scalars.data_position + args.global_batch as u64,
        };
        if held!(held, rt.check_uce()).is_some() {
            return Err(StepError::Uce);
        }
        self.torn = false;
        held!(held, rt.end_update(step));

        let losses = rt.collective(|| comm.all_gather_f64(f64::from(loss)))?;
        let mean_loss = losses.iter().sum::<f64>() / self.world as f64;
        self.last_loss = Some(mean_loss);
        let dt = t0.elapsed().as_secs_f64();
        let tps = (args.global_batch * args.seq_len) as f64 / dt;
        if self.rank == 0
            && (step == 1
                || step.is_multiple_of(args.log_interval.max(1))
                || step == args.train_iters)
        {
            println!(
                "step {step:>6}/{} | loss {mean_loss:.4} (floor {:.4}) | lr {:.2e} | {:>8.0} tok/s | {:>8.1} ms/step",
                args.train_iters,
                self.floor,
                self.opt.lr_at(step),
                tps,
                dt * 1e3
            );
        }
        // Logged before the snapshot: a step whose snapshot is sealed has
        // been logged, and a step logged but not sealed is redone (and
        // logged again with the same values).
        self.log.write(serde_json::json!({
            "event": "step", "step": step, "loss": mean_loss, "lr": self.opt.lr_at(step),
            "tokens_per_s": tps, "step_time_s": dt, "held_ms": held.as_secs_f64() * 1e3, "epoch": self.epoch,
            "world_size": self.world, "global_batch": args.global_batch,
            "samples": self.state.scalars.data_position,
            "snapshots_skipped": rt.snapshots_skipped(),
            "unix_s": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()),
        }))?;
        let last = step == args.train_iters;
        let of = if last { CommitOf::Last } else { CommitOf::Step };
        let handoff = Instant::now();
        rt.commit(step, self.epoch, self.state.scalars.encode(), of);
        self.handoff = handoff.elapsed();

        // With an agent that saves, the save steps' snapshots are held for it
        // and it writes them to disk off the training path.
        let due = args.save_interval > 0 && step.is_multiple_of(args.save_interval);
        if let Some(dir) = &args.save
            && (due || last)
            && !rt.agent_saves()
        {
            let t = Instant::now();
            let path = rt.collective(|| self.save(dir, comm))?;
            let secs = t.elapsed().as_secs_f64();
            if self.rank == 0 {
                println!(
                    "saved iteration {step} to {} in {secs:.3} s",
                    path.display()
                );
            }
            self.log.write(serde_json::json!({
                "event": "checkpoint", "step": step, "dir": path, "seconds": secs,
            }))?;
        }
        Ok(())
    }
}

/// Exit codes of `hatrain-train`.
pub mod exit {
    /// Bad flags or environment.
    pub const USAGE: u8 = 2;
    /// The checkpoint to resume from is missing or corrupt.
    pub const LOAD: u8 = 3;
    /// A checkpoint could not be saved (the previous one is intact).
    pub const SAVE: u8 = 4;
    /// A collective, the rendezvous or the model failed.
    pub const FAILED: u8 = 1;
    /// The agent told the worker to stop.
    pub const STOPPED: u8 = 5;
}

impl TrainError {
    /// The documented exit code for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Env(_) | Self::Args(_) | Self::Plan(_) | Self::Secret(_) => exit::USAGE,
            Self::Load(_) => exit::LOAD,
            Self::Save { .. } | Self::SaveElsewhere { .. } => exit::SAVE,
            Self::Stopped => exit::STOPPED,
            Self::Uce => exit::FAILED,
            Self::Rendezvous(_)
            | Self::Collective(_)
            | Self::Model(_)
            | Self::Runtime(_)
            | Self::Log { .. } => exit::FAILED,
        }
    }
}

/// Entry point of the `hatrain-train` binary (and of `hatrain-agent train`).
///
/// Must run before the process starts any thread: it may set
/// `RAYON_NUM_THREADS`, which candle reads.
pub fn main(args: TrainArgs) -> std::process::ExitCode {
    if let Some(n) = args.threads {
        // SAFETY: called first thing in `main`, before any other thread
        // exists, so nothing reads the environment concurrently.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", n.max(1).to_string()) };
    }
    // A warm standby parks here until the agent gives it a failed rank's
    // place, which it then takes as if the launcher had started it there.
    match hatrain_worker::standby::standby() {
        Ok(None) => {}
        Ok(Some(a)) => {
            eprintln!(
                "standby {}: taking the place of rank {} (local rank {})",
                std::process::id(),
                a.rank,
                a.local_rank
            );
            for (k, v) in a.env() {
                // SAFETY: still before any other thread exists (the wait
                // above ran on this one).
                unsafe { std::env::set_var(k, v) };
            }
            // SAFETY: as above.
            unsafe { std::env::remove_var(hatrain_worker::standby::Assigned::CLEARED) };
        }
        Err(e) => {
            eprintln!("standby {}: error: {}", std::process::id(), error_chain(&e));
            return std::process::ExitCode::from(exit::FAILED);
        }
    }
    let env = match DistEnv::from_env() {
        Ok(env) => env,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            return std::process::ExitCode::from(e.exit_code());
        }
    };
    let rank = env.rank;
    match run(&args, env) {
        Ok(_) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rank {rank}: error: {}", error_chain(&e));
            std::process::ExitCode::from(e.exit_code())
        }
    }
}

/// An error and its sources, joined with ": ".
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<DistEnv, TrainError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        DistEnv::from_lookup(|k| map.get(k).cloned())
    }

    fn tiny(iters: u64) -> TrainArgs {
        let mut a = TrainArgs::parse_from(["hatrain-train", "--model-size", "tiny"]);
        a.train_iters = iters;
        a.global_batch = 8;
        a.seq_len = 16;
        a.log_interval = 1000;
        a
    }

    #[test]
    fn single_rank_resume_is_exact() {
        let d = tempfile::tempdir().unwrap();
        let straight = run(&tiny(12), env(&[]).unwrap()).unwrap();
        let mut first = tiny(6);
        first.save = Some(d.path().to_path_buf());
        run(&first, env(&[]).unwrap()).unwrap();
        let mut second = tiny(12);
        second.load = Some(d.path().to_path_buf());
        let resumed = run(&second, env(&[]).unwrap()).unwrap();
        assert_eq!(resumed.param_xxh3, straight.param_xxh3);
        assert_eq!(resumed.final_loss, straight.final_loss);
    }
}
