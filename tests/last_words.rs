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
    let mut cmd = Command::new(agent());
    cmd.args(["launch", "--nproc-per-node", "4", "--job-id", job])
        .args(["--threads-per-worker", "1", "--stop-grace-secs", "3"])
        // With two slots, snapshots pause while the agent writes a periodic
        // save from one of them, and the newest consistent step can then be
        // older than the step before a crash; three keep them going.
        .args(["--snapshot-slots", "3"])
        .args(ha)
        .arg("--shm-root")
        .arg(shm)
        .arg("--")
        .arg(trainer())
        .args(train)
        .env_remove("HIGH_AVAILABILITY")
        .env("RUST_LOG", "info");
    match plan {
        Some(p) => cmd.env("HATRAIN_FAULT_PLAN", p),
        None => cmd.env_remove("HATRAIN_FAULT_PLAN"),
    };
    cmd
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
    assert!((15..ITERS).contains(&it), "iteration {it}");
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
