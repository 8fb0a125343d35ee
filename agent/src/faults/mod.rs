//! Device fault sources, behind one seam. Each source watches the host's
//! accelerators on a thread of its own and reports [`DeviceFault`]s: which
//! device, the code and class it saw, and the action the fault table gives
//! it (`None` when the filter dropped it, with the reason). The job's event
//! loop maps the device to the local rank that uses it and acts:
//!
//! | action | what the agent does |
//! |---|---|
//! | `uce` | the rank repairs the step from its snapshot (or a replica) |
//! | `crash` | the rank is rebooted in place (worker reboot) |
//! | `hang` | the rank is taken as hung (the watchdog's path) |
//! | `host` | the device is lost: the job writes its last words and stops |
//! | `ignore` | logged only |
//!
//! Sources:
//! - [`nvml`]: NVIDIA Xid events (cargo feature `nvml`);
//! - [`ascend`]: Ascend NPUs, through DCMI's fault events or by polling its
//!   error codes, and through `npu-smi` where the library is missing
//!   (cargo feature `ascend`, on by default: the library is loaded at run
//!   time, so a host without it builds and runs the same);
//! - SIGBUS in the worker (host memory) is the worker runtime's, not here.
//!
//! Every report and decision is logged and kept for `agentctl faults`.

#[cfg(feature = "ascend")]
pub mod ascend;
pub mod nvml;

use hatrain_shared::control::DeviceFaultRecord;
use hatrain_shared::npu::{Action, Class, DeviceEvent, FaultTable, Verdict};
use std::path::PathBuf;
use tokio::sync::mpsc;

/// One report of a device fault source, judged.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceFault {
    /// `nvml`, `dcmi`, `npu-smi`.
    pub source: &'static str,
    /// The variable listing the devices the ranks see, in local-rank order
    /// (`CUDA_VISIBLE_DEVICES`, `ASCEND_RT_VISIBLE_DEVICES`).
    pub visible: &'static str,
    pub device: u32,
    pub code: Option<u64>,
    pub class: Option<Class>,
    /// `None`: dropped (see `why`).
    pub action: Option<Action>,
    /// The rank, when the source knows it (a worker's own text) rather
    /// than the device.
    pub rank: Option<usize>,
    /// Whether the agent acts on it; a worker's own error text is recorded
    /// only, since the worker's runtime (or its exit) acts on it.
    pub acts: bool,
    pub why: String,
    pub text: String,
    pub unix_s: f64,
}

impl DeviceFault {
    /// An NPU event as the filter judged it.
    pub fn judged(
        source: &'static str,
        visible: &'static str,
        ev: &DeviceEvent,
        verdict: &Verdict,
    ) -> Self {
        let (class, action, why) = match verdict {
            Verdict::Act(d) => (
                Some(d.class),
                Some(d.action),
                if d.known {
                    format!("the table's row for 0x{:08X}", ev.code)
                } else {
                    format!(
                        "a code the table does not name, at severity {}",
                        ev.severity
                    )
                },
            ),
            Verdict::Escalated { decision, count } => (
                Some(decision.class),
                Some(decision.action),
                format!("UCE number {count} on this device within the table's window"),
            ),
            Verdict::Dropped(why) => (None, None, (*why).to_string()),
        };
        Self {
            source,
            visible,
            device: ev.device,
            code: Some(u64::from(ev.code)),
            class,
            action,
            rank: None,
            acts: true,
            why,
            text: ev.name.clone(),
            unix_s: unix_now(),
        }
    }

    /// A torch_npu error text in the stderr of `rank` (local rank
    /// `local_rank`, whose device it names).
    pub fn worker_text(
        rank: usize,
        local_rank: usize,
        action: Action,
        words: &str,
        line: &str,
    ) -> Self {
        Self {
            source: "worker-text",
            visible: ASCEND_VISIBLE,
            device: u32::try_from(local_rank).unwrap_or(u32::MAX),
            code: None,
            class: None,
            action: Some(action),
            rank: Some(rank),
            acts: false,
            why: format!(
                "torch_npu's text {words:?}: recorded; the worker's runtime, or its exit, acts on it"
            ),
            text: line.chars().take(300).collect(),
            unix_s: unix_now(),
        }
    }

