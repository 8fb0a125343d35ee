//! Warm standby workers (`--warm-standby K`): the agent keeps K extra
//! processes of the worker command that have done their start-up and park;
//! a rank that must be restarted (a SIGKILL, a UCE outside the registered
//! state) is handed to one, which restores from shared memory, and the
//! pool is refilled in the background. For the reference trainer and for a
//! PyTorch DDP job, the replacement is the standby (its pid was started
//! before the fault), the result is bit-identical to the fault-free run, a
//! standby that dies while parked is replaced, and a job that ends stops its
//! standbys and leaves no process behind.

mod common;

use common::python::{example, launch};
use common::{
    Job, final_checksum, job_id, job_pids, kill, read_log, reboot_pair, text, tiny_args, wait_until,
};
use std::path::Path;
use std::process::Output;
use std::time::Duration;

/// The value of `key=` in a log line of the agent.
fn field(line: &str, key: &str) -> Option<String> {
    let at = line.find(&format!(" {key}="))? + key.len() + 2;
    Some(line[at..].split_whitespace().next()?.to_string())
}

/// Pids of the standbys the agent started, in order, and the line each
/// started on.
fn standbys_started(out: &str) -> Vec<(i32, usize)> {
    out.lines()
        .enumerate()
        .filter(|(_, l)| l.contains("warm standby started"))
        .map(|(i, l)| (field(l, "pid").unwrap().parse().unwrap(), i))
        .collect()
}

/// The line number and pid of each `replacement started` of `rank`, with
/// whether it was a standby.
fn replacements(out: &str, rank: usize) -> Vec<(usize, i32, bool)> {
    out.lines()
        .enumerate()
        .filter(|(_, l)| {
            l.contains("replacement started") && field(l, "rank") == Some(rank.to_string())
        })
        .map(|(i, l)| {
            let pid = field(l, "pid").unwrap().parse().unwrap();
            (i, pid, field(l, "standby").as_deref() == Some("true"))
        })
        .collect()
}

/// The line on which a standby took a rank's place.
fn promoted(out: &str) -> usize {
    out.lines()
        .position(|l| l.contains("warm standby takes the rank's place"))
        .expect("a standby was promoted")
}

/// Runs `cmd` to the end and checks it left no process behind.
fn finish(mut job: Job) -> Output {
    let out = job.wait_output(Duration::from_secs(240));
    let tag = job.job.clone();
    assert!(
        wait_until(Duration::from_secs(5), || job_pids(&tag).is_empty()),
        "left behind: {:?}\n{}",
        job_pids(&tag),
        text(&out)
    );
    out
}

fn trainer_run(plan: Option<&str>, iters: u64, dir: &Path) -> (Output, String) {
    let log = dir.join(format!(
        "log-{}.jsonl",
        plan.unwrap_or("clean").replace(':', "_")
    ));
    let mut train = tiny_args(iters);
    train.extend(["--log-jsonl".into(), log.display().to_string()]);
    let mut cmd = reboot_pair(&["--warm-standby", "1"], &train);
    cmd.env_remove("HATRAIN_FAULT_PLAN");
    if let Some(p) = plan {
        cmd.env("HATRAIN_FAULT_PLAN", p);
    }
    let out = finish(Job::spawn(cmd, &job_id("standby")));
    let sum = final_checksum(&read_log(&log));
    (out, sum)
}

#[test]
fn the_trainer_hands_a_killed_or_uce_struck_rank_to_a_warm_standby_bit_identical() {
    let _one_at_a_time = common::python::serial();
    let dir = tempfile::tempdir().unwrap();
    let (clean, want) = trainer_run(None, 30, dir.path());
    assert!(clean.status.success(), "{}", text(&clean));
    // A SIGKILL, and a UCE outside the registered state (the process
    // cannot trust its memory: it needs a fresh one).
    // Rank 0 takes its time at step 2: the standby has parked by the fault
    // even on a loaded machine.
    for plan in [
        "0:2:forward:sleep1500;1:12:forward:kill",
        "0:2:forward:sleep1500;1:9:update:uce-outside",
    ] {
        let (out, sum) = trainer_run(Some(plan), 30, dir.path());
        let all = text(&out);
        assert!(out.status.success(), "{plan}: {all}");
        assert_eq!(sum, want, "{plan}: not bit-identical\n{all}");
        let started = standbys_started(&all);
        let repl = replacements(&all, 1);
        assert_eq!(repl.len(), 1, "{plan}: {all}");
        let (line, pid, standby) = repl[0];
        assert!(standby, "{plan}: the replacement was not a standby\n{all}");
        // The replacement is the first standby, started before the fault;
        // the pool is refilled after it.
        assert_eq!(started[0].0, pid, "{plan}: {all}");
        assert!(started[0].1 < line);
        let at = promoted(&all);
        assert!(
            started.len() >= 2 && started[1].1 > at,
            "{plan}: pool not refilled\n{all}"
        );
        assert!(all.contains("warm standby stopped"), "{plan}: {all}");
        // Once promoted, its output is labelled as the rank's.
        assert!(
            all.contains("[rank 1] rank 1: resumed at step")
                && !all.contains("[standby 0] rank 1: resumed"),
            "{plan}: {all}"
        );
    }
}

