//! A job among neighbours on one host: a second launch of a running job is
//! refused and changes nothing, two launches with default settings run side
//! by side, a stale folder of a killed agent is cleaned, a shm root too
//! small for the stores is a clear error (also when its space goes between
//! the check and the creation), and a worker killed by the OOM killer is
//! named as such, restarted once, then the job writes its last words and
//! stops.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

fn train_args(iters: u64, seed: u64, log: &Path) -> Vec<String> {
    let mut a = tiny_args(iters);
    a.extend(s(&["--seed", &seed.to_string(), "--log-jsonl"]));
    a.push(log.display().to_string());
    a
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Ranks of `job` stopped by their fault plan.
fn stopped(job: &str) -> Vec<(usize, i32)> {
    let mut v: Vec<(usize, i32)> = job_pids(job)
        .into_iter()
        .filter(|&p| proc_state(p) == Some('T'))
        .filter_map(|p| rank_of(p).map(|r| (r, p)))
        .collect();
    v.sort();
    v
}

#[test]
fn a_second_launch_of_a_running_job_is_refused_and_the_first_is_untouched() {
    let d = tempfile::tempdir().unwrap();
    let shm = d.path().join("shm");
    let (ref_log, log) = (d.path().join("ref.jsonl"), d.path().join("a.jsonl"));
    assert_success(
        &run_launch(2, "ref", &train_args(40, 1, &ref_log)),
        "fault-free run",
    );
    let job = job_id("first");
    let mut first = reboot_pair(
        &["--job-id", &job, "--shm-root", shm.to_str().unwrap()],
        &train_args(40, 1, &log),
    );
    // Rank 1 stops itself at step 25; the harness kills it after the
    // second launch was refused.
    first.env("HATRAIN_FAULT_PLAN", "1:25:forward:stop");
    let mut guard = Job::spawn(first, &job);
    assert!(
        wait_until(Duration::from_secs(60), || stopped(&job).len() == 1),
        "rank 1 did not reach its stop"
    );
    let folder = shm.join(&job);
    let before: Vec<PathBuf> = {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&folder)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        v
    };
    let second_tag = job_id("second");
    let out = Job::spawn(
        reboot_pair(
            &["--job-id", &job, "--shm-root", shm.to_str().unwrap()],
            &train_args(40, 1, &d.path().join("b.jsonl")),
        ),
        &second_tag,
    )
    .wait_output(Duration::from_secs(60));
    let said = text(&out);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains(&format!(
            "job {job} is already running (agent pid {}",
            guard.pid()
        )) && said.contains("started at")
            && said.contains("choose another --job-id"),
        "{said}"
    );
    assert!(
        !said.contains("stale"),
        "nothing was taken for stale: {said}"
    );
    assert!(
        job_pids(&second_tag).is_empty(),
        "the second launch started nothing"
    );
    let mut after: Vec<PathBuf> = std::fs::read_dir(&folder)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    after.sort();
    assert_eq!(before, after, "the first job's folder is untouched");
    assert!(!d.path().join("b.jsonl").exists());

    // The first job still recovers: its rank 1 is killed and rebooted.
    let (_, victim) = stopped(&job)[0];
    kill(victim, libc::SIGKILL);
    let out = guard.wait_output(Duration::from_secs(120));
    assert_success(&out, "the first job");
    assert!(
        text(&out).contains("restarting it in place"),
        "{}",
        text(&out)
    );
    assert_eq!(
        final_checksum(&read_log(&log)),
        final_checksum(&read_log(&ref_log)),
        "the first job ends bit-identical to the fault-free run"
    );
    assert!(!folder.exists() && !shm.exists(), "nothing left behind");
    assert!(job_pids(&job).is_empty());
}

/// The job id a launch made for itself, from its log.
fn made_id(said: &str) -> String {
    let line = said
        .lines()
        .find(|l| l.contains("job id made for this launch"))
        .unwrap_or_else(|| panic!("no made job id in: {said}"));
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("job="))
        .expect("job= field")
        .to_string()
}

