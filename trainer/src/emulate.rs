//! `--emulate-device MS`: the reference trainer shaped as an accelerator
//! host runs a step.
//!
//! On an accelerator the forward and backward passes are kernels queued on
//! the device: the host thread that queued them waits, holding no core,
//! while hatrain's threads have the host to themselves. [`Device`] makes
//! each step's forward and backward exactly that: a wait of `MS`
//! milliseconds (a sleep, not a spin), after which the gradients are those
//! of a seeded function of the step, the rank and the element. Everything
//! else is as without it: the gradients are reduce-scattered, the real
//! AdamW updates the real state, and the snapshots, replicas, checkpoints
//! and faults carry exactly the bytes they do with the real model. A run is
//! still a pure function of its flags, so a run with faults ends
//! bit-identical to one without.
//!
//! The gradients cost the host one pass of stores over the buffer (a
//! pattern of [`PERIOD`] elements drawn per rank, scaled and shifted per
//! step), done before the wait and counted in it: the step takes `MS`, or
//! that pass if it is longer. A paused job stops the device: the wait
//! ends at once (see [`crate::stop`]).

use crate::data::SplitMix64;
use crate::stop::Stop;
use std::time::{Duration, Instant};

/// The length of the per-rank gradient pattern.
pub const PERIOD: usize = 4096;

/// The emulated device of one rank.
#[derive(Debug, Clone)]
pub struct Device {
    step_time: Duration,
    seed: u64,
    rank: u64,
    pattern: Vec<f32>,
}

/// A uniform draw in `[-1, 1)`.
fn unit(rng: &mut SplitMix64) -> f32 {
    // 24 random bits, as f32 holds them exactly.
    ((rng.next_u64() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
}

impl Device {
    /// A device whose forward and backward take `ms` milliseconds, for
    /// `rank` of a job seeded `seed`.
    pub fn new(ms: f64, seed: u64, rank: usize) -> Self {
        let rank = rank as u64;
        let mut rng = SplitMix64::new(seed ^ 0xde71_ce00_0000_0000 ^ rank.rotate_left(32));
        let pattern = (0..PERIOD).map(|_| unit(&mut rng) * 1e-2).collect();
        Self {
            step_time: Duration::from_secs_f64(ms / 1e3),
            seed,
            rank,
            pattern,
        }
    }

    /// The forward and backward of `step`: fills `grads`, waits out the
    /// step's device time, returns the step's loss; `None` when `stop` was
    /// set before the time was out.
    pub fn forward_backward(&self, step: u64, grads: &mut [f32], stop: &Stop) -> Option<f32> {
        let t = Instant::now();
        let mut rng = SplitMix64::new(self.seed ^ step.rotate_left(17) ^ self.rank.rotate_left(48));
        let (scale, shift) = (unit(&mut rng), unit(&mut rng) * 1e-3);
        for chunk in grads.chunks_mut(PERIOD) {
            for (g, p) in chunk.iter_mut().zip(&self.pattern) {
                *g = p * scale + shift;
            }
        }
        let rest = self.step_time.saturating_sub(t.elapsed());
        if stop.wait(rest) {
            return None;
        }
        // A loss that falls with the steps, as a training run's would.
        Some(2.0 + 1.0 / (1.0 + step as f32) + scale.abs() * 1e-2)
    }
}

/// `--emulate-device`'s value: milliseconds, finite and above zero.
pub fn parse_ms(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(ms) if ms.is_finite() && ms > 0.0 && ms <= 3_600_000.0 => Ok(ms),
        Ok(_) => Err(format!(
            "{s} ms: a step's device time is above 0 and at most an hour"
        )),
        Err(e) => Err(format!("{s:?} is not a number of milliseconds: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gradients_are_a_function_of_the_step_rank_and_element() {
        let (a, b) = (Device::new(0.001, 7, 0), Device::new(0.001, 7, 1));
        let grad = |d: &Device, step| {
            let mut g = vec![0f32; 3 * PERIOD + 5];
            let loss = d.forward_backward(step, &mut g, &Stop::default());
            (g, loss)
        };
        assert_eq!(grad(&a, 3), grad(&a, 3));
        assert_eq!(grad(&a, 3), grad(&Device::new(0.001, 7, 0), 3));
        assert_ne!(grad(&a, 3).0, grad(&a, 4).0);
        assert_ne!(grad(&a, 3).0, grad(&b, 3).0);
        assert!(grad(&a, 3).0.iter().all(|g| g.is_finite() && g.abs() < 0.1));
    }

    #[test]
    fn the_step_takes_the_device_time_at_least() {
        let d = Device::new(20.0, 1, 0);
        let t = Instant::now();
        let loss = d.forward_backward(1, &mut [0f32; 10], &Stop::default());
        assert!(loss.is_some());
        assert!(t.elapsed() >= Duration::from_millis(20));
    }

    #[test]
    fn a_stop_ends_the_device_time_at_once() {
        // An hour of device time: the test would hang unless stopped.
        let d = Device::new(3_600_000.0, 1, 0);
        let stop = std::sync::Arc::new(Stop::default());
        let setter = {
            let stop = std::sync::Arc::clone(&stop);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                stop.set();
            })
        };
        assert_eq!(d.forward_backward(1, &mut [0f32; 10], &stop), None);
        setter.join().unwrap();
        // Stopped before it began: no time at all.
        assert_eq!(d.forward_backward(2, &mut [0f32; 10], &stop), None);
    }

    #[test]
    fn bad_device_times_are_refused_with_their_reason() {
        assert_eq!(parse_ms("2000"), Ok(2000.0));
        assert_eq!(parse_ms("0.5"), Ok(0.5));
        for bad in ["0", "-3", "inf", "NaN", "1e9"] {
            assert!(parse_ms(bad).unwrap_err().contains("above 0"), "{bad}");
        }
        assert!(parse_ms("fast").unwrap_err().contains("not a number"));
    }
}
