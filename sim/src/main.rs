//! `hatrain-sim`: see the library's documentation.

use clap::Parser;
use hatrain_sim::cli::{Cli, execute};
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match execute(cli, &mut std::io::stdout().lock()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hatrain-sim: error: {e:#}");
            ExitCode::from(2)
        }
    }
}
