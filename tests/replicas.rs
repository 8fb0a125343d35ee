//! Agents of several hosts, each with its own shared-memory root on its own
//! loopback address (127.0.0.x), one rank each.
//!
//! - Two hosts: each holds the other's snapshots in its own shared memory,
//!   byte-identical to the owner's; a stranger's frames sent to a holder
//!   are refused and counted; training ends bit-identical to the same
//!   world size on one host; nothing is left in either root.
//! - Three hosts: they agree on one controller; when one host vanishes
//!   (agent and worker SIGKILLed, shared memory deleted), the others hear
//!   it go and stop, naming the lost host's ranks and the replica of them
//!   that survives; nothing is left in their roots.

mod common;
use common::hosts::*;
use common::ports::free_ports;
use common::*;
use hatrain_shared::shm::Store;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const ITERS: u64 = 40;
/// Rank 0 sleeps this long in step 25's forward pass, rank 1 waits for it
/// in a collective: both newest snapshots stand still meanwhile.
const PLAN: &str = "0:25:forward:sleep5000";

struct Host {
    addr: &'static str,
    shm: PathBuf,
}

#[allow(clippy::too_many_arguments)]
fn node(k: usize, host: &Host, job: &str, ports: (u16, u16), secret: &Path, log: &Path) -> Command {
    Launch::new(1)
        .job(job)
        .high_availability()
        .shm_root(&host.shm)
        .option("--nnodes", "2")
        .option("--node-rank", k.to_string())
        .option("--master-addr", "127.0.0.1")
        .option("--master-port", ports.0.to_string())
        .option("--rdzv-port", ports.1.to_string())
        .option("--local-addr", host.addr)
        .option("--secret-file", secret)
        .args(tiny_args(ITERS))
        .arg("--log-jsonl")
        .arg(log)
        .fault_plan(PLAN)
        .env_remove("SLURM_JOB_ID")
        .command()
}

/// The newest step that `a` and `b` both hold sealed and verified, and
/// whether their bytes are equal.
fn compare(a: &Path, b: &Path) -> Option<(u64, bool)> {
    let (a, b) = (Store::open(a).ok()?, Store::open(b).ok()?);
    let (steps_a, _) = a.verified_steps();
    let (steps_b, _) = b.verified_steps();
    let step = steps_a.into_iter().find(|s| steps_b.contains(s))?;
    let (ia, ib) = (a.find_step(step)?, b.find_step(step)?);
    let mut ba = vec![0u8; ia.len as usize];
    let mut bb = vec![0u8; ib.len as usize];
    a.read_slot(ia.slot, &mut [&mut ba]).ok()?;
    b.read_slot(ib.slot, &mut [&mut bb]).ok()?;
    Some((step, ba == bb && ia.checksum == ib.checksum))
}

/// Frames from a process that does not hold the job's secret: garbage, and
/// a well-formed hello under another key.
fn stranger(endpoint: &str) {
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::DEALER).unwrap();
    s.set_linger(0).unwrap();
    s.connect(endpoint).unwrap();
    s.send(&b"not a frame at all"[..], 0).unwrap();
    let (_, hello) = hatrain_shared::peer::Pending::hello(
        hatrain_shared::auth::Secret::from_bytes([1; 32]),
        0,
        [9; 16],
    );
    s.send(hello, 0).unwrap();
    // Nothing comes back to a stranger.
    assert_eq!(s.poll(zmq::POLLIN, 500).unwrap(), 0);
}

