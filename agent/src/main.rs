//! `hatrain-agent`: parses the command line and hands over to the library.

use anyhow::{Context, Result};
use clap::Parser;
use hatrain_agent::cli::{Cli, Command, LaunchArgs};
use hatrain_agent::exit;
use hatrain_agent::launch::{self, HaSettings, JobIdSource, LaunchConfig, LaunchError, OutputPlan};
use hatrain_agent::recovery::{HangPolicy, Outcome, RestartPolicy};
use hatrain_shared::control::FaultKind;
use hatrain_shared::ha::{self, HaFlags};
use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            say(format_args!("hatrain-agent: error: {e:#}"));
            let usage = e.downcast_ref::<LaunchError>().is_some_and(|e| {
                matches!(
                    e,
                    LaunchError::Config(_) | LaunchError::JobDir(_) | LaunchError::Secret(_)
                )
            });
            ExitCode::from(if usage { exit::USAGE } else { exit::INTERNAL })
        }
    }
}

fn run(command: Command) -> Result<ExitCode> {
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
            Command::Launch(args) => {
                let report = launch::run(&launch_config(args)?, shutdown).await?;
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

fn seconds(flag: &str, v: f64) -> Result<Duration, LaunchError> {
    Duration::try_from_secs_f64(v).map_err(|_| {
        LaunchError::Config(format!(
            "{flag} {v} must be a non-negative number of seconds"
        ))
    })
}

fn launch_config(a: LaunchArgs) -> Result<LaunchConfig, LaunchError> {
    let node_rank = launch::resolve_node_rank(a.node_rank, |k| std::env::var(k).ok())?;
    let (job_id, source) =
        launch::resolve_job_id(a.job_id, a.nnodes, node_rank, |k| std::env::var(k).ok())?;
    match source {
        JobIdSource::Given => tracing::info!(job = %job_id, "job id"),
        JobIdSource::Launcher(var) => {
            tracing::info!(job = %job_id, from = var, "job id (from the launcher's)")
        }
        JobIdSource::Made => tracing::info!(
            job = %job_id,
            "job id made for this launch (give --job-id to choose one); agentctl finds the job by it"
        ),
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let h = &a.ha;
    let flags = HaFlags {
        enable_high_availability: h.enable_high_availability,
        enable_hbmfault_repair: h.enable_hbmfault_repair,
        enable_worker_reboot: h.enable_worker_reboot,
        enable_elastic_training: h.enable_elastic_training,
    };
    let env = std::env::var(ha::ENV).ok();
    let modes = ha::resolve(flags, env.as_deref(), a.nnodes * a.nproc_per_node)
        .map_err(|e| LaunchError::Config(e.to_string()))?;
    let ha = HaSettings {
        modes,
        policy: RestartPolicy {
            max_restarts: h
                .max_restarts
                .unwrap_or(RestartPolicy::default().max_restarts),
            window: seconds("--restart-window-secs", h.restart_window_secs)?,
            max_in_window: h.max_restarts_in_window,
            ..RestartPolicy::default()
        },
        shm_root: h
            .shm_root
            .clone()
            .unwrap_or_else(hatrain_shared::trust::default_shm_root),
        slots: h.snapshot_slots,
        pause_timeout: seconds("--pause-timeout-secs", h.pause_timeout_secs)?,
        hang: HangPolicy {
            fixed: h
                .hang_timeout_secs
                .map(|v| seconds("--hang-timeout-secs", v))
                .transpose()?,
            factor: if h.hang_factor.is_finite() && h.hang_factor >= 1.0 {
                h.hang_factor
            } else {
                return Err(LaunchError::Config(format!(
                    "--hang-factor {} must be at least 1",
                    h.hang_factor
                )));
            },
            floor: seconds("--hang-floor-secs", h.hang_floor_secs)?,
            startup_grace: seconds("--hang-startup-grace-secs", h.hang_startup_grace_secs)?,
            ..HangPolicy::default()
        },
        trainer_saves: h.trainer_saves,
        register_timeout: seconds("--register-timeout-secs", h.register_timeout_secs)?,
        slices: h.snapshot_slices == "on",
        replicas: h.replicas,
        host_timeout: seconds("--host-timeout-secs", h.host_timeout_secs)?,
        failure_domain: h.failure_domain.clone(),
        local_addr: h.local_addr,
        standby_nodes: h.standby_nodes,
        min_nodes: usize::try_from(h.min_nodes).unwrap_or(usize::MAX),
        standby: h.standby,
        coordinator: h.coordinator.parse().map_err(LaunchError::Config)?,
        coordinator_timeout: seconds("--coordinator-timeout-secs", h.coordinator_timeout_secs)?,
    };
    if a.standalone && a.nnodes != 1 {
        return Err(LaunchError::Config(format!(
            "--standalone runs one host; --nnodes {} asks for more",
            a.nnodes
        )));
    }
    let command = launch::worker_command(
        a.command,
        a.no_python,
        a.module,
        std::env::var_os("HATRAIN_PYTHON"),
    )?;
    Ok(LaunchConfig {
        nnodes: a.nnodes,
        node_rank,
        nproc_per_node: a.nproc_per_node,
        master_addr: a.master_addr,
        master_port: a.master_port,
        rdzv_port: a.rdzv_port,
        group_restarts: h.max_restarts.unwrap_or(0),
        output: OutputPlan {
            log_dir: a.log_dir,
            redirects: a.redirects,
            tee: a.tee,
            filter: a.local_ranks_filter.map(|f| f.0),
        },
        job_id,
        secret_file: a.secret_file,
        threads_per_worker: a
            .threads_per_worker
            .unwrap_or((cores / a.nproc_per_node.max(1)).max(1)),
        stop_grace: seconds("--stop-grace-secs", a.stop_grace_secs)?,
        command,
        ha,
    })
}
