//! The policies compared, their settings, and what a simulated run of one
//! policy over one trace comes to.

use crate::costs::{Measured, Published};
use crate::rates::Rates;
use crate::trace::{Kind, Shape, kind_rates};
use serde::Serialize;

/// How a job gets through its faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// (a) Every fault restarts every process from the last disk
    /// checkpoint, written blocking (torchrun's way).
    Disk,
    /// (b) Every fault restarts every process from an in-memory checkpoint
    /// on the same hosts; a lost host falls back to disk (DLRover's flash
    /// checkpoint).
    Memory,
    /// (c) hatrain: in-place UCE repair and worker reboot, peer replicas,
    /// standby hosts, last words when nothing else helps.
    Hatrain,
    /// (d) hatrain that shrinks the group when no standby is left and
    /// grows it back when a host is repaired.
    Elastic,
}

impl Policy {
    pub const ALL: [Policy; 4] = [
        Policy::Disk,
        Policy::Memory,
        Policy::Hatrain,
        Policy::Elastic,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Disk => "disk restart",
            Policy::Memory => "memory restart",
            Policy::Hatrain => "hatrain",
            Policy::Elastic => "hatrain elastic",
        }
    }

    /// Whether hatrain's settings (standbys, replicas) apply.
    pub fn is_hatrain(self) -> bool {
        matches!(self, Policy::Hatrain | Policy::Elastic)
    }

    /// Whether this policy's disk saves block training.
    pub fn blocking_saves(self) -> bool {
        self == Policy::Disk
    }
}

/// The knobs a planner turns.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Setting {
    /// Idle standby hosts held for the job (hatrain).
    pub standby_hosts: u32,
    /// Other hosts holding a copy of each host's snapshots, each in
    /// another failure domain (hatrain's `--replicas`).
    pub replicas: u32,
    /// Seconds of training between disk saves; `None`: Young–Daly for the
    /// faults that roll back to disk under this policy.
    pub disk_interval_s: Option<f64>,
    /// The smallest share of the hosts an elastic job keeps training on.
    pub min_hosts_frac: f64,
    /// Steps between hatrain's snapshots (its `--snapshot-interval`): a
    /// longer one costs less per step and more work redone per fault.
    pub snapshot_every: u32,
    /// hatrain hands a slow host over (its `--on-slow replace`): to a
    /// standby host, or (elastic) out of the group until the slowdown is
    /// over, once what it has cost equals the price of the hand-over.
    pub on_slow_replace: bool,
}

impl Default for Setting {
    fn default() -> Self {
        Self {
            standby_hosts: 2,
            replicas: 1,
            disk_interval_s: None,
            min_hosts_frac: 0.5,
            snapshot_every: 1,
            on_slow_replace: true,
        }
    }
}

/// Everything one simulated run depends on besides the trace.
#[derive(Debug, Clone)]
pub struct Params {
    pub shape: Shape,
    pub rates: Rates,
    pub published: Published,
    pub measured: Measured,
}

/// Where lost time goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Cause {
    /// Waiting for a fault to be noticed.
    Detection,
    /// Restarting, requeueing, or hatrain's in-memory recovery.
    Restart,
    /// Reading state back from disk or memory.
    Load,
    /// Bringing a grown group back in step.
    Resync,
    /// Work done and thrown away.
    Redone,
    /// The per-step cost of snapshots, replicas and background saves.
    Overhead,
    /// Blocking checkpoint writes and last-words dumps.
    Checkpoint,
    /// Training on fewer hosts after an elastic shrink.
    Shrunk,
    /// Training behind a slow host.
    Slowdown,
}

