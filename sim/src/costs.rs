//! What each recovery costs: the published costs of today's restarts, and
//! hatrain's own costs as its benchmarks measured them.
//!
//! hatrain's costs come from a JSON file that the project's benchmarks
//! write (`target/sim-costs.json`, or `$HATRAIN_SIM_COSTS`), one entry per
//! measured figure:
//!
//! ```text
//! { "format": "hatrain-sim-costs", "version": 1, "machine": "2 cores, 24 GiB",
//!   "costs": { "uce_pause_s": { "value": 0.158, "source": "cargo bench …",
//!                               "measured": "2026-12-04" }, … } }
//! ```
//!
//! The checked-in default (`sim/costs.json`) is the latest measured run.
//! A file that lacks an entry the model needs, or holds one that is not a
//! finite number in its range, is refused with the key named.

use crate::scale::PerGb;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// The checked-in costs: the latest run of the project's benchmarks.
pub const DEFAULT_COSTS: &str = include_str!("../costs.json");

/// Why a costs file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CostsError {
    #[error("cannot read the costs file {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the costs file {path} is not hatrain-sim-costs JSON: {source}")]
    Parse {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "the costs file {path} has format {format:?} version {version}; this reads \"hatrain-sim-costs\" version 1"
    )]
    Format {
        path: String,
        format: String,
        version: u32,
    },
    #[error("the costs file {path} has no entry {key:?} ({what}); run {bench}")]
    Missing {
        path: String,
        key: &'static str,
        what: &'static str,
        bench: &'static str,
    },
    #[error("the costs file {path}: {key} = {value} is outside [{lo}, {hi}] ({what})")]
    Range {
        path: String,
        key: &'static str,
        value: f64,
        lo: f64,
        hi: f64,
        what: &'static str,
    },
}

/// One measured figure and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub value: f64,
    pub source: String,
    pub measured: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    format: String,
    version: u32,
    machine: String,
    costs: BTreeMap<String, Entry>,
}

/// hatrain's measured costs, in the units the model uses.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Measured {
    /// Where they were measured.
    pub machine: String,
    /// Step time with a snapshot every step ÷ none.
    pub snapshot_step_ratio: f64,
    /// Step time with one peer replica ÷ none (on top of the snapshot).
    pub replica_step_ratio: f64,
    /// Step time with the agent writing checkpoints ÷ none, at
    /// `persist_duty`.
    pub persist_step_ratio: f64,
    /// The share of time the agent's writer was busy when
    /// `persist_step_ratio` was measured.
    pub persist_duty: f64,
    /// UCE repair, excluding the recomputed step.
    pub uce_pause_s: f64,
    /// Worker crash → first step again, less one step.
    pub crash_pause_s: f64,
    /// Host lost → first step on a standby host, less one step.
    pub host_standby_pause_s: f64,
    /// Host lost → first step at the smaller size, less one step.
    pub shrink_pause_s: f64,
    /// The pause of the running ranks while a host joins back.
    pub grow_pause_s: f64,
    /// Last-words dump time ÷ a plain write of the same bytes.
    pub dump_time_ratio: f64,
    /// hatrain's costs per GB of state, for a run scaled to another state
    /// size and host (`crate::scale`); `None` in a file without them.
    pub per_gb: Option<PerGb>,
    /// Steps from the onset of one rank's slowdown to the agent's finding
    /// (`scripts/slow-detect.sh delay`); `None` in a file without it: no
    /// slowdown is detected, so none is handed over.
    pub slow_detect_steps: Option<f64>,
    /// Every entry as it was read, for the report.
    pub entries: BTreeMap<String, Entry>,
}

