//! PyTorch under hatrain: `examples/torch_ddp.py` (a real DDP job, gloo,
//! AdamW, dropout) under a real `hatrain-agent launch`, its rank 1
//! SIGKILLed at three instants (the forward pass, inside the update fences
//! after `optimizer.step()`, halfway through the snapshot copy) at several
//! steps. Only that rank restarts; the job ends with parameters
//! bit-identical to the fault-free run. A recovery reads the other ranks'
//! slices of the sliced snapshots from their stores on this host, or, when
//! a rank cannot, gathers them over the process group.

mod common;

use common::examples::{DDP_STEPS, ExampleRun, events, final_digest, torch_ddp};
use common::python::{example, launch};
use common::{Job, job_id, kill, read_log, text, wait_until};
use std::path::Path;
use std::time::Duration;

fn run(plan: Option<&str>, script_args: &[&str]) -> ExampleRun {
    torch_ddp(plan, script_args, &[])
}

fn run_with(plan: Option<&str>, script_args: &[&str], env: &[(&str, &Path)]) -> ExampleRun {
    torch_ddp(plan, script_args, env)
}

/// The parameters' digest of the fault-free run with the default flags,
/// made once per test binary: every fault must end with it.
fn clean_digest() -> &'static str {
    static DIGEST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    DIGEST.get_or_init(|| {
        let clean = run(None, &[]);
        let want = digest(&clean.logs[0]);
        assert_eq!(digest(&clean.logs[1]), want, "DDP keeps the ranks equal");
        want
    })
}

fn digest(log: &[serde_json::Value]) -> String {
    final_digest(log, DDP_STEPS)
}

#[test]
fn a_ddp_rank_killed_in_forward_in_the_update_or_mid_commit_restarts_alone_bit_identical() {
    let _one_at_a_time = common::python::serial();
    let want = clean_digest();
    for (point, step) in [
        ("forward", 7),
        ("update", 13),
        ("commit", 19),
        ("forward", 16),
        ("update", 5),
        ("commit", 10),
    ] {
        let plan = format!("1:{step}:{point}:kill");
        let r = run(Some(&plan), &[]);
        for log in &r.logs {
            assert_eq!(digest(log), want, "{plan}: {}", r.output);
        }
        // Rank 0 trained on in one process; rank 1's replacement is new.
        let starts0 = events(&r.logs[0], "start");
        assert_eq!(starts0.len(), 1, "{plan}: rank 0 restarted");
        let starts1 = events(&r.logs[1], "start");
        assert_eq!(starts1.len(), 2, "{plan}: {:?}", r.logs[1]);
        assert_ne!(starts1[0]["pid"], starts1[1]["pid"]);
        for (rank, log) in r.logs.iter().enumerate() {
            let resumes = events(log, "resume");
            assert_eq!(resumes.len(), 1, "{plan}: rank {rank}: {log:?}");
            let at = resumes[0]["step"].as_u64().unwrap();
            // Back to a step at most two before the fault (the step being
            // copied, and the one a peer may have completed meanwhile).
            assert!((step - 2..step).contains(&at), "{plan}: resumed at {at}");
        }
        assert_eq!(
            r.output.matches("replacement started rank=1").count(),
            1,
            "{plan}: {}",
            r.output
        );
        assert!(!r.output.contains("replacement started rank=0"));
        // Nothing the job set up is left for the interpreter's exit to
        // find leaked (hatrain.torch freezes it; it is thawed at exit).
        assert!(!r.output.contains("leaked"), "{plan}: {}", r.output);
        // The other ranks' slices came from their stores on this host.
        assert!(
            !r.output.contains("gathering them over the process group"),
            "{plan}: {}",
            r.output
        );
    }
}

