//! Command-line interface of `hatrain-agent`.

use clap::{Args, Parser, Subcommand};
use hatrain_shared::ident::JobId;
use std::ffi::OsString;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "hatrain-agent",
    version,
    about = "hatrain host agent: launches and supervises training workers"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Launch this host's workers, torchrun-style:
    /// `launch --nproc-per-node P [...] -- <worker command...>`.
    Launch(LaunchArgs),
}

#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Number of hosts in the job.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This host's index (default: SLURM_NODEID, OMPI_COMM_WORLD_RANK,
    /// PMI_RANK, else 0).
    #[arg(long)]
    pub node_rank: Option<usize>,
    /// Workers on this host.
    #[arg(long)]
    pub nproc_per_node: usize,
    /// Address of node 0, which hosts the rendezvous store.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of the rendezvous store (default on one node: a free port).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Job identifier, passed to workers as HATRAIN_JOB_ID: 1 to 64
    /// letters, digits, '.', '_' or '-', not starting with '.' (default:
    /// Slurm's job and step, else one made for this launch, printed at
    /// start).
    #[arg(long, env = "HATRAIN_JOB_ID")]
    pub job_id: Option<JobId>,
    /// RAYON_NUM_THREADS for each worker when the environment does not set
    /// it (default: cores / workers, at least 1).
    #[arg(long)]
    pub threads_per_worker: Option<usize>,
    /// The job's secret (hex, in a file nobody else can read). Required with
    /// more than one node, so that every agent holds the same; on one node
    /// a fresh one is made for each launch.
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    #[arg(long, default_value_t = 5.0)]
    pub stop_grace_secs: f64,
    #[command(flatten)]
    pub ha: HaArgs,
    /// The worker command and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<OsString>,
}

/// High-availability switches (named as in MindSpeed-LLM). The
/// HIGH_AVAILABILITY environment variable (a comma-separated set of dump,
/// retry, recover, elastic-training) turns features on as well.
#[derive(Debug, Args)]
pub struct HaArgs {
    /// Master switch: high availability, with the last-words dump.
    #[arg(long)]
    pub enable_high_availability: bool,
    /// Repair uncorrectable memory errors by recomputing the step.
    #[arg(long)]
    pub enable_hbmfault_repair: bool,
    /// Restart a failed worker in place and refill it from memory.
    #[arg(long)]
    pub enable_worker_reboot: bool,
    /// Scale down and back up by data-parallel ranks.
    #[arg(long)]
    pub enable_elastic_training: bool,
    /// Restarts allowed per rank over the job.
    #[arg(long, default_value_t = 10)]
    pub max_restarts: u32,
    /// Restarts allowed per rank within --restart-window-secs.
    #[arg(long, default_value_t = 5)]
    pub max_restarts_in_window: u32,
    #[arg(long, default_value_t = 60.0)]
    pub restart_window_secs: f64,
    /// Root directory of the shared-memory snapshot stores (default:
    /// /dev/shm/hatrain for root, /dev/shm/hatrain-<uid> for others).
    #[arg(long)]
    pub shm_root: Option<PathBuf>,
    /// Snapshot slots per rank. While the agent writes a checkpoint from a
    /// slot, that slot is held; with 2, snapshots wait meanwhile, with 3
    /// they go on.
    #[arg(long, default_value_t = 2)]
    pub snapshot_slots: usize,
    /// Let the trainer write its own --save-interval checkpoints (a
    /// collective save on the training path). By default the agent writes
    /// them from the snapshots when one host holds every rank.
    #[arg(long)]
    pub trainer_saves: bool,
    /// Seconds every rank has to pause during a recovery.
    #[arg(long, default_value_t = 60.0)]
    pub pause_timeout_secs: f64,
    /// Declare a rank hung after this many seconds without progress
    /// (default: adaptive, --hang-factor × the median step time, at least
    /// --hang-floor-secs, and --hang-startup-grace-secs for the first steps).
    #[arg(long)]
    pub hang_timeout_secs: Option<f64>,
    #[arg(long, default_value_t = 10.0)]
    pub hang_factor: f64,
    #[arg(long, default_value_t = 30.0)]
    pub hang_floor_secs: f64,
    #[arg(long, default_value_t = 600.0)]
    pub hang_startup_grace_secs: f64,
}
