//! A stand-in for Ascend's `libdcmi.so`: the DCMI calls hatrain's NPU
//! fault source makes, with the header's C signatures and structures, over
//! recorded fault events instead of a device. The tests load it through
//! the agent's `--dcmi-library`, the same dynamic-loading path as the real
//! library.
//!
//! Driven by files in the folder `DCMI_STANDIN_DIR`:
//! - each `*.json` (in name order) is a JSON array of fault events
//!   (`event_id`, `deviceid`, `severity`, `assertion`, `alarm_raised_time`,
//!   `event_name`), delivered through the subscription's callback on a
//!   thread of the library, after which the file is renamed `*.sent`;
//! - `device-N.codes` holds device N's current error codes (hex, spaces
//!   between) and `device-N.health` its health (0-3), for polling.
//!
//! `DCMI_STANDIN_SUBSCRIBE=fail` makes subscribing fail (the source then
//! polls); `DCMI_STANDIN_DEVICES` is the device count (default 2, one card).

use serde::Deserialize;
use std::ffi::{c_char, c_int, c_uint};
use std::path::PathBuf;
use std::time::Duration;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DcmiEventFilter {
    pub filter_flag: u64,
    pub event_id: c_uint,
    pub severity: u8,
    pub node_type: u8,
    pub resv: [u8; 32],
}

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
    pub event_name: [c_char; 256],
    pub additional_info: [c_char; 32],
    pub os_id: u8,
    pub resv_1: [u8; 1],
    pub node_type_ex: u16,
    pub sub_node_type_ex: u16,
    pub resv_2: [u8; 2],
    pub resv: [u8; 24],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DcmiEvent {
    pub kind: c_int,
    pub dms_event: DcmiDmsFaultEvent,
}

type Handler = unsafe extern "C" fn(*mut DcmiEvent);

/// DCMI's "not supported" return code.
const NOT_SUPPORTED: c_int = -8005;

#[derive(Deserialize)]
struct Recorded {
    event_id: u32,
    deviceid: u16,
    severity: u8,
    assertion: u8,
    alarm_raised_time: u64,
    #[serde(default)]
    event_name: String,
}

fn dir() -> Option<PathBuf> {
    std::env::var_os("DCMI_STANDIN_DIR").map(PathBuf::from)
}

