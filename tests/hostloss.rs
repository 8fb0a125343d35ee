//! Whole hosts lost from a job of three hosts of two ranks each (agents on
//! 127.0.0.1–3, each with its own shared-memory root) and its standby
//! agents. A host vanishes as a machine would: its agent and workers
//! SIGKILLed, its shared memory deleted. While it happens the job stands
//! still (rank 0 naps in step 30), so every replica has caught up.
//!
//! - One host lost: recovered on the standby from its peer replicas.
//! - The controller's host lost: a successor takes over and recovers it
//!   the same way.
//! - Two hosts lost at once with `--replicas 2`: recovered on two standbys.
//! - Two hosts lost one after the other, the controller's second: the
//!   replicas follow the first standby, and the second recovers from them.
//! - A host lost with no standby left (dump on): the last-words checkpoint
//!   takes its ranks from their replicas, each host writing its share;
//!   resuming from it on one host of six ranks ends bit-identically.
//! - SIGTERM to a follower's agent: every host writes its share of the
//!   last words; resuming from them ends bit-identically.
//! - A standby that took a lost host's ranks lost in turn (vanished, or
//!   frozen past the host timeout): the next standby takes them.
//! - A host lost while the last words are under way (SIGTERM to the
//!   controller, then host 1 vanishes while the ranks pause): its ranks
//!   come from their replicas, and the resume is bit-identical.
//! - A host lost with the only holder of its replicas: the job stops at
//!   once, naming the ranks whose state is gone and the newest complete
//!   checkpoint on disk; nothing claims a later step.
//! - A host whose replica streams are starved of CPU (a busy loop on every
//!   core, the job training on): lost once its ranks trained 3 or more
//!   steps past their replicas, it is still recovered from memory (the
//!   step the replicas and the other hosts have in common is kept).
//! - A host whose NPU must be isolated (a SeparateNPU event from the
//!   stand-in DCMI library): it leaves the job as a lost host does, and its
//!   ranks are recovered on the standby from their peer replicas.
//!
//! Every run that recovers ends with every step's loss and the final
//! checksum of one host with six ranks; nothing is left in any root.

mod common;
use common::cluster::*;
use common::hosts::*;
use common::*;
use std::path::PathBuf;
use std::time::Duration;

/// The controller (host 0) recovered host 1's ranks 2 and 3 on the standby
/// (host 3) from their replicas, and the run equals the reference.
fn host1_recovered_on_the_standby(
    c: &Cluster,
    outs: &[(usize, std::process::Output)],
    reference: &[serde_json::Value],
) {
    let controller = stderr(outs, 0);
    assert!(
        controller.contains("host 1 lost: recovering on a standby host")
            && controller.contains("ranks=[2, 3] s_star="),
        "the controller recovered host 1's ranks on the standby:\n{controller}"
    );
    assert_filled(&stderr(outs, 3), &[2, 3]);
    assert_recovered(c, outs, reference);
}

/// Host 1 vanishes; the controller gives its ranks to the standby, whose
/// stores are filled from their replicas on host 2 ((1 + 1) mod 3); every
/// rank resumes from s\*. Once the standby holds ranks 2 and 3 itself,
/// host 2's hand-over to it ends (it offered every new step before, each
/// refused), and the standby counted no frame as malformed: checked while
/// rank 0 naps again in step 50.
#[test]
fn a_lost_host_is_recovered_on_a_standby_from_its_peer_replicas() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, reference) = six_ranks_reference(tmp.path());
    let plan = format!("{NAP};0:50:forward:sleep6000");
    let mut c = Cluster::start_with_plan(tmp, "standby", 1, &[], &train, &plan);
    c.wait_held(2, &[2, 3]);
    c.vanish(&[1]);
    // Host 2 streams its own ranks past step 45 (so the job is well past
    // the recovery), while nothing goes to the standby any more.
    let settled = poll_agentctl(&c.socket(2), "status", Duration::from_secs(120), |v| {
        let streams = v["status"]["replicas"]["streams"].as_array()?;
        let own_past_45 = streams.iter().any(|s| {
            s["node"] == 0
                && s["ranks"]
                    .as_array()
                    .is_some_and(|r| r.iter().any(|r| r["local_step"].as_u64() >= Some(45)))
        });
        let handover_done = streams
            .iter()
            .filter(|s| s["node"] == 3)
            .all(|s| s["connected"] == false && s["ranks"].as_array().is_some_and(Vec::is_empty));
        (own_past_45 && handover_done).then(|| streams.clone())
    });
    let standby = poll_agentctl(&c.socket(3), "status", Duration::from_secs(30), |v| {
        Some(v["status"]["replicas"].clone())
    });
    if settled.is_none() || standby.is_none() {
        panic!(
            "host 2's hand-over to the standby never ended ({settled:?}), or the standby did not answer:\n{}",
            c.kill_all()
        );
    }
    let standby = standby.unwrap();
    assert_eq!(
        standby["rejected_malformed"], 0,
        "the standby counted no frame as malformed: {standby}"
    );
    let outs = c.ends(&[0, 2, 3]);
    host1_recovered_on_the_standby(&c, &outs, &reference);
}

