//! The service form: `hatrain-agent serve` adopts jobs that the real
//! `mpirun` starts through `hatrain-agent exec`, repairs them without
//! mpirun noticing, and speaks systemd's notify protocol.

mod common;
use common::ports::free_port;
use common::serve::{Serve, assert_no_job_state, mpirun, promtool_check, scrape};
use common::*;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

const HA: [&str; 2] = ["--enable-high-availability", "--enable-worker-reboot"];

fn train(log: &Path) -> Vec<String> {
    let mut a = tiny_args(40);
    a.extend(["--log-jsonl".into(), log.display().to_string()]);
    a
}

/// The parent pid of a process.
fn ppid(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')')
        .next()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Stops the serving agent with SIGTERM and checks that it leaves nothing:
/// no process, no socket, no job folder.
fn stop_clean(mut serve: Serve) {
    kill(serve.job.pid(), libc::SIGTERM);
    let out = serve.job.wait_output(Duration::from_secs(60));
    assert_success(&out, "the serving agent's stop");
    assert!(!serve.socket.exists(), "the socket is removed");
    let left: Vec<_> = std::fs::read_dir(&serve.shm)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "shared memory left behind: {left:?}");
    assert!(job_pids(&serve.job.job).is_empty());
}

#[test]
fn an_mpirun_job_is_repaired_without_mpirun_noticing() {
    let d = tempfile::tempdir().unwrap();
    let port = free_port();
    let serve = Serve::start_with(d.path(), &[], &["--metrics-addr", &port.to_string()]);
    let (ref_log, log) = (d.path().join("ref.jsonl"), d.path().join("faulty.jsonl"));

    let job = job_id("mpi-ref");
    let cmd = mpirun(4, &serve.socket, &job, &HA, &train(&ref_log), &[]);
    let out = Job::spawn(cmd, &job).wait_output(Duration::from_secs(180));
    assert_success(&out, "the fault-free mpirun job");

    // Rank 2 stops inside its optimizer update at step 12, rank 1 in its
    // forward pass at step 30; the test kills each worker with SIGKILL.
    let job = job_id("mpi-kill");
    let plan = [("HATRAIN_FAULT_PLAN", "2:12:update:stop;1:30:forward:stop")];
    let cmd = mpirun(4, &serve.socket, &job, &HA, &train(&log), &plan);
    let mut run = Job::spawn(cmd, &job);
    let mpirun_pid = run.pid();
    let stopped = |rank| {
        job_pids(&job)
            .into_iter()
            .find(|&p| proc_state(p) == Some('T') && rank_of(p) == Some(rank))
    };
    assert!(
        wait_until(Duration::from_secs(120), || stopped(2).is_some()),
        "rank 2 never reached its fault"
    );
    let victim = stopped(2).unwrap();
    let shim = ppid(victim).unwrap();
    let shims = children(mpirun_pid);
    assert_eq!(shims.len(), 4, "mpirun started 4 exec shims");
    assert!(shims.contains(&shim), "the worker is its exec shim's child");
    kill(victim, libc::SIGKILL);
    // While rank 1 is stopped the job waits: look at it then.
    assert!(
        wait_until(Duration::from_secs(120), || stopped(1).is_some()),
        "rank 1 never reached its fault (was rank 2 repaired?)"
    );
    let socket = serve.shm.join(&job).join("agent.sock");
    let repaired = poll_agentctl(&socket, "faults", Duration::from_secs(30), |v| {
        let faults = v["faults"].as_array()?;
        faults
            .iter()
            .find(|f| f["recovery_s"].is_number())
            .map(|f| f["ranks"].clone())
    });
    assert_eq!(
        repaired,
        Some(serde_json::json!([2])),
        "rank 2 was repaired"
    );
    assert_eq!(
        children(mpirun_pid),
        shims,
        "mpirun's shims are the same processes"
    );
    let reborn: Vec<i32> = job_pids(&job)
        .into_iter()
        .filter(|&p| rank_of(p) == Some(2) && ppid(p) == Some(shim))
        .collect();
    assert!(
        reborn.len() == 1 && reborn[0] != victim,
        "rank 2's new worker runs under the same shim: {reborn:?}"
    );
    // agentctl lists it among the host agent's jobs.
    let out = std::process::Command::new(agentctl())
        .arg("--host-socket")
        .arg(&serve.socket)
        .arg("--shm-root")
        .arg(&serve.shm)
        .args(["--json", "jobs"])
        .output()
        .unwrap();
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let listed = list
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["job"] == job.as_str());
    assert!(
        listed.is_some_and(|j| j["served"] == true
            && j["running"] == true
            && j["launcher"] == "mpirun"
            && j["world_size"] == 4),
        "{list}"
    );
    // The metrics say so too, in a form Prometheus takes.
    let (status, metrics) = scrape(port);
    assert!(status.contains(" 200 "), "{status}");
    let (ok, said) = promtool_check(&metrics);
    assert!(
        ok && said.trim().is_empty(),
        "promtool check metrics: {said}\n{metrics}"
    );
    let crash = format!("hatrain_faults_total{{job=\"{job}\",kind=\"crash\",action=\"reboot\"}} 1");
    assert!(metrics.contains(&crash), "{crash} in\n{metrics}");
    let hist = format!("hatrain_recovery_duration_seconds_count{{job=\"{job}\"}} 1");
    assert!(metrics.contains(&hist), "{hist} in\n{metrics}");
    assert!(
        metrics.contains(&format!("hatrain_world_size{{job=\"{job}\"}} 4")),
        "{metrics}"
    );
    // What hatrain holds each rank's training thread for, per step, and
    // what its snapshot copies cost.
    for series in [
        format!("hatrain_step_held_seconds{{job=\"{job}\",rank=\"0\",stat=\"p99\"}} "),
        format!("hatrain_snapshot_copied_bytes_total{{job=\"{job}\",rank=\"0\"}} "),
        format!("hatrain_snapshot_copy_cpu_seconds_total{{job=\"{job}\",rank=\"0\"}} "),
    ] {
        assert!(metrics.contains(&series), "{series} in\n{metrics}");
    }
    kill(stopped(1).unwrap(), libc::SIGKILL);

    let out = run.wait_output(Duration::from_secs(180));
    assert_success(&out, "the mpirun job with a killed rank");
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    // mpirun's own words, not its ranks': a rank may print that its
    // communicator was aborted, depending on which one saw the fault first.
    assert!(!mpirun_complained(&text), "mpirun noticed: {text}");
    let (a, b) = (read_log(&ref_log), read_log(&log));
    assert_eq!(final_losses(&a), final_losses(&b), "every step's loss");
    assert_eq!(final_checksum(&a), final_checksum(&b), "final weights");
    assert!(job_pids(&job).is_empty(), "no worker outlives its job");
    stop_clean(serve);
}

