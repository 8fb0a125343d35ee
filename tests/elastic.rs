//! Elastic training: a host lost with no standby shrinks the data-parallel
//! group instead of stopping the job, and the group grows back onto a
//! standby that starts later. A host vanishes as a machine would (its agent
//! and workers SIGKILLed, its shared memory deleted) while the job stands
//! still (rank 0 naps), so the replicas have caught up.
//!
//! - 3 hosts × 2 ranks, host 1 lost: 6 → 4 ranks (ranks of one host
//!   exchange their pieces through shared memory); the agents' saves after
//!   it are of 4 ranks; a rank that crashes afterwards restarts at its new
//!   place.
//! - 5 hosts × 1 rank: two shrinks, 5 → 4 → 3 (the replicas placed past
//!   the lost host).
//! - 4 hosts × 2 ranks and a late standby host: shrink and grow back,
//!   ranks of one host exchanging through shared memory;
//! - 4 hosts × 1 rank and a late standby: shrink, grow back, shrink again;
//!   and a host lost during a grow.
//! - 4 hosts × 1 rank of a global batch of 8, one lost: the group goes on
//!   at 2 (a size that divides 8), the third rank standing by.
//! - Below `--min-nodes`: the last words, and a stop that says why.
//!
//! The elastic invariant, at every resize: the run after it equals, bit for
//! bit (every step's loss and the final checksum), a fresh run at the new
//! size started with `--load` from a checkpoint of its s* (chained over the
//! resizes). The global batch is the same at every size, and nothing is
//! left behind.

mod common;
use common::cluster::*;
use common::hosts::*;
use common::*;
use std::time::Duration;

#[test]
fn a_host_lost_shrinks_the_group_and_the_run_equals_a_fresh_one_at_the_new_size() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, _six) = six_ranks_reference(tmp.path());
    let dir = tmp.path().to_path_buf();
    // Rank 0 naps again in step 45, so the resize can be seen while the
    // job runs; rank 5 (place 3 of 4 by then) crashes in step 50 and is
    // started again at its place in the smaller group.
    let plan = format!("{NAP};0:45:forward:sleep3000;5:50:forward:kill");
    // The agents save every 10 steps (and at the end), at either size.
    let save = dir.join("saves");
    let mut saving = train.clone();
    saving.extend(s(&[
        "--save",
        save.to_str().unwrap(),
        "--save-interval",
        "10",
    ]));
    let mut c = Cluster::start_with_plan(
        tmp,
        "elastic",
        0,
        &["--enable-elastic-training"],
        &saving,
        &plan,
    );
    c.wait_held(2, &[2, 3]);
    c.vanish(&[1]);
    // A follower's status shows the group's size and its resize.
    let socket = c.shm[2].join(&c.job).join("agent.sock");
    let seen = poll_agentctl(&socket, "status", Duration::from_secs(60), |v| {
        let s = &v["status"];
        (s["world_size"] == 4 && s["resizes"][0]["to"] == 4).then(|| s["resizes"][0].clone())
    });
    let resize = seen.expect("host 2's status shows the resize to 4 ranks");
    assert_eq!(resize["from"], 6);
    assert!(
        resize["seconds"].as_f64().is_some_and(|s| s > 0.0),
        "{resize}"
    );
    let outs = c.ends(&[0, 2]);
    for (k, out) in &outs {
        assert_success(out, &format!("host {k}\n{}", logs(&outs)));
    }
    let controller = stderr(&outs, 0);
    assert!(
        controller.contains("shrinking the data-parallel group from 6 to 4 ranks"),
        "{controller}"
    );
    assert!(
        stderr(&outs, 2).contains("replacement started rank=5"),
        "rank 5 was started again after its crash:\n{}",
        logs(&outs)
    );
    let run = read_log(&c.log);
    let reshape = run
        .iter()
        .find(|e| e["event"] == "reshape")
        .unwrap_or_else(|| panic!("no reshape in the run's log:\n{}", logs(&outs)));
    let s_star = reshape["step"].as_u64().unwrap();
    assert_eq!(reshape["world_size"], 4);
    assert!((29..=30).contains(&s_star), "resized at step {s_star}");
    // Rank 0's new quarter of each moment goes on past its old sixth into
    // rank 1's, and rank 1 is on its host: those pieces came through
    // shared memory, not the ring.
    assert!(
        reshape["bytes_received_shm"]
            .as_u64()
            .is_some_and(|b| b > 0),
        "{reshape}"
    );
    // The global batch: 24 sequences a step at either size.
    for e in run.iter().filter(|e| e["event"] == "step") {
        let step = e["step"].as_u64().unwrap();
        let world = if step > s_star { 4 } else { 6 };
        assert_eq!(e["world_size"], world, "step {step}");
        assert_eq!(e["global_batch"], 24, "step {step}");
        assert_eq!(e["samples"], step * 24, "samples consumed by step {step}");
    }

    // The checkpoints written after the resize are of 4 ranks, and the
    // final one holds the run's parameters.
    for it in [40, 50, 60] {
        let meta = hatrain_shared::checkpoint::read_rank_meta(
            &hatrain_shared::checkpoint::iter_dir(&save, it),
            3,
            4,
        )
        .unwrap_or_else(|e| panic!("iteration {it} of 4 ranks: {e}\n{}", logs(&outs)));
        assert_eq!(meta.iteration, it);
    }
    assert_eq!(hatrain_shared::checkpoint::read_tracker(&save).unwrap(), 60);
    let reload = dir.join("reload.jsonl");
    let mut again = train.clone();
    again.extend(s(&["--load", save.to_str().unwrap(), "--log-jsonl"]));
    again.push(reload.display().to_string());
    assert_success(
        &run_launch(4, "elastic-reload", &again),
        "loading the final save",
    );
    assert_eq!(final_checksum(&read_log(&reload)), final_checksum(&run));

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
    assert_eq!(resize["s_star"], s_star);
    assert_eq!(final_checksum(&run), final_checksum(&fresh));
    for k in [0, 2] {
        assert_nothing_left(&c.shm[k]);
    }
}

