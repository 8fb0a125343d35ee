//! The job's membership and leadership kept in etcd (`--coordinator
//! etcd://...`): Debian's `etcd-server`, started by each test on loopback
//! ports with its data under a temporary folder. The multi-host scenarios
//! run as with the embedded coordinator, and end bit-identical to one host
//! of six ranks:
//!
//! - workers SIGKILLed on a follower's host and on the controller's are
//!   rebooted in place;
//! - a host lost (its lease expires) is recovered on the standby from its
//!   peer replicas;
//! - the controller's host lost: its leader key goes with its lease, node 1
//!   takes the key and recovers host 0's ranks on the standby.
//!
//! - the controller's host frozen (SIGSTOP) past its lease: node 1 takes
//!   the leader key and recovers host 0's ranks on the standby; host 0,
//!   resumed, sees another act under a newer term and stops, and no agent
//!   follows it again.
//!
//! - with three etcd members: one killed mid-run changes nothing; two
//!   killed, then a worker killed, the job waits, and recovers once the
//!   members are back, bit-identical; or, with them kept down, it writes
//!   its last words after `--coordinator-timeout` and stops, saying why,
//!   and the run resumed from them is bit-identical.
//!
//! Nothing is left: no agent, no etcd, no data directory, no shm file.

mod common;
use common::cluster::*;
use common::etcd::Etcd;
use common::hosts::*;
use common::{poll_agentctl, s};
use std::time::Duration;

/// Starts one etcd member in a folder of its own (kept apart from the
/// cluster's, which the cluster removes).
fn etcd() -> (tempfile::TempDir, Etcd) {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path(), 1);
    (dir, etcd)
}

#[test]
fn workers_are_rebooted_in_place_on_any_host_with_the_etcd_coordinator() {
    let (_dir, etcd) = etcd();
    let tmp = tempfile::tempdir().unwrap();
    let (train, reference) = six_ranks_reference(tmp.path());
    let url = etcd.url();
    // Rank 3 (host 1) dies at step 15, rank 0 (host 0, the controller's)
    // at step 40.
    let plan = "3:15:forward:kill;0:40:forward:kill";
    let mut c =
        Cluster::start_with_plan(tmp, "etcdreboot", 0, &["--coordinator", &url], &train, plan);
    let outs = c.ends(&[0, 1, 2]);
    let controller = stderr(&outs, 0);
    assert!(
        controller.contains("etcd: this agent holds the job's leader key"),
        "node 0 holds the leader key:\n{controller}"
    );
    for (rank, host) in [(3usize, 1usize), (0, 0)] {
        assert!(
            controller.contains(&format!("ranks=[{rank}] s_star=")),
            "the controller recovered rank {rank}:\n{controller}"
        );
        let log = stderr(&outs, host);
        assert!(
            log.contains(&format!("replacement started rank={rank}")),
            "rank {rank} was restarted on its own host {host}:\n{log}"
        );
    }
    assert_recovered(&c, &outs, &reference);
}

#[test]
fn a_host_whose_lease_expires_is_recovered_on_a_standby_with_the_etcd_coordinator() {
    let (_dir, etcd) = etcd();
    let tmp = tempfile::tempdir().unwrap();
    let (train, reference) = six_ranks_reference(tmp.path());
    let url = etcd.url();
    let mut c = Cluster::start(tmp, "etcdstandby", 1, &["--coordinator", &url], &train);
    c.wait_held(2, &[2, 3]);
    c.vanish(&[1]);
    let outs = c.ends(&[0, 2, 3]);
    let controller = stderr(&outs, 0);
    assert!(
        controller.contains("host 1's lease in etcd expired")
            && controller.contains("host 1 lost: recovering on a standby host")
            && controller.contains("ranks=[2, 3] s_star="),
        "the controller recovered host 1's ranks on the standby:\n{controller}"
    );
    assert_filled(&stderr(&outs, 3), &[2, 3]);
    assert_recovered(&c, &outs, &reference);
}