/// The entries of [`PerGb`]: `(key, what it is, the bench, lowest,
/// highest)`. A file has all of them or none.
const PER_GB_KEYS: [(&str, &str, &str, f64, f64); 6] = [
    (
        "held_ms_fixed",
        "held time per step, fixed part (ms)",
        "HATRAIN_BENCH_EMULATE_MS=2000 cargo bench -p hatrain-scenarios --bench replica",
        0.0,
        1e6,
    ),
    (
        "held_ms_per_gb",
        "held time per step per GB of state (ms)",
        "HATRAIN_BENCH_EMULATE_MS=2000 cargo bench -p hatrain-scenarios --bench replica",
        0.0,
        1e6,
    ),
    (
        "snapshot_cpu_s_per_gb",
        "commit-thread CPU seconds per GB snapshotted",
        "HATRAIN_BENCH_EMULATE_MS=2000 cargo bench -p hatrain-scenarios --bench replica",
        0.0,
        1e3,
    ),
    (
        "replica_cpu_s_per_gb",
        "replica stream CPU seconds per GB, both ends",
        "cargo bench -p hatrain-scenarios --bench replica",
        0.0,
        1e3,
    ),
    (
        "recovery_s_per_gb",
        "recovery seconds per GB of state",
        "cargo bench -p hatrain-scenarios --bench recovery",
        0.0,
        1e4,
    ),
    (
        "pause_state_gb",
        "state per rank the pauses were measured with (GB)",
        "cargo bench -p hatrain-scenarios --bench recovery",
        0.0,
        1e4,
    ),
];

/// The slow-rank detector's delay, optional (see
/// [`Measured::slow_detect_steps`]).
const SLOW_DETECT: (&str, &str, &str, f64, f64) = (
    "slow_detect_steps",
    "steps from a rank's slowdown to the finding",
    "scripts/slow-detect.sh delay 7 and delay 22",
    1.0,
    1e6,
);

/// `(key, what it is, the bench that measures it, lowest, highest)`.
const KEYS: [(&str, &str, &str, f64, f64); 10] = [
    (
        "snapshot_step_ratio",
        "step time with a snapshot every step ÷ none",
        "cargo bench -p hatrain-scenarios --bench recovery",
        1.0,
        10.0,
    ),
    (
        "replica_step_ratio",
        "step time with one peer replica ÷ none",
        "cargo bench -p hatrain-scenarios --bench replica",
        1.0,
        10.0,
    ),
    (
        "persist_step_ratio",
        "step time with agent-side saves ÷ none",
        "cargo bench -p hatrain-scenarios --bench persist",
        1.0,
        10.0,
    ),
    (
        "persist_duty",
        "the agent writer's busy share during that",
        "cargo bench -p hatrain-scenarios --bench persist",
        1e-6,
        1.0,
    ),
    (
        "uce_pause_s",
        "UCE repair less the recomputed step",
        "cargo bench -p hatrain-scenarios --bench uce",
        0.0,
        3600.0,
    ),
    (
        "crash_pause_s",
        "worker crash → first step, less one step",
        "cargo bench -p hatrain-scenarios --bench recovery",
        0.0,
        3600.0,
    ),
    (
        "host_standby_pause_s",
        "host lost → first step on a standby, less one step",
        "cargo bench -p hatrain-scenarios --bench hostloss",
        0.0,
        3600.0,
    ),
    (
        "shrink_pause_s",
        "host lost → first step at the smaller size, less one step",
        "cargo bench -p hatrain-scenarios --bench elastic",
        0.0,
        3600.0,
    ),
    (
        "grow_pause_s",
        "the running ranks' pause while a host joins",
        "cargo bench -p hatrain-scenarios --bench elastic",
        0.0,
        3600.0,
    ),
    (
        "dump_time_ratio",
        "last-words dump ÷ a plain write",
        "cargo bench -p hatrain-scenarios --bench dump",
        0.1,
        100.0,
    ),
];

