//! `hatrain-agent exec [FLAGS] -- CMD`: one rank of a job that another
//! launcher (`mpirun`, `srun`, `torchrun`) starts, put under this host's
//! agent (`hatrain-agent serve`).
//!
//! The shim is what the launcher sees: it registers the rank (job id, rank
//! and world size from the launcher's environment, the high-availability
//! flags given here), then forks the worker whenever the agent says so and
//! reports each of its exits. While the agent restarts a crashed worker the
//! shim stays, so the launcher never sees a rank die that hatrain repairs;
//! at the end it exits with its worker's status, as the worker would have.
//!
//! The worker is the shim's child: it inherits the shim's output (the
//! launcher's), working folder and environment, with the agent's variables
//! over it; it dies with the shim (a parent-death signal), and a SIGTERM,
//! SIGINT, SIGHUP or SIGQUIT from the launcher is passed to its process
//! group, after which the shim exits with its status (SIGUSR1 and SIGUSR2
//! are only passed on). If the agent goes away, the worker trains on and
//! the shim waits for the next agent, which takes the rank back.
//!
//! Threads: the main one forks (a parent-death signal follows the thread
//! that forked) and decides; one waits for the worker, one reads the
//! agent's commands, one takes the launcher's signals.

use crate::cli::HaArgs;
use crate::reaper::ExitStatus;
use crate::shim::wire::{PROTOCOL, Registration, Reply, Resume, Started, ToAgent, ToShim};
use hatrain_shared::ident::JobId;
use nix::sys::signal::{SigSet, SigmaskHow, Signal, kill, sigprocmask};
use nix::unistd::Pid;
use std::ffi::OsString;
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// What `exec` was given.
#[derive(Debug, Clone)]
pub struct ExecOptions {
    pub socket: PathBuf,
    pub job: Option<JobId>,
    pub ha: HaArgs,
    pub command: Vec<OsString>,
    /// How long a shim whose worker has ended waits for an agent that went
    /// away to come back.
    pub agent_wait: Duration,
}

/// A rank's place, from its launcher's environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub launcher: &'static str,
}

/// The launchers whose variables are read, in order: (name, rank, world
/// size, local rank, local world size). Slurm's tasks on this node are
/// read apart ([`slurm_local_tasks`]).
const LAUNCHERS: [(&str, [&str; 4]); 3] = [
    (
        "torchrun",
        ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
    ),
    (
        "mpirun",
        [
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ],
    ),
    (
        "srun",
        [
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "SLURM_LOCALID",
            SLURM_LOCAL_TASKS,
        ],
    ),
];

/// Stands for the tasks of the step on this node, which Slurm says in one
/// of several ways.
const SLURM_LOCAL_TASKS: &str = "SLURM_STEP_TASKS_PER_NODE";

/// The tasks of this Slurm step on this node: this node's entry of
/// `SLURM_STEP_TASKS_PER_NODE` (`2(x3),1`: two on each of the first three
/// nodes, one on the fourth), else of the allocation's
/// `SLURM_NTASKS_PER_NODE` or `SLURM_TASKS_PER_NODE`.
pub fn slurm_local_tasks(get: &impl Fn(&str) -> Option<String>) -> Option<String> {
    // The step's own count first: a step may use fewer tasks than its
    // allocation's `--ntasks-per-node`.
    let spec = get(SLURM_LOCAL_TASKS)
        .or_else(|| get("SLURM_NTASKS_PER_NODE"))
        .or_else(|| get("SLURM_TASKS_PER_NODE"))?;
    let node: usize = get("SLURM_NODEID")
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    let mut seen = 0usize;
    for part in spec.split(',') {
        let (n, times) = match part.split_once("(x") {
            Some((n, t)) => (n, t.trim_end_matches(')').parse::<usize>().ok()?),
            None => (part, 1),
        };
        seen += times;
        if node < seen {
            return Some(n.trim().to_string());
        }
    }
    None
}