#[test]
fn a_rank_killed_while_the_job_restores_is_restarted_and_the_job_ends_bit_identical() {
    let _one_at_a_time = common::python::serial();
    let want = clean_digest();
    // Rank 1 is killed in step 13's update; rank 0 is killed once it has
    // restored its own slice of step 11 or 12, before it reads rank 1's.
    let plan = "1:13:update:kill;0:11:restore:kill;0:12:restore:kill";
    let r = run(Some(plan), &[]);
    for log in &r.logs {
        assert_eq!(digest(log), want, "{}", r.output);
    }
    assert!(
        r.output.contains("planned fault kill at step 1"),
        "{}",
        r.output
    );
    // Both ranks were replaced once: rank 0 in the middle of the recovery.
    // Rank 1's replacement, waiting for rank 0 to build the process group,
    // gave the build up when the agent paused the job again (it was not
    // left waiting until the pause timed out, then killed).
    for log in &r.logs {
        assert_eq!(events(log, "start").len(), 2, "{log:?}");
    }
    assert!(
        r.output
            .contains("rank 1: a rank failed while the job rebuilt under epoch 1"),
        "{}",
        r.output
    );
    assert!(!r.output.contains("did not pause"), "{}", r.output);
}

#[test]
fn a_rank_killed_after_its_last_step_was_sealed_is_replaced_and_the_job_ends_bit_identical() {
    let _one_at_a_time = common::python::serial();
    let want = clean_digest();
    // Rank 0 is killed once its loop has ended (step 24, the last, sealed):
    // its replacement restores step 24 and finishes, with no process group
    // to build (rank 1 may have finished and left).
    let r = run(Some("0:24:close:kill"), &[]);
    for log in &r.logs {
        assert_eq!(digest(log), want, "{}", r.output);
    }
    assert_eq!(events(&r.logs[0], "start").len(), 2, "{:?}", r.logs[0]);
    assert!(
        r.output
            .contains("rank 0: resumed at step 24, the last, under epoch 1"),
        "{}",
        r.output
    );
}

#[test]
fn ranks_that_cannot_read_each_others_stores_gather_the_slices_over_the_process_group_bit_identical()
 {
    let _one_at_a_time = common::python::serial();
    let want = clean_digest();
    // Rank 1 is killed in step 13's update; the job goes back to step 11
    // or 12, and rank 0's read of rank 1's store fails there (planned), so
    // every rank takes the process-group path.
    let plan = "1:13:update:kill;0:11:restore:no-siblings;0:12:restore:no-siblings";
    let r = run(Some(plan), &[]);
    for log in &r.logs {
        assert_eq!(digest(log), want, "{}", r.output);
    }
    assert_eq!(
        r.output
            .matches("gathering them over the process group")
            .count(),
        1,
        "{}",
        r.output
    );
    for log in &r.logs {
        assert_eq!(events(log, "resume").len(), 1, "{log:?}");
    }
}

#[test]
fn a_uce_in_a_ddp_ranks_parameters_is_repaired_in_the_same_process_bit_identical() {
    let _one_at_a_time = common::python::serial();
    let want = clean_digest();
    // Byte 40000 of part 1 (the flat parameters), at the forward pass.
    let r = run(Some("1:9:forward:uce-1-40000"), &[]);
    for log in &r.logs {
        assert_eq!(digest(log), want, "{}", r.output);
    }
    for log in &r.logs {
        assert_eq!(events(log, "start").len(), 1, "no process restarted");
        assert_eq!(events(log, "resume").len(), 1, "{log:?}");
    }
    assert!(
        r.output.contains("uncorrectable memory error"),
        "{}",
        r.output
    );
}

#[test]
fn a_ddp_model_with_batchnorm_buffers_comes_back_bit_identical() {
    let _one_at_a_time = common::python::serial();
    // BatchNorm's running statistics (float32) and batch counters (int64)
    // are module buffers: snapshotted and restored with the parameters.
    // Each rank's statistics are of its own batches: compared rank by rank.
    let clean = run(None, &["--batchnorm"]);
    let r = run(Some("1:11:update:kill"), &["--batchnorm"]);
    for (got, want) in r.logs.iter().zip(&clean.logs) {
        assert_eq!(digest(got), digest(want), "{}", r.output);
    }
    assert_eq!(events(&r.logs[1], "start").len(), 2, "{:?}", r.logs[1]);
    assert_ne!(
        digest(&clean.logs[0]),
        digest(&clean.logs[1]),
        "the ranks' own statistics are in the digest"
    );
}