#[test]
fn two_hosts_hold_each_others_snapshots_identically_and_refuse_a_strangers_frames() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = {
        let log = tmp.path().join("ref.jsonl");
        let mut args = tiny_args(ITERS);
        args.extend(["--log-jsonl".into(), log.display().to_string()]);
        assert_success(&run_launch(2, "replicas-ref", &args), "one host, two ranks");
        read_log(&log)
    };
    let secret = secret_file(tmp.path());
    let hosts = [
        Host {
            addr: "127.0.0.1",
            shm: tmp.path().join("host0"),
        },
        Host {
            addr: "127.0.0.2",
            shm: tmp.path().join("host1"),
        },
    ];
    let job = job_id("replicas");
    let ports: (u16, u16) = free_ports::<2>().into();
    let log = tmp.path().join("run.jsonl");
    let mut agents: Vec<Job> = (0..2)
        .map(|k| Job::spawn(node(k, &hosts[k], &job, ports, &secret, &log), &job))
        .collect();
    let socket = |k: usize| hosts[k].shm.join(&job).join("agent.sock");
    let shm = |k: usize, file: String| hosts[k].shm.join(&job).join(file);

    // Each host holds the other's rank, streamed while training runs.
    for (k, other) in [(0usize, 1u64), (1, 0)] {
        let held = poll_agentctl(&socket(k), "status", Duration::from_secs(120), |v| {
            let h = v["status"]["replicas"]["held"].as_array()?;
            h.iter()
                .find(|h| {
                    h["rank"] == other && h["steps"].as_array().is_some_and(|s| !s.is_empty())
                })
                .cloned()
        });
        let held = held.unwrap_or_else(|| panic!("host {k} holds no replica of rank {other}"));
        assert_eq!(held["from_node"], other, "{held}");
    }
    // While rank 0 sleeps the snapshots stand still: each replica is the
    // owner's newest snapshot, byte for byte, and the streams report no lag.
    for (owner, holder) in [(0usize, 1usize), (1, 0)] {
        let rank = owner;
        let lagless = poll_agentctl(&socket(owner), "status", Duration::from_secs(60), |v| {
            let s = &v["status"]["replicas"]["streams"][0];
            let r = &s["ranks"][0];
            (s["node"] == holder
                && s["connected"] == true
                && r["local_step"].as_u64()? >= 20
                && r["lag_steps"] == 0
                && r["lag_bytes"] == 0)
                .then(|| (r.clone(), v["status"]["replicas"].clone()))
        });
        let (r, replicas) =
            lagless.unwrap_or_else(|| panic!("rank {rank}'s stream to host {holder} lags"));
        // What each side's replica thread has cost is counted with its
        // bytes: the sender's stream and, having held the other host's
        // rank, the receiver.
        let s = &replicas["streams"][0];
        assert!(
            s["bytes_sent"].as_u64().is_some_and(|b| b > 0)
                && s["cpu_s"].as_f64().is_some_and(|c| c > 0.0)
                && replicas["received_bytes"].as_u64().is_some_and(|b| b > 0)
                && replicas["receive_cpu_s"].as_f64().is_some_and(|c| c > 0.0),
            "host {owner}'s replica threads' CPU time and bytes: {replicas}"
        );
        // A slot may be rewritten between the look and the read once
        // training goes on, and both keep an older step for the replicas
        // (the hold): while the newest common step is that one, look again.
        let (step, same) = (0..50)
            .find_map(|_| {
                compare(
                    &shm(owner, format!("rank_{rank:05}.shm")),
                    &shm(holder, format!("replica_{rank:05}.shm")),
                )
                .filter(|&(step, same)| !same || step >= 20)
                .or_else(|| {
                    std::thread::sleep(Duration::from_millis(20));
                    None
                })
            })
            .unwrap_or_else(|| panic!("no step from 20 on of rank {rank} held by both hosts: {r}"));
        assert!(
            same,
            "rank {rank}: step {step} differs between owner and replica"
        );
        assert!(
            step >= 20,
            "rank {rank}: the newest common step is {step}: {r}"
        );
    }
    // A stranger's frames: refused, counted, and no answer.
    let endpoint = poll_agentctl(&socket(1), "status", Duration::from_secs(10), |v| {
        v["status"]["replicas"]["listen"].as_str().map(String::from)
    })
    .expect("the holder's endpoint");
    assert!(endpoint.starts_with("tcp://127.0.0.2:"), "{endpoint}");
    stranger(&endpoint);
    let counted = poll_agentctl(&socket(1), "status", Duration::from_secs(10), |v| {
        let r = &v["status"]["replicas"];
        (r["rejected_malformed"].as_u64()? >= 1 && r["rejected_forged"].as_u64()? >= 1)
            .then_some(())
    });
    assert!(counted.is_some(), "the stranger's frames were not counted");

    for (k, a) in agents.iter_mut().enumerate() {
        let out = a.wait_output(Duration::from_secs(300));
        assert_success(&out, &format!("host {k}"));
    }
    let run = read_log(&log);
    assert_eq!(losses(&run), losses(&reference), "every step's loss");
    assert_eq!(final_checksum(&run), final_checksum(&reference));
    for h in &hosts {
        assert_nothing_left(&h.shm);
    }
}

