//! `hatrain-agent`: parses the command line and hands over to the library.

use anyhow::{Context, Result};
use clap::Parser;
use hatrain_agent::cli::{Cli, Command, ExecArgs, ServeArgs};
use hatrain_agent::exit;
use hatrain_agent::launch::{self, LaunchError};
use hatrain_agent::recovery::Outcome;
use hatrain_agent::serve;
use hatrain_agent::settings::{launch_config, seconds};
use hatrain_shared::control::FaultKind;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Exec(args) = cli.command {
        return exec(*args);
    }
    logging();
    match run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            say(format_args!("hatrain-agent: error: {e:#}"));
            ExitCode::from(match e.downcast_ref::<LaunchError>() {
                Some(LaunchError::Config(_) | LaunchError::JobDir(_) | LaunchError::Secret(_)) => {
                    exit::USAGE
                }
                Some(LaunchError::DeviceLost { .. }) => exit::DEVICE_LOST,
                Some(LaunchError::HandedOver { .. }) => exit::HANDED_OVER,
                _ => exit::INTERNAL,
            })
        }
    }
}

fn run(command: Command) -> Result<ExitCode> {
    // Descriptors for every control connection, worker pipe, store and
    // checkpoint file; the workers get the limit the agent started with.
    match hatrain_agent::limits::raise_nofile() {
        Ok((soft, hard)) if soft < hard => {
            tracing::debug!(soft, hard, "descriptor limit raised to the hard limit")
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read or raise the descriptor limit"),
    }
    // One thread: workers are forked from it, and PR_SET_PDEATHSIG fires when
    // the *thread* that forked a child exits, so that thread must live as
    // long as the agent.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(async {
        let shutdown = CancellationToken::new();
        let signaled = Arc::new(AtomicI32::new(0));
        watch_signals(shutdown.clone(), Arc::clone(&signaled))?;
        let (outcome, faults) = match command {
            Command::Exec(_) => unreachable!("run without the async runtime"),
            Command::Serve(args) => {
                let cfg = serve_config(args)?;
                let local = tokio::task::LocalSet::new();
                local.run_until(serve::run(cfg, shutdown)).await?;
                return Ok(ExitCode::SUCCESS);
            }
            Command::Launch(args) => {
                let metrics_addr = args.metrics_addr;
                let cfg = launch_config(*args, &|k| std::env::var(k).ok())?;
                if let Some(addr) = metrics_addr {
                    let socket = cfg.ha.shm_root.join(cfg.job_id.as_str()).join(hatrain_agent::jobdir::SOCKET);
                    let jobs = hatrain_agent::metrics::Jobs::default();
                    jobs.lock().unwrap_or_else(|p| p.into_inner()).insert(cfg.job_id.to_string(), socket);
                    hatrain_agent::metrics::serve(addr, jobs, shutdown.clone())
                        .await
                        .with_context(|| format!("cannot serve metrics on {addr}"))?;
                }
                let report = launch::run(&cfg, shutdown).await?;
                if let Some((it, dir)) = &report.last_words {
                    say(format_args!(
                        "hatrain-agent: last-words checkpoint of iteration {it} written; resume with --load {}",
                        dir.display()
                    ));
                }
                if report.group_restarts > 0 {
                    say(format_args!(
                        "hatrain-agent: the group of workers was restarted {} time(s) (TORCHELASTIC_RESTART_COUNT)",
                        report.group_restarts
                    ));
                }
                for lost in &report.lost_hosts {
                    say(format_args!("hatrain-agent: a host of the job was lost: {lost}"));
                }
                if let Some(why) = &report.stop_reason {
                    say(format_args!("hatrain-agent: {why}"));
                }
                if let Some((rank, why)) = &report.root_cause {
                    say(format_args!(
                        "hatrain-agent: root cause (rank {rank}'s error file): {why}"
                    ));
                }
                if let Some(Err(why)) = &report.final_save {
                    let newest = report.persist.as_ref().and_then(|p| {
                        let it = hatrain_shared::checkpoint::read_tracker(&p.dir).ok()?;
                        Some(format!("iteration {it} in {}", p.dir.display()))
                    });
                    say(format_args!(
                        "hatrain-agent: training finished but its final checkpoint could not be written: {why}; the newest checkpoint on disk is {}",
                        newest.as_deref().unwrap_or("none")
                    ));
                    return Ok(ExitCode::from(exit::SAVE_FAILED));
                }
                (report.outcome, report.faults)
            }
        };
        Ok(match outcome {
            Outcome::Succeeded => ExitCode::SUCCESS,
            Outcome::WorkerFailed { rank, status } => {
                let oom = faults.iter().rev().find(|f| f.ranks == [rank]).filter(|f| f.kind == FaultKind::Oom);
                match oom {
                    Some(_) => say(format_args!(
                        "hatrain-agent: rank {rank} ran out of memory (killed by the kernel's OOM killer, {status}); job stopped"
                    )),
                    None => say(format_args!("hatrain-agent: rank {rank} failed ({status}); job stopped")),
                }
                ExitCode::from(exit::worker(status.code()))
            }
            Outcome::Unfit => {
                let why = faults.iter().rev().find(|f| f.kind == FaultKind::Store).map_or("", |f| f.detail.as_str());
                say(format_args!("hatrain-agent: the job cannot run on this host: {why}"));
                ExitCode::from(exit::UNFIT)
            }
            Outcome::RecoveryFailed => {
                say(format_args!(
                    "hatrain-agent: recovery failed; job stopped (see the log above for why)"
                ));
                ExitCode::from(exit::RECOVERY_FAILED)
            }
            Outcome::Interrupted => ExitCode::from(exit::signaled(signaled.load(Ordering::SeqCst))),
        })
    })
}

