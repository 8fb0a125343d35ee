//! `agentctl`: inspects a running hatrain agent over its control socket.
//! One small function per verb; `--json` prints the agent's reply as JSON.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use hatrain_agent::serve::wire::{self, JobSummary};
use hatrain_shared::control::{
    DeviceFaultRecord, FaultRecord, InjectKind, ReplicaReport, Request, Response, WorkerReport,
};
use hatrain_shared::ident::JobId;
use hatrain_shared::joblock;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "agentctl",
    version,
    about = "Inspect and drive a running hatrain agent"
)]
struct Cli {
    /// The agent's control socket (default: <shm-root>/<job>/agent.sock,
    /// or HATRAIN_AGENT_SOCKET).
    #[arg(long, env = "HATRAIN_AGENT_SOCKET")]
    socket: Option<PathBuf>,
    /// Job id, to find the socket under --shm-root (default: the only job
    /// running there).
    #[arg(long, env = "HATRAIN_JOB_ID")]
    job: Option<JobId>,
    /// Root of the agents' shared memory (default: /dev/shm/hatrain for
    /// root, /dev/shm/hatrain-<uid> for others).
    #[arg(long)]
    shm_root: Option<PathBuf>,
    /// The host agent's socket (`hatrain-agent serve`), which `jobs` asks
    /// first (default: /run/hatrain/agent.sock for root,
    /// $XDG_RUNTIME_DIR/hatrain/agent.sock for others).
    #[arg(long, env = "HATRAIN_HOST_SOCKET")]
    host_socket: Option<PathBuf>,
    /// Print the reply as JSON.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    verb: Verb,
}

