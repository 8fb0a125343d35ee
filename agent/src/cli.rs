//! Command-line interface of `hatrain-agent`.

use crate::output::{PerRank, RankFilter};
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
    Launch(Box<LaunchArgs>),
    /// Serve this host's jobs as a long-running agent (a systemd service):
    /// ranks that another launcher starts register through `exec`.
    Serve(ServeArgs),
    /// Run one rank under this host's serving agent, as the command an
    /// mpirun, srun or torchrun starts: `exec [FLAGS] -- <worker command>`.
    Exec(Box<ExecArgs>),
}

/// `serve`'s flags.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The socket exec shims and agentctl reach this agent on (default:
    /// /run/hatrain/agent.sock for root, $XDG_RUNTIME_DIR/hatrain/agent.sock
    /// for others).
    #[arg(long, env = "HATRAIN_AGENT_SOCKET")]
    pub socket: Option<PathBuf>,
    /// Root of the served jobs' snapshot stores, unless a job's exec names
    /// one (default: /dev/shm/hatrain for root, /dev/shm/hatrain-<uid> for
    /// others).
    #[arg(long)]
    pub shm_root: Option<PathBuf>,
    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    #[arg(long, default_value_t = 5.0)]
    pub stop_grace_secs: f64,
    /// How long a job's ranks have, from the first, to all register (and
    /// a re-adopted job's shims to come back).
    #[arg(long, default_value_t = 120.0)]
    pub gather_timeout_secs: f64,
    /// On SIGTERM: `keep` leaves the jobs training for the next agent to
    /// re-adopt; `stop` stops them (after their last-words checkpoints
    /// when the dump mode is on).
    #[arg(long, value_enum, default_value = "keep")]
    pub on_stop: OnStop,
    /// Serve Prometheus metrics at http://ADDR/metrics: PORT (on
    /// 127.0.0.1) or ADDR:PORT (default: off).
    #[arg(long, value_parser = crate::metrics::parse_addr)]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

/// `exec`'s flags: the host agent's socket, the job id, and the
/// high-availability switches as `launch` takes them (every rank of a job
/// gives the same).
#[derive(Debug, Args)]
pub struct ExecArgs {
    /// The host agent's socket (default as `serve`'s).
    #[arg(long, env = "HATRAIN_AGENT_SOCKET")]
    pub agent_socket: Option<PathBuf>,
    /// The job's id (default: the launcher's id of the run: torchrun's run
    /// id, Open MPI's job id, Slurm's job and step).
    #[arg(long, env = "HATRAIN_JOB_ID")]
    pub job_id: Option<JobId>,
    /// When the host agent goes away (a restart), the worker trains on and
    /// the shim waits for the next agent; a shim whose worker has ended
    /// waits this long, then exits with the worker's status.
    #[arg(long, default_value_t = 300.0)]
    pub agent_wait_secs: f64,
    #[command(flatten)]
    pub ha: HaArgs,
    /// The worker command and its arguments, after `--`.
    #[arg(last = true, required = true)]
    pub command: Vec<OsString>,
}

