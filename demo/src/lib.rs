//! `hatrain-demo`: the project's main job on its embedded default, a
//! program of its own that starts `hatrain-agent` and `hatrain-train` as
//! the real processes they are ([`demo`], and a host lost from a job of
//! several ([`hostloss`])), draws its loss curve ([`plot`]),
//! and finds the project's binaries for it and for the scenario tests
//! ([`bins`]).

pub mod bins;
pub mod demo;
pub mod hostloss;
pub mod plot;