/// Two shrinks in one run, five hosts of one rank (so that the hosts left
/// after two losses are still a majority of the job's agents): host 2
/// vanishes at step 30 (5 → 4 ranks), then host 1 at step 45 (4 → 3).
/// After the first, host 1 streams its replicas past the lost host 2, to
/// host 3: without that, rank 1 would have no replica left at the second
/// loss. Each leg after a resize equals a fresh run at its size loaded
/// from a checkpoint of its s*, chained: five ranks to s1*, four from there
/// to s2*, three from there to the end. The global batch (60) is the same
/// at every size.
#[test]
fn the_group_shrinks_twice_and_each_leg_equals_a_fresh_run() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let mut train = tiny_args(60);
    let at = train.iter().position(|a| a == "--global-batch").unwrap();
    train[at + 1] = "60".into();
    let plan = format!("{NAP};0:45:forward:sleep8000");
    let mut c = Cluster::start_shape(
        tmp,
        "elastic-twice",
        (5, 1),
        0,
        &["--enable-elastic-training"],
        &train,
        &plan,
    );
    c.wait_held(3, &[2]);
    c.vanish(&[2]);
    c.wait_held_at(3, &[1], 44);
    c.vanish(&[1]);
    let outs = c.ends(&[0, 3, 4]);
    for (k, out) in &outs {
        assert_success(out, &format!("host {k}\n{}", logs(&outs)));
    }
    let run = read_log(&c.log);
    let resizes = reshapes(&run);
    let [(s1, 4), (s2, 3)] = resizes[..] else {
        panic!(
            "two resizes, to 4 then 3 ranks: {resizes:?}\n{}",
            logs(&outs)
        );
    };
    assert!(
        (29..=30).contains(&s1) && (44..=45).contains(&s2),
        "{resizes:?}"
    );
    for e in run.iter().filter(|e| e["event"] == "step") {
        let step = e["step"].as_u64().unwrap();
        assert_eq!(e["samples"], step * 60, "samples consumed by step {step}");
    }

    // The chain of fresh runs: 5 ranks to s1*, 4 to s2*, 3 to the end.
    let leg = |ranks, load, to, name| fresh_leg(&dir, &train, ranks, load, to, name);
    let (at_s1, _) = leg(5, None, Some(s1), "twice-5");
    let (at_s2, four) = leg(4, Some(&at_s1), Some(s2), "twice-4");
    let (_, three) = leg(3, Some(&at_s2), None, "twice-3");
    let ours = final_losses(&run);
    for fresh in [&four, &three] {
        for (step, loss) in final_losses(fresh) {
            assert_eq!(ours[&step].to_bits(), loss.to_bits(), "loss of step {step}");
        }
    }
    assert_eq!(final_losses(&three).keys().next().copied(), Some(s2 + 1));
    assert_eq!(final_checksum(&run), final_checksum(&three));
    for k in [0, 3, 4] {
        assert_nothing_left(&c.shm[k]);
    }
}

