//! Only the job's own processes may speak to it. Another user of the host
//! (`nobody`, through `runuser`) floods the rendezvous store with requests,
//! and opens thousands of idle connections to it, while the job recovers
//! from a killed rank: every request is refused and counted, the store's
//! threads and memory stay bounded, the idle connections are closed, and
//! the run ends bit-identical to the run without them.

mod common;
use common::*;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const ITERS: u64 = 400;

fn launch(job: &str, shm: &Path, log: &Path, plan: &str) -> Command {
    Launch::new(4)
        .job(job)
        .worker_reboot()
        .option("--pause-timeout-secs", "30")
        .shm_root(shm)
        .args(tiny_args(ITERS))
        .arg("--log-jsonl")
        .arg(log)
        .fault_plan(plan)
        .command()
}

fn reference(dir: &Path) -> String {
    let log = dir.join("ref.jsonl");
    let mut args = tiny_args(ITERS);
    args.extend(["--log-jsonl".into(), log.display().to_string()]);
    assert_success(&run_launch(4, "trust-ref", &args), "reference run");
    final_checksum(&read_log(&log))
}

fn status(socket: &Path) -> Option<serde_json::Value> {
    let out = Command::new(agentctl())
        .arg("--socket")
        .arg(socket)
        .args(["--json", "status"])
        .output()
        .ok()?;
    out.status.success().then_some(())?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    Some(v["status"].clone())
}

/// Runs the probe as `nobody`, with room for many descriptors.
fn as_nobody(args: &[String]) -> std::thread::JoinHandle<Output> {
    let probe = bin("hatrain-storeprobe");
    let line = format!(
        "ulimit -n 8192; exec {} {}",
        probe.display(),
        args.join(" ")
    );
    std::thread::spawn(move || {
        Command::new("runuser")
            .args(["-u", "nobody", "--", "sh", "-c", &line])
            .output()
            .expect("runuser")
    })
}

fn field(out: &str, name: &str) -> u64 {
    out.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {out:?}"))
}

/// `(threads, resident KiB)` of a process.
fn threads_and_rss(pid: i32) -> (u64, u64) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let get = |k: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (get("Threads:"), get("VmRSS:"))
}

fn store_addr(socket: &Path) -> String {
    let mut addr = None;
    assert!(
        wait_until(Duration::from_secs(60), || {
            addr = status(socket).and_then(|s| s["store_addr"].as_str().map(String::from));
            addr.is_some()
        }),
        "the agent did not say where its store listens"
    );
    addr.unwrap()
}

#[test]
fn another_users_requests_during_a_recovery_are_refused_counted_and_change_nothing() {
    let d = tempfile::tempdir().unwrap();
    let want = reference(d.path());
    let (shm, log) = (d.path().join("shm"), d.path().join("run.jsonl"));
    let job = job_id("flood");
    // Rank 0 is slow for a while, so the run lasts; rank 1 dies meanwhile.
    let plan = "0:40:forward:sleep1500;1:60:forward:kill";
    let mut guard = Job::spawn(launch(&job, &shm, &log, plan), &job);
    let socket = shm.join(&job).join("agent.sock");
    let addr = store_addr(&socket);
    let flood = as_nobody(&["flood".into(), addr, "5".into()]);
    let mut refused = 0;
    let end = Instant::now() + Duration::from_secs(60);
    while guard.child.as_mut().unwrap().try_wait().unwrap().is_none() && Instant::now() < end {
        if let Some(s) = status(&socket) {
            refused = refused.max(s["store"]["refused"].as_u64().unwrap_or(0));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = guard.wait_output(Duration::from_secs(120));
    assert_success(&out, "the run under a flood");
    let probe = flood.join().unwrap();
    let said = String::from_utf8_lossy(&probe.stdout);
    assert!(
        probe.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&probe.stderr)
    );
    eprintln!("probe {said}; the agent counted {refused} refusals");
    assert_eq!(field(&said, "accepted"), 0, "nothing was answered: {said}");
    assert!(field(&said, "refused") > 10, "{said}");
    assert!(refused > 0, "the agent counted the refusals");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr
            .matches("recovered: first step after the fault completed")
            .count(),
        1,
        "{stderr}"
    );
    assert_eq!(
        final_checksum(&read_log(&log)),
        want,
        "final parameters differ"
    );
    assert!(job_pids(&job).is_empty());
}

#[test]
fn thousands_of_idle_connections_from_another_user_are_bounded_and_closed() {
    let d = tempfile::tempdir().unwrap();
    let want = reference(d.path());
    let (shm, log) = (d.path().join("shm"), d.path().join("run.jsonl"));
    let job = job_id("idle");
    let plan = "0:40:forward:sleep2500;1:60:forward:kill";
    let mut guard = Job::spawn(launch(&job, &shm, &log, plan), &job);
    let agent = guard.pid();
    let socket = shm.join(&job).join("agent.sock");
    let addr = store_addr(&socket);
    let (threads0, rss0) = threads_and_rss(agent);
    let idle = as_nobody(&["idle".into(), addr, "3000".into(), "8".into()]);
    let (mut threads, mut rss) = (threads0, rss0);
    let mut last = serde_json::Value::Null;
    let end = Instant::now() + Duration::from_secs(60);
    while guard.child.as_mut().unwrap().try_wait().unwrap().is_none() && Instant::now() < end {
        let (t, r) = threads_and_rss(agent);
        threads = threads.max(t);
        rss = rss.max(r);
        if let Some(s) = status(&socket) {
            last = s;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = guard.wait_output(Duration::from_secs(120));
    assert_success(&out, "the run under idle connections");
    let probe = idle.join().unwrap();
    let said = String::from_utf8_lossy(&probe.stdout);
    assert!(
        probe.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&probe.stderr)
    );
    eprintln!(
        "agent threads {threads0} -> {threads}, resident {rss0} -> {rss} KiB; probe {said}; store {}",
        last["store"]
    );
    let opened = field(&said, "opened");
    assert!(opened >= 1000, "{said}");
    assert_eq!(
        field(&said, "closed"),
        opened,
        "every idle connection was closed: {said}"
    );
    assert!(
        threads <= threads0 + 4,
        "the agent's threads went from {threads0} to {threads}"
    );
    assert!(
        rss <= rss0 + 64 * 1024,
        "the agent's memory went from {rss0} KiB to {rss} KiB"
    );
    let st = &last["store"];
    assert!(
        st["over_limit"].as_u64().unwrap_or(0) + st["timed_out"].as_u64().unwrap_or(0) > 0,
        "{st}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr
            .matches("recovered: first step after the fault completed")
            .count(),
        1,
        "the ranks met again during the recovery: {stderr}"
    );
    assert_eq!(
        final_checksum(&read_log(&log)),
        want,
        "final parameters differ"
    );
    assert!(job_pids(&job).is_empty());
}
