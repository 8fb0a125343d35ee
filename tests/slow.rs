//! Slow ranks, with real processes slowed for real (each sleeps in its
//! data path or its forward pass, every step from the eightieth, by its fault
//! plan): where each rank's steps go, phase by phase, as the agent reads
//! it from the control pages (`agentctl status`, `workers[].step_times`),
//! and the detector's findings (`agentctl slow`).
//!
//! - a rank slowed in its data path shows the time as data, the rank it
//!   holds back as collective time; it is named, with data as the phase,
//!   and not handed over even with `--on-slow replace`;
//! - a rank slowed in its forward pass is named with compute;
//! - both ranks slowed together (the host) raise nothing;
//! - healthy runs of the real model beside a CPU burner raise nothing;
//! - a rank throttled for real (a CPU quota on its process, a cgroup v1
//!   `cpu` group) is named with compute, and with `--on-slow replace` is
//!   handed to a warm standby once the slowdown has cost the job the price
//!   of a hand-over; the run ends bit-identical to one never throttled;
//! - with two hosts, the controller names a slow rank of the other host,
//!   with that host, and both ranks of that host slow as the host;
//! - with `--on-slow replace` and a standby host, a slow host leaves the
//!   job and the standby takes its ranks; the run ends bit-identical to
//!   one never slowed.
//! - a PyTorch DDP job's rank slowed in its forward pass is named with
//!   compute, and one slowed before `job.step()` (loading its batch) with
//!   data: the other rank's wait inside the backward pass (DDP's
//!   all-reduce) is timed as collective.

mod common;
use common::*;
use std::time::Duration;

/// Runs 2 ranks for `steps` steps (an emulated device of `device` ms, or
/// the real model) under `plan`, with `--on-slow replace` (and worker
/// reboot, a hand-over priced at nothing) where `replace`, polling `agentctl status` until
/// `done(status)`; returns the last status seen, whether `done` held, and
/// the launcher's output.
fn run(
    name: &str,
    steps: u64,
    device: Option<&str>,
    plan: &str,
    replace: bool,
    done: impl Fn(&serde_json::Value) -> bool,
) -> (serde_json::Value, bool, std::process::Output) {
    let d = tempfile::tempdir().unwrap();
    let mut args = tiny_args(steps);
    if let Some(ms) = device {
        args.extend(s(&["--emulate-device", ms]));
    }
    let job = job_id(name);
    let shm = d.path().join("shm");
    let mut launch = Launch::new(2).job(&job).shm_root(&shm);
    if replace {
        launch =
            launch
                .worker_reboot()
                .flags(["--on-slow", "replace", "--slow-handover-secs", "0"]);
    }
    let cmd = launch.args(args).fault_plan(plan).command();
    let mut running = Job::spawn(cmd, &job);
    let socket = shm.join(&job).join("agent.sock");
    let mut last = serde_json::Value::Null;
    let held = poll_agentctl(&socket, "status", Duration::from_secs(120), |v| {
        last = v["status"].clone();
        done(&last).then_some(())
    })
    .is_some();
    let out = running.wait_output(Duration::from_secs(240));
    assert_success(&out, name);
    (last, held, out)
}

/// Rank `rank`'s step times in `status`, once `steps` of them are timed.
fn times(status: &serde_json::Value, rank: u64, steps: u64) -> Option<serde_json::Value> {
    status["workers"]
        .as_array()?
        .iter()
        .find(|r| r["rank"] == rank)
        .map(|r| r["step_times"].clone())
        .filter(|t| t["steps"].as_u64().is_some_and(|n| n >= steps))
}

fn ms(t: &serde_json::Value, phase: &str) -> f64 {
    t[format!("{phase}_ms")].as_f64().unwrap()
}

/// The findings in `status`.
fn findings(status: &serde_json::Value) -> Vec<serde_json::Value> {
    status["slow"].as_array().cloned().unwrap_or_default()
}

