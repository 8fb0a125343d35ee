//! PyTorch jobs as people write them: any optimizer, an LR schedule,
//! bfloat16. `examples/torch_ddp.py` under a real `hatrain-agent launch`
//! with each of eight optimizers and a scheduler, its rank 1 SIGKILLed
//! three times in one run (in the forward pass, inside the update fences
//! after `optimizer.step()`, halfway through a snapshot's copy): every run
//! ends with parameters bit-identical to the same run without faults. The
//! state is learnt from each optimizer's own structure; no line of
//! hatrain is written per optimizer. A bfloat16 model is snapshotted in
//! bfloat16 (2 bytes an element), and so is the agent's checkpoint of it.
//! Bad input is refused with an error that
//! names it.

mod common;

use common::examples::{DDP_STEPS, ExampleRun, events, final_digest, torch_ddp};
use common::python::{python, script, serial};
use common::text;
use std::process::Command;

/// Rank 1 is killed at step 5 in the forward pass, at step 11 inside the
/// update, at step 17 halfway through the snapshot's copy: each in the
/// next process of that rank.
const THREE_KILLS: &str = "1:5:forward:kill:0;1:11:update:kill:1;1:17:commit:kill:2";

fn run(plan: Option<&str>, script_args: &[&str]) -> ExampleRun {
    torch_ddp(plan, script_args, &[])
}

fn digest(log: &[serde_json::Value]) -> String {
    final_digest(log, DDP_STEPS)
}

/// A fault-free run and one with three kills of rank 1 end with the same
/// parameters and buffers on each rank (a norm's statistics are each
/// rank's own); rank 1 resumed three times, rank 0 in one process.
fn three_kills_end_bit_identical(args: &[&str]) -> ExampleRun {
    let clean = run(None, args);
    let r = run(Some(THREE_KILLS), args);
    for (log, want) in r.logs.iter().zip(&clean.logs) {
        assert_eq!(digest(log), digest(want), "{args:?}: {}", r.output);
    }
    assert_eq!(events(&r.logs[0], "start").len(), 1, "{args:?}");
    assert_eq!(
        events(&r.logs[1], "start").len(),
        4,
        "{args:?}: {:?}",
        r.logs[1]
    );
    for log in &r.logs {
        assert_eq!(events(log, "resume").len(), 3, "{args:?}: {log:?}");
    }
    // The schedule went on from where it was: the fault run's learning
    // rates are the clean run's, step for step.
    let lrs = |log: &[serde_json::Value]| -> Vec<(u64, f64)> {
        let mut by_step = std::collections::BTreeMap::new();
        for e in events(log, "step") {
            by_step.insert(e["step"].as_u64().unwrap(), e["lr"].as_f64().unwrap());
        }
        by_step.into_iter().collect()
    };
    assert_eq!(lrs(&r.logs[0]), lrs(&clean.logs[0]), "{args:?}");
    r
}

#[test]
fn every_optimizer_with_a_scheduler_comes_back_bit_identical_from_three_kills() {
    let _one_at_a_time = serial();
    for (optimizer, scheduler) in [
        ("adamw", "cosine"),
        ("adam-amsgrad", "step"),
        ("sgd-nesterov", "cosine"),
        ("adagrad", "step"),
        ("rmsprop", "cosine"),
        ("adamax", "step"),
        ("nadam", "cosine"),
        ("radam", "step"),
    ] {
        three_kills_end_bit_identical(&["--optimizer", optimizer, "--scheduler", scheduler]);
    }
}

/// The elements each rank's sliced snapshot holds of a part of `len`
/// replicated on 2 ranks (`hatrain_shared::shard::shard_range`).
fn held(len: u64, rank: u64) -> u64 {
    len / 2 + u64::from(rank < len % 2)
}

