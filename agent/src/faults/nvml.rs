//! GPU memory errors as a fault source: NVML Xid events (behind the `nvml`
//! cargo feature; the library is loaded at run time, and the source is off
//! when there is no GPU or no driver).
//!
//! Xids 48 (double-bit ECC error), 63 and 64 (ECC page retirement or row
//! remapping event / failure), 94 (contained ECC error) and 95 (uncontained
//! ECC error) count as uncorrectable memory errors. The device maps to the
//! local rank that uses it (`CUDA_VISIBLE_DEVICES`), and the agent asks
//! that rank to treat it as a UCE in its state: the step is thrown away and
//! every rank returns to s\*.

#[cfg(feature = "nvml")]
use super::DeviceFault;

/// Xids that report an uncorrectable memory error.
pub const UCE_XIDS: [u64; 5] = [48, 63, 64, 94, 95];

/// The variable that lists the GPUs the ranks see.
pub const VISIBLE: &str = "CUDA_VISIBLE_DEVICES";

pub fn is_uce_xid(xid: u64) -> bool {
    UCE_XIDS.contains(&xid)
}

/// Starts the NVML watcher thread, which sends UCE Xids to `tx` until the
/// receiver is gone. Without a usable NVML it logs why and does nothing.
#[cfg(feature = "nvml")]
pub fn watch(tx: tokio::sync::mpsc::Sender<DeviceFault>) {
    use nvml_wrapper::bitmasks::event::EventTypes;
    use nvml_wrapper::enums::event::XidError;
    use nvml_wrapper::error::NvmlError;
    let spawned = std::thread::Builder::new().name("hatrain-nvml".into()).spawn(move || {
        let nvml = match nvml_wrapper::Nvml::init() {
            Ok(n) => n,
            Err(e) => {
                tracing::info!(error = %e, "NVML not available: the GPU fault source is off");
                return;
            }
        };
        let count = nvml.device_count().unwrap_or(0);
        let mut set = match nvml.create_event_set() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "NVML event set: the GPU fault source is off");
                return;
            }
        };
        for i in 0..count {
            let Ok(device) = nvml.device_by_index(i) else { continue };
            set = match device.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(device = i, error = %e.error, "cannot watch Xid events: the GPU fault source is off");
                    return;
                }
            };
        }
        tracing::info!(devices = count, "watching NVML Xid events");
        loop {
            match set.wait(1000) {
                Ok(ev) => {
                    let Some(XidError::Value(xid)) = ev.event_data else { continue };
                    let Ok(device) = ev.device.index() else { continue };
                    if !is_uce_xid(xid) {
                        continue;
                    }
                    let fault = DeviceFault {
                        source: "nvml",
                        visible: VISIBLE,
                        device,
                        code: Some(xid),
                        class: None,
                        action: Some(hatrain_shared::npu::Action::Uce),
                        rank: None,
                        acts: true,
                        why: format!("Xid {xid} is an uncorrectable memory error"),
                        text: format!("Xid {xid}"),
                        unix_s: super::unix_now(),
                    };
                    if tx.blocking_send(fault).is_err() {
                        return;
                    }
                }
                Err(NvmlError::Timeout) => {
                    if tx.is_closed() {
                        return;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "NVML wait failed: the GPU fault source stops");
                    return;
                }
            }
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the NVML watcher");
    }
}

/// Without the `nvml` feature there is no GPU fault source.
#[cfg(not(feature = "nvml"))]
pub fn watch(tx: tokio::sync::mpsc::Sender<super::DeviceFault>) {
    drop(tx);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uce_xids() {
        assert!(UCE_XIDS.iter().all(|x| is_uce_xid(*x)));
        assert!(!is_uce_xid(79) && !is_uce_xid(13));
    }
}
