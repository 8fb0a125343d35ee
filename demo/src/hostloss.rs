//! The demo's host loss: three agents of two ranks each and one standby
//! agent on loopback (127.0.0.1–4), each host with its own shared-memory
//! root. Rank 2, on host 1, naps in step 30, so the job stands still while
//! host 2 catches up with host 1's replicas; then host 1's agent and workers
//! (the napping one too) are SIGKILLed together and its shared memory
//! deleted, as if the machine vanished. The
//! controller gives host 1's ranks to the standby, whose stores are filled
//! from the replicas on host 2, and the job ends. Its losses and weights are
//! compared with the same training on one host of six ranks.

use crate::demo::DemoArgs;
use crate::demo::{Bins, final_checksum, losses, query, read_events, shm_root};
use anyhow::{Context, Result, bail};
use hatrain_shared::control::{FaultKind, FaultRecord, Request, Response};
use hatrain_trainer::faults::ENV_FAULT_PLAN;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Hosts of ranks, and ranks per host.
const HOSTS: usize = 3;
const PER_HOST: usize = 2;
/// The host that vanishes, and the one holding its replicas.
const LOST: usize = 1;
const HOLDER: usize = 2;
const STEPS: u64 = 60;
/// The job stands still in step 30 (a nap shorter than the hang bound) on
/// a rank of the host that vanishes; its first process only, not the one
/// the standby starts.
const PLAN: &str = "2:30:forward:sleep8000";

/// How the host loss went.
#[derive(Debug)]
pub struct HostLossOutcome {
    /// The controller's record of the loss.
    pub fault: Option<FaultRecord>,
    /// Every step's loss and the final weights equal the one-host run.
    pub identical: bool,
    pub seconds: f64,
}

/// A free TCP port on loopback.
fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("no free port on loopback")?;
    Ok(l.local_addr()?.port())
}

/// A fresh job secret (mode 0600) in `dir`.
fn secret_file(dir: &Path) -> Result<PathBuf> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join("secret");
    let bytes: [u8; 32] = hatrain_shared::auth::random().context("no random bytes")?;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .and_then(|mut f| f.write_all(hex.as_bytes()))
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

fn train_args(args: &DemoArgs, log: &Path) -> Vec<String> {
    [
        "--model-size",
        &args.model_size,
        "--train-iters",
        &STEPS.to_string(),
        "--global-batch",
        "24",
        "--log-interval",
        "30",
        "--log-jsonl",
        &log.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// An agent process: its output to `out`, SIGTERMed if the demo dies.
fn agent(bins: &Bins, out: &Path) -> Result<tokio::process::Command> {
    let file =
        std::fs::File::create(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut c = tokio::process::Command::new(&bins.agent);
    c.stdout(Stdio::from(file.try_clone()?))
        .stderr(Stdio::from(file))
        .env("RUST_LOG", "info")
        .env_remove(hatrain_shared::ha::ENV)
        .kill_on_drop(true);
    // SAFETY: prctl(2) only, between fork and exec.
    unsafe {
        c.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)
                .map_err(std::io::Error::from)
        });
    }
    Ok(c)
}

/// SIGKILLs `pid` and its children at once.
fn vanish(pid: u32) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let mut pids = vec![pid as i32];
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                pids.extend(s.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
            }
        }
    }
    for p in pids {
        let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
    }
}