#[test]
fn a_bfloat16_model_is_snapshotted_in_bfloat16_and_comes_back_bit_identical() {
    let _one_at_a_time = serial();
    let r = three_kills_end_bit_identical(&[
        "--dtype",
        "bfloat16",
        "--batchnorm",
        "--optimizer",
        "adamw",
        "--scheduler",
        "cosine",
    ]);
    // The example's MLP: 64 inputs, 3 layers of 256, one output, and a
    // BatchNorm1d(256) after each layer (a weight and a bias).
    let params: u64 = (64 * 256 + 256) + 2 * (256 * 256 + 256) + (256 + 1) + 3 * 2 * 256;
    // Each BatchNorm1d(256): running mean and variance (bfloat16), and
    // its batch count (int64).
    let buffers_bf16: u64 = 3 * 2 * 256;
    for (rank, log) in r.logs.iter().enumerate() {
        let start = events(log, "start")[0];
        let parts: Vec<(String, String, u64)> =
            serde_json::from_value(start["parts"].clone()).unwrap();
        let find = |name: &str| {
            parts
                .iter()
                .find(|p| p.0 == name)
                .unwrap_or_else(|| panic!("no part {name} in {parts:?}"))
                .clone()
        };
        assert_eq!(
            find("params.bfloat16"),
            ("params.bfloat16".into(), "BF16".into(), params)
        );
        assert_eq!(find("buffers.bfloat16").1, "BF16");
        assert_eq!(find("buffers.bfloat16").2, buffers_bf16);
        assert_eq!(find("state.exp_avg.bfloat16").2, params);
        assert_eq!(find("state.exp_avg_sq.bfloat16").1, "BF16");
        // The snapshot holds each element at its own size: 2 bytes for
        // bfloat16 (this rank's slice of what DDP replicates; the
        // buffers, its own, whole).
        let size = |dtype: &str| match dtype {
            "BF16" => 2,
            "F32" => 4,
            "I64" | "F64" => 8,
            "U8" => 1,
            other => panic!("dtype {other}"),
        };
        let want: u64 = parts
            .iter()
            .map(|(name, dtype, len)| {
                let len = match name.starts_with("buffers.") || name == "meta" {
                    true => *len,
                    false => held(*len, rank as u64),
                };
                len * size(dtype)
            })
            .sum::<u64>()
            + 64 * 1024;
        assert_eq!(start["snapshot_bytes"].as_u64(), Some(want), "{parts:?}");
    }

    // The agent's checkpoint of the same run: each tensor in its dtype,
    // a bfloat16 one 2 bytes an element, the parameters all bfloat16.
    let save = tempfile::tempdir().unwrap();
    let dir = save.path().to_str().unwrap();
    run(
        None,
        &[
            "--dtype",
            "bfloat16",
            "--batchnorm",
            "--optimizer",
            "adamw",
            "--save",
            dir,
        ],
    );
    let mut tensors = Vec::new();
    for rank in 0..2 {
        let file = save.path().join(format!(
            "iter_{DDP_STEPS:07}/rank_{rank:05}/state.safetensors"
        ));
        tensors.extend(safetensors_entries(&std::fs::read(&file).unwrap()));
    }
    let mut bf16_params = 0;
    for (name, dtype, numel, bytes) in &tensors {
        let size = match dtype.as_str() {
            "BF16" => 2,
            "F32" => 4,
            "I64" => 8,
            other => panic!("{name}: dtype {other}"),
        };
        assert_eq!(*bytes, numel * size, "{name} {dtype}");
        if name.starts_with("model.")
            && !name.contains(".running_")
            && !name.ends_with("num_batches_tracked")
        {
            assert_eq!(dtype, "BF16", "{name}");
            bf16_params += numel;
        }
        if name.ends_with(".exp_avg") || name.ends_with(".exp_avg_sq") {
            assert_eq!(dtype, "BF16", "{name}");
        }
    }
    // Every parameter is written once, by one of the two ranks.
    assert_eq!(bf16_params, params, "{tensors:?}");
}

/// `(name, dtype, elements, bytes)` of each tensor of a safetensors file
/// (an 8-byte little-endian header length, then the JSON header).
fn safetensors_entries(file: &[u8]) -> Vec<(String, String, u64, u64)> {
    let len = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&file[8..8 + len]).unwrap();
    header
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, t)| {
            let numel = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .product();
            let at = t["data_offsets"].as_array().unwrap();
            let bytes = at[1].as_u64().unwrap() - at[0].as_u64().unwrap();
            (name, t["dtype"].as_str().unwrap().to_string(), numel, bytes)
        })
        .collect()
}

#[test]
fn bad_state_is_refused_with_an_error_naming_it() {
    let out = Command::new(python())
        .arg(script("torch_bad_input.py"))
        .env_remove("HATRAIN_AGENT_SOCKET")
        .output()
        .unwrap();
    let text = text(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("bad input ok"), "{text}");
}