/// Seconds since the Unix epoch now, as the agents date faults.
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Whether OpenMPI's mpirun itself reported a failed or aborted rank: its
/// own banners, never a rank's words (a rank may print that its
/// communicator aborted while the agent repairs the job).
fn mpirun_complained(text: &str) -> bool {
    const MPIRUN_SAYS: [&str; 5] = [
        "mpirun noticed that",
        "mpirun detected that one or more processes exited with non-zero status",
        "Primary job  terminated normally, but",
        "MPI_ABORT was invoked",
        "mpirun has exited due to process rank",
    ];
    text.lines()
        .any(|line| MPIRUN_SAYS.iter().any(|said| line.contains(said)))
}

/// Reads the datagrams systemd would get until `pick` finds one.
fn next_with(sock: &UnixDatagram, what: &str, limit: Duration) -> (String, Instant) {
    let end = Instant::now() + limit;
    let mut buf = [0u8; 4096];
    while Instant::now() < end {
        if let Ok(n) = sock.recv(&mut buf) {
            let msg = String::from_utf8_lossy(&buf[..n]).to_string();
            if msg.lines().any(|l| l == what) {
                return (msg, Instant::now());
            }
        }
    }
    panic!("no {what} within {limit:?}");
}

#[test]
fn the_notify_protocol_says_ready_watchdog_and_stopping() {
    let d = tempfile::tempdir().unwrap();
    let notify = d.path().join("notify.sock");
    let sock = UnixDatagram::bind(&notify).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let serve = Serve::start(
        d.path(),
        &[
            ("NOTIFY_SOCKET", notify.to_str().unwrap()),
            ("WATCHDOG_USEC", "1000000"),
        ],
    );
    let (ready, _) = next_with(&sock, "READY=1", Duration::from_secs(20));
    assert!(ready.contains("STATUS=serving 0 jobs"), "{ready}");
    UnixStream::connect(&serve.socket).expect("READY comes once the socket takes connections");
    // Keep-alives: at least every half period, never a whole period apart.
    let mut at = vec![next_with(&sock, "WATCHDOG=1", Duration::from_secs(5)).1];
    while at.len() < 5 {
        at.push(next_with(&sock, "WATCHDOG=1", Duration::from_secs(5)).1);
    }
    let longest = at.windows(2).map(|w| w[1] - w[0]).max().unwrap();
    assert!(
        longest < Duration::from_secs(1),
        "keep-alives {longest:?} apart with WATCHDOG_USEC of 1 s"
    );
    kill(serve.job.pid(), libc::SIGTERM);
    let (stopping, _) = next_with(&sock, "STOPPING=1", Duration::from_secs(20));
    assert!(stopping.contains("STOPPING=1"));
    stop_clean(serve);
}

