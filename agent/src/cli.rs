//! Command-line interface of `hatrain-agent`.

use clap::{Args, Parser, Subcommand};
use hatrain_worker::trainer::TrainArgs;
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
    /// Train the default model on 4 local ranks with periodic checkpoints.
    Demo(DemoArgs),
    /// Run the reference trainer in this process (the same as `hatrain-train`).
    Train(TrainArgs),
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
    /// Job identifier, passed to workers as HATRAIN_JOB_ID.
    #[arg(long, default_value = "hatrain")]
    pub job_id: String,
    /// RAYON_NUM_THREADS for each worker when the environment does not set
    /// it (default: cores / workers, at least 1).
    #[arg(long)]
    pub threads_per_worker: Option<usize>,
    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    #[arg(long, default_value_t = 5.0)]
    pub stop_grace_secs: f64,
    /// The worker command and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<OsString>,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Workers (ranks) to train with.
    #[arg(long, default_value_t = 4)]
    pub nproc: usize,
    /// Training steps.
    #[arg(long, default_value_t = 300)]
    pub steps: u64,
    /// Save a checkpoint every N steps.
    #[arg(long, default_value_t = 50)]
    pub save_interval: u64,
    /// Model size: tiny, small, 10m or 100m.
    #[arg(long, default_value = "small")]
    pub model_size: String,
    /// Directory for the demo's checkpoints and log (replaced on each run).
    #[arg(long, default_value = "hatrain-demo")]
    pub workdir: PathBuf,
}
