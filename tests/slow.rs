//! Slow ranks, with real processes slowed for real (each sleeps in its
//! data path or its forward pass, every step from the fortieth, by its fault
//! plan): where each rank's steps go, phase by phase, as the agent reads
//! it from the control pages (`agentctl status`, `workers[].step_times`),
//! and the detector's findings (`agentctl slow`).
//!
//! - a rank slowed in its data path shows the time as data, the rank it
//!   holds back as collective time; it is named, with data as the phase;
//! - a rank slowed in its forward pass is named with compute;
//! - both ranks slowed together (the host) raise nothing;
//! - healthy runs of the real model beside a CPU burner raise nothing.

mod common;
use common::*;
use std::time::Duration;

/// Runs 2 ranks for `steps` steps (an emulated device of `device` ms, or
/// the real model) under `plan`, polling `agentctl status` until
/// `done(status)`; returns the last status seen, whether `done` held, and
/// the launcher's output.
fn run(
    name: &str,
    steps: u64,
    device: Option<&str>,
    plan: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> (serde_json::Value, bool, std::process::Output) {
    let d = tempfile::tempdir().unwrap();
    let mut args = tiny_args(steps);
    if let Some(ms) = device {
        args.extend(s(&["--emulate-device", ms]));
    }
    let job = job_id(name);
    let shm = d.path().join("shm");
    let cmd = Launch::new(2)
        .job(&job)
        .shm_root(&shm)
        .args(args)
        .fault_plan(plan)
        .command();
    let mut running = Job::spawn(cmd, &job);
    let socket = shm.join(&job).join("agent.sock");
    let mut last = serde_json::Value::Null;
    let held = poll_agentctl(&socket, "status", Duration::from_secs(120), |v| {
        last = v["status"].clone();
        done(&last).then_some(())
    })
    .is_some();
    let out = running.wait_output(Duration::from_secs(240));
    assert_success(&out, name);
    (last, held, out)
}

/// Rank `rank`'s step times in `status`, once `steps` of them are timed.
fn times(status: &serde_json::Value, rank: u64, steps: u64) -> Option<serde_json::Value> {
    status["workers"]
        .as_array()?
        .iter()
        .find(|r| r["rank"] == rank)
        .map(|r| r["step_times"].clone())
        .filter(|t| t["steps"].as_u64().is_some_and(|n| n >= steps))
}

fn ms(t: &serde_json::Value, phase: &str) -> f64 {
    t[format!("{phase}_ms")].as_f64().unwrap()
}

/// The findings in `status`.
fn findings(status: &serde_json::Value) -> Vec<serde_json::Value> {
    status["slow"].as_array().cloned().unwrap_or_default()
}

#[test]
fn a_rank_slowed_in_its_data_path_shows_as_data_and_is_named_with_data() {
    let (status, held, out) = run("slow-data", 150, Some("20"), "1:40-400:data:sleep40", |s| {
        times(s, 0, 100).is_some() && times(s, 1, 100).is_some() && !findings(s).is_empty()
    });
    assert!(held, "no finding after 100 steps: {status}\n{}", text(&out));
    let (fast, slow) = (
        times(&status, 0, 100).unwrap(),
        times(&status, 1, 100).unwrap(),
    );
    // Most of the steps timed slept 40 ms in rank 1's data path.
    assert!(ms(&slow, "data") >= 15.0, "rank 1: {slow}");
    assert!(ms(&fast, "data") < 5.0, "rank 0 loads at once: {fast}");
    assert!(
        ms(&fast, "collective") > ms(&slow, "collective") + 10.0,
        "rank 0 waits for rank 1 in the collectives: rank 0 {fast}, rank 1 {slow}"
    );
    // The emulated device's 20 ms are compute on both, and the phases are
    // within the step.
    for t in [&fast, &slow] {
        assert!(ms(t, "compute") >= 15.0, "{t}");
        let parts: f64 = ["data", "compute", "collective", "update"]
            .iter()
            .map(|p| ms(t, p))
            .sum();
        assert!(parts <= ms(t, "step") * 1.001, "{t}");
    }
    let f = &findings(&status)[0];
    assert_eq!(
        (f["rank"].as_u64(), f["phase"].as_str()),
        (Some(1), Some("data")),
        "{f}"
    );
    assert!(f["cause"].as_str().unwrap().contains("data loading"), "{f}");
    let since = f["since_step"].as_u64().unwrap();
    assert!(
        (31..=52).contains(&since),
        "the window holding step 40, or the next: {f}"
    );
}

#[test]
fn a_rank_slowed_in_its_forward_pass_is_named_with_compute() {
    let (status, held, out) = run(
        "slow-compute",
        150,
        Some("20"),
        "0:40-400:forward:sleep30",
        |s| !findings(s).is_empty(),
    );
    assert!(held, "no finding: {status}\n{}", text(&out));
    let f = &findings(&status)[0];
    assert_eq!(
        (f["rank"].as_u64(), f["phase"].as_str()),
        (Some(0), Some("compute")),
        "{f}"
    );
    let excess = f["excess_ms"].as_f64().unwrap();
    assert!(
        (20.0..60.0).contains(&excess),
        "about the 30 ms it sleeps: {f}"
    );
}

#[test]
fn both_ranks_slowed_together_raise_nothing() {
    let plan = "0:40-400:forward:sleep30;1:40-400:forward:sleep30";
    let (status, held, out) = run("slow-both", 150, Some("20"), plan, |s| {
        times(s, 0, 120).is_some() && times(s, 1, 120).is_some()
    });
    assert!(held, "never 120 steps timed: {status}\n{}", text(&out));
    assert!(findings(&status).is_empty(), "{status}");
}

/// The real model's compute on both cores, a burner on each beside it,
/// in a few runs: no finding.
#[test]
fn healthy_runs_beside_a_cpu_burner_raise_nothing() {
    let _burners = Burners::start();
    for k in 0..3 {
        let (status, held, out) = run(&format!("slow-healthy-{k}"), 400, None, "", |s| {
            times(s, 0, 300).is_some() && times(s, 1, 300).is_some()
        });
        assert!(held, "never 300 steps timed: {status}\n{}", text(&out));
        assert!(findings(&status).is_empty(), "run {k}: {status}");
    }
}
