//! An NPU's UCE, as the Ascend fault source hears of it, against the same
//! fault as a SIGBUS in the worker: from the fault to the first step
//! completed after the repair, in one run of interleaved repetitions.
//!
//! 2 ranks train the `uce` benchmark's model (d_model 1024, d_ff 4096, 4
//! layers: about 290 MB of state per rank) with step repair on, through the
//! stand-in `libdcmi.so` (the `hatrain-dcmi-standin` cdylib, loaded with
//! `--dcmi-library`):
//!
//! - `dcmi`: once rank 0 has logged step 5, a recorded 0x80E01801 event on
//!   device 1 is posted; the fault's time is the posting. The source hands
//!   it to the job, which asks rank 1 to take it as a UCE in its state at
//!   its next step boundary;
//! - `sigbus`: rank 1 gets a SIGBUS (BUS_MCEERR_AR) in its parameters at
//!   the start of step 6 (its fault plan); the fault's time is rank 0's
//!   log of step 5, which the ranks finish together.
//!
//! Both end at the first step logged under the recovery's epoch. The
//! difference is the wait for rank 1's step boundary (up to a step) and the
//! source's hand-over.

mod common;
#[path = "../tests/common/dcmi.rs"]
mod dcmi;

use common::launch::Launch;
use common::median;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const RUNS: usize = 3;

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn steps(log: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["event"] == "step")
        .collect()
}

/// One run: seconds from the fault to the first step after the repair.
fn run(dir: &Path, n: usize, dcmi_event: bool) -> f64 {
    let log = dir.join(format!("run-{n}.jsonl"));
    let events = dir.join(format!("events-{n}"));
    std::fs::create_dir_all(&events).unwrap();
    let launch = Launch::bare(2)
        .high_availability()
        .flags(["--enable-hbmfault-repair"])
        .shm_root(dir)
        .option("--dcmi-library", dcmi::standin())
        .args(["--model-size", "10m", "--d-model", "1024", "--d-ff", "4096"])
        .args(["--layers", "4", "--global-batch", "4", "--seq-len", "16"])
        .args(["--train-iters", "12", "--log-interval", "1000"])
        .arg("--log-jsonl")
        .arg(&log)
        .env("DCMI_STANDIN_DIR", &events)
        .env_remove("ASCEND_RT_VISIBLE_DEVICES")
        .env("RUST_LOG", "warn");
    let launch = if dcmi_event {
        launch.no_fault_plan()
    } else {
        launch.fault_plan("1:6:forward:uce-params-4096")
    };
    let mut child = launch
        .command()
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run hatrain-agent");
    let end = Instant::now() + Duration::from_secs(300);
    let at_5 = loop {
        assert!(Instant::now() < end, "no step 5");
        if let Some(st) = child.try_wait().expect("poll the agent") {
            panic!("the agent exited ({st}) before step 5");
        }
        if let Some(e) = steps(&log).iter().find(|e| e["step"] == 5) {
            break e["unix_s"].as_f64().unwrap();
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let t_fault = if dcmi_event {
        let t = now();
        dcmi::post(
            &events,
            "uce",
            &[dcmi::event(0x80E0_1801, 1, 1, "multi-bit ecc error")],
        );
        t
    } else {
        at_5
    };
    let out = child.wait_with_output().expect("wait for the agent");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let first = steps(&log)
        .into_iter()
        .find(|e| e["epoch"].as_u64().is_some_and(|ep| ep >= 1))
        .unwrap_or_else(|| panic!("no step after a repair: {stderr}"));
    first["unix_s"].as_f64().unwrap() - t_fault
}

fn main() {
    let dir = tempfile::Builder::new()
        .prefix("hatrain-bench-")
        .tempdir_in("/dev/shm")
        .expect("tempdir");
    println!("NPU UCE (stand-in DCMI event) vs SIGBUS UCE, 2 ranks, about 290 MB per rank");
    let (mut by_dcmi, mut by_sigbus) = (Vec::new(), Vec::new());
    for rep in 0..RUNS {
        let s = run(dir.path(), 2 * rep, false);
        let d = run(dir.path(), 2 * rep + 1, true);
        println!(
            "rep {rep}: fault -> first step after the repair: sigbus {s:.3} s | dcmi event {d:.3} s"
        );
        by_sigbus.push(s);
        by_dcmi.push(d);
    }
    let (s, d) = (median(by_sigbus), median(by_dcmi));
    println!(
        "median of {RUNS}: sigbus {s:.3} s, dcmi event {d:.3} s: dcmi / sigbus {:.2}x",
        d / s
    );
}