/// Logs go to journald, with their fields (job, rank, fault) as its own,
/// when systemd connected stderr to the journal (`JOURNAL_STREAM` names
/// stderr's device and inode); else to stderr as text.
fn logging() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter =
        || tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    if journal_is_stderr()
        && let Ok(journal) = tracing_journald::layer()
    {
        tracing_subscriber::registry()
            .with(filter())
            .with(journal.with_syslog_identifier("hatrain-agent".into()))
            .init();
        return;
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter())
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

fn journal_is_stderr() -> bool {
    use std::os::unix::fs::MetadataExt;
    let Some(v) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Ok(meta) = std::fs::metadata("/proc/self/fd/2") else {
        return false;
    };
    v.to_str()
        .and_then(|v| v.split_once(':'))
        .and_then(|(d, i)| Some((d.parse::<u64>().ok()?, i.parse::<u64>().ok()?)))
        .is_some_and(|(dev, ino)| dev == meta.dev() && ino == meta.ino())
}

fn exec(a: ExecArgs) -> ExitCode {
    let Some(socket) = a.agent_socket.or_else(serve::default_socket) else {
        say(format_args!(
            "hatrain-agent exec: error: no host agent socket: give --agent-socket (or HATRAIN_AGENT_SOCKET); XDG_RUNTIME_DIR is not set"
        ));
        return ExitCode::from(exit::USAGE);
    };
    let opts = hatrain_agent::exec::ExecOptions {
        socket,
        job: a.job_id,
        ha: a.ha,
        command: a.command,
        agent_wait: match seconds("--agent-wait-secs", a.agent_wait_secs) {
            Ok(d) => d,
            Err(e) => {
                say(format_args!("hatrain-agent exec: error: {e}"));
                return ExitCode::from(exit::USAGE);
            }
        },
    };
    match hatrain_agent::exec::run(opts) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            say(format_args!("hatrain-agent exec: error: {e}"));
            ExitCode::from(exit::USAGE)
        }
    }
}

fn serve_config(a: ServeArgs) -> Result<serve::ServeConfig, LaunchError> {
    let socket = a.socket.or_else(serve::default_socket).ok_or_else(|| {
        LaunchError::Config(
            "no socket to serve on: give --socket (or HATRAIN_AGENT_SOCKET); XDG_RUNTIME_DIR is not set".into(),
        )
    })?;
    Ok(serve::ServeConfig {
        shm_root: a
            .shm_root
            .unwrap_or_else(hatrain_shared::trust::default_shm_root),
        stop_grace: seconds("--stop-grace-secs", a.stop_grace_secs)?,
        gather_timeout: seconds("--gather-timeout-secs", a.gather_timeout_secs)?,
        state_dir: socket_dir(&socket).join("jobs"),
        on_stop: a.on_stop,
        metrics_addr: a.metrics_addr,
        socket,
    })
}

fn socket_dir(socket: &std::path::Path) -> std::path::PathBuf {
    socket
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."))
        .to_path_buf()
}

/// SIGTERM, SIGINT, SIGHUP and SIGQUIT cancel the root shutdown token, as
/// torchrun takes them (the terminal or ssh session that started the job
/// going away is a stop, not a crash: the last words are written). A
/// signal after the first is not lost: it says the agent is still stopping.
fn watch_signals(shutdown: CancellationToken, signaled: Arc<AtomicI32>) -> Result<()> {
    let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let mut hup = signal(SignalKind::hangup()).context("cannot handle SIGHUP")?;
    let mut quit = signal(SignalKind::quit()).context("cannot handle SIGQUIT")?;
    tokio::spawn(async move {
        loop {
            let sig = tokio::select! {
                Some(()) = term.recv() => libc::SIGTERM,
                Some(()) = int.recv() => libc::SIGINT,
                Some(()) = hup.recv() => libc::SIGHUP,
                Some(()) = quit.recv() => libc::SIGQUIT,
                else => return,
            };
            let name = nix::sys::signal::Signal::try_from(sig).map_or("a signal", |s| s.as_str());
            if signaled
                .compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                tracing::warn!(
                    signal = name,
                    "stopping: the workers are stopped (after the last-words checkpoint when the dump mode is on)"
                );
                shutdown.cancel();
            } else {
                say(format_args!(
                    "hatrain-agent: {name} again: still stopping; the last-words checkpoint, if one is being written, is finished first (SIGKILL stops at once and loses it)"
                ));
            }
        }
    });
    Ok(())
}

/// Writes a line to stderr, ignoring a stderr that is gone (a closed
/// terminal after SIGHUP must not end the agent mid-dump).
fn say(msg: std::fmt::Arguments) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{msg}");
}
