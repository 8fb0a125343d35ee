//! `hatrain-agent launch`: the torchrun-style launcher of one host.
//!
//! It hosts hatrain's rendezvous store (on node rank 0, on a port of its
//! own), starts `--nproc-per-node` workers with the environment torchrun
//! gives its workers ([`LaunchConfig::worker_specs`]), and supervises them
//! until they all finish, one fails, or the agent is asked to stop. A verb
//! above the job: its configuration is [`crate::config`]'s.

pub use crate::config::*;
use crate::job::{self, JobReport};
use tokio_util::sync::CancellationToken;

/// Runs one host's part of the job until it ends or `shutdown` fires.
pub async fn run(
    cfg: &LaunchConfig,
    shutdown: CancellationToken,
) -> Result<JobReport, LaunchError> {
    job::run(cfg, shutdown).await
}
