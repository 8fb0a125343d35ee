//! The stand-in `libdcmi.so` (the `hatrain-dcmi-standin` cdylib), built
//! for the tests and benchmarks that replay Ascend NPU fault events.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// Writes recorded DCMI fault events for the stand-in to deliver: whole,
/// then renamed into place as `<name>.json` in `dir`.
pub fn post(dir: &Path, name: &str, events: &[serde_json::Value]) {
    let tmp = dir.join(format!("{name}.tmp"));
    std::fs::write(&tmp, serde_json::to_vec(events).unwrap()).unwrap();
    std::fs::rename(&tmp, dir.join(format!("{name}.json"))).unwrap();
}

/// One recorded fault event (`dcmi_dms_fault_event`'s fields), raised.
pub fn event(code: u32, device: u16, time_ms: u64, name: &str) -> serde_json::Value {
    serde_json::json!({
        "event_id": code, "deviceid": device, "severity": 2, "assertion": 1,
        "alarm_raised_time": time_ms, "event_name": name,
    })
}

/// Builds the stand-in library (once per test process) and returns its path.
pub fn standin() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("dcmi-standin/Cargo.toml");
        let out = Command::new(cargo)
            .args(["build", "--message-format=json-render-diagnostics"])
            .arg("--manifest-path")
            .arg(&manifest)
            .stderr(Stdio::inherit())
            .output()
            .expect("run cargo");
        assert!(out.status.success(), "building the stand-in libdcmi failed");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| {
                v["reason"] == "compiler-artifact" && v["target"]["name"] == "hatrain_dcmi_standin"
            })
            .flat_map(|v| {
                v["filenames"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|f| f.as_str().map(PathBuf::from))
                    .collect::<Vec<_>>()
            })
            .find(|f| f.extension().is_some_and(|x| x == "so"))
            .expect("the stand-in's .so among cargo's artifacts")
    })
}
