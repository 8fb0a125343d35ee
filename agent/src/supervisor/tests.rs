//! The supervisor over a recording fake of the OS: who is signalled, in
//! what order, after how long (paused tokio time), and what it starts.

use super::os::fake::RecordingOs;
use super::*;
use crate::reaper::ExitStatus;

fn specs(n: usize) -> Vec<WorkerSpec> {
    (0..n)
        .map(|rank| WorkerSpec {
            rank,
            local_rank: rank,
            program: "/bin/true".into(),
            args: Vec::new(),
            env: vec![
                ("HATRAIN_RESTART_COUNT".into(), "0".into()),
                (ENV_GROUP_RESTARTS.into(), "0".into()),
            ],
        })
        .collect()
}

async fn started(os: &Arc<RecordingOs>, n: usize, dir: &std::path::Path) -> Supervisor {
    let spawner = Spawner::Os(Arc::clone(os) as Arc<dyn Os>);
    let plan = (OutputPlan::default(), dir.to_path_buf());
    Supervisor::start(&specs(n), spawner, Duration::from_secs(5), plan, &[])
        .await
        .expect("started")
}

#[tokio::test(start_paused = true)]
async fn stopping_is_sigterm_to_each_group_then_sigkill_after_the_grace_period() {
    let dir = tempfile::tempdir().unwrap();
    let os = Arc::new(RecordingOs::default());
    let mut sup = started(&os, 3, dir.path()).await;
    let pids: Vec<i32> = os.started().into_iter().map(|(_, p)| p).collect();
    assert_eq!(pids.len(), 3);
    os.stubborn(pids[1]);
    let t0 = tokio::time::Instant::now();
    sup.stop_all().await;
    let waited = t0.elapsed();
    let signals = os.signals();
    // SIGTERM to every worker's process group first, then SIGKILL to the
    // one that ignored it, once the grace period had passed.
    let terms: Vec<i32> = signals
        .iter()
        .filter(|(_, s)| *s == Signal::SIGTERM)
        .map(|(p, _)| *p)
        .collect();
    assert_eq!(terms, pids.iter().map(|p| -p).collect::<Vec<_>>());
    let kills: Vec<i32> = signals
        .iter()
        .filter(|(_, s)| *s == Signal::SIGKILL)
        .map(|(p, _)| *p)
        .collect();
    assert_eq!(kills, vec![-pids[1]], "{signals:?}");
    assert!(
        waited >= Duration::from_secs(5),
        "killed before the grace: {waited:?}"
    );
    assert!(os.running().is_empty());
    assert!(sup.running().is_empty());
}

#[tokio::test(start_paused = true)]
async fn workers_that_stop_at_sigterm_are_not_killed_and_nothing_waits_for_the_grace() {
    let dir = tempfile::tempdir().unwrap();
    let os = Arc::new(RecordingOs::default());
    let mut sup = started(&os, 2, dir.path()).await;
    let t0 = tokio::time::Instant::now();
    sup.stop_all().await;
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(os.signals().iter().all(|(_, s)| *s == Signal::SIGTERM));
}

#[tokio::test(start_paused = true)]
async fn an_exit_is_reported_with_its_rank_and_the_rank_starts_again_with_its_count() {
    let dir = tempfile::tempdir().unwrap();
    let os = Arc::new(RecordingOs::default());
    let mut sup = started(&os, 2, dir.path()).await;
    let (_, pid) = os.started()[1];
    os.exit(pid, ExitStatus::Signaled(9));
    let (rank, ev) = sup.next_exit().await.expect("an exit");
    assert_eq!((rank, ev.pid, ev.status), (1, pid, ExitStatus::Signaled(9)));
    assert_eq!(sup.pid(1), None);
    let again = sup.respawn(1, 3, Some((0, 1))).expect("started again");
    assert_eq!(sup.pid(1), Some(again));
    assert_eq!(os.started().last(), Some(&(1, again)));
    let env = os.last_env();
    assert!(
        env.contains(&("HATRAIN_RESTART_COUNT".into(), "3".into())),
        "{env:?}"
    );
    let place = hatrain_shared::rendezvous::ENV_GROUP_PLACE;
    assert!(env.contains(&(place.into(), "0/1".into())), "{env:?}");
    // A rank this host never ran is refused, not a panic.
    assert!(matches!(
        sup.respawn(7, 1, None),
        Err(SupervisorError::NotHere { rank: 7 })
    ));
    // Not its own spawner's: no process group is killed after the exit
    // (the starter reaps its own).
    assert!(os.signals().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_group_restart_stops_everyone_then_starts_all_with_the_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let os = Arc::new(RecordingOs::default());
    let mut sup = started(&os, 2, dir.path()).await;
    let first: Vec<i32> = os.started().into_iter().map(|(_, p)| p).collect();
    let again = sup.restart_all(1).await.expect("restarted");
    assert_eq!(again.len(), 2);
    assert!(first.iter().all(|p| !os.running().contains(p)));
    assert_eq!(sup.attempt(), 1);
    assert_eq!(sup.running(), again);
    let spec = &sup.specs[0];
    assert!(spec.env.contains(&(ENV_GROUP_RESTARTS.into(), "1".into())));
}

#[tokio::test(start_paused = true)]
async fn a_worker_that_cannot_start_stops_those_started_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let os = Arc::new(RecordingOs::default());
    os.failing(2);
    let spawner = Spawner::Os(Arc::clone(&os) as Arc<dyn Os>);
    let plan = (OutputPlan::default(), dir.path().to_path_buf());
    let err = Supervisor::start(&specs(3), spawner, Duration::from_secs(5), plan, &[])
        .await
        .expect_err("rank 2 cannot start");
    assert!(
        matches!(err, SupervisorError::Spawn { rank: 2, .. }),
        "{err}"
    );
    assert!(os.running().is_empty(), "ranks 0 and 1 are stopped again");
}