/// Shrink, grow back, shrink again: four hosts of one rank and a standby
/// agent that starts only after the first loss (five agents, so that the
/// hosts left after a loss are a majority of them). Host 1 vanishes at
/// step 30 (4 → 3 ranks); the standby then starts, is heard, takes host
/// 1's rank and the group grows back (3 → 4), the new rank filled from the
/// others at a step boundary; then host 2 vanishes at step 50 (4 → 3).
/// Every leg equals a fresh run at its size loaded from a checkpoint of its
/// s*, chained, and the global batch is the same throughout.
#[test]
fn the_group_shrinks_grows_back_and_shrinks_again() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let mut train = tiny_args(70);
    let at = train.iter().position(|a| a == "--global-batch").unwrap();
    train[at + 1] = "24".into();
    let plan = format!("{NAP};0:35:forward:sleep5000;0:50:forward:sleep8000");
    let mut c = Cluster::start_later(
        tmp,
        "elastic-grow",
        (4, 1),
        (1, 1),
        &["--enable-elastic-training"],
        &train,
        &plan,
    );
    let socket = c.shm[0].join(&c.job).join("agent.sock");
    c.wait_held(2, &[1]);
    c.vanish(&[1]);
    if poll_agentctl(&socket, "status", Duration::from_secs(60), resized(1, 3)).is_none() {
        panic!("the group did not shrink to 3 ranks:\n{}", c.kill_all());
    }
    c.start_late();
    if poll_agentctl(&socket, "status", Duration::from_secs(60), resized(2, 4)).is_none() {
        panic!("the group did not grow back to 4 ranks:\n{}", c.kill_all());
    }
    c.wait_held_at(3, &[2], 49);
    c.vanish(&[2]);
    let outs = c.ends(&[0, 3, 4]);
    for (k, out) in &outs {
        assert_success(out, &format!("host {k}\n{}", logs(&outs)));
    }
    let standby = stderr(&outs, 4);
    assert!(
        standby.contains("taking the ranks of a lost host") && standby.contains("ranks=[1]"),
        "{standby}"
    );
    let run = read_log(&c.log);
    let resizes = reshapes(&run);
    let [(s1, 3), (s2, 4), (s3, 3)] = resizes[..] else {
        panic!("resizes to 3, 4, 3 ranks: {resizes:?}\n{}", logs(&outs));
    };
    assert!(
        (29..=30).contains(&s1) && s2 < 49 && (49..=50).contains(&s3),
        "{resizes:?}"
    );
    for e in run.iter().filter(|e| e["event"] == "step") {
        let step = e["step"].as_u64().unwrap();
        assert_eq!(e["samples"], step * 24, "samples consumed by step {step}");
    }

    let leg = |ranks, load, to, name| fresh_leg(&dir, &train, ranks, load, to, name);
    let (at_s1, _) = leg(4, None, Some(s1), "grow-4a");
    let (at_s2, three) = leg(3, Some(&at_s1), Some(s2), "grow-3a");
    let (at_s3, four) = leg(4, Some(&at_s2), Some(s3), "grow-4b");
    let (_, last) = leg(3, Some(&at_s3), None, "grow-3b");
    let ours = final_losses(&run);
    for fresh in [&three, &four, &last] {
        for (step, loss) in final_losses(fresh) {
            assert_eq!(ours[&step].to_bits(), loss.to_bits(), "loss of step {step}");
        }
    }
    assert_eq!(final_checksum(&run), final_checksum(&last));
    for k in [0, 3, 4] {
        assert_nothing_left(&c.shm[k]);
    }
}