/// Host 1's replica streams starved of CPU: a burner on every core beside
/// streams that take idle CPU only (`SCHED_IDLE`), while the job trains on
/// (no nap). The replicas of host 1's ranks fall steps behind what the
/// other hosts' stores would keep, and the job keeps the step they have in
/// common (the replica hold). Host 1 vanishes while its stream lags: its
/// ranks are recovered on the standby from their replicas, never "no
/// common step", and the run equals the reference.
#[test]
fn a_host_whose_replica_stream_is_starved_of_cpu_is_recovered_from_memory() {
    let tmp = tempfile::tempdir().unwrap();
    // Long enough for the replicas to fall behind while the job trains.
    let mut train = tiny_args(400);
    let at = train.iter().position(|a| a == "--global-batch").unwrap();
    train[at + 1] = "24".into();
    let log = tmp.path().join("ref.jsonl");
    let mut args = train.clone();
    args.extend(["--log-jsonl".into(), log.display().to_string()]);
    assert_success(&run_launch(6, "starved-ref", &args), "one host, six ranks");
    let reference = read_log(&log);
    let mut c = Cluster::start_with_plan(tmp, "starved", 1, &[], &train, "");
    let burners = Burners::start();
    // Host 1's ranks have trained 3 steps or more past the newest step of
    // their replicas (without the hold the other hosts' stores, of 3
    // slots, would hold no step of those), with a common step kept.
    let lagging = poll_agentctl(&c.socket(1), "status", Duration::from_secs(120), |v| {
        let s = &v["status"];
        let trained = s["workers"]
            .as_array()?
            .iter()
            .filter_map(|w| w["step"].as_u64())
            .min()?;
        let replica = s["replicas"]["streams"]
            .as_array()?
            .iter()
            .flat_map(|s| s["ranks"].as_array().into_iter().flatten())
            .map(|k| k["replica_step"].as_u64())
            .collect::<Option<Vec<u64>>>()?
            .into_iter()
            .max()?;
        let common = s["replicas"]["kept"]["common"].as_u64()?;
        (trained >= replica + 3 && (5..350).contains(&trained))
            .then_some((trained, replica, common))
    });
    if lagging.is_none() {
        drop(burners);
        panic!(
            "host 1's stream never lagged with a common step kept:\n{}",
            c.kill_all()
        );
    }
    c.vanish(&[1]);
    drop(burners);
    let outs = c.ends(&[0, 2, 3]);
    host1_recovered_on_the_standby(&c, &outs, &reference);
}

