//! The reference model's shape and the layout of its flat parameter buffer.
//!
//! Every parameter lives in one flat `f32` buffer, tensor after tensor, in the
//! order [`ModelConfig::layout`] gives. The optimizer state (AdamW's two
//! moments) has the same layout. Rank `r` of `W` owns the element range
//! [`shard_range`]`(numel, W, r)`: it alone keeps the moments for it and
//! updates those parameters. Checkpoints store each rank's range, so a
//! checkpoint written at one world size can be re-sliced at another.

#[cfg(doc)]
use hatrain_shared::shard::shard_range;

use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::str::FromStr;

/// Shape of the reference language model: token embedding, a context window
/// of `context` tokens projected to `d_model`, `layers` residual MLP blocks,
/// and a softmax over `vocab` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub vocab: usize,
    pub context: usize,
    pub d_embed: usize,
    pub d_model: usize,
    pub d_ff: usize,
    pub layers: usize,
}

/// One named tensor inside the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSlot {
    pub name: String,
    pub shape: Vec<usize>,
    pub offset: usize,
}

impl TensorSlot {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }
}

/// Named sizes, from a tiny test model to about 100M parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelSize {
    /// About 40K parameters: tests; a 50-step run takes seconds.
    Tiny,
    /// About 0.5M parameters: the demo's default.
    Small,
    /// About 10M parameters: benchmarks.
    M10,
    /// About 100M parameters: benchmarks.
    M100,
}

/// Why a model shape was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("unknown model size {0:?}; expected one of tiny, small, 10m, 100m")]
    UnknownSize(String),
    #[error("model dimension {0} must be at least 1")]
    ZeroDimension(&'static str),
    #[error("vocab {0} does not fit token ids")]
    VocabTooLarge(usize),
}

impl FromStr for ModelSize {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "tiny" => Ok(Self::Tiny),
            "small" => Ok(Self::Small),
            "10m" => Ok(Self::M10),
            "100m" => Ok(Self::M100),
            other => Err(ConfigError::UnknownSize(other.to_string())),
        }
    }
}

impl ModelSize {
    pub fn config(self) -> ModelConfig {
        let (vocab, context, d_embed, d_model, d_ff, layers) = match self {
            Self::Tiny => (64, 4, 16, 64, 128, 2),
            Self::Small => (256, 8, 32, 256, 512, 2),
            Self::M10 => (1024, 8, 64, 512, 2048, 4),
            Self::M100 => (4096, 8, 128, 1024, 4096, 11),
        };
        ModelConfig {
            vocab,
            context,
            d_embed,
            d_model,
            d_ff,
            layers,
        }
    }
}

impl ModelConfig {
    /// The tensors of the flat buffer, in order, with their offsets.
    pub fn layout(&self) -> Vec<TensorSlot> {
        let mut shapes: Vec<(String, Vec<usize>)> = vec![
            ("tok_emb".into(), vec![self.vocab, self.d_embed]),
            (
                "in_proj.weight".into(),
                vec![self.context * self.d_embed, self.d_model],
            ),
            ("in_proj.bias".into(), vec![self.d_model]),
        ];
        for l in 0..self.layers {
            shapes.push((format!("blocks.{l}.norm.weight"), vec![self.d_model]));
            shapes.push((
                format!("blocks.{l}.fc1.weight"),
                vec![self.d_model, self.d_ff],
            ));
            shapes.push((format!("blocks.{l}.fc1.bias"), vec![self.d_ff]));
            shapes.push((
                format!("blocks.{l}.fc2.weight"),
                vec![self.d_ff, self.d_model],
            ));
            shapes.push((format!("blocks.{l}.fc2.bias"), vec![self.d_model]));
        }
        shapes.push(("final_norm.weight".into(), vec![self.d_model]));
        shapes.push(("lm_head.weight".into(), vec![self.d_model, self.vocab]));
        shapes.push(("lm_head.bias".into(), vec![self.vocab]));

        let mut offset = 0;
        shapes
            .into_iter()
            .map(|(name, shape)| {
                let slot = TensorSlot {
                    name,
                    shape,
                    offset,
                };
                offset += slot.numel();
                slot
            })
            .collect()
    }

    /// Number of parameters (elements of the flat buffer).
    pub fn numel(&self) -> usize {
        self.layout().last().map_or(0, |t| t.offset + t.numel())
    }

    /// Checks that every dimension is usable.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let dims = [
            ("vocab", self.vocab),
            ("context", self.context),
            ("d_embed", self.d_embed),
            ("d_model", self.d_model),
            ("d_ff", self.d_ff),
        ];
        for (name, v) in dims {
            if v == 0 {
                return Err(ConfigError::ZeroDimension(name));
            }
        }
        if self.vocab > u32::MAX as usize {
            return Err(ConfigError::VocabTooLarge(self.vocab));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_contiguous_and_sizes_are_as_named() {
        for (size, lo, hi) in [
            (ModelSize::Tiny, 10_000, 100_000),
            (ModelSize::Small, 200_000, 1_000_000),
            (ModelSize::M10, 8_000_000, 12_000_000),
            (ModelSize::M100, 90_000_000, 110_000_000),
        ] {
            let cfg = size.config();
            let layout = cfg.layout();
            let mut next = 0;
            for t in &layout {
                assert_eq!(t.offset, next, "{}", t.name);
                next += t.numel();
            }
            assert_eq!(cfg.numel(), next);
            assert!((lo..hi).contains(&next), "{size:?} has {next} parameters");
        }
    }
}
