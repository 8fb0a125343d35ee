//! `hatrain-agent serve`: the long-running agent of a host, the form it
//! takes as a systemd service.
//!
//! It listens on one socket (default [`default_socket`]) for the ranks of
//! jobs that another launcher started (`mpirun`, `srun`, `torchrun`), each
//! through a thin `hatrain-agent exec -- CMD` shim ([`crate::exec`]). Once
//! every rank of a job has registered, the job runs as under `launch`
//! ([`crate::job::run_served`]): snapshots, UCE repair, the hang watchdog,
//! worker reboot, the persister and the last-words dump, except that each
//! rank's shim forks its worker ([`Shims`]). The launcher sees its shims
//! only, and they live while their workers are restarted beneath them.
//!
//! Its workers do not die with it: a SIGKILL or `systemctl restart` of the
//! agent leaves them training and committing snapshots, their shims wait,
//! and the next agent re-adopts each job from its state folder (the first
//! rank's registration and what the job keeps, [`crate::job::Kept`]) and
//! the shared memory, as the shims come back; a worker that died in the
//! gap is rebooted, and a memory error flagged in the gap is repaired.
//!
//! It tells systemd how it is (READY once the socket is up, a one-line
//! STATUS, WATCHDOG keep-alives from its loop, STOPPING) through
//! [`crate::notify`]. On SIGTERM ([`OnStop`]) it leaves its jobs training
//! for the next agent (the default), or stops each as `launch` stops one
//! (the last-words checkpoint first when the dump mode is on), and the
//! shims exit with their workers' statuses.
//!
//! INVARIANT: everything runs on the agent's one thread (a `LocalSet`):
//! the state is an `Rc<RefCell<..>>` whose borrows never cross an await.

pub use crate::cli::OnStop;
pub use crate::shim::{Shims, wire};

use crate::cli::LaunchArgs;
use crate::config::{LaunchConfig, LaunchError};
use crate::job::{Kept, Served};
use crate::notify;
use hatrain_shared::ident::JobId;
use statedir::{StateFiles, abandon, lock_state_dir, make_private_dir};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use wire::{JobSummary, PROTOCOL, Registration, Reply, ToAgent};

mod statedir;

/// The host agent's socket: `/run/hatrain/agent.sock` for root, else
/// `$XDG_RUNTIME_DIR/hatrain/agent.sock` (`None` without it).
pub fn default_socket() -> Option<PathBuf> {
    if hatrain_shared::trust::me() == 0 {
        return Some(PathBuf::from("/run/hatrain/agent.sock"));
    }
    std::env::var_os("XDG_RUNTIME_DIR").map(|d| PathBuf::from(d).join("hatrain/agent.sock"))
}

#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub socket: PathBuf,
    /// The served jobs' shared-memory root, unless a job's `exec` names one.
    pub shm_root: PathBuf,
    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    pub stop_grace: Duration,
    /// How long a job's first rank waits for the others to register (and
    /// a re-adopted job for its shims to come back).
    pub gather_timeout: Duration,
    /// Where each running job's state is kept for the next agent.
    pub state_dir: PathBuf,
    pub on_stop: OnStop,
    /// Where Prometheus metrics are served.
    pub metrics_addr: Option<std::net::SocketAddr>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("another agent serves on {0} already")]
    Busy(PathBuf),
    #[error("another agent keeps its jobs' state in {0} (give each agent its own --socket folder)")]
    StateBusy(PathBuf),
    #[error("cannot listen on {path}")]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// One job: gathering its ranks, then running.
#[derive(Debug)]
struct Entry {
    first: Registration,
    cfg: LaunchConfig,
    shims: Arc<Shims>,
    since: Instant,
    started_unix_s: f64,
    running: bool,
    /// What the agent before this one kept of the job: its shims are
    /// coming back.
    resume: Option<Kept>,
}

#[derive(Debug)]
struct State {
    cfg: ServeConfig,
    jobs: BTreeMap<String, Entry>,
    tasks: TaskTracker,
    /// Cancelled when the agent stops with its jobs.
    stop_jobs: CancellationToken,
    /// The running jobs' control sockets, for the metrics.
    metrics: crate::metrics::Jobs,
    shutdown: CancellationToken,
}

