//! The reference language model, computed with candle over the flat
//! parameter buffer.
//!
//! ```text
//! ids[N, C] ─ tok_emb ─► [N, C·E] ─ in_proj ─► x[N, D]
//! x ← x + fc2(gelu(fc1(rmsnorm(x) · norm)))        (× layers)
//! logits[N, V] = lm_head(rmsnorm(x) · final_norm)
//! loss = mean over N of −log softmax(logits)[target]
//! ```
//!
//! Parameters live in the flat buffer in the order of
//! [`ModelConfig::layout`]; [`Model::loss_and_grad`] views them as candle
//! variables for one step and writes the gradients back into a flat buffer of
//! the same layout, which is what the collectives and the sharded optimizer
//! work on.

use crate::config::{ModelConfig, TensorSlot};
use crate::data::SplitMix64;
use crate::stop::Stop;
use candle_core::{D, DType, Device, Tensor, Var};

const RMS_EPS: f64 = 1e-5;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model computation failed")]
    Candle(#[from] candle_core::Error),
    #[error(
        "batch of {inputs} context tokens does not match {targets} targets × context {context}"
    )]
    BatchShape {
        inputs: usize,
        targets: usize,
        context: usize,
    },
    #[error("the job was paused: the forward and backward stopped")]
    Stopped,
}

#[derive(Debug, Clone)]
pub struct Model {
    cfg: ModelConfig,
    layout: Vec<TensorSlot>,
    numel: usize,
}

