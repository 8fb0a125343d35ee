//! The supervisor: spawns one host's workers, forwards their output (see
//! [`crate::output`]), follows their exits through the [`Reaper`], stops
//! them, and starts the whole group again when asked (torchrun's restart).
//!
//! What to do on an exit is decided elsewhere (`recovery::on_exit`, a pure
//! function); the supervisor only carries decisions out. Stopping is
//! always SIGTERM, a grace period, then SIGKILL, and waits until every worker
//! has been reaped, so no worker outlives the supervisor. Workers also get
//! `PR_SET_PDEATHSIG = SIGKILL`, so they die with an agent that is killed
//! before it can stop them.
//!
//! Who forks a worker is the [`Spawner`]'s choice: the agent itself
//! (`launch`), or, for a job another launcher started (`serve`), the rank's
//! `hatrain-agent exec` shim, which stays the launcher's child while its
//! worker is restarted beneath it. Either way the exits arrive here as
//! [`ExitEvent`]s and the signals go to the worker's process group. With
//! `--preload`, the agent's Python workers are forked from a server that
//! has done their imports, and are still the agent's children
//! (`forkserver`).

mod forkserver;
mod os;
mod warm;

#[cfg(test)]
pub(crate) use os::fake::RecordingOs;
pub use os::{Os, RealOs};

pub use forkserver::{PythonCommand, check_module};

use crate::output::Sink;
use crate::reaper::{ExitEvent, ExitStatus, Reaper};
pub use crate::spec::WorkerSpec;
use crate::spec::{ENV_ERROR_FILE, ENV_GROUP_RESTARTS, OutputPlan, attempt_dir, error_file};
use nix::errno::Errno;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::collections::HashMap;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("cannot start worker rank {rank} ({program})")]
    Spawn {
        rank: usize,
        program: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot forward the output of worker rank {rank}")]
    Output {
        rank: usize,
        #[source]
        source: io::Error,
    },
    /// A restart of a rank this host was never given (no spec of it).
    #[error("rank {rank} cannot be restarted here: this host does not run it")]
    NotHere { rank: usize },
}

/// How long the fork server may take over its imports before the workers
/// start without it.
const FORK_SERVER_START: Duration = Duration::from_secs(120);

/// Who forks the workers.
#[derive(Debug, Clone)]
pub enum Spawner {
    /// The agent, through its reaper (`launch`).
    Own(Reaper),
    /// Each rank's `exec` shim (`serve`).
    Shims(Arc<crate::shim::Shims>),
    /// Whatever else starts processes and reports their exits (the
    /// supervisor's unit tests: a recording fake of the OS).
    Os(Arc<dyn Os>),
}

/// A worker's process state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerState {
    Running { pid: i32 },
    Exited(ExitStatus),
}

/// One host's workers.
#[derive(Debug)]
pub struct Supervisor {
    specs: Vec<WorkerSpec>,
    states: Vec<WorkerState>,
    ranks: Vec<usize>,
    by_pid: HashMap<i32, usize>,
    exits: mpsc::UnboundedReceiver<ExitEvent>,
    exits_tx: mpsc::UnboundedSender<ExitEvent>,
    spawner: Spawner,
    output: TaskTracker,
    /// Where the ranks' error texts are reported, once the job says.
    texts: std::sync::Arc<std::sync::OnceLock<mpsc::Sender<crate::faults::DeviceFault>>>,
    grace: Duration,
    plan: OutputPlan,
    run_dir: PathBuf,
    /// Group restarts so far (torchrun's restart count).
    attempt: u32,
    /// Warm standby processes (`--warm-standby`).
    warm: warm::Pool,
    /// The fork server of Python workers (`--preload`).
    forks: Option<forkserver::ForkServer>,
    /// Where signals go.
    os: Arc<dyn Os>,
}

impl Supervisor {
    /// Spawns every worker, each through the reaper (which delivers its exit
    /// here). If one cannot be spawned, those already started are stopped
    /// again. With `preload` modules, the workers are forked from a Python
    /// that has imported them, once it is ready.
    pub async fn start(
        specs: &[WorkerSpec],
        spawner: Spawner,
        grace: Duration,
        (plan, run_dir): (OutputPlan, PathBuf),
        preload: &[String],
    ) -> Result<Self, SupervisorError> {
        let mut sup = Self::new(specs, spawner, grace, plan, run_dir);
        sup.start_fork_server(preload).await;
        for spec in specs {
            match sup.spawn(spec) {
                Ok(pid) => sup.running_as(spec.rank, pid),
                Err(e) => {
                    sup.stop_all().await;
                    return Err(e);
                }
            }
        }
        Ok(sup)
    }

