//! The fault trace: every fault of one simulated run, drawn once per seed
//! so that every policy meets the same faults at the same times.
//!
//! Faults of all kinds form one Poisson process whose rate is the sum of
//! the per-component rates (kinds independent, components exchangeable), so
//! a trace is a sorted list of `(time, kind, duration, u)`: the duration is
//! the repair time of a lost host or domain, or the length of a slowdown;
//! `u` is a uniform draw in [0, 1) that a policy uses where the fault's
//! cost depends on where in a step or a save it lands. The same seed gives
//! the same trace, bit for bit (ChaCha8, defined across platforms).

use crate::rates::Rates;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// One fault's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// An uncorrectable memory error on an accelerator.
    Uce,
    /// A worker process dies.
    Crash,
    /// A worker stops making progress.
    Hang,
    /// A host is lost until repaired.
    Host,
    /// Every host of one failure domain is lost until repaired.
    Domain,
    /// A host runs slow, and with it the synchronous job.
    Slow,
}

impl Kind {
    pub const ALL: [Kind; 6] = [
        Kind::Uce,
        Kind::Crash,
        Kind::Hang,
        Kind::Host,
        Kind::Domain,
        Kind::Slow,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Uce => "uce",
            Kind::Crash => "crash",
            Kind::Hang => "hang",
            Kind::Host => "host",
            Kind::Domain => "domain",
            Kind::Slow => "slow",
        }
    }
}

/// One fault.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fault {
    /// Seconds from the start.
    pub t: f64,
    pub kind: Kind,
    /// Repair time (host, domain) or slowdown length, seconds; else 0.
    pub dur: f64,
    /// A uniform draw in [0, 1).
    pub u: f64,
}

/// The job's shape: accelerators, hosts, and the simulated span.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    pub accelerators: u32,
    pub per_host: u32,
    pub span_s: f64,
}

impl Shape {
    /// Hosts the job trains on (a last, partial host counts as one).
    pub fn hosts(&self) -> u32 {
        self.accelerators.div_ceil(self.per_host.max(1))
    }

    /// Failure domains, a last partial one counted.
    pub fn domains(&self, rates: &Rates) -> u32 {
        self.hosts().div_ceil(rates.domain_hosts.max(1))
    }
}

/// Per-second rates of each kind for this shape, in `Kind::ALL` order.
pub fn kind_rates(shape: &Shape, rates: &Rates) -> [f64; 6] {
    const DAY: f64 = 86_400.0;
    let acc = f64::from(shape.accelerators);
    let hosts = f64::from(shape.hosts());
    let domains = f64::from(shape.domains(rates));
    [
        rates.uce * acc / DAY,
        rates.crash * acc / DAY,
        rates.hang * acc / DAY,
        rates.host * hosts / DAY,
        rates.domain * domains / DAY,
        rates.slow * hosts / DAY,
    ]
}

/// Draws the trace of `seed` into `out` (cleared first).
pub fn draw(shape: &Shape, rates: &Rates, seed: u64, out: &mut Vec<Fault>) {
    out.clear();
    let by_kind = kind_rates(shape, rates);
    let total: f64 = by_kind.iter().sum();
    if total <= 0.0 {
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut t = 0.0;
    loop {
        t += exp(&mut rng, 1.0 / total);
        if t >= shape.span_s {
            return;
        }
        let mut pick = rng.random::<f64>() * total;
        let mut kind = Kind::Slow;
        for (k, r) in Kind::ALL.into_iter().zip(by_kind) {
            if pick < r {
                kind = k;
                break;
            }
            pick -= r;
        }
        if by_kind[kind as usize] <= 0.0 {
            // Rounding left `pick` past the last kind with a rate.
            kind = Kind::ALL[by_kind.iter().rposition(|r| *r > 0.0).unwrap_or(0)];
        }
        let dur = match kind {
            Kind::Host | Kind::Domain => exp(&mut rng, rates.repair_hours * 3600.0),
            Kind::Slow => exp(&mut rng, rates.slow_hours * 3600.0),
            _ => 0.0,
        };
        let u = rng.random::<f64>();
        out.push(Fault { t, kind, dur, u });
    }
}

/// The faults of `trace` kept with probability `keep` each, by a draw of
/// their own (not `u`): a trace at a lower rate that meets a subset of the
/// same faults at the same times, for comparisons between rates.
pub fn thin(trace: &[Fault], keep: f64, seed: u64) -> Vec<Fault> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x7468_696e);
    trace
        .iter()
        .filter(|_| rng.random::<f64>() < keep)
        .copied()
        .collect()
}

/// An exponential draw of the given mean.
fn exp(rng: &mut ChaCha8Rng, mean: f64) -> f64 {
    // 1 - U is in (0, 1], so the logarithm is finite.
    -(1.0 - rng.random::<f64>()).ln() * mean
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        Shape {
            accelerators: 16_384,
            per_host: 8,
            span_s: 54.0 * 86_400.0,
        }
    }

    #[test]
    fn the_same_seed_draws_the_same_trace_and_another_seed_another() {
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        draw(&shape(), &Rates::llama3(), 7, &mut a);
        draw(&shape(), &Rates::llama3(), 7, &mut b);
        draw(&shape(), &Rates::llama3(), 8, &mut c);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.windows(2).all(|w| w[0].t < w[1].t));
        assert!(
            a.iter()
                .all(|f| f.t < shape().span_s && (0.0..1.0).contains(&f.u))
        );
    }

    #[test]
    fn llama3_rates_give_its_419_interruptions_by_kind_on_average() {
        let rates = Rates {
            domain: 0.0,
            slow: 0.0,
            ..Rates::llama3()
        };
        let mut counts = [0u64; 6];
        let mut trace = Vec::new();
        let seeds = 200;
        for seed in 0..seeds {
            draw(&shape(), &rates, seed, &mut trace);
            for f in &trace {
                counts[f.kind as usize] += 1;
            }
        }
        let expect = crate::rates::LLAMA3_BY_KIND;
        for (i, e) in expect.iter().enumerate() {
            let mean = counts[i] as f64 / seeds as f64;
            // Poisson: the mean of 200 draws has a standard error of
            // sqrt(e / 200); allow 4 of them.
            let tol = 4.0 * (f64::from(*e) / seeds as f64).sqrt();
            assert!(
                (mean - f64::from(*e)).abs() < tol,
                "{:?}: mean {mean}, expected {e} ± {tol}",
                Kind::ALL[i]
            );
        }
        assert_eq!(counts[4] + counts[5], 0);
    }

    #[test]
    fn no_rates_no_faults() {
        let mut t = vec![Fault {
            t: 0.0,
            kind: Kind::Uce,
            dur: 0.0,
            u: 0.0,
        }];
        draw(&shape(), &Rates::none(), 1, &mut t);
        assert!(t.is_empty());
    }
}
