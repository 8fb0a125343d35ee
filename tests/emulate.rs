//! `hatrain-train --emulate-device MS`: each step's forward and backward
//! are a wait of MS milliseconds holding no host core, as on an accelerator
//! host, with seeded gradients; the update and the state are the real
//! ones. Under a real `hatrain-agent launch`, a rank SIGKILLed at three
//! instants (forward, inside the update fences, halfway through a
//! snapshot's copy), a memory error in an AdamW moment and a hung rank end
//! with parameters bit-identical to the same run without faults.

mod common;
use common::*;
use std::path::Path;
use std::time::Duration;

/// Emulated device time per step, in milliseconds.
const DEVICE_MS: &str = "40";
const STEPS: u64 = 30;

fn args(log: &Path) -> Vec<String> {
    let mut a = tiny_args(STEPS);
    a.extend(s(&["--emulate-device", DEVICE_MS, "--log-jsonl"]));
    a.push(log.display().to_string());
    a
}

/// The steps rank 0 logged, in order.
fn steps(log: &[serde_json::Value]) -> Vec<u64> {
    log.iter()
        .filter(|e| e["event"] == "step")
        .map(|e| e["step"].as_u64().unwrap())
        .collect()
}

#[test]
fn an_emulated_device_run_comes_back_bit_identical_from_kills_a_memory_error_and_a_hang() {
    let d = tempfile::tempdir().unwrap();
    let (ref_log, log) = (d.path().join("ref.jsonl"), d.path().join("run.jsonl"));
    assert_success(
        &run_launch(2, "emulate-ref", &args(&ref_log)),
        "reference run",
    );
    let reference = read_log(&ref_log);
    assert_eq!(steps(&reference), (1..=STEPS).collect::<Vec<_>>());
    // The forward and backward are the device's wait: no step is shorter.
    for e in reference.iter().filter(|e| e["event"] == "step") {
        assert!(e["step_time_s"].as_f64().unwrap() >= 0.040, "{e}");
    }

    // Rank 1 is killed in the forward pass, inside the update fences and
    // halfway through a snapshot's copy (each in its next process); rank 0
    // takes a memory error in its first AdamW moment; rank 1's fourth
    // process hangs in a step, and is found hung and killed.
    let plan = "1:5:forward:kill;1:11:update:kill:1;1:17:commit:kill:2;\
                0:21:forward:uce-exp_avg-500;1:25:forward:hang:3";
    let job = job_id("emulate");
    let cmd = Launch::new(2)
        .job(&job)
        .worker_reboot()
        .flags(["--enable-hbmfault-repair"])
        .flags(["--hang-factor", "10", "--hang-floor-secs", "3"])
        .flags(["--hang-startup-grace-secs", "2"])
        .shm_root(d.path().join("shm"))
        .args(args(&log))
        .fault_plan(plan)
        .command();
    let out = Job::spawn(cmd, &job).wait_output(Duration::from_secs(240));
    assert_success(&out, "run with kills, a memory error and a hang");
    let run = read_log(&log);
    assert_eq!(final_checksum(&run), final_checksum(&reference));
    // Five faults, each recovered under a new epoch of the job.
    let epochs: std::collections::BTreeSet<u64> = run
        .iter()
        .filter(|e| e["event"] == "step")
        .map(|e| e["epoch"].as_u64().unwrap())
        .collect();
    assert!(epochs.len() >= 6, "epochs {epochs:?}: {}", text(&out));
}