    /// Takes up workers that run already, started for the agent before
    /// this one (a serving agent's restart): each rank with the pid its
    /// shim gave (whose exit, if it ended meanwhile, comes next), none
    /// started.
    pub fn resume(
        specs: &[WorkerSpec],
        spawner: Spawner,
        pids: &std::collections::BTreeMap<usize, i32>,
        grace: Duration,
        run_dir: PathBuf,
    ) -> Self {
        let mut sup = Self::new(specs, spawner, grace, OutputPlan::default(), run_dir);
        for spec in specs {
            match pids.get(&spec.rank) {
                Some(&pid) => sup.running_as(spec.rank, pid),
                None => {
                    tracing::warn!(rank = spec.rank, "its shim knows no worker of the rank");
                    sup.ranks.push(spec.rank);
                    sup.states.push(WorkerState::Exited(ExitStatus::Exited(1)));
                }
            }
        }
        sup
    }

    fn new(
        specs: &[WorkerSpec],
        spawner: Spawner,
        grace: Duration,
        plan: OutputPlan,
        run_dir: PathBuf,
    ) -> Self {
        let (exits_tx, exits) = mpsc::unbounded_channel();
        let os: Arc<dyn Os> = match &spawner {
            Spawner::Shims(shims) => {
                shims.watch(exits_tx.clone());
                Arc::new(RealOs)
            }
            Spawner::Os(os) => {
                os.watch(exits_tx.clone());
                Arc::clone(os)
            }
            Spawner::Own(_) => Arc::new(RealOs),
        };
        Self {
            specs: specs.to_vec(),
            states: Vec::with_capacity(specs.len()),
            ranks: Vec::with_capacity(specs.len()),
            by_pid: HashMap::new(),
            exits,
            exits_tx,
            spawner,
            output: TaskTracker::new(),
            texts: Default::default(),
            grace,
            plan,
            run_dir,
            attempt: 0,
            warm: warm::Pool::default(),
            forks: None,
            os,
        }
    }

    /// Starts the fork server of `preload` and waits until it is ready
    /// (imports take seconds; a worker started meanwhile would do them
    /// again). Without modules, or for workers another launcher starts,
    /// nothing.
    async fn start_fork_server(&mut self, preload: &[String]) {
        if preload.is_empty() || self.specs.is_empty() {
            return;
        }
        if !matches!(self.spawner, Spawner::Own(_)) {
            tracing::warn!(
                "--preload is for `launch`: a served job's processes are its launcher's to start"
            );
            return;
        }
        self.forks = Some(forkserver::ForkServer::new(preload.to_vec()));
        self.restart_fork_server();
        if let Some(f) = &mut self.forks {
            f.wait_ready(FORK_SERVER_START).await;
        }
    }

    /// Starts the fork server if it is down and may be started again.
    fn restart_fork_server(&mut self) {
        let (Some(f), Spawner::Own(reaper), Some(template)) =
            (&mut self.forks, &self.spawner, self.specs.first())
        else {
            return;
        };
        // The server imports with the environment the ranks share: none
        // of a rank's own variables.
        let env: Vec<(String, String)> = template
            .env
            .iter()
            .filter(|kv| self.specs.iter().all(|s| s.env.contains(kv)))
            .filter(|(k, _)| !warm::RANK_VARS.contains(&k.as_str()))
            .cloned()
            .collect();
        f.start(reaper, &self.exits_tx, template, &env);
    }

    fn running_as(&mut self, rank: usize, pid: i32) {
        self.states.push(WorkerState::Running { pid });
        self.ranks.push(rank);
        self.by_pid.insert(pid, self.states.len() - 1);
    }

    /// Takes the ranks of `specs` (a lost host's) without starting them: as
    /// if their processes had died here, so that [`Supervisor::respawn`]
    /// starts each when it is told to. Ranks this host has already are
    /// left as they are.
    pub fn adopt(&mut self, specs: Vec<WorkerSpec>) {
        for spec in specs {
            if self.index(spec.rank).is_some() {
                continue;
            }
            self.ranks.push(spec.rank);
            self.states
                .push(WorkerState::Exited(ExitStatus::Signaled(libc::SIGKILL)));
            self.specs.push(spec);
        }
    }

