//! Ascend NPU faults (cargo feature `ascend`). On a thread of its own:
//!
//! 1. loads the DCMI library at run time (`--dcmi-library`, by default
//!    `libdcmi.so` from the loader's path) and subscribes once, with card
//!    = device = -1, to every device's fault events; raised events go
//!    through the fault table's [`Filter`];
//! 2. where subscribing fails, polls each device's error codes and health
//!    every second, as MindCluster's device plugin does, and reports each
//!    code when it appears;
//! 3. where the library cannot be loaded, polls `npu-smi info -t health -i
//!    N -c 0` for each device instead (those of `--devices`, else of
//!    `ASCEND_RT_VISIBLE_DEVICES`, else 0 to the local ranks - 1), and `-t
//!    ecc`, whose `HBM Double Bit Error Count` rising is a UCE too;
//! 4. where neither is there, says so once and stops: the host has no
//!    Ascend device to watch.
//!
//! DCMI's structures and calls are those of its public header
//! (`dcmi_interface_api.h`); the event's device id is taken as the logical
//! device id the ranks' `ASCEND_RT_VISIBLE_DEVICES` lists.

use super::{DeviceFault, SourceConfig};
use hatrain_shared::npu::{DeviceEvent, Filter, HBM_UCE, HealthStatus, parse_ecc, parse_health};
use std::collections::{BTreeSet, HashMap};
use std::ffi::{c_char, c_int, c_uint};
use std::sync::OnceLock;
use std::sync::mpsc as std_mpsc;
use std::time::Duration;
use tokio::sync::mpsc;

/// The variable listing the NPUs the ranks see.
pub const VISIBLE: &str = super::ASCEND_VISIBLE;
/// How often codes are polled without a subscription.
const POLL: Duration = Duration::from_secs(1);

const DCMI_MAX_EVENT_NAME_LENGTH: usize = 256;
const DCMI_MAX_EVENT_DATA_LENGTH: usize = 32;
const DCMI_MAX_EVENT_RESV_LENGTH: usize = 32;
/// `dcmi_get_device_errorcode_v2` reports at most this many codes.
const MAX_CODES: usize = 128;

/// `struct dcmi_event_filter` (passed by value; all zero: every event).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DcmiEventFilter {
    pub filter_flag: u64,
    pub event_id: c_uint,
    pub severity: u8,
    pub node_type: u8,
    pub resv: [u8; DCMI_MAX_EVENT_RESV_LENGTH],
}

/// `struct dcmi_dms_fault_event`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DcmiDmsFaultEvent {
    pub event_id: c_uint,
    pub deviceid: u16,
    pub node_type: u8,
    pub node_id: u8,
    pub sub_node_type: u8,
    pub sub_node_id: u8,
    pub severity: u8,
    pub assertion: u8,
    pub event_serial_num: c_int,
    pub notify_serial_num: c_int,
    pub alarm_raised_time: u64,
    pub event_name: [c_char; DCMI_MAX_EVENT_NAME_LENGTH],
    pub additional_info: [c_char; DCMI_MAX_EVENT_DATA_LENGTH],
    pub os_id: u8,
    pub resv_1: [u8; 1],
    pub node_type_ex: u16,
    pub sub_node_type_ex: u16,
    pub resv_2: [u8; 2],
    pub resv: [u8; DCMI_MAX_EVENT_RESV_LENGTH - 8],
}

/// `struct dcmi_event` (type 0, `DCMI_DMS_FAULT_EVENT`, is the only one).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DcmiEvent {
    pub kind: c_int,
    pub dms_event: DcmiDmsFaultEvent,
}

type Handler = unsafe extern "C" fn(*mut DcmiEvent);
type Init = unsafe extern "C" fn() -> c_int;
type Subscribe = unsafe extern "C" fn(c_int, c_int, DcmiEventFilter, Handler) -> c_int;
type CardList = unsafe extern "C" fn(*mut c_int, *mut c_int, c_int) -> c_int;
type DeviceIdInCard = unsafe extern "C" fn(c_int, *mut c_int, *mut c_int, *mut c_int) -> c_int;
type LogicId = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
type Health = unsafe extern "C" fn(c_int, c_int, *mut c_uint) -> c_int;
type ErrorCodes = unsafe extern "C" fn(c_int, c_int, *mut c_int, *mut c_uint, c_uint) -> c_int;

