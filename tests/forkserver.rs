//! Workers forked from a preloaded Python (`hatrain-agent launch --preload
//! MODULES`), under a real agent.
//!
//! - A forked worker is what `python SCRIPT ARGS` or `python -m MODULE
//!   ARGS` would have started: a fresh `__main__`, its arguments and path,
//!   its rank's environment, its command in `/proc/PID/cmdline`, the agent
//!   as its parent, a process group of its own, the workers' OOM score,
//!   stdin from /dev/null, numpy's generator seeded afresh, its output
//!   forwarded and labelled, and its exit status reported as it is.
//! - A server that cannot import its modules leaves the workers to start
//!   afresh, the job runs, and nothing is left.
//! - `examples/torch_ddp.py` with `--preload torch,torch._dynamo`: a rank
//!   SIGKILLed is replaced by a worker forked from the server; the server
//!   SIGKILLed is started again; a second rank SIGKILLed then is replaced
//!   too; the parameters end bit-identical to the fault-free run without a
//!   server, and nothing of the job is left when it ends.

mod common;

use common::python::{example, launch, launch_plain, python, script};
use common::{Job, job_id, job_pids, kill, read_log, text, wait_until};
use std::path::Path;
use std::time::Duration;

fn report(dir: &Path, rank: usize) -> serde_json::Value {
    let path = dir.join(format!("rank{rank}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap()
}

/// `launch` of 2 ranks of `python ARGS` with only the `extra` flags, its
/// workers' reports going to `dir`.
fn plain_launch(extra: &[&str], args: &[&str], dir: &Path) -> std::process::Command {
    let mut c = launch_plain(2, extra, args, dir);
    c.env_remove("HATRAIN_FAULT_PLAN").env("FORKED_OUT", dir);
    c
}

#[test]
fn a_forked_worker_is_what_python_would_have_started() {
    let _one_at_a_time = common::python::serial();
    let file = script("forked.py");
    let folder = file.parent().unwrap().canonicalize().unwrap();
    let file_s = file.to_str().unwrap();
    // As a script, then as a module (found through PYTHONPATH, which the
    // server had at its start).
    for (args, argv0, path0) in [
        (
            vec!["-u", file_s, "--flag", "x"],
            file_s.to_string(),
            folder.clone(),
        ),
        (
            vec!["-u", "-m", "forked", "--flag", "x"],
            folder.join("forked.py").display().to_string(),
            std::path::PathBuf::new(),
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = plain_launch(&["--preload", "xml.dom.minidom,numpy"], &args, dir.path());
        cmd.env("PYTHONPATH", &folder);
        let mut job = Job::spawn(cmd, &job_id("forked"));
        let agent = job.pid();
        let out = job.wait_output(Duration::from_secs(120));
        let output = text(&out);
        assert!(out.status.success(), "{args:?}: {output}");
        for rank in 0..2 {
            let r = report(dir.path(), rank);
            let what = format!("{args:?} rank {rank}: {r}");
            assert_eq!(r["name"], "__main__", "{what}");
            assert_eq!(
                r["argv"],
                serde_json::json!([argv0, "--flag", "x"]),
                "{what}"
            );
            if path0.as_os_str().is_empty() {
                // `python -m`: the working folder.
                assert_eq!(
                    Path::new(r["path0"].as_str().unwrap())
                        .canonicalize()
                        .unwrap(),
                    dir.path().canonicalize().unwrap(),
                    "{what}"
                );
            } else {
                assert_eq!(r["path0"], path0.display().to_string(), "{what}");
            }
            assert_eq!(r["preloaded"], true, "{what}");
            assert_eq!(r["ppid"], agent, "{what}");
            assert_eq!(r["pgid"], r["pid"], "{what}");
            assert_eq!(r["oom_score_adj"], "500", "{what}");
            assert_eq!(r["stdin"], "/dev/null", "{what}");
            let cmdline: Vec<String> = serde_json::from_value(r["cmdline"].clone()).unwrap();
            let mut want = vec![python().display().to_string()];
            want.extend(args.iter().map(|a| a.to_string()));
            assert_eq!(cmdline, want, "{what}");
            assert_eq!(r["rank_env"], rank.to_string(), "{what}");
            assert_eq!(r["server_names"], serde_json::json!([]), "{what}");
            assert_eq!(
                r["file"],
                folder.join("forked.py").display().to_string(),
                "{what}"
            );
            assert!(
                Path::new(r["dunder_file"].as_str().unwrap()).is_absolute(),
                "{what}"
            );
            assert!(
                output.contains(&format!("[rank {rank}] hello from rank {rank}")),
                "{output}"
            );
            assert!(
                output.contains(&format!("[rank {rank}] warning from rank {rank}")),
                "{output}"
            );
            assert!(
                output.contains(&format!(
                    "worker started rank={rank} local_rank={rank} pid={} from_server=true",
                    r["pid"]
                )),
                "{output}"
            );
        }
        assert!(output.contains("fork server ready"), "{output}");
        // Each rank drew its own numbers, as fresh processes do.
        let draws = [0, 1].map(|r| report(dir.path(), r)["numpy_draw"].as_f64().unwrap());
        assert_ne!(draws[0], draws[1], "{args:?}");
    }
}

#[test]
fn a_forked_workers_exit_status_is_reported_as_it_is() {
    let _one_at_a_time = common::python::serial();
    let dir = tempfile::tempdir().unwrap();
    let file = script("forked.py");
    let mut cmd = plain_launch(
        &["--preload", "json"],
        &[file.to_str().unwrap()],
        dir.path(),
    );
    cmd.env("FORKED_EXIT", "3");
    let out = Job::spawn(cmd, &job_id("forked-exit")).wait_output(Duration::from_secs(120));
    let output = text(&out);
    assert!(!out.status.success(), "{output}");
    assert!(output.contains("exit code 3"), "{output}");
    assert!(output.contains("from_server=true"), "{output}");
}

#[test]
fn a_server_that_cannot_import_its_modules_leaves_the_workers_to_start_afresh() {
    let _one_at_a_time = common::python::serial();
    let dir = tempfile::tempdir().unwrap();
    let file = script("forked.py");
    let cmd = plain_launch(
        &["--preload", "no_such_module_here"],
        &[file.to_str().unwrap()],
        dir.path(),
    );
    let id = job_id("forked-bad");
    let out = Job::spawn(cmd, &id).wait_output(Duration::from_secs(120));
    let output = text(&out);
    assert!(out.status.success(), "{output}");
    let left = job_pids(&id);
    assert!(left.is_empty(), "left behind: {left:?}: {output}");
    assert!(
        output.contains("cannot import no_such_module_here"),
        "{output}"
    );
    assert_eq!(output.matches("from_server=false").count(), 2, "{output}");
    for rank in 0..2 {
        assert_eq!(report(dir.path(), rank)["preloaded"], false);
    }
}

/// Pids of the job's fork servers.
fn servers(job: &str) -> Vec<i32> {
    job_pids(job)
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.windows(18).any(|w| w == b"hatrain.forkserver"))
        })
        .collect()
}