#[test]
fn a_rank_slowed_in_its_data_path_shows_as_data_is_named_with_data_and_not_replaced() {
    // With --on-slow replace, the hand-over priced at nothing: a rank slow
    // in its data path is not handed over (a fresh process loads no
    // faster).
    let plan = "1:80-400:data:sleep40";
    let (status, held, out) = run("slow-data", 200, Some("20"), plan, true, |s| {
        times(s, 0, 100).is_some() && times(s, 1, 100).is_some() && !findings(s).is_empty()
    });
    assert!(held, "no finding after 100 steps: {status}\n{}", text(&out));
    let (fast, slow) = (
        times(&status, 0, 100).unwrap(),
        times(&status, 1, 100).unwrap(),
    );
    // The steps timed from the eightieth slept 40 ms in rank 1's data path.
    let n = slow["steps"].as_f64().unwrap();
    let slept = 40.0 * (n - 80.0) / n;
    assert!(ms(&slow, "data") >= 0.75 * slept, "rank 1: {slow}");
    assert!(ms(&fast, "data") < 5.0, "rank 0 loads at once: {fast}");
    assert!(
        ms(&fast, "collective") > ms(&slow, "collective") + 0.5 * slept,
        "rank 0 waits for rank 1 in the collectives: rank 0 {fast}, rank 1 {slow}"
    );
    // The emulated device's 20 ms are compute on both, and the phases are
    // within the step.
    for t in [&fast, &slow] {
        assert!(ms(t, "compute") >= 15.0, "{t}");
        let parts: f64 = ["data", "compute", "collective", "update"]
            .iter()
            .map(|p| ms(t, p))
            .sum();
        assert!(parts <= ms(t, "step") * 1.001, "{t}");
    }
    let f = &findings(&status)[0];
    assert_eq!(
        (f["rank"].as_u64(), f["phase"].as_str()),
        (Some(1), Some("data")),
        "{f}"
    );
    assert!(f["cause"].as_str().unwrap().contains("data loading"), "{f}");
    assert_eq!(
        status["faults"],
        serde_json::json!([]),
        "nothing handed over"
    );
    let since = f["since_step"].as_u64().unwrap();
    assert!(
        (50..=100).contains(&since),
        "the window holding step 80, or the next: {f}"
    );
}

#[test]
fn a_rank_slowed_in_its_forward_pass_is_named_with_compute() {
    let (status, held, out) = run(
        "slow-compute",
        200,
        Some("20"),
        "0:80-400:forward:sleep30",
        false,
        |s| !findings(s).is_empty(),
    );
    assert!(held, "no finding: {status}\n{}", text(&out));
    let f = &findings(&status)[0];
    assert_eq!(
        (f["rank"].as_u64(), f["phase"].as_str()),
        (Some(0), Some("compute")),
        "{f}"
    );
    let excess = f["excess_ms"].as_f64().unwrap();
    assert!(
        (20.0..60.0).contains(&excess),
        "about the 30 ms it sleeps: {f}"
    );
}

#[test]
fn both_ranks_slowed_together_raise_nothing() {
    let plan = "0:80-400:forward:sleep30;1:80-400:forward:sleep30";
    let (status, held, out) = run("slow-both", 200, Some("20"), plan, false, |s| {
        times(s, 0, 120).is_some() && times(s, 1, 120).is_some()
    });
    assert!(held, "never 120 steps timed: {status}\n{}", text(&out));
    assert!(findings(&status).is_empty(), "{status}");
}

/// The real model's compute on both cores, a burner on each beside it,
/// in a few runs: no finding.
#[test]
fn healthy_runs_beside_a_cpu_burner_raise_nothing() {
    let _burners = Burners::start();
    for k in 0..3 {
        let (status, held, out) = run(&format!("slow-healthy-{k}"), 400, None, "", false, |s| {
            times(s, 0, 300).is_some() && times(s, 1, 300).is_some()
        });
        assert!(held, "never 300 steps timed: {status}\n{}", text(&out));
        assert!(findings(&status).is_empty(), "run {k}: {status}");
    }
}

