//! Helpers shared by the scenario tests: start the real binaries, read their
//! JSON logs, and make sure no process of a test outlives it.
#![allow(dead_code)]

pub mod cluster;
pub mod dcmi;
pub mod etcd;
pub mod examples;
pub mod hosts;
pub mod launch;
pub mod ports;
pub mod python;
pub mod serve;
pub mod slurm;

pub use launch::Launch;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A project binary, built first (once per test process) in the test's
/// profile.
pub fn bin(name: &str) -> PathBuf {
    hatrain_demo::bins::locate(name).unwrap_or_else(|e| panic!("{e}"))
}

pub fn agent() -> PathBuf {
    bin("hatrain-agent")
}

pub fn trainer() -> PathBuf {
    bin("hatrain-train")
}

/// A job id unique to this test process and call, so the orphan check finds
/// exactly this test's processes.
pub fn job_id(name: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "t-{name}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// Trainer arguments for a small, quick run.
pub fn tiny_args(iters: u64) -> Vec<String> {
    [
        "--model-size",
        "tiny",
        "--global-batch",
        "16",
        "--seq-len",
        "16",
        "--log-interval",
        "1000",
        "--train-iters",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([iters.to_string()])
    .collect()
}

/// `hatrain-agent launch --nproc-per-node n --job-id job -- hatrain-train
/// <args>`, with [`Launch::new`]'s defaults.
pub fn launch_cmd(nproc: usize, job: &str, train: &[String]) -> Command {
    Launch::new(nproc).job(job).args(train).command()
}

/// `launch` of the reference trainer with worker reboot, 2 ranks, `extra`
/// flags before `--`, and [`Launch::new`]'s defaults: the environment's job
/// id and thread count are left out, so the test's own choices hold.
pub fn reboot_pair(extra: &[&str], train: &[String]) -> Command {
    Launch::new(2)
        .worker_reboot()
        .flags(extra)
        .args(train)
        .command()
}

/// Runs a launch to completion (bounded) and returns its output.
pub fn run_launch(nproc: usize, name: &str, train: &[String]) -> Output {
    let job = job_id(name);
    let mut guard = Job::spawn(launch_cmd(nproc, &job, train), &job);
    guard.wait_output(Duration::from_secs(300))
}

/// A running launcher; dropping it kills the launcher and every process that
/// carries its job id, so a failing test leaves nothing behind. Its output
/// is drained as it comes (a full pipe would block the agent).
pub struct Job {
    pub child: Option<Child>,
    pub job: String,
    drains: Vec<std::thread::JoinHandle<Vec<u8>>>,
}

fn drain(mut r: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = r.read_to_end(&mut buf);
        buf
    })
}

