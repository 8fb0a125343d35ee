//! The supervisor's seam to the operating system: signals to process
//! groups, and, for a spawner other than the agent's own reaper or the
//! `exec` shims, starting a process and hearing of its exit. The real one
//! is `kill(2)`; the recording fake of the tests holds processes that die
//! of the signals they are sent (or, stubborn, ignore SIGTERM), so the
//! supervisor's stop protocol is tested in milliseconds of paused time.

use super::{ExitEvent, WorkerSpec, signal};
use nix::sys::signal::Signal;
use std::io;
use tokio::sync::mpsc;

/// What the supervisor asks of the operating system.
pub trait Os: Send + Sync + std::fmt::Debug {
    /// Sends `sig` to `pid` (a process group when negative); a process
    /// already gone is not an error.
    fn signal(&self, pid: i32, sig: Signal);
    /// Starts `spec`'s process; its pid. Only for [`super::Spawner::Os`].
    fn start(&self, spec: &WorkerSpec) -> io::Result<i32> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "this OS seam starts no process ({})",
                spec.program.display()
            ),
        ))
    }
    /// Where the exits of the processes it starts go.
    fn watch(&self, _exits: mpsc::UnboundedSender<ExitEvent>) {}
}

/// `kill(2)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealOs;

impl Os for RealOs {
    fn signal(&self, pid: i32, sig: Signal) {
        signal(pid, sig);
    }
}

#[cfg(test)]
pub(crate) mod fake {
    //! A recording fake of the OS.

    use super::*;
    use crate::reaper::ExitStatus;
    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::Mutex;

    #[derive(Debug, Default)]
    struct State {
        next: i32,
        /// Running processes, by pid, with the rank they run.
        running: BTreeMap<i32, usize>,
        /// Pids that ignore SIGTERM.
        stubborn: BTreeSet<i32>,
        /// Ranks whose start fails.
        failing: BTreeSet<usize>,
        /// Every start (rank, pid) and signal (pid, signal), in order.
        started: Vec<(usize, i32)>,
        /// The environment of the last process started.
        env: Vec<(String, String)>,
        signals: Vec<(i32, Signal)>,
        exits: Option<mpsc::UnboundedSender<ExitEvent>>,
    }

    #[derive(Debug, Default)]
    pub struct RecordingOs(Mutex<State>);

    impl RecordingOs {
        fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
            f(&mut self.0.lock().expect("not poisoned"))
        }

        /// Process `pid` ignores SIGTERM.
        pub fn stubborn(&self, pid: i32) {
            self.with(|s| s.stubborn.insert(pid));
        }

        /// Starting `rank` fails from now on.
        pub fn failing(&self, rank: usize) {
            self.with(|s| s.failing.insert(rank));
        }

        /// Process `pid` exits by itself with `status`.
        pub fn exit(&self, pid: i32, status: ExitStatus) {
            self.with(|s| {
                if s.running.remove(&pid).is_some()
                    && let Some(tx) = &s.exits
                {
                    let _ = tx.send(ExitEvent { pid, status });
                }
            });
        }

        pub fn started(&self) -> Vec<(usize, i32)> {
            self.with(|s| s.started.clone())
        }

        pub fn last_env(&self) -> Vec<(String, String)> {
            self.with(|s| s.env.clone())
        }

        pub fn signals(&self) -> Vec<(i32, Signal)> {
            self.with(|s| s.signals.clone())
        }

        pub fn running(&self) -> Vec<i32> {
            self.with(|s| s.running.keys().copied().collect())
        }
    }

    impl Os for RecordingOs {
        fn signal(&self, pid: i32, sig: Signal) {
            self.with(|s| {
                s.signals.push((pid, sig));
                // Every process is alone in its group.
                let pid = pid.abs();
                let dies = sig == Signal::SIGKILL || !s.stubborn.contains(&pid);
                if dies
                    && s.running.remove(&pid).is_some()
                    && let Some(tx) = &s.exits
                {
                    let status = ExitStatus::Signaled(sig as i32);
                    let _ = tx.send(ExitEvent { pid, status });
                }
            });
        }

        fn start(&self, spec: &WorkerSpec) -> io::Result<i32> {
            self.with(|s| {
                if s.failing.contains(&spec.rank) {
                    return Err(io::Error::from_raw_os_error(libc::EAGAIN));
                }
                s.next += 1;
                let pid = 1_000 + s.next;
                s.running.insert(pid, spec.rank);
                s.started.push((spec.rank, pid));
                s.env.clone_from(&spec.env);
                Ok(pid)
            })
        }

        fn watch(&self, exits: mpsc::UnboundedSender<ExitEvent>) {
            self.with(|s| s.exits = Some(exits));
        }
    }
}