fn devices() -> c_int {
    std::env::var("DCMI_STANDIN_DEVICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
}

fn event(r: &Recorded, serial: c_int) -> DcmiEvent {
    let mut name = [0 as c_char; 256];
    for (d, s) in name.iter_mut().zip(r.event_name.bytes().take(255)) {
        *d = s as c_char;
    }
    DcmiEvent {
        kind: 0,
        dms_event: DcmiDmsFaultEvent {
            event_id: r.event_id,
            deviceid: r.deviceid,
            node_type: 0,
            node_id: 0,
            sub_node_type: 0,
            sub_node_id: 0,
            severity: r.severity,
            assertion: r.assertion,
            event_serial_num: serial,
            notify_serial_num: serial,
            alarm_raised_time: r.alarm_raised_time,
            event_name: name,
            additional_info: [0; 32],
            os_id: 0,
            resv_1: [0; 1],
            node_type_ex: 0,
            sub_node_type_ex: 0,
            resv_2: [0; 2],
            resv: [0; 24],
        },
    }
}

/// Delivers the recorded files as they appear, for the life of the process.
fn replay(handler: Handler) {
    let Some(dir) = dir() else { return };
    let mut serial = 0;
    loop {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map(|r| {
                r.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "json"))
                    .collect()
            })
            .unwrap_or_default();
        files.sort();
        for f in files {
            let Ok(text) = std::fs::read_to_string(&f) else {
                continue;
            };
            // A file still being written does not parse yet: next round.
            let Ok(events) = serde_json::from_str::<Vec<Recorded>>(&text) else {
                continue;
            };
            for r in &events {
                serial += 1;
                let mut ev = event(r, serial);
                // SAFETY: the subscriber's handler, with a valid event for
                // the duration of the call, as DCMI calls it.
                unsafe { handler(&mut ev) };
            }
            let _ = std::fs::rename(&f, f.with_extension("sent"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn dcmi_init() -> c_int {
    0
}

/// # Safety
/// `card_num` and `card_list` (of `list_len` entries) are valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dcmi_get_card_list(
    card_num: *mut c_int,
    card_list: *mut c_int,
    list_len: c_int,
) -> c_int {
    if card_num.is_null() || card_list.is_null() || list_len < 1 {
        return NOT_SUPPORTED;
    }
    // SAFETY: valid per the contract above.
    unsafe {
        *card_num = 1;
        *card_list = 0;
    }
    0
}

/// # Safety
/// The three out-pointers are valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dcmi_get_device_id_in_card(
    card_id: c_int,
    device_id_max: *mut c_int,
    mcu_id: *mut c_int,
    cpu_id: *mut c_int,
) -> c_int {
    if card_id != 0 || device_id_max.is_null() || mcu_id.is_null() || cpu_id.is_null() {
        return NOT_SUPPORTED;
    }
    // SAFETY: valid per the contract above.
    unsafe {
        *device_id_max = devices();
        *mcu_id = -1;
        *cpu_id = -1;
    }
    0
}

/// # Safety
/// `logic_id` is valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dcmi_get_device_logic_id(
    logic_id: *mut c_int,
    card_id: c_int,
    device_id: c_int,
) -> c_int {
    if logic_id.is_null() || card_id != 0 || !(0..devices()).contains(&device_id) {
        return NOT_SUPPORTED;
    }
    // SAFETY: valid per the contract above.
    unsafe { *logic_id = device_id };
    0
}

fn device_file(device: c_int, ext: &str) -> String {
    dir()
        .and_then(|d| std::fs::read_to_string(d.join(format!("device-{device}.{ext}"))).ok())
        .unwrap_or_default()
}

/// # Safety
/// `health` is valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dcmi_get_device_health(
    card_id: c_int,
    device_id: c_int,
    health: *mut c_uint,
) -> c_int {
    if health.is_null() || card_id != 0 || !(0..devices()).contains(&device_id) {
        return NOT_SUPPORTED;
    }
    let h = device_file(device_id, "health").trim().parse().unwrap_or(0);
    // SAFETY: valid per the contract above.
    unsafe { *health = h };
    0
}

/// # Safety
/// `error_count` is valid, and `error_code_list` has `list_len` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dcmi_get_device_errorcode_v2(
    card_id: c_int,
    device_id: c_int,
    error_count: *mut c_int,
    error_code_list: *mut c_uint,
    list_len: c_uint,
) -> c_int {
    if error_count.is_null()
        || error_code_list.is_null()
        || card_id != 0
        || !(0..devices()).contains(&device_id)
    {
        return NOT_SUPPORTED;
    }
    let codes: Vec<c_uint> = device_file(device_id, "codes")
        .split_whitespace()
        .filter_map(|c| c_uint::from_str_radix(c.trim_start_matches("0x"), 16).ok())
        .take(list_len as usize)
        .collect();
    // SAFETY: valid per the contract above; at most `list_len` written.
    unsafe {
        for (i, c) in codes.iter().enumerate() {
            *error_code_list.add(i) = *c;
        }
        *error_count = codes.len() as c_int;
    }
    0
}

/// # Safety
/// `handler` stays valid for the life of the process.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dcmi_subscribe_fault_event(
    card_id: c_int,
    device_id: c_int,
    _filter: DcmiEventFilter,
    handler: Option<Handler>,
) -> c_int {
    let Some(handler) = handler else {
        return NOT_SUPPORTED;
    };
    if std::env::var("DCMI_STANDIN_SUBSCRIBE").is_ok_and(|v| v == "fail") {
        return NOT_SUPPORTED;
    }
    // Only "every device" is recorded.
    if card_id != -1 || device_id != -1 {
        return NOT_SUPPORTED;
    }
    match std::thread::Builder::new()
        .name("dcmi-standin".into())
        .spawn(move || replay(handler))
    {
        Ok(_) => 0,
        Err(_) => NOT_SUPPORTED,
    }
}