/// Runs the one-host reference and the host loss.
pub(crate) async fn run(
    args: &DemoArgs,
    bins: &Bins,
    shutdown: &CancellationToken,
) -> Result<HostLossOutcome> {
    let work = args.workdir.join("hostloss");
    if work.exists() {
        std::fs::remove_dir_all(&work)
            .with_context(|| format!("cannot clear {}", work.display()))?;
    }
    std::fs::create_dir_all(&work).with_context(|| format!("cannot create {}", work.display()))?;
    let work = work.canonicalize()?;
    let pid = std::process::id();

    println!(
        "demo: one host of {} ranks, {STEPS} steps, for reference",
        HOSTS * PER_HOST
    );
    let ref_log = work.join("reference.jsonl");
    let mut c = agent(bins, &work.join("reference.log"))?;
    c.args([
        "launch",
        "--nproc-per-node",
        &(HOSTS * PER_HOST).to_string(),
    ])
    .args(["--job-id", &format!("demo-hostloss-ref-{pid}")])
    .arg("--shm-root")
    .arg(shm_root(args))
    .arg("--")
    .arg(&bins.train)
    .args(train_args(args, &ref_log));
    let st = tokio::select! {
        st = c.status() => st.context("cannot run the reference")?,
        _ = shutdown.cancelled() => bail!("the demo was interrupted"),
    };
    if !st.success() {
        bail!(
            "the one-host reference failed ({st}); see {}",
            work.join("reference.log").display()
        );
    }

    let secret = secret_file(&work)?;
    let (master, rdzv) = (free_port()?, free_port()?);
    let roots = shm_root(args).join(format!("hatrain-demo-hostloss-{pid}"));
    std::fs::create_dir_all(&roots)
        .with_context(|| format!("cannot create {}", roots.display()))?;
    let job = format!("demo-hostloss-{pid}");
    let log = work.join("train.jsonl");
    let root = |k: usize| roots.join(format!("host{k}"));
    let mut agents = Vec::new();
    for k in 0..=HOSTS {
        let mut c = agent(bins, &work.join(format!("host{k}.log")))?;
        c.args(["launch", "--nnodes", &HOSTS.to_string()])
            .args(["--nproc-per-node", &PER_HOST.to_string()])
            .args(["--node-rank", &k.to_string(), "--job-id", &job])
            .args(["--master-addr", "127.0.0.1"])
            .args(["--master-port", &master.to_string()])
            .args(["--rdzv-port", &rdzv.to_string()])
            .args(["--local-addr", &format!("127.0.0.{}", k + 1)])
            .args(["--standby-nodes", "1", "--hang-timeout-secs", "20"])
            .args(["--enable-high-availability", "--enable-worker-reboot"])
            .arg("--secret-file")
            .arg(&secret)
            .arg("--shm-root")
            .arg(root(k));
        if k == HOSTS {
            c.arg("--standby");
        }
        c.arg("--")
            .arg(&bins.train)
            .args(train_args(args, &log))
            .env(ENV_FAULT_PLAN, PLAN);
        agents.push(Some(
            c.spawn().context("cannot start hatrain-agent launch")?,
        ));
    }
    println!(
        "demo: {HOSTS} agents of {PER_HOST} ranks each and a standby agent on 127.0.0.1-{}; waiting until host {HOLDER} holds the replicas of host {LOST}'s ranks",
        HOSTS + 1
    );
    let t = Instant::now();
    let socket = |k: usize| root(k).join(&job).join("agent.sock");
    let lost: Vec<u64> = (LOST * PER_HOST..(LOST + 1) * PER_HOST)
        .map(|r| r as u64)
        .collect();
    loop {
        if shutdown.is_cancelled() {
            bail!("the demo was interrupted");
        }
        if t.elapsed() > Duration::from_secs(300) {
            bail!(
                "host {HOLDER} never held the replicas of ranks {lost:?}; see {}",
                work.display()
            );
        }
        if let Some(Response::Status(s)) = query(&socket(HOLDER), Request::Status).await
            && let Some(r) = s.replicas
            && lost.iter().all(|&rank| {
                r.held
                    .iter()
                    .any(|h| h.rank == rank && h.steps.first().is_some_and(|&s| s >= 29))
            })
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "demo: host {LOST} vanishes: its agent and workers SIGKILLed, its shared memory deleted"
    );
    if let Some(mut a) = agents[LOST].take() {
        if let Some(p) = a.id() {
            vanish(p);
        }
        let _ = a.wait().await;
    }
    std::fs::remove_dir_all(root(LOST))
        .with_context(|| format!("cannot delete {}", root(LOST).display()))?;
    let mut fault = None;
    let mut codes = Vec::new();
    for (k, a) in agents.iter_mut().enumerate() {
        let Some(a) = a else { continue };
        let st = loop {
            tokio::select! {
                st = a.wait() => break st?,
                _ = shutdown.cancelled() => bail!("the demo was interrupted"),
                _ = tokio::time::sleep(Duration::from_millis(200)), if k == 0 => {
                    if let Some(Response::Status(s)) = query(&socket(0), Request::Status).await {
                        fault = s.faults.iter().find(|f| f.kind == FaultKind::HostLost).cloned().or(fault);
                    }
                }
            }
        };
        codes.push((k, st));
    }
    let _ = std::fs::remove_dir_all(&roots);
    if let Some((k, st)) = codes.iter().find(|(_, st)| !st.success()) {
        bail!(
            "host {k}'s agent failed ({st}); see {}",
            work.join(format!("host{k}.log")).display()
        );
    }
    let (a, b) = (read_events(&ref_log)?, read_events(&log)?);
    let identical = losses(&a) == losses(&b)
        && final_checksum(&a) == final_checksum(&b)
        && final_checksum(&a).is_some();
    Ok(HostLossOutcome {
        fault,
        identical,
        seconds: t.elapsed().as_secs_f64(),
    })
}
