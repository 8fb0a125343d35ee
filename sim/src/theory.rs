//! Closed forms the simulation is checked against.

/// First-order goodput of restart-from-disk with blocking saves: a save of
/// `write_s` after every `interval_s` of training, faults at `rate` per
/// second, each costing `downtime_s` plus, on average, half a
/// save-to-save period of work (Young 1974; Daly 2006):
///
/// `1 − δ/(τ + δ) − λ ((τ + δ)/2 + D)`.
///
/// Its exact optimum is `τ + δ = √(2δ/λ)`; Young's `τ = √(2δ/λ)` is the
/// same to first order (δ ≪ τ).
pub fn disk_goodput(interval_s: f64, write_s: f64, rate: f64, downtime_s: f64) -> f64 {
    let period = interval_s + write_s;
    1.0 - write_s / period - rate * (period / 2.0 + downtime_s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::young_daly;

    #[test]
    fn young_daly_is_the_optimum_of_the_first_order_model() {
        let (w, rate, d) = (60.0, 1.0 / 50_000.0, 390.0);
        let tau = young_daly(w, rate);
        let g = disk_goodput(tau, w, rate, d);
        for k in [0.8, 0.9, 1.1, 1.25] {
            assert!(disk_goodput(tau * k, w, rate, d) < g, "k = {k}");
        }
    }
}