type Shared = Rc<RefCell<State>>;

/// Serves until `shutdown`, then stops every job and waits for them.
pub async fn run(cfg: ServeConfig, shutdown: CancellationToken) -> Result<(), ServeError> {
    let listener = bind(&cfg.socket)?;
    make_private_dir(&cfg.state_dir).map_err(|source| ServeError::Bind {
        path: cfg.state_dir.clone(),
        source,
    })?;
    // One agent keeps its jobs' state in a folder: a second one would take
    // the first one's jobs for its own.
    let _state_lock = lock_state_dir(&cfg.state_dir)?;
    let socket = cfg.socket.clone();
    let state: Shared = Rc::new(RefCell::new(State {
        cfg,
        jobs: BTreeMap::new(),
        tasks: TaskTracker::new(),
        stop_jobs: CancellationToken::new(),
        metrics: crate::metrics::Jobs::default(),
        shutdown: shutdown.clone(),
    }));
    let metrics_addr = state.borrow().cfg.metrics_addr;
    if let Some(addr) = metrics_addr {
        let jobs = Arc::clone(&state.borrow().metrics);
        crate::metrics::serve(addr, jobs, shutdown.clone())
            .await
            .map_err(|source| ServeError::Bind {
                path: PathBuf::from(addr.to_string()),
                source,
            })?;
    }
    tracing::info!(socket = %socket.display(), "serving: jobs register with `hatrain-agent exec`");
    recover(&state);
    notify::ready("serving 0 jobs");
    let mut watchdog = notify::watchdog_interval();
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            conn = listener.accept() => {
                if let Ok((stream, _)) = conn {
                    tokio::task::spawn_local(connection(Rc::clone(&state), stream));
                }
            }
            _ = tick.tick() => expire(&state),
            _ = notify::keepalive(&mut watchdog) => {}
        }
    }
    notify::stopping();
    let (jobs, on_stop) = (state.borrow().jobs.len(), state.borrow().cfg.on_stop);
    if on_stop == OnStop::Keep {
        // Nothing of the jobs is undone: their workers, stores and state
        // files stay as a crash would leave them, for the next agent.
        tracing::info!(
            jobs,
            "stopping; the jobs train on and the next agent re-adopts them (--on-stop keep)"
        );
        let _ = std::fs::remove_file(&socket);
        std::process::exit(0);
    }
    tracing::info!(jobs, "stopping: every job is stopped (--on-stop stop)");
    state.borrow().stop_jobs.cancel();
    let tasks = state.borrow().tasks.clone();
    tasks.close();
    // Keep-alives go on while the jobs stop (a last-words dump takes time).
    loop {
        tokio::select! {
            () = tasks.wait() => break,
            _ = notify::keepalive(&mut watchdog) => {}
        }
    }
    drop(listener);
    let _ = std::fs::remove_file(&socket);
    Ok(())
}

/// Binds the socket (0600: only its owner and root reach it), making its
/// folder if needed; a socket some agent still answers on is not taken.
fn bind(path: &Path) -> Result<UnixListener, ServeError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let err = |source| ServeError::Bind {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(err)?;
        hatrain_shared::trust::check(
            dir,
            hatrain_shared::trust::Kind::Dir,
            hatrain_shared::trust::me(),
        )
        .map_err(|e| err(std::io::Error::other(e.to_string())))?;
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(ServeError::Busy(path.to_path_buf()));
    }
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    Ok(listener)
}

/// Why a message of the host agent's protocol was not read.
#[derive(Debug, thiserror::Error)]
enum ReadError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Frame(#[from] hatrain_shared::frame::FrameError),
}

async fn read_msg(stream: &mut UnixStream) -> Result<ToAgent, ReadError> {
    let mut header = [0u8; hatrain_shared::frame::HEADER_LEN];
    stream.read_exact(&mut header).await?;
    let len = PROTOCOL.parse_header(&header)?;
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await?;
    Ok(PROTOCOL.parse_json(&body)?)
}