impl Model {
    pub fn new(cfg: ModelConfig) -> Self {
        let layout = cfg.layout();
        let numel = cfg.numel();
        Self { cfg, layout, numel }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Deterministic initial parameters: weights `N(0, 1/fan_in)`, residual
    /// output projections scaled down by `sqrt(2·layers)`, biases zero, norm
    /// gains one.
    pub fn init(&self, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        let mut flat = vec![0f32; self.numel];
        let residual_scale = 1.0 / ((2 * self.cfg.layers.max(1)) as f64).sqrt();
        for t in &self.layout {
            let dst = &mut flat[t.range()];
            if t.name.ends_with("bias") {
                continue;
            }
            if t.name.ends_with("norm.weight") {
                dst.fill(1.0);
                continue;
            }
            let std = if t.name == "tok_emb" {
                1.0
            } else {
                let s = 1.0 / (t.shape[0] as f64).sqrt();
                if t.name.ends_with("fc2.weight") {
                    s * residual_scale
                } else {
                    s
                }
            };
            for x in dst.iter_mut() {
                *x = (rng.normal() * std) as f32;
            }
        }
        flat
    }

    /// Mean cross-entropy of predicting `targets[i]` from the `context` ids
    /// `inputs[i·C .. (i+1)·C]`; the gradient of that mean goes to `grads`
    /// (same layout as `params`). Between layers, and before and after the
    /// backward pass, it stops with [`ModelError::Stopped`] once `stop` is
    /// set (candle's backward pass runs whole).
    pub fn loss_and_grad(
        &self,
        params: &[f32],
        inputs: &[u32],
        targets: &[u32],
        grads: &mut [f32],
        stop: &Stop,
    ) -> Result<f32, ModelError> {
        let stopped = || match stop.is_set() {
            true => Err(ModelError::Stopped),
            false => Ok(()),
        };
        let (n, c) = (targets.len(), self.cfg.context);
        if inputs.len() != n * c {
            return Err(ModelError::BatchShape {
                inputs: inputs.len(),
                targets: n,
                context: c,
            });
        }
        let dev = Device::Cpu;
        let vars = self
            .layout
            .iter()
            .map(|t| Var::from_slice(&params[t.range()], t.shape.as_slice(), &dev))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let p = |i: usize| vars[i].as_tensor();

        let ids = Tensor::from_slice(inputs, n * c, &dev)?;
        let tgt = Tensor::from_slice(targets, (n, 1), &dev)?;
        let emb = p(0).embedding(&ids)?.reshape((n, c * self.cfg.d_embed))?;
        let mut x = emb.matmul(p(1))?.broadcast_add(p(2))?;
        for l in 0..self.cfg.layers {
            stopped()?;
            let b = 3 + 5 * l;
            let h = rms_norm(&x, p(b))?;
            let h = h.matmul(p(b + 1))?.broadcast_add(p(b + 2))?.gelu()?;
            let h = h.matmul(p(b + 3))?.broadcast_add(p(b + 4))?;
            x = (x + h)?;
        }
        let b = 3 + 5 * self.cfg.layers;
        let x = rms_norm(&x, p(b))?;
        let logits = x.matmul(p(b + 1))?.broadcast_add(p(b + 2))?;
        // log-sum-exp with the row maximum held constant: the gradient does
        // not depend on it, and it keeps exp() in range.
        let max = logits.max_keepdim(D::Minus1)?.detach();
        let lse = (logits
            .broadcast_sub(&max)?
            .exp()?
            .sum_keepdim(D::Minus1)?
            .log()?
            + max)?;
        let picked = logits.gather(&tgt, D::Minus1)?;
        let loss = (lse - picked)?.mean_all()?;

        stopped()?;
        let store = loss.backward()?;
        stopped()?;
        for (t, v) in self.layout.iter().zip(&vars) {
            let dst = &mut grads[t.range()];
            match store.get(v.as_tensor()) {
                Some(g) => {
                    let g = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    dst.copy_from_slice(&g);
                }
                None => dst.fill(0.0),
            }
        }
        Ok(loss.to_scalar::<f32>()?)
    }
}

fn rms_norm(x: &Tensor, gain: &Tensor) -> candle_core::Result<Tensor> {
    let inv = (x.sqr()?.mean_keepdim(D::Minus1)? + RMS_EPS)?
        .sqrt()?
        .recip()?;
    x.broadcast_mul(&inv)?.broadcast_mul(gain)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelSize;

    #[test]
    fn gradient_matches_finite_differences() {
        let mut cfg = ModelSize::Tiny.config();
        cfg.vocab = 12;
        cfg.d_model = 8;
        cfg.d_ff = 8;
        cfg.d_embed = 4;
        let m = Model::new(cfg);
        let params = m.init(5);
        let inputs: Vec<u32> = (0..6 * cfg.context).map(|i| (i * 7 % 12) as u32).collect();
        let targets: Vec<u32> = (0..6).map(|i| (i * 5 % 12) as u32).collect();
        let mut g = vec![0f32; m.numel()];
        let loss = m
            .loss_and_grad(&params, &inputs, &targets, &mut g, &Stop::default())
            .unwrap();
        assert!(loss.is_finite());
        let mut scratch = vec![0f32; m.numel()];
        // Check a spread of coordinates in f32 with a loose tolerance.
        for i in (0..m.numel()).step_by(m.numel() / 25) {
            let h = 1e-2f32;
            let mut p = params.clone();
            p[i] += h;
            let up = m
                .loss_and_grad(&p, &inputs, &targets, &mut scratch, &Stop::default())
                .unwrap();
            p[i] -= 2.0 * h;
            let down = m
                .loss_and_grad(&p, &inputs, &targets, &mut scratch, &Stop::default())
                .unwrap();
            let fd = (up - down) / (2.0 * h);
            assert!(
                (fd - g[i]).abs() < 2e-3 + 0.05 * g[i].abs(),
                "param {i}: fd {fd} vs {}",
                g[i]
            );
        }
    }

    /// `n` examples for the tiny model (context 4, vocabulary 64).
    fn tiny_batch(n: usize) -> (Vec<u32>, Vec<u32>) {
        let inputs = (0..n * 4).map(|i| (i % 64) as u32).collect();
        let targets = (0..n).map(|i| (i * 3 % 64) as u32).collect();
        (inputs, targets)
    }

    #[test]
    fn same_inputs_same_bits() {
        let m = Model::new(ModelSize::Tiny.config());
        let params = m.init(1);
        let (inputs, targets) = tiny_batch(32);
        let (mut a, mut b) = (vec![0f32; m.numel()], vec![0f32; m.numel()]);
        let la = m
            .loss_and_grad(&params, &inputs, &targets, &mut a, &Stop::default())
            .unwrap();
        let lb = m
            .loss_and_grad(&params, &inputs, &targets, &mut b, &Stop::default())
            .unwrap();
        assert_eq!(la.to_bits(), lb.to_bits());
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }

    #[test]
    fn a_stopped_job_computes_no_gradient() {
        let m = Model::new(ModelSize::Tiny.config());
        let params = m.init(1);
        let (inputs, targets) = tiny_batch(8);
        let mut g = vec![0f32; m.numel()];
        let stop = Stop::default();
        stop.set();
        let r = m.loss_and_grad(&params, &inputs, &targets, &mut g, &stop);
        assert!(matches!(r, Err(ModelError::Stopped)), "{r:?}");
        assert!(g.iter().all(|x| *x == 0.0), "no gradient written");
    }
}