#[test]
fn two_launches_with_default_settings_run_side_by_side() {
    let d = tempfile::tempdir().unwrap();
    // Rank 1 of each job naps at step 10, so both are running when
    // agentctl is asked to pick one.
    let nap = "1:10:forward:sleep1500";
    let solo = |seed: u64| {
        let log = d.path().join(format!("solo{seed}.jsonl"));
        let tag = job_id("solo");
        let mut c = reboot_pair(&[], &train_args(30, seed, &log));
        c.env("HATRAIN_FAULT_PLAN", nap);
        assert_success(
            &Job::spawn(c, &tag).wait_output(Duration::from_secs(120)),
            "a solo run",
        );
        final_checksum(&read_log(&log))
    };
    let (solo1, solo2) = (solo(1), solo(2));
    assert_ne!(solo1, solo2, "the two jobs train different models");

    let logs = [d.path().join("a.jsonl"), d.path().join("b.jsonl")];
    let tags = [job_id("side-a"), job_id("side-b")];
    let mut guards: Vec<Job> = (0..2)
        .map(|i| {
            let mut c = reboot_pair(&[], &train_args(30, i as u64 + 1, &logs[i]));
            c.env("HATRAIN_FAULT_PLAN", nap);
            Job::spawn(c, &tags[i])
        })
        .collect();
    // While both train, agentctl without --job names both and picks none.
    assert!(
        wait_until(Duration::from_secs(60), || logs.iter().all(|l| losses(
            &read_log(l)
        )
        .len()
            >= 10)),
        "both jobs train"
    );
    let ctl = Command::new(agentctl())
        .arg("status")
        .env_remove("HATRAIN_JOB_ID")
        .output()
        .unwrap();
    let listed = Command::new(agentctl())
        .args(["--json", "jobs"])
        .output()
        .unwrap();
    let outs: Vec<Output> = guards
        .iter_mut()
        .map(|g| g.wait_output(Duration::from_secs(120)))
        .collect();
    for o in &outs {
        assert_success(o, "a side-by-side run");
        assert!(!text(o).contains("stale"), "{}", text(o));
    }
    let ids: Vec<String> = outs.iter().map(|o| made_id(&text(o))).collect();
    assert_ne!(ids[0], ids[1], "default job ids differ");
    let ctl_err = String::from_utf8_lossy(&ctl.stderr);
    assert!(!ctl.status.success(), "agentctl must not guess: {ctl_err}");
    assert!(
        ctl_err.contains("choose one with --job")
            && ctl_err.contains(&ids[0])
            && ctl_err.contains(&ids[1]),
        "{ctl_err}"
    );
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.contains(&ids[0]) && listed.contains(&ids[1]),
        "{listed}"
    );
    assert_eq!(final_checksum(&read_log(&logs[0])), solo1);
    assert_eq!(final_checksum(&read_log(&logs[1])), solo2);
    let root = hatrain_shared::trust::default_shm_root();
    for id in &ids {
        assert!(!root.join(id).exists(), "{id}'s folder is removed");
    }
    for t in &tags {
        assert!(job_pids(t).is_empty());
    }
}

#[test]
fn a_stale_folder_of_a_killed_agent_is_cleaned_and_the_new_job_runs() {
    let d = tempfile::tempdir().unwrap();
    let shm = d.path().join("shm");
    let job = job_id("stale");
    let log = d.path().join("a.jsonl");
    let flags = [
        "--job-id",
        job.as_str(),
        "--shm-root",
        shm.to_str().unwrap(),
    ];
    let mut guard = Job::spawn(reboot_pair(&flags, &train_args(100_000, 1, &log)), &job);
    assert!(
        wait_until(Duration::from_secs(60), || losses(&read_log(&log)).len()
            >= 3),
        "the first job trains"
    );
    // The agent dies without cleaning up; its workers die with it.
    kill(guard.pid(), libc::SIGKILL);
    let _ = guard.wait_output(Duration::from_secs(30));
    assert!(
        wait_until(Duration::from_secs(30), || job_pids(&job).is_empty()),
        "the workers die with their agent"
    );
    let folder = shm.join(&job);
    assert!(
        folder.join("rank_00000.shm").exists(),
        "the killed agent left its stores"
    );
    assert!(folder.join("agent.lock").exists());
    std::fs::write(folder.join("notes.txt"), b"a user's file").unwrap();

    let log2 = d.path().join("b.jsonl");
    let out = Job::spawn(reboot_pair(&flags, &train_args(20, 1, &log2)), &job)
        .wait_output(Duration::from_secs(120));
    assert_success(&out, "the job in the stale folder");
    let said = text(&out);
    assert!(
        said.contains("removing a stale file of this job") && said.contains("rank_00000.shm"),
        "{said}"
    );
    assert_eq!(losses(&read_log(&log2)).len(), 20);
    // The user's file is left alone, so the folder stays with it only.
    let left: Vec<String> = std::fs::read_dir(&folder)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["notes.txt"]);
}

/// A tmpfs of `size` mounted under `dir` for the test, unmounted when
/// dropped; `None` (and a note) when the test cannot mount.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Option<Self> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: mounting a small tmpfs needs root");
            return None;
        }
        let mnt = dir.join("shm");
        std::fs::create_dir(&mnt).unwrap();
        let st = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(&mnt)
            .status()
            .unwrap();
        assert!(st.success(), "mount tmpfs failed");
        Some(Self(mnt))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

