//! `hatrain-shared`: the vocabulary every hatrain process agrees on.
//!
//! - [`frame`]: the length-prefixed, versioned frame every socket protocol uses;
//! - [`rendezvous`]: the messages of the key-value store that ranks meet in;
//! - [`model`]: the reference model's shape and the layout of its flat
//!   parameter buffer, and how that buffer is sharded across ranks;
//! - [`checkpoint`]: the on-disk checkpoint format (Megatron-style directories
//!   of safetensors files with a `meta.json`), its writer and its reader.
//!
//! Nothing here decides *when* anything happens; that is the agent's and the
//! worker runtime's business.

pub mod checkpoint;
pub mod control;
pub mod frame;
pub mod ha;
pub mod model;
pub mod rendezvous;
pub mod shm;