/// Why the shim cannot run its rank.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("{set} is set but {var} is not")]
    Missing {
        set: &'static str,
        var: &'static str,
    },
    #[error("{var}={value:?} is not a number")]
    NotNumber { var: &'static str, value: String },
    #[error(
        "{rank_var}={rank} of {world_var}={world} (local {local} of {local_world}) is not a rank of the job"
    )]
    NotARank {
        rank_var: &'static str,
        world_var: &'static str,
        rank: usize,
        world: usize,
        local: usize,
        local_world: usize,
    },
    #[error(
        "no launcher's rank is in the environment (looked for {0}): start `exec` with mpirun, srun or torchrun"
    )]
    NoLauncher(String),
    #[error(
        "cannot tell which job this rank belongs to: give --job-id (or HATRAIN_JOB_ID), the same for every rank"
    )]
    NoJob,
    #[error("the launcher's run id gives no job id ({made:?}: {reason}); give --job-id")]
    RunId {
        made: String,
        reason: hatrain_shared::ident::JobIdError,
    },
    #[error(
        "no hatrain agent answers on {socket} ({reason}): start one with `hatrain-agent serve` (or `systemctl start hatrain-agent`), or name its socket with --agent-socket"
    )]
    NoAgent {
        socket: PathBuf,
        reason: std::io::Error,
    },
    #[error("{socket}: cannot read its owner: {reason}")]
    Owner { socket: PathBuf, reason: nix::Error },
    #[error("{socket} is served by uid {uid}, neither root nor this user ({me}): not trusted")]
    Untrusted { socket: PathBuf, uid: u32, me: u32 },
    #[error("the host agent: {0}")]
    Agent(hatrain_shared::frame::FrameError),
    #[error("{socket}: {reason}")]
    Socket {
        socket: PathBuf,
        reason: std::io::Error,
    },
    #[error("the command's argument {0:?} is not UTF-8")]
    NotUtf8(std::ffi::OsString),
    #[error("no worker command given (put it after `--`)")]
    NoCommand,
    #[error("the host agent refused rank {rank}: {why}")]
    Refused { rank: usize, why: String },
    #[error("cannot block signals: {0}")]
    Signals(nix::Error),
    #[error("cannot read the agent's commands: {0}")]
    Commands(std::io::Error),
}

/// The rank's place: the first launcher whose rank variable is set gives
/// all four numbers.
pub fn identity(get: impl Fn(&str) -> Option<String>) -> Result<Identity, ExecError> {
    let get = |k: &str| match k {
        SLURM_LOCAL_TASKS => slurm_local_tasks(&get),
        _ => get(k),
    };
    for (launcher, vars) in LAUNCHERS {
        if get(vars[0]).is_none() {
            continue;
        }
        let mut n = [0usize; 4];
        for (slot, var) in n.iter_mut().zip(vars) {
            let v = get(var).ok_or(ExecError::Missing { set: vars[0], var })?;
            *slot = v.trim().parse().map_err(|_| ExecError::NotNumber {
                var,
                value: v.clone(),
            })?;
        }
        let [rank, world_size, local_rank, local_world_size] = n;
        if rank >= world_size || local_rank >= local_world_size || world_size == 0 {
            return Err(ExecError::NotARank {
                rank_var: vars[0],
                world_var: vars[1],
                rank,
                world: world_size,
                local: local_rank,
                local_world: local_world_size,
            });
        }
        return Ok(Identity {
            rank,
            world_size,
            local_rank,
            local_world_size,
            launcher,
        });
    }
    Err(ExecError::NoLauncher(
        LAUNCHERS.map(|(_, v)| v[0]).join(", "),
    ))
}

/// The job id: the flag (or `HATRAIN_JOB_ID`), else the launcher's own id
/// of the run: torchrun's run id, Open MPI's job id, Slurm's job and step.
pub fn job_id(
    flag: Option<JobId>,
    get: impl Fn(&str) -> Option<String>,
) -> Result<JobId, ExecError> {
    if let Some(j) = flag {
        return Ok(j);
    }
    let made = if let Some(id) = get("TORCHELASTIC_RUN_ID").filter(|v| v != "none") {
        format!("torchrun-{id}")
    } else if let Some(id) = get("OMPI_MCA_ess_base_jobid") {
        format!("mpirun-{id}")
    } else if let Some(id) = get("SLURM_JOB_ID") {
        let step = get("SLURM_STEP_ID").unwrap_or_else(|| "0".into());
        format!("slurm-{id}.{step}")
    } else {
        return Err(ExecError::NoJob);
    };
    JobId::new(&made).map_err(|reason| ExecError::RunId {
        made: made.clone(),
        reason,
    })
}