/// Hosts of two ranks: host 1 of four is lost (8 → 6 ranks), then a late
/// standby host of two is heard and the group grows back (6 → 8); the
/// hosts left after the loss are a majority of the job's five agents. In both
/// reshapes the ranks of one host take each other's pieces through shared
/// memory (rank 0's log gives every rank's bytes), each rank takes less
/// than an all-gather of every rank's holdings would have brought it, and
/// each leg equals a fresh run at its size loaded from a checkpoint of its
/// s*.
#[test]
fn ranks_of_one_host_reshape_through_shared_memory_in_a_shrink_and_a_grow() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let mut train = tiny_args(50);
    let at = train.iter().position(|a| a == "--global-batch").unwrap();
    train[at + 1] = "24".into();
    let plan = format!("{NAP};0:36:forward:sleep6000");
    let mut c = Cluster::start_later(
        tmp,
        "elastic-local",
        (4, 2),
        (1, 1),
        &["--enable-elastic-training"],
        &train,
        &plan,
    );
    let socket = c.shm[0].join(&c.job).join("agent.sock");
    c.wait_held(2, &[2, 3]);
    c.vanish(&[1]);
    if poll_agentctl(&socket, "status", Duration::from_secs(60), resized(1, 6)).is_none() {
        panic!("the group did not shrink to 6 ranks:\n{}", c.kill_all());
    }
    c.start_late();
    if poll_agentctl(&socket, "status", Duration::from_secs(60), resized(2, 8)).is_none() {
        panic!("the group did not grow back to 8 ranks:\n{}", c.kill_all());
    }
    let outs = c.ends(&[0, 2, 3, 4]);
    for (k, out) in &outs {
        assert_success(out, &format!("host {k}\n{}", logs(&outs)));
    }
    let run = read_log(&c.log);
    let resizes = reshapes(&run);
    let [(s1, 6), (s2, 8)] = resizes[..] else {
        panic!("resizes to 6 and 8 ranks: {resizes:?}\n{}", logs(&outs));
    };
    for e in run.iter().filter(|e| e["event"] == "reshape") {
        let by_rank = e["by_rank"].as_array().expect("every rank's bytes");
        eprintln!(
            "reshape to {} at step {}: {}",
            e["world_size"], e["step"], e["by_rank"]
        );
        assert_eq!(
            by_rank.len() as u64,
            e["world_size"].as_u64().unwrap(),
            "{e}"
        );
        let bytes = |r: &serde_json::Value, k: &str| r[k].as_u64().unwrap();
        assert!(
            by_rank.iter().any(|r| bytes(r, "received_shm") > 0),
            "no rank took pieces through shared memory: {e}"
        );
        let sent: u64 = by_rank.iter().map(|r| bytes(r, "sent_shm")).sum();
        let got: u64 = by_rank.iter().map(|r| bytes(r, "received_shm")).sum();
        assert_eq!(sent, got, "what was left was taken: {e}");
        for r in by_rank {
            let took = bytes(r, "received") + bytes(r, "received_shm");
            assert!(took < bytes(r, "all_gather"), "{r} in {e}");
        }
    }
    let leg = |ranks, load, to, name| fresh_leg(&dir, &train, ranks, load, to, name);
    let (at_s1, _) = leg(8, None, Some(s1), "local-8a");
    let (at_s2, six) = leg(6, Some(&at_s1), Some(s2), "local-6");
    let (_, last) = leg(8, Some(&at_s2), None, "local-8b");
    let ours = final_losses(&run);
    for fresh in [&six, &last] {
        for (step, loss) in final_losses(fresh) {
            assert_eq!(ours[&step].to_bits(), loss.to_bits(), "loss of step {step}");
        }
    }
    assert_eq!(final_checksum(&run), final_checksum(&last));
    for k in [0, 2, 3, 4] {
        assert_nothing_left(&c.shm[k]);
    }
}