/// Why a shim's registration is refused (what the shim is told).
#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error("the agent is stopping")]
    Stopping,
    #[error("job id {id:?}: {reason}")]
    JobId {
        id: String,
        reason: hatrain_shared::ident::JobIdError,
    },
    #[error(
        "job {job} has {world} ranks, {local} of them on this host: the host agent serves jobs whose ranks all run on it; a job of several hosts runs `hatrain-agent launch` on each"
    )]
    SeveralHosts {
        job: JobId,
        world: usize,
        local: usize,
    },
    #[error("rank {rank} (local rank {local}) does not fit a job of {world} ranks on one host")]
    RankOutside {
        rank: usize,
        local: usize,
        world: usize,
    },
    #[error(
        "job {0} is being re-adopted from the agent before this one; a new rank cannot join it"
    )]
    Readopting(JobId),
    #[error("job {job} runs here, and rank {rank} is not one of its shims")]
    NotAShim { job: JobId, rank: usize },
    #[error(
        "job {0} is already running here; a rank that joins it late is not taken (use another job id)"
    )]
    Late(JobId),
    #[error(
        "rank {rank} of job {job} was started with another world size, command or flags than rank {first}"
    )]
    Disagrees {
        job: JobId,
        rank: usize,
        first: usize,
    },
    #[error("rank {rank} of job {job} is registered already")]
    Again { job: JobId, rank: usize },
    #[error(
        "job {job} is not known here: the agent that ran it kept no state in {dir}; its worker runs on without protection"
    )]
    Unknown { job: JobId, dir: PathBuf },
    #[error("no worker command (put it after `--`)")]
    NoCommand,
    #[error("{0}")]
    Config(#[from] LaunchError),
}

async fn write_msg(stream: &mut UnixStream, reply: &Reply) {
    let Ok(payload) = serde_json::to_vec(reply) else {
        return;
    };
    if let Ok(frame) = PROTOCOL.encode(&payload) {
        let _ = stream.write_all(&frame).await;
    }
}