#[test]
fn exec_says_what_is_missing() {
    let d = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(agent())
        .args(["exec", "--agent-socket"])
        .arg(d.path().join("none.sock"))
        .args(["--", "true"])
        .env("OMPI_COMM_WORLD_RANK", "0")
        .env("OMPI_COMM_WORLD_SIZE", "1")
        .env("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        .env("OMPI_COMM_WORLD_LOCAL_SIZE", "1")
        .env("OMPI_MCA_ess_base_jobid", "7")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("no hatrain agent answers on"), "{err}");
    assert!(err.contains("hatrain-agent serve"), "{err}");

    let serve = Serve::start(d.path(), &[]);
    let out = std::process::Command::new(agent())
        .args(["exec", "--agent-socket"])
        .arg(&serve.socket)
        .args(["--", "true"])
        .env_remove("RANK")
        .env_remove("OMPI_COMM_WORLD_RANK")
        .env_remove("SLURM_PROCID")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("no launcher's rank is in the environment"),
        "{err}"
    );
    // A job that spans hosts is refused with the reason.
    let out = std::process::Command::new(agent())
        .args(["exec", "--job-id", "wide", "--agent-socket"])
        .arg(&serve.socket)
        .args(["--", "true"])
        .env("OMPI_COMM_WORLD_RANK", "0")
        .env("OMPI_COMM_WORLD_SIZE", "8")
        .env("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        .env("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("4 of them on this host"), "{err}");
    stop_clean(serve);
}

/// The newest step rank 0 has committed to its snapshot store.
fn committed(shm: &Path, job: &str) -> Option<u64> {
    let path = hatrain_shared::shm::store_path(&shm.join(job), 0);
    let store = hatrain_shared::shm::Store::open(&path).ok()?;
    store.sealed().first().map(|s| s.step)
}

const STEPS: u64 = 800;
const UCE_AT: u64 = 600;
const HA_UCE: [&str; 3] = [
    "--enable-high-availability",
    "--enable-worker-reboot",
    "--enable-hbmfault-repair",
];

