//! Faults on the control page: what a worker reports (fault flags, and the
//! state part and byte a memory error hit) and what `agentctl inject` asks
//! a worker to give itself.
//!
//! ```text
//! fault flags:  bit 0 UCE repaired in a state part (step must be redone)
//!               bit 1 UCE outside the registered state (fatal)
//!               bit 2 another SIGBUS (fatal)
//!               bit 3 the rank could not rebuild its communicator
//!                     (epoch at 56, unreachable peer at 120)
//! fault part, fault offset: where the repairable UCE hit
//! injection kind: 0 none | 1 crash | 2 hang | 3 uce
//! injection part, offset: the UCE's target; injection step: the step it
//! waits for (0: the next one)
//! ```
//!
//! INVARIANT: the agent writes an injection's arguments before its kind
//! (release), and the worker takes it by swapping the kind to 0 before it
//! reads them; one injection is pending at a time.

use super::page::ControlPage;
use std::sync::atomic::{AtomicU64, Ordering};

bitflags::bitflags! {
    /// Faults a worker records in its control page.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct FaultFlags: u64 {
        /// An uncorrectable memory error in a registered state part was
        /// repaired in place; the step is to be recomputed from s*.
        const UCE_REPAIRABLE = 1;
        /// An uncorrectable memory error outside the registered state: the
        /// process could not trust its memory and died of it.
        const UCE_FATAL = 1 << 1;
        /// Another SIGBUS killed the process.
        const SIGBUS = 1 << 2;
        /// The rank could not rebuild its communicator for an epoch.
        const REBUILD_FAILED = 1 << 3;
    }
}

/// Where a repaired memory error hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UceSite {
    /// Index of the state part (in the rank's state map).
    pub part: u64,
    /// Byte offset in the part.
    pub offset: u64,
}

/// A fault `agentctl inject` asks a worker to give itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Injection {
    /// SIGKILL itself.
    Crash,
    /// Block inside the step forever.
    Hang,
    /// An uncorrectable memory error at byte `offset` of state part `part`.
    Uce { part: u64, offset: u64 },
}

impl Injection {
    /// The injection as its (kind, part, offset) words.
    pub fn encode(self) -> [u64; 3] {
        match self {
            Self::Crash => [1, 0, 0],
            Self::Hang => [2, 0, 0],
            Self::Uce { part, offset } => [3, part, offset],
        }
    }

    pub fn decode([kind, part, offset]: [u64; 3]) -> Option<Self> {
        match kind {
            1 => Some(Self::Crash),
            2 => Some(Self::Hang),
            3 => Some(Self::Uce { part, offset }),
            _ => None,
        }
    }
}

impl ControlPage {
    /// Records a repaired UCE in a state part (worker side).
    pub fn record_uce(&self, site: UceSite) {
        self.fault_part.store(site.part, Ordering::Relaxed);
        self.fault_offset.store(site.offset, Ordering::Relaxed);
        self.fault_flags
            .fetch_or(FaultFlags::UCE_REPAIRABLE.bits(), Ordering::Release);
    }

    /// Records that the communicator of `epoch` could not be built because
    /// `peer` (if known) could not be reached (worker side).
    pub fn record_rebuild_failure(&self, epoch: u64, peer: Option<u64>) {
        self.rebuild_epoch.store(epoch, Ordering::Relaxed);
        self.rebuild_peer
            .store(peer.unwrap_or(u64::MAX), Ordering::Relaxed);
        self.fault_flags
            .fetch_or(FaultFlags::REBUILD_FAILED.bits(), Ordering::Release);
    }

    /// The epoch and peer of the last failed rebuild.
    pub fn rebuild_failure(&self) -> (u64, Option<u64>) {
        let peer = self.rebuild_peer.load(Ordering::Relaxed);
        (
            self.rebuild_epoch.load(Ordering::Relaxed),
            (peer != u64::MAX).then_some(peer),
        )
    }

    /// The recorded faults, and where the last repairable UCE hit.
    pub fn faults(&self) -> (FaultFlags, UceSite) {
        let flags = FaultFlags::from_bits_retain(self.fault_flags.load(Ordering::Acquire));
        let site = UceSite {
            part: self.fault_part.load(Ordering::Relaxed),
            offset: self.fault_offset.load(Ordering::Relaxed),
        };
        (flags, site)
    }

    /// Clears fault flags (agent side, once handled).
    pub fn clear_faults(&self, flags: FaultFlags) {
        self.fault_flags.fetch_and(!flags.bits(), Ordering::AcqRel);
    }

    /// The fault-flags word, for a signal handler to set [`FaultFlags`]
    /// bits in with one atomic `fetch_or` (async-signal-safe).
    pub fn fault_word(&self) -> &AtomicU64 {
        &self.fault_flags
    }

    /// Asks the worker to give itself `fault` at step `at` (0: its next
    /// step; agent side). False, and nothing posted, while an earlier
    /// injection is pending.
    pub fn inject(&self, fault: Injection, at: u64) -> bool {
        if self.inject_kind.load(Ordering::Acquire) != 0 {
            return false;
        }
        let [kind, part, offset] = fault.encode();
        self.inject_part.store(part, Ordering::Relaxed);
        self.inject_offset.store(offset, Ordering::Relaxed);
        self.inject_at.store(at, Ordering::Relaxed);
        self.inject_kind.store(kind, Ordering::Release);
        true
    }

    /// Takes a pending injection due at `step` (worker side): one atomic
    /// load on the fast path.
    pub fn take_injection(&self, step: u64) -> Option<Injection> {
        if self.inject_kind.load(Ordering::Acquire) == 0
            || self.inject_at.load(Ordering::Relaxed) > step
        {
            return None;
        }
        let kind = self.inject_kind.swap(0, Ordering::AcqRel);
        Injection::decode([
            kind,
            self.inject_part.load(Ordering::Relaxed),
            self.inject_offset.load(Ordering::Relaxed),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn injections_round_trip(kind in 0u8..3, part in any::<u64>(), offset in any::<u64>()) {
            let i = match kind {
                0 => Injection::Crash,
                1 => Injection::Hang,
                _ => Injection::Uce { part, offset },
            };
            prop_assert_eq!(Injection::decode(i.encode()), Some(i));
        }

        #[test]
        fn any_words_decode(w in any::<[u64; 3]>()) {
            prop_assert_eq!(Injection::decode(w).is_some(), (1..=3).contains(&w[0]));
        }

        #[test]
        fn flags_keep_unknown_bits(w in any::<u64>()) {
            prop_assert_eq!(FaultFlags::from_bits_retain(w).bits(), w);
        }
    }
}