/// The values of `keys` in `file`, each present and in its range.
fn read_keys<const N: usize>(
    file: &File,
    path: &str,
    keys: [(&'static str, &'static str, &'static str, f64, f64); N],
) -> Result<[f64; N], CostsError> {
    let mut v = [0.0; N];
    for (slot, (key, what, bench, lo, hi)) in v.iter_mut().zip(keys) {
        let e = file.costs.get(key).ok_or(CostsError::Missing {
            path: path.into(),
            key,
            what,
            bench,
        })?;
        if !(e.value.is_finite() && e.value >= lo && e.value <= hi) {
            return Err(CostsError::Range {
                path: path.into(),
                key,
                value: e.value,
                lo,
                hi,
                what,
            });
        }
        *slot = e.value;
    }
    Ok(v)
}

impl Measured {
    /// The checked-in default.
    pub fn checked_in() -> Self {
        Self::parse(DEFAULT_COSTS, "sim/costs.json").expect("the checked-in costs parse")
    }

    /// Reads a costs file the benchmarks wrote.
    pub fn load(path: &Path) -> Result<Self, CostsError> {
        let name = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| CostsError::Read {
            path: name.clone(),
            source,
        })?;
        Self::parse_bytes(&bytes, &name)
    }

    /// Parses costs JSON; `path` names it in errors.
    pub fn parse(text: &str, path: &str) -> Result<Self, CostsError> {
        Self::parse_bytes(text.as_bytes(), path)
    }

    /// Parses costs JSON from bytes (which need not be UTF-8 to be refused
    /// clearly).
    pub fn parse_bytes(bytes: &[u8], path: &str) -> Result<Self, CostsError> {
        let file: File = serde_json::from_slice(bytes).map_err(|source| CostsError::Parse {
            path: path.into(),
            source,
        })?;
        if file.format != "hatrain-sim-costs" || file.version != 1 {
            return Err(CostsError::Format {
                path: path.into(),
                format: file.format,
                version: file.version,
            });
        }
        let v: [f64; KEYS.len()] = read_keys(&file, path, KEYS)?;
        let present = PER_GB_KEYS
            .iter()
            .filter(|k| file.costs.contains_key(k.0))
            .count();
        let per_gb = if present == 0 {
            None
        } else {
            let g: [f64; PER_GB_KEYS.len()] = read_keys(&file, path, PER_GB_KEYS)?;
            Some(PerGb {
                held_ms_fixed: g[0],
                held_ms_per_gb: g[1],
                snapshot_cpu_s_per_gb: g[2],
                replica_cpu_s_per_gb: g[3],
                recovery_s_per_gb: g[4],
                pause_state_gb: g[5],
            })
        };
        let slow_detect_steps = match file.costs.get(SLOW_DETECT.0) {
            None => None,
            Some(_) => Some(read_keys(&file, path, [SLOW_DETECT])?[0]),
        };
        Ok(Self {
            machine: file.machine,
            per_gb,
            slow_detect_steps,
            snapshot_step_ratio: v[0],
            replica_step_ratio: v[1],
            persist_step_ratio: v[2],
            persist_duty: v[3],
            uce_pause_s: v[4],
            crash_pause_s: v[5],
            host_standby_pause_s: v[6],
            shrink_pause_s: v[7],
            grow_pause_s: v[8],
            dump_time_ratio: v[9],
            entries: file.costs,
        })
    }
}

/// Today's restarts at scale, from published figures; the help text of
/// each flag names the source.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Published {
    /// Seconds one step takes.
    pub step_s: f64,
    /// Seconds a blocking checkpoint write takes (Meta: about 5 minutes).
    pub ckpt_write_s: f64,
    /// Seconds to read a checkpoint back from disk.
    pub disk_load_s: f64,
    /// Seconds to restart every process: start, import, build, join the
    /// collectives.
    pub init_s: f64,
    /// Seconds for the scheduler to requeue the job on a replacement host.
    pub requeue_s: f64,
    /// Seconds before a crashed worker is noticed by the launcher.
    pub detect_crash_s: f64,
    /// Seconds before a hang or a lost host ends in an error: the
    /// collectives' timeout.
    pub detect_timeout_s: f64,
    /// Seconds to read an in-memory checkpoint back (DLRover's flash
    /// checkpoint).
    pub mem_load_s: f64,
    /// hatrain's host-loss timeout, seconds.
    pub host_timeout_s: f64,
}

impl Default for Published {
    fn default() -> Self {
        Self {
            step_s: 10.0,
            ckpt_write_s: 300.0,
            disk_load_s: 120.0,
            init_s: 240.0,
            requeue_s: 180.0,
            detect_crash_s: 30.0,
            detect_timeout_s: 600.0,
            mem_load_s: 10.0,
            host_timeout_s: 3.0,
        }
    }
}

