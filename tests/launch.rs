//! `hatrain-agent launch` with real workers and real signals: a worker killed
//! with SIGKILL stops the job, SIGTERM stops it cleanly, and no process of the
//! job survives either way (checked by pid and by job id).

mod common;
use common::*;
use std::collections::HashSet;
use std::time::{Duration, Instant};

/// Starts a long 4-rank job and waits until its workers train.
fn start_long_job(name: &str) -> (Job, tempfile::TempDir, HashSet<i32>) {
    let d = tempfile::tempdir().unwrap();
    let log = d.path().join("log.jsonl");
    let job = job_id(name);
    let mut args = tiny_args(1_000_000);
    args.extend(["--log-jsonl".to_string(), log.display().to_string()]);
    let guard = Job::spawn(launch_cmd(4, &job, &args), &job);
    let launcher = guard.pid();
    let mut workers = HashSet::new();
    assert!(
        wait_until(Duration::from_secs(60), || {
            workers = children(launcher);
            workers.len() == 4 && losses(&read_log(&log)).len() >= 3
        }),
        "workers did not start training"
    );
    (guard, d, workers)
}

fn alive(pid: i32) -> bool {
    // A zombie still answers kill(0); the /proc state tells them apart.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

#[test]
fn a_killed_worker_stops_the_job_and_leaves_no_orphans() {
    let (mut job, _dir, workers) = start_long_job("kill");
    let victim = *workers
        .iter()
        .find(|&&p| rank_of(p) == Some(2))
        .expect("rank 2 found");
    let t0 = Instant::now();
    kill(victim, libc::SIGKILL);
    let out = job.wait_output(Duration::from_secs(60));
    let took = t0.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "launch must fail when a worker dies");
    let code = out.status.code().expect("exit code");
    assert_ne!(code, 0);
    // The failing rank's code is the launcher's: 137 for the SIGKILLed rank,
    // or the error code of a peer that noticed first.
    assert!(stderr.contains("failed"), "{stderr}");
    assert!(
        stderr.contains("rank=2") || stderr.contains("rank 2"),
        "{stderr}"
    );
    for w in &workers {
        assert!(!alive(*w), "worker {w} survived the launcher");
    }
    assert!(
        job_pids(&job.job).is_empty(),
        "orphans: {:?}",
        job_pids(&job.job)
    );
    eprintln!("kill -> launcher exit {code} in {took:?}");
}

#[test]
fn sigterm_stops_the_workers_cleanly() {
    let (mut job, _dir, workers) = start_long_job("term");
    kill(job.pid(), libc::SIGTERM);
    let out = job.wait_output(Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(128 + libc::SIGTERM), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("shutdown requested"), "{stderr}");
    for w in &workers {
        assert!(!alive(*w), "worker {w} survived SIGTERM to the launcher");
    }
    assert!(job_pids(&job.job).is_empty());
}

#[test]
fn worker_exit_code_is_the_launchers() {
    // A worker command that fails at once with its own code.
    let job = job_id("code");
    let cmd = Launch::bare(2)
        .job(&job)
        .program("sh")
        .args(["-c", "if [ \"$RANK\" = 1 ]; then exit 7; fi; sleep 30"])
        .command();
    let out = Job::spawn(cmd, &job).wait_output(Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    assert!(job_pids(&job).is_empty());
}

#[test]
fn bad_flags_are_usage_errors() {
    let out = std::process::Command::new(agent())
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "5",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("node rank 5 is outside --nnodes 2"),
        "{stderr}"
    );
}

#[test]
fn job_ids_that_are_not_names_are_refused_before_anything_is_touched() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("a/b/shm");
    let victim = d.path().join("victim");
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::write(victim.join("data"), b"precious").unwrap();
    let long = "j".repeat(65);
    for id in [
        "..",
        "../../../victim",
        "a/b",
        "",
        "a\nb",
        "/abs",
        long.as_str(),
    ] {
        let out = Launch::bare(2)
            .job(id)
            .shm_root(&root)
            .program("true")
            .env_remove("HATRAIN_JOB_ID")
            .command()
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{id:?}: {stderr}");
        assert!(
            stderr.contains("job id") && stderr.contains("is refused"),
            "{id:?}: {stderr}"
        );
        let out = std::process::Command::new(agentctl())
            .args(["--job", id, "status"])
            .output()
            .unwrap();
        assert!(!out.status.success(), "agentctl takes {id:?}");
    }
    // The environment is checked the same way.
    let out = Launch::bare(2)
        .shm_root(&root)
        .program("true")
        .env("HATRAIN_JOB_ID", "../victim")
        .command()
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(!root.exists(), "nothing was created");
    assert_eq!(std::fs::read(victim.join("data")).unwrap(), b"precious");
}

#[test]
fn an_untrusted_shm_root_or_job_folder_is_refused_and_nothing_is_written_there() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let launch = |root: &std::path::Path, job: &str| {
        let out = Launch::bare(2)
            .job(job)
            .shm_root(root)
            .program("true")
            .command()
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    // A root another user made beforehand, open to everyone.
    let open = d.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    if nix::unistd::geteuid().is_root() {
        nix::unistd::chown(&open, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
    }
    let (code, stderr) = launch(&open, "j");
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains(&open.display().to_string())
            && stderr.contains("0777")
            && (stderr.contains("belongs to uid 65534") || stderr.contains("others may write")),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_dir(&open).unwrap().count(),
        0,
        "nothing written"
    );
    // A symlink in place of the root, and in place of the job folder.
    let real = d.path().join("real");
    std::fs::create_dir(&real).unwrap();
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o700)).unwrap();
    let link = d.path().join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let (code, stderr) = launch(&link, "j");
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("symbolic link"), "{stderr}");
    let elsewhere = d.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, real.join("j")).unwrap();
    let (code, stderr) = launch(&real, "j");
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("real/j") && stderr.contains("symbolic link"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_dir(&elsewhere).unwrap().count(),
        0,
        "nothing written"
    );
}
