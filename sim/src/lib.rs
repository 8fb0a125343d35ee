//! hatrain-sim: what a fault-tolerance setup is worth on a cluster of
//! 1,000 to 100,000 accelerators, before anyone runs it.
//!
//! A deterministic discrete-event simulation of one data-parallel job:
//! faults are drawn per component from rates by kind (`rates`, `trace`),
//! and each policy (`policy`) meets the same trace (`engine`): restart from
//! disk, restart from memory, hatrain, hatrain with elastic resizing.
//! hatrain's costs are the ones its benchmarks measured (`costs`); the
//! others' are published figures. `run` repeats it over many seeds on
//! every core, `plan` searches hatrain's settings for a goodput target,
//! `chart` draws goodput against cluster size. The model does no I/O: only
//! `costs::Measured::load`, `chart` and the binary touch files.

pub mod chart;
pub mod cli;
pub mod costs;
pub mod engine;
pub mod plan;
pub mod policy;
pub mod rates;
pub mod report;
pub mod run;
pub mod scale;
pub mod theory;
pub mod trace;

pub use costs::{Measured, Published};
pub use engine::simulate;
pub use policy::{Cause, Outcome, Params, Policy, Setting};
pub use rates::Rates;
pub use trace::{Fault, Kind, Shape};
