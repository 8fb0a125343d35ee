//! `hatrain-demo`: the project's main job on an embedded default.
//!
//! It trains the reference model (`hatrain-train`) on `--nproc` local ranks,
//! each run a real `hatrain-agent launch` process with dump, retry and
//! recover on and the agent writing the periodic checkpoints from shared
//! memory:
//! 1. a fault-free run, for reference;
//! 2. the same run while `--kills` workers are killed with SIGKILL (at
//!    steps, ranks and points drawn from `--fault-seed`: the forward pass,
//!    inside the update fences, mid snapshot copy), a rank's AdamW moments
//!    take an uncorrectable memory error and a rank hangs; near the end the
//!    agent gets SIGTERM and writes its last-words checkpoint;
//! 3. a resume from that checkpoint with `--load`, to the end.
//!
//! It ends with a summary (the loss against the data's entropy floor, every
//! fault with its action, the step it was repaired from, its recovery time
//! and the steps lost; the last-words checkpoint; whether the resumed run
//! ended with weights bit-identical to the fault-free one) and a PNG of the
//! loss curves with the faults marked.

use anyhow::{Context, Result, bail};
use clap::Args;
use hatrain_shared::control::{FaultRecord, Request, Response};
use hatrain_trainer::data::SplitMix64;
use hatrain_trainer::faults::ENV_FAULT_PLAN;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const POINTS: [&str; 3] = ["forward", "update", "commit"];

/// What the demo trains, and the faults it injects.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Workers (ranks) to train with.
    #[arg(long, default_value_t = 4)]
    pub nproc: usize,
    /// Training steps.
    #[arg(long, default_value_t = 200)]
    pub steps: u64,
    /// Save a checkpoint every N steps.
    #[arg(long, default_value_t = 50)]
    pub save_interval: u64,
    /// Model size: tiny, small, 10m or 100m.
    #[arg(long, default_value = "small")]
    pub model_size: String,
    /// Directory for the demo's checkpoints and log (replaced on each run).
    #[arg(long, default_value = "hatrain-demo")]
    pub workdir: PathBuf,
    /// Workers to kill (SIGKILL) during the run, at steps and ranks drawn
    /// from --fault-seed.
    #[arg(long, default_value_t = 3)]
    pub kills: usize,
    #[arg(long, default_value_t = 7)]
    pub fault_seed: u64,
    /// Root directory of the shared-memory snapshot stores (default: the
    /// agent's).
    #[arg(long)]
    pub shm_root: Option<PathBuf>,
}

/// One planned fault: a kill (SIGKILL) at a point, or a UCE or hang.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Kill {
    rank: usize,
    step: u64,
    point: &'static str,
    /// Which process of the rank it hits (earlier faults restart it).
    inc: u64,
}

impl Kill {
    /// The fault-plan entry: `uce` and `hang` points are faults of their own.
    fn entry(&self) -> String {
        match self.point {
            "uce" => format!(
                "{}:{}:forward:uce-exp_avg-4096:{}",
                self.rank, self.step, self.inc
            ),
            "hang" => format!("{}:{}:forward:hang:{}", self.rank, self.step, self.inc),
            p => format!("{}:{}:{p}:kill:{}", self.rank, self.step, self.inc),
        }
    }

    fn describe(&self) -> String {
        match self.point {
            "uce" => format!(
                "rank {}: memory error (UCE) in its AdamW moments at step {}",
                self.rank, self.step
            ),
            "hang" => format!("rank {}: hangs in step {}", self.rank, self.step),
            p => format!("rank {}: SIGKILL at step {} ({p})", self.rank, self.step),
        }
    }
}

/// The demo's faults: `n` kills drawn by [`plan`], then a UCE and a hang
/// in the last part of the run.
fn schedule(seed: u64, n: usize, nproc: usize, steps: u64) -> Vec<Kill> {
    let mut v = plan(seed, n, nproc, steps * 2 / 3);
    let mut rng = SplitMix64::new(seed ^ 0x0FA1);
    for (i, point) in ["uce", "hang"].into_iter().enumerate() {
        let rank = rng.below(nproc);
        // Every earlier kill or hang of this rank started a new process.
        let inc = v
            .iter()
            .filter(|k| k.rank == rank && k.point != "uce")
            .count() as u64;
        v.push(Kill {
            rank,
            step: steps * 2 / 3 + 5 + i as u64 * (steps / 8).max(3),
            point,
            inc,
        });
    }
    v
}

