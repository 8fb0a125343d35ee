//! `hatrain-agent`: the per-host agent. It depends on `hatrain-shared`
//! only: it knows no model and links no training framework.
//!
//! - [`reaper`]: the one SIGCHLD reaper;
//! - [`supervisor`]: spawns, follows, restarts and stops one host's workers;
//! - [`config`]: one host's configuration ([`config::LaunchConfig`]) and
//!   the worker specs it gives; [`spec`]: a worker's spec and files;
//! - [`launch`], [`serve`] and [`exec`]: the verbs, above the job;
//! - [`shim`]: the agent's side of the exec shims of a served job;
//! - [`layers`]: the modules' layers, which a test holds the crate to;
//! - [`job`]: one host's job: the event loop around the recovery machine;
//! - [`jobdir`]: the job's folder in shared memory, verified and held;
//! - [`recovery`]: the recovery machine, a state machine without I/O, and
//!   its pure policies (restarts, the hang watchdog, s\*);
//! - [`control`]: the control socket for workers and `agentctl`;
//! - [`persister`]: checkpoints written from the snapshots;
//! - [`replicator`]: peer replicas, streamed to and held for other hosts;
//! - [`coordinator`]: membership, liveness and leadership of a job's
//!   agents (the embedded, agent-to-agent backend);
//! - [`faults`]: device fault sources (NVIDIA Xids, Ascend NPUs) behind one seam;
//! - [`oom`]: whether the kernel's OOM killer ended a worker;
//! - [`output`]: the workers' output, as torchrun forwards and logs it;
//! - [`cli`] and [`exit`]: the command line and its exit codes.

pub mod cli;
pub mod config;
pub mod control;
pub mod coordinator;
pub mod exec;
pub mod faults;
pub mod job;
pub mod jobdir;
pub mod launch;
pub mod layers;
pub mod limits;
pub mod metrics;
pub mod notify;
pub mod oom;
pub mod output;
pub mod persister;
pub mod reaper;
pub mod recovery;
pub mod replicator;
pub mod serve;
pub mod settings;
pub mod shim;
pub mod slow;
pub mod spec;
pub mod supervisor;

/// Eight random hex digits, to make a name unique on the host (job ids,
/// run folders).
pub fn random_tag() -> std::io::Result<String> {
    let mut bits = [0u8; 4];
    getrandom::fill(&mut bits).map_err(std::io::Error::other)?;
    Ok(format!("{:08x}", u32::from_le_bytes(bits)))
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

/// Exit codes of `hatrain-agent`.
///
/// A job that ends because a worker failed exits with that worker's code
/// (128+N when it was killed by signal N), as torchrun does.
pub mod exit {
    /// Internal error of the agent.
    pub const INTERNAL: u8 = 1;
    /// Bad flags or configuration.
    pub const USAGE: u8 = 2;
    /// A fault could not be recovered from (the reason is logged and in
    /// `agentctl faults`).
    pub const RECOVERY_FAILED: u8 = 3;
    /// Training finished, but the agent could not write its final
    /// checkpoint (the previous one is intact).
    pub const SAVE_FAILED: u8 = 4;
    /// The job cannot run on this host: a snapshot store cannot be made
    /// (the shm root is too small, or out of resources); the message names
    /// the root, the bytes needed and free, and the flags to change.
    pub const UNFIT: u8 = 5;
    /// A device of this host is lost to a job of several hosts: the host
    /// left the job, which recovers without it.
    pub const DEVICE_LOST: u8 = 6;
    /// This host held the job back (`--on-slow replace`): it left the job
    /// of several hosts to a standby host, and the job goes on without it.
    pub const HANDED_OVER: u8 = 7;

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
