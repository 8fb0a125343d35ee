//! `hatrain-train`: the reference trainer (see `hatrain_trainer::trainer`).

use clap::Parser;
use hatrain_trainer::trainer::{self, TrainArgs};
use std::process::ExitCode;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = TrainArgs::parse();
    trainer::main(args)
}
