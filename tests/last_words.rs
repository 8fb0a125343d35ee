//! The last-words checkpoint: written by the agent from the ranks' sealed
//! snapshots on SIGTERM, on `agentctl dump`, and when a fault cannot be
//! repaired; resuming from it reproduces the run without faults bit for bit.

mod common;
use common::*;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const ITERS: u64 = 40;

fn train(log: &Path, extra: &[String]) -> Vec<String> {
    let mut a = tiny_args(ITERS);
    a.extend(["--log-jsonl".into(), log.display().to_string()]);
    a.extend(extra.iter().cloned());
    a
}

fn ha_launch(job: &str, shm: &Path, ha: &[&str], train: &[String], plan: Option<&str>) -> Command {
    let launch = Launch::new(4)
        .job(job)
        // With two slots, snapshots pause while the agent writes a periodic
        // save from one of them, and the newest consistent step can then be
        // older than the step before a crash; three keep them going.
        .option("--snapshot-slots", "3")
        .flags(ha)
        .shm_root(shm)
        .args(train)
        .env_remove("HIGH_AVAILABILITY");
    match plan {
        Some(p) => launch.fault_plan(p),
        None => launch.no_fault_plan(),
    }
    .command()
}

fn reference(dir: &Path) -> Vec<serde_json::Value> {
    let log = dir.join("ref.jsonl");
    assert_success(&run_launch(4, "lw-ref", &train(&log, &[])), "reference run");
    read_log(&log)
}

/// Resumes from `ckpt` to the end and checks the result against `reference`.
fn resume_matches(dir: &Path, ckpt: &Path, from: u64, reference: &[serde_json::Value]) {
    let log = dir.join(format!("resumed-{from}.jsonl"));
    let args = train(&log, &["--load".into(), ckpt.display().to_string()]);
    assert_success(
        &run_launch(4, "lw-resume", &args),
        "resume from the last-words checkpoint",
    );
    let b = read_log(&log);
    assert_eq!(b[0]["resumed_from"], from);
    assert_eq!(
        final_checksum(reference),
        final_checksum(&b),
        "final weights differ"
    );
    let want = final_losses(reference);
    for (step, loss) in final_losses(&b) {
        assert_eq!(loss.to_bits(), want[&step].to_bits(), "loss of step {step}");
    }
}

fn tracker(ckpt: &Path) -> u64 {
    std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn sigterm_writes_a_last_words_checkpoint_that_resumes_exactly() {
    let d = tempfile::tempdir().unwrap();
    let reference = reference(d.path());
    let (log, ckpt, shm) = (
        d.path().join("run.jsonl"),
        d.path().join("ckpt"),
        d.path().join("shm"),
    );
    let job = job_id("lw-term");
    let args = train(&log, &["--save".into(), ckpt.display().to_string()]);
    let mut guard = Job::spawn(
        ha_launch(&job, &shm, &["--enable-high-availability"], &args, None),
        &job,
    );
    assert!(wait_until(Duration::from_secs(120), || losses(&read_log(
        &log
    ))
    .len()
        >= 15));
    kill(guard.pid(), libc::SIGTERM);
    let out = guard.wait_output(Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + libc::SIGTERM), "{stderr}");
    let it = tracker(&ckpt);
    assert!(
        stderr.contains(&format!("last-words checkpoint of iteration {it} written")),
        "{stderr}"
    );
    // Step 15 was logged; its snapshot may still have been copying (the
    // copy overlaps the next step), so the newest sealed step is 14 or
    // later.
    assert!((14..ITERS).contains(&it), "iteration {it}");
    assert!(job_pids(&job).is_empty());
    assert!(!shm.join(&job).exists(), "shared memory left behind");
    resume_matches(d.path(), &ckpt, it, &reference);
}

#[test]
fn agentctl_dump_checkpoints_and_training_goes_on() {
    let d = tempfile::tempdir().unwrap();
    let reference = reference(d.path());
    let (log, ckpt, shm) = (
        d.path().join("run.jsonl"),
        d.path().join("ckpt"),
        d.path().join("shm"),
    );
    let job = job_id("lw-ctl");
    let args = train(
        &log,
        &[
            "--save".into(),
            ckpt.display().to_string(),
            "--save-interval".into(),
            "1000".into(),
        ],
    );
    // Rank 2 stops itself at step 20 so the dump happens at a known point;
    // the harness resumes it with SIGCONT after the dump.
    let mut guard = Job::spawn(
        ha_launch(
            &job,
            &shm,
            &["--enable-high-availability"],
            &args,
            Some("2:20:forward:stop"),
        ),
        &job,
    );
    let mut stopped = None;
    assert!(wait_until(Duration::from_secs(120), || {
        stopped = job_pids(&job)
            .into_iter()
            .find(|p| proc_state(*p) == Some('T'));
        stopped.is_some()
    }));
    // A stopped rank cannot pause: the dump waits for it, so let it run
    // again first, then dump while training goes on.
    kill(stopped.unwrap(), libc::SIGCONT);
    let out = Command::new(agentctl())
        .arg("--socket")
        .arg(shm.join(&job).join("agent.sock"))
        .arg("dump")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        said.contains("last-words checkpoint of iteration"),
        "{said}"
    );
    let dumped = tracker(&ckpt);
    assert!(dumped >= 19, "dumped iteration {dumped}");
    let out = guard.wait_output(Duration::from_secs(120));
    assert_success(&out, "training after the dump");
    // Training went on to the end and saved its final checkpoint; both the
    // run and a resume from the dump match the run without faults.
    let run = read_log(&log);
    assert_eq!(final_checksum(&reference), final_checksum(&run));
    let lw = d.path().join("lw-only");
    std::fs::create_dir(&lw).unwrap();
    let name = format!("iter_{dumped:07}");
    std::fs::rename(ckpt.join(&name), lw.join(&name)).unwrap();
    std::fs::write(
        lw.join("latest_checkpointed_iteration.txt"),
        format!("{dumped}\n"),
    )
    .unwrap();
    resume_matches(d.path(), &lw, dumped, &reference);
}