    /// Starts `rank` again, with `HATRAIN_RESTART_COUNT=restarts`. The old
    /// process must have been reaped.
    /// With `place`, the process takes that place `(rank, world)` in a
    /// data-parallel group elastic training resized.
    pub fn respawn(
        &mut self,
        rank: usize,
        restarts: u32,
        place: Option<(u64, u64)>,
    ) -> Result<i32, SupervisorError> {
        let idx = self.index(rank).ok_or(SupervisorError::NotHere { rank })?;
        debug_assert!(matches!(self.states[idx], WorkerState::Exited(_)));
        let mut spec = self.specs[idx].clone();
        for (k, v) in spec.env.iter_mut() {
            if k == "HATRAIN_RESTART_COUNT" {
                *v = restarts.to_string();
            }
        }
        let key = hatrain_shared::rendezvous::ENV_GROUP_PLACE;
        spec.env.retain(|(k, _)| k != key);
        if let Some((r, w)) = place {
            spec.env.push((key.to_string(), format!("{r}/{w}")));
        }
        let pid = self.spawn(&spec)?;
        self.states[idx] = WorkerState::Running { pid };
        self.by_pid.insert(pid, idx);
        Ok(pid)
    }

    /// Stops every worker (SIGTERM, the grace period, SIGKILL) and starts
    /// them all again as restart `attempt` of the group, with
    /// `TORCHELASTIC_RESTART_COUNT` and the error files of that attempt. A
    /// worker that cannot be started leaves the others stopped.
    pub async fn restart_all(
        &mut self,
        attempt: u32,
    ) -> Result<Vec<(usize, i32)>, SupervisorError> {
        self.stop_running().await;
        self.attempt = attempt;
        let mut started = Vec::new();
        for idx in 0..self.specs.len() {
            let spec = &mut self.specs[idx];
            for (k, v) in spec.env.iter_mut() {
                match k.as_str() {
                    ENV_GROUP_RESTARTS => *v = attempt.to_string(),
                    ENV_ERROR_FILE => {
                        *v = error_file(&self.run_dir, attempt, spec.local_rank)
                            .display()
                            .to_string()
                    }
                    "HATRAIN_RESTART_COUNT" => *v = "0".into(),
                    _ => {}
                }
            }
            let spec = self.specs[idx].clone();
            let pid = self.spawn(&spec)?;
            self.states[idx] = WorkerState::Running { pid };
            self.by_pid.insert(pid, idx);
            started.push((spec.rank, pid));
        }
        self.warm.stopping = false;
        self.restart_fork_server();
        self.refill();
        Ok(started)
    }

    /// The agent's reaper, when the agent starts the workers itself: any
    /// other child of the agent must be started through it too.
    pub fn reaper(&self) -> Option<Reaper> {
        match &self.spawner {
            Spawner::Own(r) => Some(r.clone()),
            Spawner::Shims(_) | Spawner::Os(_) => None,
        }
    }

    /// Reports the torch_npu error texts in the ranks' stderr to `tx`.
    pub fn report_texts_to(&self, tx: mpsc::Sender<crate::faults::DeviceFault>) {
        let _ = self.texts.set(tx);
    }

    /// The group restarts so far.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Where the workers' error files and logs go.
    pub fn run_dir(&self) -> &std::path::Path {
        &self.run_dir
    }

    fn index(&self, rank: usize) -> Option<usize> {
        self.ranks.iter().position(|&r| r == rank)
    }

    /// The ranks of this host, in local-rank order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// The pid of `rank` if it runs.
    pub fn pid(&self, rank: usize) -> Option<i32> {
        match self.states[self.index(rank)?] {
            WorkerState::Running { pid } => Some(pid),
            WorkerState::Exited(_) => None,
        }
    }

    /// Waits for the next exit of one of our workers: its rank and event.
    /// `None` if the reaper is gone.
    pub async fn next_exit(&mut self) -> Option<(usize, ExitEvent)> {
        loop {
            let ev = self.exits.recv().await?;
            if let Some(idx) = self.record(ev) {
                return Some((self.ranks[idx], ev));
            }
        }
    }

    fn spawn(&mut self, spec: &WorkerSpec) -> Result<i32, SupervisorError> {
        self.spawn_as(spec, None)
    }

