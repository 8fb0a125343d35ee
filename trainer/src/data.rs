//! The synthetic token stream: a random sparse Markov chain whose entropy
//! rate is known, so the loss has a known floor.
//!
//! Each state has `branching` successors: always `(s+1) mod V` (so the chain
//! is irreducible) and `branching-1` others drawn at random, with random
//! weights. The entropy rate `H = Σ_i π_i · H(P_i)` (nats per token) uses the
//! stationary distribution `π`, found by power iteration. No model can do
//! better than `H` on average; a model that learned the chain reaches it.
//!
//! A training sequence is identified by a 64-bit seed alone: it starts in a
//! state drawn from that seed, runs [`BURN_IN`] tokens toward stationarity,
//! then emits its tokens. The sampler's RNG draws the seeds, so its state and
//! the count of sequences consumed are all there is to the data position.

/// Tokens dropped at the start of every sequence so it starts close to the
/// stationary distribution.
pub const BURN_IN: usize = 32;

/// SplitMix64: a tiny, fast generator whose whole state is one `u64`, so it
/// is trivially saved in a checkpoint and bit-exactly restored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitMix64 {
    pub state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// The chain: per state, successors with cumulative probabilities.
#[derive(Debug, Clone)]
pub struct MarkovChain {
    succ: Vec<Vec<(u32, f64)>>,
    entropy_rate: f64,
}

impl MarkovChain {
    pub fn new(seed: u64, vocab: usize, branching: usize) -> Self {
        assert!(vocab >= 2, "a chain needs at least two states");
        let branching = branching.clamp(1, vocab);
        let mut rng = SplitMix64::new(seed);
        let mut probs: Vec<Vec<(u32, f64)>> = Vec::with_capacity(vocab);
        for s in 0..vocab {
            let mut next = vec![(s + 1) % vocab];
            while next.len() < branching {
                let t = rng.below(vocab);
                if !next.contains(&t) {
                    next.push(t);
                }
            }
            // Squared uniforms give a skewed, low-entropy distribution.
            let w: Vec<f64> = next.iter().map(|_| rng.next_f64().powi(2) + 0.02).collect();
            let total: f64 = w.iter().sum();
            probs.push(
                next.iter()
                    .zip(&w)
                    .map(|(&t, &w)| (t as u32, w / total))
                    .collect(),
            );
        }

        // Stationary distribution by power iteration.
        let mut pi = vec![1.0 / vocab as f64; vocab];
        for _ in 0..10_000 {
            let mut nxt = vec![0.0; vocab];
            for (s, row) in probs.iter().enumerate() {
                for &(t, p) in row {
                    nxt[t as usize] += pi[s] * p;
                }
            }
            let diff: f64 = nxt.iter().zip(&pi).map(|(a, b)| (a - b).abs()).sum();
            pi = nxt;
            if diff < 1e-13 {
                break;
            }
        }
        let entropy_rate = probs
            .iter()
            .zip(&pi)
            .map(|(row, &w)| w * row.iter().map(|&(_, p)| -p * p.ln()).sum::<f64>())
            .sum();

        let succ = probs
            .into_iter()
            .map(|row| {
                let mut acc = 0.0;
                row.into_iter()
                    .map(|(t, p)| {
                        acc += p;
                        (t, acc)
                    })
                    .collect()
            })
            .collect();
        Self { succ, entropy_rate }
    }

    /// Entropy rate in nats per token: the floor of the cross-entropy loss.
    pub fn entropy_rate(&self) -> f64 {
        self.entropy_rate
    }

    pub fn vocab(&self) -> usize {
        self.succ.len()
    }

    fn step(&self, s: u32, rng: &mut SplitMix64) -> u32 {
        let row = &self.succ[s as usize];
        let u = rng.next_f64();
        row.iter()
            .find(|&&(_, c)| u < c)
            .or(row.last())
            .map_or(s, |&(t, _)| t)
    }

    /// Appends the `len` tokens of sequence `seq_seed` to `out`.
    pub fn sequence(&self, seq_seed: u64, len: usize, out: &mut Vec<u32>) {
        let mut rng = SplitMix64::new(seq_seed);
        let mut s = rng.below(self.vocab()) as u32;
        for _ in 0..BURN_IN {
            s = self.step(s, &mut rng);
        }
        for _ in 0..len {
            s = self.step(s, &mut rng);
            out.push(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_are_deterministic_and_follow_the_chain() {
        let c = MarkovChain::new(7, 64, 4);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        c.sequence(99, 500, &mut a);
        c.sequence(99, 500, &mut b);
        assert_eq!(a, b);
        for w in a.windows(2) {
            assert!(c.succ[w[0] as usize].iter().any(|&(t, _)| t == w[1]));
        }
        let h = c.entropy_rate();
        assert!(h > 0.0 && h < (4f64).ln(), "entropy rate {h}");
    }

    #[test]
    fn empirical_entropy_matches_the_rate() {
        // The average of -ln p(next | current) over a long sample estimates H.
        let c = MarkovChain::new(3, 32, 4);
        let mut toks = Vec::new();
        c.sequence(1, 200_000, &mut toks);
        let p = |s: u32, t: u32| {
            let row = &c.succ[s as usize];
            let i = row.iter().position(|&(x, _)| x == t).unwrap();
            row[i].1 - if i == 0 { 0.0 } else { row[i - 1].1 }
        };
        let est: f64 =
            toks.windows(2).map(|w| -p(w[0], w[1]).ln()).sum::<f64>() / (toks.len() - 1) as f64;
        assert!(
            (est - c.entropy_rate()).abs() < 0.02,
            "{est} vs {}",
            c.entropy_rate()
        );
    }
}
