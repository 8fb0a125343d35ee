//! The command line of `hatrain-train`.

use crate::config::{ModelConfig, ModelSize};
use crate::optim::AdamW;
use clap::Parser;
use std::path::PathBuf;

#[derive(Debug, Clone, Parser, serde::Serialize)]
#[command(
    name = "hatrain-train",
    about = "Reference trainer: a small language model on a synthetic token stream, \
             data-parallel with a ZeRO-1 sharded AdamW. Ranks come from RANK/WORLD_SIZE."
)]
pub struct TrainArgs {
    /// Named model size: tiny, small, 10m or 100m.
    #[arg(long, default_value = "small", value_parser = parse_size)]
    #[serde(skip)]
    pub model_size: ModelSize,
    /// Override: vocabulary size.
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Override: tokens of context the model sees.
    #[arg(long)]
    pub context: Option<usize>,
    /// Override: embedding width.
    #[arg(long)]
    pub d_embed: Option<usize>,
    /// Override: model width.
    #[arg(long)]
    pub d_model: Option<usize>,
    /// Override: hidden width of the MLP blocks.
    #[arg(long)]
    pub d_ff: Option<usize>,
    /// Override: number of MLP blocks.
    #[arg(long)]
    pub layers: Option<usize>,

    /// Train until this many steps are complete.
    #[arg(long, default_value_t = 200)]
    pub train_iters: u64,
    /// Sequences per step, over all ranks (must divide by the world size).
    #[arg(long, default_value_t = 32)]
    pub global_batch: usize,
    /// Predicted tokens per sequence.
    #[arg(long, default_value_t = 32)]
    pub seq_len: usize,
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f32,
    #[arg(long, default_value_t = 10)]
    pub warmup: u64,
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f32,
    #[arg(long, default_value_t = 0.9)]
    pub beta1: f32,
    #[arg(long, default_value_t = 0.95)]
    pub beta2: f32,
    #[arg(long, default_value_t = 1e-8)]
    pub eps: f32,
    /// Seed of the model initialisation, the data chain and the sampler.
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// Successors per state of the data's Markov chain.
    #[arg(long, default_value_t = 4)]
    pub branching: usize,

    /// Save checkpoints into this directory.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Save every N steps (and at the end) when --save is given.
    #[arg(long, default_value_t = 0)]
    pub save_interval: u64,
    /// Resume from the newest checkpoint in this directory.
    #[arg(long)]
    pub load: Option<PathBuf>,
    /// Load only the weights: start at step 0 with fresh optimizer and RNG.
    #[arg(long)]
    pub finetune: bool,
    /// Do not load the optimizer moments.
    #[arg(long)]
    pub no_load_optim: bool,
    /// Do not load the sampler RNG state.
    #[arg(long)]
    pub no_load_rng: bool,

    /// Append machine-readable JSON lines here (rank 0 only).
    #[arg(long)]
    pub log_jsonl: Option<PathBuf>,
    /// Print a progress line every N steps (rank 0 only).
    #[arg(long, default_value_t = 10)]
    pub log_interval: u64,
    /// Snapshot the state into shared memory every N steps (with an agent).
    #[arg(long, default_value_t = 1)]
    pub snapshot_interval: u64,
    /// What the update does with a snapshot copy still running when it
    /// begins: `wait` for it, or `skip` it (training does not wait; after
    /// N skips in a row, default 4, the next copy is waited for): `wait`,
    /// `skip` or `skip:N`.
    #[arg(long, default_value = "wait")]
    #[serde(serialize_with = "as_text")]
    pub snapshot_window: hatrain_worker::runtime::Window,
    /// Compute threads per rank (sets RAYON_NUM_THREADS; default: the
    /// environment's value, else all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Emulate an accelerator: each step's forward and backward become MS
    /// milliseconds of device time (a wait that holds no host core), with
    /// seeded gradients; the optimizer update, the state and everything
    /// hatrain does with it are as with the model (see `emulate`).
    #[arg(long, value_name = "MS", value_parser = crate::emulate::parse_ms)]
    pub emulate_device: Option<f64>,
}

fn parse_size(s: &str) -> Result<ModelSize, crate::config::ConfigError> {
    s.parse()
}

impl TrainArgs {
    pub fn model_config(&self) -> ModelConfig {
        let mut c = self.model_size.config();
        let over = |slot: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *slot = v;
            }
        };
        over(&mut c.vocab, self.vocab);
        over(&mut c.context, self.context);
        over(&mut c.d_embed, self.d_embed);
        over(&mut c.d_model, self.d_model);
        over(&mut c.d_ff, self.d_ff);
        over(&mut c.layers, self.layers);
        c
    }

    pub(super) fn optimizer(&self) -> AdamW {
        AdamW {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            warmup: self.warmup,
        }
    }
}

/// Serializes a flag's value as the text it was given in.
fn as_text<T: std::fmt::Display, S: serde::Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}