/// Host 1's NPU 0 (rank 2's) must be isolated: its DCMI reports 0x80E18402
/// (SeparateNPU). Host 1 leaves the job as a lost host does, and the
/// controller recovers ranks 2 and 3 on the standby from their replicas.
#[test]
fn a_host_whose_npu_must_be_isolated_leaves_and_its_ranks_recover_on_a_standby() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, reference) = six_ranks_reference(tmp.path());
    let standin = common::dcmi::standin().display().to_string();
    let mut c = Cluster::start(tmp, "npu-out", 1, &["--dcmi-library", &standin], &train);
    c.wait_held(2, &[2, 3]);
    common::dcmi::post(
        &c.dcmi_events(1),
        "separate",
        &[common::dcmi::event(
            0x80E1_8402,
            0,
            1,
            "hbm isolated lines reached 64",
        )],
    );
    let left = c.ends(&[1]);
    let host1 = stderr(&left, 1);
    assert_eq!(
        left[0].1.status.code(),
        Some(i32::from(hatrain_agent::exit::DEVICE_LOST)),
        "{host1}"
    );
    assert!(
        host1.contains("class=\"SeparateNPU\" action=host")
            && host1.contains("device lost: this host leaves the job"),
        "{host1}"
    );
    assert_nothing_left(&c.shm[1]);
    let outs = c.ends(&[0, 2, 3]);
    host1_recovered_on_the_standby(&c, &outs, &reference);
}

/// Hosts lost one after the other: host 1, then host 0, the controller.
/// The replicas follow the standby that took host 1's ranks: host 0
/// streams its ranks to it (host 1 held them), and it streams the ranks it
/// took to host 2. So when host 0 goes, its ranks are on standby 3: node
/// 2 takes over and gives them to standby 4. Rank 2, on standby 3 by then,
/// naps in step 45 so that the replicas catch up.
#[test]
fn hosts_lost_one_after_the_other_are_recovered_as_the_replicas_follow_the_standbys() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, reference) = six_ranks_reference(tmp.path());
    let plan = format!("{NAP};2:45:forward:sleep8000:*");
    let mut c = Cluster::start_with_plan(tmp, "onebyone", 2, &[], &train, &plan);
    c.wait_held(2, &[2, 3]);
    c.vanish(&[1]);
    c.wait_held_at(3, &[0, 1], 44);
    c.wait_held_at(2, &[2, 3], 44);
    c.vanish(&[0]);
    let outs = c.ends(&[2, 3, 4]);
    let successor = stderr(&outs, 2);
    assert!(
        successor.contains("host 0 lost: recovering on a standby host")
            && successor.contains("ranks=[0, 1] s_star="),
        "node 2 took over and recovered host 0's ranks on a standby:\n{}",
        logs(&outs)
    );
    assert_filled(&stderr(&outs, 3), &[2, 3]);
    assert_filled(&stderr(&outs, 4), &[0, 1]);
    assert_recovered(&c, &outs, &reference);
}

/// A standby that took a lost host's ranks is lost in turn. Host 0, the
/// controller's, vanishes: node 1 takes over and gives ranks 0 and 1 to
/// standby 3, which streams their replicas to host 1 as host 0 did. Then
/// host 3 is lost too (`lose`), and standby 4 takes ranks 0 and 1, filled
/// from the replicas host 1 holds of them. Rank 2 naps in step 45 so that
/// those replicas catch up first.
fn a_standby_lost_in_turn(name: &str, lose: impl FnOnce(&mut Cluster)) {
    let tmp = tempfile::tempdir().unwrap();
    let (train, reference) = six_ranks_reference(tmp.path());
    let plan = format!("{NAP};2:45:forward:sleep8000");
    let mut c = Cluster::start_with_plan(tmp, name, 2, &[], &train, &plan);
    c.wait_held(1, &[0, 1]);
    c.vanish(&[0]);
    c.wait_held_at(1, &[0, 1], 44);
    lose(&mut c);
    let outs = c.ends(&[1, 2, 4]);
    let successor = stderr(&outs, 1);
    assert!(
        successor.contains("taking over as the job's controller")
            && successor.matches("ranks=[0, 1] s_star=").count() == 2,
        "node 1 took over and recovered ranks 0 and 1 twice:\n{}",
        logs(&outs)
    );
    assert_filled(&stderr(&outs, 4), &[0, 1]);
    assert_recovered(&c, &outs, &reference);
}

