//! The agent writes checkpoints of a workload it has never seen, from its
//! state map alone: `hatrain-mapworker` (parts, files, slices and meta
//! fields of its own, sizes that differ by rank) is saved periodically, at
//! the end, and in a last-words dump on SIGTERM, and every file of every
//! rank directory is byte for byte what the map says it must be.

mod common;
use common::*;
use hatrain_scenarios::mapworker::{BETA, alpha, alpha_len, beta, header, map};
use hatrain_shared::checkpoint::{self, iter_dir, rank_dir};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const WORLD: usize = 3;

fn launch(job: &str, shm: &Path, ckpt: &Path, steps: u64, step_ms: u64) -> Command {
    Launch::bare(WORLD)
        .job(job)
        .stop_grace_secs(3)
        .option("--snapshot-slots", "3")
        .high_availability()
        .shm_root(shm)
        .program(bin("hatrain-mapworker"))
        .args(["--steps", &steps.to_string(), "--interval", "5"])
        .args(["--step-ms", &step_ms.to_string()])
        .arg("--save")
        .arg(ckpt)
        .env_remove("HIGH_AVAILABILITY")
        .env("RUST_LOG", "info")
        .command()
}

/// Checks every file of iteration `it` against what the map says: the
/// rank directory written locally from the map and the expected state of
/// (it, rank), compared byte for byte.
fn assert_exact(ckpt: &Path, it: u64) {
    let want = tempfile::tempdir().unwrap();
    let tmp = checkpoint::begin_save(want.path(), it).unwrap();
    for rank in 0..WORLD {
        let a: Vec<f32> = (0..alpha_len(rank)).map(|i| alpha(it, rank, i)).collect();
        let b: Vec<f32> = (0..BETA).map(|i| beta(it, rank, i)).collect();
        let h = header(it, rank);
        let parts: [&[u8]; 3] = [&h, bytemuck::cast_slice(&a), bytemuck::cast_slice(&b)];
        let views = parts.map(hatrain_shared::statemap::PartView::whole);
        checkpoint::write_rank(&tmp, &map(rank, WORLD, ckpt, 5), rank, it, &views).unwrap();
        let (got, exp) = (rank_dir(&iter_dir(ckpt, it), rank), rank_dir(&tmp, rank));
        for file in ["first.safetensors", "second.safetensors", "meta.json"] {
            assert_eq!(
                std::fs::read(got.join(file)).unwrap(),
                std::fs::read(exp.join(file)).unwrap(),
                "iteration {it}, rank {rank}: {file} differs from what the map says"
            );
        }
        let meta = checkpoint::read_rank_meta(&iter_dir(ckpt, it), rank, WORLD).unwrap();
        assert_eq!(meta.fields["steps_done"], it);
        assert_eq!(
            meta.fields["label"],
            serde_json::json!({"worker": "mapworker", "rank": rank})
        );
    }
}

fn iterations(ckpt: &Path) -> Vec<u64> {
    let mut v: Vec<u64> = std::fs::read_dir(ckpt)
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("iter_")?.parse().ok())
        .collect();
    v.sort();
    v
}

#[test]
fn periodic_and_final_saves_of_an_unknown_worker_follow_its_map_byte_for_byte() {
    let d = tempfile::tempdir().unwrap();
    let (shm, ckpt) = (d.path().join("shm"), d.path().join("ckpt"));
    let job = job_id("map");
    let out =
        Job::spawn(launch(&job, &shm, &ckpt, 30, 15), &job).wait_output(Duration::from_secs(120));
    assert_success(&out, "mapworker job");
    assert_eq!(checkpoint::read_tracker(&ckpt).unwrap(), 30);
    let its = iterations(&ckpt);
    assert!(its.len() >= 2 && its.contains(&30), "{its:?}");
    for it in its {
        assert!(it % 5 == 0, "only save steps are written: {it}");
        assert_exact(&ckpt, it);
    }
    assert!(job_pids(&job).is_empty());
}

#[test]
fn the_last_words_of_an_unknown_worker_follow_its_map_byte_for_byte() {
    let d = tempfile::tempdir().unwrap();
    let (shm, ckpt) = (d.path().join("shm"), d.path().join("ckpt"));
    let job = job_id("map-lw");
    let mut guard = Job::spawn(launch(&job, &shm, &ckpt, 1_000_000, 20), &job);
    let socket = shm.join(&job).join("agent.sock");
    let past = |n: u64| {
        let out = Command::new(agentctl())
            .arg("--socket")
            .arg(&socket)
            .args(["--json", "workers"])
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        v["workers"]
            .as_array()
            .is_some_and(|w| w.len() == WORLD && w.iter().all(|r| r["step"].as_u64() > Some(n)))
    };
    assert!(
        wait_until(Duration::from_secs(60), || past(12)),
        "no progress"
    );
    kill(guard.pid(), libc::SIGTERM);
    let out = guard.wait_output(Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + libc::SIGTERM), "{stderr}");
    let it = checkpoint::read_tracker(&ckpt).unwrap();
    assert!(it > 12, "the last words hold a step past 12, not {it}");
    // The newest consistent step, written now (or already on disk when the
    // signal came right after a periodic save of it).
    assert!(
        stderr.contains(&format!("last-words checkpoint of iteration {it} written"))
            || stderr.contains(&format!("iteration {it} is already on disk")),
        "{stderr}"
    );
    assert_exact(&ckpt, it);
    assert!(job_pids(&job).is_empty());
    assert!(!shm.join(&job).exists());
}
