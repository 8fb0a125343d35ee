//! `hatrain-agent`: the per-host agent.
//!
//! - [`reaper`]: the one SIGCHLD reaper;
//! - [`supervisor`]: spawns, follows and stops one host's workers, with the
//!   pure decision function [`supervisor::on_exit`];
//! - [`launch`]: the torchrun-style launcher, which also hosts the
//!   rendezvous store;
//! - [`demo`]: the main job on its embedded default;
//! - [`cli`] and [`exit`]: the command line and its exit codes.

pub mod cli;
pub mod demo;
pub mod launch;
pub mod reaper;
pub mod supervisor;

/// Exit codes of `hatrain-agent`.
///
/// A job that ends because a worker failed exits with that worker's code
/// (128+N when it was killed by signal N), as torchrun does.
pub mod exit {
    /// Internal error of the agent.
    pub const INTERNAL: u8 = 1;
    /// Bad flags or configuration.
    pub const USAGE: u8 = 2;

    /// The code for an agent stopped by signal `sig` (128+N).
    pub fn signaled(sig: i32) -> u8 {
        u8::try_from(128 + sig).unwrap_or(INTERNAL)
    }

    /// The code for a job whose worker ended with shell code `code`.
    pub fn worker(code: i32) -> u8 {
        u8::try_from(code)
            .ok()
            .filter(|c| *c != 0)
            .unwrap_or(INTERNAL)
    }
}