/// What the main thread hears. Events of a commands connection carry its
/// generation: one that came from a connection replaced since is stale.
enum Ev {
    Command(u64, ToShim),
    AgentGone(u64, String),
    Exited(u32, ExitStatus),
    Signal(Signal),
}

/// The launcher's signals that stop the rank: passed to the worker, and
/// the shim ends with it.
const STOPPING: [Signal; 4] = [
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGQUIT,
];

/// The launcher's signals that are only passed on (Slurm's
/// `--signal=USR1@90`, `scancel -s USR1`: checkpoint and requeue).
const PASSED: [Signal; 2] = [Signal::SIGUSR1, Signal::SIGUSR2];

/// How long the handshake with an agent may take.
const HANDSHAKE: Duration = Duration::from_secs(5);

/// How often a shim whose agent is gone tries for the next one (a connect
/// to a socket that is not there costs microseconds).
const RETRY: Duration = Duration::from_millis(25);

fn say(msg: std::fmt::Arguments) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "hatrain-agent exec: {msg}");
}

/// Connects to the host agent and checks that root or this user runs it.
fn connect(socket: &std::path::Path) -> Result<UnixStream, ExecError> {
    let s = UnixStream::connect(socket).map_err(|reason| ExecError::NoAgent {
        socket: socket.to_path_buf(),
        reason,
    })?;
    let cred = nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(|reason| ExecError::Owner {
            socket: socket.to_path_buf(),
            reason,
        })?;
    let me = hatrain_shared::trust::me();
    if cred.uid() != 0 && cred.uid() != me {
        return Err(ExecError::Untrusted {
            socket: socket.to_path_buf(),
            uid: cred.uid(),
            me,
        });
    }
    Ok(s)
}

fn exchange(s: &mut UnixStream, msg: &ToAgent) -> Result<Reply, ExecError> {
    PROTOCOL
        .send_json(s, msg)
        .and_then(|()| PROTOCOL.recv_json(s))
        .map_err(ExecError::Agent)
}

/// Why a registration did not go through.
#[derive(Debug)]
enum Refusal {
    /// The agent refused it, saying why.
    Refused(String),
    /// The agent could not be reached, or answered nothing it should.
    Unreachable(ExecError),
}

/// Registers the rank and attaches its commands connection: the events
/// and commands connections.
fn register(
    socket: &std::path::Path,
    reg: &Registration,
) -> Result<(UnixStream, UnixStream), Refusal> {
    let unreachable = Refusal::Unreachable;
    let socket_err = |reason| {
        Refusal::Unreachable(ExecError::Socket {
            socket: socket.to_path_buf(),
            reason,
        })
    };
    // An agent that accepts and then stalls must not hold the shim (it
    // passes the launcher's signals and its worker's exits).
    let timed = |s: &UnixStream, t: Option<Duration>| {
        s.set_read_timeout(t)
            .and_then(|()| s.set_write_timeout(t))
            .map_err(socket_err)
    };
    let mut events = connect(socket).map_err(unreachable)?;
    timed(&events, Some(HANDSHAKE))?;
    match exchange(&mut events, &ToAgent::Register(Box::new(reg.clone()))).map_err(unreachable)? {
        Reply::Registered { .. } => {}
        Reply::Refused { message } => return Err(Refusal::Refused(message)),
        other => {
            return Err(Refusal::Refused(format!(
                "it answered {other:?} to a registration"
            )));
        }
    }
    let mut commands = connect(socket).map_err(unreachable)?;
    timed(&commands, Some(HANDSHAKE))?;
    let attach = ToAgent::Commands {
        job: reg.job.clone(),
        rank: reg.rank,
    };
    match exchange(&mut commands, &attach).map_err(unreachable)? {
        Reply::Attached => {
            // The commands come when they come; an exit report is small.
            timed(&commands, None)?;
            timed(&events, None)?;
            events
                .set_write_timeout(Some(HANDSHAKE))
                .map_err(socket_err)?;
            Ok((events, commands))
        }
        Reply::Refused { message } => Err(Refusal::Refused(message)),
        other => Err(Refusal::Refused(format!(
            "it answered {other:?} to an attach"
        ))),
    }
}

