//! The Python binding of the worker runtime (`python/`), run by real
//! Python processes under a real `hatrain-agent launch`: numpy arrays
//! registered without a copy, commits and restores byte for byte, bad
//! input refused, and the faults of the single-host core (a SIGKILL inside
//! the update fences, a SIGKILL halfway through a snapshot copy, a UCE in a
//! registered array) repaired, ending bit-identical to the fault-free run.

mod common;

use common::python::{launch, script};
use common::{Job, job_id, read_log, text};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

#[test]
fn numpy_arrays_are_registered_committed_and_restored_in_place_and_bad_input_is_refused() {
    let _one_at_a_time = common::python::serial();
    let dir = tempfile::tempdir().unwrap();
    let test = script("test_binding.py");
    let cmd = launch(2, &[], &[test.to_str().unwrap()], dir.path());
    let out = Job::spawn(cmd, &job_id("binding")).wait_output(Duration::from_secs(120));
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    for rank in 0..2 {
        assert!(all.contains(&format!("[rank {rank}] binding ok")), "{all}");
    }
}

/// Final hash per rank, and the log of each rank.
struct Run {
    finals: BTreeMap<usize, String>,
    logs: Vec<Vec<serde_json::Value>>,
}

fn run_worker(fault: &str, at: u64) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let (worker, out_dir) = (script("binding_worker.py"), dir.path().to_str().unwrap());
    let at = at.to_string();
    let args = [
        worker.to_str().unwrap(),
        "--out",
        out_dir,
        "--fault",
        fault,
        "--at",
        &at,
        "--fault-rank",
        "1",
    ];
    let cmd = launch(2, &[], &args, dir.path());
    let out = Job::spawn(cmd, &job_id("binding-fault")).wait_output(Duration::from_secs(120));
    assert!(out.status.success(), "{fault} at {at}: {}", text(&out));
    let finals = (0..2)
        .map(|r| {
            let f: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(dir.path().join(format!("final.{r}.json"))).unwrap(),
            )
            .unwrap();
            assert_eq!(f["step"], 12, "{f}");
            assert_eq!(f["sealed"], true, "{f}");
            (r, f["sha256"].as_str().unwrap().to_string())
        })
        .collect();
    let logs = (0..2)
        .map(|r| read_log(&Path::new(out_dir).join(format!("log.{r}.jsonl"))))
        .collect();
    Run { finals, logs }
}

fn events<'a>(log: &'a [serde_json::Value], name: &str) -> Vec<&'a serde_json::Value> {
    log.iter().filter(|e| e["event"] == name).collect()
}

#[test]
fn faults_in_a_numpy_worker_are_repaired_and_end_bit_identical() {
    let _one_at_a_time = common::python::serial();
    let clean = run_worker("none", 0);
    assert_ne!(
        clean.finals[&0], clean.finals[&1],
        "the ranks' states differ"
    );
    for at in [2u64, 5, 9] {
        for fault in ["kill-update", "kill-commit", "uce"] {
            let run = run_worker(fault, at);
            assert_eq!(run.finals, clean.finals, "{fault} at step {at}");
            let hurt = &run.logs[1];
            let starts = events(hurt, "start");
            let resumes = events(hurt, "resume");
            // Every rank went back to the same step before the fault: the
            // torn live state, or the half-copied snapshot, was never used.
            // A kill comes after the last step's copy was waited for (at
            // the update fence), so that step is sealed; a UCE may strike
            // while it is still being copied, which abandons that copy.
            let back: Vec<Vec<u64>> = run
                .logs
                .iter()
                .map(|log| {
                    events(log, "resume")
                        .iter()
                        .map(|e| e["step"].as_u64().unwrap())
                        .collect()
                })
                .collect();
            assert_eq!(back[0], back[1], "{fault} at {at}: {:?}", run.logs);
            assert_eq!(back[0].len(), 1, "{fault} at {at}: {:?}", run.logs);
            let earliest = if fault == "uce" { at - 2 } else { at - 1 };
            assert!(
                (earliest..at).contains(&back[0][0]),
                "{fault} at {at}: resumed at {}",
                back[0][0]
            );
            match fault {
                "uce" => {
                    // Repaired in place: one process, which saw the error.
                    assert_eq!(starts.len(), 1, "{hurt:?}");
                    assert_eq!(events(hurt, "uce")[0]["step"], at, "{hurt:?}");
                }
                _ => {
                    // Killed and replaced: the replacement awaited the
                    // directive and restored from shared memory.
                    assert_eq!(starts.len(), 2, "{hurt:?}");
                    assert_eq!(starts[1]["kind"], "await", "{hurt:?}");
                    assert_ne!(starts[0]["pid"], starts[1]["pid"]);
                    assert_eq!(resumes.len(), 1);
                }
            }
            if fault == "kill-commit" {
                assert_eq!(events(hurt, "killed")[0]["step"], at, "{hurt:?}");
            }
        }
    }
}
