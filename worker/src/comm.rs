//! The seam between the runtime and a training framework's communicator.
//!
//! The runtime never links a framework's collectives. It needs one thing of
//! a communicator: to abort it from another thread, so that a rank blocked
//! in a collective on a hung peer is released when the agent pauses the job
//! (DESIGN.md section 6). Rebuilding a communicator for a new epoch is the
//! framework's own business; the runtime says when and under which epoch.

use std::sync::Arc;

/// Aborts a communicator from any thread: every blocked and later call on
/// it fails promptly.
pub trait Abort: Send + Sync + std::fmt::Debug {
    fn abort(&self);
}

/// A communicator of one epoch, as the runtime sees it.
pub trait Communicator {
    /// The epoch it was built for.
    fn epoch(&self) -> u64;
    /// A handle that aborts it.
    fn abort_handle(&self) -> Arc<dyn Abort>;
}

/// Hooks into the runtime's background work. The reference trainer passes
/// [`NoHooks`], or its fault plan's [`Hooks::commit_halfway`] to fault a
/// rank in the middle of a snapshot copy; a framework whose state lives in
/// device memory passes [`Hooks::before_copy`].
pub trait Hooks: Send + Sync + std::fmt::Debug {
    /// The commit thread is about to copy step `step`'s snapshot out of the
    /// registered buffers: returns once they hold that step. A framework
    /// that stages device state into host buffers asynchronously waits here
    /// for its copy to complete, on the commit thread, not the training
    /// loop's.
    fn before_copy(&self, _step: u64) {}
    /// The commit thread has copied half of step `step`'s snapshot.
    fn commit_halfway(&self, _step: u64) {}
}

/// No hooks.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHooks;

impl Hooks for NoHooks {}