impl Job {
    /// Starts `cmd`; every process it starts carries `HATRAIN_TEST_TAG=job`
    /// in its environment, so the guard finds them even when the job's id
    /// is made by the agent.
    pub fn spawn(mut cmd: Command, job: &str) -> Self {
        let mut child = cmd
            .env(TAG, job)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start hatrain-agent");
        let drains = vec![
            drain(child.stdout.take().expect("piped")),
            drain(child.stderr.take().expect("piped")),
        ];
        Self {
            child: Some(child),
            job: job.to_string(),
            drains,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").id() as i32
    }

    /// Waits up to `limit` for the launcher to exit; panics (after killing
    /// everything) if it does not.
    pub fn wait_output(&mut self, limit: Duration) -> Output {
        let mut child = self.child.take().expect("not yet waited");
        let pid = child.id() as i32;
        let end = Instant::now() + limit;
        let status = loop {
            if let Some(st) = child.try_wait().expect("wait for hatrain-agent") {
                break st;
            }
            if Instant::now() > end {
                kill(pid, libc::SIGKILL);
                let _ = child.wait();
                kill_job(&self.job);
                panic!("hatrain-agent (pid {pid}) did not exit within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut drains = std::mem::take(&mut self.drains).into_iter();
        let stdout = drains
            .next()
            .map(|h| h.join().unwrap_or_default())
            .unwrap_or_default();
        let stderr = drains
            .next()
            .map(|h| h.join().unwrap_or_default())
            .unwrap_or_default();
        Output {
            status,
            stdout,
            stderr,
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        kill_job(&self.job);
    }
}

pub fn kill(pid: i32, sig: i32) {
    // SAFETY: kill(2) takes plain integers.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// The environment variable that marks a test job's processes.
pub const TAG: &str = "HATRAIN_TEST_TAG";

/// Pids of live (not zombie) processes whose environment carries
/// `HATRAIN_JOB_ID=<job>` or `HATRAIN_TEST_TAG=<job>`.
pub fn job_pids(job: &str) -> Vec<i32> {
    let needle = format!("HATRAIN_JOB_ID={job}");
    let tagged = format!("{TAG}={job}");
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(env) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        if !env
            .split(|b| *b == 0)
            .any(|kv| kv == needle.as_bytes() || kv == tagged.as_bytes())
        {
            continue;
        }
        let zombie = std::fs::read_to_string(e.path().join("stat"))
            .map(|s| {
                s.rsplit(')')
                    .next()
                    .is_some_and(|rest| rest.trim_start().starts_with('Z'))
            })
            .unwrap_or(false);
        if !zombie {
            out.push(pid);
        }
    }
    out
}

pub fn kill_job(job: &str) {
    for pid in job_pids(job) {
        kill(pid, libc::SIGKILL);
    }
}

/// Direct children of `pid`.
pub fn children(pid: i32) -> HashSet<i32> {
    let mut out = HashSet::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                out.extend(s.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
            }
        }
    }
    out
}

/// The `RANK` of a process, from its environment.
pub fn rank_of(pid: i32) -> Option<usize> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(b"RANK="))
        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
}

/// Polls `cond` every 20 ms until it holds or `limit` passes.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}

/// The JSON lines of a trainer's log. A log read while the trainer runs
/// may end in a line still being written: only complete lines (ended by a
/// newline) are read, and each must be JSON.
pub fn read_log(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    complete
        .lines()
        .map(|l| serde_json::from_str(l).expect("log line is JSON"))
        .collect()
}

/// Losses by step from a log.
pub fn losses(log: &[serde_json::Value]) -> Vec<(u64, f64)> {
    log.iter()
        .filter(|e| e["event"] == "step")
        .map(|e| (e["step"].as_u64().unwrap(), e["loss"].as_f64().unwrap()))
        .collect()
}

pub fn final_checksum(log: &[serde_json::Value]) -> String {
    log.iter()
        .rev()
        .find(|e| e["event"] == "final")
        .and_then(|e| e["param_xxh3"].as_str())
        .expect("final event")
        .to_string()
}

/// A finished process's stdout and stderr, as text.
pub fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

pub fn assert_success(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed: {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn code(status: &ExitStatus) -> Option<i32> {
    status.code()
}

pub fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

pub fn agentctl() -> PathBuf {
    bin("agentctl")
}

/// The one-letter state of a process (`R`, `S`, `T` for stopped, `Z`...).
pub fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.trim_start().chars().next()
}

/// The last logged loss of every step (a step redone after a recovery is
/// logged again; the last value is the one the run kept).
pub fn final_losses(log: &[serde_json::Value]) -> std::collections::BTreeMap<u64, f64> {
    losses(log).into_iter().collect()
}

/// Asks the agent at `socket` `agentctl --json VERB` every 50 ms until
/// `pick` finds what it wants in the reply, or `limit` passes.
pub fn poll_agentctl<T>(
    socket: &Path,
    verb: &str,
    limit: Duration,
    mut pick: impl FnMut(&serde_json::Value) -> Option<T>,
) -> Option<T> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Ok(o) = Command::new(agentctl())
            .arg("--socket")
            .arg(socket)
            .args(["--json", verb])
            .output()
            && o.status.success()
            && let Ok(v) = serde_json::from_slice::<serde_json::Value>(&o.stdout)
            && let Some(t) = pick(&v)
        {
            return Some(t);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// Processes that keep every core busy, ended by pid when dropped.
pub struct Burners(Vec<std::process::Child>);

impl Burners {
    pub fn start() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Self(
            (0..cores)
                .map(|_| {
                    std::process::Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .spawn()
                        .unwrap()
                })
                .collect(),
        )
    }
}

impl Drop for Burners {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
