//! Directives: the agent's instructions to a rank, posted in its control
//! page with a sequence lock.
//!
//! The agent posts by making `directive seq` odd, writing kind, epoch and
//! step, then making it even again (release). The worker polls `directive
//! seq` with one atomic load (no syscall) at every step boundary; it reads
//! a directive consistently by re-checking the sequence after the fields,
//! and acknowledges it by storing its sequence in `acknowledged seq`.
//! Between steps a rank's watcher sleeps on the sequence (a futex on its
//! low 32 bits, shared by every process that maps the page), which each
//! post wakes.
//!
//! ```text
//! kind word: 0 none | 1 pause | 2 resume | 3 stop | 4 reshape
//! step word: a resume's or reshape's step; a pause's `upto` + 1 (0: none)
//! rank, world words: a reshape's new place (0 for the other kinds)
//! ```

use super::page::ControlPage;
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::time::Duration;

/// An instruction from the agent to a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Directive {
    None,
    /// Abort the communicator, finish any commit, wait for the next
    /// directive. `epoch` is the epoch being formed. `upto`, when known,
    /// bounds the step the job can resume from (the newest step a rank
    /// whose process has ended holds sealed): a copy of a later step is
    /// abandoned instead of finished, since no rank could use it.
    Pause {
        epoch: u64,
        #[serde(default)]
        upto: Option<u64>,
    },
    /// Roll back to `step` (restoring from the sealed slot of that step
    /// unless the live state is exactly there) and rebuild the communicator
    /// under `epoch`.
    Resume {
        epoch: u64,
        step: u64,
    },
    /// Leave the training loop and exit.
    Stop,
    /// Like `Resume`, at a new place in the data-parallel group: the rank
    /// becomes `rank` of `world` (elastic training). Its state at `step` is
    /// re-sliced for that place with the other ranks of the new group, and
    /// its snapshots take the new layout.
    Reshape {
        epoch: u64,
        step: u64,
        rank: u64,
        world: u64,
    },
}

impl Directive {
    /// The directive as its five words (kind, epoch, step, rank, world).
    pub fn encode(self) -> [u64; 5] {
        match self {
            Self::None => [0; 5],
            Self::Pause { epoch, upto } => {
                [1, epoch, upto.map_or(0, |s| s.saturating_add(1)), 0, 0]
            }
            Self::Resume { epoch, step } => [2, epoch, step, 0, 0],
            Self::Stop => [3, 0, 0, 0, 0],
            Self::Reshape {
                epoch,
                step,
                rank,
                world,
            } => [4, epoch, step, rank, world],
        }
    }

    /// The directive of five words; an unknown kind, or a reshape to a
    /// place outside its world, reads as `None`.
    pub fn decode([kind, epoch, step, rank, world]: [u64; 5]) -> Self {
        match kind {
            1 => Self::Pause {
                epoch,
                upto: step.checked_sub(1),
            },
            2 => Self::Resume { epoch, step },
            3 => Self::Stop,
            4 if rank < world => Self::Reshape {
                epoch,
                step,
                rank,
                world,
            },
            _ => Self::None,
        }
    }

    /// The epoch and step a resume or reshape rolls back to.
    pub fn resumes(self) -> Option<(u64, u64)> {
        match self {
            Self::Resume { epoch, step } | Self::Reshape { epoch, step, .. } => Some((epoch, step)),
            _ => None,
        }
    }
}

impl ControlPage {
    /// Posts a directive (agent side). Returns its sequence number.
    pub fn post(&self, d: Directive) -> u64 {
        let [kind, epoch, step, rank, world] = d.encode();
        let start = self.dir_seq.fetch_add(1, Ordering::AcqRel) + 1;
        debug_assert!(start % 2 == 1, "one poster at a time");
        self.dir_kind.store(kind, Ordering::Relaxed);
        self.dir_epoch.store(epoch, Ordering::Relaxed);
        self.dir_step.store(step, Ordering::Relaxed);
        self.dir_rank.store(rank, Ordering::Relaxed);
        self.dir_world.store(world, Ordering::Relaxed);
        let seq = self.dir_seq.fetch_add(1, Ordering::Release) + 1;
        self.wake_directive_waiters();
        seq
    }

    /// Blocks until the directive sequence is no longer `seen`, a post
    /// wakes the caller, or `limit` passes; it may also return early
    /// (a signal, a wake for another reason).
    pub fn wait_directive(&self, seen: u64, limit: Duration) {
        let ts = libc::timespec {
            tv_sec: limit.as_secs().try_into().unwrap_or(libc::time_t::MAX),
            tv_nsec: limit.subsec_nanos().into(),
        };
        // SAFETY: a futex wait on an aligned word of this mapped page,
        // compared with the sequence's low 32 bits (which a post changes);
        // the timespec outlives the call. EAGAIN, EINTR and ETIMEDOUT all
        // mean: look again.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                low_word(&self.dir_seq),
                libc::FUTEX_WAIT,
                seen as u32,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }

    /// Wakes every [`Self::wait_directive`] on this page, in any process.
    pub fn wake_directive_waiters(&self) {
        // SAFETY: a futex wake on an aligned word of this mapped page.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                low_word(&self.dir_seq),
                libc::FUTEX_WAKE,
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }

    /// The directive sequence number: one atomic load, the step-boundary
    /// fast path.
    pub fn directive_seq(&self) -> u64 {
        self.dir_seq.load(Ordering::Acquire)
    }

    /// Reads the current directive and its sequence number consistently.
    pub fn directive(&self) -> (u64, Directive) {
        loop {
            let s1 = self.dir_seq.load(Ordering::Acquire);
            if s1 % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let words = [
                self.dir_kind.load(Ordering::Relaxed),
                self.dir_epoch.load(Ordering::Relaxed),
                self.dir_step.load(Ordering::Relaxed),
                self.dir_rank.load(Ordering::Relaxed),
                self.dir_world.load(Ordering::Relaxed),
            ];
            fence(Ordering::Acquire);
            if self.dir_seq.load(Ordering::Relaxed) == s1 {
                return (s1, Directive::decode(words));
            }
        }
    }

    /// Worker side: `seq` has been carried out (or, for a pause, obeyed).
    pub fn acknowledge(&self, seq: u64) {
        self.ack.store(seq, Ordering::Release);
    }

    pub fn acknowledged(&self) -> u64 {
        self.ack.load(Ordering::Acquire)
    }

    /// The directive the rank has acknowledged, if it is the current one.
    pub fn acknowledged_directive(&self) -> Option<Directive> {
        let (seq, d) = self.directive();
        (seq != 0 && self.acknowledged() == seq).then_some(d)
    }
}

/// The address of the low 32 bits of `word`: what a futex on it compares.
fn low_word(word: &AtomicU64) -> *const u32 {
    let p = word.as_ptr().cast::<u32>().cast_const();
    if cfg!(target_endian = "little") {
        p
    } else {
        p.wrapping_add(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn directives_round_trip(
            kind in 0u8..5, epoch in any::<u64>(), step in any::<u64>(),
            world in 1u64..4096, rank in any::<u64>(), upto in proptest::option::of(0..u64::MAX),
        ) {
            let d = match kind {
                0 => Directive::None,
                1 => Directive::Pause { epoch, upto },
                2 => Directive::Resume { epoch, step },
                3 => Directive::Stop,
                _ => Directive::Reshape { epoch, step, rank: rank % world, world },
            };
            prop_assert_eq!(Directive::decode(d.encode()), d);
        }

        #[test]
        fn any_words_decode(words in any::<[u64; 5]>()) {
            let _ = Directive::decode(words);
        }
    }
}