/// Where the subscription's callback sends (DCMI allows one subscription
/// per process, so one sender for the process).
static EVENTS: OnceLock<std_mpsc::SyncSender<DeviceEvent>> = OnceLock::new();

/// The subscription's callback: copies the event out and hands it on.
unsafe extern "C" fn on_event(ev: *mut DcmiEvent) {
    // SAFETY: DCMI passes a valid event for the duration of the call, or
    // null (checked).
    let Some(ev) = (unsafe { ev.as_ref() }) else {
        return;
    };
    if ev.kind != 0 {
        return;
    }
    let e = &ev.dms_event;
    let name: Vec<u8> = e
        .event_name
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    let event = DeviceEvent {
        device: u32::from(e.deviceid),
        code: e.event_id,
        severity: e.severity,
        assertion: e.assertion,
        time_ms: e.alarm_raised_time,
        name: String::from_utf8_lossy(&name).into_owned(),
    };
    if let Some(tx) = EVENTS.get() {
        // Never blocks DCMI's thread: a full queue drops the event, which
        // the polling of a later reading does not replace (logged).
        if tx.try_send(event).is_err() {
            eprintln!("hatrain-agent: DCMI fault event dropped: the agent's queue is full");
        }
    }
}

/// Why the DCMI library cannot be used.
#[derive(Debug, thiserror::Error)]
enum DcmiError {
    #[error(transparent)]
    Load(#[from] libloading::Error),
    #[error("dcmi_init returned {0}")]
    Init(c_int),
}

/// The function `name` of `lib`, as a `T`.
///
/// # Safety
/// `T` must be the function's type in DCMI's header.
unsafe fn symbol<T: Copy>(lib: &libloading::Library, name: &[u8]) -> Result<T, DcmiError> {
    // SAFETY: the caller's contract.
    Ok(unsafe { lib.get::<T>(name) }.map(|s| *s)?)
}

/// The library's calls this source uses.
struct Dcmi {
    _lib: libloading::Library,
    subscribe: Subscribe,
    card_list: CardList,
    device_id_in_card: DeviceIdInCard,
    logic_id: LogicId,
    health: Health,
    error_codes: ErrorCodes,
}

impl Dcmi {
    fn load(path: &std::path::Path) -> Result<Self, DcmiError> {
        // SAFETY: loading runs the library's initialisers; DCMI's are the
        // vendor's, as when MindCluster loads it.
        let lib = unsafe { libloading::Library::new(path) }?;
        // SAFETY: each symbol is taken with its type from DCMI's header.
        unsafe {
            let init: Init = *lib.get::<Init>(b"dcmi_init\0")?;
            let dcmi = Self {
                subscribe: symbol(&lib, b"dcmi_subscribe_fault_event\0")?,
                card_list: symbol(&lib, b"dcmi_get_card_list\0")?,
                device_id_in_card: symbol(&lib, b"dcmi_get_device_id_in_card\0")?,
                logic_id: symbol(&lib, b"dcmi_get_device_logic_id\0")?,
                health: symbol(&lib, b"dcmi_get_device_health\0")?,
                error_codes: symbol(&lib, b"dcmi_get_device_errorcode_v2\0")?,
                _lib: lib,
            };
            let rc = init();
            if rc != 0 {
                return Err(DcmiError::Init(rc));
            }
            Ok(dcmi)
        }
    }