/// A PyTorch DDP job (`examples/torch_ddp.py`, gloo) whose rank 1 sleeps
/// 30 ms in each step's forward pass from step 150 (the drill plan): DDP's
/// all-reduce inside the backward pass keeps rank 0 waiting as long, which
/// `hatrain.torchtime` counts as its collective time, not compute; rank 1
/// is named, with compute. Slept before `job.step()` instead (where the
/// script loads its batch), it is named with data. An FSDP2 job
/// (`examples/torch_gpt.py`, a small GPT): rank 0 waits in FSDP's
/// all-gathers and reduce-scatters, timed as collective; rank 1 is named
/// with compute.
#[test]
fn a_pytorch_rank_slowed_in_its_forward_pass_or_its_data_is_named_with_that_phase() {
    let _one_at_a_time = common::python::serial();
    let fsdp = [
        "--layers", "2", "--width", "64", "--heads", "2", "--vocab", "256", "--seq", "16",
        "--batch", "2",
    ];
    for (example, extra, point, phase) in [
        (
            "torch_ddp.py",
            &["--step-ms", "5"][..],
            "forward",
            "compute",
        ),
        ("torch_ddp.py", &["--step-ms", "5"][..], "data", "data"),
        ("torch_gpt.py", &fsdp[..], "forward", "compute"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let job = job_id("slow-torch");
        let shm = dir.path().join("shm");
        let script = common::python::example(example);
        let mut args = vec![script.to_str().unwrap(), "--steps", "400"];
        args.extend(extra);
        let flags = ["--job-id", &job, "--shm-root", shm.to_str().unwrap()];
        let mut cmd = common::python::launch(2, &flags, &args, dir.path());
        cmd.env("HATRAIN_FAULT_PLAN", format!("1:150-400:{point}:sleep30"));
        let mut running = Job::spawn(cmd, &job);
        let socket = shm.join(&job).join("agent.sock");
        let mut last = serde_json::Value::Null;
        let found = poll_agentctl(&socket, "status", Duration::from_secs(180), |v| {
            last = v["status"].clone();
            // Named, and 150 steps slowed timed (the sums are the
            // whole run's).
            let f = findings(&last).into_iter().next()?;
            times(&last, 0, 300).map(|_| f)
        });
        let out = running.wait_output(Duration::from_secs(240));
        assert_success(&out, "the PyTorch job");
        let f = found
            .unwrap_or_else(|| panic!("{example} {point}: never named: {last}\n{}", text(&out)));
        assert_eq!(
            (f["rank"].as_u64(), f["phase"].as_str()),
            (Some(1), Some(phase)),
            "{example}: {f}"
        );
        assert!(f["since_step"].as_u64().unwrap() >= 100, "{example}: {f}");
        let excess = f["excess_ms"].as_f64().unwrap();
        assert!(
            (15.0..60.0).contains(&excess),
            "{example}: about the 30 ms it sleeps: {f}"
        );
        // Rank 0 waited in the collectives for rank 1.
        let (waited, slow) = (times(&last, 0, 300).unwrap(), times(&last, 1, 300).unwrap());
        assert!(
            ms(&waited, "collective") > ms(&slow, "collective") + 5.0,
            "{example}: rank 0 {waited}, rank 1 {slow}"
        );
    }
}

/// A cgroup v1 `cpu` group with a quota, removed when dropped (its
/// processes moved back to the root group first, should the test fail
/// while they live).
struct CpuQuota(std::path::PathBuf);

impl CpuQuota {
    /// `percent` of one core for `pid`.
    fn new(name: &str, percent: u64, pid: i32) -> Self {
        let dir = std::path::Path::new("/sys/fs/cgroup/cpu").join(name);
        std::fs::create_dir(&dir).unwrap_or_else(|e| {
            panic!("the test throttles a worker in a cgroup v1 cpu group (as root): {dir:?}: {e}")
        });
        let q = Self(dir);
        std::fs::write(q.0.join("cpu.cfs_period_us"), "100000").unwrap();
        std::fs::write(q.0.join("cpu.cfs_quota_us"), (percent * 1000).to_string()).unwrap();
        std::fs::write(q.0.join("cgroup.procs"), pid.to_string()).unwrap();
        q
    }

    fn procs(&self) -> Vec<i32> {
        std::fs::read_to_string(self.0.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

impl Drop for CpuQuota {
    fn drop(&mut self) {
        for pid in self.procs() {
            let _ = std::fs::write("/sys/fs/cgroup/cpu/cgroup.procs", pid.to_string());
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Rank 1's process is held to 20% of a core from step 60 on (a cgroup's
/// CPU quota: the real model's compute, throttled). The detector names it
/// with compute; `--on-slow replace` with a hand-over priced at 1 s hands
/// it to the warm standby once the slowdown cost that much (a fault of
/// kind `slow`, recovered by worker reboot); the standby is not
/// throttled, so the finding ends (three windows not slow); and the run
/// ends bit-identical to the same run never throttled (`scripts/slow-detect.sh replace` measures
/// the step times).
#[test]
fn a_rank_throttled_by_a_cpu_quota_is_handed_to_a_warm_standby_and_the_run_stays_bit_identical() {
    let d = tempfile::tempdir().unwrap();
    let steps = 800;
    let with_log = |name: &str| {
        let mut a = tiny_args(steps);
        a.extend(s(&["--log-jsonl", d.path().join(name).to_str().unwrap()]));
        a
    };
    let reference = run_launch(2, "slow-replace-ref", &with_log("ref.jsonl"));
    assert_success(&reference, "the run never throttled");
    let job = job_id("slow-replace");
    let shm = d.path().join("shm");
    let cmd = Launch::new(2)
        .worker_reboot()
        .job(&job)
        .shm_root(&shm)
        .flags([
            "--warm-standby",
            "1",
            "--on-slow",
            "replace",
            "--slow-handover-secs",
            "1",
        ])
        .args(with_log("slowed.jsonl"))
        .command();
    let mut running = Job::spawn(cmd, &job);
    let socket = shm.join(&job).join("agent.sock");
    let rank1 = |v: &serde_json::Value| {
        v["status"]["workers"]
            .as_array()?
            .iter()
            .find(|w| w["rank"] == 1)
            .cloned()
    };
    let pid = poll_agentctl(&socket, "status", Duration::from_secs(120), |v| {
        let w = rank1(v)?;
        (w["step"].as_u64()? >= 60).then(|| w["pid"].as_i64())?
    })
    .expect("rank 1 reached step 60") as i32;
    let quota = CpuQuota::new(&job, 20, pid);
    // Handed over, and rank 1's finding ended: the standby is not slow.
    let mut last = serde_json::Value::Null;
    let seen = poll_agentctl(&socket, "status", Duration::from_secs(120), |v| {
        last = v["status"].clone();
        let fault = last["faults"]
            .as_array()?
            .iter()
            .find(|f| f["kind"] == "slow" && f["recovery_s"].is_number())
            .cloned()?;
        let f = findings(&last)
            .into_iter()
            .find(|f| f["rank"] == 1 && f["ended"] == true)?;
        Some((fault, f))
    });
    let out = running.wait_output(Duration::from_secs(240));
    assert_success(&out, "the throttled run");
    let (fault, f) = seen.unwrap_or_else(|| {
        panic!(
            "never handed over, or still slow after: {last}\n{}",
            text(&out)
        )
    });
    assert_eq!(fault["ranks"], serde_json::json!([1]), "{fault}");
    assert_eq!(fault["class"], "reboot", "{fault}");
    assert!(
        quota.procs().is_empty(),
        "the throttled process is gone: {:?}",
        quota.procs()
    );
    assert_eq!(f["phase"], "compute", "{f}");
    assert_eq!(f["alone"], true, "{f}");
    let now = last["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["rank"] == 1);
    let now = now.and_then(|w| w["pid"].as_i64()).unwrap() as i32;
    assert_ne!(now, pid, "rank 1 runs in another process");
    let since = f["since_step"].as_u64().unwrap();
    assert!(since >= 51, "not before the quota: {f}");
    let slowed = read_log(&d.path().join("slowed.jsonl"));
    let fresh = read_log(&d.path().join("ref.jsonl"));
    assert_eq!(final_checksum(&slowed), final_checksum(&fresh));
    assert_eq!(final_losses(&slowed), final_losses(&fresh));
}

/// `--on-slow replace` restarts ranks in place: without worker reboot it
/// is a usage error that names what is missing, before any worker starts;
/// a policy that does not exist is one too.
#[test]
fn on_slow_replace_without_worker_reboot_and_an_unknown_policy_are_usage_errors() {
    for (flags, says) in [
        (
            &["--on-slow", "replace"][..],
            "--on-slow replace needs --enable-worker-reboot",
        ),
        (&["--on-slow", "evict"][..], "'evict'"),
    ] {
        let job = job_id("slow-flags");
        let out = Launch::new(2)
            .job(&job)
            .flags(flags)
            .program("true")
            .command()
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains(says), "{flags:?}: {stderr}");
        assert!(job_pids(&job).is_empty());
    }
}

/// Two hosts of two ranks (agents on 127.0.0.1 and 127.0.0.2): the
/// controller (host 0) compares every rank of the job from the views the
/// hosts report. Rank 2, on host 1, sleeping in its forward pass is named
/// there, with its host; both ranks of host 1 sleeping are that host.
#[test]
fn the_controller_names_a_slow_rank_of_another_host_and_a_slow_host() {
    for (plan, want) in [
        ("2:80-400:forward:sleep30", "one rank alone"),
        (
            "2:80-400:forward:sleep30;3:80-400:forward:sleep30",
            "every rank of host 1",
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let mut train = tiny_args(240);
        train.extend(s(&["--emulate-device", "20"]));
        let mut c =
            common::cluster::Cluster::start_shape(tmp, "slow-hosts", (2, 2), 0, &[], &train, plan);
        let mut last = serde_json::Value::Null;
        let found = poll_agentctl(&c.socket(0), "status", Duration::from_secs(120), |v| {
            last = v["status"].clone();
            findings(&last).into_iter().find(|f| f["rank"] == 2)
        });
        let Some(f) = found else {
            panic!("{plan}: never named: {last}\n{}", c.kill_all());
        };
        let outs = c.ends(&[0, 1]);
        for (k, out) in &outs {
            assert_success(out, &format!("{plan}: host {k}"));
        }
        assert_eq!(
            (f["host"].as_u64(), f["phase"].as_str()),
            (Some(1), Some("compute")),
            "{plan}: {f}"
        );
        assert!(f["cause"].as_str().unwrap().contains(want), "{plan}: {f}");
    }
}

/// Two hosts of two ranks and a standby host, `--on-slow replace`: both
/// ranks of host 1 sleep 30 ms in each forward pass from step 80 (host 1's
/// fault plan: the standby that takes its ranks is not slow). The
/// controller names host 1 and, once the slowdown has cost the job the
/// price of a hand-over (the host timeout, the hand-over itself priced at
/// nothing), orders it out: host 1 leaves the job (its agent exits with
/// `HANDED_OVER` and leaves nothing in its root), the standby takes ranks
/// 2 and 3 filled from their peer replicas, the finding ends there, and
/// the run ends bit-identical to one host of four ranks never slowed.
#[test]
fn a_slow_host_is_handed_to_a_standby_host_and_the_run_stays_bit_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let mut train = tiny_args(400);
    train.extend(s(&["--emulate-device", "20"]));
    let log = tmp.path().join("ref.jsonl");
    let mut args = train.clone();
    args.extend(s(&["--log-jsonl", log.to_str().unwrap()]));
    assert_success(
        &run_launch(4, "slow-host-ref", &args),
        "one host of four ranks",
    );
    let reference = read_log(&log);
    let slowed = "2:80-400:forward:sleep30;3:80-400:forward:sleep30";
    let replace = ["--on-slow", "replace", "--slow-handover-secs", "0"];
    let mut c = common::cluster::Cluster::start_shape_plans(
        tmp,
        "slow-host",
        (2, 2),
        1,
        &replace,
        &train,
        &["", slowed],
    );
    let mut last = serde_json::Value::Null;
    let seen = poll_agentctl(&c.socket(0), "status", Duration::from_secs(180), |v| {
        last = v["status"].clone();
        let fault = last["faults"]
            .as_array()?
            .iter()
            .find(|f| f["class"] == "standby" && f["recovery_s"].is_number())
            .cloned()?;
        let f = findings(&last)
            .into_iter()
            .find(|f| f["rank"] == 2 && f["ended"] == true)?;
        Some((fault, f))
    });
    let Some((fault, f)) = seen else {
        panic!(
            "host 1 never handed over, or still slow after: {last}\n{}",
            c.kill_all()
        );
    };
    let left = c.ends(&[1]);
    assert_eq!(
        left[0].1.status.code(),
        Some(i32::from(hatrain_agent::exit::HANDED_OVER)),
        "{}",
        common::cluster::logs(&left)
    );
    common::hosts::assert_nothing_left(&c.shm[1]);
    let outs = c.ends(&[0, 2]);
    common::cluster::assert_recovered(&c, &outs, &reference);
    assert_eq!(fault["ranks"], serde_json::json!([2, 3]), "{fault}");
    assert!(
        fault["detail"]
            .as_str()
            .unwrap()
            .contains("held the job back"),
        "{fault}"
    );
    assert_eq!(
        (
            f["host"].as_u64(),
            f["whole_host"].as_bool(),
            f["phase"].as_str()
        ),
        (Some(1), Some(true), Some("compute")),
        "{f}"
    );
}
