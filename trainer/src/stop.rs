//! A rank's compute stopped when its job is paused.
//!
//! On an accelerator a paused job's device is stopped: the queued kernels
//! are dropped and the host thread waiting on them returns at once (as
//! MindIO TTP stops an NPU before it repairs the job). Without that a rank
//! whose peer has died computes to the end of its forward and backward
//! before its first collective finds the communicator aborted, and the
//! whole job waits for it: the larger the model, the longer.
//!
//! [`Stop`] is that signal for the reference trainer. Aborting a
//! communicator sets it (see [`crate::collective::AbortHandle`]); the
//! model's forward and backward look at it between layers, and an emulated
//! device's wait ([`crate::emulate`]) wakes on it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Set once, from any thread; read and waited on by the compute.
#[derive(Debug, Default)]
pub struct Stop {
    set: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

impl Stop {
    /// Stops the compute: every later [`Stop::is_set`] is true and every
    /// [`Stop::wait`] returns.
    pub fn set(&self) {
        self.set.store(true, Ordering::SeqCst);
        // Taken so that a waiter between its check and its wait is not
        // missed.
        drop(self.lock.lock().unwrap_or_else(PoisonError::into_inner));
        self.wake.notify_all();
    }

    pub fn is_set(&self) -> bool {
        self.set.load(Ordering::SeqCst)
    }

    /// Waits `time`, holding no core, or less when stopped: `true` when it
    /// was stopped.
    pub fn wait(&self, time: Duration) -> bool {
        let until = Instant::now() + time;
        let mut guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        while !self.is_set() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            guard = self
                .wake
                .wait_timeout(guard, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_wait_runs_its_time_unless_stopped() {
        let stop = Stop::default();
        let t = Instant::now();
        assert!(!stop.wait(Duration::from_millis(20)));
        assert!(t.elapsed() >= Duration::from_millis(20));
        stop.set();
        assert!(stop.is_set());
        assert!(stop.wait(Duration::from_secs(3600)));
    }

    #[test]
    fn a_stop_from_another_thread_ends_a_long_wait() {
        let stop = Arc::new(Stop::default());
        let setter = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                stop.set();
            })
        };
        // An hour unless the stop ends it: the test would hang, not pass.
        assert!(stop.wait(Duration::from_secs(3600)));
        setter.join().unwrap();
    }
}
