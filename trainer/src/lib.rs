//! `hatrain-trainer`: the reference workload `hatrain-train`, a training
//! job like any other that links the worker runtime.
//!
//! - [`config`]: the model's shape and the layout of its flat buffer;
//! - [`model`], [`data`], [`optim`]: a small language model in candle, a
//!   synthetic Markov-chain token stream of known entropy, AdamW over a
//!   ZeRO-1 shard;
//! - [`collective`]: abortable ring collectives over TCP, one per epoch;
//! - [`dist`]: where a rank sits in the job and how it meets its peers;
//! - [`checkpoint`]: the trainer's state map and checkpoint loader;
//! - [`faults`]: the deterministic fault plan tests and the demo use;
//! - [`emulate`]: `--emulate-device`, a step shaped as on an accelerator;
//! - [`stop`]: a rank's compute stopped when its job is paused;
//! - [`trainer`]: the training loop.

pub mod checkpoint;
pub mod collective;
pub mod config;
pub mod data;
pub mod dist;
pub mod emulate;
pub mod faults;
pub mod model;
pub mod optim;
pub mod stop;
pub mod trainer;
