//! The step clock: where each training step goes, phase by phase
//! ([`StepPhase`]), summed on the training thread and added to the control
//! page once per step. Reading the clock is `clock_gettime` through the
//! vDSO: no syscall, no lock.

use super::Runtime;
use hatrain_shared::shm::StepPhase;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

const DATA: usize = StepPhase::Data as usize;
const COMPUTE: usize = StepPhase::Compute as usize;
const COLLECTIVE: usize = StepPhase::Collective as usize;
const UPDATE: usize = StepPhase::Update as usize;
const STEP: usize = StepPhase::Step as usize;
/// From `begin_step`: compute, or data once the loop says its batch is
/// ready.
const OPENING: usize = STEP + 1;
/// Time no phase counts (the fences, the loop after its update).
const NONE: usize = STEP + 2;
/// `step_start` before the first step.
const NEVER: u64 = u64::MAX;

#[derive(Debug)]
pub(super) struct StepClock {
    base: Instant,
    phase: AtomicUsize,
    /// When the running segment began, in ns since `base`.
    mark: AtomicU64,
    step_start: AtomicU64,
    /// This step's ns per phase so far (all but the whole step).
    acc: [AtomicU64; STEP],
    /// Ns this step's compute waited on collectives that ran beside it:
    /// moved from compute to collective when the step is published.
    overlapped: AtomicU64,
}

impl Default for StepClock {
    fn default() -> Self {
        Self {
            base: Instant::now(),
            phase: AtomicUsize::new(NONE),
            mark: AtomicU64::new(0),
            step_start: AtomicU64::new(NEVER),
            acc: Default::default(),
            overlapped: AtomicU64::new(0),
        }
    }
}

impl StepClock {
    fn now(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Ends the running segment, counted as `opening` when it is the
    /// opening one, and begins one of phase `to`.
    fn switch_counting(&self, to: usize, opening: usize) -> usize {
        let now = self.now();
        let from = self.phase.swap(to, Ordering::Relaxed);
        let began = self.mark.swap(now, Ordering::Relaxed);
        let counted = if from == OPENING { opening } else { from };
        if counted < STEP {
            self.acc[counted].fetch_add(now.saturating_sub(began), Ordering::Relaxed);
        }
        from
    }

    fn switch(&self, to: usize) -> usize {
        self.switch_counting(to, COMPUTE)
    }

    /// A step begins: the step before it, if one was timed, as its ns per
    /// phase.
    fn begin(&self) -> Option<[u64; STEP + 1]> {
        self.switch(OPENING);
        let now = self.mark.load(Ordering::Relaxed);
        let start = self.step_start.swap(now, Ordering::Relaxed);
        let mut ns = [0u64; STEP + 1];
        for (n, a) in ns.iter_mut().zip(&self.acc) {
            *n = a.swap(0, Ordering::Relaxed);
        }
        ns[STEP] = now.saturating_sub(start);
        let waited = self.overlapped.swap(0, Ordering::Relaxed).min(ns[COMPUTE]);
        ns[COMPUTE] -= waited;
        ns[COLLECTIVE] += waited;
        (start != NEVER).then_some(ns)
    }
}

impl Runtime {
    /// Publishes the step before `begin_step` and opens the next.
    pub(super) fn time_step_begins(&self) {
        let times = self.step_clock.begin();
        if let (Some(ns), Some(a)) = (times, &self.attached) {
            a.store.page().record_step(&ns);
        }
    }

    /// The loop's batch for this step is ready: the time since
    /// `begin_step` was data loading, what follows is compute. Loops that
    /// do not call it count that time as compute.
    pub fn batch_ready(&self) {
        if self.step_clock.phase.load(Ordering::Relaxed) == OPENING {
            self.step_clock.switch_counting(COMPUTE, DATA);
        }
    }

    /// A garbage collection of the interpreter took `ns` in `step` (a
    /// Python worker's `gc.callbacks`): added to the control page.
    pub fn gc_collected(&self, ns: u64, step: u64) {
        if let Some(a) = &self.attached {
            a.store.page().record_gc(ns, step);
        }
    }

