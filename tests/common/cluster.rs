//! A job of three hosts of two ranks each (agents on 127.0.0.1–3, each
//! with its own shared-memory root) and its standby agents, for the tests
//! of whole hosts lost.

use super::hosts::*;
use super::ports::free_ports;
use super::*;
use std::path::PathBuf;
use std::process::Output;
use std::time::Duration;

/// Rank 0 naps in step 30's forward pass: the job stands still meanwhile
/// (the hang bound is longer than the nap).
pub const NAP: &str = "0:30:forward:sleep8000";

/// Three hosts of two ranks and their standbys, running.
pub struct Cluster {
    pub shm: Vec<PathBuf>,
    pub job: String,
    pub agents: Vec<Job>,
    pub log: PathBuf,
    /// Standby agents started later, by [`Cluster::start_late`].
    late: Vec<(usize, std::process::Command)>,
    /// Dropped last, once every agent is gone.
    _tmp: tempfile::TempDir,
    /// One cluster at a time: eleven processes each on a small machine.
    _one: std::sync::MutexGuard<'static, ()>,
}

static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Cluster {
    /// Starts the hosts and `standbys` standby agents, each with `extra`
    /// flags, training with `train` (and a log of its own).
    pub fn start(
        tmp: tempfile::TempDir,
        name: &str,
        standbys: usize,
        extra: &[&str],
        train: &[String],
    ) -> Self {
        Self::start_with_plan(tmp, name, standbys, extra, train, NAP)
    }

    /// [`Cluster::start`] with the fault plan `plan`.
    pub fn start_with_plan(
        tmp: tempfile::TempDir,
        name: &str,
        standbys: usize,
        extra: &[&str],
        train: &[String],
        plan: &str,
    ) -> Self {
        Self::start_shape(tmp, name, (3, 2), standbys, extra, train, plan)
    }

    /// [`Cluster::start_with_plan`] with `nodes` hosts of `per_node` ranks.
    pub fn start_shape(
        tmp: tempfile::TempDir,
        name: &str,
        shape: (usize, usize),
        standbys: usize,
        extra: &[&str],
        train: &[String],
        plan: &str,
    ) -> Self {
        Self::start_later(tmp, name, shape, (standbys, 0), extra, train, plan)
    }

    /// [`Cluster::start_shape`] with a fault plan per host: host `k`'s
    /// agent runs `plans[k]` (none past the end).
    pub fn start_shape_plans(
        tmp: tempfile::TempDir,
        name: &str,
        shape: (usize, usize),
        standbys: usize,
        extra: &[&str],
        train: &[String],
        plans: &[&str],
    ) -> Self {
        let plan = |k: usize| plans.get(k).copied().unwrap_or_default();
        Self::start_planned(tmp, name, shape, (standbys, 0), extra, train, &plan)
    }

    /// [`Cluster::start_shape`] with `standbys.0` standby agents, of which
    /// the last `standbys.1` start only at [`Cluster::start_late`].
    pub fn start_later(
        tmp: tempfile::TempDir,
        name: &str,
        shape: (usize, usize),
        standbys: (usize, usize),
        extra: &[&str],
        train: &[String],
        plan: &str,
    ) -> Self {
        Self::start_planned(tmp, name, shape, standbys, extra, train, &|_| plan)
    }

    /// [`Cluster::start_later`], host `k` with the fault plan `plan(k)`.
    fn start_planned<'p>(
        tmp: tempfile::TempDir,
        name: &str,
        (nodes, per_node): (usize, usize),
        (standbys, later): (usize, usize),
        extra: &[&str],
        train: &[String],
        plan: &dyn Fn(usize) -> &'p str,
    ) -> Self {
        let one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let secret = secret_file(tmp.path());
        let shm: Vec<PathBuf> = (0..nodes + standbys)
            .map(|k| tmp.path().join(format!("host{k}")))
            .collect();
        let job = job_id(name);
        let ports: (u16, u16) = free_ports::<2>().into();
        let log = tmp.path().join("run.jsonl");
        let mut args = train.to_vec();
        args.extend(["--log-jsonl".into(), log.display().to_string()]);
        let spares = standbys.to_string();
        let agents = (0..nodes + standbys)
            .map(|k| {
                let mut flags = vec![
                    "--standby-nodes",
                    spares.as_str(),
                    "--hang-timeout-secs",
                    "20",
                ];
                flags.extend(extra);
                if k >= nodes {
                    flags.push("--standby");
                }
                let mut c = reboot_node(
                    k, nodes, per_node, &shm[k], &job, ports, &secret, &args, &flags,
                );
                c.env("HATRAIN_FAULT_PLAN", plan(k));
                // Each agent's run folder goes in the test's folder: a host
                // that vanishes (SIGKILL) leaves its own, as a machine
                // would, and the test's folder goes with the test.
                c.env("TMPDIR", tmp.path());
                // Where a stand-in libdcmi (given with `--dcmi-library`)
                // reads this host's recorded NPU fault events.
                let events = dcmi_events(tmp.path(), k);
                std::fs::create_dir_all(&events).unwrap();
                c.env("DCMI_STANDIN_DIR", events);
                (k, c)
            })
            .collect::<Vec<_>>();
        let first_late = nodes + standbys - later.min(standbys);
        let mut late = Vec::new();
        let mut started = Vec::new();
        for (k, c) in agents {
            if k >= first_late {
                late.push((k, c));
            } else {
                started.push(host_job(c, &job, k));
            }
        }
        Self {
            shm,
            job,
            agents: started,
            log,
            late,
            _tmp: tmp,
            _one: one,
        }
    }

    /// Kills every agent still running (a test that failed) and returns
    /// their logs.
    pub fn kill_all(&mut self) -> String {
        let running: Vec<usize> = (0..self.agents.len())
            .filter(|&k| self.agents[k].child.is_some())
            .collect();
        for &k in &running {
            kill_job(&format!("{}-h{k}", self.job));
        }
        let outs: Vec<(usize, Output)> = running
            .iter()
            .map(|&k| (k, self.agents[k].wait_output(Duration::from_secs(30))))
            .collect();
        logs(&outs)
    }

    /// Starts the standby agents held back.
    pub fn start_late(&mut self) {
        for (k, c) in std::mem::take(&mut self.late) {
            assert_eq!(self.agents.len(), k, "standbys start in node order");
            self.agents.push(host_job(c, &self.job, k));
        }
    }

    /// Waits until host `k` holds the replicas of `ranks` at step 29 or
    /// later, where the job stands still.
    pub fn wait_held(&mut self, k: usize, ranks: &[u64]) {
        self.wait_held_at(k, ranks, 29);
    }

    /// Waits until host `k` holds the replicas of `ranks` at step `step`
    /// or later.
    pub fn wait_held_at(&mut self, k: usize, ranks: &[u64], step: u64) {
        let socket = self.shm[k].join(&self.job).join("agent.sock");
        let caught_up = poll_agentctl(&socket, "status", Duration::from_secs(120), |v| {
            let held = v["status"]["replicas"]["held"].as_array()?;
            let at = |rank: u64| {
                held.iter()
                    .any(|h| h["rank"] == rank && h["steps"][0].as_u64().is_some_and(|s| s >= step))
            };
            ranks.iter().all(|&r| at(r)).then_some(())
        });
        if caught_up.is_none() {
            panic!(
                "host {k} never held the replicas of ranks {ranks:?} at step {step}:\n{}",
                self.kill_all()
            );
        }
    }

    /// Hosts `hosts` vanish at once.
    pub fn vanish(&mut self, hosts: &[usize]) {
        for &k in hosts {
            kill_job(&format!("{}-h{k}", self.job));
        }
        for &k in hosts {
            let _ = self.agents[k].wait_output(Duration::from_secs(30));
            std::fs::remove_dir_all(&self.shm[k]).unwrap();
        }
    }

    /// Host `k` freezes, as a machine that stalls: its agent and workers
    /// SIGSTOPped.
    pub fn freeze(&self, k: usize) {
        for pid in job_pids(&format!("{}-h{k}", self.job)) {
            kill(pid, libc::SIGSTOP);
        }
    }

    /// Host `k` runs again (SIGCONT).
    pub fn thaw(&self, k: usize) {
        for pid in job_pids(&format!("{}-h{k}", self.job)) {
            kill(pid, libc::SIGCONT);
        }
    }

    /// Where host `k`'s stand-in libdcmi reads recorded fault events.
    pub fn dcmi_events(&self, k: usize) -> PathBuf {
        dcmi_events(self._tmp.path(), k)
    }

    /// The agent socket of host `k`.
    pub fn socket(&self, k: usize) -> PathBuf {
        self.shm[k].join(&self.job).join("agent.sock")
    }

    /// How the agents of `hosts` ended.
    pub fn ends(&mut self, hosts: &[usize]) -> Vec<(usize, Output)> {
        hosts
            .iter()
            .map(|&k| (k, self.agents[k].wait_output(Duration::from_secs(300))))
            .collect()
    }
}