impl Cause {
    pub const ALL: [Cause; 9] = [
        Cause::Detection,
        Cause::Restart,
        Cause::Load,
        Cause::Resync,
        Cause::Redone,
        Cause::Overhead,
        Cause::Checkpoint,
        Cause::Shrunk,
        Cause::Slowdown,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Cause::Detection => "detection",
            Cause::Restart => "restart",
            Cause::Load => "load",
            Cause::Resync => "re-sync",
            Cause::Redone => "redone",
            Cause::Overhead => "overhead",
            Cause::Checkpoint => "checkpoint",
            Cause::Shrunk => "shrunk",
            Cause::Slowdown => "slowdown",
        }
    }
}

/// What one run came to.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The share of the span spent on steps that were kept.
    pub goodput: f64,
    /// Seconds lost, by `Cause::ALL` order.
    pub lost: [f64; 9],
    /// Times the job stopped and had to be requeued.
    pub stops: u32,
    /// Faults met, by `Kind::ALL` order.
    pub faults: [u32; 6],
}

/// Rate per second of the faults that roll a policy back to its last disk
/// checkpoint (for Young–Daly).
pub fn rollback_rate(policy: Policy, setting: &Setting, shape: &Shape, rates: &Rates) -> f64 {
    let r = kind_rates(shape, rates);
    let lost_hosts = r[Kind::Host as usize] + r[Kind::Domain as usize];
    match policy {
        Policy::Disk => r[..5].iter().sum(),
        Policy::Memory => lost_hosts,
        Policy::Hatrain | Policy::Elastic if setting.replicas == 0 => lost_hosts,
        Policy::Hatrain | Policy::Elastic => 0.0,
    }
}

/// Young–Daly's first-order optimum: `sqrt(2 δ / λ)` for a save costing
/// `δ` seconds and rollbacks at rate `λ` per second (∞ with none).
pub fn young_daly(write_s: f64, rate: f64) -> f64 {
    if rate > 0.0 {
        (2.0 * write_s / rate).sqrt()
    } else {
        f64::INFINITY
    }
}

/// The shortest disk interval simulated, seconds.
pub const MIN_INTERVAL_S: f64 = 10.0;

/// The disk interval a run uses: the setting's, or Young–Daly's for what a
/// save costs this policy; a background save cannot start before the last
/// one ends.
pub fn disk_interval(policy: Policy, setting: &Setting, p: &Params) -> f64 {
    let w = p.published.ckpt_write_s;
    // What one save costs training: all of its write when it blocks; when
    // it runs beside training, the measured slowdown per second of writing.
    let cost = if policy.blocking_saves() {
        w
    } else {
        let m = &p.measured;
        w * (m.persist_step_ratio - 1.0) / m.persist_duty
    };
    let tau = setting
        .disk_interval_s
        .unwrap_or_else(|| young_daly(cost, rollback_rate(policy, setting, &p.shape, &p.rates)));
    // Nobody saves more often than every 10 s or every step.
    let floor = p.published.step_s.max(MIN_INTERVAL_S);
    if policy.blocking_saves() {
        tau.max(floor)
    } else {
        tau.max(w).max(floor)
    }
}

/// Step time with this policy's per-step work ÷ without.
pub fn step_ratio(policy: Policy, setting: &Setting, p: &Params, interval: f64) -> f64 {
    let m = &p.measured;
    let snap = m.snapshot_step_ratio - 1.0;
    // The agent's writer costs in proportion to how much of the time it
    // writes; measured at `persist_duty`.
    let duty = if interval.is_finite() {
        (p.published.ckpt_write_s / interval).min(1.0)
    } else {
        0.0
    };
    let persist = (m.persist_step_ratio - 1.0) * duty / m.persist_duty;
    match policy {
        Policy::Disk => 1.0,
        Policy::Memory => 1.0 + snap + persist,
        // Each replica streams the snapshot once more, at the measured
        // cost of one.
        Policy::Hatrain | Policy::Elastic => {
            let copies = snap + (m.replica_step_ratio - 1.0) * f64::from(setting.replicas);
            1.0 + copies / f64::from(setting.snapshot_every.max(1)) + persist
        }
    }
}
