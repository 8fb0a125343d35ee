//! `hatrain-demo`: parses the command line and runs [`hatrain_demo::demo`].

use anyhow::{Context, Result};
use clap::Parser;
use hatrain_demo::demo::{self, DemoArgs};
use std::process::ExitCode;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Train the default model on 4 local ranks with periodic checkpoints: once
/// without faults; once with workers killed, a memory error and a hang, all
/// repaired, then SIGTERM and a last-words checkpoint; once resumed from it.
/// Compares the weights and draws the loss curves.
#[derive(Debug, Parser)]
#[command(name = "hatrain-demo", version)]
struct Cli {
    #[command(flatten)]
    args: DemoArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli.args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hatrain-demo: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &DemoArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(async {
        let shutdown = CancellationToken::new();
        let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
        let mut int = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
        let stop = shutdown.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            stop.cancel();
        });
        demo::run(args, shutdown).await
    })
}
