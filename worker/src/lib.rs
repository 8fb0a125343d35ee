//! `hatrain-worker`: the runtime a training process links.
//!
//! - [`runtime`]: registration with the agent, the step boundary, the update
//!   fences, background snapshot commits and the agent's directives;
//! - [`comm`]: the small seam through which the runtime reaches a
//!   framework's communicator (abort), and test hooks;
//! - [`uce`]: the SIGBUS handler that repairs uncorrectable memory errors in
//!   registered state buffers.
//!
//! It knows no model and no collective: the reference trainer
//! (`hatrain-trainer`) and the Python binding sit on top of it.

pub mod buffer;
pub mod comm;
pub mod runtime;
pub mod standby;
pub mod uce;