    /// What `agentctl faults` shows of it; `ranks` use the device.
    pub fn record(&self, ranks: Vec<usize>) -> DeviceFaultRecord {
        DeviceFaultRecord {
            source: self.source.into(),
            device: self.device,
            code: self.code,
            class: self.class.map(|c| format!("{c:?}")),
            action: self.action.map_or("dropped", Action::name).into(),
            why: self.why.clone(),
            ranks,
            text: self.text.clone(),
            unix_s: self.unix_s,
        }
    }
}

/// How the sources are set up.
#[derive(Debug, Clone)]
pub struct SourceConfig {
    pub table: FaultTable,
    /// The DCMI library to load (a name the loader searches for, or a
    /// path).
    pub dcmi_library: PathBuf,
    /// The `npu-smi` program for hosts without the library.
    pub npu_smi: PathBuf,
    /// Local ranks on this host (devices polled without a device list).
    pub local_ranks: usize,
    /// The devices of the local ranks (`--devices`), if given.
    pub devices: Option<Vec<u32>>,
    /// The agent's reaper, which a source's own child process (`npu-smi`)
    /// is started through (the reaper waits for every child).
    pub reaper: Option<crate::reaper::Reaper>,
}

/// Starts every source compiled in; each sends to `tx` until it is closed.
pub fn start(tx: mpsc::Sender<DeviceFault>, cfg: &SourceConfig) {
    nvml::watch(tx.clone());
    #[cfg(feature = "ascend")]
    ascend::watch(tx, cfg.clone());
    #[cfg(not(feature = "ascend"))]
    let _ = (tx, cfg);
}

/// The variable listing the NPUs the ranks see.
pub const ASCEND_VISIBLE: &str = "ASCEND_RT_VISIBLE_DEVICES";

pub(crate) fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The local rank using device `device`: local rank i uses the i-th device
/// of `visible` (a comma-separated list of ordinals), or device i when it
/// is unset or empty.
pub fn local_rank_of(device: u32, visible: Option<&str>, local_ranks: usize) -> Option<usize> {
    let rank = match visible.map(str::trim).filter(|v| !v.is_empty()) {
        None => device as usize,
        Some(list) => list
            .split(',')
            .position(|d| d.trim().parse::<u32>().ok() == Some(device))?,
    };
    (rank < local_ranks).then_some(rank)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hatrain_shared::npu::{Decision, Filter, HBM_UCE};

    #[test]
    fn device_mapping() {
        assert_eq!(local_rank_of(1, None, 4), Some(1));
        assert_eq!(local_rank_of(5, None, 4), None);
        assert_eq!(local_rank_of(3, Some("2,3"), 2), Some(1));
        assert_eq!(local_rank_of(0, Some("2,3"), 2), None);
        assert_eq!(local_rank_of(2, Some(" 2 , 3 "), 2), Some(0));
        assert_eq!(local_rank_of(2, Some(""), 4), Some(2));
    }

    #[test]
    fn a_judged_event_is_recorded_with_its_code_class_and_reason() {
        let ev = DeviceEvent {
            device: 1,
            code: HBM_UCE,
            severity: 2,
            assertion: 1,
            time_ms: 0,
            name: "hbm multi-bit ecc".into(),
        };
        let mut f = Filter::new(FaultTable::default());
        let v = f.judge(&ev);
        let r = DeviceFault::judged("dcmi", "X", &ev, &v).record(vec![1]);
        assert_eq!(r.code, Some(u64::from(HBM_UCE)));
        assert_eq!(
            (r.class.as_deref(), r.action.as_str()),
            (Some("RestartBusiness"), "uce")
        );
        assert!(r.why.contains("0x80E01801"), "{}", r.why);
        let dropped = DeviceFault::judged("dcmi", "X", &ev, &Verdict::Dropped("why not"));
        assert_eq!(dropped.record(vec![]).action, "dropped");
        let escalated = Verdict::Escalated {
            decision: Decision {
                class: Class::ManuallySeparateNPU,
                action: Action::Host,
                known: true,
            },
            count: 2,
        };
        let r = DeviceFault::judged("dcmi", "X", &ev, &escalated).record(vec![1]);
        assert_eq!(r.action, "host");
        assert!(r.why.contains("UCE number 2"), "{}", r.why);
    }
}