fn mapworker_launch(job: &str, root: &Path, worker: &[&str], save: &Path) -> Command {
    Launch::new(2)
        .job(job)
        .worker_reboot()
        .shm_root(root)
        .program(bin("hatrain-mapworker"))
        .args(worker)
        .arg("--save")
        .arg(save)
        .command()
}

/// The refusal names the root, the bytes needed and free, and the flags;
/// there was no bus error and nothing is left in the root.
fn refused_for_space(out: &Output, root: &Path, job: &str) {
    let said = text(out);
    assert_eq!(out.status.code(), Some(5), "{said}");
    assert!(
        said.contains(&format!("the shm root {} has", root.display()))
            && said.contains("bytes")
            && said.contains("free, but")
            && said.contains("need")
            && said.contains("--shm-root")
            && said.contains("--snapshot-slots"),
        "{said}"
    );
    assert!(
        !said.contains("Bus error") && !said.contains("SIGBUS"),
        "{said}"
    );
    assert!(
        said.contains("the job cannot run on this host"),
        "the exit summary says why: {said}"
    );
    assert!(!root.join(job).exists(), "the job folder is removed");
    assert!(job_pids(job).is_empty());
}

#[test]
fn a_shm_root_too_small_for_the_stores_is_refused_with_the_numbers() {
    let d = tempfile::tempdir().unwrap();
    let Some(fs) = Tmpfs::mount(d.path(), "16m") else {
        return;
    };
    let job = job_id("small-shm");
    // Two ranks of 20 MiB in 2 slots: about 80 MiB for a 16 MiB root.
    let out = Job::spawn(
        mapworker_launch(
            &job,
            &fs.0,
            &["--pad-mib", "20", "--steps", "5"],
            &d.path().join("ck"),
        ),
        &job,
    )
    .wait_output(Duration::from_secs(60));
    refused_for_space(&out, &fs.0, &job);
    assert_eq!(
        std::fs::read_dir(&fs.0).unwrap().count(),
        0,
        "the root is empty"
    );
}

#[test]
fn space_taken_between_the_check_and_the_creation_is_an_error_not_a_bus_error() {
    let d = tempfile::tempdir().unwrap();
    let Some(fs) = Tmpfs::mount(d.path(), "64m") else {
        return;
    };
    let job = job_id("shm-race");
    // Each store is about 24 MiB: both fit when rank 0 registers; rank 1
    // registers 3 s later, after the test has taken what was left.
    let mut guard = Job::spawn(
        mapworker_launch(
            &job,
            &fs.0,
            &[
                "--pad-mib",
                "12",
                "--steps",
                "5",
                "--delay-rank",
                "1",
                "--delay-ms",
                "3000",
            ],
            &d.path().join("ck"),
        ),
        &job,
    );
    let first = fs.0.join(&job).join("rank_00000.shm");
    assert!(
        wait_until(Duration::from_secs(30), || first.exists()),
        "rank 0's store is made"
    );
    // Take every block that is left, 1 MiB at a time, then page by page
    // (reserved, so really taken: a sparse file takes none).
    let filler = fs.0.join("filler");
    let f = std::fs::File::create(&filler).unwrap();
    let mut len = 0i64;
    for chunk in [1 << 20, 4096] {
        while nix::fcntl::fallocate(&f, nix::fcntl::FallocateFlags::empty(), len, chunk).is_ok() {
            len += chunk;
        }
    }
    let left = nix::sys::statvfs::statvfs(&fs.0)
        .unwrap()
        .blocks_available();
    assert_eq!(left, 0, "the tmpfs is full");
    let out = guard.wait_output(Duration::from_secs(60));
    std::fs::remove_file(&filler).unwrap();
    refused_for_space(&out, &fs.0, &job);
    assert!(
        text(&out).contains("No space left on device") || text(&out).contains("cannot reserve"),
        "{}",
        text(&out)
    );
    assert_eq!(
        std::fs::read_dir(&fs.0).unwrap().count(),
        0,
        "the root is empty"
    );
}

/// A memory cgroup made for the test: v2 where the machine has it, else
/// v1; removed (its processes killed) when dropped.
struct MemCgroup {
    dir: PathBuf,
}

