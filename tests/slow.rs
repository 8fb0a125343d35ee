//! Slow ranks: where each rank's steps go, phase by phase, as the agent
//! reads it from the control pages (`agentctl status`, `workers[].
//! step_times`). A rank whose data loading is slowed for real (it sleeps
//! in its data path, each step from the tenth) shows the time as data;
//! the rank it holds back shows it as collective time, waiting for it;
//! the compute of both stays where it was.

mod common;
use common::*;
use std::time::Duration;

#[test]
fn a_rank_slowed_in_its_data_path_shows_as_data_and_its_peer_waits_in_collectives() {
    let d = tempfile::tempdir().unwrap();
    let mut args = tiny_args(80);
    args.extend(s(&["--emulate-device", "20"]));
    let job = job_id("slow-data");
    let shm = d.path().join("shm");
    let cmd = Launch::new(2)
        .job(&job)
        .shm_root(&shm)
        .args(args)
        .fault_plan("1:10-80:data:sleep40")
        .command();
    let mut running = Job::spawn(cmd, &job);
    let socket = shm.join(&job).join("agent.sock");
    let seen = poll_agentctl(&socket, "status", Duration::from_secs(120), |v| {
        let w = v["status"]["workers"].as_array()?;
        let times = |rank: u64| {
            w.iter()
                .find(|r| r["rank"] == rank)
                .map(|r| r["step_times"].clone())
                .filter(|t| t["steps"].as_u64().is_some_and(|n| n >= 40))
        };
        Some((times(0)?, times(1)?))
    });
    let out = running.wait_output(Duration::from_secs(240));
    assert_success(&out, "the slowed run");
    let Some((fast, slow)) = seen else {
        panic!(
            "agentctl status never showed 40 timed steps of both ranks: {}",
            text(&out)
        );
    };
    let ms = |t: &serde_json::Value, phase: &str| t[format!("{phase}_ms")].as_f64().unwrap();
    // At least 31 of the first 40 steps slept 40 ms in rank 1's data path.
    assert!(ms(&slow, "data") >= 25.0, "rank 1: {slow}");
    assert!(ms(&fast, "data") < 5.0, "rank 0 loads at once: {fast}");
    assert!(
        ms(&fast, "collective") > ms(&slow, "collective") + 20.0,
        "rank 0 waits for rank 1 in the collectives: rank 0 {fast}, rank 1 {slow}"
    );
    // The emulated device's 20 ms are compute on both.
    for t in [&fast, &slow] {
        assert!(ms(t, "compute") >= 15.0, "{t}");
        let parts: f64 = ["data", "compute", "collective", "update"]
            .iter()
            .map(|p| ms(t, p))
            .sum();
        assert!(
            parts <= ms(t, "step") * 1.001,
            "the phases are within the step: {t}"
        );
    }
}
