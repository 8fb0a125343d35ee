//! The driver's shell over a recording fake of the OS, on tokio's paused
//! clock: what the machine decides reaches the processes (a start, a
//! signal), what comes of it returns to the machine, and the machine's
//! clock is the job's. No process is started, no second passes.

use super::*;
use crate::config::HaSettings;
use crate::reaper::ExitStatus;
use crate::recovery::ExitCause;
use crate::supervisor::{Os, RecordingOs, WorkerSpec};
use hatrain_shared::control::FaultKind;
use hatrain_shared::ha::HaModes;
use hatrain_shared::ident::JobId;
use nix::sys::signal::Signal;

fn cfg(root: &std::path::Path) -> LaunchConfig {
    LaunchConfig {
        nnodes: 1,
        node_rank: 0,
        nproc_per_node: 2,
        master_addr: "127.0.0.1".into(),
        master_port: Some(29500),
        rdzv_port: None,
        group_restarts: 0,
        output: Default::default(),
        job_id: JobId::new("shell").unwrap(),
        secret_file: None,
        threads_per_worker: 1,
        stop_grace: Duration::from_secs(3),
        command: vec!["/bin/true".into()],
        ha: HaSettings {
            modes: HaModes {
                dump: true,
                retry: true,
                recover: true,
                elastic: false,
            },
            shm_root: root.join("shm"),
            pause_timeout: Duration::from_secs(2),
            ..HaSettings::default()
        },
        worker_env: None,
    }
}

fn specs(ranks: &[usize]) -> Vec<WorkerSpec> {
    ranks
        .iter()
        .map(|&rank| WorkerSpec {
            rank,
            local_rank: rank,
            program: "/bin/true".into(),
            args: Vec::new(),
            env: Vec::new(),
        })
        .collect()
}

/// The supervisor of the job's 2 ranks over `os`.
async fn supervisor(
    os: &Arc<RecordingOs>,
    cfg: &LaunchConfig,
    run: &std::path::Path,
) -> Supervisor {
    let spawner = Spawner::Os(Arc::clone(os) as Arc<dyn Os>);
    let plan = (cfg.output.clone(), run.to_path_buf());
    Supervisor::start(&specs(&[0, 1]), spawner, cfg.stop_grace, plan, &[])
        .await
        .expect("started")
}

/// `rank`'s worker is SIGKILLed; the supervisor reaps it and the driver
/// is told, as the event loop does.
async fn killed(os: &RecordingOs, d: &mut Driver<'_>, sup: &mut Supervisor, rank: usize) {
    let pid = sup.pid(rank).expect("running");
    os.signal(-pid, Signal::SIGKILL);
    let (r, ev) = sup.next_exit().await.expect("its exit");
    assert_eq!((r, ev.status), (rank, ExitStatus::Signaled(9)));
    let cause = ExitCause::Status;
    d.feed(
        sup,
        Event::Exited {
            rank,
            status: ev.status,
            cause,
        },
    );
}

/// Both ranks registered with the runtime (the stores they snapshot into
/// are not needed here: nothing is restored).
fn registered(d: &mut Driver<'_>, sup: &mut Supervisor) {
    for rank in [0, 1] {
        d.feed(
            sup,
            Event::Registered {
                rank,
                checkpoint: true,
                global_batch: None,
            },
        );
    }
}

fn machine<'a>(d: &'a Driver<'_>) -> &'a crate::recovery::Machine {
    match &d.decider {
        Decider::Controller(c) => &c.machine,
        Decider::Follower(_) => panic!("one host controls itself"),
    }
}

/// A worker killed 3 s into the job: the machine's restart in place is a
/// new process of that rank, started through the OS, and the fault is
/// dated 3 s into the job.
#[tokio::test(start_paused = true)]
async fn a_crashed_worker_is_started_again_through_the_os_and_its_fault_dated_on_the_jobs_clock() {
    let t = tempfile::tempdir().unwrap();
    let cfg = cfg(t.path());
    let mut dir = JobDir::open(&cfg.ha.shm_root, &cfg.job_id).unwrap();
    let os = Arc::new(RecordingOs::default());
    let mut sup = supervisor(&os, &cfg, t.path()).await;
    let (tx, _rx) = mpsc::unbounded_channel();
    let (decider, _) = decider_for(&cfg, &dir, None, false, sup.ranks());
    let mut d = Driver::new(&cfg, &mut dir, decider, Box::new(specs), tx);
    registered(&mut d, &mut sup);
    tokio::time::advance(Duration::from_secs(3)).await;
    killed(&os, &mut d, &mut sup, 1).await;
    let starts: Vec<usize> = os.started().into_iter().map(|(r, _)| r).collect();
    assert_eq!(starts, [0, 1, 1], "{:#?}", machine(&d).faults());
    assert_eq!(sup.pid(1), os.started().last().map(|(_, p)| *p));
    let m = machine(&d);
    let f = m.faults().last().expect("the crash is recorded");
    assert_eq!((f.kind, f.ranks.as_slice()), (FaultKind::Crash, &[1][..]));
    let at = f.detected_unix_s - m.started_unix_s();
    assert!((at - 3.0).abs() < 0.01, "detected {at} s into the job");
    assert_eq!(d.outcome, None);
}

/// A replacement the OS cannot start: the machine is told, and stops the
/// job naming the rank (after its last words); nothing else is started.
#[tokio::test(start_paused = true)]
async fn a_replacement_the_os_cannot_start_stops_the_job_naming_the_rank() {
    let t = tempfile::tempdir().unwrap();
    let cfg = cfg(t.path());
    let mut dir = JobDir::open(&cfg.ha.shm_root, &cfg.job_id).unwrap();
    let os = Arc::new(RecordingOs::default());
    let mut sup = supervisor(&os, &cfg, t.path()).await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (decider, _) = decider_for(&cfg, &dir, None, false, sup.ranks());
    let mut d = Driver::new(&cfg, &mut dir, decider, Box::new(specs), tx);
    registered(&mut d, &mut sup);
    os.failing(0);
    killed(&os, &mut d, &mut sup, 0).await;
    // The last words wait for the ranks to pause (none answers here)
    // until the pause times out; no rank registered a checkpoint layout,
    // so they fail, and the job stops.
    for _ in 0..30 {
        if d.outcome.is_some() {
            break;
        }
        tokio::time::advance(Duration::from_secs(1)).await;
        d.on_tick(&mut sup);
        // Collections are verified on a blocking thread.
        let wait = Duration::from_millis(100);
        while let Ok(Some(c)) = tokio::time::timeout(wait, rx.recv()).await {
            d.on_collected(&mut sup, c);
        }
    }
    assert_eq!(os.started().len(), 2, "only the first two started");
    assert!(
        matches!(d.outcome, Some(Outcome::WorkerFailed { rank: 0, .. })),
        "{:?} {} {:#?}",
        d.outcome,
        machine(&d).activity(),
        machine(&d).faults()
    );
    let f = machine(&d).faults().last().expect("recorded");
    assert!(f.action.contains("cannot restart rank 0"), "{}", f.action);
}