#[test]
fn the_controllers_host_lost_is_recovered_by_the_next_leader_in_etcd() {
    let (_dir, etcd) = etcd();
    let tmp = tempfile::tempdir().unwrap();
    let (train, reference) = six_ranks_reference(tmp.path());
    let url = etcd.url();
    let mut c = Cluster::start(tmp, "etcdctlloss", 1, &["--coordinator", &url], &train);
    c.wait_held(1, &[0, 1]);
    c.vanish(&[0]);
    let outs = c.ends(&[1, 2, 3]);
    let successor = stderr(&outs, 1);
    assert!(
        successor.contains("etcd: this agent holds the job's leader key")
            && successor.contains("taking over as the job's controller")
            && successor.contains("host 0 lost: recovering on a standby host")
            && successor.contains("ranks=[0, 1] s_star="),
        "node 1 took the leader key and recovered host 0's ranks on the standby:\n{}",
        logs(&outs)
    );
    assert_filled(&stderr(&outs, 3), &[0, 1]);
    assert_recovered(&c, &outs, &reference);
}

#[test]
fn a_controller_paused_past_its_lease_cannot_act_again_and_the_successors_recovery_stands() {
    let (_dir, etcd) = etcd();
    let tmp = tempfile::tempdir().unwrap();
    let (train, reference) = six_ranks_reference(tmp.path());
    let url = etcd.url();
    let mut c = Cluster::start(tmp, "etcdpause", 1, &["--coordinator", &url], &train);
    c.wait_held(1, &[0, 1]);
    c.freeze(0);
    // Node 1 holds the leader key and the successor's recovery completed.
    let recovered = poll_agentctl(&c.socket(1), "status", Duration::from_secs(60), |v| {
        let m = &v["status"]["membership"];
        let done = v["status"]["faults"]
            .as_array()?
            .iter()
            .any(|f| f["kind"] == "host_lost" && f["recovery_s"].is_number());
        (m["acting"] == true && m["follows"] == 1 && done).then_some(())
    });
    c.thaw(0);
    if recovered.is_none() {
        panic!(
            "node 1 never acted and recovered host 0's ranks:\n{}",
            c.kill_all()
        );
    }
    let outs = c.ends(&[0, 1, 2, 3]);
    let old = stderr(&outs, 0);
    assert_eq!(
        outs[0].1.status.code(),
        Some(3),
        "host 0, resumed, stops:\n{old}"
    );
    assert!(
        old.contains("its lease in etcd ran out; node 1 holds the job's leader key now")
            || old.contains(
                "its lease in etcd ran out; another agent holds the job's leader key now"
            ),
        "host 0 says another controller acts in its place:\n{old}"
    );
    for (k, log) in [
        (1, stderr(&outs, 1)),
        (2, stderr(&outs, 2)),
        (3, stderr(&outs, 3)),
    ] {
        assert!(
            !log.contains("following the controller that took over node=0"),
            "host {k} never follows the paused controller again:\n{log}"
        );
    }
    let successor = stderr(&outs, 1);
    assert!(
        successor.contains("taking over as the job's controller")
            && successor.contains("ranks=[0, 1] s_star="),
        "node 1 recovered host 0's ranks:\n{successor}"
    );
    assert_filled(&stderr(&outs, 3), &[0, 1]);
    assert_recovered(&c, &outs[1..], &reference);
    assert_nothing_left(&c.shm[0]);
}

/// Rank 0 naps 14 s in step 30 (the job stands still while etcd is
/// changed, and the leases of its agents run out: 3 s); rank 3 (host 1)
/// dies in step 32, after the nap.
const NAP_THEN_KILL: &str = "0:30:forward:sleep14000;3:32:forward:kill";

