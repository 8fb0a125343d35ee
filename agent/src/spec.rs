//! What a worker is started with, and where its files go: the spec of one
//! worker process, the output plan of a host's workers, and torchrun's
//! layout of the run's folder (an attempt's folder and error file per
//! local rank). Plain data, below the supervisor and the configuration.

use crate::output::PerRank;
use std::ffi::OsString;
use std::path::PathBuf;

/// How to start one worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    pub rank: usize,
    pub local_rank: usize,
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub env: Vec<(String, String)>,
}

/// Where the workers' output goes (torchrun's `--log-dir`, `--redirects`,
/// `--tee`, `--local-ranks-filter`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OutputPlan {
    pub log_dir: Option<PathBuf>,
    pub redirects: PerRank,
    pub tee: PerRank,
    pub filter: Option<Vec<usize>>,
}

/// The group restart count torchrun gives its workers.
pub const ENV_GROUP_RESTARTS: &str = "TORCHELASTIC_RESTART_COUNT";
/// Where a worker's `torch.distributed.elastic` error handler writes the
/// exception that ended it.
pub const ENV_ERROR_FILE: &str = "TORCHELASTIC_ERROR_FILE";

/// The folder of one attempt (group restart) of one local rank in the
/// run's folder, torchrun's layout.
pub fn attempt_dir(run_dir: &std::path::Path, restart: u32, local_rank: usize) -> PathBuf {
    run_dir
        .join(format!("attempt_{restart}"))
        .join(local_rank.to_string())
}

/// The error file of one local rank in one attempt.
pub fn error_file(run_dir: &std::path::Path, restart: u32, local_rank: usize) -> PathBuf {
    attempt_dir(run_dir, restart, local_rank).join("error.json")
}
