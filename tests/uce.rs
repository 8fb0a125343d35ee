//! Uncorrectable memory errors: a UCE in a registered state buffer is
//! repaired by returning every rank to s* and recomputing the step, with no
//! process restarted; a UCE outside registered memory escalates to a worker
//! reboot. Both end bit-identical to the run without faults.
//!
//! The UCE is a real SIGBUS with `si_code` BUS_MCEERR_AR and `si_addr` in the
//! buffer, sent by the worker to itself (`rt_tgsigqueueinfo`), since this
//! machine's kernel refuses `MADV_HWPOISON`; the same handler runs.

mod common;
use common::*;
use std::process::Command;
use std::time::Duration;

fn args(log: &std::path::Path) -> Vec<String> {
    let mut a = tiny_args(40);
    a.extend(["--log-jsonl".into(), log.display().to_string()]);
    a
}

fn launch(
    job: &str,
    shm: &std::path::Path,
    ha: &[&str],
    log: &std::path::Path,
    plan: &str,
) -> Command {
    Launch::new(4)
        .job(job)
        .flags(ha)
        .shm_root(shm)
        .args(args(log))
        .fault_plan(plan)
        .env_remove("HIGH_AVAILABILITY")
        .command()
}

fn started_pids(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter(|l| l.contains("worker started"))
        .filter_map(|l| l.split("pid=").nth(1).map(|p| p.trim().to_string()))
        .collect()
}

#[test]
fn uce_in_state_buffers_is_repaired_without_a_restart() {
    let d = tempfile::tempdir().unwrap();
    let ref_log = d.path().join("ref.jsonl");
    assert_success(&run_launch(4, "uce-ref", &args(&ref_log)), "reference run");
    let log = d.path().join("run.jsonl");
    let job = job_id("uce");
    // A parameter page before the forward pass, an AdamW-moment page inside
    // the update fences, and the second moment.
    let plan =
        "1:10:forward:uce-params-1000;2:20:update:uce-exp_avg-500;3:30:forward:uce-exp_avg_sq-64";
    let ha = ["--enable-high-availability", "--enable-hbmfault-repair"];
    let out = Job::spawn(launch(&job, &d.path().join("shm"), &ha, &log, plan), &job)
        .wait_output(Duration::from_secs(120));
    assert_success(&out, "run with UCEs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        started_pids(&stderr).len(),
        4,
        "no process was restarted: {stderr}"
    );
    for (rank, buf) in [(1, "params"), (2, "exp_avg"), (3, "exp_avg_sq")] {
        assert!(
            stderr.contains(&format!(
                "UCE: step repair rank={rank} detail=SIGBUS BUS_MCEERR in {buf}"
            )),
            "{stderr}"
        );
    }
    assert!(stderr.contains("via Sigqueue") || stderr.contains("via Hwpoison"));
    assert_eq!(
        stderr
            .matches("recovered: first step after the fault completed")
            .count(),
        3
    );
    assert_eq!(
        final_checksum(&read_log(&ref_log)),
        final_checksum(&read_log(&log))
    );
}

#[test]
fn uce_outside_registered_memory_reboots_the_worker() {
    let d = tempfile::tempdir().unwrap();
    let ref_log = d.path().join("ref.jsonl");
    assert_success(&run_launch(4, "uce-ref2", &args(&ref_log)), "reference run");
    let log = d.path().join("run.jsonl");
    let job = job_id("uce-out");
    let ha = [
        "--enable-high-availability",
        "--enable-hbmfault-repair",
        "--enable-worker-reboot",
    ];
    let out = Job::spawn(
        launch(
            &job,
            &d.path().join("shm"),
            &ha,
            &log,
            "2:15:forward:uce-outside",
        ),
        &job,
    )
    .wait_output(Duration::from_secs(120));
    assert_success(&out, "run with a UCE outside the state");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        started_pids(&stderr).len(),
        5,
        "rank 2 is rebooted: {stderr}"
    );
    assert!(stderr.contains("killed by signal 7 (SIGBUS)"), "{stderr}");
    assert_eq!(
        final_checksum(&read_log(&ref_log)),
        final_checksum(&read_log(&log))
    );
}
