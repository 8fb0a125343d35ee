//! Worker reboot (HIGH_AVAILABILITY=recover): ranks killed with SIGKILL at
//! chosen instants are restarted in place and refilled from shared memory,
//! and the run ends bit-identical to a run without faults.
//!
//! The runtime's fault plan stops (SIGSTOP) a rank at a named point of a
//! chosen step; this harness then kills it with a real SIGKILL, the way a
//! crash would take it.

mod common;
use common::*;
use hatrain_shared::control::{Response, StatusReport};
use std::process::Command;
use std::time::{Duration, Instant};

fn store_dir(shm: &std::path::Path, job: &str) -> std::path::PathBuf {
    shm.join(job)
}

/// Ranks of the job that are stopped by their fault plan.
fn stopped(job: &str) -> Vec<(usize, i32)> {
    let mut v: Vec<(usize, i32)> = job_pids(job)
        .into_iter()
        .filter(|&p| proc_state(p) == Some('T'))
        .filter_map(|p| rank_of(p).map(|r| (r, p)))
        .collect();
    v.sort();
    v
}

fn agentctl_status(socket: &std::path::Path) -> StatusReport {
    let out = Command::new(agentctl())
        .arg("--socket")
        .arg(socket)
        .args(["--json", "status"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    match serde_json::from_slice(&out.stdout).unwrap() {
        Response::Status(s) => *s,
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn killed_ranks_recover_bit_identically() {
    let d = tempfile::tempdir().unwrap();
    let shm = d.path().join("shm");
    let (ref_log, log) = (d.path().join("ref.jsonl"), d.path().join("faulty.jsonl"));
    let train = |log: &std::path::Path| {
        let mut a = s(&["--train-iters", "60", "--log-interval", "1000"]);
        a.extend(["--log-jsonl".into(), log.display().to_string()]);
        a
    };
    assert_success(&run_launch(4, "ref", &train(&ref_log)), "fault-free run");

    // Each entry stops a rank at a point of a step; the harness kills it.
    // INCARNATION (5th field) picks which process of a restarted rank.
    let plan = [
        "1:8:forward:stop",   // A: during forward/backward
        "2:15:update:stop",   // B: inside the update fences
        "3:22:commit:stop",   // C: halfway through a snapshot copy
        "0:30:forward:stop",  // D: the logging rank; its newest slot is also bit-flipped
        "1:40:update:stop:1", // E: two ranks at once, inside the fences
        "3:40:update:stop:1",
        "2:48:commit:stop:1",  // F: mid-copy again
        "0:56:forward:stop:1", // G: agentctl is checked while this rank is stopped
    ]
    .join(";");
    let job = job_id("recover");
    let cmd = Launch::new(4)
        .job(&job)
        .worker_reboot()
        // Three slots: with two, a corrupt newest slot on a rank that is a
        // commit behind the others leaves no common step.
        .option("--snapshot-slots", "3")
        .shm_root(&shm)
        .args(train(&log))
        .fault_plan(&plan)
        .command();
    let mut guard = Job::spawn(cmd, &job);
    let socket = store_dir(&shm, &job).join("agent.sock");

    let mut events = 0;
    let mut killed = Vec::new();
    let mut flipped_step = None;
    let deadline = Instant::now() + Duration::from_secs(240);
    while guard.child.as_mut().unwrap().try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the faulty run did not finish");
        let first = stopped(&job);
        if first.is_empty() {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        // Give a second rank of the same event time to stop too.
        std::thread::sleep(Duration::from_millis(300));
        let victims = stopped(&job);
        events += 1;
        let ranks: Vec<usize> = victims.iter().map(|v| v.0).collect();
        if events == 4 {
            // D: flip a bit of rank 0's newest sealed snapshot; recovery
            // must detect it and fall back to the older slot.
            let store = hatrain_shared::shm::Store::open(&hatrain_shared::shm::store_path(
                &store_dir(&shm, &job),
                0,
            ))
            .unwrap();
            let newest = store.sealed()[0];
            store.corrupt_slot_byte(newest.slot, 4096 + 123);
            flipped_step = Some(newest.step);
        }
        if events == 7 {
            // G: the job is stuck on a stopped rank; the agent still answers
            // and reports what it has repaired so far.
            let st = agentctl_status(&socket);
            assert_eq!(st.faults.len(), 7, "{:?}", st.faults);
            for f in &st.faults {
                assert!(f.recovery_s.is_some_and(|s| s > 0.0), "{f:?}");
                assert!(f.s_star.is_some() && f.steps_lost.is_some(), "{f:?}");
            }
            let restarts: Vec<u64> = st.workers.iter().map(|w| w.restarts).collect();
            assert_eq!(restarts, vec![1, 2, 2, 2]);
            assert!(
                st.workers
                    .iter()
                    .all(|w| w.pid.is_some() && w.last_snapshot.is_some())
            );
        }
        for &(_, pid) in &victims {
            kill(pid, libc::SIGKILL);
        }
        killed.push(ranks);
        // Wait until the victims are gone before looking for the next event.
        assert!(wait_until(Duration::from_secs(30), || victims
            .iter()
            .all(|&(_, p)| proc_state(p).is_none_or(|s| s == 'Z'))));
    }
    let out = guard.wait_output(Duration::from_secs(30));
    assert_success(&out, "faulty run");
    assert_eq!(
        killed,
        vec![
            vec![1],
            vec![2],
            vec![3],
            vec![0],
            vec![1, 3],
            vec![2],
            vec![0]
        ],
        "the planned faults, in order"
    );

    let (a, b) = (read_log(&ref_log), read_log(&log));
    assert_eq!(
        final_checksum(&a),
        final_checksum(&b),
        "final parameters differ"
    );
    let (la, lb) = (final_losses(&a), final_losses(&b));
    assert_eq!(la.len(), 60);
    assert_eq!(lb.keys().collect::<Vec<_>>(), la.keys().collect::<Vec<_>>());
    for (step, loss) in &la {
        assert_eq!(
            loss.to_bits(),
            lb[step].to_bits(),
            "loss of step {step} differs"
        );
    }
    // The agent's log tells what it decided and why.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.matches("restarting it in place").count(),
        8,
        "{stderr}"
    );
    assert_eq!(
        stderr
            .matches("recovered: first step after the fault completed")
            .count(),
        8
    );
    // D: the bit flip was detected and s* fell back below the flipped step.
    assert!(
        stderr.contains("checksum mismatch"),
        "bit flip not detected"
    );
    let flipped = flipped_step.unwrap();
    assert!(
        stderr.contains(&format!("s_star={}", flipped - 1)),
        "s* did not fall back below the flipped step {flipped}"
    );
    // No shared memory is left behind, and no process.
    assert!(!store_dir(&shm, &job).exists());
    assert!(job_pids(&job).is_empty());
}

#[test]
fn a_rank_that_always_crashes_is_given_up_on() {
    let d = tempfile::tempdir().unwrap();
    let job = job_id("always");
    let cmd = Launch::new(2)
        .job(&job)
        .worker_reboot()
        .shm_root(d.path())
        .args(tiny_args(20))
        .fault_plan("1:5:forward:kill:*")
        .command();
    let out = Job::spawn(cmd, &job).wait_output(Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + libc::SIGKILL), "{stderr}");
    assert!(
        stderr.contains("at step 4 on 3 attempts in a row"),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("restarting it in place").count(),
        2,
        "{stderr}"
    );
    assert!(job_pids(&job).is_empty(), "orphans left");
    assert!(!d.path().join(&job).exists(), "shared memory left behind");
}

#[test]
fn bad_ha_configuration_is_refused_at_start() {
    for (args, env, want) in [
        (
            vec!["--enable-worker-reboot"],
            None,
            "--enable-worker-reboot needs --enable-high-availability",
        ),
        (
            vec![],
            Some("recover,sometimes"),
            "unknown value \"sometimes\"",
        ),
    ] {
        let mut cmd = Command::new(agent());
        cmd.args(["launch", "--nproc-per-node", "2"])
            .args(&args)
            .args(["--", "true"]);
        match env {
            Some(v) => cmd.env("HIGH_AVAILABILITY", v),
            None => cmd.env_remove("HIGH_AVAILABILITY"),
        };
        let out = cmd.output().unwrap();
        assert_eq!(out.status.code(), Some(2));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(want), "{stderr}");
    }
    let out = Command::new(agent())
        .args([
            "launch",
            "--nproc-per-node",
            "1",
            "--enable-high-availability",
            "--",
            "true",
        ])
        .env_remove("HIGH_AVAILABILITY")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("a replica must exist"));
}