/// A host lost during a grow: after host 1 is lost (4 → 3 ranks), the
/// standby starts and takes rank 1 back, but while the group pauses to take
/// it in (rank 0 naps in step 32), host 2 vanishes. Rank 2 leaves in the
/// same reshape as rank 1 joins: the group stays at 3 ranks (0, 1 on the
/// standby, 3), and the run equals a fresh 3-rank run from the first s*.
#[test]
fn a_host_lost_during_a_grow_leaves_in_the_same_reshape() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let mut train = tiny_args(50);
    let at = train.iter().position(|a| a == "--global-batch").unwrap();
    train[at + 1] = "24".into();
    let plan = format!("{NAP};0:32:forward:sleep10000");
    let mut c = Cluster::start_later(
        tmp,
        "elastic-grow-lost",
        (4, 1),
        (1, 1),
        &["--enable-elastic-training"],
        &train,
        &plan,
    );
    let socket = c.shm[0].join(&c.job).join("agent.sock");
    c.wait_held(2, &[1]);
    c.vanish(&[1]);
    let shrunk = |v: &serde_json::Value| {
        let s = &v["status"];
        (s["resizes"].as_array().is_some_and(|r| r.len() == 1) && s["world_size"] == 3)
            .then_some(())
    };
    if poll_agentctl(&socket, "status", Duration::from_secs(60), shrunk).is_none() {
        panic!("the group did not shrink to 3 ranks:\n{}", c.kill_all());
    }
    // Rank 0 is in its nap at step 32 when the standby comes: the grow
    // waits for it to pause.
    c.wait_held_at(3, &[2], 31);
    c.start_late();
    let growing = |v: &serde_json::Value| {
        let s = &v["status"];
        (s["world_size"] == 4 && s["recovering"] == true).then_some(())
    };
    if poll_agentctl(&socket, "status", Duration::from_secs(60), growing).is_none() {
        panic!("the group did not start to grow:\n{}", c.kill_all());
    }
    c.vanish(&[2]);
    let outs = c.ends(&[0, 3, 4]);
    for (k, out) in &outs {
        assert_success(out, &format!("host {k}\n{}", logs(&outs)));
    }
    let run = read_log(&c.log);
    let resizes = reshapes(&run);
    let [(s1, 3), (_, 3)] = resizes[..] else {
        panic!(
            "two reshapes, both to 3 ranks: {resizes:?}\n{}",
            logs(&outs)
        );
    };
    let standby = stderr(&outs, 4);
    assert!(
        standby.contains("reshaped to 3 ranks"),
        "rank 1 joined:\n{standby}"
    );

    let save = dir.join("at-s1");
    let mut first = train.clone();
    let at = first.iter().position(|a| a == "--train-iters").unwrap();
    first[at + 1] = s1.to_string();
    first.extend(s(&["--save", save.to_str().unwrap()]));
    assert_success(&run_launch(4, "grow-lost-4", &first), "four ranks to s1*");
    let log = dir.join("fresh3.jsonl");
    let mut fresh = train.clone();
    fresh.extend(s(&["--load", save.to_str().unwrap(), "--log-jsonl"]));
    fresh.push(log.display().to_string());
    assert_success(
        &run_launch(3, "grow-lost-3", &fresh),
        "three ranks from s1*",
    );
    let fresh = read_log(&log);
    let ours = final_losses(&run);
    for (step, loss) in final_losses(&fresh) {
        assert_eq!(ours[&step].to_bits(), loss.to_bits(), "loss of step {step}");
    }
    assert_eq!(final_checksum(&run), final_checksum(&fresh));
    for k in [0, 3, 4] {
        assert_nothing_left(&c.shm[k]);
    }
}

