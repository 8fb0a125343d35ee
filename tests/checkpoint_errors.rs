//! Bad checkpoint input gets a clear error naming the file and changes
//! nothing on disk; a save that fails halfway (a full disk) leaves the
//! previous checkpoint loadable.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

/// Runs the trainer as a one-rank job.
fn train(args: &[String]) -> Output {
    Command::new(trainer())
        .args(args)
        .env_remove("WORLD_SIZE")
        .env_remove("RANK")
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap()
}

fn make_checkpoint(dir: &Path) {
    let mut args = tiny_args(4);
    args.extend(["--save".into(), dir.display().to_string()]);
    let out = train(&args);
    assert_success(&out, "initial save");
}

/// Every file under `dir` with its contents, to prove nothing changed.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// Loads (and would save into) `dir`; must fail with exit code 3 and an error
/// naming `must_name` and `reason`, leaving every file as it was.
fn expect_load_error(dir: &Path, extra: &[&str], must_name: &str, reason: &str) {
    let before = snapshot(dir);
    let mut args = tiny_args(8);
    args.extend(["--load".into(), dir.display().to_string()]);
    args.extend(["--save".into(), dir.display().to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let out = train(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains(must_name),
        "error does not name {must_name}: {stderr}"
    );
    assert!(
        stderr.contains(reason),
        "error does not say {reason:?}: {stderr}"
    );
    assert_eq!(snapshot(dir), before, "a failed load changed files");
}

#[test]
fn bad_inputs_are_named_and_nothing_is_overwritten() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("ckpt");
    make_checkpoint(&dir);
    let tracker = dir.join("latest_checkpointed_iteration.txt");
    let rank0 = dir.join("iter_0000004/rank_00000");

    // Missing tracker.
    let empty = d.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    expect_load_error(
        &empty,
        &[],
        "latest_checkpointed_iteration.txt",
        "no checkpoint tracker",
    );

    // Garbled tracker.
    std::fs::write(&tracker, "four\n").unwrap();
    expect_load_error(&dir, &[], "latest_checkpointed_iteration.txt", "garbled");
    std::fs::write(&tracker, "4\n").unwrap();

    // Bit-flipped and truncated safetensors.
    for (file, reason) in [
        ("model.safetensors", "checksum mismatch"),
        ("optim.safetensors", "truncated"),
    ] {
        let path = rank0.join(file);
        let good = std::fs::read(&path).unwrap();
        let mut bad = good.clone();
        if reason == "truncated" {
            bad.truncate(good.len() / 2);
        } else {
            let i = good.len() - 17;
            bad[i] ^= 0x04;
        }
        std::fs::write(&path, &bad).unwrap();
        expect_load_error(&dir, &[], &format!("rank_00000/{file}"), reason);
        std::fs::write(&path, &good).unwrap();
    }

    // Another model shape.
    expect_load_error(
        &dir,
        &["--d-model", "32"],
        "rank_00000/meta.json",
        "another model shape",
    );

    // Missing rank directory.
    let aside = d.path().join("aside");
    std::fs::rename(&rank0, &aside).unwrap();
    expect_load_error(&dir, &[], "rank_00000", "rank directory missing");
    std::fs::rename(&aside, &rank0).unwrap();

    // Repaired, it loads and trains on.
    let mut args = tiny_args(8);
    args.extend(["--load".into(), dir.display().to_string()]);
    assert_success(&train(&args), "load after repair");
}

#[test]
fn reduced_loads_warn_that_the_resume_is_not_exact() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("ckpt");
    make_checkpoint(&dir);
    for flag in ["--finetune", "--no-load-optim", "--no-load-rng"] {
        let mut args = tiny_args(6);
        args.extend(["--load".into(), dir.display().to_string(), flag.into()]);
        let out = train(&args);
        assert_success(&out, flag);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(flag) && stderr.contains("NOT exact"),
            "{flag}: {stderr}"
        );
    }
}

/// A tmpfs of a fixed size, unmounted on drop.
struct SmallDisk(PathBuf);

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A 12 MiB tmpfs under `d` (the small model's checkpoint is ~8 MB: one
/// fits, two do not), or `None` without root.
fn small_disk(d: &Path) -> Option<SmallDisk> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: mounting a small tmpfs needs root");
        return None;
    }
    let mnt = d.join("disk");
    std::fs::create_dir(&mnt).unwrap();
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=12m", "tmpfs"])
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(st.success(), "mount tmpfs failed");
    Some(SmallDisk(mnt))
}

fn small_model_args(iters: &str) -> Vec<String> {
    s(&[
        "--model-size",
        "small",
        "--global-batch",
        "4",
        "--seq-len",
        "8",
        "--train-iters",
        iters,
        "--save-interval",
        "2",
        "--log-interval",
        "1000",
    ])
}

/// The checkpoint of iteration 2 on the full disk is intact and resumes.
fn resumes_from_iteration_2(mnt: &Path) {
    assert_eq!(
        std::fs::read_to_string(mnt.join("latest_checkpointed_iteration.txt")).unwrap(),
        "2\n"
    );
    let names: Vec<String> = std::fs::read_dir(mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        !names.iter().any(|n| n.ends_with("_tmp")),
        "a partial checkpoint was left: {names:?}"
    );
    let mut resume = small_model_args("4");
    resume.extend(["--load".into(), mnt.display().to_string()]);
    let out = train(&resume);
    assert_success(&out, "resume from the checkpoint before the failed save");
    assert!(String::from_utf8_lossy(&out.stdout).contains("resumed from"));
}

#[test]
fn a_save_that_runs_out_of_disk_leaves_the_previous_checkpoint() {
    let d = tempfile::tempdir().unwrap();
    let Some(disk) = small_disk(d.path()) else {
        return;
    };
    let mut full = small_model_args("4");
    full.extend(["--save".into(), disk.0.display().to_string()]);
    let out = train(&full);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(
        stderr.contains("saving iteration 4 failed; the previous checkpoint is intact"),
        "{stderr}"
    );
    assert!(stderr.contains("No space left on device"), "{stderr}");
    // The trainer's own save leaves its partial directory for the next save
    // to clear; the agent's removes it (checked below).
    let _ = std::fs::remove_dir_all(disk.0.join("iter_0000004_tmp"));
    resumes_from_iteration_2(&disk.0);
}

#[test]
fn an_agent_save_that_runs_out_of_disk_says_so_and_keeps_the_previous() {
    let d = tempfile::tempdir().unwrap();
    let Some(disk) = small_disk(d.path()) else {
        return;
    };
    // Iteration 2 is on the disk (saved by a plain run); the agent's save of
    // the final iteration 4 of the resumed run then does not fit.
    let mnt = disk.0.display().to_string();
    let mut first = small_model_args("2");
    first.extend(s(&["--save", &mnt]));
    assert_success(&train(&first), "the first two steps");
    let mut full = small_model_args("4");
    full.extend(s(&["--save", &mnt, "--load", &mnt]));
    let job = job_id("full-disk");
    let out = Job::spawn(launch_cmd(1, &job, &full), &job).wait_output(Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(
        stderr.contains("its final checkpoint could not be written")
            && stderr.contains("No space left on device")
            && stderr.contains("the newest checkpoint on disk is iteration 2"),
        "{stderr}"
    );
    assert!(job_pids(&job).is_empty());
    resumes_from_iteration_2(&disk.0);
}