/// Draws `n` kills spread over the run (at least 10 steps apart, none in
/// the first or last 5 steps), each in the first process of its rank.
fn plan(seed: u64, n: usize, nproc: usize, steps: u64) -> Vec<Kill> {
    let mut rng = SplitMix64::new(seed);
    let span = steps.saturating_sub(10).max(1);
    let gap = span / (n as u64 + 1);
    let mut used = vec![false; nproc];
    (0..n)
        .filter_map(|i| {
            let free: Vec<usize> = (0..nproc).filter(|r| !used[*r]).collect();
            let rank = *free.get(rng.below(free.len().max(1)))?;
            used[rank] = true;
            let jitter = if gap > 2 {
                rng.below(gap as usize / 2) as u64
            } else {
                0
            };
            Some(Kill {
                rank,
                step: 5 + gap * (i as u64 + 1) + jitter,
                point: POINTS[rng.below(POINTS.len())],
                inc: 0,
            })
        })
        .collect()
}

/// A finished run: how its agent exited, the faults it handled, its log.
struct RunResult {
    code: Option<i32>,
    faults: Vec<FaultRecord>,
    log: PathBuf,
    ckpt: PathBuf,
    seconds: f64,
}

/// What a run does besides training to the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Script {
    /// Train to the end.
    Plain,
    /// Send the agent SIGTERM once `stop_at` is reached and every one of
    /// `faults` faults is recovered.
    SigtermAt { stop_at: u64, faults: usize },
    /// `--load` the checkpoint directory of the run named here.
    ResumeFrom(&'static str),
}

pub(crate) fn shm_root(args: &DemoArgs) -> PathBuf {
    args.shm_root
        .clone()
        .unwrap_or_else(hatrain_shared::trust::default_shm_root)
}

/// The binaries a run starts.
#[derive(Debug, Clone)]
pub(crate) struct Bins {
    pub agent: PathBuf,
    pub train: PathBuf,
}

fn launch_command(
    args: &DemoArgs,
    bins: &Bins,
    job: &str,
    work: &Path,
    ckpt: &Path,
    log: &Path,
) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(&bins.agent);
    c.args(["launch", "--nproc-per-node", &args.nproc.to_string()])
        .args(["--job-id", job])
        .arg("--shm-root")
        .arg(shm_root(args))
        .args([
            "--enable-high-availability",
            "--enable-hbmfault-repair",
            "--enable-worker-reboot",
        ])
        // A hang is declared after 10 median steps, at least 2 s.
        .args(["--hang-floor-secs", "2", "--hang-startup-grace-secs", "120"])
        // A slot held for the periodic save never costs a snapshot.
        .args(["--snapshot-slots", "3"])
        .arg("--")
        .arg(&bins.train)
        .args(["--model-size", &args.model_size])
        .args(["--train-iters", &args.steps.to_string()])
        .args(["--save-interval", &args.save_interval.to_string()])
        .args(["--log-interval", "25"])
        .arg("--save")
        .arg(ckpt)
        .arg("--log-jsonl")
        .arg(log)
        .current_dir(work)
        .env_remove(hatrain_shared::ha::ENV)
        .env_remove(ENV_FAULT_PLAN)
        .kill_on_drop(true);
    // SAFETY: prctl(2) only, between fork and exec: the agent of a run
    // gets SIGTERM (and so stops its workers) if the demo dies.
    unsafe {
        c.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)
                .map_err(std::io::Error::from)
        });
    }
    c
}

