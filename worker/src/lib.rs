//! `hatrain-worker`: what a training process links.
//!
//! - [`rendezvous`]: the store the ranks of an epoch meet in (server, client);
//! - [`collective`]: abortable ring collectives over TCP, one per epoch;
//! - [`data`], [`model`], [`optim`]: the reference workload (a synthetic
//!   Markov-chain token stream, a small language model in candle, AdamW over
//!   a ZeRO-1 shard);
//! - [`trainer`]: the reference trainer `hatrain-train`.

pub mod collective;
pub mod data;
pub mod model;
pub mod optim;
pub mod rendezvous;
pub mod runtime;
pub mod trainer;
pub mod uce;