    /// (card, device in card, logical id) of every device.
    fn devices(&self) -> Vec<(c_int, c_int, u32)> {
        let mut cards = [0 as c_int; 64];
        let mut n: c_int = 0;
        // SAFETY: the list has room for `cards.len()` ids, as passed.
        let rc = unsafe { (self.card_list)(&mut n, cards.as_mut_ptr(), cards.len() as c_int) };
        if rc != 0 {
            return Vec::new();
        }
        let mut out = Vec::new();
        for &card in cards.iter().take(usize::try_from(n).unwrap_or(0)) {
            let (mut max, mut mcu, mut cpu) = (0, 0, 0);
            // SAFETY: three valid out-pointers.
            if unsafe { (self.device_id_in_card)(card, &mut max, &mut mcu, &mut cpu) } != 0 {
                continue;
            }
            for dev in 0..max {
                let mut logic: c_int = -1;
                // SAFETY: one valid out-pointer.
                if unsafe { (self.logic_id)(&mut logic, card, dev) } == 0
                    && let Ok(l) = u32::try_from(logic)
                {
                    out.push((card, dev, l));
                }
            }
        }
        out
    }

    /// One device's current error codes and health (0 ok … 3 critical).
    fn reading(&self, card: c_int, dev: c_int) -> Option<(Vec<u32>, u32)> {
        let mut codes = [0 as c_uint; MAX_CODES];
        let mut n: c_int = 0;
        let mut health: c_uint = 0;
        // SAFETY: the list has room for MAX_CODES codes, as passed; one
        // valid out-pointer each.
        unsafe {
            if (self.error_codes)(card, dev, &mut n, codes.as_mut_ptr(), MAX_CODES as c_uint) != 0
                || (self.health)(card, dev, &mut health) != 0
            {
                return None;
            }
        }
        let n = usize::try_from(n).unwrap_or(0).min(MAX_CODES);
        Some((codes[..n].to_vec(), health))
    }
}

/// Starts the Ascend source on its own thread.
pub fn watch(tx: mpsc::Sender<DeviceFault>, cfg: SourceConfig) {
    let spawned = std::thread::Builder::new()
        .name("hatrain-npu".into())
        .spawn(move || run(&tx, &cfg));
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the Ascend fault source");
    }
}

fn run(tx: &mpsc::Sender<DeviceFault>, cfg: &SourceConfig) {
    let mut filter = Filter::new(cfg.table.clone());
    match Dcmi::load(&cfg.dcmi_library) {
        Ok(dcmi) => dcmi_source(&dcmi, &mut filter, tx),
        Err(e) => {
            tracing::info!(library = %cfg.dcmi_library.display(), error = %e,
                "DCMI library not loaded: trying npu-smi for Ascend faults");
            npu_smi_source(cfg, &mut filter, tx);
        }
    }
}

/// Sends `ev` judged; false when the job is gone.
fn send(
    tx: &mpsc::Sender<DeviceFault>,
    filter: &mut Filter,
    source: &'static str,
    ev: &DeviceEvent,
) -> bool {
    let verdict = filter.judge(ev);
    tx.blocking_send(DeviceFault::judged(source, VISIBLE, ev, &verdict))
        .is_ok()
}

