//! Fault rates by kind, and where each default comes from.
//!
//! Accelerator-level kinds (UCE, worker crash, hang) are per accelerator
//! and day; host loss and silent slowdown per host and day; the loss of a
//! failure domain (a rack, a power feed) per domain and day. The defaults
//! split Llama 3's 419 unexpected interruptions in 54 days on 16,384 H100
//! (Dubey et al., "The Llama 3 Herd of Models", 2024, Table 5) into the
//! simulator's kinds:
//!
//! | kind  | Llama 3 root causes (count)                                        | n   |
//! |-------|--------------------------------------------------------------------|-----|
//! | UCE   | GPU HBM3 memory (72), GPU SRAM memory (19)                         | 91  |
//! | crash | software bug (54), GPU system processor (17), silent data          | 79  |
//! |       | corruption (6), dependency (2)                                     |     |
//! | hang  | network switch or cable (35), NCCL watchdog timeouts (7)           | 42  |
//! | host  | faulty GPU (148), host maintenance (32), NIC (7), thermal (6), SSD | 207 |
//! |       | (3), power supply (3), chassis (2), IO expansion board (2), CPU    |     |
//! |       | (2), system memory (2)                                             |     |
//!
//! The host-loss rate this gives, 1.87×10⁻³ per host-day, agrees in order
//! with the 5×10⁻³ failures per node-day that Meta measured on its research
//! clusters (Kokolis et al., "Revisiting Reliability in Large-Scale Machine
//! Learning Research Clusters", 2024). No source above gives a per-rack
//! rate, a repair time or a slowdown rate: those defaults are assumptions,
//! and say so in the help text.

use serde::{Deserialize, Serialize};

/// Llama 3's accelerators, days and interruptions by the simulator's kinds.
pub const LLAMA3_ACCELERATORS: u32 = 16_384;
/// Llama 3's 54-day snapshot.
pub const LLAMA3_DAYS: f64 = 54.0;
/// Llama 3's hosts of 8 H100.
pub const LLAMA3_PER_HOST: u32 = 8;
/// Interruptions by kind: UCE, crash, hang, host (see the module's table).
pub const LLAMA3_BY_KIND: [u32; 4] = [91, 79, 42, 207];

/// Rates of each fault kind, and the durations that go with them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rates {
    /// Uncorrectable memory errors per accelerator-day.
    pub uce: f64,
    /// Worker crashes per accelerator-day.
    pub crash: f64,
    /// Hangs per accelerator-day.
    pub hang: f64,
    /// Host losses per host-day.
    pub host: f64,
    /// Mean hours before a lost host is repaired and can serve again.
    pub repair_hours: f64,
    /// Losses of a whole failure domain per domain-day.
    pub domain: f64,
    /// Hosts in a failure domain.
    pub domain_hosts: u32,
    /// Silent slowdowns per host-day.
    pub slow: f64,
    /// The speed of the whole (synchronous) job while a host is slow.
    pub slow_speed: f64,
    /// Mean hours a slowdown lasts before it is found and removed.
    pub slow_hours: f64,
}

impl Default for Rates {
    fn default() -> Self {
        Self::llama3()
    }
}

impl Rates {
    /// Llama 3's interruptions per component and day, with the assumed
    /// repair, domain and slowdown figures.
    pub fn llama3() -> Self {
        let acc_days = f64::from(LLAMA3_ACCELERATORS) * LLAMA3_DAYS;
        let host_days = f64::from(LLAMA3_ACCELERATORS / LLAMA3_PER_HOST) * LLAMA3_DAYS;
        let [uce, crash, hang, host] = LLAMA3_BY_KIND.map(f64::from);
        Self {
            uce: uce / acc_days,
            crash: crash / acc_days,
            hang: hang / acc_days,
            host: host / host_days,
            repair_hours: 12.0,
            domain: 2e-4,
            domain_hosts: 4,
            slow: 5e-4,
            slow_speed: 0.8,
            slow_hours: 1.0,
        }
    }

    /// No faults at all.
    pub fn none() -> Self {
        Self {
            uce: 0.0,
            crash: 0.0,
            hang: 0.0,
            host: 0.0,
            domain: 0.0,
            slow: 0.0,
            ..Self::llama3()
        }
    }

    /// Every rate multiplied by `k` (durations unchanged).
    pub fn scaled(self, k: f64) -> Self {
        Self {
            uce: self.uce * k,
            crash: self.crash * k,
            hang: self.hang * k,
            host: self.host * k,
            domain: self.domain * k,
            slow: self.slow * k,
            ..self
        }
    }

    /// Checks that every rate is finite and not negative, and the
    /// durations and sizes make sense; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        let rates = [
            ("uce", self.uce),
            ("crash", self.crash),
            ("hang", self.hang),
            ("host", self.host),
            ("domain", self.domain),
            ("slow", self.slow),
        ];
        for (name, v) in rates {
            if !(v.is_finite() && (0.0..=1e3).contains(&v)) {
                return Err(format!(
                    "rate {name} = {v}: must be between 0 and 1000 per component-day"
                ));
            }
        }
        for (name, v) in [
            ("repair_hours", self.repair_hours),
            ("slow_hours", self.slow_hours),
        ] {
            if !(v.is_finite() && (0.0..=1e5).contains(&v)) {
                return Err(format!("{name} = {v}: must be between 0 and 100000 hours"));
            }
        }
        if !(self.slow_speed > 0.0 && self.slow_speed <= 1.0) {
            return Err(format!(
                "slow_speed = {}: must be in (0, 1]",
                self.slow_speed
            ));
        }
        if self.domain_hosts == 0 {
            return Err("domain_hosts = 0: a failure domain holds at least one host".into());
        }
        Ok(())
    }
}