/// Three etcd members and a job of three hosts, standing still in step 30.
fn three_members(
    name: &str,
    plan: &str,
    extra: &[&str],
    save: bool,
) -> (tempfile::TempDir, Etcd, Cluster, Resume) {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path(), 3);
    let tmp = tempfile::tempdir().unwrap();
    let (train, reference) = six_ranks_reference(tmp.path());
    let rest = Resume {
        train: train.clone(),
        reference,
        save: tmp.path().join("ckpt"),
        log: tmp.path().join("resumed.jsonl"),
    };
    let mut args = train;
    if save {
        args.extend(s(&["--save", rest.save.to_str().unwrap()]));
    }
    let url = etcd.url();
    let mut flags = vec!["--coordinator", url.as_str()];
    flags.extend(extra);
    let mut c = Cluster::start_with_plan(tmp, name, 0, &flags, &args, plan);
    c.wait_held(2, &[2, 3]);
    (dir, etcd, c, rest)
}

#[test]
fn one_etcd_member_of_three_lost_changes_nothing() {
    let (_dir, mut etcd, mut c, rest) = three_members("etcdone", NAP, &[], false);
    etcd.kill(0);
    let outs = c.ends(&[0, 1, 2]);
    for (k, _) in &outs {
        let log = stderr(&outs, *k);
        assert!(
            !log.contains(" lost") && !log.contains("waits for etcd"),
            "host {k} saw no loss and waited for nothing:\n{log}"
        );
    }
    assert_recovered(&c, &outs, &rest.reference);
}

#[test]
fn a_fault_while_etcd_has_no_quorum_waits_for_it_and_recovers_when_it_returns() {
    let (_dir, mut etcd, mut c, rest) = three_members("etcdback", NAP_THEN_KILL, &[], false);
    etcd.kill(1);
    etcd.kill(2);
    // The nap ends, rank 3 dies in step 32 and its fault waits: the
    // controller's lease ran out meanwhile.
    let waiting = poll_agentctl(&c.socket(0), "status", Duration::from_secs(60), |v| {
        let m = &v["status"]["membership"];
        (m["acting"] == false && m["waiting_faults"].as_u64() >= Some(1)).then_some(())
    });
    if waiting.is_none() {
        panic!(
            "the controller never held a fault, waiting for etcd:\n{}",
            c.kill_all()
        );
    }
    etcd.restart(1);
    etcd.restart(2);
    let outs = c.ends(&[0, 1, 2]);
    let controller = stderr(&outs, 0);
    assert!(
        controller.contains("the job waits for etcd")
            && controller.contains("holds its lease in etcd: deciding the faults that waited"),
        "the fault waited for etcd, and was decided once it answered:\n{controller}\n{}",
        etcd.logs()
    );
    assert!(
        controller.contains("ranks=[3] s_star="),
        "rank 3 was recovered:\n{controller}"
    );
    assert_recovered(&c, &outs, &rest.reference);
}

#[test]
fn a_fault_while_etcd_stays_without_quorum_ends_in_last_words_after_the_coordinator_timeout() {
    let (_dir, mut etcd, mut c, rest) = three_members(
        "etcdgone",
        NAP_THEN_KILL,
        &["--coordinator-timeout", "4"],
        true,
    );
    etcd.kill(1);
    etcd.kill(2);
    let outs = c.ends(&[0, 1, 2]);
    let controller = stderr(&outs, 0);
    assert_eq!(
        outs[0].1.status.code(),
        Some(3),
        "the job stops:\n{}",
        logs(&outs)
    );
    assert!(
        controller.contains("a fault waited 4 s (--coordinator-timeout-secs) for etcd"),
        "the controller says why it stopped:\n{controller}"
    );
    let it = hatrain_shared::checkpoint::read_tracker(&rest.save)
        .unwrap_or_else(|e| panic!("no last words on disk ({e}):\n{}", logs(&outs)));
    assert!(
        controller.contains(&format!("last-words checkpoint of iteration {it} written")),
        "the controller says where the last words are:\n{controller}"
    );
    for k in 0..3 {
        assert_nothing_left(&c.shm[k]);
    }
    rest.resumes_from(it, "etcdgone-resume");
}
