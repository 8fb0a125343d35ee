//! The terminal tables.

use crate::plan::Plan;
use crate::policy::Setting;
use crate::run::Summary;
use std::fmt::Write;

fn pct(x: f64) -> String {
    format!("{:.2}%", x * 100.0)
}

/// How a disk interval reads.
pub fn interval(s: Option<f64>) -> String {
    match s {
        Some(s) if s < 3600.0 => format!("disk every {:.0} min", s / 60.0),
        Some(s) => format!("disk every {:.1} h", s / 3600.0),
        None => "no periodic disk saves".into(),
    }
}

/// A setting in words.
pub fn setting(s: &Summary) -> String {
    let st: &Setting = &s.setting;
    if s.policy.is_hatrain() {
        format!(
            "{} standby, {} replica{}, snapshot every {} step{}, {}{}",
            st.standby_hosts,
            st.replicas,
            if st.replicas == 1 { "" } else { "s" },
            st.snapshot_every,
            if st.snapshot_every == 1 { "" } else { "s" },
            interval(s.disk_interval_s),
            if st.on_slow_replace {
                ", slow hosts handed over"
            } else {
                ""
            }
        )
    } else {
        interval(s.disk_interval_s)
    }
}

/// The scaled costs in words (`--state-gb`).
pub fn scaled(w: &crate::scale::Scaled) -> String {
    format!(
        "hatrain's costs scaled to {} GB of state per accelerator and {} spare cores per host: held {:.2} ms per step; a host's snapshot takes its spare cores {:.2} s ({:.2} s with one replica), waited for beyond the step; each recovery {:.1} s longer (memory bandwidth and the device-to-host copy not modelled)\n",
        w.scale.state_gb,
        w.scale.spare_cores,
        w.held_s * 1e3,
        w.copy_s,
        w.copy_and_replica_s,
        w.pause_add_s
    )
}

/// The comparison table: goodput with its spread, stops, and the time lost
/// by cause.
pub fn table(summaries: &[Summary]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<16} {:>8} {:>17} {:>6} {:>6}  setting",
        "policy", "goodput", "p10–p90", "stops", "step×"
    );
    for s in summaries {
        let _ = writeln!(
            out,
            "{:<16} {:>8} {:>17} {:>6.1} {:>6.3}  {}",
            s.policy.name(),
            pct(s.goodput.median),
            format!("{}–{}", pct(s.goodput.p10), pct(s.goodput.p90)),
            s.stops.median,
            s.step_ratio,
            setting(s)
        );
    }
    let _ = writeln!(out, "\ntime lost by cause (mean share of the span):");
    let _ = write!(out, "{:<16}", "policy");
    for (c, _) in &summaries[0].lost {
        let _ = write!(out, " {:>10}", c.name());
    }
    let _ = writeln!(out);
    for s in summaries {
        let _ = write!(out, "{:<16}", s.policy.name());
        for (_, v) in &s.lost {
            let _ = write!(out, " {:>10}", pct(*v));
        }
        let _ = writeln!(out);
    }
    out
}

/// The planner's answer.
pub fn plan(p: &Plan) -> String {
    let mut out = String::new();
    match &p.cheapest {
        Some(s) => {
            let _ = writeln!(
                out,
                "cheapest setting reaching {}: {} ({}), median goodput {} (p10 {})",
                pct(p.target),
                setting(s),
                if s.policy == crate::Policy::Elastic {
                    "elastic on"
                } else {
                    "elastic off"
                },
                pct(s.goodput.median),
                pct(s.goodput.p10)
            );
        }
        None => {
            let _ = writeln!(
                out,
                "no setting of the {} tried reaches {}: the best is {} ({}) at {}",
                p.tried,
                pct(p.target),
                setting(&p.best),
                p.best.policy.name(),
                pct(p.best.goodput.median)
            );
            if let Some((cause, share)) = p.blocker {
                let _ = writeln!(
                    out,
                    "what stands in the way: {} ({} of the time)",
                    cause.name(),
                    pct(share)
                );
            }
        }
    }
    out
}
