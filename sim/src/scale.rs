//! hatrain's costs at a state size and a host shape other than the ones
//! they were measured at (`hatrain-sim --state-gb G --spare-cores C`).
//!
//! The step ratios and pauses in the costs file were measured on this
//! project's 2-core machine with a small model, where training takes every
//! core, so every byte hatrain copies is taken from training. On an
//! accelerator host the step runs on the device and hatrain's threads run
//! on host cores training leaves idle. So the model takes hatrain's costs
//! apart, as the benchmarks measure them:
//!
//! - **held time**: what the training thread spends in hatrain's calls per
//!   step (a fixed part and a part per GB of state), added to every step;
//! - **host CPU per GB**: the commit thread's CPU seconds per GB
//!   snapshotted, and the replica stream's (both ends) per GB replicated.
//!   A host's snapshot of `per_host × G` GB, and its replicas, must be
//!   copied by its `C` spare cores within the window a snapshot has (the
//!   `snapshot_every` steps until the next update); what does not fit in
//!   that window is waited for by training;
//! - **recovery per GB**: each of hatrain's pauses (UCE repair, crash,
//!   host loss onto a standby, shrink) grows by this many seconds per GB of
//!   state beyond the state it was measured with.
//!
//! Left out, and said so in the report: memory bandwidth shared with the
//! data loader, and the device-to-host copy (a DMA that overlaps compute).

use crate::costs::Measured;
use serde::Serialize;

/// The state and the host a run is scaled to.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Scale {
    /// GB (10⁹ bytes) of training state per accelerator.
    pub state_gb: f64,
    /// Host cores per host that training leaves to hatrain.
    pub spare_cores: f64,
}

/// hatrain's per-GB costs, read from the costs file.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PerGb {
    /// Held time per step, milliseconds: fixed, and per GB of state.
    pub held_ms_fixed: f64,
    pub held_ms_per_gb: f64,
    /// Commit-thread CPU seconds per GB snapshotted.
    pub snapshot_cpu_s_per_gb: f64,
    /// Replica stream CPU seconds per GB, sender and receiver together.
    pub replica_cpu_s_per_gb: f64,
    /// Recovery seconds per GB of state beyond `pause_state_gb`.
    pub recovery_s_per_gb: f64,
    /// The state per rank (GB) the pauses of the costs file were measured
    /// with.
    pub pause_state_gb: f64,
}

/// What the scaled model comes to, for the report.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Scaled {
    pub scale: Scale,
    /// Held seconds per step.
    pub held_s: f64,
    /// Seconds the spare cores need per snapshot of a host: the copy, and
    /// the copy with one replica.
    pub copy_s: f64,
    pub copy_and_replica_s: f64,
    /// Seconds added to each pause.
    pub pause_add_s: f64,
}

impl Scale {
    /// `m` with its step ratios and pauses at this scale, for hosts of
    /// `per_host` accelerators stepping every `step_s` seconds; and what
    /// the scaled figures came from.
    pub fn apply(&self, m: &Measured, g: &PerGb, per_host: u32, step_s: f64) -> (Measured, Scaled) {
        let gb = self.state_gb;
        let held_s = (g.held_ms_fixed + g.held_ms_per_gb * gb) / 1e3;
        let host_gb = gb * f64::from(per_host.max(1));
        let cores = self.spare_cores.max(1e-9);
        let copy_s = host_gb * g.snapshot_cpu_s_per_gb / cores;
        let copy_and_replica_s =
            host_gb * (g.snapshot_cpu_s_per_gb + g.replica_cpu_s_per_gb) / cores;
        // Within a step's window, what does not fit is waited for.
        let wait = |need: f64| (need - step_s).max(0.0);
        let snapshot = 1.0 + (held_s + wait(copy_s)) / step_s;
        let replica = 1.0 + (wait(copy_and_replica_s) - wait(copy_s)) / step_s;
        let pause_add_s = g.recovery_s_per_gb * (gb - g.pause_state_gb).max(0.0);
        let mut out = m.clone();
        out.snapshot_step_ratio = snapshot;
        out.replica_step_ratio = replica;
        out.uce_pause_s += pause_add_s;
        out.crash_pause_s += pause_add_s;
        out.host_standby_pause_s += pause_add_s;
        out.shrink_pause_s += pause_add_s;
        (
            out,
            Scaled {
                scale: *self,
                held_s,
                copy_s,
                copy_and_replica_s,
                pause_add_s,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn per_gb() -> PerGb {
        PerGb {
            held_ms_fixed: 1.0,
            held_ms_per_gb: 0.5,
            snapshot_cpu_s_per_gb: 0.4,
            replica_cpu_s_per_gb: 0.8,
            recovery_s_per_gb: 2.0,
            pause_state_gb: 0.5,
        }
    }

    #[test]
    fn copies_that_fit_their_window_cost_only_the_held_time() {
        let m = Measured::checked_in();
        // 8 × 10 GB on 16 cores: 2 s of copying, 6 s with a replica, in
        // a 10 s step.
        let s = Scale {
            state_gb: 10.0,
            spare_cores: 16.0,
        };
        let (out, why) = s.apply(&m, &per_gb(), 8, 10.0);
        assert!((why.held_s - 0.006).abs() < 1e-12, "{why:?}");
        assert!((why.copy_s - 2.0).abs() < 1e-9 && (why.copy_and_replica_s - 6.0).abs() < 1e-9);
        assert!((out.snapshot_step_ratio - 1.0006).abs() < 1e-12, "{out:?}");
        assert_eq!(out.replica_step_ratio, 1.0);
        // 2 s per GB for the 9.5 GB beyond what the pauses were measured at.
        assert!((out.crash_pause_s - (m.crash_pause_s + 19.0)).abs() < 1e-9);
        assert!((out.host_standby_pause_s - (m.host_standby_pause_s + 19.0)).abs() < 1e-9);
        assert_eq!(out.grow_pause_s, m.grow_pause_s);
    }

    #[test]
    fn what_does_not_fit_the_window_is_waited_for() {
        let m = Measured::checked_in();
        // 2 cores: 16 s of copying and 48 s with the replica, per 10 s step.
        let s = Scale {
            state_gb: 10.0,
            spare_cores: 2.0,
        };
        let (out, _) = s.apply(&m, &per_gb(), 8, 10.0);
        assert!((out.snapshot_step_ratio - (1.0 + (0.006 + 6.0) / 10.0)).abs() < 1e-9);
        assert!((out.replica_step_ratio - (1.0 + (38.0 - 6.0) / 10.0)).abs() < 1e-9);
        // Fewer cores never cost less.
        let more = Scale {
            spare_cores: 4.0,
            ..s
        };
        let (fewer_waits, _) = more.apply(&m, &per_gb(), 8, 10.0);
        assert!(fewer_waits.snapshot_step_ratio < out.snapshot_step_ratio);
    }
}