/// `node` with its own test tag, so that one host's processes can be killed
/// alone.
/// Three hosts of one rank each; the third vanishes (its agent and worker
/// SIGKILLed, its shared memory deleted) while the job runs. The others
/// hear it go, stop, and say which host and ranks were lost and what of
/// their state this host still holds; nothing claims to recover them.
#[test]
fn a_lost_host_is_named_with_the_replica_that_survives_it() {
    let tmp = tempfile::tempdir().unwrap();
    let secret = secret_file(tmp.path());
    let addrs = ["127.0.0.1", "127.0.0.2", "127.0.0.3"];
    let shm: Vec<PathBuf> = (0..3)
        .map(|k| tmp.path().join(format!("host{k}")))
        .collect();
    let job = job_id("hostloss");
    let ports: (u16, u16) = free_ports::<2>().into();
    let log = tmp.path().join("run.jsonl");
    // A global batch that three ranks share.
    let mut train = tiny_args(200);
    let at = train.iter().position(|a| a == "--global-batch").unwrap();
    train[at + 1] = "24".into();
    let mut agents: Vec<Job> = (0..3)
        .map(|k| {
            let c = Launch::new(1)
                .job(&job)
                .high_availability()
                .shm_root(&shm[k])
                .option("--nnodes", "3")
                .option("--node-rank", k.to_string())
                .option("--master-addr", "127.0.0.1")
                .option("--master-port", ports.0.to_string())
                .option("--rdzv-port", ports.1.to_string())
                .option("--local-addr", addrs[k])
                .option("--secret-file", &secret)
                .args(&train)
                .arg("--log-jsonl")
                .arg(&log)
                // Rank 0 naps at step 30: the job stands still meanwhile.
                .fault_plan("0:30:forward:sleep60000")
                .env_remove("SLURM_JOB_ID")
                .command();
            host_job(c, &job, k)
        })
        .collect();
    let socket = |k: usize| shm[k].join(&job).join("agent.sock");
    // Node 0 hears everyone and holds rank 2's replica ((2 + 1) mod 3).
    let ready = poll_agentctl(&socket(0), "status", Duration::from_secs(120), |v| {
        let s = &v["status"];
        let held = s["replicas"]["held"].as_array()?;
        (s["membership"]["live"] == serde_json::json!([0, 1, 2])
            && held
                .iter()
                .any(|h| h["rank"] == 2 && h["steps"].as_array().is_some_and(|st| !st.is_empty())))
        .then_some(())
    });
    assert!(
        ready.is_some(),
        "node 0 never heard all three hosts with rank 2's replica"
    );
    // All three follow one controller, and only it acts (after start-up,
    // an agent may still be waiting out a lease).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let (agreed, last) = loop {
        let last = (0..3)
            .map(|k| {
                poll_agentctl(&socket(k), "status", Duration::from_secs(10), |v| {
                    Some(v["status"]["membership"].clone())
                })
                .unwrap_or_default()
            })
            .collect::<Vec<serde_json::Value>>();
        let leader = last[0]["follows"].as_u64();
        let one = leader.is_some_and(|l| {
            last.iter().all(|x| x["follows"] == l)
                && last.iter().filter(|x| x["acting"] == true).count() == 1
                && last[l as usize]["acting"] == true
        });
        if one || std::time::Instant::now() > deadline {
            break (one, last);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        agreed,
        "the three hosts do not agree on one controller: {last:?}"
    );

    // Host 2 vanishes.
    kill_job(&format!("{job}-h2"));
    let _ = agents[2].wait_output(Duration::from_secs(30));
    std::fs::remove_dir_all(&shm[2]).unwrap();

    let out0 = agents[0].wait_output(Duration::from_secs(60));
    let err0 = String::from_utf8_lossy(&out0.stderr);
    assert_eq!(
        code(&out0.status),
        Some(3),
        "node 0 stops: recovery failed\n{err0}"
    );
    assert!(
        err0.contains("a host of the job was lost: ranks [2]")
            && err0.contains("this host holds the replica of rank 2 up to step"),
        "node 0 names the lost host and the replica it holds:\n{err0}"
    );
    let out1 = agents[1].wait_output(Duration::from_secs(60));
    let err1 = String::from_utf8_lossy(&out1.stderr);
    assert!(!out1.status.success(), "node 1 cannot go on\n{err1}");
    assert!(
        err1.contains("a host of the job was lost: ranks [2]"),
        "node 1 names the lost host:\n{err1}"
    );
    for root in &shm[..2] {
        assert_nothing_left(root);
    }
}