/// `launch` of the tiny model on 4 ranks with worker reboot.
fn reboot_launch(job: &str, shm: &std::path::Path, log: &std::path::Path, plan: &str) -> Command {
    reboot_launch_with(job, shm, log, plan, &[])
}

/// [`reboot_launch`] with more agent flags.
fn reboot_launch_with(
    job: &str,
    shm: &std::path::Path,
    log: &std::path::Path,
    plan: &str,
    flags: &[&str],
) -> Command {
    Launch::new(4)
        .job(job)
        .flags(flags)
        .worker_reboot()
        .option("--pause-timeout-secs", "20")
        // Three slots: a rank whose newest slot is rejected still shares an
        // older step with ranks that committed one step more.
        .option("--snapshot-slots", "3")
        .shm_root(shm)
        .args(tiny_args(40))
        .arg("--log-jsonl")
        .arg(log)
        .fault_plan(plan)
        .command()
}

fn reference_of_4(dir: &std::path::Path) -> String {
    let log = dir.join("ref.jsonl");
    let mut args = tiny_args(40);
    args.extend(["--log-jsonl".into(), log.display().to_string()]);
    assert_success(&run_launch(4, "hdr-ref", &args), "reference run");
    final_checksum(&read_log(&log))
}

#[test]
fn a_slot_header_that_lies_is_rejected_and_the_job_recovers_bit_identically() {
    use hatrain_shared::shm::{HeaderWord, Store, store_path};
    let d = tempfile::tempdir().unwrap();
    let want = reference_of_4(d.path());
    for word in [HeaderWord::Step, HeaderWord::Epoch, HeaderWord::Len] {
        let shm = d.path().join(format!("shm-{word:?}"));
        let log = d.path().join(format!("run-{word:?}.jsonl"));
        let job = job_id("hdr");
        let mut guard = Job::spawn(reboot_launch(&job, &shm, &log, "1:25:forward:stop"), &job);
        assert!(
            wait_until(Duration::from_secs(60), || stopped(&job).len() == 1),
            "rank 1 did not stop"
        );
        let (rank, pid) = stopped(&job)[0];
        assert_eq!(rank, 1);
        let store = Store::open(&store_path(&store_dir(&shm, &job), 1)).unwrap();
        let newest = store.sealed()[0];
        let value = match word {
            // The older slot's step: the header claims what it does not hold.
            HeaderWord::Step => newest.step - 1,
            HeaderWord::Epoch => newest.epoch + 7,
            _ => newest.len - 8,
        };
        store.tamper_header(newest.slot, word, value);
        drop(store);
        kill(pid, libc::SIGKILL);
        let out = guard.wait_output(Duration::from_secs(120));
        assert_success(&out, &format!("run with a lying {word:?} word"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("snapshot slot rejected") && stderr.contains("checksum mismatch"),
            "{word:?}: {stderr}"
        );
        assert!(
            stderr.contains(&format!("s_star={}", newest.step - 1)),
            "{word:?}: s* falls back below the lying slot's step {}: {stderr}",
            newest.step
        );
        assert_eq!(
            final_checksum(&read_log(&log)),
            want,
            "{word:?}: final parameters differ"
        );
        assert!(job_pids(&job).is_empty());
    }
}

#[test]
fn a_clean_exit_before_the_peers_finish_is_a_fault_and_recovered_bit_identically() {
    let d = tempfile::tempdir().unwrap();
    let want = reference_of_4(d.path());
    let (shm, log) = (d.path().join("shm"), d.path().join("run.jsonl"));
    let job = job_id("exit0");
    let out = Job::spawn(reboot_launch(&job, &shm, &log, "2:15:forward:exit0"), &job)
        .wait_output(Duration::from_secs(120));
    assert_success(&out, "run with an early clean exit");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rank 2 exited 0 after step 14")
            && stderr.contains("restarting it in place"),
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
fn a_rebuild_that_keeps_failing_is_retried_then_the_job_dumps_and_names_the_ranks() {
    let d = tempfile::tempdir().unwrap();
    let (shm, log, ckpt) = (
        d.path().join("shm"),
        d.path().join("run.jsonl"),
        d.path().join("ckpt"),
    );
    let job = job_id("rebuild");
    // Rank 1 is killed; rank 2 then cannot reach its next peer whenever it
    // resumes from step 8 or 9 (s* is 9, or 8 when the kill tore a commit).
    let plan = "1:10:forward:kill;2:8:rebuild:fail:*;2:9:rebuild:fail:*";
    let mut cmd = reboot_launch(&job, &shm, &log, plan);
    cmd.arg("--save").arg(&ckpt);
    let t = Instant::now();
    let out = Job::spawn(cmd, &job).wait_output(Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert_eq!(
        stderr.matches("trying again under a new epoch").count(),
        2,
        "{stderr}"
    );
    assert!(
        stderr.contains("could not be rebuilt under 3 epochs")
            && stderr.contains("rank 2 could not reach rank 3"),
        "{stderr}"
    );
    assert!(
        stderr.contains("last-words checkpoint of iteration"),
        "the dump comes first: {stderr}"
    );
    let it: u64 = std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!((8..=9).contains(&it), "{it}");
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
    assert!(job_pids(&job).is_empty());
}

#[test]
fn full_and_sliced_snapshots_both_recover_two_ranks_killed_at_once_bit_identically() {
    let d = tempfile::tempdir().unwrap();
    let want = reference_of_4(d.path());
    let mut bytes = Vec::new();
    for slices in ["off", "on"] {
        let (shm, log) = (
            d.path().join(format!("shm-{slices}")),
            d.path().join(format!("run-{slices}.jsonl")),
        );
        let job = job_id("slices");
        // Two ranks die at step 20: one inside the update, one halfway
        // through its snapshot copy.
        let cmd = reboot_launch_with(
            &job,
            &shm,
            &log,
            "1:20:update:kill;3:20:commit:kill",
            &["--snapshot-slices", slices],
        );
        let out = Job::spawn(cmd, &job).wait_output(Duration::from_secs(120));
        assert_success(&out, &format!("--snapshot-slices {slices}"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        let line = stderr
            .lines()
            .find(|l| l.contains("snapshot store created") && l.contains("rank=0"))
            .expect("rank 0's store");
        assert!(
            line.contains(&format!("sliced={}", slices == "on")),
            "{line}"
        );
        bytes.push(
            line.split_whitespace()
                .find_map(|w| w.strip_prefix("bytes="))
                .and_then(|b| b.parse::<u64>().ok())
                .expect("bytes="),
        );
        assert_eq!(
            final_checksum(&read_log(&log)),
            want,
            "--snapshot-slices {slices}: final parameters differ"
        );
        assert!(job_pids(&job).is_empty());
    }
    // 4 ranks: the parameters are held once across the group, a quarter
    // on each rank; the moments are each rank's own already.
    let params = hatrain_trainer::model::Model::new(
        "tiny"
            .parse::<hatrain_trainer::config::ModelSize>()
            .unwrap()
            .config(),
    )
    .numel() as u64
        * 4;
    assert_eq!(
        bytes[0] - bytes[1],
        params / 4 * 3,
        "sliced {} bytes against full {}",
        bytes[1],
        bytes[0]
    );
}

#[test]
fn a_rank_killed_after_its_last_step_was_sealed_is_replaced_and_finishes_bit_identical() {
    let d = tempfile::tempdir().unwrap();
    let train = |log: &std::path::Path| {
        let mut a = tiny_args(20);
        a.extend(["--log-jsonl".into(), log.display().to_string()]);
        a
    };
    let (ref_log, log) = (d.path().join("ref.jsonl"), d.path().join("faulty.jsonl"));
    let mut clean = reboot_pair(&[], &train(&ref_log));
    clean.env_remove("HATRAIN_FAULT_PLAN");
    let out = Job::spawn(clean, &job_id("last-ref")).wait_output(Duration::from_secs(120));
    assert_success(&out, "fault-free run");
    // Rank 0 is killed once its loop has ended at step 20, the last, with
    // that step sealed on every rank (rank 1 may have finished and left).
    let mut cmd = reboot_pair(&[], &train(&log));
    cmd.env("HATRAIN_FAULT_PLAN", "0:20:end:kill");
    let out = Job::spawn(cmd, &job_id("last")).wait_output(Duration::from_secs(120));
    let output = text(&out);
    assert_success(&out, "run with rank 0 killed after its last step");
    assert!(
        output.contains("rank 0: resumed at step 20, the last, under epoch 1"),
        "{output}"
    );
    assert!(!output.contains("did not complete"), "{output}");
    assert_eq!(
        final_checksum(&read_log(&log)),
        final_checksum(&read_log(&ref_log))
    );
}