async fn connection(state: Shared, mut stream: UnixStream) {
    let Ok(cred) = stream.peer_cred() else {
        return;
    };
    let me = hatrain_shared::trust::me();
    if cred.uid() != me && cred.uid() != 0 {
        let message = format!(
            "uid {} may not use this agent: it serves its own uid ({me}) and root",
            cred.uid()
        );
        write_msg(&mut stream, &Reply::Refused { message }).await;
        return;
    }
    let pid = cred.pid().unwrap_or(0);
    let first = match tokio::time::timeout(Duration::from_secs(10), read_msg(&mut stream)).await {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => {
            let message = format!("not a message of the host agent's protocol: {e}");
            write_msg(&mut stream, &Reply::Refused { message }).await;
            return;
        }
        Err(_) => return,
    };
    match first {
        ToAgent::Register(reg) => {
            let (job, rank) = (reg.job.clone(), reg.rank);
            let answer = register(&state, *reg, pid);
            let shims = match answer {
                Ok((shims, job_socket)) => {
                    write_msg(&mut stream, &Reply::Registered { job_socket }).await;
                    shims
                }
                Err(why) => {
                    let message = why.to_string();
                    tracing::warn!(job, rank, pid, "registration refused: {message}");
                    write_msg(&mut stream, &Reply::Refused { message }).await;
                    return;
                }
            };
            // The shim's events: its worker's exits, until it goes.
            while let Ok(msg) = read_msg(&mut stream).await {
                match msg {
                    ToAgent::Exited { pid, status } => shims.exited(rank, pid, status),
                    other => tracing::warn!(job, rank, "unexpected from an exec shim: {other:?}"),
                }
            }
            shims.gone(rank);
            forget_if_abandoned(&state, &job);
        }
        ToAgent::Commands { job, rank } => {
            let Ok(std) = stream.into_std() else { return };
            if std.set_nonblocking(false).is_err() {
                return;
            }
            attach(&state, &job, rank, pid, std);
        }
        ToAgent::Jobs => {
            let list = summaries(&state.borrow());
            write_msg(&mut stream, &Reply::Jobs(list)).await;
        }
        ToAgent::Exited { .. } => {
            let message = "an exec shim registers before it reports exits".to_string();
            write_msg(&mut stream, &Reply::Refused { message }).await;
        }
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Takes one rank's registration: the first of a job makes its entry (and
/// its configuration, so that a bad flag is refused to the first rank);
/// the others must agree with it.
fn register(state: &Shared, reg: Registration, pid: i32) -> Result<(Arc<Shims>, PathBuf), Refused> {
    let mut st = state.borrow_mut();
    if st.shutdown.is_cancelled() {
        return Err(Refused::Stopping);
    }
    let job = JobId::new(&reg.job).map_err(|reason| Refused::JobId {
        id: reg.job.clone(),
        reason,
    })?;
    if reg.world_size != reg.local_world_size {
        return Err(Refused::SeveralHosts {
            job,
            world: reg.world_size,
            local: reg.local_world_size,
        });
    }
    if reg.rank >= reg.world_size || reg.local_rank != reg.rank {
        return Err(Refused::RankOutside {
            rank: reg.rank,
            local: reg.local_rank,
            world: reg.world_size,
        });
    }
    let serve = st.cfg.clone();
    if let Some(e) = st.jobs.get(&reg.job) {
        if e.resume.is_some() != reg.resume.is_some() {
            return Err(match e.resume {
                Some(_) => Refused::Readopting(job),
                None => Refused::NotAShim {
                    job,
                    rank: reg.rank,
                },
            });
        }
        if e.running {
            return Err(Refused::Late(job));
        }
        let f = &e.first;
        if (f.world_size, &f.command, &f.ha) != (reg.world_size, &reg.command, &reg.ha) {
            return Err(Refused::Disagrees {
                job,
                rank: reg.rank,
                first: f.rank,
            });
        }
        if e.shims.ranks().iter().any(|&(r, _)| r == reg.rank) {
            return Err(Refused::Again {
                job,
                rank: reg.rank,
            });
        }
        e.shims.register(reg.rank, pid);
        if let Some(r) = reg.resume {
            tracing::info!(job = %reg.job, rank = reg.rank, running = ?r.running, exited = ?r.exited, "a rank's shim came back");
            e.shims.resumed(reg.rank, r.running, r.exited);
        }
        let socket = e.cfg.ha.shm_root.join(&reg.job).join(crate::jobdir::SOCKET);
        return Ok((Arc::clone(&e.shims), socket));
    }
    if reg.resume.is_some() {
        return Err(Refused::Unknown {
            job,
            dir: serve.state_dir.clone(),
        });
    }
    let cfg = job_config(&reg, job, &serve)?;
    let socket = cfg.ha.shm_root.join(&reg.job).join(crate::jobdir::SOCKET);
    let shims = Arc::new(Shims::default());
    shims.register(reg.rank, pid);
    tracing::info!(
        job = %reg.job,
        launcher = %reg.launcher,
        world_size = reg.world_size,
        "a job's first rank registered"
    );
    st.jobs.insert(
        reg.job.clone(),
        Entry {
            first: reg,
            cfg,
            shims: Arc::clone(&shims),
            since: Instant::now(),
            started_unix_s: unix_now(),
            running: false,
            resume: None,
        },
    );
    drop(st);
    status(state);
    Ok((shims, socket))
}

/// The launch configuration of a served job: one host, its ranks' flags,
/// the workers' environment from their shims.
fn job_config(
    reg: &Registration,
    job: JobId,
    serve: &ServeConfig,
) -> Result<LaunchConfig, Refused> {
    if reg.command.is_empty() {
        return Err(Refused::NoCommand);
    }
    let mut ha = reg.ha.clone();
    ha.shm_root.get_or_insert_with(|| serve.shm_root.clone());
    let args = LaunchArgs {
        nnodes: 1,
        node_rank: Some(0),
        nproc_per_node: reg.local_world_size,
        master_addr: "127.0.0.1".into(),
        master_port: None,
        rdzv_port: None,
        standalone: false,
        job_id: Some(job),
        threads_per_worker: None,
        secret_file: None,
        stop_grace_secs: serve.stop_grace.as_secs_f64(),
        no_python: true,
        module: false,
        log_dir: None,
        redirects: Default::default(),
        tee: Default::default(),
        local_ranks_filter: None,
        metrics_addr: None,
        ha,
        command: reg.command.iter().map(Into::into).collect(),
    };
    let env: BTreeMap<String, String> = reg.env.iter().cloned().collect();
    let mut cfg = crate::settings::launch_config(args, &|k| env.get(k).cloned())?;
    cfg.worker_env = Some(env);
    cfg.validate()?;
    Ok(cfg)
}

/// Attaches a shim's commands connection; starts the job once every rank
/// has attached.
fn attach(
    state: &Shared,
    job: &str,
    rank: usize,
    pid: i32,
    mut stream: std::os::unix::net::UnixStream,
) {
    let answer = {
        let st = state.borrow();
        match st.jobs.get(job) {
            None => Err(format!("job {job} is not registered here")),
            Some(e) => match stream.try_clone() {
                Ok(s) => e
                    .shims
                    .attach(rank, pid, s)
                    .map(|()| Arc::clone(&e.shims))
                    .map_err(|e| crate::error_chain(&e)),
                Err(err) => Err(err.to_string()),
            },
        }
    };
    let reply = match &answer {
        Ok(_) => Reply::Attached,
        Err(message) => Reply::Refused {
            message: message.clone(),
        },
    };
    // The shim waits for this before it reads commands: nothing else is on
    // the connection yet.
    if let Err(e) = PROTOCOL.send_json(&mut stream, &reply) {
        tracing::warn!(job, rank, "cannot answer an exec shim: {e}");
    }
    let Ok(shims) = answer else { return };
    let ready = {
        let st = state.borrow();
        let e = &st.jobs[job];
        let ranks = shims.ranks();
        !e.running && ranks.len() == e.first.world_size && ranks.iter().all(|&(_, a)| a)
    };
    if ready {
        start(state, job);
    }
}

fn start(state: &Shared, job: &str) {
    let (cfg, served, token, tasks, files) = {
        let mut st = state.borrow_mut();
        let token = st.stop_jobs.child_token();
        let tasks = st.tasks.clone();
        let files = StateFiles::of(&st.cfg.state_dir, job);
        let e = st.jobs.get_mut(job).expect("the job's entry");
        e.running = true;
        if e.resume.is_none()
            && let Err(err) = files.write_registration(&e.first)
        {
            tracing::warn!(job, error = %err, "cannot keep the job's registration: an agent restart would lose the job");
        }
        let socket = e.cfg.ha.shm_root.join(job).join(crate::jobdir::SOCKET);
        st.metrics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(job.to_string(), socket);
        let e = st.jobs.get_mut(job).expect("the job's entry");
        let served = Served {
            shims: Arc::clone(&e.shims),
            state_file: files.kept.clone(),
            resume: e.resume.clone(),
        };
        (e.cfg.clone(), served, token, tasks, files)
    };
    let shims = Arc::clone(&served.shims);
    let resumed = served.resume.is_some();
    tracing::info!(job, ranks = cfg.nproc_per_node, modes = ?cfg.ha.modes.names(), "every rank registered: the job starts");
    status(state);
    let state = Rc::clone(state);
    let job = job.to_string();
    let span = tracing::info_span!("job", job = %job);
    tasks.spawn_local(tracing::Instrument::instrument(
        async move {
            let result = crate::job::run_served(&cfg, served, token).await;
            let error = match &result {
                Ok(report) => {
                    tracing::info!(outcome = ?report.outcome, faults = report.faults.len(), "the job ended");
                    None
                }
                Err(e) => {
                    let why = crate::error_chain(e);
                    tracing::error!("the job could not run: {why}");
                    Some(why)
                }
            };
            // A job taken back from the agent before that cannot be run
            // again leaves its workers training, unprotected.
            let detach = resumed && error.is_some();
            shims.finish(error, detach);
            files.remove();
            let mut st = state.borrow_mut();
            st.jobs.remove(&job);
            st.metrics.lock().unwrap_or_else(|p| p.into_inner()).remove(&job);
            drop(st);
            status(&state);
        },
        span,
    ));
}

/// A job whose shims are all gone before it started is forgotten (one
/// being taken back waits for the rest of its shims, or the timeout).
fn forget_if_abandoned(state: &Shared, job: &str) {
    let mut st = state.borrow_mut();
    if st
        .jobs
        .get(job)
        .is_some_and(|e| !e.running && e.resume.is_none() && e.shims.all_gone())
    {
        st.jobs.remove(job);
        drop(st);
        status(state);
    }
}

/// Refuses the jobs whose ranks did not all register in time.
fn expire(state: &Shared) {
    let limit = state.borrow().cfg.gather_timeout;
    let late: Vec<String> = state
        .borrow()
        .jobs
        .iter()
        .filter(|(_, e)| !e.running && e.since.elapsed() > limit)
        .map(|(j, _)| j.clone())
        .collect();
    for job in late {
        let Some(e) = state.borrow_mut().jobs.remove(&job) else {
            continue;
        };
        let why = format!(
            "only {} of job {job}'s {} ranks {} within {:.0} s",
            e.shims.ranks().len(),
            e.first.world_size,
            if e.resume.is_some() {
                "came back to this agent"
            } else {
                "registered"
            },
            limit.as_secs_f64()
        );
        tracing::error!("{why}");
        e.shims.finish(Some(why), false);
        if e.resume.is_some() {
            abandon(&state.borrow().cfg.state_dir, &e.cfg.ha.shm_root, &job);
        }
        status(state);
    }
}

fn summaries(st: &State) -> Vec<JobSummary> {
    st.jobs
        .iter()
        .map(|(job, e)| JobSummary {
            job: job.clone(),
            launcher: e.first.launcher.clone(),
            world_size: e.first.world_size,
            registered: e.shims.ranks().len(),
            running: e.running,
            started_unix_s: e.started_unix_s,
            socket: e.cfg.ha.shm_root.join(job).join(crate::jobdir::SOCKET),
        })
        .collect()
}

/// systemd's one-line STATUS: the jobs served.
fn status(state: &Shared) {
    let st = state.borrow();
    let line = match st.jobs.len() {
        0 => "serving 0 jobs".to_string(),
        n => {
            let names: Vec<String> = st
                .jobs
                .iter()
                .map(|(j, e)| {
                    let what = if e.running { "running" } else { "gathering" };
                    format!("{j} ({} ranks, {what})", e.first.world_size)
                })
                .collect();
            format!(
                "serving {n} job{}: {}",
                if n == 1 { "" } else { "s" },
                names.join(", ")
            )
        }
    };
    notify::status(&line);
}

/// Takes up the jobs the agent before this one ran: each waits for its
/// shims to come back, for the gather timeout.
fn recover(state: &Shared) {
    let serve = state.borrow().cfg.clone();
    let Ok(entries) = std::fs::read_dir(&serve.state_dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let job = name.as_str();
        if !e.file_type().is_ok_and(|t| t.is_dir()) || JobId::new(job).is_err() {
            continue;
        }
        let files = StateFiles::of(&serve.state_dir, job);
        let loaded = std::fs::read(&files.registration)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<Registration>(&b).map_err(|e| e.to_string()))
            .and_then(|reg| {
                let kept = Kept::load(&files.kept).map_err(|e| crate::error_chain(&e))?;
                Ok((kept, reg))
            })
            .and_then(|(kept, reg)| {
                let id = JobId::new(job).map_err(|e| e.to_string())?;
                let cfg = job_config(&reg, id, &serve).map_err(|e| e.to_string())?;
                Ok((cfg, kept, reg))
            });
        match loaded {
            Ok((cfg, kept, first)) => {
                tracing::info!(
                    job,
                    ranks = first.world_size,
                    "a job the previous agent ran: waiting for its shims to come back"
                );
                state.borrow_mut().jobs.insert(
                    job.to_string(),
                    Entry {
                        first,
                        cfg,
                        shims: Arc::new(Shims::default()),
                        since: Instant::now(),
                        started_unix_s: unix_now(),
                        running: false,
                        resume: Some(kept),
                    },
                );
            }
            Err(why) => {
                tracing::error!(job, "cannot re-adopt the job the previous agent ran: {why}");
                abandon(&serve.state_dir, &serve.shm_root, job);
            }
        }
    }
    status(state);
}
