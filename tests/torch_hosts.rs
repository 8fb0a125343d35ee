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
//! - Elastic DDP, three hosts, host 1 lost with no standby: the group
//!   shrinks to two ranks at s\*, each rank bringing what it holds (the lost
//!   rank's slices and metadata from its replica), with the global batch
//!   kept; the run after it equals, bit for bit, a fresh run of two ranks
//!   loaded from the agent's checkpoint of s\* of a run without faults.

mod common;

use common::cluster::{assert_filled, logs, stderr};
use common::examples::{Example, ExampleRun, events, final_digest};
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

/// The agents of one test job: `nodes` hosts of one rank and standby
/// hosts, training the example with `args`.
struct Hosts {
    tmp: tempfile::TempDir,
    job: String,
    shm: Vec<std::path::PathBuf>,
    agents: Vec<Job>,
}

impl Hosts {
    fn start(nodes: usize, standbys: usize, extra: &[&str], args: &[&str]) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let secret = secret_file(tmp.path());
        let job = job_id("torch-hosts");
        let ports = (free_port(), free_port());
        let log = tmp.path().join("log.{rank}.jsonl");
        let script = example("torch_gpt.py");
        let all = nodes + standbys;
        let shm: Vec<_> = (0..all)
            .map(|k| tmp.path().join(format!("host{k}")))
            .collect();
        let spares = standbys.to_string();
        let agents = (0..all)
            .map(|k| {
                let mut flags = vec![
                    "--enable-hbmfault-repair",
                    "--standby-nodes",
                    spares.as_str(),
                    "--hang-timeout-secs",
                    "20",
                ];
                flags.extend(extra);
                if k >= nodes {
                    flags.push("--standby");
                }
                let mut c = Launch::new(1)
                    .job(&job)
                    .worker_reboot()
                    .shm_root(&shm[k])
                    .option("--nnodes", nodes.to_string())
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
                    .args(args)
                    .env_remove("SLURM_JOB_ID")
                    .fault_plan(NAP)
                    .env("TMPDIR", tmp.path())
                    .command();
                c.current_dir(tmp.path());
                Job::spawn(c, &format!("{job}-h{k}"))
            })
            .collect();
        Self {
            tmp,
            job,
            shm,
            agents,
        }
    }

    /// Kills every agent still running (a test that failed) and returns
    /// their logs.
    fn kill_all(&mut self) -> String {
        let running: Vec<usize> = (0..self.agents.len())
            .filter(|&k| self.agents[k].child.is_some())
            .collect();
        for &k in &running {
            kill_job(&format!("{}-h{k}", self.job));
        }
        let outs: Vec<_> = running
            .into_iter()
            .map(|k| (k, self.agents[k].wait_output(Duration::from_secs(30))))
            .collect();
        logs(&outs)
    }

    /// Waits until host `holder` holds `rank`'s replica of step 11 (the
    /// job stands still in step 12), then host `lost` vanishes.
    fn lose(&mut self, lost: usize, holder: usize) {
        let socket = self.shm[holder].join(&self.job).join("agent.sock");
        let held = poll_agentctl(&socket, "status", Duration::from_secs(120), |v| {
            let held = v["status"]["replicas"]["held"].as_array()?;
            held.iter()
                .any(|h| h["rank"] == lost && h["steps"][0].as_u64().is_some_and(|s| s >= 11))
                .then_some(())
        });
        if held.is_none() {
            panic!(
                "host {holder} never held rank {lost}'s replica at step 11:\n{}",
                self.kill_all()
            );
        }
        kill_job(&format!("{}-h{lost}", self.job));
        let _ = self.agents[lost].wait_output(Duration::from_secs(30));
        std::fs::remove_dir_all(&self.shm[lost]).unwrap();
    }

    /// How the agents of `hosts` ended; each must have succeeded, and left
    /// nothing in its root.
    fn ends(&mut self, hosts: &[usize]) -> Vec<(usize, std::process::Output)> {
        let outs: Vec<_> = hosts
            .iter()
            .map(|&k| (k, self.agents[k].wait_output(Duration::from_secs(300))))
            .collect();
        for (k, out) in &outs {
            assert!(
                out.status.success(),
                "host {k} did not end well:\n{}",
                logs(&outs)
            );
            assert_nothing_left(&self.shm[*k]);
        }
        outs
    }

    /// Rank `rank`'s log.
    fn log(&self, rank: usize) -> Vec<serde_json::Value> {
        read_log(&self.tmp.path().join(format!("log.{rank}.jsonl")))
    }
}