/// [`a_standby_lost_in_turn`], host 3 SIGKILLed with its shared memory.
#[test]
fn a_standby_that_took_over_and_vanishes_is_replaced_by_the_next_standby() {
    a_standby_lost_in_turn("standby-gone", |c| c.vanish(&[3]));
}

/// [`a_standby_lost_in_turn`], host 3 frozen (SIGSTOP of its agent and
/// workers) past the host timeout, and thawed once standby 4 runs its
/// ranks: it leaves the job, and leaves nothing in its root.
#[test]
fn a_standby_that_took_over_and_freezes_is_replaced_by_the_next_standby() {
    a_standby_lost_in_turn("standby-frozen", |c| {
        c.freeze(3);
        let replaced = poll_agentctl(&c.socket(1), "status", Duration::from_secs(120), |v| {
            let recovered = v["status"]["faults"]
                .as_array()?
                .iter()
                .filter(|f| f["kind"] == "host_lost" && f["recovery_s"].is_number())
                .count();
            (recovered >= 2).then_some(())
        });
        c.thaw(3);
        if replaced.is_none() {
            panic!(
                "the frozen standby's ranks never recovered:\n{}",
                c.kill_all()
            );
        }
        let frozen = c.ends(&[3]);
        assert!(
            !frozen[0].1.status.success(),
            "the host that froze leaves the job:\n{}",
            logs(&frozen)
        );
        assert_nothing_left(&c.shm[3]);
    });
}

/// Host 0 runs the controller, and vanishes. The survivors agree on a
/// successor (node 1, the lowest), whose agent takes over from what the
/// old controller had told it and what every host reports; it gives host
/// 0's ranks to the standby, filled from their replicas on host 1; the
/// workers meet in the successor's store from then on.
#[test]
fn the_loss_of_the_controllers_host_is_recovered_on_a_standby_too() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, reference) = six_ranks_reference(tmp.path());
    let mut c = Cluster::start(tmp, "ctlloss", 1, &[], &train);
    c.wait_held(1, &[0, 1]);
    c.vanish(&[0]);
    let outs = c.ends(&[1, 2, 3]);
    let successor = stderr(&outs, 1);
    assert!(
        successor.contains("taking over as the job's controller")
            && successor.contains("host 0 lost: recovering on a standby host")
            && successor.contains("ranks=[0, 1] s_star="),
        "node 1 took over and recovered host 0's ranks on the standby:\n{successor}"
    );
    let follower = stderr(&outs, 2);
    assert!(
        (follower.contains("reporting to the successor")
            || follower.contains("following the controller that took over"))
            && follower.contains("the controller ended the job"),
        "node 2 follows the successor to the end:\n{follower}"
    );
    assert_filled(&stderr(&outs, 3), &[0, 1]);
    assert_recovered(&c, &outs, &reference);
}

/// With `--replicas 2`, host 0 holds the replicas of hosts 1 and 2; both
/// vanish at once and each one's ranks go to a standby of its own.
#[test]
fn two_hosts_lost_at_once_are_recovered_on_two_standbys_with_two_replicas() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, reference) = six_ranks_reference(tmp.path());
    let mut c = Cluster::start(tmp, "twolost", 2, &["--replicas", "2"], &train);
    c.wait_held(0, &[2, 3, 4, 5]);
    c.vanish(&[1, 2]);
    let outs = c.ends(&[0, 3, 4]);
    let controller = stderr(&outs, 0);
    for (node, ranks) in [(1, "[2, 3]"), (2, "[4, 5]")] {
        assert!(
            controller.contains(&format!("host {node} lost: recovering on a standby host"))
                && controller.contains(&format!("ranks={ranks} s_star=")),
            "the controller recovered host {node}'s ranks on a standby:\n{}",
            logs(&outs)
        );
    }
    let filled: usize = [3, 4]
        .iter()
        .map(|&k| {
            stderr(&outs, k)
                .matches("store filled from the peer replica")
                .count()
        })
        .sum();
    assert_eq!(
        filled,
        4,
        "the standbys filled all four lost ranks:\n{}",
        logs(&outs)
    );
    assert_recovered(&c, &outs, &reference);
}

