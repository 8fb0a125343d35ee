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
//! - Elastic DDP, four hosts, host 1 lost with no standby: the group
//!   shrinks to three ranks at s1, each rank bringing what it holds (the
//!   lost rank's slices and metadata from its replica); a standby started
//!   late grows it back to four at s2, the joining rank given its state by
//!   the others. The global batch is kept, and each leg equals, bit for
//!   bit, a fresh run at its size loaded from the agent's checkpoint of
//!   its s\* (chained through runs without faults).

mod common;

use common::cluster::{assert_filled, logs, stderr};
use common::examples::{Example, ExampleRun, events, final_digest};
use common::hosts::*;
use common::launch::Launch;
use common::ports::free_ports;
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
    /// Standby agents started later, by [`Hosts::start_late`].
    late: Vec<std::process::Command>,
}

impl Hosts {
    fn start(nodes: usize, standbys: usize, extra: &[&str], args: &[&str]) -> Self {
        Self::start_later(nodes, (standbys, 0), extra, args, NAP)
    }

    /// `nodes` hosts and `standbys.0` standby hosts, of which the last
    /// `standbys.1` start only at [`Hosts::start_late`]; the ranks follow
    /// the drill `plan`.
    fn start_later(
        nodes: usize,
        (standbys, later): (usize, usize),
        extra: &[&str],
        args: &[&str],
        plan: &str,
    ) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let secret = secret_file(tmp.path());
        let job = job_id("torch-hosts");
        let ports: (u16, u16) = free_ports::<2>().into();
        let log = tmp.path().join("log.{rank}.jsonl");
        let script = example("torch_gpt.py");
        let all = nodes + standbys;
        let shm: Vec<_> = (0..all)
            .map(|k| tmp.path().join(format!("host{k}")))
            .collect();
        let spares = standbys.to_string();
        let mut agents = (0..all)
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
                    .fault_plan(plan)
                    .env("TMPDIR", tmp.path())
                    .command();
                c.current_dir(tmp.path());
                c
            })
            .collect::<Vec<_>>();
        let late = agents.split_off(all - later.min(standbys));
        let agents = agents
            .into_iter()
            .enumerate()
            .map(|(k, c)| Job::spawn(c, &format!("{job}-h{k}")))
            .collect();
        Self {
            tmp,
            job,
            shm,
            agents,
            late,
        }
    }

    /// Starts the standby agents held back.
    fn start_late(&mut self) {
        for c in std::mem::take(&mut self.late) {
            let k = self.agents.len();
            self.agents
                .push(Job::spawn(c, &format!("{}-h{k}", self.job)));
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

/// Elastic DDP, four hosts of one rank and a standby that starts only
/// after the first loss (five agents, so that the hosts left after a loss
/// are a majority of them), a global batch of 12. Host 1 vanishes while
/// rank 0 naps in step 12: the group shrinks to 3 at s1. The standby then
/// starts while rank 0 naps in step 18, is heard, takes rank 1 and the
/// group grows back to 4 at s2, the new rank given its state by the
/// others. Each leg equals a fresh run at its size loaded from the agent's
/// checkpoint of its s\* (of the leg before it, chained): every step's
/// loss on every rank, and the final parameters.
#[test]
fn an_elastic_pytorch_ddp_job_shrinks_and_grows_back_and_each_leg_equals_a_fresh_run() {
    let _one_at_a_time = serial();
    let mut args: Vec<&str> = MODEL.to_vec();
    args.extend(["--ddp", "--global-batch", "12"]);
    let plan = format!("{NAP};0:18:forward:sleep15000");
    let mut hosts = Hosts::start_later(4, (1, 1), &["--enable-elastic-training"], &args, &plan);
    let socket = hosts.shm[0].join(&hosts.job).join("agent.sock");
    let resized = |n: usize, world: u64| {
        move |v: &serde_json::Value| {
            let s = &v["status"];
            (s["resizes"].as_array().is_some_and(|r| r.len() == n) && s["world_size"] == world)
                .then_some(())
        }
    };
    // Rank 1's replica is on host 2.
    hosts.lose(1, 2);
    if poll_agentctl(&socket, "status", Duration::from_secs(120), resized(1, 3)).is_none() {
        panic!("the group did not shrink to 3 ranks:\n{}", hosts.kill_all());
    }
    hosts.start_late();
    if poll_agentctl(&socket, "status", Duration::from_secs(120), resized(2, 4)).is_none() {
        panic!(
            "the group did not grow back to 4 ranks:\n{}",
            hosts.kill_all()
        );
    }
    let outs = hosts.ends(&[0, 2, 3, 4]);
    let controller = stderr(&outs, 0);
    assert!(
        controller.contains("shrinking the data-parallel group from 4 to 3 ranks")
            && controller.contains("growing the data-parallel group from 3 to 4 ranks"),
        "{}",
        logs(&outs)
    );
    // Where each rank resumed: rank 0 twice (the shrink, the grow), the
    // rank that joined once (the grow).
    let resumes = |rank: usize| -> Vec<u64> {
        events(&hosts.log(rank), "resume")
            .iter()
            .filter_map(|e| e["step"].as_u64())
            .collect()
    };
    let (s1, s2) = match resumes(0)[..] {
        [s1, s2] => (s1, s2),
        ref r => panic!("rank 0 resumed at {r:?}:\n{}", logs(&outs)),
    };
    assert!(
        (10..=12).contains(&s1) && s1 < s2 && s2 < STEPS,
        "resized at {s1} and {s2}"
    );
    assert_eq!(resumes(1), [s2], "the joining rank:\n{}", logs(&outs));
    // Every step at the size of its leg (a step redone after a resize
    // counts as redone), as old rank 3 saw it.
    for e in events(&hosts.log(3), "step") {
        let step = e["step"].as_u64().unwrap();
        let want = if step <= s1 || step > s2 { 4 } else { 3 };
        assert_eq!(e["world_size"], want, "step {step}");
    }

    // The legs without faults, chained through the agent's checkpoints:
    // four ranks saved at s1; three loaded from it, saved at s2; four
    // loaded from that.
    let leg = |ranks: usize, load: Option<&std::path::Path>, save_at: Option<u64>, name: &str| {
        let saves = hosts.tmp.path().join(name);
        let interval = save_at.map(|s| s.to_string());
        let mut leg = args.clone();
        if let Some(interval) = &interval {
            leg.extend([
                "--save",
                saves.to_str().unwrap(),
                "--save-interval",
                interval,
            ]);
        }
        let load = load.map(|p| p.join("dcp"));
        if let Some(load) = &load {
            leg.extend(["--load", load.to_str().unwrap()]);
        }
        let run = run(ranks, &leg, &[]);
        (save_at.map(|s| saves.join(format!("iter_{s:07}"))), run)
    };
    let (at_s1, _) = leg(4, None, Some(s1), "four");
    let (at_s2, three) = leg(3, at_s1.as_deref(), Some(s2), "three");
    let (_, four) = leg(4, at_s2.as_deref(), None, "four-again");
    let losses = |log: &[serde_json::Value], from: u64, to: u64| -> Vec<(u64, String)> {
        let mut by_step: std::collections::BTreeMap<u64, String> = Default::default();
        for e in events(log, "step") {
            let step = e["step"].as_u64().unwrap();
            if step > from && step <= to {
                // The last time a step ran is the one that counts.
                by_step.insert(step, e["loss"].to_string());
            }
        }
        by_step.into_iter().collect()
    };
    // Ranks 0, 2, 3 of the job were places 0, 1, 2 of three; the joining
    // rank 1 took place 1 of four again.
    for (place, rank) in [(0, 0), (1, 2), (2, 3)] {
        assert_eq!(
            losses(&hosts.log(rank), s1, s2),
            losses(&three.logs[place], s1, s2),
            "rank {rank} (place {place} of three)"
        );
    }
    let want = final_digest(&four.logs[0], STEPS);
    for rank in 0..4 {
        assert_eq!(
            losses(&hosts.log(rank), s2, STEPS),
            losses(&four.logs[rank], s2, STEPS),
            "rank {rank} after the grow"
        );
        assert_eq!(
            final_digest(&hosts.log(rank), STEPS),
            want,
            "rank {rank}:\n{}",
            logs(&outs)
        );
    }
}
