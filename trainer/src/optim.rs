//! AdamW over one rank's shard of the flat buffers (ZeRO-1).
//!
//! Decoupled weight decay, bias-corrected moments, a linear warm-up of the
//! learning rate. The update reads only the shard's parameters, gradients and
//! moments, so it is the same computation whichever rank owns the shard.

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub warmup: u64,
}

impl AdamW {
    /// Learning rate of step `t` (1-based).
    pub fn lr_at(&self, t: u64) -> f32 {
        if self.warmup == 0 || t >= self.warmup {
            self.lr
        } else {
            self.lr * t as f32 / self.warmup as f32
        }
    }

    /// Applies step `t` (1-based) to a shard.
    pub fn step(&self, t: u64, params: &mut [f32], grads: &[f32], m: &mut [f32], v: &mut [f32]) {
        assert!(
            params.len() == grads.len() && grads.len() == m.len() && m.len() == v.len(),
            "AdamW shard buffers differ in length"
        );
        let lr = self.lr_at(t);
        let t = i32::try_from(t).unwrap_or(i32::MAX);
        let bc1 = 1.0 - self.beta1.powi(t);
        let bc2 = 1.0 - self.beta2.powi(t);
        let decay = 1.0 - lr * self.weight_decay;
        for (((p, &g), m), v) in params
            .iter_mut()
            .zip(grads)
            .zip(m.iter_mut())
            .zip(v.iter_mut())
        {
            *m = self.beta1 * *m + (1.0 - self.beta1) * g;
            *v = self.beta2 * *v + (1.0 - self.beta2) * g * g;
            let update = (*m / bc1) / ((*v / bc2).sqrt() + self.eps);
            *p = *p * decay - lr * update;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_step_moves_by_lr_against_the_gradient() {
        let opt = AdamW {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 0.0,
            weight_decay: 0.0,
            warmup: 0,
        };
        let mut p = vec![1.0, 1.0];
        let (mut m, mut v) = (vec![0.0; 2], vec![0.0; 2]);
        opt.step(1, &mut p, &[2.0, -3.0], &mut m, &mut v);
        assert!(
            (p[0] - 0.9).abs() < 1e-6 && (p[1] - 1.1).abs() < 1e-6,
            "{p:?}"
        );
    }

    #[test]
    fn warmup_is_linear() {
        let opt = AdamW {
            lr: 1.0,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
            warmup: 4,
        };
        assert_eq!([1, 2, 4, 9].map(|t| opt.lr_at(t)), [0.25, 0.5, 1.0, 1.0]);
    }
}
