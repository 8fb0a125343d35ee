//! A slow rank, as the agent's detector reports it (`agentctl slow`,
//! `agentctl status`, the metrics, one log line when it begins and one
//! when it ends).

use serde::{Deserialize, Serialize};

/// A rank found holding the job back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlowFinding {
    pub rank: usize,
    /// The phase that grew on it: `data`, `compute` or `update`; `gc` when
    /// its garbage collector took half the excess or more.
    pub phase: String,
    /// How much longer its own work (data, compute and update) took per
    /// step than the other ranks' (their median), in the window that
    /// confirmed it, and the job's step then.
    pub excess_ms: f64,
    pub step_ms: f64,
    /// How much longer than its own work before it was slow.
    pub over_own_history_ms: f64,
    /// The step at which it was first seen slow, and the last step seen.
    pub since_step: u64,
    pub last_step: u64,
    /// The likely cause, in words.
    pub cause: String,
    /// It was the only rank slow when it was confirmed (since control
    /// protocol 1.8).
    #[serde(default)]
    pub alone: bool,
    /// The host it runs on, where the detector knew it (a controller's,
    /// which compares every host's ranks; since control protocol 1.8).
    #[serde(default)]
    pub host: Option<u64>,
    /// Every rank of its host was slow with it, and no other rank: the
    /// host holds the job back (since control protocol 1.9).
    #[serde(default)]
    pub whole_host: bool,
    /// It no longer holds the job back.
    pub ended: bool,
}

impl SlowFinding {
    /// What it has cost the job so far: every rank waited its excess in
    /// each step from the first seen slow to the last.
    pub fn cost_ms(&self) -> f64 {
        let steps = self.last_step.saturating_sub(self.since_step) + 1;
        self.excess_ms * steps as f64
    }
}