#[test]
fn a_ddp_rank_killed_is_replaced_by_a_warm_standby_bit_identical() {
    let _one_at_a_time = common::python::serial();
    let dir = tempfile::tempdir().unwrap();
    let script = example("torch_ddp.py");
    let run = |plan: Option<&str>, name: &str| {
        let log = dir.path().join(format!("{name}.{{rank}}.jsonl"));
        let args = [
            script.to_str().unwrap(),
            "--steps",
            "24",
            "--log-jsonl",
            log.to_str().unwrap(),
        ];
        let mut cmd = launch(2, &["--warm-standby", "1"], &args, dir.path());
        cmd.env_remove("HATRAIN_FAULT_PLAN");
        if let Some(p) = plan {
            cmd.env("HATRAIN_FAULT_PLAN", p);
        }
        let out = finish(Job::spawn(cmd, &job_id("torch-standby")));
        let read = |r: usize| read_log(&dir.path().join(format!("{name}.{r}.jsonl")));
        (out, [read(0), read(1)])
    };
    let digest = |log: &[serde_json::Value]| {
        log.iter()
            .find(|e| e["event"] == "final")
            .map(|e| e["model_sha256"].as_str().unwrap().to_string())
            .expect("final event")
    };
    let (clean, logs) = run(None, "clean");
    assert!(clean.status.success(), "{}", text(&clean));
    let want = digest(&logs[0]);
    for (point, step) in [("forward", 9), ("update", 14), ("commit", 17)] {
        // Rank 0 takes its time at step 2, so that the standby (importing
        // torch meanwhile, on a loaded machine) has parked by the fault:
        // a fault before that gets a fresh process instead.
        let plan = format!("0:2:forward:sleep6000;1:{step}:{point}:kill");
        let (out, logs) = run(Some(&plan), &format!("{point}-{step}"));
        let all = text(&out);
        assert!(out.status.success(), "{plan}: {all}");
        for log in &logs {
            assert_eq!(digest(log), want, "{plan}: not bit-identical\n{all}");
        }
        let repl = replacements(&all, 1);
        assert_eq!(repl.len(), 1, "{plan}: {all}");
        let (line, pid, standby) = repl[0];
        assert!(standby, "{plan}: {all}");
        let started = standbys_started(&all);
        assert_eq!(started[0].0, pid);
        assert!(started[0].1 < line && started.len() >= 2 && started[1].1 > promoted(&all));
        // In the job's logs: rank 1's second process is that standby, and
        // it was running before rank 1's first one died.
        let starts: Vec<_> = logs[1].iter().filter(|e| e["event"] == "start").collect();
        assert_eq!(starts.len(), 2, "{plan}: {:?}", logs[1]);
        assert_eq!(starts[1]["pid"], pid, "{plan}");
        assert_eq!(starts[1]["standby"], true);
        // It has the rank's environment, as a process started there would:
        // torch's error handler writes the rank's error file.
        assert_eq!(starts[1]["role_rank"], "1", "{plan}");
        let error_file = starts[1]["error_file"].as_str().unwrap_or_default();
        assert!(
            error_file.ends_with("/1/error.json") && starts[0]["error_file"] == error_file,
            "{plan}: {:?}",
            logs[1]
        );
        // And its output is labelled as the rank's.
        assert!(
            all.contains("[rank 1] rank 1: resumed at step")
                && !all.contains("[standby 0] rank 1: resumed"),
            "{plan}: {all}"
        );
        // Rank 0 never restarted.
        assert_eq!(logs[0].iter().filter(|e| e["event"] == "start").count(), 1);
    }
}

/// Pids of the job's processes started as standbys.
fn standby_pids(job: &str) -> Vec<i32> {
    job_pids(job)
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == b"HATRAIN_STANDBY=1"))
        })
        .collect()
}

#[test]
fn a_standby_that_dies_parked_is_replaced_and_the_next_fault_uses_its_successor() {
    let _one_at_a_time = common::python::serial();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log.jsonl");
    let mut train = tiny_args(40);
    train.extend(["--log-jsonl".into(), log.display().to_string()]);
    let (_, want) = trainer_run(None, 40, dir.path());
    // Rank 0 pauses at step 5 long enough for the test to kill the parked
    // standby; rank 1 is killed at step 30, after its successor parked.
    let mut cmd = reboot_pair(&["--warm-standby", "1"], &train);
    cmd.env(
        "HATRAIN_FAULT_PLAN",
        "0:5:forward:sleep3000;1:30:forward:kill",
    );
    let tag = job_id("standby-dies");
    let job = Job::spawn(cmd, &tag);
    assert!(wait_until(Duration::from_secs(60), || standby_pids(&tag)
        .len()
        == 1));
    let first = standby_pids(&tag)[0];
    kill(first, libc::SIGKILL);
    let out = finish(job);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(
        all.contains("warm standby exited unused: starting another"),
        "{all}"
    );
    let started = standbys_started(&all);
    assert_eq!(started[0].0, first);
    let repl = replacements(&all, 1);
    assert_eq!(repl.len(), 1, "{all}");
    assert!(repl[0].2, "{all}");
    assert_eq!(
        repl[0].1, started[1].0,
        "the successor took the rank\n{all}"
    );
    assert_eq!(final_checksum(&read_log(&log)), want);
}
