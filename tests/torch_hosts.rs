//! `examples/torch_gpt.py` across hosts: two hosts of one rank each
//! (agents on 127.0.0.1 and .2, each with its own shared-memory root) and a
//! standby host (.3). The process group meets in the agent's authenticated
//! rendezvous store, reached through each host's agent; each host streams
//! its rank's snapshots to the other.
//!
//! A host vanishes as a machine would (its agent and worker SIGKILLed, its
//! shared memory deleted) while the job stands still (rank 0 naps in step
//! 12, so the other host holds the lost rank's replica of step 11): the
//! standby takes the rank, fills its store from the replica, and the job
//! runs to its end with the full parameters bit-identical to a run of two
//! ranks on one host without faults.
//!
//! - FSDP2 (each rank holds a shard of the parameters and of the AdamW
//!   moments), host 1 lost.
//! - DDP (each rank snapshots a slice of the replicated state; after the
//!   restore the slices travel over the new process group), the
//!   controller's host lost: host 1 takes over, and the workers' next group
//!   meets in its store.

mod common;

use common::cluster::{assert_filled, logs, stderr};
use common::examples::{Example, final_digest};
use common::hosts::*;
use common::launch::Launch;
use common::python::{example, python, serial};
use common::*;
use std::time::Duration;

const STEPS: u64 = 24;

/// A small model, so that a run takes seconds on two cores.
const MODEL: [&str; 12] = [
    "--steps", "24", "--layers", "2", "--width", "64", "--heads", "4", "--vocab", "512", "--seq",
    "32",
];

/// Rank 0 naps in step 12's forward pass: the job stands still meanwhile
/// (the hang bound is longer than the nap).
const NAP: &str = "0:12:forward:sleep8000";

#[test]
fn a_pytorch_job_with_fsdp2_across_hosts_recovers_a_lost_host_on_a_standby_from_its_peer_replica() {
    lost_host(&[], 1);
}

#[test]
fn a_pytorch_ddp_job_across_hosts_recovers_the_loss_of_the_controllers_host_on_a_standby() {
    lost_host(&["--ddp"], 0);
}

/// Host `lost` of the two vanishes, the example run with `layout` flags.
fn lost_host(layout: &[&str], lost: usize) {
    let _one_at_a_time = serial();
    let args: Vec<&str> = MODEL.iter().chain(layout).copied().collect();
    let reference = Example {
        script: "torch_gpt.py",
        ranks: 2,
        flags: &[],
        args: &args,
        plan: None,
        env: &[],
    }
    .run();
    let want = final_digest(&reference.logs[0], STEPS);
    let holder = 1 - lost;
    let tmp = tempfile::tempdir().unwrap();
    let secret = secret_file(tmp.path());
    let job = job_id("torch-hosts");
    let ports = (free_port(), free_port());
    let log = tmp.path().join("log.{rank}.jsonl");
    let script = example("torch_gpt.py");
    let shm: Vec<_> = (0..3)
        .map(|k| tmp.path().join(format!("host{k}")))
        .collect();
    let mut agents: Vec<Job> = (0..3)
        .map(|k| {
            let mut flags = vec![
                "--enable-hbmfault-repair",
                "--standby-nodes",
                "1",
                "--hang-timeout-secs",
                "20",
            ];
            if k == 2 {
                flags.push("--standby");
            }
            let mut c = Launch::new(1)
                .job(&job)
                .worker_reboot()
                .shm_root(&shm[k])
                .option("--nnodes", "2")
                .option("--node-rank", k.to_string())
                .option("--master-addr", "127.0.0.1")
                .option("--master-port", ports.0.to_string())
                .option("--rdzv-port", ports.1.to_string())
                .option("--local-addr", format!("127.0.0.{}", k + 1))
                .option("--secret-file", &secret)
                .flags(&flags)
                .program(python())
                .arg(&script)
                .args(["--log-jsonl", log.to_str().unwrap()])
                .args(&args)
                .env_remove("SLURM_JOB_ID")
                .fault_plan(NAP)
                .env("TMPDIR", tmp.path())
                .command();
            c.current_dir(tmp.path());
            Job::spawn(c, &format!("{job}-h{k}"))
        })
        .collect();

    // The other host holds the lost rank's replica of the step the job
    // stands still at.
    let socket = shm[holder].join(&job).join("agent.sock");
    let held = poll_agentctl(&socket, "status", Duration::from_secs(120), |v| {
        let held = v["status"]["replicas"]["held"].as_array()?;
        held.iter()
            .any(|h| h["rank"] == lost && h["steps"][0].as_u64().is_some_and(|s| s >= 11))
            .then_some(())
    });
    if held.is_none() {
        for k in 0..3 {
            kill_job(&format!("{job}-h{k}"));
        }
        let outs: Vec<_> = (0..3)
            .map(|k| (k, agents[k].wait_output(Duration::from_secs(30))))
            .collect();
        panic!(
            "host {holder} never held rank {lost}'s replica at step 11:\n{}",
            logs(&outs)
        );
    }
    kill_job(&format!("{job}-h{lost}"));
    let _ = agents[lost].wait_output(Duration::from_secs(30));
    std::fs::remove_dir_all(&shm[lost]).unwrap();

    let outs: Vec<_> = [holder, 2]
        .into_iter()
        .map(|k| (k, agents[k].wait_output(Duration::from_secs(300))))
        .collect();
    for (k, out) in &outs {
        assert!(
            out.status.success(),
            "host {k} did not end well:\n{}",
            logs(&outs)
        );
    }
    // The survivor runs the controller (host 1 by taking over).
    let controller = stderr(&outs, holder);
    assert!(
        controller.contains(&format!("host {lost} lost: recovering on a standby host"))
            && (lost != 0 || controller.contains("taking over as the job's controller")),
        "the controller recovered host {lost} on the standby:\n{}",
        logs(&outs)
    );
    assert_filled(&stderr(&outs, 2), &[lost]);
    for rank in 0..2 {
        let run = read_log(&tmp.path().join(format!("log.{rank}.jsonl")));
        assert_eq!(
            final_digest(&run, STEPS),
            want,
            "rank {rank}'s parameters:\n{}",
            logs(&outs)
        );
    }
    for k in [holder, 2] {
        assert_nothing_left(&shm[k]);
    }
}
