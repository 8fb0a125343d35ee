//! Elastic training: a host lost with no standby shrinks the data-parallel
//! group instead of stopping the job. Three hosts of two ranks each (no
//! standby, `--enable-elastic-training`); while the job stands still at
//! step 30 (rank 0 naps), host 1 vanishes: its agent and workers SIGKILLed,
//! its shared memory deleted. The four ranks left re-slice their ZeRO
//! shards, with ranks 2 and 3 taken from their replicas on host 2, and go
//! on at size 4 from the consistent step s*, without restarting a process
//! or reading the disk.
//!
//! The elastic invariant: the run after the resize equals, bit for bit
//! (every step's loss and the final checksum), a fresh run of four ranks
//! started with `--load` from a checkpoint of step s*. The global batch is
//! the same at both sizes, and nothing is left behind.

mod common;
use common::cluster::*;
use common::hosts::*;
use common::*;

#[test]
fn a_host_lost_shrinks_the_group_and_the_run_equals_a_fresh_one_at_the_new_size() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, _six) = six_ranks_reference(tmp.path());
    let dir = tmp.path().to_path_buf();
    let mut c = Cluster::start(tmp, "elastic", 0, &["--enable-elastic-training"], &train);
    c.wait_held(2, &[2, 3]);
    c.vanish(&[1]);
    let outs = c.ends(&[0, 2]);
    for (k, out) in &outs {
        assert_success(out, &format!("host {k}\n{}", logs(&outs)));
    }
    let controller = stderr(&outs, 0);
    assert!(
        controller.contains("shrinking the data-parallel group from 6 to 4 ranks"),
        "{controller}"
    );
    let run = read_log(&c.log);
    let reshape = run
        .iter()
        .find(|e| e["event"] == "reshape")
        .unwrap_or_else(|| panic!("no reshape in the run's log:\n{}", logs(&outs)));
    let s_star = reshape["step"].as_u64().unwrap();
    assert_eq!(reshape["world_size"], 4);
    assert!((29..=30).contains(&s_star), "resized at step {s_star}");
    // The global batch: 24 sequences a step at either size.
    for e in run.iter().filter(|e| e["event"] == "step") {
        let step = e["step"].as_u64().unwrap();
        let world = if step > s_star { 4 } else { 6 };
        assert_eq!(e["world_size"], world, "step {step}");
        assert_eq!(e["global_batch"], 24, "step {step}");
        assert_eq!(e["samples"], step * 24, "samples consumed by step {step}");
    }

    // The same job without faults, saved at s*, then resumed at size 4.
    let save = dir.join("at-s-star");
    let mut first = train.clone();
    let at = first.iter().position(|a| a == "--train-iters").unwrap();
    first[at + 1] = s_star.to_string();
    first.extend(s(&["--save", save.to_str().unwrap()]));
    assert_success(&run_launch(6, "elastic-ref-6", &first), "six ranks to s*");
    let fresh_log = dir.join("fresh4.jsonl");
    let mut fresh = train.clone();
    fresh.extend(s(&["--load", save.to_str().unwrap(), "--log-jsonl"]));
    fresh.push(fresh_log.display().to_string());
    assert_success(
        &run_launch(4, "elastic-ref-4", &fresh),
        "four ranks from s*",
    );
    let fresh = read_log(&fresh_log);
    assert_eq!(fresh[0]["resumed_from"], s_star);
    let ours = final_losses(&run);
    let want = final_losses(&fresh);
    assert_eq!(
        want.keys().next().copied(),
        Some(s_star + 1),
        "the fresh run starts after s*"
    );
    for (step, loss) in &want {
        assert_eq!(
            ours[step].to_bits(),
            loss.to_bits(),
            "loss of step {step} after the resize"
        );
    }
    assert_eq!(final_checksum(&run), final_checksum(&fresh));
    for k in [0, 2] {
        assert_nothing_left(&c.shm[k]);
    }
}