async fn train_once(
    args: &DemoArgs,
    bins: &Bins,
    name: &str,
    kills: &[Kill],
    script: Script,
    shutdown: &CancellationToken,
) -> Result<RunResult> {
    let work = args.workdir.join(name);
    if work.exists() {
        std::fs::remove_dir_all(&work)
            .with_context(|| format!("cannot clear {}", work.display()))?;
    }
    std::fs::create_dir_all(&work).with_context(|| format!("cannot create {}", work.display()))?;
    let work = work
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", work.display()))?;
    let log = work.join("train.jsonl");
    let ckpt = work.join("checkpoints");
    let job = format!("demo-{name}-{}", std::process::id());
    let mut cmd = launch_command(args, bins, &job, &work, &ckpt, &log);
    if let Script::ResumeFrom(from) = script {
        cmd.arg("--load")
            .arg(work.with_file_name(from).join("checkpoints"));
    }
    let mut plan: Vec<String> = kills.iter().map(Kill::entry).collect();
    if let Script::SigtermAt { stop_at, .. } = script {
        // Rank 0 pauses 1 s (under the 2 s hang bound) in the step after
        // `stop_at`: a fast model would otherwise finish before the demo
        // sees `stop_at` and signals.
        plan.push(format!("0:{}:forward:sleep1000:*", stop_at + 1));
    }
    if !plan.is_empty() {
        cmd.env(ENV_FAULT_PLAN, plan.join(";"));
    }
    let t = Instant::now();
    let mut child = cmd.spawn().context("cannot start hatrain-agent launch")?;
    let pid = child.id().context("the agent exited at once")?;
    let socket = shm_root(args).join(&job).join("agent.sock");
    let mut faults = Vec::new();
    let mut signalled = false;
    let status = loop {
        tokio::select! {
            st = child.wait() => break st.context("cannot wait for the agent")?,
            _ = shutdown.cancelled(), if !signalled => {
                signalled = true;
                signal_agent(pid);
            }
            _ = tokio::time::sleep(Duration::from_millis(100)), if !signalled => {
                let status = query(&socket, Request::Status).await;
                if let Some(Response::Status(s)) = status {
                    faults = s.faults.clone();
                    if let Script::SigtermAt { stop_at, faults: n } = script {
                        let step = s.workers.iter().map(|w| w.step).min().unwrap_or(0);
                        let recovered = s.faults.len() >= n
                            && s.faults.iter().all(|f| f.recovery_s.is_some());
                        if step >= stop_at && recovered && !s.recovering {
                            println!(
                                "demo: every rank is past step {stop_at} and every fault is recovered: sending the agent (pid {pid}) SIGTERM"
                            );
                            signalled = true;
                            signal_agent(pid);
                        }
                    }
                }
            }
        }
    };
    if shutdown.is_cancelled() {
        bail!("the demo was interrupted");
    }
    Ok(RunResult {
        code: status.code(),
        faults,
        log,
        ckpt,
        seconds: t.elapsed().as_secs_f64(),
    })
}

fn signal_agent(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
}

/// One request to a run's agent (none while its socket is not up yet).
pub(crate) async fn query(socket: &Path, request: Request) -> Option<Response> {
    let socket = socket.to_path_buf();
    tokio::task::spawn_blocking(move || {
        hatrain_shared::control::request(&socket, &request, Duration::from_secs(5)).ok()
    })
    .await
    .ok()
    .flatten()
}