/// With one replica each, host 1's is on host 2: both vanish at once. (Two
/// standbys, so that the three agents left are a majority of the five: a
/// controller without one decides nothing, see `tests/partition.rs`.) No
/// surviving host holds the state of ranks 2 and 3, so the controller stops
/// the job at once (not after the pause timeout), naming them and the
/// newest complete checkpoint on disk; nothing on disk claims a later step,
/// and no standby waits for their state.
#[test]
fn a_host_lost_with_the_only_holder_of_its_replicas_stops_naming_the_lost_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let save = tmp.path().join("ckpt");
    let mut train = tiny_args(60);
    let at = train.iter().position(|a| a == "--global-batch").unwrap();
    train[at + 1] = "24".into();
    train.extend(s(&["--save-interval", "10", "--save"]));
    train.push(save.display().to_string());
    let mut c = Cluster::start(tmp, "gone", 2, &[], &train);
    c.wait_held(0, &[4, 5]);
    c.vanish(&[1, 2]);
    let outs = c.ends(&[0, 3, 4]);
    let controller = stderr(&outs, 0);
    assert_eq!(
        code(&outs[0].1.status),
        Some(3),
        "the controller stops: recovery failed\n{controller}"
    );
    let newest = hatrain_shared::checkpoint::read_tracker(&save).unwrap();
    assert_eq!(newest, 20, "the agents saved 10 and 20 before step 30");
    assert!(
        controller.contains("the state of ranks [2, 3] is lost")
            && controller.contains(&format!(
                "the newest complete checkpoint on disk is iteration 20 in {}",
                save.display()
            )),
        "the controller names the lost ranks and the checkpoint to resume from:\n{controller}"
    );
    // (Host 2's ranks may have gone to the standby first, when its loss
    // was seen first: their replicas are on host 0.)
    for standby in [stderr(&outs, 3), stderr(&outs, 4)] {
        for rank in [2, 3] {
            assert!(
                !standby.contains(&format!("store filled from the peer replica rank={rank}")),
                "no standby takes rank {rank}, whose state is gone:\n{standby}"
            );
        }
    }
    for it in 21..=60 {
        let dir = hatrain_shared::checkpoint::iter_dir(&save, it);
        assert!(!dir.exists(), "{} claims a later step", dir.display());
    }
    assert!(!outs[1].1.status.success(), "the standby ends with the job");
    for k in [0, 3, 4] {
        assert_nothing_left(&c.shm[k]);
    }
}

/// No standby: host 1 vanishes while the job stands still in step 30.
/// The job stops with its last words: host 2 writes ranks 2 and 3 from
/// their replicas beside its own, host 0 its own, and the controller
/// commits. Resumed with `--load` on one host of six ranks, the run ends
/// with the losses and the checksum of the run without faults.
#[test]
fn with_no_standby_the_last_words_take_a_lost_hosts_ranks_from_their_replicas() {
    let lw = LastWords::start("lastwords");
    let mut c = lw.cluster;
    let save = lw.save;
    c.vanish(&[1]);
    let outs = c.ends(&[0, 2]);
    let controller = stderr(&outs, 0);
    assert_eq!(
        code(&outs[0].1.status),
        Some(3),
        "the job stops: no standby takes host 1's ranks\n{controller}"
    );
    let it = hatrain_shared::checkpoint::read_tracker(&save)
        .unwrap_or_else(|e| panic!("no checkpoint on disk ({e}):\n{}", logs(&outs)));
    assert!(
        (29..=30).contains(&it),
        "the last words are of the step the job stood still at, not {it}"
    );
    assert!(
        controller.contains(&format!("last-words checkpoint of iteration {it} written")),
        "the controller says where the last words are:\n{controller}"
    );
    let holder = stderr(&outs, 2);
    assert!(
        holder.contains("writing this host's share of the checkpoint")
            && holder.contains("ranks=[2, 3, 4, 5]"),
        "host 2 writes the lost ranks from their replicas beside its own:\n{holder}"
    );
    for k in [0, 2] {
        assert_nothing_left(&c.shm[k]);
    }

    lw.rest.resumes_from(it, "lastwords-resume");
}