/// With `--min-nodes 3`, losing a host would leave two: the group does not
/// shrink; the last-words checkpoint (ranks 2 and 3 from their replicas)
/// is written and the job stops, saying why.
#[test]
fn a_loss_below_min_nodes_writes_the_last_words_and_stops() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut train, _six) = six_ranks_reference(tmp.path());
    let save = tmp.path().join("ckpt");
    train.extend(s(&["--save", save.to_str().unwrap()]));
    let flags = ["--enable-elastic-training", "--min-nodes", "3"];
    let mut c = Cluster::start(tmp, "elastic-min", 0, &flags, &train);
    c.wait_held(2, &[2, 3]);
    c.vanish(&[1]);
    let outs = c.ends(&[0, 2]);
    let it = hatrain_shared::checkpoint::read_tracker(&save)
        .unwrap_or_else(|e| panic!("no last words on disk ({e}):\n{}", logs(&outs)));
    assert!((29..=30).contains(&it), "last words of iteration {it}");
    let controller = stderr(&outs, 0);
    assert!(
        controller.contains("fewer than --min-nodes 3, so the group does not shrink"),
        "{controller}"
    );
    assert!(
        !controller.contains("shrinking the data-parallel group"),
        "{controller}"
    );
    for (k, out) in &outs {
        assert_eq!(
            code(&out.status),
            Some(3),
            "host {k} stops:\n{}",
            logs(&outs)
        );
        assert_nothing_left(&c.shm[*k]);
    }
}

/// Four hosts of one rank and a global batch of 8: host 1 is lost, and
/// the 3 ranks left do not divide 8. The controller keeps the group at 2
/// (the largest size that divides it): rank 3 stands by (its host is the
/// highest, and its replica is held by host 0, which stays), its state
/// brought to the reshape from that replica as the lost rank's is from
/// host 2's. The choice shows in `agentctl status` (the fault's action),
/// and the run equals a fresh run of 2 ranks loaded from a checkpoint of
/// s* written by a fault-free run of 4.
#[test]
fn a_size_that_does_not_divide_the_global_batch_leaves_ranks_standing_by() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let mut train = tiny_args(60);
    let at = train.iter().position(|a| a == "--global-batch").unwrap();
    train[at + 1] = "8".into();
    let mut c = Cluster::start_shape(
        tmp,
        "elastic-divides",
        (4, 1),
        0,
        &["--enable-elastic-training"],
        &train,
        NAP,
    );
    c.wait_held(2, &[1]);
    c.wait_held(0, &[3]);
    c.vanish(&[1]);
    let socket = c.shm[2].join(&c.job).join("agent.sock");
    let mut last = serde_json::Value::Null;
    let fault = poll_agentctl(&socket, "status", Duration::from_secs(60), |v| {
        last = v["status"].clone();
        (last["world_size"] == 2).then(|| last["faults"][0].clone())
    });
    let Some(fault) = fault else {
        let outs = c.ends(&[0, 2, 3]);
        panic!(
            "host 2's status never showed the group at 2 ranks: {last}\n{}",
            logs(&outs)
        );
    };
    let action = fault["action"].as_str().unwrap_or_default();
    assert!(
        action.contains("go on with 2 ranks") && action.contains("ranks [3] stand by"),
        "{fault}"
    );
    let outs = c.ends(&[0, 2, 3]);
    for (k, out) in &outs {
        assert_success(out, &format!("host {k}\n{}", logs(&outs)));
    }
    let run = read_log(&c.log);
    let reshapes = reshapes(&run);
    let [(s_star, 2)] = reshapes[..] else {
        panic!("one resize, to 2 ranks: {reshapes:?}\n{}", logs(&outs));
    };
    assert!((29..=30).contains(&s_star), "resized at step {s_star}");
    // Only what rank 0 lacks moved to it: of each moment, the old quarter
    // of its new half that rank 1 (brought by rank 2) held, and at most
    // the parameters past its slice, 5 bytes per parameter at the most;
    // an all-gather would have sent it the moments' three other quarters
    // alone, 6 bytes per parameter.
    let start = run.iter().find(|e| e["event"] == "start").unwrap();
    let numel = start["params"].as_u64().expect("the start event's params");
    let reshape = run.iter().find(|e| e["event"] == "reshape").unwrap();
    let received = reshape["bytes_received"].as_u64().unwrap();
    eprintln!("the reshape sent rank 0 {received} bytes for {numel} parameters");
    assert!(
        received > 0 && received < 6 * numel,
        "rank 0 received {received} bytes for {numel} parameters"
    );
    for e in run.iter().filter(|e| e["event"] == "step") {
        let step = e["step"].as_u64().unwrap();
        let world = if step > s_star { 2 } else { 4 };
        assert_eq!(e["world_size"], world, "step {step}");
        assert_eq!(e["samples"], step * 8, "samples consumed by step {step}");
    }

    // Four ranks without faults to s*, saved; two from there to the end.
    let save = dir.join("at-s-star");
    let mut first = train.clone();
    let at = first.iter().position(|a| a == "--train-iters").unwrap();
    first[at + 1] = s_star.to_string();
    first.extend(s(&["--save", save.to_str().unwrap()]));
    assert_success(&run_launch(4, "divides-4", &first), "four ranks to s*");
    let fresh_log = dir.join("fresh2.jsonl");
    let mut fresh = train.clone();
    fresh.extend(s(&["--load", save.to_str().unwrap(), "--log-jsonl"]));
    fresh.push(fresh_log.display().to_string());
    assert_success(&run_launch(2, "divides-2", &fresh), "two ranks from s*");
    let fresh = read_log(&fresh_log);
    let ours = final_losses(&run);
    let want = final_losses(&fresh);
    assert_eq!(want.keys().next().copied(), Some(s_star + 1));
    for (step, loss) in &want {
        assert_eq!(ours[step].to_bits(), loss.to_bits(), "loss of step {step}");
    }
    assert_eq!(final_checksum(&run), final_checksum(&fresh));
    for k in [0, 2, 3] {
        assert_nothing_left(&c.shm[k]);
    }
}

