//! A PyTorch job's checkpoints, written by the agent from shared memory,
//! loaded by PyTorch alone: `examples/torch_gpt.py` (FSDP2) runs 20 steps
//! under `hatrain-agent launch --save DIR --save-interval 10` with rank 1
//! SIGKILLed on the way; then the same script under a plain `torchrun`,
//! which never imports hatrain, loads the agent's checkpoint with
//! `torch.distributed.checkpoint.HuggingFaceStorageReader`:
//!
//! - the last one, at 2 ranks and at 3: every parameter and every AdamW
//!   state tensor equals the training run's at its end (their SHA-256);
//! - the one of step 10, at 2 ranks, trained on to step 20: the same
//!   parameters as the run that never stopped;
//!
//! and the same step-10 checkpoint loaded by `hatrain.torch` (`--load`
//! under the agent) and trained on to step 20 under the agent ends there
//! too.

mod common;

use common::examples::{Example, events};
use common::python::{example, python, serial};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// A small model, so that a run takes seconds on two cores.
const MODEL: [&str; 12] = [
    "--steps", "20", "--layers", "2", "--width", "64", "--heads", "4", "--vocab", "512", "--seq",
    "32",
];

/// The `final` event of a log: its step, and the digests of the full
/// parameters and optimizer state.
fn last(log: &[serde_json::Value]) -> (u64, String, String) {
    let f = events(log, "final");
    assert_eq!(f.len(), 1, "{log:?}");
    (
        f[0]["step"].as_u64().unwrap(),
        f[0]["model_sha256"].as_str().unwrap().to_string(),
        f[0]["optim_sha256"].as_str().unwrap().to_string(),
    )
}

/// `examples/torch_gpt.py` under a plain torchrun of `ranks` ranks with
/// `--load from`; returns each rank's log.
fn load_with_torchrun(ranks: usize, from: &Path) -> Vec<Vec<serde_json::Value>> {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log.{rank}.jsonl");
    let mut cmd = Command::new(python());
    cmd.args([
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
    ])
    .arg(ranks.to_string())
    .arg(example("torch_gpt.py"))
    .args(MODEL)
    .arg("--load")
    .arg(from)
    .arg("--log-jsonl")
    .arg(&log)
    .current_dir(dir.path())
    .env_remove("HATRAIN_AGENT_SOCKET")
    .env_remove("HATRAIN_FAULT_PLAN")
    .env("OMP_NUM_THREADS", "1");
    let tag = common::job_id("dcp-load");
    let out = common::Job::spawn(cmd, &tag).wait_output(Duration::from_secs(300));
    let output = common::text(&out);
    assert!(
        out.status.success(),
        "torchrun --load {from:?} at {ranks} ranks: {output}"
    );
    (0..ranks)
        .map(|r| common::read_log(&dir.path().join(format!("log.{r}.jsonl"))))
        .collect()
}

#[test]
fn a_checkpoint_the_agent_wrote_loads_with_torch_distributed_checkpoint_alone_at_two_and_three_ranks()
 {
    let _one_at_a_time = serial();
    let save = tempfile::tempdir().unwrap();
    let save_dir = save.path().to_str().unwrap();
    let args: Vec<&str> = MODEL
        .iter()
        .copied()
        .chain(["--save", save_dir, "--save-interval", "10"])
        .collect();
    let kill = "1:13:update:kill:0";
    let trained = Example {
        script: "torch_gpt.py",
        ranks: 2,
        flags: &[],
        args: &args,
        plan: Some(kill),
        env: &[],
    }
    .run();
    let want = last(&trained.logs[0]);
    assert_eq!(want.0, 20);
    assert_eq!(
        events(&trained.logs[1], "start").len(),
        2,
        "{kill}: {}",
        trained.output
    );

    // The agent's save folder: the tracker, and the iteration's folder of
    // every rank's files for PyTorch's reader.
    let tracker = std::fs::read_to_string(save.path().join("latest_checkpointed_iteration.txt"))
        .expect("the tracker");
    assert_eq!(tracker.trim(), "20");
    let dcp = save.path().join("iter_0000020/dcp");
    for rank in 0..2 {
        for file in ["state.safetensors", "meta.json"] {
            let linked = dcp.join(format!("rank_{rank:05}-{file}"));
            assert!(linked.is_file(), "{}", linked.display());
        }
    }

    for ranks in [2, 3] {
        let logs = load_with_torchrun(ranks, save.path());
        for log in &logs {
            let start = events(log, "start");
            assert_eq!(start[0]["start_step"], 20, "{log:?}");
            assert_eq!(last(log), want, "loaded at {ranks} ranks");
        }
    }

    // The checkpoint of step 10, trained on to step 20 without hatrain,
    // ends where the agent's run did.
    let step10 = save.path().join("iter_0000010/dcp");
    let logs = load_with_torchrun(2, &step10);
    for log in &logs {
        assert_eq!(events(log, "start")[0]["start_step"], 10, "{log:?}");
        assert_eq!(last(log), want, "step 10 loaded and trained on to 20");
    }

    // hatrain.torch starts a job from it.
    let args: Vec<&str> = MODEL
        .iter()
        .copied()
        .chain(["--load", step10.to_str().unwrap()])
        .collect();
    let resumed = Example {
        script: "torch_gpt.py",
        ranks: 2,
        flags: &[],
        args: &args,
        plan: None,
        env: &[],
    }
    .run();
    for log in &resumed.logs {
        assert_eq!(events(log, "start")[0]["start_step"], 10, "{log:?}");
        assert_eq!(last(log), want, "step 10 loaded by hatrain.torch");
    }
}