/// A stand-in `torch_npu` (its recovery API only), which logs its calls
/// and says the bad address is `where_` (3: resident memory, repairable; 1:
/// outside the allocator, not).
fn fake_torch_npu(dir: &Path, where_: u32) -> std::path::PathBuf {
    let pkg = dir.join("torch_npu");
    std::fs::create_dir_all(&pkg).unwrap();
    std::fs::write(
        pkg.join("__init__.py"),
        format!(
            r#"import json, os
class _Npu:
    def _log(self, *call):
        with open(os.environ["FAKE_TORCH_NPU_LOG"], "a") as f:
            f.write(json.dumps(call) + "\n")
    def stop_device(self, d): self._log("stop_device", d)
    def check_uce_in_memory(self, d):
        self._log("check_uce_in_memory", d)
        return {where_}
    def restart_device(self, d): self._log("restart_device", d)
npu = _Npu()
"#
        ),
    )
    .unwrap();
    dir.to_path_buf()
}

#[test]
fn an_npu_uce_raised_in_a_ddp_step_is_repaired_in_place_or_restarts_the_rank_bit_identical() {
    let _one_at_a_time = common::python::serial();
    let want = clean_digest();
    // torch_npu's RuntimeError for ACL error 507053 ("UCE ERROR"), raised
    // in rank 1's forward pass, with the bad address in resident memory:
    // the step is repaired in the same processes.
    for (where_, repaired) in [(3, true), (1, false)] {
        let d = tempfile::tempdir().unwrap();
        let calls = d.path().join("calls.jsonl");
        let fake = fake_torch_npu(d.path(), where_);
        let r = run_with(
            Some("1:9:forward:npu-uce"),
            &[],
            &[("PYTHONPATH", &fake), ("FAKE_TORCH_NPU_LOG", &calls)],
        );
        for log in &r.logs {
            assert_eq!(digest(log), want, "{where_}: {}", r.output);
        }
        let called: Vec<serde_json::Value> = std::fs::read_to_string(&calls)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let starts1 = events(&r.logs[1], "start").len();
        if repaired {
            assert_eq!(
                called,
                vec![
                    serde_json::json!(["stop_device", 1]),
                    serde_json::json!(["check_uce_in_memory", 1]),
                    serde_json::json!(["restart_device", 1]),
                ]
            );
            assert_eq!(starts1, 1, "no process restarted: {}", r.output);
            assert!(
                r.output
                    .contains("the device reported an uncorrectable memory error (UCE ERROR)")
                    && r.output.contains("UCE: step repair rank=1"),
                "{}",
                r.output
            );
        } else {
            // Not repairable in place: the process goes and is restarted.
            assert_eq!(called.len(), 2, "{called:?}");
            assert_eq!(starts1, 2, "rank 1 restarted: {}", r.output);
            assert!(r.output.contains("restarting it in place"), "{}", r.output);
        }
        assert_eq!(
            events(&r.logs[0], "start").len(),
            1,
            "rank 0 never restarted"
        );
    }
}

/// Whether `pid` is a process of test job `job` (its environment carries the
/// job's tag): a pid read from a log is only signalled while it is.
fn of_job(pid: i32, job: &str) -> bool {
    let tag = format!("HATRAIN_TEST_TAG={job}");
    std::fs::read(format!("/proc/{pid}/environ"))
        .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == tag.as_bytes()))
}