#[test]
fn an_unrepairable_crash_ends_with_a_last_words_checkpoint() {
    let d = tempfile::tempdir().unwrap();
    let reference = reference(d.path());
    let (log, ckpt, shm) = (
        d.path().join("run.jsonl"),
        d.path().join("ckpt"),
        d.path().join("shm"),
    );
    let job = job_id("lw-crash");
    let args = train(
        &log,
        &[
            "--save".into(),
            ckpt.display().to_string(),
            "--save-interval".into(),
            "10".into(),
        ],
    );
    // Dump mode only: a crash cannot be repaired, so the job stops, but
    // first writes the newest consistent step (not the save of step 20).
    let out = Job::spawn(
        ha_launch(
            &job,
            &shm,
            &["--enable-high-availability"],
            &args,
            Some("1:27:update:kill"),
        ),
        &job,
    )
    .wait_output(Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + libc::SIGKILL), "{stderr}");
    assert!(stderr.contains("worker reboot is not enabled"), "{stderr}");
    let it = tracker(&ckpt);
    assert_eq!(
        it, 26,
        "the dump holds the step before the update that crashed: {stderr}"
    );
    resume_matches(d.path(), &ckpt, it, &reference);
}

#[test]
fn agentctl_answers_during_a_dump_of_the_100m_model_and_a_worker_killed_meanwhile_is_recovered() {
    let d = tempfile::tempdir().unwrap();
    let (log, ckpt, shm) = (
        d.path().join("run.jsonl"),
        d.path().join("ckpt"),
        d.path().join("shm"),
    );
    let job = job_id("lw-100m");
    let args = s(&[
        "--model-size",
        "100m",
        "--global-batch",
        "2",
        "--seq-len",
        "4",
        "--log-interval",
        "1000",
        "--train-iters",
        "4",
        "--save",
        &ckpt.display().to_string(),
        "--log-jsonl",
        &log.display().to_string(),
    ]);
    let cmd = Launch::new(2)
        .job(&job)
        .stop_grace_secs(5)
        .worker_reboot()
        .option("--pause-timeout-secs", "120")
        .shm_root(&shm)
        .args(&args)
        .env_remove("HIGH_AVAILABILITY")
        .no_fault_plan()
        .command();
    let mut guard = Job::spawn(cmd, &job);
    let socket = shm.join(&job).join("agent.sock");
    let status = || -> Option<serde_json::Value> {
        let out = Command::new(agentctl())
            .arg("--socket")
            .arg(&socket)
            .args(["--json", "status"])
            .output()
            .ok()?;
        out.status.success().then_some(())?;
        serde_json::from_slice(&out.stdout).ok()
    };
    let stepped = |st: &serde_json::Value| {
        st["status"]["workers"]
            .as_array()
            .is_some_and(|w| w.len() == 2 && w.iter().all(|r| r["step"].as_u64() >= Some(1)))
    };
    assert!(
        wait_until(Duration::from_secs(240), || status()
            .is_some_and(|s| stepped(&s))),
        "the 100m model did not complete a step"
    );
    let dump = {
        let socket = socket.clone();
        std::thread::spawn(move || {
            Command::new(agentctl())
                .arg("--socket")
                .arg(&socket)
                .arg("dump")
                .output()
                .unwrap()
        })
    };
    // While the checkpoint (about 1.2 GB) is written, the agent answers.
    let mut answered = None;
    assert!(
        wait_until(Duration::from_secs(120), || {
            let st = status();
            let writing = st.as_ref().is_some_and(|s| {
                s["status"]["activity"]
                    .as_str()
                    .is_some_and(|a| a.contains("writing iteration"))
            });
            if writing {
                answered = st;
            }
            writing
        }),
        "no status answer while the dump was being written"
    );
    // A worker killed during the dump: the dump completes, then it is
    // restarted and recovered, and the job finishes.
    let pid = answered.unwrap()["status"]["workers"][1]["pid"]
        .as_i64()
        .expect("rank 1 runs") as i32;
    kill(pid, libc::SIGKILL);
    let dumped = dump.join().unwrap();
    let said = String::from_utf8_lossy(&dumped.stdout);
    assert!(
        dumped.status.success() && said.contains("last-words checkpoint of iteration"),
        "{said}{}",
        String::from_utf8_lossy(&dumped.stderr)
    );
    let out = guard.wait_output(Duration::from_secs(600));
    assert_success(&out, "the 100m job");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("restarting it in place"), "{stderr}");
    assert_eq!(
        stderr
            .matches("recovered: first step after the fault completed")
            .count(),
        1,
        "{stderr}"
    );
    assert_eq!(tracker(&ckpt), 4, "the final checkpoint is on disk");
    assert!(job_pids(&job).is_empty());
    assert!(!shm.join(&job).exists());
}
