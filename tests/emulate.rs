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

/// `--snapshot-window skip`: rank 0's snapshot of step 8 begins to be
/// copied a second late (a copy that starts late, as one staged out of
/// device memory may), long after step 9's update began. That update does
/// not wait for it: the snapshot is abandoned and counted, and so is each
/// one queued behind it, and the snapshots after are taken again (a kill
/// at step 40 resumes from a step after them). The run ends bit-identical
/// to one without faults, and `agentctl status` shows the held time per
/// step and the copy time per snapshot while it runs.
#[test]
fn a_snapshot_that_misses_its_window_is_skipped_and_counted_and_training_never_waits_for_it() {
    const STEPS: u64 = 45;
    let d = tempfile::tempdir().unwrap();
    let (ref_log, log) = (d.path().join("ref.jsonl"), d.path().join("run.jsonl"));
    let args = |log: &Path| {
        let mut a = tiny_args(STEPS);
        a.extend(s(&[
            "--emulate-device",
            DEVICE_MS,
            "--snapshot-window",
            "skip:1000",
        ]));
        a.extend(s(&["--log-jsonl", log.to_str().unwrap()]));
        a
    };
    assert_success(
        &run_launch(2, "window-ref", &args(&ref_log)),
        "reference run",
    );
    let reference = read_log(&ref_log);

    // Rank 0 also naps in step 30, so that agentctl is asked while it runs.
    let plan = "0:8:copy:sleep1000;0:30:forward:sleep2000;1:40:forward:kill";
    let job = job_id("window");
    let shm = d.path().join("shm");
    let cmd = Launch::new(2)
        .job(&job)
        .worker_reboot()
        .shm_root(&shm)
        .args(args(&log))
        .fault_plan(plan)
        .command();
    let mut running = Job::spawn(cmd, &job);
    let socket = shm.join(&job).join("agent.sock");
    let shown = poll_agentctl(&socket, "status", Duration::from_secs(60), |v| {
        let w = v["status"]["workers"].as_array()?;
        let ok = w.len() == 2
            && w.iter().all(|r| {
                r["held_time"]["steps"].as_u64().is_some_and(|n| n >= 20)
                    && r["held_time"]["p50_ms"].as_f64().is_some()
                    && r["copies"]["sealed"].as_u64().is_some_and(|n| n > 0)
                    && r["copies"]["copy_ms_mean"]
                        .as_f64()
                        .is_some_and(|ms| ms > 0.0)
            });
        // The late copy is counted once the commit thread is back from it.
        let counted = w[0]["copies"]["skipped"].as_u64().is_some_and(|n| n >= 1);
        (ok && counted).then(|| w.clone())
    });
    let out = running.wait_output(Duration::from_secs(240));
    assert_success(&out, "run with a late copy and a kill");
    assert!(
        shown.is_some(),
        "agentctl status never showed both ranks' held and copy times and rank 0's skipped copy: {}",
        text(&out)
    );

    let run = read_log(&log);
    assert_eq!(final_checksum(&run), final_checksum(&reference));
    let skipped = |step: u64| {
        run.iter()
            .find(|e| e["event"] == "step" && e["step"] == step)
            .and_then(|e| e["snapshots_skipped"].as_u64())
            .unwrap_or_else(|| panic!("no step {step} in the log"))
    };
    // Step 9 was logged after its update began, while step 8's copy had
    // not: had the update waited for that copy, its skip would have been
    // counted by then.
    assert_eq!(
        skipped(9),
        0,
        "step 9's update did not wait for step 8's copy"
    );
    assert!(skipped(STEPS) >= 1, "the late snapshot is counted");
    // The kill at step 40 resumes from a snapshot taken after the skipped
    // ones.
    let resumed: Vec<u64> = run
        .iter()
        .filter(|e| e["event"] == "resume")
        .map(|e| e["step"].as_u64().unwrap())
        .collect();
    assert!(
        !resumed.is_empty() && resumed.iter().all(|&s| s > 9),
        "resumed from {resumed:?}: {}",
        text(&out)
    );
}

/// Rank 1 is killed halfway through its copy of step 8, so step 7 is the
/// newest it holds sealed, while rank 0 is in the middle of its own copy
/// of step 8 (held there 3 s). The pause says the job cannot resume past
/// step 7: rank 0 abandons that copy, unsealed and counted, instead of
/// finishing a snapshot no rank could use, and the job resumes from 7,
/// bit-identical to the run without faults.
#[test]
fn a_pause_abandons_a_copy_of_a_step_the_dead_rank_never_sealed() {
    let d = tempfile::tempdir().unwrap();
    let (ref_log, log) = (d.path().join("ref.jsonl"), d.path().join("run.jsonl"));
    assert_success(&run_launch(2, "upto-ref", &args(&ref_log)), "reference run");
    let reference = read_log(&ref_log);

    let job = job_id("upto");
    let cmd = Launch::new(2)
        .job(&job)
        .worker_reboot()
        .shm_root(d.path().join("shm"))
        .args(args(&log))
        .fault_plan("0:8:commit:sleep3000;1:8:commit:kill")
        .command();
    let out = Job::spawn(cmd, &job).wait_output(Duration::from_secs(240));
    assert_success(&out, "run with a kill during both ranks' copies");
    let run = read_log(&log);
    assert_eq!(final_checksum(&run), final_checksum(&reference));
    let resumed: Vec<u64> = run
        .iter()
        .filter(|e| e["event"] == "resume")
        .map(|e| e["step"].as_u64().unwrap())
        .collect();
    assert_eq!(resumed, vec![7], "{}", text(&out));
    let last = run
        .iter()
        .rfind(|e| e["event"] == "final")
        .expect("rank 0's final line");
    assert_eq!(
        last["snapshot_copies"]["skipped"].as_u64(),
        Some(1),
        "rank 0's copy of step 8 abandoned, the only one: {last}"
    );
}
