//! A job of several hosts of one rank each, for the host-loss benchmarks:
//! their agents, a host vanishing, and the timings read from the log.

use super::{now, steps, worker_pids};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// A job secret (64 hex digits `byte` repeated, mode 0600) in `dir`, made
/// once.
pub fn secret_file(dir: &Path, byte: &str) -> PathBuf {
    use std::os::unix::fs::OpenOptionsExt;
    let secret = dir.join("secret");
    if !secret.exists() {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&secret)
            .unwrap();
        std::io::Write::write_all(&mut f, byte.repeat(32).as_bytes()).unwrap();
    }
    secret
}

/// The agents of a job of `nnodes` hosts of one rank (and `standbys`
/// spare agents), each on its own loopback address and shm root.
pub struct Launch<'a> {
    pub dir: &'a Path,
    pub job: String,
    pub ports: (u16, u16),
    pub secret: &'a Path,
    pub ha: bool,
    pub nnodes: usize,
    pub standbys: usize,
    /// `--snapshot-slots` with high availability.
    pub slots: usize,
    /// More agent flags.
    pub extra: &'a [&'a str],
    pub train: &'a [String],
}

impl Launch<'_> {
    pub fn shm(&self, node: usize) -> PathBuf {
        self.dir.join(format!("{}-host{node}", self.job))
    }

    /// Where agent `node` logs.
    pub fn log(&self, node: usize) -> PathBuf {
        self.dir.join(format!("{}-agent{node}.log", self.job))
    }

    /// The last `n` lines of agent `node`'s log.
    pub fn tail(&self, node: usize, n: usize) -> String {
        let log = std::fs::read_to_string(self.log(node)).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(n).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        tail.join("\n")
    }

    /// Waits for agent `node`; a failure shows the end of its log.
    pub fn expect_success(&self, node: usize, agent: &mut Child) {
        if !agent.wait().unwrap().success() {
            panic!(
                "agent {node} of {} failed:\n{}",
                self.job,
                self.tail(node, 20)
            );
        }
    }

    /// Waits (up to `limit`) for a step event of `log` satisfying `f`
    /// while the agents `nodes` of `agents` run. When one of them exits
    /// first (a job that stopped), or the time is up, it fails at once with
    /// the end of every agent's log (the others are sent SIGTERM).
    pub fn wait_step(
        &self,
        agents: &mut [Child],
        nodes: &[usize],
        log: &Path,
        limit: Duration,
        what: &str,
        f: impl Fn(&Value) -> bool,
    ) -> Value {
        let end = Instant::now() + limit;
        let why = loop {
            if let Some(e) = steps(log).into_iter().find(|e| f(e)) {
                return e;
            }
            let exited = nodes.iter().find_map(|&n| {
                let s = agents[n].try_wait().ok().flatten()?;
                Some(format!("agent {n} exited ({s}) first"))
            });
            if let Some(why) = exited {
                break why;
            }
            if Instant::now() >= end {
                break format!("none within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let mut logs = String::new();
        for &n in nodes {
            if matches!(agents[n].try_wait(), Ok(None)) {
                // SAFETY: kill(2) with plain integers.
                unsafe { libc::kill(agents[n].id() as i32, libc::SIGTERM) };
            }
            logs.push_str(&format!("--- agent {n}:\n{}\n", self.tail(n, 30)));
        }
        panic!(
            "{what} of {}: {why}; the agents' logs end:\n{logs}",
            self.job
        );
    }

    pub fn start(&self, node: usize) -> Child {
        let mut launch = super::launch::Launch::bare(1)
            .job(&self.job)
            .stop_grace_secs(2)
            .shm_root(self.shm(node))
            .option("--nnodes", self.nnodes.to_string())
            .option("--node-rank", node.to_string())
            .option("--master-addr", "127.0.0.1")
            .option("--master-port", self.ports.0.to_string())
            .option("--rdzv-port", self.ports.1.to_string())
            .option("--local-addr", format!("127.0.0.{}", node + 1))
            .option("--secret-file", self.secret);
        if self.ha {
            launch = launch
                .worker_reboot()
                .option("--standby-nodes", self.standbys.to_string())
                .option("--snapshot-slots", self.slots.to_string())
                .option("--pause-timeout-secs", "20");
            if node >= self.nnodes {
                launch = launch.flags(["--standby"]);
            }
            launch = launch.flags(self.extra);
        }
        launch
            .args(self.train)
            .env("RUST_LOG", "warn")
            .env_remove("SLURM_JOB_ID")
            .command()
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.log(node)).expect("an agent log"))
            .spawn()
            .expect("start hatrain-agent")
    }
}

/// Host 1 vanishes: its agent and worker SIGKILLed, its shm deleted.
/// Returns when it was killed.
pub fn vanish(agent: &mut Child, shm: &Path) -> f64 {
    let pids = worker_pids(agent.id());
    let t = now();
    // SAFETY: kill(2) with plain integers.
    unsafe { libc::kill(agent.id() as i32, libc::SIGKILL) };
    for (_, pid) in pids {
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let _ = agent.wait();
    let _ = std::fs::remove_dir_all(shm);
    t
}

/// Seconds from `t_kill` to the first step after it and to step `k` again,
/// and the steps redone.
pub fn timings(log: &Path, t_kill: f64, k: u64) -> (f64, f64, usize) {
    let s = steps(log);
    let after = |e: &&serde_json::Value| e["unix_s"].as_f64() > Some(t_kill);
    let first = s
        .iter()
        .filter(after)
        .filter_map(|e| e["unix_s"].as_f64())
        .next();
    let back = s
        .iter()
        .filter(after)
        .find(|e| e["step"].as_u64() >= Some(k))
        .and_then(|e| e["unix_s"].as_f64());
    let redone = s
        .iter()
        .filter(after)
        .filter(|e| e["step"].as_u64() < Some(k))
        .count();
    (
        first.expect("a step after the loss") - t_kill,
        back.expect("step K again") - t_kill,
        redone,
    )
}