/// Three hosts of two ranks each, one recovery machine on node 0's agent:
/// a worker SIGKILLed on a host that is not the controller's, a worker
/// hung on another (the watchdog sees it through that host's reports), and
/// a worker SIGKILLed on the controller's host are each rebooted in place
/// on their own host, every rank of the job pausing and resuming together;
/// every step's loss and the final checksum equal one host with six ranks.
#[test]
fn workers_are_rebooted_in_place_on_any_host_by_one_controller() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, reference) = six_ranks_reference(tmp.path());
    let JobParts {
        secret,
        shm,
        job,
        ports,
        log,
        args,
    } = job_parts(tmp.path(), "reboot", 3, &train);
    let mut agents: Vec<Job> = (0..3)
        .map(|k| {
            let extra = ["--hang-timeout-secs", "3"];
            let mut c = reboot_node(k, 3, 2, &shm[k], &job, ports, &secret, &args, &extra);
            // Rank 3 (host 1) dies at step 15, rank 4 (host 2) hangs at
            // step 30, rank 0 (host 0, the controller's) dies at step 45.
            c.env(
                "HATRAIN_FAULT_PLAN",
                "3:15:forward:kill;4:30:forward:hang;0:45:forward:kill",
            );
            host_job(c, &job, k)
        })
        .collect();
    let outs: Vec<_> = agents
        .iter_mut()
        .map(|a| a.wait_output(Duration::from_secs(300)))
        .collect();
    for (k, out) in outs.iter().enumerate() {
        assert_success(out, &format!("host {k}"));
    }
    let err = |k: usize| String::from_utf8_lossy(&outs[k].stderr).into_owned();
    let controller = err(0);
    for (rank, host) in [(3usize, 1usize), (4, 2), (0, 0)] {
        assert!(
            controller.contains(&format!("ranks=[{rank}] s_star=")),
            "the controller recovered rank {rank}:\n{controller}"
        );
        assert!(
            err(host).contains(&format!("replacement started rank={rank}")),
            "rank {rank} was restarted on its own host {host}:\n{}",
            err(host)
        );
    }
    assert!(
        controller.contains("rank hung: killing it") && controller.contains("rank=4"),
        "the controller's watchdog saw rank 4 hang on host 2:\n{controller}"
    );
    for k in 1..3 {
        assert!(
            err(k).contains("the controller ended the job"),
            "host {k} ended with the controller:\n{}",
            err(k)
        );
    }
    // A step done again after a recovery is logged again: the last value
    // of every step is the run's.
    let run = read_log(&log);
    assert_eq!(
        final_losses(&run),
        final_losses(&reference),
        "every step's loss"
    );
    assert_eq!(final_checksum(&run), final_checksum(&reference));
    for root in &shm {
        assert_nothing_left(root);
    }
}
