//! `hatrain-shared`: the vocabulary every hatrain process agrees on:
//! formats and protocols, no policy.
//!
//! - [`frame`]: the length-prefixed, versioned frame every socket protocol uses;
//! - [`auth`]: the job's secret, and frames authenticated under it;
//! - [`control`]: the agent's control protocol (workers and `agentctl`);
//! - [`rendezvous`] and [`store`]: the messages of the key-value store that
//!   ranks meet in, and the store itself (server and client);
//! - [`shm`]: the shared-memory snapshot store and its typed control page;
//! - [`statemap`]: the self-describing map of a rank's state;
//! - [`checkpoint`]: the on-disk checkpoint format, its writer and reader;
//! - [`shard`]: how a flat buffer is split across the ranks of a group;
//! - [`resize`]: what moves, from which rank to which, when the group is
//!   resized;
//! - [`ha`]: the high-availability switches;
//! - [`ident`]: job ids, which are names and never paths;
//! - [`joblock`]: the lock that claims a job's folder, and who holds it;
//! - [`npu`]: Ascend NPU faults: the fault table, torch_npu's error texts,
//!   `npu-smi`'s output;
//! - [`peer`]: authenticated frames between agents (peer replicas);
//! - [`trust`]: whether a folder or file may be used (owner, mode, kind).
//!
//! Nothing here decides *when* anything happens; that is the agent's and the
//! worker runtime's business.

pub mod auth;
pub mod checkpoint;
pub mod control;
pub mod frame;
pub mod ha;
pub mod ident;
pub mod joblock;
pub mod npu;
pub mod peer;
pub mod rendezvous;
pub mod resize;
pub mod shard;
pub mod shm;
pub mod slowness;
pub mod statemap;
pub mod store;
pub mod trust;

/// The CPU time the calling thread has used, in nanoseconds (0 where the
/// clock cannot be read).
pub fn thread_cpu_ns() -> u64 {
    use nix::time::{ClockId, clock_gettime};
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).map_or(0, |t| {
        u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000_000
            + u64::try_from(t.tv_nsec()).unwrap_or(0)
    })
}
