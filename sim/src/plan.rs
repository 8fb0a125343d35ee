//! The planner: the cheapest hatrain setting that reaches a goodput target
//! under the given fault rates, or the cost that stands in the way.
//!
//! Cheapest means fewer standby hosts (idle hardware) first, then fewer
//! replicas (memory, and a copy per step); among the settings of that
//! cost that reach the target, the one with the highest goodput (elastic
//! resizing, snapshot and disk intervals cost no hardware). Every
//! candidate meets the same traces, so the comparison between them is
//! paired, not noise against noise.

use crate::policy::{Cause, Params, Policy, Setting};
use crate::run::{Summary, study};
use serde::Serialize;

/// Standby host counts tried.
pub const STANDBYS: [u32; 9] = [0, 1, 2, 4, 8, 16, 32, 64, 128];
/// Replica counts tried.
pub const REPLICAS: [u32; 3] = [0, 1, 2];
/// Steps between snapshots tried.
pub const SNAPSHOT_EVERY: [u32; 4] = [1, 3, 10, 30];
/// Disk intervals tried, hours; `None`: Young–Daly.
pub const INTERVALS_H: [Option<f64>; 2] = [None, Some(6.0)];

/// What the planner found.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub target: f64,
    /// The cheapest setting whose median goodput reaches the target.
    pub cheapest: Option<Summary>,
    /// The setting with the highest median goodput (the cheapest of
    /// equals).
    pub best: Summary,
    /// When none reaches it: the largest cause of loss of the best.
    pub blocker: Option<(Cause, f64)>,
    /// Settings tried.
    pub tried: usize,
}

/// Every candidate, cheapest hardware first.
pub fn candidates(min_hosts_frac: f64) -> Vec<(Policy, Setting)> {
    let mut out = Vec::new();
    for standby_hosts in STANDBYS {
        for replicas in REPLICAS {
            for policy in [Policy::Hatrain, Policy::Elastic] {
                for snapshot_every in SNAPSHOT_EVERY {
                    for interval in INTERVALS_H {
                        out.push((
                            policy,
                            Setting {
                                standby_hosts,
                                replicas,
                                disk_interval_s: interval.map(|h| h * 3600.0),
                                min_hosts_frac,
                                snapshot_every,
                                on_slow_replace: true,
                            },
                        ));
                    }
                }
            }
        }
    }
    out
}

/// The higher median goodput; of equals, the first (the cheaper).
fn better<'a>(a: &'a Summary, b: &'a Summary) -> &'a Summary {
    if b.goodput.median > a.goodput.median {
        b
    } else {
        a
    }
}

/// Searches the candidates for `target`.
pub fn plan(
    params: &Params,
    target: f64,
    min_hosts_frac: f64,
    seed: u64,
    runs: u64,
    threads: usize,
) -> Plan {
    let cases = candidates(min_hosts_frac);
    let summaries = study(params, &cases, seed, runs, threads);
    let hardware = |s: &Summary| (s.setting.standby_hosts, s.setting.replicas);
    let cheapest = summaries
        .iter()
        .filter(|s| s.goodput.median >= target)
        .min_by_key(|s| hardware(s))
        .map(hardware)
        .map(|cost| {
            summaries
                .iter()
                .filter(|s| hardware(s) == cost)
                .fold(None::<&Summary>, |acc, s| {
                    Some(acc.map_or(s, |a| better(a, s)))
                })
                .expect("the cheapest cost has a setting")
                .clone()
        });
    let best = summaries
        .iter()
        .fold(None::<&Summary>, |acc, s| {
            Some(acc.map_or(s, |a| better(a, s)))
        })
        .expect("candidates are never empty")
        .clone();
    let blocker = if cheapest.is_none() {
        best.lost.iter().copied().max_by(|a, b| a.1.total_cmp(&b.1))
    } else {
        None
    };
    Plan {
        target,
        cheapest,
        best,
        blocker,
        tried: cases.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::costs::{Measured, Published};
    use crate::rates::Rates;
    use crate::trace::Shape;

    fn params(rates: Rates) -> Params {
        Params {
            shape: Shape {
                accelerators: 2048,
                per_host: 8,
                span_s: 30.0 * 86_400.0,
            },
            rates,
            published: Published::default(),
            measured: Measured::checked_in(),
        }
    }

    #[test]
    fn with_no_faults_the_cheapest_is_no_standby_no_replica_and_the_sparsest_snapshots() {
        let p = plan(&params(Rates::none()), 0.5, 0.5, 1, 2, 2);
        let s = p.cheapest.expect("reached");
        assert_eq!((s.setting.standby_hosts, s.setting.replicas), (0, 0));
        assert_eq!(s.setting.snapshot_every, 30, "least overhead");
        assert!(p.blocker.is_none());
    }

    #[test]
    fn an_unreachable_target_names_what_stands_in_the_way() {
        // With no faults only the per-step overhead is lost, and even the
        // sparsest snapshots cost more than a millionth.
        let p = plan(&params(Rates::none()), 0.999_999, 0.5, 1, 2, 2);
        assert!(p.cheapest.is_none());
        let (cause, share) = p.blocker.expect("a blocker");
        assert_eq!(cause, Cause::Overhead);
        assert!((share - (1.0 - p.best.goodput.median)).abs() < 1e-9);
        // With Llama 3's host losses at three hundred times their rate,
        // time goes to recoveries, not only to overhead.
        let p = plan(&params(Rates::llama3().scaled(300.0)), 0.999, 0.5, 1, 4, 2);
        let (cause, _) = p.blocker.expect("a blocker");
        assert_ne!(cause, Cause::Overhead, "{:?}", p.best.lost);
    }

    #[test]
    fn more_host_losses_need_more_standby_hosts_or_replicas() {
        let calm = plan(&params(Rates::llama3()), 0.9, 0.5, 1, 8, 2);
        let rough = plan(&params(Rates::llama3().scaled(20.0)), 0.9, 0.5, 1, 8, 2);
        let cost = |p: &Plan| {
            p.cheapest.as_ref().map_or((u32::MAX, u32::MAX), |s| {
                (s.setting.standby_hosts, s.setting.replicas)
            })
        };
        // At the published rates the job needs neither; at twenty times
        // them, disk rollbacks of lost hosts cost too much without one.
        assert_eq!(cost(&calm), (0, 0));
        assert!(cost(&rough) > cost(&calm), "{:?}", cost(&rough));
        assert_ne!(cost(&rough), (u32::MAX, u32::MAX), "reachable");
    }
}
