//! `hatrain-agent demo`: the project's main job on an embedded default.
//!
//! It launches the reference trainer (this same binary, `train` subcommand,
//! so one `cargo run` builds everything) on `--nproc` local ranks with
//! periodic checkpoints, then summarises the run from the trainer's JSON log.

use crate::cli::DemoArgs;
use crate::launch::{self, LaunchConfig};
use crate::supervisor::Outcome;
use anyhow::{Context, Result, bail};
use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

pub async fn run(args: &DemoArgs, shutdown: CancellationToken) -> Result<Outcome> {
    let exe = std::env::current_exe().context("cannot find the agent's own executable")?;
    let work = &args.workdir;
    let ckpt = work.join("checkpoints");
    let log = work.join("train.jsonl");
    if ckpt.exists() {
        std::fs::remove_dir_all(&ckpt)
            .with_context(|| format!("cannot clear {}", ckpt.display()))?;
    }
    std::fs::create_dir_all(work).with_context(|| format!("cannot create {}", work.display()))?;
    let _ = std::fs::remove_file(&log);

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
    command.extend(["--save".into(), ckpt.clone().into_os_string()]);
    command.extend(["--log-jsonl".into(), log.clone().into_os_string()]);

    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cfg = LaunchConfig {
        nnodes: 1,
        node_rank: 0,
        nproc_per_node: args.nproc,
        master_addr: "127.0.0.1".into(),
        master_port: None,
        job_id: "demo".into(),
        threads_per_worker: (cores / args.nproc.max(1)).max(1),
        stop_grace: Duration::from_secs(5),
        command,
        ha: crate::launch::HaSettings::default(),
    };
    println!(
        "demo: training the {} model on {} local ranks for {} steps, checkpoint every {} steps into {}",
        args.model_size,
        args.nproc,
        args.steps,
        args.save_interval,
        ckpt.display()
    );
    let outcome = launch::run(&cfg, shutdown).await?.outcome;
    if outcome == Outcome::Succeeded {
        summarise(&log, &ckpt, args)?;
    }
    Ok(outcome)
}

fn summarise(log: &Path, ckpt: &Path, args: &DemoArgs) -> Result<()> {
    let text =
        std::fs::read_to_string(log).with_context(|| format!("cannot read {}", log.display()))?;
    let events: Vec<serde_json::Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .with_context(|| format!("{} is not JSON lines", log.display()))?;
    let of = |kind: &'static str| events.iter().filter(move |e| e["event"] == kind);
    let Some(start) = of("start").next() else {
        bail!("{} has no start event", log.display())
    };
    let Some(fin) = of("final").next_back() else {
        bail!("{} has no final event", log.display())
    };
    let floor = start["entropy_floor"].as_f64().unwrap_or(f64::NAN);
    let first = of("step")
        .next()
        .and_then(|e| e["loss"].as_f64())
        .unwrap_or(f64::NAN);
    let last = fin["loss"].as_f64().unwrap_or(f64::NAN);
    let saved: Vec<String> = of("checkpoint").map(|e| e["step"].to_string()).collect();
    let tracker = hatrain_shared::checkpoint::read_tracker(ckpt)?;
    println!();
    println!("demo summary");
    println!(
        "  ranks {}, parameters {}, steps {}",
        args.nproc, start["params"], fin["step"]
    );
    println!(
        "  loss {first:.4} -> {last:.4}, floor {floor:.4}: {:.0}% of the way to the entropy floor",
        100.0 * (first - last) / (first - floor)
    );
    println!(
        "  checkpoints at steps {} (tracker: {tracker})",
        saved.join(", ")
    );
    println!(
        "  final parameters xxh3 {}",
        fin["param_xxh3"].as_str().unwrap_or("?")
    );
    println!("  log: {}", log.display());
    Ok(())
}