fn dcmi_events(tmp: &std::path::Path, k: usize) -> PathBuf {
    tmp.join(format!("dcmi-events-{k}"))
}

/// Every host's log, for a failure's message.
pub fn logs(outs: &[(usize, Output)]) -> String {
    outs.iter()
        .map(|(k, o)| format!("--- host {k}\n{}", String::from_utf8_lossy(&o.stderr)))
        .collect()
}

pub fn stderr(outs: &[(usize, Output)], k: usize) -> String {
    outs.iter()
        .find(|(h, _)| *h == k)
        .map(|(_, o)| String::from_utf8_lossy(&o.stderr).into_owned())
        .unwrap_or_default()
}

/// The standby's log `standby` says it filled each of `ranks` from its
/// replica.
pub fn assert_filled(standby: &str, ranks: &[usize]) {
    for rank in ranks {
        assert!(
            standby.contains(&format!("store filled from the peer replica rank={rank}")),
            "the standby filled rank {rank} from its replica:\n{standby}"
        );
        assert!(
            standby.contains(&format!(
                "replica store removed: this host holds the rank itself rank={rank} "
            )),
            "the standby gave up the replica it filled rank {rank} from:\n{standby}"
        );
    }
}

/// Every survivor succeeded, the run equals the reference, and nothing is
/// left in their roots.
pub fn assert_recovered(c: &Cluster, outs: &[(usize, Output)], reference: &[serde_json::Value]) {
    if let Some((k, out)) = outs.iter().find(|(_, o)| !o.status.success()) {
        panic!("host {k} failed: {}\n{}", out.status, logs(outs));
    }
    let run = read_log(&c.log);
    assert_eq!(
        final_losses(&run),
        final_losses(reference),
        "every step's loss"
    );
    assert_eq!(final_checksum(&run), final_checksum(reference));
    for (k, _) in outs {
        assert_nothing_left(&c.shm[*k]);
    }
}

/// How a run resumed from the last words is checked: the trainer's
/// arguments, the run without faults, and where the resumed run logs.
pub struct Resume {
    pub train: Vec<String>,
    pub reference: Vec<serde_json::Value>,
    pub save: PathBuf,
    pub log: PathBuf,
}

impl Resume {
    /// Resumed with `--load` from iteration `it` on one host of six ranks,
    /// the run ends with every loss and the checksum of the run without
    /// faults.
    pub fn resumes_from(&self, it: u64, name: &str) {
        let mut args = self.train.clone();
        args.extend(s(&["--load", self.save.to_str().unwrap(), "--log-jsonl"]));
        args.push(self.log.display().to_string());
        assert_success(&run_launch(6, name, &args), "the resumed run");
        let run = read_log(&self.log);
        assert_eq!(run[0]["resumed_from"], it);
        assert_eq!(final_checksum(&run), final_checksum(&self.reference));
        let want = final_losses(&self.reference);
        for (step, loss) in final_losses(&run) {
            assert_eq!(loss.to_bits(), want[&step].to_bits(), "loss of step {step}");
        }
    }
}
