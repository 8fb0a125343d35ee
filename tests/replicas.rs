//! Peer replicas between real agents: two hosts, each an agent with its own
//! shared-memory root on its own loopback address (127.0.0.1 and
//! 127.0.0.2), one rank each. Each holds the other's snapshots in its own
//! shared memory, byte-identical to the owner's; a stranger's frames sent
//! to a holder are refused and counted; training ends bit-identical to the
//! same world size on one host; nothing is left in either root.

mod common;
use common::*;
use hatrain_shared::shm::Store;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const ITERS: u64 = 40;
/// Rank 0 sleeps this long in step 25's forward pass, rank 1 waits for it
/// in a collective: both newest snapshots stand still meanwhile.
const PLAN: &str = "0:25:forward:sleep5000";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn secret_file(dir: &Path) -> PathBuf {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join("secret");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .unwrap();
    std::io::Write::write_all(&mut f, "5a".repeat(32).as_bytes()).unwrap();
    path
}

struct Host {
    addr: &'static str,
    shm: PathBuf,
}

#[allow(clippy::too_many_arguments)]
fn node(k: usize, host: &Host, job: &str, ports: (u16, u16), secret: &Path, log: &Path) -> Command {
    let mut c = Command::new(agent());
    c.args(["launch", "--nnodes", "2", "--nproc-per-node", "1"])
        .args(["--node-rank", &k.to_string(), "--job-id", job])
        .args(["--master-addr", "127.0.0.1"])
        .args(["--master-port", &ports.0.to_string()])
        .args(["--rdzv-port", &ports.1.to_string()])
        .args(["--local-addr", host.addr])
        .args(["--threads-per-worker", "1", "--stop-grace-secs", "3"])
        .arg("--enable-high-availability")
        .arg("--secret-file")
        .arg(secret)
        .arg("--shm-root")
        .arg(&host.shm)
        .arg("--")
        .arg(trainer())
        .args(tiny_args(ITERS))
        .arg("--log-jsonl")
        .arg(log)
        .env("HATRAIN_FAULT_PLAN", PLAN)
        .env_remove("SLURM_JOB_ID")
        .env("RUST_LOG", "info");
    c
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
    let ports = (free_port(), free_port());
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
                .then(|| r.clone())
        });
        let r = lagless.unwrap_or_else(|| panic!("rank {rank}'s stream to host {holder} lags"));
        // A slot may be rewritten between the look and the read once
        // training goes on: then look again.
        let (step, same) = (0..50)
            .find_map(|_| {
                compare(
                    &shm(owner, format!("rank_{rank:05}.shm")),
                    &shm(holder, format!("replica_{rank:05}.shm")),
                )
                .or_else(|| {
                    std::thread::sleep(Duration::from_millis(20));
                    None
                })
            })
            .unwrap_or_else(|| panic!("no step of rank {rank} held by both hosts: {r}"));
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
        let left: Vec<_> = std::fs::read_dir(&h.shm)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(
            left.is_empty(),
            "left behind in {}: {left:?}",
            h.shm.display()
        );
    }
}
