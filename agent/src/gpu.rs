//! GPU memory errors as a fault source: NVML Xid events (behind the `nvml`
//! cargo feature; the library is loaded at run time, and the source is off
//! when there is no GPU or no driver).
//!
//! Xids 48 (double-bit ECC error), 63 and 64 (ECC page retirement or row
//! remapping event / failure), 94 (contained ECC error) and 95 (uncontained
//! ECC error) count as uncorrectable memory errors. The device maps to the
//! local rank that uses it, and the agent asks that rank to treat it as a
//! UCE in its state: the step is thrown away and every rank returns to s\*.

/// Xids that report an uncorrectable memory error.
pub const UCE_XIDS: [u64; 5] = [48, 63, 64, 94, 95];

/// A GPU fault seen by NVML.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuFault {
    /// NVML device index.
    pub device: u32,
    pub xid: u64,
}

pub fn is_uce_xid(xid: u64) -> bool {
    UCE_XIDS.contains(&xid)
}

/// The local rank using NVML device `device`: local rank i uses the i-th
/// device of `CUDA_VISIBLE_DEVICES` (ordinals only), or device i when it is
/// unset.
pub fn local_rank_of(device: u32, visible: Option<&str>, local_ranks: usize) -> Option<usize> {
    let rank = match visible.map(str::trim).filter(|v| !v.is_empty()) {
        None => device as usize,
        Some(list) => list
            .split(',')
            .position(|d| d.trim().parse::<u32>().ok() == Some(device))?,
    };
    (rank < local_ranks).then_some(rank)
}

/// Starts the NVML watcher thread, which sends UCE Xids to `tx` until the
/// receiver is gone. Without a usable NVML it logs why and does nothing.
#[cfg(feature = "nvml")]
pub fn watch(tx: tokio::sync::mpsc::Sender<GpuFault>) {
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
                    if is_uce_xid(xid) && tx.blocking_send(GpuFault { device, xid }).is_err() {
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
pub fn watch(tx: tokio::sync::mpsc::Sender<GpuFault>) {
    drop(tx);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xids_and_device_mapping() {
        assert!(UCE_XIDS.iter().all(|x| is_uce_xid(*x)));
        assert!(!is_uce_xid(79) && !is_uce_xid(13));
        assert_eq!(local_rank_of(1, None, 4), Some(1));
        assert_eq!(local_rank_of(5, None, 4), None);
        assert_eq!(local_rank_of(3, Some("2,3"), 2), Some(1));
        assert_eq!(local_rank_of(0, Some("2,3"), 2), None);
        assert_eq!(local_rank_of(2, Some(" 2 , 3 "), 2), Some(0));
        assert_eq!(local_rank_of(2, Some(""), 4), Some(2));
    }
}