    /// Starts `spec`'s process, or warm standby number `standby` from it.
    fn spawn_as(
        &mut self,
        spec: &WorkerSpec,
        standby: Option<usize>,
    ) -> Result<i32, SupervisorError> {
        // The attempt's folder holds the worker's error file (torch's error
        // handler writes it and does not make its folder) and logs.
        std::fs::create_dir_all(attempt_dir(&self.run_dir, self.attempt, spec.local_rank))
            .map_err(|source| SupervisorError::Output {
                rank: spec.rank,
                source,
            })?;
        let reaper = match &self.spawner {
            Spawner::Own(reaper) => reaper.clone(),
            Spawner::Os(os) => {
                return os.start(spec).map_err(|source| SupervisorError::Spawn {
                    rank: spec.rank,
                    program: spec.program.clone(),
                    source,
                });
            }
            Spawner::Shims(shims) => {
                let pid = shims.start(spec).map_err(|source| SupervisorError::Spawn {
                    rank: spec.rank,
                    program: spec.program.clone(),
                    source,
                })?;
                tracing::info!(
                    rank = spec.rank,
                    local_rank = spec.local_rank,
                    pid,
                    "worker started by its exec shim"
                );
                return Ok(pid);
            }
        };
        let forked = match &mut self.forks {
            Some(f) => f.fork(&reaper, &self.exits_tx, spec),
            None => None,
        };
        let from_server = forked.is_some();
        let (pid, stdout, stderr) = match forked {
            Some((pid, out, err)) => (pid, Some(out), Some(err)),
            None => self.spawn_process(&reaper, spec)?,
        };
        match standby {
            Some(n) => tracing::info!(standby = n, pid, from_server, "warm standby started"),
            None => tracing::info!(
                rank = spec.rank,
                local_rank = spec.local_rank,
                pid,
                from_server,
                "worker started"
            ),
        }
        let out_err = |source| SupervisorError::Output {
            rank: spec.rank,
            source,
        };
        let mut retarget = Vec::new();
        for (fd, to_stderr) in [(stdout, false), (stderr, true)] {
            if let Some(fd) = fd {
                let sink = self.sink(spec, standby, to_stderr).map_err(out_err)?;
                let rx = tokio::net::unix::pipe::Receiver::from_owned_fd(fd).map_err(out_err)?;
                // A standby's output goes to its rank's sink once it has one.
                let to = standby.map(|_| {
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    retarget.push((to_stderr, tx));
                    rx
                });
                self.output.spawn(crate::output::forward(rx, sink, to));
            }
        }
        if standby.is_some() {
            self.warm.retarget.insert(pid, retarget);
        }
        Ok(pid)
    }