#[test]
fn an_agent_restart_never_stops_training() {
    let d = tempfile::tempdir().unwrap();
    let (ref_log, log) = (d.path().join("ref.jsonl"), d.path().join("gaps.jsonl"));
    let train = |log: &Path| {
        let mut a = tiny_args(STEPS);
        a.extend(["--log-jsonl".into(), log.display().to_string()]);
        a
    };
    let serve = Serve::start(d.path(), &[]);
    let job = job_id("mpi-ref");
    let cmd = mpirun(4, &serve.socket, &job, &HA_UCE, &train(&ref_log), &[]);
    let out = Job::spawn(cmd, &job).wait_output(Duration::from_secs(300));
    assert_success(&out, "the fault-free mpirun job");

    // Rank 0 takes 10 ms more per step, so that the run outlasts two
    // agent restarts (a sleep changes no number).
    let slow: Vec<String> = (1..=STEPS)
        .map(|s| format!("0:{s}:forward:sleep10:*"))
        .collect();
    // Rank 2 gets an uncorrectable memory error in its AdamW moments at
    // step UCE_AT, while no agent runs.
    let slow = format!("{};2:{UCE_AT}:update:uce-exp_avg-500", slow.join(";"));
    let job = job_id("mpi-restart");
    let plan = [("HATRAIN_FAULT_PLAN", slow.as_str())];
    let cmd = mpirun(4, &serve.socket, &job, &HA_UCE, &train(&log), &plan);
    let mut run = Job::spawn(cmd, &job);
    let socket = serve.shm.join(&job).join("agent.sock");
    let running = |limit| {
        poll_agentctl(&socket, "workers", limit, |v| {
            let w = v["workers"].as_array()?;
            (w.len() == 4 && w.iter().all(|w| w["pid"].is_number())).then_some(())
        })
        .is_some()
    };
    assert!(running(Duration::from_secs(60)), "the job started");
    assert!(
        wait_until(Duration::from_secs(60), || committed(&serve.shm, &job)
            .is_some_and(|s| s >= 5)),
        "rank 0 commits snapshots"
    );

    // 1. SIGTERM of the agent (`systemctl restart`, with the default
    // --on-stop keep): the workers train on through the gap, and the next
    // agent, 2 s later, takes them back.
    kill(serve.job.pid(), libc::SIGTERM);
    let before = committed(&serve.shm, &job).expect("rank 0 committed a snapshot");
    std::thread::sleep(Duration::from_secs(2));
    let after = committed(&serve.shm, &job).unwrap();
    assert!(
        after > before,
        "snapshots go on without an agent ({before} then {after})"
    );
    let mut serve = serve;
    let out = serve.job.wait_output(Duration::from_secs(10));
    assert_success(&out, "the agent's stop that leaves the jobs training");
    drop(serve);
    let serve = Serve::start(d.path(), &[]);
    assert!(
        running(Duration::from_secs(30)),
        "the next agent re-adopted every worker"
    );

    // 2. SIGKILL of the agent, then of rank 1's worker while none runs:
    // the next agent reboots it from shared memory.
    kill(serve.job.pid(), libc::SIGKILL);
    let victim = job_pids(&job)
        .into_iter()
        .find(|&p| rank_of(p) == Some(1) && proc_state(p).is_some_and(|s| s != 'Z'))
        .expect("rank 1's worker");
    let killed_at = unix_now();
    kill(victim, libc::SIGKILL);
    std::thread::sleep(Duration::from_secs(2));
    drop(serve);
    let serve = Serve::start(d.path(), &[]);
    let repaired = poll_agentctl(&socket, "faults", Duration::from_secs(60), |v| {
        let faults = v["faults"].as_array()?;
        faults
            .iter()
            .find(|f| f["recovery_s"].is_number() && f["ranks"] == serde_json::json!([1]))
            .and_then(|f| f["detected_unix_s"].as_f64())
    });
    let seen_at = unix_now();
    let detected = repaired.expect("rank 1 was rebooted by the next agent");
    // The next agent dates the fault on the job's clock: after the kill,
    // and no later than this test saw it (not the job's age earlier).
    assert!(
        (killed_at..=seen_at).contains(&detected),
        "rank 1's fault is dated {detected}, killed at {killed_at}, seen at {seen_at}"
    );

    // 3. SIGKILL of the agent shortly before rank 2's memory error: the
    // error is flagged while no agent runs, and the next agent repairs it
    // by recomputing the step.
    assert!(
        wait_until(Duration::from_secs(120), || committed(&serve.shm, &job)
            .is_some_and(|s| s + 60 >= UCE_AT)),
        "the job reaches step {}",
        UCE_AT - 60
    );
    let agent_gone_at = unix_now();
    kill(serve.job.pid(), libc::SIGKILL);
    assert!(
        committed(&serve.shm, &job).is_some_and(|s| s < UCE_AT),
        "the agent went before the memory error"
    );
    std::thread::sleep(Duration::from_secs(2));
    drop(serve);
    let serve = Serve::start(d.path(), &[]);
    let repaired = poll_agentctl(&socket, "faults", Duration::from_secs(60), |v| {
        let faults = v["faults"].as_array()?;
        faults
            .iter()
            .find(|f| {
                f["recovery_s"].is_number()
                    && f["kind"] == "uce"
                    && f["ranks"] == serde_json::json!([2])
            })
            .map(|f| {
                (
                    f["action"].as_str().unwrap_or("").to_string(),
                    f["detected_unix_s"].as_f64(),
                )
            })
    });
    let seen_at = unix_now();
    assert!(
        repaired
            .as_ref()
            .is_some_and(|(a, _)| a.contains("recompute")),
        "rank 2's memory error was repaired by the next agent: {repaired:?}"
    );
    // Flagged while no agent ran: dated after the agent went, and no later
    // than this test saw it.
    let detected = repaired.and_then(|(_, at)| at).unwrap_or(f64::NAN);
    assert!(
        (agent_gone_at..=seen_at).contains(&detected),
        "rank 2's fault is dated {detected}, the agent went at {agent_gone_at}, seen at {seen_at}"
    );

    let out = run.wait_output(Duration::from_secs(300));
    assert_success(&out, "the mpirun job through three agent restarts");
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(!mpirun_complained(&text), "mpirun noticed: {text}");
    let (a, b) = (read_log(&ref_log), read_log(&log));
    assert_eq!(final_losses(&a), final_losses(&b), "every step's loss");
    assert_eq!(final_checksum(&a), final_checksum(&b), "final weights");
    assert!(job_pids(&job).is_empty(), "no worker outlives its job");
    stop_clean(serve);
    assert_no_job_state(d.path());
}