/// SIGTERM to host 1's agent (a follower) while the job stands still in
/// step 30: the controller stops the job with its last words, which every
/// host writes its share of. Resumed with `--load` on one host of six
/// ranks, the run ends with the losses and the checksum of the run without
/// faults.
#[test]
fn sigterm_to_a_follower_ends_the_job_with_last_words_every_host_writes_its_share_of() {
    let lw = LastWords::start("sigterm");
    let mut c = lw.cluster;
    let save = lw.save;
    let follower = c.agents[1].child.as_ref().unwrap().id() as i32;
    kill(follower, libc::SIGTERM);
    let outs = c.ends(&[0, 1, 2]);
    let it = hatrain_shared::checkpoint::read_tracker(&save)
        .unwrap_or_else(|e| panic!("no checkpoint on disk ({e}):\n{}", logs(&outs)));
    assert!(
        (29..=30).contains(&it),
        "the last words are of the step the job stood still at, not {it}"
    );
    let controller = stderr(&outs, 0);
    assert!(
        controller.contains(&format!("last-words checkpoint of iteration {it} written")),
        "{controller}"
    );
    for (k, ranks) in [(0, "[0, 1]"), (1, "[2, 3]"), (2, "[4, 5]")] {
        let log = stderr(&outs, k);
        assert!(
            log.contains("writing this host's share of the checkpoint")
                && log.contains(&format!("ranks={ranks}")),
            "host {k} writes its own ranks:\n{}",
            logs(&outs)
        );
        assert!(!outs[k].1.status.success(), "host {k} was interrupted");
        assert_nothing_left(&c.shm[k]);
    }

    lw.rest.resumes_from(it, "sigterm-resume");
}

/// SIGTERM to the controller while the job stands still (rank 0 naps, so
/// the pause for the last words waits), then host 1 vanishes before the
/// ranks have paused: the last words take ranks 2 and 3 from their
/// replicas on host 2, and resuming from them ends bit-identically.
#[test]
fn a_host_lost_while_the_last_words_are_under_way_is_written_from_its_replicas() {
    let lw = LastWords::start("lw-lost");
    let mut c = lw.cluster;
    let save = lw.save;
    let controller = c.agents[0].child.as_ref().unwrap().id() as i32;
    kill(controller, libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(500));
    c.vanish(&[1]);
    let outs = c.ends(&[0, 2]);
    let it = hatrain_shared::checkpoint::read_tracker(&save)
        .unwrap_or_else(|e| panic!("no checkpoint on disk ({e}):\n{}", logs(&outs)));
    assert!((29..=30).contains(&it), "last words of iteration {it}");
    let holder = stderr(&outs, 2);
    assert!(
        holder.contains("writing this host's share of the checkpoint")
            && holder.contains("ranks=[2, 3, 4, 5]"),
        "host 2 writes the lost ranks from their replicas:\n{}",
        logs(&outs)
    );
    for k in [0, 2] {
        assert_nothing_left(&c.shm[k]);
    }

    lw.rest.resumes_from(it, "lw-lost-resume");
}

/// A job of three hosts of two ranks and no standby, saving only its last
/// words, standing still at step 30 with host 1's replicas held on host 2;
/// and what its resume is checked against.
struct LastWords {
    cluster: Cluster,
    save: PathBuf,
    rest: Resume,
}

impl LastWords {
    fn start(name: &str) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let (train, reference) = six_ranks_reference(tmp.path());
        let save = tmp.path().join("ckpt");
        let log = tmp.path().join("resumed.jsonl");
        let mut saving = train.clone();
        // Nothing is saved before the end (no --save-interval): only the
        // last words can be on disk.
        saving.extend(s(&["--save", save.to_str().unwrap()]));
        let mut cluster = Cluster::start(tmp, name, 0, &[], &saving);
        cluster.wait_held(2, &[2, 3]);
        Self {
            cluster,
            save: save.clone(),
            rest: Resume {
                train,
                reference,
                save,
                log,
            },
        }
    }
}