#[test]
fn a_second_rank_killed_at_a_seeded_moment_of_the_first_recovery_ends_bit_identical() {
    let _one_at_a_time = common::python::serial();
    let want = clean_digest();
    for seed in 0..4u64 {
        // Rank 1 is SIGKILLed after step 6, then rank 0 a seeded moment
        // later: within the recovery, as it ends, or after it (up to 0.5 s
        // with a warm standby, whose recovery is short; 2 s without).
        let standby = seed % 2 == 0;
        let mut x = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        let delay = Duration::from_millis((x ^ (x >> 31)) % if standby { 500 } else { 2000 });
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log.{rank}.jsonl");
        let script = example("torch_ddp.py");
        let steps = DDP_STEPS.to_string();
        let args = [
            script.to_str().unwrap(),
            "--steps",
            &steps,
            "--step-ms",
            "30",
            "--log-jsonl",
            log.to_str().unwrap(),
        ];
        let extra: &[&str] = if standby {
            &["--warm-standby", "1"]
        } else {
            &[]
        };
        let mut cmd = launch(2, extra, &args, dir.path());
        cmd.env_remove("HATRAIN_FAULT_PLAN");
        let id = job_id("torch-race");
        let mut job = Job::spawn(cmd, &id);
        let read = |r: usize| read_log(&dir.path().join(format!("log.{r}.jsonl")));
        let pid = |r: usize| {
            events(&read(r), "start")
                .last()
                .and_then(|e| e["pid"].as_i64())
                .map(|p| p as i32)
        };
        let at_6 = wait_until(Duration::from_secs(120), || {
            events(&read(0), "step").len() >= 6 && pid(1).is_some()
        });
        assert!(at_6, "seed {seed}: no step 6");
        kill(pid(1).unwrap(), libc::SIGKILL);
        std::thread::sleep(delay);
        let second = pid(0).unwrap();
        assert!(
            of_job(second, &id),
            "seed {seed}: rank 0 ended before {delay:?}"
        );
        kill(second, libc::SIGKILL);
        let out = job.wait_output(Duration::from_secs(240));
        let output = text(&out);
        let what = format!("seed {seed} (delay {delay:?}, standby {standby})");
        assert!(out.status.success(), "{what}: {output}");
        for r in 0..2 {
            assert_eq!(digest(&read(r)), want, "{what}: rank {r}: {output}");
        }
        assert_eq!(events(&read(0), "start").len(), 2, "{what}: {output}");
        // No rank was left to the agent's pause or resume timeouts.
        assert!(!output.contains("did not pause"), "{what}: {output}");
        assert!(!output.contains("did not complete"), "{what}: {output}");
    }
}

/// `Job(gc="planned:4")`: the automatic collector is off, and each rank
/// collects before every fourth step. Every collection is timed into the
/// rank's control page with the step it ran in (`agentctl status`:
/// `workers[].step_times`, `gc_collections` and `gc_step_sum`): read while
/// the job runs, both ranks show the same collections, at steps 4, 8, ...
/// and no other; the parameters end as the run's with the automatic
/// collector.
#[test]
fn planned_garbage_collections_run_at_the_same_steps_on_every_rank() {
    let _one_at_a_time = common::python::serial();
    let want = clean_digest();
    let dir = tempfile::tempdir().unwrap();
    let job = job_id("torch-gc");
    let shm = dir.path().join("shm");
    let log = dir.path().join("log.{rank}.jsonl");
    let script = example("torch_ddp.py");
    let steps = common::examples::DDP_STEPS.to_string();
    let args = [
        script.to_str().unwrap(),
        "--steps",
        &steps,
        "--step-ms",
        "60",
        "--gc",
        "planned:4",
        "--log-jsonl",
        log.to_str().unwrap(),
    ];
    let flags = ["--job-id", &job, "--shm-root", shm.to_str().unwrap()];
    let mut running = Job::spawn(launch(2, &flags, &args, dir.path()), &job);
    let socket = shm.join(&job).join("agent.sock");
    // (collections, the sum of their steps) of each rank.
    let gc = |v: &serde_json::Value| -> Option<Vec<(u64, u64)>> {
        let w = v["status"]["workers"].as_array()?;
        (w.len() == 2).then_some(())?;
        w.iter()
            .map(|w| {
                let t = &w["step_times"];
                Some((t["gc_collections"].as_u64()?, t["gc_step_sum"].as_u64()?))
            })
            .collect()
    };
    let mut seen = Vec::new();
    let same = common::poll_agentctl(&socket, "status", Duration::from_secs(120), |v| {
        let g = gc(v)?;
        seen = g.clone();
        (g[0] == g[1] && g[0].0 >= 3).then_some(g[0])
    });
    let out = running.wait_output(Duration::from_secs(300));
    assert!(out.status.success(), "{}", text(&out));
    let (k, sum) =
        same.unwrap_or_else(|| panic!("never the same on both: {seen:?}\n{}", text(&out)));
    assert_eq!(
        sum,
        4 * k * (k + 1) / 2,
        "collections before steps 4, 8, ... only: {k} of them"
    );
    for r in 0..2 {
        let log = read_log(&dir.path().join(format!("log.{r}.jsonl")));
        assert_eq!(digest(&log), want, "rank {r}");
    }
}