#[test]
fn the_service_files_pass_systemd_checks() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let unit = repo.join("systemd/hatrain-agent.service");
    // verify checks that ExecStart's /usr/local/bin/hatrain-agent exists:
    // in a mount namespace of the test's own, a tmpfs there holds the
    // binary built here, and the host is not touched.
    let script = format!(
        "mount -t tmpfs tmpfs /usr/local/bin && cp '{}' /usr/local/bin/hatrain-agent && systemd-analyze verify '{}'",
        agent().display(),
        unit.display()
    );
    let out = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .output()
        .expect("unshare (util-linux)");
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify: {said}"
    );

    // The tmpfiles.d entry makes the agent's folders, with their modes.
    let d = tempfile::tempdir().unwrap();
    let out = std::process::Command::new("systemd-tmpfiles")
        .arg("--create")
        .arg(format!("--root={}", d.path().display()))
        .arg(
            repo.join("systemd/hatrain-agent.conf")
                .canonicalize()
                .unwrap(),
        )
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && said.trim().is_empty(),
        "systemd-tmpfiles: {said}"
    );
    for (dir, mode) in [
        ("run/hatrain", 0o755),
        ("run/hatrain/jobs", 0o700),
        ("dev/shm/hatrain", 0o700),
    ] {
        use std::os::unix::fs::PermissionsExt;
        let m = std::fs::metadata(d.path().join(dir))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(m, mode, "{dir}");
    }

    // The example environment file's flags start the agent.
    let env = std::fs::read_to_string(repo.join("systemd/hatrain-agent.env")).unwrap();
    let args = env
        .lines()
        .find_map(|l| l.strip_prefix("HATRAIN_AGENT_ARGS="))
        .expect("HATRAIN_AGENT_ARGS in the environment file");
    let args: Vec<&str> = args.split_whitespace().collect();
    let serve = Serve::start_with(d.path(), &[], &args);
    stop_clean(serve);
}

/// The agent SIGKILLed at a seeded moment just after a worker's SIGKILL
/// (before, during or after its recovery), the next agent 1 s later: the
/// job ends bit-identical every time.
#[test]
fn an_agent_killed_during_a_recovery_is_followed_by_the_next() {
    let d = tempfile::tempdir().unwrap();
    let serve = Serve::start(d.path(), &[]);
    let ref_log = d.path().join("ref.jsonl");
    let train = |log: &Path| {
        let mut a = tiny_args(120);
        a.extend(["--log-jsonl".into(), log.display().to_string()]);
        a
    };
    let job = job_id("race-ref");
    let cmd = mpirun(4, &serve.socket, &job, &HA, &train(&ref_log), &[]);
    let out = Job::spawn(cmd, &job).wait_output(Duration::from_secs(300));
    assert_success(&out, "the fault-free mpirun job");
    let want = final_checksum(&read_log(&ref_log));
    let mut serve = Some(serve);
    for (seed, delay_ms) in [0u64, 5, 20, 60, 150].into_iter().enumerate() {
        let log = d.path().join(format!("race{seed}.jsonl"));
        let job = job_id("race");
        let s = serve.take().unwrap_or_else(|| Serve::start(d.path(), &[]));
        let plan = [("HATRAIN_FAULT_PLAN", "1:40:update:stop")];
        let cmd = mpirun(4, &s.socket, &job, &HA, &train(&log), &plan);
        let mut run = Job::spawn(cmd, &job);
        let stopped = || {
            job_pids(&job)
                .into_iter()
                .find(|&p| proc_state(p) == Some('T') && rank_of(p) == Some(1))
        };
        assert!(
            wait_until(Duration::from_secs(120), || stopped().is_some()),
            "seed {seed}: rank 1 stops"
        );
        kill(stopped().unwrap(), libc::SIGKILL);
        std::thread::sleep(Duration::from_millis(delay_ms));
        kill(s.job.pid(), libc::SIGKILL);
        drop(s);
        std::thread::sleep(Duration::from_secs(1));
        let mut s = Serve::start(d.path(), &[]);
        let ended = wait_until(Duration::from_secs(120), || {
            run.child.as_mut().unwrap().try_wait().unwrap().is_some()
        });
        if !ended {
            kill(s.job.pid(), libc::SIGKILL);
            let agent = s.job.wait_output(Duration::from_secs(10));
            kill(run.pid(), libc::SIGKILL);
            let mpi = run.wait_output(Duration::from_secs(10));
            panic!(
                "seed {seed}: the job did not end after the agent was killed {delay_ms} ms after the worker\n--- next agent\n{}\n--- mpirun\n{}",
                String::from_utf8_lossy(&agent.stderr),
                String::from_utf8_lossy(&mpi.stderr)
            );
        }
        let out = run.wait_output(Duration::from_secs(10));
        assert_success(
            &out,
            &format!("seed {seed} (agent killed {delay_ms} ms after the worker)"),
        );
        assert_eq!(
            final_checksum(&read_log(&log)),
            want,
            "seed {seed}: final weights"
        );
        assert!(
            job_pids(&job).is_empty(),
            "seed {seed}: no worker outlives its job"
        );
        serve = Some(s);
    }
    stop_clean(serve.take().unwrap());
}