fn digest(log: &[serde_json::Value]) -> String {
    let f: Vec<_> = log.iter().filter(|e| e["event"] == "final").collect();
    assert_eq!(f.len(), 1, "{log:?}");
    f[0]["model_sha256"].as_str().unwrap().to_string()
}

fn starts(log: &[serde_json::Value]) -> Vec<i32> {
    log.iter()
        .filter(|e| e["event"] == "start")
        .filter_map(|e| e["pid"].as_i64().map(|p| p as i32))
        .collect()
}

#[test]
fn ddp_ranks_forked_from_a_preloaded_server_recover_bit_identical_through_the_servers_death() {
    let _one_at_a_time = common::python::serial();
    let script = example("torch_ddp.py");
    let run = |extra: &[&str], step_ms: &str, faults: bool| {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log.{rank}.jsonl");
        let args = [
            script.to_str().unwrap(),
            "--steps",
            "24",
            "--step-ms",
            step_ms,
            "--log-jsonl",
            log.to_str().unwrap(),
        ];
        let mut cmd = launch(2, extra, &args, dir.path());
        cmd.env_remove("HATRAIN_FAULT_PLAN");
        let id = job_id("forked-ddp");
        let mut job = Job::spawn(cmd, &id);
        let read = |r: usize| read_log(&dir.path().join(format!("log.{r}.jsonl")));
        let steps = |r: usize| read(r).iter().filter(|e| e["event"] == "step").count();
        if faults {
            // Rank 1, while the first server serves.
            assert!(wait_until(Duration::from_secs(120), || steps(0) >= 4));
            let first = servers(&id);
            assert_eq!(first.len(), 1, "{first:?}");
            kill(*starts(&read(1)).last().unwrap(), libc::SIGKILL);
            assert!(
                wait_until(Duration::from_secs(120), || starts(&read(1)).len() == 2
                    && steps(0) >= 10),
                "rank 1 was not replaced"
            );
            // The server, which is started again.
            kill(first[0], libc::SIGKILL);
            assert!(
                wait_until(Duration::from_secs(30), || {
                    let now = servers(&id);
                    now.len() == 1 && now[0] != first[0]
                }),
                "no second fork server"
            );
            // Rank 0, forked from the new server or started afresh.
            kill(*starts(&read(0)).last().unwrap(), libc::SIGKILL);
        }
        let out = job.wait_output(Duration::from_secs(240));
        let output = text(&out);
        assert!(out.status.success(), "{output}");
        let left = job_pids(&id);
        assert!(left.is_empty(), "left behind: {left:?}: {output}");
        let logs = [read(0), read(1)];
        assert_eq!(digest(&logs[0]), digest(&logs[1]), "{output}");
        (digest(&logs[0]), logs, output)
    };
    let (want, _, _) = run(&[], "0", false);
    let (got, logs, output) = run(&["--preload", "torch,torch._dynamo"], "150", true);
    assert_eq!(got, want, "{output}");
    for (rank, log) in logs.iter().enumerate() {
        assert_eq!(starts(log).len(), 2, "rank {rank}: {output}");
    }
    // Both first workers and rank 1's replacement came from the server.
    assert_eq!(
        output.matches("worker started rank=1 local_rank=1").count(),
        2,
        "{output}"
    );
    let rank1_forked = output
        .lines()
        .filter(|l| l.contains("worker started rank=1") && l.contains("from_server=true"))
        .count();
    assert_eq!(rank1_forked, 2, "{output}");
    assert!(
        output.contains("the fork server ended: starting another"),
        "{output}"
    );
    assert_eq!(output.matches("fork server started").count(), 2, "{output}");
}