impl MemCgroup {
    fn make(limit_bytes: u64) -> Option<Self> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: a memory cgroup needs root");
            return None;
        }
        let name = format!("hatrain-oom-{}", std::process::id());
        let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers");
        let (dir, limit_file) = if std::fs::read_to_string(v2).is_ok_and(|c| c.contains("memory")) {
            (Path::new("/sys/fs/cgroup").join(&name), "memory.max")
        } else if Path::new("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists() {
            (
                Path::new("/sys/fs/cgroup/memory").join(&name),
                "memory.limit_in_bytes",
            )
        } else {
            eprintln!(
                "skipped: this machine has no memory cgroup controller to limit a worker with"
            );
            return None;
        };
        if let Err(e) = std::fs::create_dir(&dir) {
            eprintln!(
                "skipped: cannot make a memory cgroup at {}: {e}",
                dir.display()
            );
            return None;
        }
        let cg = Self { dir };
        std::fs::write(cg.dir.join(limit_file), limit_bytes.to_string()).unwrap();
        let _ = std::fs::write(cg.dir.join("memory.swap.max"), "0");
        eprintln!(
            "memory cgroup {} limited to {limit_bytes} bytes",
            cg.dir.display()
        );
        Some(cg)
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        let procs = std::fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
        for p in procs
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            kill(p, libc::SIGKILL);
        }
        let _ = wait_until(Duration::from_secs(10), || {
            std::fs::read_to_string(self.dir.join("cgroup.procs"))
                .map(|s| s.trim().is_empty())
                .unwrap_or(true)
        });
        let _ = std::fs::remove_dir(&self.dir);
    }
}

#[test]
fn a_worker_out_of_memory_is_named_restarted_once_then_the_job_stops_with_its_last_words() {
    let d = tempfile::tempdir().unwrap();
    let Some(cg) = MemCgroup::make(256 << 20) else {
        return;
    };
    let (shm, save, log) = (
        d.path().join("shm"),
        d.path().join("ckpt"),
        d.path().join("log.jsonl"),
    );
    let job = job_id("oom");
    let mut train = train_args(40, 1, &log);
    train.extend(s(&[
        "--save",
        save.to_str().unwrap(),
        "--save-interval",
        "100",
    ]));
    // Rank 1 takes 1 GiB at step 6 in its first process, and again at step
    // 14 in its second; the second naps first, so agentctl can be asked
    // about the first kill meanwhile.
    let plan = "1:6:forward:alloc1024:0;1:10:forward:sleep2000:1;1:14:forward:alloc1024:1";
    let mut inner = reboot_pair(
        &["--job-id", &job, "--shm-root", shm.to_str().unwrap()],
        &train,
    );
    inner.env("HATRAIN_FAULT_PLAN", plan);
    // The agent (and so its workers) runs inside the cgroup.
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(r#"echo $$ > "$0/cgroup.procs" && exec "$@""#)
        .arg(&cg.dir)
        .arg(inner.get_program())
        .args(inner.get_args());
    for (k, v) in inner.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let mut guard = Job::spawn(cmd, &job);
    let socket = shm.join(&job).join("agent.sock");
    let seen = poll_agentctl(&socket, "faults", Duration::from_secs(120), |v| {
        v["faults"]
            .as_array()
            .and_then(|f| f.iter().find(|f| f["kind"] == "oom").cloned())
    });
    let out = guard.wait_output(Duration::from_secs(120));
    let said = text(&out);
    let fault = seen.unwrap_or_else(|| panic!("agentctl faults never showed an OOM kill: {said}"));
    assert_eq!(fault["ranks"], serde_json::json!([1]), "{fault}");
    assert!(
        fault["detail"].as_str().unwrap().contains("OOM killer")
            && fault["action"].as_str().unwrap().contains("restart rank 1"),
        "{fault}"
    );
    assert_eq!(out.status.code(), Some(137), "{said}");
    assert!(
        said.contains("ran out of memory") && said.contains("restarting it in place"),
        "the first kill is named and restarted: {said}"
    );
    assert!(
        said.contains("a restart at the same size would meet the same end"),
        "the second kill stops the job: {said}"
    );
    // The kernel may take a second victim while the first one's memory is
    // still being freed (seen here: rank 0, 6 ms after rank 1); each is
    // named for what it was.
    assert!(
        said.contains("ran out of memory (killed by the kernel's OOM killer"),
        "the exit summary names it: {said}"
    );
    assert!(
        said.contains("last-words checkpoint of iteration"),
        "last words before the stop: {said}"
    );
    let it: u64 = std::fs::read_to_string(save.join("latest_checkpointed_iteration.txt"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        (10..14).contains(&it),
        "the last words hold a step before the second kill: {it}"
    );
    assert!(!shm.exists(), "nothing left behind");
    assert!(job_pids(&job).is_empty());
}