/// Two jobs served at once; another user cannot reach the agent; and with
/// --on-stop stop, a SIGTERM writes each job's last-words checkpoint before
/// its workers are stopped.
#[test]
fn two_jobs_at_once_then_a_stop_with_last_words() {
    let d = tempfile::tempdir().unwrap();
    let serve = Serve::start_with(d.path(), &[], &["--on-stop", "stop"]);
    let steps = 400;
    let slow: Vec<String> = (1..=steps)
        .map(|s| format!("0:{s}:forward:sleep10:*"))
        .collect();
    let slow = slow.join(";");
    let plan = [("HATRAIN_FAULT_PLAN", slow.as_str())];
    let mut runs = Vec::new();
    for name in ["first", "second"] {
        let job = job_id(name);
        let save = d.path().join(format!("{name}-ckpt"));
        let mut train = tiny_args(steps);
        train.extend([
            "--save".into(),
            save.display().to_string(),
            "--save-interval".into(),
            "1000".into(),
        ]);
        let cmd = mpirun(2, &serve.socket, &job, &HA, &train, &plan);
        runs.push((Job::spawn(cmd, &job), job, save));
    }
    for (_, job, _) in &runs {
        assert!(
            wait_until(Duration::from_secs(60), || committed(&serve.shm, job)
                .is_some_and(|s| s >= 20)),
            "job {job} trains"
        );
    }
    // Another user is not let in.
    let out = std::process::Command::new("runuser")
        .args(["-u", "nobody", "--"])
        .arg(agent())
        .args(["exec", "--job-id", "stranger", "--agent-socket"])
        .arg(&serve.socket)
        .args(["--", "true"])
        .env("OMPI_COMM_WORLD_RANK", "0")
        .env("OMPI_COMM_WORLD_SIZE", "1")
        .env("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        .env("OMPI_COMM_WORLD_LOCAL_SIZE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("Permission denied"), "{err}");

    kill(serve.job.pid(), libc::SIGTERM);
    for (mut run, job, save) in runs {
        let out = run.wait_output(Duration::from_secs(120));
        assert!(!out.status.success(), "job {job}'s workers were stopped");
        let it = hatrain_shared::checkpoint::read_tracker(&save)
            .unwrap_or_else(|e| panic!("job {job} has a last-words checkpoint: {e}"));
        assert!(
            it >= 20 && it < steps,
            "job {job}'s last words at iteration {it}"
        );
        assert!(job_pids(&job).is_empty(), "no worker of {job} is left");
    }
    stop_clean(serve);
    assert_no_job_state(d.path());
}

