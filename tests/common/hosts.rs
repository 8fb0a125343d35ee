//! Agents of a job of several hosts on one machine: each host is an agent
//! with its own shared-memory root on its own loopback address
//! (127.0.0.x).

use super::*;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::ports::free_ports;

/// A job secret (mode 0600) in `dir`.
pub fn secret_file(dir: &Path) -> PathBuf {
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

/// Nothing of the job is left in the shm root `root`.
pub fn assert_nothing_left(root: &Path) {
    let left: Vec<_> = std::fs::read_dir(root)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(
        left.is_empty(),
        "left behind in {}: {left:?}",
        root.display()
    );
}

/// Trainer arguments for 60 steps of a global batch six ranks share, and
/// the log of that run on one host with six ranks.
pub fn six_ranks_reference(dir: &Path) -> (Vec<String>, Vec<serde_json::Value>) {
    let mut train = tiny_args(60);
    let at = train.iter().position(|a| a == "--global-batch").unwrap();
    train[at + 1] = "24".into();
    let log = dir.join("ref.jsonl");
    let mut args = train.clone();
    args.extend(["--log-jsonl".into(), log.display().to_string()]);
    assert_success(&run_launch(6, "six-ref", &args), "one host, six ranks");
    (train, read_log(&log))
}

/// A host's agent as a job of the test's.
pub fn host_job(cmd: Command, job: &str, k: usize) -> Job {
    Job::spawn(cmd, &format!("{job}-h{k}"))
}

/// Agent `k` of `nodes`, `per_node` ranks each, with worker reboot, and
/// `extra` flags, on 127.0.0.(k+1).
#[allow(clippy::too_many_arguments)]
pub fn reboot_node(
    k: usize,
    nodes: usize,
    per_node: usize,
    shm: &Path,
    job: &str,
    ports: (u16, u16),
    secret: &Path,
    train: &[String],
    extra: &[&str],
) -> Command {
    let at = Place {
        netns: None,
        master: "127.0.0.1".into(),
        local: format!("127.0.0.{}", k + 1),
    };
    reboot_node_at(
        &at, k, nodes, per_node, shm, job, ports, secret, train, extra,
    )
}

/// Where an agent runs: in a network namespace (or not), its master's
/// address and its own.
pub struct Place {
    pub netns: Option<String>,
    pub master: String,
    pub local: String,
}

/// [`reboot_node`] at `at`.
#[allow(clippy::too_many_arguments)]
pub fn reboot_node_at(
    at: &Place,
    k: usize,
    nodes: usize,
    per_node: usize,
    shm: &Path,
    job: &str,
    ports: (u16, u16),
    secret: &Path,
    train: &[String],
    extra: &[&str],
) -> Command {
    let launch = Launch::new(per_node)
        .job(job)
        .worker_reboot()
        .shm_root(shm)
        .option("--nnodes", nodes.to_string())
        .option("--node-rank", k.to_string())
        .option("--master-addr", &at.master)
        .option("--master-port", ports.0.to_string())
        .option("--rdzv-port", ports.1.to_string())
        .option("--local-addr", &at.local)
        .option("--secret-file", secret)
        .flags(extra)
        .args(train)
        .env_remove("SLURM_JOB_ID");
    match &at.netns {
        Some(ns) => launch.netns(ns).command(),
        None => launch.command(),
    }
}

/// What the hosts of one test job share: the secret, each host's shm
/// root, the job id, the ports, the log, and the trainer's arguments
/// writing that log.
pub struct JobParts {
    pub secret: PathBuf,
    pub shm: Vec<PathBuf>,
    pub job: String,
    pub ports: (u16, u16),
    pub log: PathBuf,
    pub args: Vec<String>,
}

/// [`JobParts`] of job `name` of `hosts` agents in `dir`, training with
/// `train`.
pub fn job_parts(dir: &Path, name: &str, hosts: usize, train: &[String]) -> JobParts {
    let log = dir.join("run.jsonl");
    let mut args = train.to_vec();
    args.extend(["--log-jsonl".into(), log.display().to_string()]);
    JobParts {
        secret: secret_file(dir),
        shm: (0..hosts).map(|k| dir.join(format!("host{k}"))).collect(),
        job: job_id(name),
        ports: free_ports::<2>().into(),
        log,
        args,
    }
}