    /// This step's compute waited `ns` on collectives that ran beside it
    /// (DDP all-reduces each gradient bucket while the backward pass goes
    /// on, and the pass ends once every bucket is reduced): counted as
    /// collective, not compute, when the step is published.
    pub fn collective_overlapped(&self, ns: u64) {
        self.step_clock.overlapped.fetch_add(ns, Ordering::Relaxed);
    }

    /// A collective begins; returns what to give [`Runtime::time_collective_ends`].
    pub(super) fn time_collective_begins(&self) -> usize {
        self.step_clock.switch(COLLECTIVE)
    }

    pub(super) fn time_collective_ends(&self, before: usize) {
        self.step_clock.switch(before);
    }

    /// The start-update fence begins (its wait counts in no phase), and
    /// the update after it.
    pub(super) fn time_fence(&self) {
        self.step_clock.switch(NONE);
    }

    pub(super) fn time_update_begins(&self) {
        self.step_clock.switch(UPDATE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread::sleep;
    use std::time::Duration;

    #[test]
    fn each_phase_gets_its_segments_and_the_step_the_whole() {
        let c = StepClock::default();
        assert_eq!(c.begin(), None, "no step before the first");
        sleep(Duration::from_millis(4)); // data
        c.switch_counting(COMPUTE, DATA);
        sleep(Duration::from_millis(6)); // compute
        let before = c.switch(COLLECTIVE);
        sleep(Duration::from_millis(8));
        c.switch(before);
        c.switch(NONE); // the fence
        sleep(Duration::from_millis(3));
        c.switch(UPDATE);
        sleep(Duration::from_millis(5));
        c.switch(NONE);
        let ns = c.begin().expect("the step timed");
        let ms = |i: usize| ns[i] / 1_000_000;
        assert!(
            ms(DATA) >= 4 && ms(COMPUTE) >= 6 && ms(COLLECTIVE) >= 8 && ms(UPDATE) >= 5,
            "{ns:?}"
        );
        let parts: u64 = ns[..STEP].iter().sum();
        assert!(
            ns[STEP] >= parts + 3_000_000,
            "the fence is in the step only: {ns:?}"
        );
        // Without `batch_ready`, the opening segment is compute.
        sleep(Duration::from_millis(2));
        c.switch(NONE);
        let ns = c.begin().unwrap();
        assert_eq!(ns[DATA], 0);
        assert!(ns[COMPUTE] >= 2_000_000, "{ns:?}");
    }

    #[test]
    fn a_wait_beside_compute_moves_from_compute_to_collective_and_never_past_it() {
        let c = StepClock::default();
        c.begin();
        sleep(Duration::from_millis(10));
        c.switch(NONE);
        c.overlapped.fetch_add(4_000_000, Ordering::Relaxed);
        let before = c.begin().unwrap();
        sleep(Duration::from_millis(10));
        c.switch(NONE);
        c.overlapped.fetch_add(4_000_000, Ordering::Relaxed);
        let ns = c.begin().unwrap();
        assert_eq!(ns[COLLECTIVE], 4_000_000, "{ns:?}");
        assert!(ns[COMPUTE] >= 6_000_000, "{ns:?}");
        assert_eq!(before[COLLECTIVE], 4_000_000, "{before:?}");
        // More than the compute: all of the compute, no more.
        sleep(Duration::from_millis(2));
        c.switch(NONE);
        c.overlapped.fetch_add(u64::MAX / 2, Ordering::Relaxed);
        let ns = c.begin().unwrap();
        assert_eq!(ns[COMPUTE], 0, "{ns:?}");
        assert!(
            ns[COLLECTIVE] >= 2_000_000 && ns[COLLECTIVE] <= ns[STEP],
            "{ns:?}"
        );
        assert_eq!(c.begin().unwrap()[COLLECTIVE], 0, "taken once");
    }
}