/// Host `lost` of the two vanishes, the example run with `layout` flags.
fn lost_host(layout: &[&str], lost: usize) {
    let _one_at_a_time = serial();
    let args: Vec<&str> = MODEL.iter().chain(layout).copied().collect();
    let want = final_digest(&run(2, &args, &[]).logs[0], STEPS);
    let holder = 1 - lost;
    let mut hosts = Hosts::start(2, 1, &[], &args);
    hosts.lose(lost, holder);
    let outs = hosts.ends(&[holder, 2]);
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
        assert_eq!(
            final_digest(&hosts.log(rank), STEPS),
            want,
            "rank {rank}'s parameters:\n{}",
            logs(&outs)
        );
    }
}

/// The example on one host: `ranks` ranks, `args`, the agent's `flags`.
fn run(ranks: usize, args: &[&str], flags: &[&str]) -> ExampleRun {
    Example {
        script: "torch_gpt.py",
        ranks,
        flags,
        args,
        plan: None,
        env: &[],
    }
    .run()
}

#[test]
fn an_elastic_pytorch_ddp_job_shrinks_when_a_host_is_lost_and_equals_a_fresh_run_at_the_new_size() {
    let _one_at_a_time = serial();
    let mut args: Vec<&str> = MODEL.to_vec();
    args.extend(["--ddp", "--global-batch", "6"]);
    let mut hosts = Hosts::start(3, 0, &["--enable-elastic-training"], &args);
    // Rank 1's replica is on host 2.
    hosts.lose(1, 2);
    let outs = hosts.ends(&[0, 2]);
    assert!(
        stderr(&outs, 0).contains("shrinking the data-parallel group from 3 to 2 ranks"),
        "{}",
        logs(&outs)
    );
    let (first, last) = (hosts.log(0), hosts.log(2));
    let s_star = events(&first, "resume")
        .last()
        .and_then(|e| e["step"].as_u64())
        .unwrap_or_else(|| panic!("rank 0 never resumed:\n{}", logs(&outs)));
    assert!((10..=12).contains(&s_star), "resized at step {s_star}");
    // Old rank 2 trained at each size in turn (a step redone after the
    // resize counts as redone), with the global batch kept.
    let sizes: std::collections::BTreeMap<u64, serde_json::Value> = events(&last, "step")
        .iter()
        .map(|e| (e["step"].as_u64().unwrap(), e["world_size"].clone()))
        .collect();
    for (step, world) in sizes {
        assert_eq!(world, if step > s_star { 2 } else { 3 }, "step {step}");
    }

    // The same job without faults, its state saved by the agent at s*;
    // then two ranks loaded from that checkpoint.
    let saves = hosts.tmp.path().join("saves");
    let (saves_arg, interval) = (saves.to_str().unwrap(), s_star.to_string());
    let mut saving = args.clone();
    saving.extend(["--save", saves_arg, "--save-interval", &interval]);
    run(3, &saving, &[]);
    let at = saves.join(format!("iter_{s_star:07}")).join("dcp");
    let mut loading = args.clone();
    loading.extend(["--load", at.to_str().unwrap()]);
    let fresh = run(2, &loading, &[]);
    let want = final_digest(&fresh.logs[0], STEPS);
    assert_eq!(final_digest(&first, STEPS), want, "{}", logs(&outs));
    assert_eq!(final_digest(&last, STEPS), want, "{}", logs(&outs));
    // Every step's loss after s*: old rank 2 is rank 1 of the fresh run.
    let losses = |log: &[serde_json::Value]| -> std::collections::BTreeMap<u64, String> {
        events(log, "step")
            .iter()
            .map(|e| (e["step"].as_u64().unwrap(), e["loss"].to_string()))
            .filter(|(step, _)| *step > s_star)
            .collect()
    };
    assert_eq!(losses(&first), losses(&fresh.logs[0]));
    assert_eq!(losses(&last), losses(&fresh.logs[1]));
}