#[derive(Debug, Subcommand)]
enum Verb {
    /// The jobs the host agent serves, and those whose agents run under
    /// --shm-root.
    Jobs,
    /// The job, its ranks and its recent faults.
    Status,
    /// One line per rank.
    Workers,
    /// The ranks found holding the job back: the phase that grew, by how
    /// much, since when, and the likely cause.
    Slow,
    /// The fault history.
    Faults,
    /// Write a last-words checkpoint of the newest consistent step now, and
    /// carry on training.
    Dump,
    /// Make a rank give itself a fault at its next step (or at --at-step).
    Inject {
        /// crash (SIGKILL itself), hang (block inside the step) or uce (an
        /// uncorrectable memory error in a state buffer).
        #[arg(value_parser = ["crash", "hang", "uce"])]
        fault: String,
        #[arg(long)]
        rank: usize,
        /// For uce: the state part, by name (default: the largest; the
        /// reference trainer's are params, exp_avg, exp_avg_sq).
        #[arg(long)]
        buffer: Option<String>,
        /// For uce: the byte offset in the buffer.
        #[arg(long, default_value_t = 0)]
        offset: u64,
        /// The step to give it at (default: the next one).
        #[arg(long)]
        at_step: Option<u64>,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agentctl: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The socket of the job to talk to: `--socket`, else `--job`'s under the
/// root, else the only job running under the root.
fn socket(cli: &Cli, root: &Path) -> Result<PathBuf> {
    if let Some(s) = &cli.socket {
        return Ok(s.clone());
    }
    if let Some(job) = &cli.job {
        return Ok(root.join(job).join("agent.sock"));
    }
    let jobs = joblock::running(root)
        .with_context(|| format!("cannot list the jobs under {}", root.display()))?;
    match jobs.as_slice() {
        [] => bail!("no job is running under {}", root.display()),
        [(job, _)] => Ok(root.join(job).join("agent.sock")),
        several => bail!(
            "{} jobs are running under {}; choose one with --job:\n{}",
            several.len(),
            root.display(),
            several
                .iter()
                .map(|(j, h)| format!("  {j} (agent pid {}, started at {})", h.pid, h.started()))
                .collect::<Vec<_>>()
                .join("\n")
        ),
    }
}

/// The jobs a host agent serves, if one answers on `socket`.
fn served(socket: &Path) -> Option<Vec<JobSummary>> {
    let mut s = std::os::unix::net::UnixStream::connect(socket).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    wire::PROTOCOL
        .send_json(&mut s, &wire::ToAgent::Jobs)
        .ok()?;
    match wire::PROTOCOL.recv_json(&mut s).ok()? {
        wire::Reply::Jobs(list) => Some(list),
        _ => None,
    }
}

fn jobs(root: &Path, host: Option<&Path>, json: bool) -> Result<()> {
    let served = host.and_then(served).unwrap_or_default();
    let jobs: Vec<_> = match joblock::running(root) {
        Ok(j) => j,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e).with_context(|| format!("cannot list {}", root.display())),
    }
    .into_iter()
    .filter(|(j, _)| !served.iter().any(|s| s.job == j.as_str()))
    .collect();
    if json {
        let mut list: Vec<_> = served
            .iter()
            .map(|s| serde_json::json!({"job": s.job, "served": true, "launcher": s.launcher, "world_size": s.world_size, "registered": s.registered, "running": s.running, "started_unix_s": s.started_unix_s, "socket": s.socket}))
            .collect();
        list.extend(jobs.iter().map(|(j, h)| serde_json::json!({"job": j.as_str(), "pid": h.pid, "started_unix_s": h.started_unix_s})));
        println!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(());
    }
    if served.is_empty() && jobs.is_empty() {
        println!("no job is running under {}", root.display());
    }
    for s in &served {
        let state = match s.running {
            true => "running".to_string(),
            false => format!(
                "gathering ({} of {} ranks registered)",
                s.registered, s.world_size
            ),
        };
        println!(
            "{}  served by the host agent  {} ranks from {}  {state}  {}",
            s.job,
            s.world_size,
            s.launcher,
            s.socket.display()
        );
    }
    for (j, h) in &jobs {
        println!("{j}  agent pid {}  started at {}", h.pid, h.started());
    }
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    let root = cli
        .shm_root
        .clone()
        .unwrap_or_else(hatrain_shared::trust::default_shm_root);
    if matches!(cli.verb, Verb::Jobs) {
        let host = cli
            .host_socket
            .clone()
            .or_else(hatrain_agent::serve::default_socket);
        return jobs(&root, host.as_deref(), cli.json);
    }
    let socket = socket(&cli, &root)?;
    let faults = matches!(cli.verb, Verb::Faults);
    let slow_only = matches!(cli.verb, Verb::Slow);
    let request = match cli.verb {
        Verb::Jobs => unreachable!("answered above"),
        Verb::Status | Verb::Slow => Request::Status,
        Verb::Workers => Request::Workers,
        Verb::Faults => Request::Faults,
        Verb::Dump => Request::Dump,
        Verb::Inject {
            fault,
            rank,
            buffer,
            offset,
            at_step,
        } => Request::Inject {
            rank,
            fault: match fault.as_str() {
                "crash" => InjectKind::Crash,
                "hang" => InjectKind::Hang,
                _ => InjectKind::Uce,
            },
            buffer,
            offset,
            at_step,
        },
    };
    // A dump pauses the job and writes its state: allow it time.
    let response = hatrain_shared::control::request(&socket, &request, Duration::from_secs(600))?;
    // With the faults, what the device fault sources reported (an agent
    // older than protocol 1.5 has none to give).
    let device = if faults {
        match hatrain_shared::control::request(
            &socket,
            &Request::DeviceFaults,
            Duration::from_secs(10),
        ) {
            Ok(Response::DeviceFaults(d)) => d,
            _ => Vec::new(),
        }
    } else {
        Vec::new()
    };
    if slow_only {
        let Response::Status(s) = response else {
            bail!("unexpected reply: {response:?}");
        };
        if cli.json {
            println!("{}", serde_json::to_string_pretty(&s.slow)?);
        } else {
            print_slow(&s.slow);
        }
        return Ok(());
    }
    if cli.json {
        let mut v = serde_json::to_value(&response)?;
        if faults && let Some(o) = v.as_object_mut() {
            o.insert("device_faults".into(), serde_json::to_value(&device)?);
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    match response {
        Response::Status(s) => {
            println!(
                "job {} | world size {} ({} rank(s) here) | epoch {} | modes {} | up {:.1} s{}",
                s.job,
                s.world_size,
                s.local_ranks,
                s.epoch,
                if s.modes.any() {
                    s.modes.names().join(",")
                } else {
                    "none".into()
                },
                s.uptime_s,
                if s.recovering { " | RECOVERING" } else { "" }
            );
            if let Some(st) = &s.store {
                println!(
                    "rendezvous store: {} requests served | {} refused (bad or missing authentication) | {} closed unauthenticated at the deadline | {} closed over the limit | {} open",
                    st.served, st.refused, st.timed_out, st.over_limit, st.open
                );
            }
            if let Some(p) = &s.persist {
                println!(
                    "checkpoints: written by the agent into {} every {} steps | last iteration {} | {} saved{}{}{}",
                    p.dir.display(),
                    p.interval,
                    p.last_saved.map_or("-".into(), |it| format!(
                        "{it} ({:.3} s)",
                        p.last_seconds.unwrap_or(0.0)
                    )),
                    p.saves,
                    p.writing
                        .map_or(String::new(), |it| format!(" | writing {it}")),
                    if p.skipped.is_empty() {
                        String::new()
                    } else {
                        format!(" | skipped {:?} (disk slower than the interval)", p.skipped)
                    },
                    p.last_error
                        .as_ref()
                        .map_or(String::new(), |e| format!(" | LAST SAVE FAILED: {e}")),
                );
            }
            if let Some(m) = &s.membership {
                println!(
                    "hosts: live {:?} | lost {:?} | starting {:?} | controller {}{} (term {}) | heartbeats on {}",
                    m.live,
                    m.lost,
                    m.starting,
                    m.follows
                        .map_or("none yet".to_string(), |n| format!("node {n}")),
                    if m.acting { ", this agent" } else { "" },
                    m.term,
                    m.listen
                );
            }
            if let Some(r) = &s.replicas {
                print_replicas(r);
            }
            for r in &s.resizes {
                println!(
                    "resized: {} -> {} ranks at s*={} in {} (fault {})",
                    r.from,
                    r.to,
                    r.s_star.map_or("-".into(), |s| s.to_string()),
                    r.seconds.map_or("-".into(), |s| format!("{s:.3} s")),
                    r.fault.map_or("-".into(), |f| f.to_string()),
                );
            }
            print_workers(&s.workers);
            if s.slow.iter().any(|f| !f.ended) {
                print_slow(&s.slow);
            }
            print_faults(&s.faults);
        }
        Response::Workers(w) => print_workers(&w),
        Response::Faults(f) => {
            print_faults(&f);
            print_device_faults(&device);
        }
        Response::DeviceFaults(d) => print_device_faults(&d),
        Response::Injected { message } => println!("{message}"),
        Response::Dumped {
            iteration, message, ..
        } => {
            println!("{message}");
            if iteration.is_none() {
                bail!("no checkpoint was written");
            }
        }
        Response::Error { message } => bail!("the agent refused: {message}"),
        other => bail!("unexpected reply: {other:?}"),
    }
    Ok(())
}

fn print_replicas(r: &ReplicaReport) {
    println!(
        "peer replicas: taken on {} | frames refused: {} malformed, {} forged or altered, {} replayed",
        r.listen, r.rejected_malformed, r.rejected_forged, r.rejected_replayed
    );
    let step = |s: Option<u64>| s.map_or("-".to_string(), |s| s.to_string());
    println!(
        "  kept for the replicas: step {} (held by every rank and a replica of each) | next: the first snapshot at or after step {}",
        step(r.kept.common),
        step(r.kept.target)
    );
    for s in &r.streams {
        println!(
            "  to node {} at {}{} | {} MiB in {} chunks | sender {}",
            s.node,
            s.endpoint,
            if s.connected { "" } else { " (not connected)" },
            s.bytes_sent >> 20,
            s.chunks_sent,
            per_gb(s.cpu_s, s.bytes_sent),
        );
        for k in &s.ranks {
            println!(
                "    rank {:>5}: local step {} | replica step {} | lag {} step(s), {} bytes | {} abandoned{}",
                k.rank,
                step(k.local_step),
                step(k.replica_step),
                step(k.lag_steps),
                k.lag_bytes,
                k.abandoned,
                if k.at_risk {
                    " | AT RISK: behind every step this host keeps but the one its next snapshot overwrites; unless another holder is current, a loss of this host now could not be recovered from memory"
                } else {
                    ""
                }
            );
        }
    }
    for h in &r.held {
        println!(
            "  holding rank {} of node {}: steps {:?} | {} stored, {} dropped",
            h.rank, h.from_node, h.steps, h.stored, h.dropped
        );
    }
    if r.received_bytes > 0 {
        println!(
            "  received {} MiB | receiver {}",
            r.received_bytes >> 20,
            per_gb(r.receive_cpu_s, r.received_bytes)
        );
    }
}

/// `cpu_s` CPU seconds for `bytes`, per GB (10^9 bytes).
fn per_gb(cpu_s: f64, bytes: u64) -> String {
    if bytes == 0 {
        format!("{cpu_s:.3} CPU s")
    } else {
        format!("{:.3} CPU s per GB", cpu_s / (bytes as f64 / 1e9))
    }
}

fn print_workers(w: &[WorkerReport]) {
    println!(
        "{:>5} {:>8} {:>10} {:>8} {:>6} {:>9} {:>13} {:>10} {:>10}  protected",
        "rank", "pid", "phase", "step", "epoch", "restarts", "snapshot", "age s", "commit ms",
    );
    for r in w {
        let (snap, age) =
            r.last_snapshot
                .as_ref()
                .map_or(("-".to_string(), "-".to_string()), |s| {
                    (
                        format!("{} ({:.1} MB)", s.step, s.bytes as f64 / 1e6),
                        format!("{:.2}", s.age_s),
                    )
                });
        println!(
            "{:>5} {:>8} {:>10} {:>8} {:>6} {:>9} {:>13} {:>10} {:>10}  {}",
            r.rank,
            r.pid.map_or("-".into(), |p| p.to_string()),
            format!("{:?}", r.phase).to_lowercase(),
            r.step,
            r.epoch,
            r.restarts,
            snap,
            age,
            r.last_commit_ms.map_or("-".into(), |m| format!("{m:.2}")),
            if r.protected {
                "yes"
            } else {
                "NO: never registered with the hatrain runtime"
            },
        );
    }
    if w.iter()
        .any(|r| r.held_time.is_some() || r.copies.is_some())
    {
        println!(
            "{:>5} {:>26} {:>9} | {:>13} {:>9} {:>8} {:>8} {:>8}",
            "rank",
            "held/step ms p50 p99 max",
            "steps",
            "copy/snap ms",
            "CPU s/GB",
            "skipped",
            "waited",
            "thinned",
        );
        for r in w {
            let held = r.held_time.as_ref().map_or(("-".into(), "-".into()), |h| {
                (
                    format!("≤{:.3} ≤{:.3} {:.3}", h.p50_ms, h.p99_ms, h.max_ms),
                    h.steps.to_string(),
                )
            });
            let copies = r.copies.as_ref().map_or(
                [
                    "-".to_string(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                ],
                |c| {
                    [
                        format!("{:.2}", c.copy_ms_mean),
                        format!("{:.3}", c.cpu_s_per_gb),
                        c.skipped.to_string(),
                        c.waited_after_misses.to_string(),
                        c.thinned.to_string(),
                    ]
                },
            );
            let [copy, cpu, skipped, waited, thinned] = copies;
            println!(
                "{:>5} {:>26} {:>9} | {:>13} {:>9} {:>8} {:>8} {:>8}",
                r.rank, held.0, held.1, copy, cpu, skipped, waited, thinned
            );
        }
    }
    if w.iter().any(|r| r.step_times.is_some()) {
        println!(
            "{:>5} {:>9} | ms per step: {:>9} {:>9} {:>10} {:>9} {:>9} | {:>8} {:>4}",
            "rank", "steps", "data", "compute", "collective", "update", "step", "gc", "gcs"
        );
        for r in w {
            if let Some(t) = &r.step_times {
                println!(
                    "{:>5} {:>9} |              {:>9.3} {:>9.3} {:>10.3} {:>9.3} {:>9.3} | {:>8.3} {:>4}",
                    r.rank,
                    t.steps,
                    t.data_ms,
                    t.compute_ms,
                    t.collective_ms,
                    t.update_ms,
                    t.step_ms,
                    t.gc_ms,
                    t.gc_collections
                );
            }
        }
    }
}

fn print_slow(f: &[hatrain_shared::slowness::SlowFinding]) {
    if f.is_empty() {
        println!("no slow rank found");
    }
    for x in f {
        println!(
            "{} rank {} | {} | +{:.1} ms per step over the others ({:.0}% of a {:.1} ms step), +{:.1} ms over its own history | steps {}..{} | {}",
            if x.ended { "was slow:" } else { "SLOW:" },
            x.rank,
            x.phase,
            x.excess_ms,
            100.0 * x.excess_ms / x.step_ms.max(f64::MIN_POSITIVE),
            x.step_ms,
            x.over_own_history_ms,
            x.since_step,
            x.last_step,
            x.cause
        );
    }
}

fn print_device_faults(d: &[DeviceFaultRecord]) {
    for x in d {
        println!(
            "device fault | {} device {} | code {} | class {} | {} | ranks {:?} | {} | {}",
            x.source,
            x.device,
            x.code.map_or("-".into(), |c| format!("0x{c:08X}")),
            x.class.as_deref().unwrap_or("-"),
            x.action,
            x.ranks,
            x.why,
            x.text,
        );
    }
}

fn print_faults(f: &[FaultRecord]) {
    if f.is_empty() {
        println!("no faults");
        return;
    }
    for x in f {
        println!(
            "fault {} | rank(s) {:?} | {} ({}) | s* {} | {} | recovered in {} | steps lost {}",
            x.id,
            x.ranks,
            x.kind,
            x.detail,
            x.s_star.map_or("-".into(), |s| s.to_string()),
            x.action,
            x.recovery_s.map_or("-".into(), |s| format!("{:.3} s", s)),
            x.steps_lost.map_or("-".into(), |s| s.to_string()),
        );
    }
}