/// The real srun of a one-node Slurm cluster starting each rank as
/// `hatrain-agent exec`: Slurm's variables give the rank, the tasks on the
/// node and the job (its job and step), and a worker that kills itself is
/// rebooted beneath its shim while srun sees nothing fail.
#[test]
fn an_srun_job_is_repaired_without_srun_noticing() {
    let slurm = common::slurm::Slurm::start();
    let d = tempfile::tempdir().unwrap();
    let serve = Serve::start(d.path(), &[]);
    let (ref_log, log) = (d.path().join("ref.jsonl"), d.path().join("kill.jsonl"));
    let job = job_id("srun-ref");
    let cmd = mpirun(2, &serve.socket, &job, &HA, &train(&ref_log), &[]);
    let out = Job::spawn(cmd, &job).wait_output(Duration::from_secs(180));
    assert_success(&out, "the fault-free mpirun job");

    let mut cmd = slurm.srun();
    cmd.args(["-n", "2", "--overcommit", "--kill-on-bad-exit=1"])
        .arg(agent())
        .arg("exec")
        .args(HA)
        .arg("--")
        .arg(trainer())
        .args(train(&log))
        .env("HATRAIN_AGENT_SOCKET", &serve.socket)
        .env("HATRAIN_FAULT_PLAN", "1:10:update:kill")
        .env("OMP_NUM_THREADS", "1")
        .env("RAYON_NUM_THREADS", "1")
        .env_remove("HATRAIN_JOB_ID");
    let tag = job_id("srun");
    let out = Job::spawn(cmd, &tag).wait_output(Duration::from_secs(180));
    assert_success(&out, "the srun job with a rank killed");
    let said =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("fault plan: rank 1 Kill at step 10"),
        "{said}"
    );
    assert!(!said.contains("srun: error"), "srun saw a failure: {said}");
    let (a, b) = (read_log(&ref_log), read_log(&log));
    assert_eq!(final_losses(&a), final_losses(&b), "every step's loss");
    assert_eq!(final_checksum(&a), final_checksum(&b), "final weights");
    assert!(job_pids(&tag).is_empty(), "no worker outlives its job");
    stop_clean(serve);
    drop(slurm);
}

/// The bin folder of the virtual environment with torch (made by
/// `scripts/torch-venv.sh` the first time).
fn venv_bin() -> std::path::PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/torch-venv.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("run scripts/torch-venv.sh");
    assert!(out.status.success(), "scripts/torch-venv.sh failed");
    let python = std::path::PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    python.parent().unwrap().to_path_buf()
}

/// The real torchrun, in its launch mode, starting each rank as
/// `hatrain-agent exec` under a serving host agent: torchrun's environment
/// contract (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and its
/// run id) gives the rank and the job, and a worker that kills itself is
/// rebooted beneath its shim while torchrun sees nothing fail.
#[test]
fn torchrun_ranks_run_under_the_host_agent() {
    let d = tempfile::tempdir().unwrap();
    let serve = Serve::start(d.path(), &[]);
    let torchrun = venv_bin().join("torchrun");
    let run_under = |log: &Path, plan: &str| {
        let mut cmd = std::process::Command::new(&torchrun);
        cmd.args(["--standalone", "--nproc-per-node", "2", "--no-python"])
            .arg(agent())
            .arg("exec")
            .args(HA)
            .arg("--")
            .arg(trainer())
            .args(train(log))
            .current_dir(d.path())
            .env("HATRAIN_AGENT_SOCKET", &serve.socket)
            .env("HATRAIN_FAULT_PLAN", plan)
            .env("OMP_NUM_THREADS", "1")
            .env("RAYON_NUM_THREADS", "1")
            .env_remove("HATRAIN_JOB_ID");
        let tag = job_id("torchrun-exec");
        let out = Job::spawn(cmd, &tag).wait_output(Duration::from_secs(300));
        assert!(job_pids(&tag).is_empty(), "no worker outlives its job");
        out
    };
    let (ref_log, log) = (d.path().join("ref.jsonl"), d.path().join("kill.jsonl"));
    let out = run_under(&ref_log, "");
    assert_success(&out, "torchrun of exec shims, no fault");
    let out = run_under(&log, "1:10:update:kill");
    assert_success(&out, "torchrun of exec shims, rank 1 killed");
    let said =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("fault plan: rank 1 Kill at step 10"),
        "{said}"
    );
    assert!(
        !said.contains("will restart worker group") && !said.contains("FAILED"),
        "torchrun saw a failure: {said}"
    );
    let (a, b) = (read_log(&ref_log), read_log(&log));
    assert_eq!(final_losses(&a), final_losses(&b), "every step's loss");
    assert_eq!(final_checksum(&a), final_checksum(&b), "final weights");
    stop_clean(serve);
}