/// Runs the demo's three trainings and prints the summary.
pub async fn run(args: &DemoArgs, shutdown: CancellationToken) -> Result<()> {
    if args.nproc < 2 {
        bail!("the demo needs --nproc 2 or more (worker reboot needs a replica)");
    }
    let bins = Bins {
        agent: crate::bins::locate("hatrain-agent")?,
        train: crate::bins::locate("hatrain-train")?,
    };
    let kills = schedule(
        args.fault_seed,
        args.kills.min(args.nproc),
        args.nproc,
        args.steps,
    );
    let last_fault = kills.iter().map(|k| k.step).max().unwrap_or(0);
    let stop_at = (args.steps * 9 / 10).max(last_fault + 3);
    if stop_at + 2 > args.steps {
        bail!(
            "--steps {} leaves no room for the SIGTERM after the last fault (step {last_fault}); use at least {}",
            args.steps,
            last_fault + 5
        );
    }
    println!(
        "demo: training the {} model on {} local ranks for {} steps, with worker reboot, \
         step repair, the hang watchdog and the last-words dump on, checkpoints every {} steps \
         written by the agent:\n  1. without faults, for reference\n  2. with {} faults:\n     {}\n     \
         and SIGTERM to the agent after step {stop_at} (rank 0 pauses 1 s in step {} so that the job still runs when it lands): a last-words checkpoint\n  3. resumed from that checkpoint to the end",
        args.model_size,
        args.nproc,
        args.steps,
        args.save_interval,
        kills.len(),
        kills
            .iter()
            .map(Kill::describe)
            .collect::<Vec<_>>()
            .join("\n     "),
        stop_at + 1
    );
    println!("\n=== run 1: no faults ===");
    let reference = train_once(args, &bins, "reference", &[], Script::Plain, &shutdown).await?;
    if reference.code != Some(0) {
        bail!(
            "the fault-free run failed (agent exit {:?})",
            reference.code
        );
    }
    println!("\n=== run 2: with faults, then SIGTERM ===");
    let script = Script::SigtermAt {
        stop_at,
        faults: kills.len(),
    };
    let faulty = train_once(args, &bins, "faulty", &kills, script, &shutdown).await?;
    let sigterm = 128 + nix::sys::signal::Signal::SIGTERM as i32;
    if faulty.code != Some(sigterm) {
        bail!(
            "the run with faults ended with agent exit {:?}, not {sigterm} after SIGTERM",
            faulty.code
        );
    }
    let last_words = hatrain_shared::checkpoint::read_tracker(&faulty.ckpt)
        .context("the last-words checkpoint is not there")?;
    println!("\n=== run 3: resumed from the last-words checkpoint of iteration {last_words} ===");
    let resumed = train_once(
        args,
        &bins,
        "resumed",
        &[],
        Script::ResumeFrom("faulty"),
        &shutdown,
    )
    .await?;
    if resumed.code != Some(0) {
        bail!("the resumed run failed (agent exit {:?})", resumed.code);
    }
    summarise(args, &kills, &reference, &faulty, &resumed, last_words)?;
    println!("\n=== a host lost: three hosts of two ranks and a standby ===");
    let lost = crate::hostloss::run(args, &bins, &shutdown).await?;
    match &lost.fault {
        Some(f) => println!(
            "host loss: ranks {:?}: {}; recovered from step {} in {} ({} step(s) computed again)",
            f.ranks,
            f.action,
            f.s_star.map_or("?".into(), |s| s.to_string()),
            f.recovery_s.map_or("?".into(), |s| format!("{s:.2} s")),
            f.steps_lost.map_or("?".into(), |s| s.to_string()),
        ),
        None => println!("host loss: the controller recorded no host loss"),
    }
    println!(
        "host loss: every step's loss and the final weights equal to one host of six ranks: {} ({:.1} s)",
        if lost.identical { "yes" } else { "NO" },
        lost.seconds
    );
    if !lost.identical || lost.fault.is_none() {
        bail!("the job that lost a host did not end as the one-host run did");
    }
    Ok(())
}

pub(crate) fn read_events(log: &Path) -> Result<Vec<serde_json::Value>> {
    let text =
        std::fs::read_to_string(log).with_context(|| format!("cannot read {}", log.display()))?;
    text.lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .with_context(|| format!("{} is not JSON lines", log.display()))
}

/// The checksum of the final weights, from a run's log.
pub(crate) fn final_checksum(ev: &[serde_json::Value]) -> Option<String> {
    ev.iter()
        .rev()
        .find(|e| e["event"] == "final")
        .and_then(|e| e["param_xxh3"].as_str())
        .map(String::from)
}

/// The last logged loss of every step (a step redone is logged again).
pub(crate) fn losses(ev: &[serde_json::Value]) -> Vec<(u64, f64)> {
    let m: std::collections::BTreeMap<u64, f64> = ev
        .iter()
        .filter(|e| e["event"] == "step")
        .filter_map(|e| Some((e["step"].as_u64()?, e["loss"].as_f64()?)))
        .collect();
    m.into_iter().collect()
}