/// `launch` takes torchrun's flags in both spellings (`--nproc-per-node`
/// and `--nproc_per_node`), so a torchrun command line runs after changing
/// its first word.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Number of hosts in the job.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This host's index (default: SLURM_NODEID, OMPI_COMM_WORLD_RANK,
    /// PMI_RANK, else 0).
    #[arg(long, alias = "node_rank")]
    pub node_rank: Option<usize>,
    /// Workers on this host.
    #[arg(long, alias = "nproc_per_node", default_value_t = 1)]
    pub nproc_per_node: usize,
    /// Address of node 0: rank 0 of the workers listens there (torch's
    /// store), and node 0's agent hosts hatrain's rendezvous store there.
    #[arg(long, alias = "master_addr", default_value = "localhost")]
    pub master_addr: String,
    /// The workers' MASTER_PORT, which rank 0 listens on (default on one
    /// node: a free port).
    #[arg(long, alias = "master_port")]
    pub master_port: Option<u16>,
    /// The port of the agents' own rendezvous store on node 0 (default:
    /// --master-port + 1 on several nodes, a free port on one).
    #[arg(long, alias = "rdzv_port")]
    pub rdzv_port: Option<u16>,
    /// One host, with free ports: what torchrun's --standalone does.
    #[arg(long)]
    pub standalone: bool,
    /// Job identifier, passed to workers as HATRAIN_JOB_ID and
    /// TORCHELASTIC_RUN_ID: 1 to 64 letters, digits, '.', '_' or '-', not
    /// starting with '.' (default: Slurm's job and step, else one made for
    /// this launch, printed at start).
    #[arg(
        long,
        env = "HATRAIN_JOB_ID",
        visible_alias = "rdzv-id",
        alias = "rdzv_id"
    )]
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
    /// Run the command as it is, not with Python (torchrun's --no-python).
    #[arg(long, alias = "no_python")]
    pub no_python: bool,
    /// The command is a Python module: `python -m MODULE` (torchrun's -m).
    #[arg(short = 'm', long)]
    pub module: bool,
    /// Base folder for the workers' log files and error files:
    /// <log-dir>/<job>_<random>/attempt_<restart>/<local rank>/ (default: a
    /// temporary folder, removed at exit unless logs were written to it).
    #[arg(long, alias = "log_dir")]
    pub log_dir: Option<PathBuf>,
    /// Send streams to the log files only: 0 none, 1 stdout, 2 stderr, 3
    /// both, for every local rank, or LOCAL_RANK:N pairs (0:1,1:2).
    #[arg(short = 'r', long, default_value = "0")]
    pub redirects: PerRank,
    /// Send streams to the log files and to the console (as --redirects).
    #[arg(short = 't', long, default_value = "0")]
    pub tee: PerRank,
    /// Show only these local ranks' output on the console (0,2); the log
    /// files keep everything.
    #[arg(long, alias = "local_ranks_filter")]
    pub local_ranks_filter: Option<RankFilter>,
    /// Serve Prometheus metrics at http://ADDR/metrics: PORT (on
    /// 127.0.0.1) or ADDR:PORT (default: off).
    #[arg(long, value_parser = crate::metrics::parse_addr)]
    pub metrics_addr: Option<std::net::SocketAddr>,
    #[command(flatten)]
    pub ha: HaArgs,
    /// The worker command and its arguments, after `--` or as torchrun
    /// takes them (a script ending in .py runs with python3 -u, as does
    /// every command with -m; --no-python runs it as it is).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    pub command: Vec<OsString>,
}