    /// Forks and execs `spec`'s command: its pid and the read ends of its
    /// stdout and stderr.
    fn spawn_process(
        &self,
        reaper: &Reaper,
        spec: &WorkerSpec,
    ) -> Result<(i32, Option<OwnedFd>, Option<OwnedFd>), SupervisorError> {
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: the closure runs in the child between fork and exec and
        // only calls setpgid(2), prctl(2), open(2), write(2), close(2),
        // getrlimit(2) and setrlimit(2), which are async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                // Its own process group, so that stopping the worker also
                // stops whatever it started.
                nix::unistd::setpgid(Pid::from_raw(0), Pid::from_raw(0))?;
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
                crate::oom::prefer_as_oom_victim();
                crate::limits::restore_nofile_in_child();
                Ok(())
            });
        }
        let mut child =
            reaper
                .spawn(&mut cmd, &self.exits_tx)
                .map_err(|source| SupervisorError::Spawn {
                    rank: spec.rank,
                    program: spec.program.clone(),
                    source,
                })?;
        let pid = i32::try_from(child.id()).expect("pids fit in i32");
        // The `Child` is dropped without waiting: the reaper collects it.
        let stdout = child.stdout.take().map(OwnedFd::from);
        let stderr = child.stderr.take().map(OwnedFd::from);
        Ok((pid, stdout, stderr))
    }

    /// Where one stream of a worker goes: the console unless redirected
    /// (or teed) and unless filtered out; a log file of the attempt when
    /// redirected or teed.
    fn sink(&self, spec: &WorkerSpec, standby: Option<usize>, stderr: bool) -> io::Result<Sink> {
        let lr = spec.local_rank;
        let (redirect, tee) = (
            self.plan.redirects.of(lr).has(stderr),
            self.plan.tee.of(lr).has(stderr),
        );
        let shown = self.plan.filter.as_ref().is_none_or(|f| f.contains(&lr));
        let (file, path) = if redirect || tee {
            let dir = attempt_dir(&self.run_dir, self.attempt, lr);
            std::fs::create_dir_all(&dir)?;
            let path = dir.join(if stderr { "stderr.log" } else { "stdout.log" });
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)?;
            (Some(f), Some(path))
        } else {
            (None, None)
        };
        let scan = (stderr && standby.is_none()).then(|| {
            crate::output::TextScan::new(spec.rank, lr, std::sync::Arc::clone(&self.texts))
        });
        Ok(Sink {
            scan,
            label: match standby {
                Some(n) => format!("standby {n}"),
                None => format!("rank {}", spec.rank),
            },
            stderr,
            console: (!redirect || tee) && shown,
            file,
            path,
        })
    }

    /// SIGKILL, now, to every worker and warm standby and whatever each
    /// started (their process groups): the host leaves the job as a lost
    /// host does.
    pub fn kill_everything(&self) {
        for (_, pid) in self.running() {
            self.os.signal(-pid, Signal::SIGKILL);
        }
        self.signal_standbys(Signal::SIGKILL);
        if let Some(pid) = self.forks.as_ref().and_then(|f| f.pid()) {
            self.os.signal(-pid, Signal::SIGKILL);
        }
    }

    /// SIGKILL to `rank`'s worker, if it runs (the machine ends a hung or
    /// faulty rank this way; its exit comes as any other).
    pub fn kill(&self, rank: usize) {
        if let Some(pid) = self.pid(rank) {
            self.os.signal(pid, Signal::SIGKILL);
        }
    }

    /// Pids of the workers still running, by rank.
    pub fn running(&self) -> Vec<(usize, i32)> {
        self.states
            .iter()
            .zip(&self.ranks)
            .filter_map(|(s, &r)| match s {
                WorkerState::Running { pid } => Some((r, *pid)),
                WorkerState::Exited(_) => None,
            })
            .collect()
    }

    /// Records an exit; returns the worker's index if it was ours.
    fn record(&mut self, ev: ExitEvent) -> Option<usize> {
        if self.standby_exited(&ev) {
            return None;
        }
        if self.forks.as_mut().is_some_and(|f| f.exited(&ev)) {
            if !self.warm.stopping {
                self.restart_fork_server();
            }
            return None;
        }
        let idx = self.by_pid.remove(&ev.pid)?;
        self.states[idx] = WorkerState::Exited(ev.status);
        // What the worker started dies with it. A shim's worker is the
        // shim's to reap, and the shim does this the moment it does: here
        // the pid may be another process's already.
        if let Spawner::Own(_) = self.spawner {
            self.os.signal(-ev.pid, Signal::SIGKILL);
        }
        Some(idx)
    }

    /// SIGTERM to every running worker, SIGKILL to those still running after
    /// the grace period, then waits until all are reaped and their output is
    /// drained.
    pub async fn stop_all(&mut self) {
        if let Some(f) = &mut self.forks {
            f.stop();
        }
        self.stop_running().await;
        self.output.close();
        // Output pipes close when the workers die; a grandchild holding a
        // pipe open must not keep the agent from exiting.
        let _ = tokio::time::timeout(Duration::from_secs(2), self.output.wait()).await;
        let _ = io::stdout().flush();
    }

    /// SIGTERM to every running worker, SIGKILL to those still running after
    /// the grace period, then waits until all are reaped.
    async fn stop_running(&mut self) {
        self.warm.stopping = true;
        self.signal_standbys(Signal::SIGTERM);
        let running = self.running();
        for &(rank, pid) in &running {
            tracing::info!(rank, pid, "sending SIGTERM");
            self.os.signal(-pid, Signal::SIGTERM);
        }
        let sent_kill = !self.wait_all(self.grace).await;
        if sent_kill {
            for (rank, pid) in self.running() {
                tracing::warn!(rank, pid, grace = ?self.grace, "still running after the grace period: SIGKILL");
                self.os.signal(-pid, Signal::SIGKILL);
            }
            self.signal_standbys(Signal::SIGKILL);
            if !self.wait_all(Duration::from_secs(10)).await {
                tracing::error!(left = ?self.running(), "workers not reaped after SIGKILL");
            }
        }
    }

    /// Waits until no worker runs; false if `limit` passed first.
    async fn wait_all(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if self.running().is_empty() && self.warm.is_empty() {
                return true;
            }
            // A signal we sent may have been delivered before our SIGCHLD
            // wait began; poll once so the exit is not waited for in vain.
            if let Spawner::Own(reaper) = &self.spawner {
                reaper.poll();
            }
            match tokio::time::timeout_at(deadline, self.exits.recv()).await {
                Err(_) => return self.running().is_empty() && self.warm.is_empty(),
                Ok(Some(ev)) => {
                    if let Some(idx) = self.record(ev) {
                        tracing::info!(rank = self.ranks[idx], pid = ev.pid, status = %ev.status, "worker stopped");
                    }
                }
                Ok(None) => return false,
            }
        }
    }
}

/// Sends `sig` to a process (or, with a negative pid, to a process group);
/// one that is already gone (ESRCH) counts as success.
pub fn signal(pid: i32, sig: Signal) {
    match kill(Pid::from_raw(pid), sig) {
        Ok(()) | Err(Errno::ESRCH) => {}
        Err(e) => tracing::error!(pid, ?sig, error = %e, "kill failed"),
    }
}

#[cfg(test)]
mod tests;
