//! `hatrain-agent demo`: the project's main job on an embedded default.
//!
//! It trains the reference model (this same binary's `train` subcommand, so
//! one `cargo run` builds everything) on `--nproc` local ranks with periodic
//! checkpoints, twice, with worker reboot on:
//! 1. a fault-free run, for reference;
//! 2. the same run while `--kills` workers are killed with SIGKILL at steps,
//!    ranks and points (forward pass, inside the update fences, mid snapshot
//!    copy) drawn from `--fault-seed`.
//!
//! It ends with a summary: the loss against the data's entropy floor, every
//! fault with the step it was repaired from, its recovery time and the steps
//! lost, and whether the final weights of both runs are bit-identical.

use crate::cli::DemoArgs;
use crate::launch::{self, HaSettings, LaunchConfig};
use crate::supervisor::Outcome;
use anyhow::{Context, Result, bail};
use hatrain_shared::control::FaultRecord;
use hatrain_shared::ha::HaModes;
use hatrain_worker::data::SplitMix64;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const POINTS: [&str; 3] = ["forward", "update", "commit"];

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

struct RunResult {
    outcome: Outcome,
    faults: Vec<FaultRecord>,
    log: PathBuf,
    seconds: f64,
}

async fn train_once(
    args: &DemoArgs,
    name: &str,
    kills: &[Kill],
    shutdown: CancellationToken,
) -> Result<RunResult> {
    let exe = std::env::current_exe().context("cannot find the agent's own executable")?;
    let work = args.workdir.join(name);
    if work.exists() {
        std::fs::remove_dir_all(&work)
            .with_context(|| format!("cannot clear {}", work.display()))?;
    }
    std::fs::create_dir_all(&work).with_context(|| format!("cannot create {}", work.display()))?;
    let ckpt = work.join("checkpoints");
    let log = work.join("train.jsonl");
    let mut command: Vec<OsString> = vec![exe.into(), "train".into()];
    for (k, v) in [
        ("--model-size", args.model_size.clone()),
        ("--train-iters", args.steps.to_string()),
        ("--save-interval", args.save_interval.to_string()),
        ("--log-interval", "25".into()),
    ] {
        command.push(k.into());
        command.push(v.into());
    }
    command.extend(["--save".into(), ckpt.into_os_string()]);
    command.extend(["--log-jsonl".into(), log.clone().into_os_string()]);
    let plan: Vec<String> = kills.iter().map(Kill::entry).collect();
    // The fault plan reaches the workers through the environment the
    // launcher passes on.
    // SAFETY: the demo sets it before it starts any worker, from the only
    // thread that reads the environment (the agent is single-threaded).
    unsafe { std::env::set_var(hatrain_worker::runtime::ENV_FAULT_PLAN, plan.join(";")) };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cfg = LaunchConfig {
        nnodes: 1,
        node_rank: 0,
        nproc_per_node: args.nproc,
        master_addr: "127.0.0.1".into(),
        master_port: None,
        job_id: format!("demo-{name}-{}", std::process::id()),
        threads_per_worker: (cores / args.nproc.max(1)).max(1),
        stop_grace: Duration::from_secs(5),
        command,
        ha: HaSettings {
            modes: HaModes {
                dump: true,
                recover: true,
                retry: true,
                ..HaModes::default()
            },
            shm_root: args.shm_root.clone(),
            // A hang is declared after 10 median steps, at least 2 s.
            hang: crate::recovery::HangPolicy {
                floor: Duration::from_secs(2),
                startup_grace: Duration::from_secs(120),
                ..crate::recovery::HangPolicy::default()
            },
            ..HaSettings::default()
        },
    };
    let t = Instant::now();
    let report = launch::run(&cfg, shutdown).await?;
    Ok(RunResult {
        outcome: report.outcome,
        faults: report.faults,
        log,
        seconds: t.elapsed().as_secs_f64(),
    })
}

pub async fn run(args: &DemoArgs, shutdown: CancellationToken) -> Result<Outcome> {
    if args.nproc < 2 {
        bail!("the demo needs --nproc 2 or more (worker reboot needs a replica)");
    }
    let kills = schedule(
        args.fault_seed,
        args.kills.min(args.nproc),
        args.nproc,
        args.steps,
    );
    println!(
        "demo: training the {} model on {} local ranks for {} steps, twice, with worker reboot, \
         step repair and the hang watchdog on:\n  1. without faults, for reference\n  2. with {} faults:\n     {}",
        args.model_size,
        args.nproc,
        args.steps,
        kills.len(),
        kills
            .iter()
            .map(Kill::describe)
            .collect::<Vec<_>>()
            .join("\n     ")
    );
    println!("\n=== run 1: no faults ===");
    let reference = train_once(args, "reference", &[], shutdown.clone()).await?;
    if reference.outcome != Outcome::Succeeded {
        return Ok(reference.outcome);
    }
    println!("\n=== run 2: with faults ===");
    let faulty = train_once(args, "faulty", &kills, shutdown).await?;
    if faulty.outcome != Outcome::Succeeded {
        return Ok(faulty.outcome);
    }
    summarise(args, &kills, &reference, &faulty)?;
    Ok(Outcome::Succeeded)
}

fn read_events(log: &Path) -> Result<Vec<serde_json::Value>> {
    let text =
        std::fs::read_to_string(log).with_context(|| format!("cannot read {}", log.display()))?;
    text.lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .with_context(|| format!("{} is not JSON lines", log.display()))
}

fn summarise(
    args: &DemoArgs,
    kills: &[Kill],
    reference: &RunResult,
    faulty: &RunResult,
) -> Result<()> {
    let (a, b) = (read_events(&reference.log)?, read_events(&faulty.log)?);
    let last = |ev: &[serde_json::Value], kind: &str| {
        ev.iter().rev().find(|e| e["event"] == kind).cloned()
    };
    let (Some(start), Some(fin_a), Some(fin_b)) =
        (last(&a, "start"), last(&a, "final"), last(&b, "final"))
    else {
        bail!("the training logs are incomplete");
    };
    let floor = start["entropy_floor"].as_f64().unwrap_or(f64::NAN);
    let first = a
        .iter()
        .find(|e| e["event"] == "step")
        .and_then(|e| e["loss"].as_f64())
        .unwrap_or(f64::NAN);
    let final_loss = fin_a["loss"].as_f64().unwrap_or(f64::NAN);
    let (sum_a, sum_b) = (
        fin_a["param_xxh3"].as_str().unwrap_or("?"),
        fin_b["param_xxh3"].as_str().unwrap_or("?"),
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
        "wall time: {:.1} s without faults, {:.1} s with {} fault(s)",
        reference.seconds,
        faulty.seconds,
        faulty.faults.len()
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
        "faults planned {}, handled {}",
        kills.len(),
        faulty.faults.len()
    );
    let same = sum_a == sum_b;
    println!(
        "final weights: {sum_a} without faults, {sum_b} with faults: {}",
        if same { "bit-identical" } else { "DIFFERENT" }
    );
    println!("logs and checkpoints: {}", args.workdir.display());
    if !same {
        bail!("the run with faults ended with other weights than the run without");
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
