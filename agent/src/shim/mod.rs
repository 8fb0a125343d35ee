//! The agent's side of the exec shims (`hatrain-agent exec`), through
//! which another launcher's ranks run under a host agent: the socket
//! protocol they speak ([`wire`]) and the shims of one served job
//! ([`Shims`]), which the supervisor starts workers through. Below the job
//! and the verbs: `serve` hosts the socket, `exec` is the shim itself.

mod shims;
pub mod wire;

pub use shims::Shims;