impl Published {
    /// Checks every figure is a number of seconds in range (a step of
    /// 1 ms to 1 day; the rest 0 to 10⁷ s); the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.step_s >= 1e-3 && self.step_s <= 86_400.0) {
            return Err(format!(
                "step_s = {}: must be between 0.001 and 86400 seconds",
                self.step_s
            ));
        }
        let fields = [
            ("ckpt_write_s", self.ckpt_write_s),
            ("disk_load_s", self.disk_load_s),
            ("init_s", self.init_s),
            ("requeue_s", self.requeue_s),
            ("detect_crash_s", self.detect_crash_s),
            ("detect_timeout_s", self.detect_timeout_s),
            ("mem_load_s", self.mem_load_s),
            ("host_timeout_s", self.host_timeout_s),
        ];
        for (name, v) in fields {
            if !(v.is_finite() && (0.0..=1e7).contains(&v)) {
                return Err(format!("{name} = {v}: must be between 0 and 1e7 seconds"));
            }
        }
        Ok(())
    }

    /// hatrain's hang watchdog at this step time: the agent's adaptive
    /// default, 10 × the median step and at least 30 s.
    pub fn hatrain_hang_detect_s(&self) -> f64 {
        (10.0 * self.step_s).max(30.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checked_in_costs_parse_and_name_their_sources() {
        let m = Measured::checked_in();
        assert!(m.snapshot_step_ratio >= 1.0);
        assert!(m.per_gb.is_some());
        assert!(m.slow_detect_steps.is_some());
        assert_eq!(m.entries.len(), KEYS.len() + PER_GB_KEYS.len() + 1);
        for (k, e) in &m.entries {
            assert!(
                e.source.contains("cargo bench") || e.source.starts_with("scripts/"),
                "{k}: {}",
                e.source
            );
            assert_eq!(e.measured.len(), 10, "{k}: {}", e.measured);
        }
    }

    #[test]
    fn a_missing_or_bad_entry_is_named() {
        let mut v: serde_json::Value = serde_json::from_str(DEFAULT_COSTS).unwrap();
        v["costs"].as_object_mut().unwrap().remove("uce_pause_s");
        let e = Measured::parse(&v.to_string(), "x.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("uce_pause_s") && e.contains("--bench uce"),
            "{e}"
        );

        // The per-GB costs come all together or not at all.
        let mut v: serde_json::Value = serde_json::from_str(DEFAULT_COSTS).unwrap();
        v["costs"]
            .as_object_mut()
            .unwrap()
            .remove("recovery_s_per_gb");
        let e = Measured::parse(&v.to_string(), "x.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("recovery_s_per_gb"), "{e}");
        for (key, ..) in PER_GB_KEYS {
            v["costs"].as_object_mut().unwrap().remove(key);
        }
        assert_eq!(
            Measured::parse(&v.to_string(), "x.json").unwrap().per_gb,
            None
        );

        let mut v: serde_json::Value = serde_json::from_str(DEFAULT_COSTS).unwrap();
        v["costs"]["snapshot_step_ratio"]["value"] = serde_json::json!(0.5);
        let e = Measured::parse(&v.to_string(), "x.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("snapshot_step_ratio = 0.5"), "{e}");

        let e = Measured::parse("{\"format\":1}", "x.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.json"), "{e}");
        let mut v: serde_json::Value = serde_json::from_str(DEFAULT_COSTS).unwrap();
        v["version"] = serde_json::json!(2);
        let e = Measured::parse(&v.to_string(), "x.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("version 2"), "{e}");
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = Measured::parse_bytes(&bytes, "p.json");
        }

        /// JSON of the right shape with any values: refused or read, never
        /// a panic.
        #[test]
        fn any_values_never_panic(values in proptest::collection::vec(proptest::num::f64::ANY, 10)) {
            let mut v: serde_json::Value = serde_json::from_str(DEFAULT_COSTS).unwrap();
            for ((key, ..), x) in KEYS.iter().zip(values) {
                v["costs"][key]["value"] = serde_json::json!(x);
            }
            let _ = Measured::parse(&v.to_string(), "p.json");
        }
    }
}
