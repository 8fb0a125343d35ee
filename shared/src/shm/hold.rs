//! Persist holds: a step the agent is to save to disk is *held*.
//!
//! After sealing a save step's slot, the worker records `(step, slot)` in
//! the hold word, and no writer touches a held slot until the hold is gone.
//! The agent *claims* a hold (a CAS that sets the claimed bit) before it
//! reads the slot, and releases it when done. Only the worker names a slot
//! in the hold word, and it replaces a hold with a newer one only while it
//! is unclaimed (a CAS), so a claimed slot cannot be rewritten while the
//! agent reads it: a slow disk makes the agent skip to the newest held step
//! instead of queueing.
//!
//! ```text
//! hold word: 0 none, else  step << 16 | claimed << 8 | (slot + 1)
//!            bits 63..16 step   bit 8 claimed   bits 7..0 slot + 1
//! ```

use super::page::ControlPage;
use std::sync::atomic::Ordering;

/// A snapshot held for the agent's persister.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    pub step: u64,
    pub slot: usize,
    /// The agent is reading the slot.
    pub claimed: bool,
}

/// Why a worker could not hold a step for the persister.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldRefused {
    /// The agent is still writing this older step out.
    Busy(Hold),
}

impl Hold {
    const CLAIMED: u64 = 1 << 8;
    /// Largest step a hold can name.
    pub const MAX_STEP: u64 = u64::MAX >> 16;

    /// The hold word (`slot` < [`super::MAX_SLOTS`], `step` ≤ [`Self::MAX_STEP`]).
    pub fn encode(self) -> u64 {
        debug_assert!(self.slot < super::MAX_SLOTS && self.step <= Self::MAX_STEP);
        let claimed = if self.claimed { Self::CLAIMED } else { 0 };
        (self.step << 16) | claimed | (self.slot as u64 + 1)
    }

    pub fn decode(w: u64) -> Option<Self> {
        let slot = (w & 0xff) as usize;
        (slot != 0).then(|| Self {
            step: w >> 16,
            slot: slot - 1,
            claimed: w & Self::CLAIMED != 0,
        })
    }
}

impl ControlPage {
    /// The current hold, if any.
    pub fn held(&self) -> Option<Hold> {
        Hold::decode(self.hold.load(Ordering::Acquire))
    }

    /// Holds the freshly sealed `slot` (of `step`) for the persister (worker
    /// side). An unclaimed older hold is replaced, and its slot freed; a
    /// claimed one stays, and this step is not held.
    pub fn hold(&self, step: u64, slot: usize) -> Result<(), HoldRefused> {
        let new = Hold {
            step: step.min(Hold::MAX_STEP),
            slot,
            claimed: false,
        }
        .encode();
        let mut cur = self.hold.load(Ordering::Acquire);
        loop {
            if let Some(h) = Hold::decode(cur).filter(|h| h.claimed) {
                return Err(HoldRefused::Busy(h));
            }
            match self
                .hold
                .compare_exchange(cur, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(()),
                Err(now) => cur = now,
            }
        }
    }

    /// Claims the hold of `step` (agent side): the claimed hold if it was
    /// held and not claimed; from then on the worker leaves its slot alone.
    pub fn claim_hold(&self, step: u64) -> Option<Hold> {
        let h = self.held().filter(|h| h.step == step && !h.claimed)?;
        let claimed = Hold { claimed: true, ..h };
        self.hold
            .compare_exchange(
                h.encode(),
                claimed.encode(),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .ok()
            .map(|_| claimed)
    }

    /// Drops `hold` if it is still the current one (either side): the agent
    /// when it is done with the slot, the worker when the step is abandoned.
    pub fn release_hold(&self, hold: Hold) -> bool {
        self.hold
            .compare_exchange(hold.encode(), 0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Puts a claimed hold back to unclaimed (agent side), when not every
    /// rank's hold of the step could be claimed.
    pub fn unclaim_hold(&self, hold: Hold) -> bool {
        let open = Hold {
            claimed: false,
            ..hold
        };
        self.hold
            .compare_exchange(
                hold.encode(),
                open.encode(),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn holds_round_trip(step in 0..=Hold::MAX_STEP, slot in 0..super::super::MAX_SLOTS, claimed in any::<bool>()) {
            let h = Hold { step, slot, claimed };
            prop_assert_eq!(Hold::decode(h.encode()), Some(h));
            prop_assert_ne!(h.encode(), 0);
        }

        #[test]
        fn any_word_decodes(w in any::<u64>()) {
            if let Some(h) = Hold::decode(w) {
                prop_assert!(h.slot < 255);
            }
        }
    }
}