/// Reads the agent's commands on one connection, until it closes.
fn read_commands(mut conn: UnixStream, generation: u64, tx: mpsc::Sender<Ev>) {
    std::thread::spawn(move || {
        loop {
            match PROTOCOL.recv_json::<_, ToShim>(&mut conn) {
                Ok(cmd) => {
                    if tx.send(Ev::Command(generation, cmd)).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let _ = tx.send(Ev::AgentGone(generation, e.to_string()));
                    return;
                }
            }
        }
    });
}

/// Runs the shim; its exit code.
pub fn run(opts: ExecOptions) -> Result<u8, ExecError> {
    let get = |k: &str| std::env::var(k).ok();
    let id = identity(get)?;
    let job = job_id(opts.job.clone(), get)?;
    let command = opts
        .command
        .iter()
        .map(|a| {
            a.to_str()
                .map(str::to_string)
                .ok_or_else(|| ExecError::NotUtf8(a.clone()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if command.is_empty() {
        return Err(ExecError::NoCommand);
    }
    let reg = Registration {
        job: job.to_string(),
        rank: id.rank,
        world_size: id.world_size,
        local_rank: id.local_rank,
        local_world_size: id.local_world_size,
        launcher: id.launcher.into(),
        ha: opts.ha,
        command,
        env: std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .collect(),
        resume: None,
    };
    let (events, commands) = register(&opts.socket, &reg).map_err(|r| match r {
        Refusal::Refused(why) => ExecError::Refused { rank: id.rank, why },
        Refusal::Unreachable(e) => e,
    })?;
    // The launcher's signals are taken by one thread; every thread started
    // from here on inherits the blocked mask.
    let mut signals = SigSet::empty();
    for s in STOPPING.iter().chain(&PASSED) {
        signals.add(*s);
    }
    signals.thread_block().map_err(ExecError::Signals)?;
    let (tx, rx) = mpsc::channel::<Ev>();
    {
        let tx = tx.clone();
        std::thread::spawn(move || {
            while let Ok(sig) = signals.wait() {
                if tx.send(Ev::Signal(sig)).is_err() {
                    return;
                }
            }
        });
    }
    let reader = commands.try_clone().map_err(ExecError::Commands)?;
    read_commands(reader, 0, tx.clone());
    Shim {
        socket: opts.socket,
        reg,
        agent_wait: opts.agent_wait,
        generation: 0,
        events: Some(events),
        commands: Some(commands),
        signals,
        tx,
        worker: None,
        last: None,
        unanswered: None,
        stopping: None,
        gone_since: None,
        orphaned: false,
    }
    .run(rx)
}

struct Shim {
    socket: PathBuf,
    reg: Registration,
    /// How long a shim without a worker waits for an agent to come back.
    agent_wait: Duration,
    generation: u64,
    events: Option<UnixStream>,
    commands: Option<UnixStream>,
    signals: SigSet,
    tx: mpsc::Sender<Ev>,
    worker: Option<u32>,
    last: Option<ExitStatus>,
    /// The worker's last exit, until the agent starts it again.
    unanswered: Option<(i32, ExitStatus)>,
    /// A signal from the launcher: the shim ends with its worker.
    stopping: Option<Signal>,
    /// Since when no agent is there.
    gone_since: Option<Instant>,
    /// No agent takes the rank back: it runs on to its end unprotected.
    orphaned: bool,
}

fn code(status: ExitStatus) -> u8 {
    u8::try_from(status.code()).unwrap_or(1)
}

impl Shim {
    fn rank(&self) -> usize {
        self.reg.rank
    }

    fn run(mut self, rx: mpsc::Receiver<Ev>) -> Result<u8, ExecError> {
        loop {
            let ev = match self.gone_since {
                Some(_) => match rx.recv_timeout(RETRY) {
                    Ok(ev) => ev,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        if let Some(code) = self.try_to_return() {
                            return Ok(code);
                        }
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                },
                None => match rx.recv() {
                    Ok(ev) => ev,
                    Err(_) => break,
                },
            };
            match ev {
                Ev::Command(g, _) | Ev::AgentGone(g, _) if g != self.generation => {}
                Ev::Command(_, ToShim::Start { program, args, env }) => {
                    let answer = self.start(program, args, env);
                    if let Some(conn) = &mut self.commands
                        && let Err(e) = PROTOCOL.send_json(conn, &answer)
                    {
                        say(format_args!("cannot answer the host agent: {e}"));
                    }
                }
                Ev::Command(_, ToShim::Finish { error, detach }) => {
                    if let Some(why) = &error {
                        say(format_args!("the host agent could not run the job: {why}"));
                    }
                    if self.worker.is_some() {
                        self.orphaned = true;
                        if detach {
                            say(format_args!(
                                "rank {}'s worker trains on without the agent's protection",
                                self.rank()
                            ));
                        } else {
                            // The agent finishes a job once its workers
                            // have ended: end this one, then go.
                            self.signal_worker(Signal::SIGTERM);
                        }
                        continue;
                    }
                    return Ok(match (error, self.last) {
                        (Some(_), _) | (None, None) => 1,
                        (None, Some(s)) => code(s),
                    });
                }
                Ev::AgentGone(_, why) => {
                    self.events = None;
                    self.commands = None;
                    if let Some(code) = self.agent_gone(&why) {
                        return Ok(code);
                    }
                }
                Ev::Exited(pid, status) => {
                    self.worker = None;
                    self.last = Some(status);
                    self.unanswered = Some((pid as i32, status));
                    let report = ToAgent::Exited {
                        pid: pid as i32,
                        status,
                    };
                    if let Some(ev) = &mut self.events
                        && PROTOCOL.send_json(ev, &report).is_err()
                    {
                        // The agent is gone: the exit goes to the next one.
                        self.events = None;
                    }
                    if self.stopping.is_some() || self.orphaned {
                        return Ok(code(status));
                    }
                }
                Ev::Signal(sig) if PASSED.contains(&sig) => self.signal_worker(sig),
                Ev::Signal(sig) => {
                    self.stopping = Some(sig);
                    if self.worker.is_none() {
                        return Ok(crate::exit::signaled(sig as i32));
                    }
                    self.signal_worker(sig);
                }
            }
        }
        Ok(self.last.map_or(1, code))
    }

    /// The agent went away: the worker runs on while the shim waits for
    /// the next agent. `Some(code)` when the shim should end now.
    fn agent_gone(&mut self, why: &str) -> Option<u8> {
        if self.stopping.is_some() || self.orphaned {
            return if self.worker.is_some() {
                None
            } else {
                Some(self.last.map_or(1, code))
            };
        }
        match self.worker {
            Some(pid) => say(format_args!(
                "the host agent is gone ({why}); rank {}'s worker (pid {pid}) trains on, and is taken back by the next agent",
                self.rank()
            )),
            None => say(format_args!(
                "the host agent is gone ({why}); rank {} waits up to {:.0} s for the next agent",
                self.rank(),
                self.agent_wait.as_secs_f64()
            )),
        }
        self.gone_since = Some(Instant::now());
        None
    }

    /// Tries to register with the next agent. `Some(code)` when the shim
    /// gives up: no agent came in time and no worker runs.
    fn try_to_return(&mut self) -> Option<u8> {
        let since = self.gone_since?;
        let mut reg = self.reg.clone();
        reg.resume = Some(Resume {
            running: self.worker.map(|p| p as i32),
            exited: self.unanswered,
        });
        match register(&self.socket, &reg) {
            Ok((events, commands)) => {
                self.generation += 1;
                match commands.try_clone() {
                    Ok(reader) => read_commands(reader, self.generation, self.tx.clone()),
                    Err(e) => {
                        say(format_args!("cannot read the agent's commands: {e}"));
                        return None;
                    }
                }
                self.events = Some(events);
                self.commands = Some(commands);
                self.gone_since = None;
                say(format_args!(
                    "rank {} is back under the host agent after {:.1} s",
                    self.rank(),
                    since.elapsed().as_secs_f64()
                ));
                None
            }
            Err(Refusal::Refused(why)) => {
                say(format_args!(
                    "the host agent does not take rank {} back: {why}",
                    self.rank()
                ));
                self.orphaned = true;
                self.gone_since = None;
                match self.worker {
                    Some(_) => None,
                    None => Some(self.last.map_or(1, code)),
                }
            }
            Err(Refusal::Unreachable(_))
                if self.worker.is_none() && since.elapsed() > self.agent_wait =>
            {
                say(format_args!(
                    "no host agent came back within {:.0} s; rank {} ends with its worker's status",
                    self.agent_wait.as_secs_f64(),
                    self.rank()
                ));
                Some(self.last.map_or(1, code))
            }
            Err(Refusal::Unreachable(_)) => None,
        }
    }

    fn signal_worker(&self, sig: Signal) {
        if let Some(pid) = self.worker
            && let Ok(pid) = i32::try_from(pid)
        {
            let _ = kill(Pid::from_raw(-pid), sig);
        }
    }

    fn start(&mut self, program: String, args: Vec<String>, env: Vec<(String, String)>) -> Started {
        if let Some(pid) = self.worker {
            return Started::Failed {
                message: format!("rank {}'s worker still runs (pid {pid})", self.rank()),
            };
        }
        if let Some(sig) = self.stopping {
            return Started::Failed {
                message: format!("rank {}'s launcher is stopping it ({sig})", self.rank()),
            };
        }
        let mut cmd = std::process::Command::new(&program);
        cmd.args(&args).envs(env);
        let unblock = self.signals;
        // SAFETY: the closure runs in the child between fork and exec and
        // only calls setpgid(2), prctl(2), sigprocmask(2), open(2),
        // write(2) and close(2), which are async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                nix::unistd::setpgid(Pid::from_raw(0), Pid::from_raw(0))?;
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
                sigprocmask(SigmaskHow::SIG_UNBLOCK, Some(&unblock), None)?;
                crate::oom::prefer_as_oom_victim();
                Ok(())
            });
        }
        match cmd.spawn() {
            Ok(mut child) => {
                let pid = child.id();
                self.worker = Some(pid);
                self.unanswered = None;
                let tx = self.tx.clone();
                std::thread::spawn(move || {
                    let waited = child.wait();
                    // What the worker started dies with it: its process
                    // group, now, while its number is still the group's.
                    if let Ok(group) = i32::try_from(pid) {
                        let _ = kill(Pid::from_raw(-group), Signal::SIGKILL);
                    }
                    let status = match waited {
                        Ok(s) => match (s.code(), s.signal()) {
                            (Some(c), _) => ExitStatus::Exited(c),
                            (None, Some(sig)) => ExitStatus::Signaled(sig),
                            (None, None) => ExitStatus::Exited(1),
                        },
                        Err(_) => ExitStatus::Exited(1),
                    };
                    let _ = tx.send(Ev::Exited(pid, status));
                });
                Started::Pid(pid as i32)
            }
            Err(e) => Started::Failed {
                message: format!("cannot start {program}: {e}"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn identity_comes_from_the_launcher() {
        let mpi = env(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("OMPI_MCA_ess_base_jobid", "791740417"),
        ]);
        let id = identity(&mpi).unwrap();
        assert_eq!((id.rank, id.world_size, id.launcher), (3, 4, "mpirun"));
        assert_eq!(job_id(None, &mpi).unwrap().as_str(), "mpirun-791740417");
        let torch = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("TORCHELASTIC_RUN_ID", "none"),
        ]);
        assert_eq!(identity(&torch).unwrap().launcher, "torchrun");
        let e = job_id(None, &torch).unwrap_err();
        assert!(e.to_string().contains("--job-id"), "{e}");
        let given = JobId::new("mine").unwrap();
        assert_eq!(job_id(Some(given.clone()), &torch).unwrap(), given);
        let e = identity(env(&[("RANK", "0"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(e.to_string().contains("LOCAL_RANK is not"), "{e}");
        let e = identity(env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "1"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("not a rank of the job"), "{e}");
        let e = identity(env(&[])).unwrap_err();
        assert!(e.to_string().contains("OMPI_COMM_WORLD_RANK"), "{e}");
        let srun = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x2),3"),
            ("SLURM_JOB_ID", "41"),
            ("SLURM_STEP_ID", "0"),
        ]);
        let id = identity(&srun).unwrap();
        let place = (id.rank, id.world_size, id.local_rank, id.local_world_size);
        assert_eq!(place, (5, 7, 1, 3));
        assert_eq!(job_id(None, &srun).unwrap().as_str(), "slurm-41.0");
        let e = job_id(None, env(&[("SLURM_JOB_ID", "../x")])).unwrap_err();
        assert!(e.to_string().contains("slurm-../x"), "{e}");
    }
}