/// A fresh run without faults of `ranks` ranks with `train`'s flags, its
/// files in `dir` under `name`: loaded from the checkpoint in `load`, and
/// run to step `to` and saved there, where given. Returns where it saved
/// and its log.
fn fresh_leg(
    dir: &std::path::Path,
    train: &[String],
    ranks: usize,
    load: Option<&std::path::Path>,
    to: Option<u64>,
    name: &str,
) -> (std::path::PathBuf, Vec<serde_json::Value>) {
    let log = dir.join(format!("{name}.jsonl"));
    let save = dir.join(name);
    let mut args = train.to_vec();
    if let Some(to) = to {
        let at = args.iter().position(|a| a == "--train-iters").unwrap();
        args[at + 1] = to.to_string();
        args.extend(s(&["--save", save.to_str().unwrap()]));
    }
    if let Some(load) = load {
        args.extend(s(&["--load", load.to_str().unwrap()]));
    }
    args.extend(s(&["--log-jsonl", log.to_str().unwrap()]));
    assert_success(&run_launch(ranks, name, &args), name);
    (save, read_log(&log))
}

/// An `agentctl status` poll's test: the group has resized `n` times and
/// is at `world` ranks.
fn resized(n: usize, world: u64) -> impl Fn(&serde_json::Value) -> Option<()> {
    move |v| {
        let s = &v["status"];
        (s["resizes"].as_array().is_some_and(|r| r.len() == n) && s["world_size"] == world)
            .then_some(())
    }
}

/// The step and the new size of each reshape in a run's log, in order.
fn reshapes(run: &[serde_json::Value]) -> Vec<(u64, u64)> {
    run.iter()
        .filter(|e| e["event"] == "reshape")
        .map(|e| {
            (
                e["step"].as_u64().unwrap(),
                e["world_size"].as_u64().unwrap(),
            )
        })
        .collect()
}
