//! The device fault sources' reports, acted on (see [`crate::faults`]): the
//! device is mapped to the local rank that uses it, the decision is logged
//! and kept for `agentctl faults`, and the action is carried out.

use super::Driver;
use crate::config::LaunchConfig;
use crate::faults::{DeviceFault, SourceConfig, local_rank_of};
use crate::recovery::Event;
use crate::supervisor::Supervisor;
use hatrain_shared::control::FaultKind;
use hatrain_shared::npu::Action;
use hatrain_shared::shm::Injection;
use tokio::sync::mpsc;

/// Reports kept for `agentctl faults`.
const KEPT: usize = 256;

/// Starts the device fault sources of this launch, and the reading of the
/// workers' error texts, all reporting to `tx`.
pub(super) fn start(sup: &mut Supervisor, cfg: &LaunchConfig, tx: mpsc::Sender<DeviceFault>) {
    sup.report_texts_to(tx.clone());
    let sources = SourceConfig {
        table: cfg.ha.fault_table.clone(),
        dcmi_library: cfg.ha.dcmi_library.clone(),
        npu_smi: cfg.ha.npu_smi.clone(),
        local_ranks: sup.ranks().len(),
        devices: cfg.ha.devices.clone(),
        reaper: sup.reaper(),
    };
    crate::faults::start(tx, &sources);
}

impl Driver<'_> {
    pub(super) fn on_device_fault(&mut self, sup: &mut Supervisor, f: DeviceFault) {
        let visible = match &self.cfg.ha.devices {
            Some(list) => Some(
                list.iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
            ),
            None => std::env::var(f.visible).ok(),
        };
        let rank = f.rank.or_else(|| {
            local_rank_of(f.device, visible.as_deref(), sup.ranks().len()).map(|l| sup.ranks()[l])
        });
        let record = f.record(rank.into_iter().collect());
        let code = f.code.map(|c| format!("0x{c:08X}"));
        let class = record.class.clone();
        match f.action {
            None | Some(Action::Ignore) => tracing::info!(
                source = f.source, device = f.device, code, class, action = %record.action,
                why = %f.why, text = %f.text, "device fault report: not acted on"
            ),
            Some(_) => tracing::warn!(
                source = f.source, device = f.device, rank, code, class, action = %record.action,
                why = %f.why, text = %f.text, "device fault"
            ),
        }
        if self.device_faults.len() == KEPT {
            self.device_faults.pop_front();
        }
        self.device_faults.push_back(record);
        if !f.acts {
            return;
        }
        let Some(action) = f.action.filter(|&a| a != Action::Ignore) else {
            return;
        };
        let Some(rank) = rank else {
            tracing::warn!(
                source = f.source,
                device = f.device,
                "the device no local rank uses has a fault: nothing to do for this job"
            );
            return;
        };
        let detail = format!(
            "{} device {}: {}{} ({})",
            f.source,
            f.device,
            code.map(|c| format!("{c} ")).unwrap_or_default(),
            class.map(|c| format!("[{c}]")).unwrap_or_default(),
            f.why
        );
        let kind = match action {
            Action::Ignore => return,
            Action::Uce => {
                // The rank treats it as a UCE in its state: the step is
                // thrown away and recomputed from s* (or, by the job's
                // modes, the rank is rebooted or the job stops).
                match (self.stores.get(&rank), self.maps.get(&rank)) {
                    (Some(store), Some(map)) => {
                        let part = map.largest_part().unwrap_or(0) as u64;
                        store.page().inject(Injection::Uce { part, offset: 0 }, 0);
                        return;
                    }
                    // Not registered yet: no state to repair, so it
                    // restarts.
                    _ => FaultKind::Crash,
                }
            }
            Action::Crash => FaultKind::Crash,
            Action::Hang => FaultKind::Hang,
            Action::Host if self.cfg.nnodes > 1 => {
                self.leave(sup, detail);
                return;
            }
            Action::Host => FaultKind::Device,
        };
        self.feed(sup, Event::DeviceFault { rank, kind, detail });
    }

    /// The device is lost and the job has other hosts: this host leaves it
    /// as a lost host does (its workers SIGKILLed now; the loop ends with
    /// nothing saved or said to the others, its connections drop, its
    /// shared memory goes with the job's folder, and `main` exits with
    /// [`crate::exit::DEVICE_LOST`]), and the other hosts recover without
    /// it by the host-loss path: its ranks onto a standby host from their
    /// peer replicas, or the group shrinks, or the last words are written.
    fn leave(&mut self, sup: &Supervisor, detail: String) {
        tracing::error!(
            detail,
            "device lost: this host leaves the job, which recovers without it as from a lost host"
        );
        sup.kill_everything();
        self.leaving = Some(crate::config::LaunchError::DeviceLost { detail });
    }

    /// This host holds the job back and the controller hands it to a
    /// standby host (`--on-slow replace`): it leaves the job as [`leave`]
    /// does, and `main` exits with [`crate::exit::HANDED_OVER`].
    ///
    /// [`leave`]: Self::leave
    pub(super) fn leave_slow(&mut self, sup: &Supervisor, detail: String) {
        tracing::warn!(
            detail,
            "this host holds the job back: it leaves the job, and a standby host takes its ranks as from a lost host"
        );
        sup.kill_everything();
        self.leaving = Some(crate::config::LaunchError::HandedOver { detail });
    }

    /// What `agentctl faults` shows of the device fault sources.
    pub(super) fn device_fault_records(&self) -> Vec<hatrain_shared::control::DeviceFaultRecord> {
        self.device_faults.iter().cloned().collect()
    }
}
