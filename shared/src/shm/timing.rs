//! Where a rank's training steps go, phase by phase (control page 2.4):
//! the runtime sums each step's time in each [`StepPhase`] and adds it to
//! the page once per step, where the agent reads it with the other words
//! (no syscall on either side). A slow rank shows as a phase that grew on
//! it alone, while the others' collective time grew waiting for it.

use super::page::ControlPage;
use std::sync::atomic::Ordering;

/// The phases of a training step, by the runtime's calls that bound them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepPhase {
    /// From `begin_step` until the loop says its batch is ready.
    Data,
    /// From then (or `begin_step`) until the start-update fence, less the
    /// collectives in between: forward and backward.
    Compute,
    /// Inside `collective` calls: waiting on the peers and moving data.
    Collective,
    /// From the start-update fence's end until the end-update fence, less
    /// the collectives in between: the optimizer's update.
    Update,
    /// The whole step, `begin_step` to the next `begin_step` (the rest is
    /// hatrain's fences, the commit hand-off, and the loop's own work
    /// after the update).
    Step,
}

/// The number of phases, and of their words in the page.
pub const PHASES: usize = 5;

impl StepPhase {
    pub const ALL: [StepPhase; PHASES] = [
        StepPhase::Data,
        StepPhase::Compute,
        StepPhase::Collective,
        StepPhase::Update,
        StepPhase::Step,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Data => "data",
            Self::Compute => "compute",
            Self::Collective => "collective",
            Self::Update => "update",
            Self::Step => "step",
        }
    }
}

/// Steps timed, and their ns in each phase summed over them (in the order
/// of [`StepPhase::ALL`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StepTimes {
    pub steps: u64,
    pub ns: [u64; PHASES],
    /// A Python worker's garbage collections (within the steps' phases,
    /// wherever they ran): their ns, how many, and the sum of the steps
    /// they ran in (collections planned at the same steps on every rank
    /// sum to the same).
    pub gc_ns: u64,
    pub gc_collections: u64,
    pub gc_step_sum: u64,
}

impl StepTimes {
    /// The ns of `phase`.
    pub fn of(&self, phase: StepPhase) -> u64 {
        self.ns[phase as usize]
    }

    /// What was timed since `earlier` (a reading of the same page).
    pub fn since(&self, earlier: &StepTimes) -> StepTimes {
        StepTimes {
            steps: self.steps.saturating_sub(earlier.steps),
            ns: std::array::from_fn(|i| self.ns[i].saturating_sub(earlier.ns[i])),
            gc_ns: self.gc_ns.saturating_sub(earlier.gc_ns),
            gc_collections: self.gc_collections.saturating_sub(earlier.gc_collections),
            gc_step_sum: self.gc_step_sum.saturating_sub(earlier.gc_step_sum),
        }
    }

    /// Mean ms per step of `phase`; `None` before any step.
    pub fn mean_ms(&self, phase: StepPhase) -> Option<f64> {
        (self.steps > 0).then(|| self.of(phase) as f64 / self.steps as f64 / 1e6)
    }
}

/// A rank's mean ms per step in each phase, over the steps timed.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepTimesReport {
    pub steps: u64,
    pub data_ms: f64,
    pub compute_ms: f64,
    pub collective_ms: f64,
    pub update_ms: f64,
    pub step_ms: f64,
    /// A Python worker's garbage collections: ms per step, how many, and
    /// the sum of the steps they ran in (since control protocol 1.8).
    #[serde(default)]
    pub gc_ms: f64,
    #[serde(default)]
    pub gc_collections: u64,
    #[serde(default)]
    pub gc_step_sum: u64,
}

impl StepTimesReport {
    /// The report of `t`; `None` before a step was timed.
    pub fn of(t: &StepTimes) -> Option<Self> {
        let ms = |p| t.mean_ms(p);
        Some(Self {
            steps: t.steps,
            data_ms: ms(StepPhase::Data)?,
            compute_ms: ms(StepPhase::Compute)?,
            collective_ms: ms(StepPhase::Collective)?,
            update_ms: ms(StepPhase::Update)?,
            step_ms: ms(StepPhase::Step)?,
            gc_ms: t.gc_ns as f64 / t.steps as f64 / 1e6,
            gc_collections: t.gc_collections,
            gc_step_sum: t.gc_step_sum,
        })
    }
}

impl ControlPage {
    /// Adds one step's phase times (worker side).
    pub fn record_step(&self, ns: &[u64; PHASES]) {
        for (word, n) in self.phase_ns.iter().zip(ns) {
            word.fetch_add(*n, Ordering::Relaxed);
        }
        self.timed_steps.fetch_add(1, Ordering::Release);
    }

    /// Adds one garbage collection of `ns` that ran in `step` (worker
    /// side).
    pub fn record_gc(&self, ns: u64, step: u64) {
        self.gc_ns.fetch_add(ns, Ordering::Relaxed);
        self.gc_step_sum.fetch_add(step, Ordering::Relaxed);
        self.gc_collections.fetch_add(1, Ordering::Release);
    }

    /// The steps timed so far (agent side).
    pub fn step_times(&self) -> StepTimes {
        let steps = self.timed_steps.load(Ordering::Acquire);
        let gc_collections = self.gc_collections.load(Ordering::Acquire);
        StepTimes {
            steps,
            ns: std::array::from_fn(|i| self.phase_ns[i].load(Ordering::Relaxed)),
            gc_ns: self.gc_ns.load(Ordering::Relaxed),
            gc_collections,
            gc_step_sum: self.gc_step_sum.load(Ordering::Relaxed),
        }
    }
}