/// High-availability switches (named as in MindSpeed-LLM). The
/// HIGH_AVAILABILITY environment variable (a comma-separated set of dump,
/// retry, recover, elastic-training) turns features on as well.
#[derive(Debug, Clone, PartialEq, Args, serde::Serialize, serde::Deserialize)]
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
    /// With worker reboot: restarts allowed per rank over the job (default
    /// 10). Otherwise, as torchrun: times the whole group is stopped and
    /// started again after a worker fails (default 0).
    #[arg(long, alias = "max_restarts")]
    pub max_restarts: Option<u32>,
    /// Restarts allowed per rank within --restart-window-secs.
    #[arg(long, default_value_t = 5)]
    pub max_restarts_in_window: u32,
    #[arg(long, default_value_t = 60.0)]
    pub restart_window_secs: f64,
    /// Root directory of the shared-memory snapshot stores (default:
    /// /dev/shm/hatrain for root, /dev/shm/hatrain-<uid> for others).
    #[arg(long)]
    pub shm_root: Option<PathBuf>,
    /// Snapshots hold only each rank's slice of the parts its data-parallel
    /// group shares (the parameters), rebuilt with an all-gather on
    /// restore; `off` copies every part whole.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub snapshot_slices: String,
    /// Snapshot slots per rank (default 2 on one node, 3 where ranks stream
    /// replicas to peer hosts). While the agent writes a checkpoint from a
    /// slot, that slot is held; with 2, snapshots wait meanwhile, with 3
    /// they go on. With peer replicas and 3 slots or more, the step the
    /// replicas and the other ranks have in common is never overwritten
    /// (snapshots thin out while a replica catches up); with 2 it is only
    /// watched.
    #[arg(long)]
    pub snapshot_slots: Option<usize>,
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
    /// With the switches on, warn about a worker that has not registered
    /// with the hatrain runtime after this many seconds: it is not
    /// protected.
    #[arg(long, default_value_t = 60.0)]
    pub register_timeout_secs: f64,
    /// With several nodes: other hosts that hold a copy of this host's
    /// snapshots in their memory (0: none).
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// This host's failure domain (a rack, a power feed): replicas never go
    /// to a host with the same label.
    #[arg(long)]
    pub failure_domain: Option<String>,
    /// With several nodes: declare another host lost after this many
    /// seconds without its heartbeat (at once when its connection drops).
    #[arg(long, default_value_t = 3.0)]
    pub host_timeout_secs: f64,
    /// The address this host's agent takes heartbeats and peer replicas on
    /// (default: the local address of the route to --master-addr).
    #[arg(long)]
    pub local_addr: Option<std::net::IpAddr>,
    /// Warm standby workers per host: K extra processes of the worker
    /// command, started ahead with `HATRAIN_STANDBY=1`, that do their
    /// start-up and park; a rank that must be restarted (worker reboot, or
    /// a UCE that needs a fresh process) is handed to one, and another is
    /// started in the background. Needs --enable-worker-reboot and a worker
    /// that supports it (hatrain.torch, hatrain-train).
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub warm_standby: usize,
    /// What a rank found slow gets: `report` (`agentctl slow`, the
    /// metrics, one log line); or `replace`: one rank slow alone in its
    /// own compute or update is also restarted in place (to a warm standby
    /// where there is one, see --warm-standby) once what it has cost the
    /// job, its excess per step times the steps it lasted, equals the
    /// price of the hand-over. Needs --enable-worker-reboot.
    #[arg(long, value_enum, default_value_t = crate::slow::OnSlow::Report)]
    pub on_slow: crate::slow::OnSlow,
    /// The price of handing a slow rank over (`--on-slow replace`) until
    /// this job has measured one: after that, the recovery time of its
    /// last worker reboot.
    #[arg(long, default_value_t = 5.0, value_name = "SECS")]
    pub slow_handover_secs: f64,
    /// Python modules to import once per host (`torch,torch._dynamo`): the
    /// workers, at the start, in a worker reboot or a group restart and as
    /// warm standbys, are forked from a Python server that has imported
    /// them, instead of each importing them again. Needs a Python worker
    /// command (a script, or -m MODULE) and the hatrain package in its
    /// interpreter; what the modules read from the environment at import
    /// is the job's, not a rank's.
    #[arg(long, value_delimiter = ',', value_name = "MODULES")]
    pub preload: Vec<String>,
    /// With several nodes: spare agents of the job, started with
    /// `--standby` and node ranks `--nnodes` and up; every agent of the job
    /// is given the same count.
    #[arg(long, default_value_t = 0)]
    pub standby_nodes: usize,
    /// This agent is a spare (its `--node-rank` is `--nnodes` or more): it
    /// starts no worker, and takes the ranks of a lost host, filled from
    /// their peer replicas.
    #[arg(long)]
    pub standby: bool,
    /// With elastic training: the group shrinks when a host is lost only
    /// while at least this many hosts hold ranks; below it the job writes
    /// its last words and stops.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub min_nodes: u64,
    /// With several nodes: where membership and leadership are kept.
    /// `embedded` (the default): the agents agree among themselves.
    /// `etcd://HOST:PORT[,HOST:PORT...]`: leases and a leader key in etcd
    /// (v3 API; 3.4 and 3.5 are supported).
    #[arg(long, env = "HATRAIN_COORDINATOR", default_value = "embedded")]
    pub coordinator: String,
    /// With etcd: how long a fault waits for etcd to answer again before
    /// the job writes its last words and stops.
    #[arg(long, alias = "coordinator-timeout", default_value_t = 30.0)]
    pub coordinator_timeout_secs: f64,
    /// A JSON file of device fault codes that replace or add to the
    /// default table (`{"codes": [{"code": "0x80E01801", "class":
    /// "RestartBusiness", "action": "uce"}], "side_effect_window_ms":
    /// 5000, "uce_repeat_count": 2, "uce_repeat_window_s": 86400}`).
    #[arg(long, value_name = "FILE")]
    pub fault_table: Option<PathBuf>,
    /// The accelerators of this host's local ranks, in local-rank order
    /// (`4,5,6,7`: local rank 0 uses device 4): how a device fault maps to
    /// its rank. Default: the list in `ASCEND_RT_VISIBLE_DEVICES` (NPU) or
    /// `CUDA_VISIBLE_DEVICES` (GPU), else local rank i on device i.
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    pub devices: Option<Vec<u32>>,
    /// The Ascend DCMI library the NPU fault source loads (a name the
    /// dynamic loader searches for, or a path).
    #[arg(long, env = "HATRAIN_DCMI_LIBRARY", default_value = "libdcmi.so")]
    pub dcmi_library: PathBuf,
    /// The `npu-smi` the NPU fault source polls where the DCMI library
    /// cannot be loaded.
    #[arg(long, env = "HATRAIN_NPU_SMI", default_value = "npu-smi")]
    pub npu_smi: PathBuf,
}

/// What a SIGTERM (`systemctl stop` or `restart`) does to the jobs of
/// `hatrain-agent serve`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnStop {
    /// The workers train on, and the next agent re-adopts them.
    Keep,
    /// Each job is stopped: its last-words checkpoint first when its dump
    /// mode is on, then its workers.
    Stop,
}