fn dcmi_source(dcmi: &Dcmi, filter: &mut Filter, tx: &mpsc::Sender<DeviceFault>) {
    let (ev_tx, ev_rx) = std_mpsc::sync_channel(1024);
    let first = EVENTS.set(ev_tx).is_ok();
    let filter_all = DcmiEventFilter {
        filter_flag: 0,
        event_id: 0,
        severity: 0,
        node_type: 0,
        resv: [0; DCMI_MAX_EVENT_RESV_LENGTH],
    };
    let rc = if first {
        // SAFETY: the handler is an `extern "C" fn` of the header's type
        // that stays valid for the life of the process.
        unsafe { (dcmi.subscribe)(-1, -1, filter_all, on_event) }
    } else {
        -1
    };
    if rc == 0 {
        tracing::info!("watching Ascend NPU fault events (DCMI subscription)");
        loop {
            match ev_rx.recv_timeout(POLL) {
                Ok(ev) => {
                    if !send(tx, filter, "dcmi", &ev) {
                        return;
                    }
                }
                Err(std_mpsc::RecvTimeoutError::Timeout) if tx.is_closed() => return,
                Err(std_mpsc::RecvTimeoutError::Timeout) => {}
                Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
    }
    let devices = dcmi.devices();
    tracing::warn!(
        rc,
        devices = devices.len(),
        "DCMI fault events cannot be subscribed to: polling error codes and health every second"
    );
    let mut seen: HashMap<u32, BTreeSet<u32>> = HashMap::new();
    loop {
        for &(card, dev, logic) in &devices {
            let Some((codes, health)) = dcmi.reading(card, dev) else {
                continue;
            };
            let severity = u8::try_from(health.min(3)).unwrap_or(3);
            for ev in new_codes(&mut seen, logic, &codes, severity, "dcmi poll") {
                if !send(tx, filter, "dcmi", &ev) {
                    return;
                }
            }
        }
        if tx.is_closed() {
            return;
        }
        std::thread::sleep(POLL);
    }
}

/// The codes of `device` that were not in its last reading, as raised
/// events, a UCE first (the codes of one reading are seen at one instant,
/// and its side effects are judged after it); a code that went away may be
/// raised again later.
fn new_codes(
    seen: &mut HashMap<u32, BTreeSet<u32>>,
    device: u32,
    codes: &[u32],
    severity: u8,
    name: &str,
) -> Vec<DeviceEvent> {
    let now: BTreeSet<u32> = codes.iter().copied().collect();
    let before = seen.insert(device, now.clone()).unwrap_or_default();
    let time_ms = (super::unix_now() * 1000.0) as u64;
    let mut fresh: Vec<DeviceEvent> = now
        .difference(&before)
        .map(|&code| DeviceEvent {
            device,
            code,
            severity,
            assertion: 1,
            time_ms,
            name: name.into(),
        })
        .collect();
    fresh.sort_by_key(|e| e.code != HBM_UCE);
    fresh
}

/// Runs `cmd` to its end and returns its stdout (at most 1 MiB), through
/// the agent's reaper when there is one (which waits for every child).
fn output(
    cmd: &mut std::process::Command,
    reaper: Option<&crate::reaper::Reaper>,
) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    use std::process::Stdio;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let Some(reaper) = reaper else {
        return cmd.output().map(|o| o.stdout);
    };
    let (tx, mut exited) = tokio::sync::mpsc::unbounded_channel();
    let mut child = reaper.spawn(cmd, &tx)?;
    let mut out = Vec::new();
    if let Some(stdout) = child.stdout.take() {
        stdout.take(1 << 20).read_to_end(&mut out)?;
    }
    // Its exit, which the reaper collects.
    let _ = exited.blocking_recv();
    Ok(out)
}

fn npu_smi_source(cfg: &SourceConfig, filter: &mut Filter, tx: &mpsc::Sender<DeviceFault>) {
    let visible = std::env::var(VISIBLE).ok().filter(|v| !v.trim().is_empty());
    let devices: Vec<u32> = match (&cfg.devices, visible) {
        (Some(list), _) => list.clone(),
        (None, Some(list)) => list
            .split(',')
            .filter_map(|d| d.trim().parse().ok())
            .collect(),
        (None, None) => (0..u32::try_from(cfg.local_ranks).unwrap_or(0)).collect(),
    };
    let read = |dev: u32| {
        let mut cmd = std::process::Command::new(&cfg.npu_smi);
        cmd.args(["info", "-t", "health", "-i", &dev.to_string(), "-c", "0"]);
        output(&mut cmd, cfg.reaper.as_ref())
    };
    // `HBM Double Bit Error Count`, whose rise is a UCE too.
    let double_bits = |dev: u32| {
        let mut cmd = std::process::Command::new(&cfg.npu_smi);
        cmd.args(["info", "-t", "ecc", "-i", &dev.to_string()]);
        let out = output(&mut cmd, cfg.reaper.as_ref()).ok()?;
        parse_ecc(&String::from_utf8_lossy(&out))
            .ok()?
            .hbm_double_bit()
    };
    let mut counted: HashMap<u32, u64> = HashMap::new();
    match devices.first().map(|&d| read(d)) {
        Some(Ok(_)) => {}
        Some(Err(e)) => {
            tracing::info!(program = %cfg.npu_smi.display(), error = %e,
                "npu-smi cannot be run either: no Ascend fault source on this host");
            return;
        }
        None => return,
    }
    tracing::info!(devices = ?devices, "watching Ascend NPU health with npu-smi every second");
    let mut seen: HashMap<u32, BTreeSet<u32>> = HashMap::new();
    let mut complained: BTreeSet<u32> = BTreeSet::new();
    loop {
        for &dev in &devices {
            let out = match read(dev) {
                Ok(o) => o,
                Err(e) => {
                    tracing::warn!(device = dev, error = %e, "npu-smi failed");
                    continue;
                }
            };
            let text = String::from_utf8_lossy(&out);
            let health = match parse_health(&text) {
                Ok(h) => {
                    complained.remove(&dev);
                    h
                }
                Err(e) => {
                    if complained.insert(dev) {
                        tracing::warn!(device = dev, error = %e, "npu-smi's health reading is not understood");
                    }
                    continue;
                }
            };
            let mut events = if health.status == HealthStatus::Unknown {
                // An absent device: a critical code the table does not name
                // (the device is out).
                new_codes(
                    &mut seen,
                    dev,
                    &[u32::MAX],
                    3,
                    "health UNKNOWN: the device is absent",
                )
            } else {
                let name = health.info.first().map_or("npu-smi", String::as_str);
                new_codes(
                    &mut seen,
                    dev,
                    &health.codes,
                    health.status.severity(),
                    name,
                )
            };
            // A rise of the double-bit count with no UCE code in the health
            // reading is a UCE the codes did not name.
            if let Some(now) = double_bits(dev)
                && let Some(before) = counted.insert(dev, now)
                && now > before
                && !seen.get(&dev).is_some_and(|c| c.contains(&HBM_UCE))
            {
                events.push(DeviceEvent {
                    device: dev,
                    code: HBM_UCE,
                    severity: 2,
                    assertion: 1,
                    time_ms: (super::unix_now() * 1000.0) as u64,
                    name: format!("HBM double-bit error count rose from {before} to {now}"),
                });
            }
            for ev in &events {
                if !send(tx, filter, "npu-smi", ev) {
                    return;
                }
            }
        }
        if tx.is_closed() {
            return;
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_structures_have_the_headers_layout() {
        assert_eq!(std::mem::size_of::<DcmiEventFilter>(), 48);
        assert_eq!(std::mem::size_of::<DcmiDmsFaultEvent>(), 352);
        assert_eq!(
            std::mem::offset_of!(DcmiDmsFaultEvent, alarm_raised_time),
            24
        );
        assert_eq!(std::mem::offset_of!(DcmiDmsFaultEvent, event_name), 32);
        assert_eq!(std::mem::offset_of!(DcmiEvent, dms_event), 8);
    }

    #[test]
    fn a_polled_code_is_reported_once_while_it_stays() {
        let mut seen = HashMap::new();
        assert_eq!(new_codes(&mut seen, 0, &[1, 2], 2, "x").len(), 2);
        assert!(new_codes(&mut seen, 0, &[1, 2], 2, "x").is_empty());
        let again = new_codes(&mut seen, 0, &[2, 3], 2, "x");
        assert_eq!(again.iter().map(|e| e.code).collect::<Vec<_>>(), vec![3]);
        assert!(
            new_codes(&mut seen, 1, &[1], 2, "x").len() == 1,
            "per device"
        );
        assert!(new_codes(&mut seen, 0, &[], 2, "x").is_empty());
        assert_eq!(
            new_codes(&mut seen, 0, &[2], 2, "x").len(),
            1,
            "gone, then back"
        );
        // A UCE and its side effect in one reading: the UCE is judged first.
        let both = new_codes(&mut seen, 2, &[0x80C9_8009, HBM_UCE], 3, "x");
        assert_eq!(
            both.iter().map(|e| e.code).collect::<Vec<_>>(),
            vec![HBM_UCE, 0x80C9_8009]
        );
    }
}