fn summarise(
    args: &DemoArgs,
    kills: &[Kill],
    reference: &RunResult,
    faulty: &RunResult,
    resumed: &RunResult,
    last_words: u64,
) -> Result<()> {
    let (a, b, c) = (
        read_events(&reference.log)?,
        read_events(&faulty.log)?,
        read_events(&resumed.log)?,
    );
    let last = |ev: &[serde_json::Value], kind: &str| {
        ev.iter().rev().find(|e| e["event"] == kind).cloned()
    };
    let (Some(start), Some(fin_a), Some(fin_c), Some(start_c)) = (
        last(&a, "start"),
        last(&a, "final"),
        last(&c, "final"),
        last(&c, "start"),
    ) else {
        bail!("the training logs are incomplete");
    };
    let floor = start["entropy_floor"].as_f64().unwrap_or(f64::NAN);
    let (la, lb, lc) = (losses(&a), losses(&b), losses(&c));
    let first = la.first().map_or(f64::NAN, |p| p.1);
    let final_loss = fin_a["loss"].as_f64().unwrap_or(f64::NAN);
    let (sum_a, sum_c) = (
        fin_a["param_xxh3"].as_str().unwrap_or("?"),
        fin_c["param_xxh3"].as_str().unwrap_or("?"),
    );
    println!("\n=== demo summary ===");
    println!(
        "model: {} parameters on {} ranks, {} steps; loss {first:.4} -> {final_loss:.4}, entropy floor {floor:.4} \
         ({:.0}% of the way to the floor)",
        start["params"],
        args.nproc,
        args.steps,
        100.0 * (first - final_loss) / (first - floor)
    );
    println!(
        "wall time: {:.1} s without faults; {:.1} s with {} fault(s) up to the SIGTERM, then {:.1} s resumed",
        reference.seconds,
        faulty.seconds,
        faulty.faults.len(),
        resumed.seconds
    );
    println!(
        "{:>5} {:>6} {:>6} {:>4} {:>10} {:>6}  action",
        "fault", "rank", "kind", "s*", "recovery", "lost"
    );
    for f in &faulty.faults {
        println!(
            "{:>5} {:>6} {:>6} {:>4} {:>10} {:>6}  {}",
            f.id,
            format!("{:?}", f.ranks),
            f.kind,
            f.s_star.map_or("-".into(), |s| s.to_string()),
            f.recovery_s.map_or("-".into(), |s| format!("{:.3} s", s)),
            f.steps_lost.map_or("-".into(), |s| s.to_string()),
            f.action,
        );
    }
    println!(
        "{:>5} {:>6} {:>6} {:>4} {:>10} {:>6}  last-words checkpoint of iteration {last_words}, then the job stopped (agent exit {})",
        "-",
        "all",
        "SIGTERM",
        last_words,
        "-",
        "-",
        faulty.code.map_or("?".into(), |c| c.to_string()),
    );
    println!(
        "faults planned {}, handled {}",
        kills.len(),
        faulty.faults.len()
    );
    let resumed_from = start_c["resumed_from"].as_u64();
    // The resumed run logs each step once; each must equal the reference.
    let want: std::collections::BTreeMap<u64, f64> = la.iter().copied().collect();
    let same_losses = lc
        .iter()
        .all(|(s, l)| want.get(s).is_some_and(|w| w.to_bits() == l.to_bits()));
    let same = sum_a == sum_c && resumed_from == Some(last_words) && same_losses;
    println!(
        "resumed from iteration {}: final weights {sum_c}, without faults {sum_a}: {}",
        resumed_from.map_or("?".into(), |s| s.to_string()),
        if same { "bit-identical" } else { "DIFFERENT" }
    );
    let png = args.workdir.join("loss.png");
    // A fault is marked at the step it hit: the step the run was at when
    // it was detected (s* + 1 for the step that was being computed).
    let mut marks: Vec<crate::plot::Mark> = faulty
        .faults
        .iter()
        .map(|f| crate::plot::Mark {
            step: f.s_star.map_or(0, |s| s + 1),
            label: format!("{} rank {:?}", f.kind, f.ranks),
        })
        .collect();
    marks.push(crate::plot::Mark {
        step: last_words,
        label: format!("SIGTERM: last words @ {last_words}"),
    });
    let series = [
        crate::plot::Series {
            label: "without faults".into(),
            points: la,
        },
        crate::plot::Series {
            label: "with faults, to the SIGTERM".into(),
            points: lb,
        },
        crate::plot::Series {
            label: format!("resumed from iteration {last_words}"),
            points: lc,
        },
    ];
    crate::plot::loss_curve(
        &png,
        &format!(
            "hatrain demo: {} model, {} ranks, {} faults and a SIGTERM",
            args.model_size,
            args.nproc,
            faulty.faults.len()
        ),
        &series,
        floor,
        &marks,
    )?;
    println!("loss curve: {}", png.display());
    println!("logs and checkpoints: {}", args.workdir.display());
    if !same {
        bail!("the resumed run ended with other weights or losses than the run without faults");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kills_are_spread_and_distinct() {
        let k = plan(7, 3, 4, 200);
        assert_eq!(k.len(), 3);
        let mut ranks: Vec<usize> = k.iter().map(|k| k.rank).collect();
        ranks.sort();
        ranks.dedup();
        assert_eq!(ranks.len(), 3);
        assert!(k.windows(2).all(|w| w[1].step >= w[0].step + 10), "{k:?}");
        assert!(k.iter().all(|k| (5..195).contains(&k.step)), "{k:?}");
        assert_eq!(plan(7, 3, 4, 200), k, "deterministic");
    }
}
