//! Deterministic fault injection for tests and demos, from
//! `HATRAIN_FAULT_PLAN`: `RANK:STEP:POINT:ACTION` entries separated by `;`,
//! POINT one of `forward`, `update` (inside the fences), `commit` (halfway
//! through the snapshot copy), `copy` (on the commit thread, before the
//! snapshot of STEP is copied: with `sleepMS`, a copy that starts late, as
//! one staged out of device memory may), `rebuild` (resuming from STEP: with `fail`,
//! the communicator cannot be rebuilt, every time), ACTION one of `stop` (SIGSTOP itself, for a
//! harness to SIGKILL), `kill` (SIGKILL itself), `exit` (exit code 17),
//! `exit0` (exit code 0 before training is over),
//! `hang` (block forever), `sleepMS` (sleep MS milliseconds: a slow rank),
//! `allocMB` (allocate and touch MB MiB that are never freed: a rank that
//! runs out of memory under a limit),
//! `uce-PART-OFFSET` (an uncorrectable memory error at byte OFFSET of state
//! part PART) or `uce-outside` (one outside the registered state). An
//! optional fifth field names the incarnation (restart count) the entry
//! fires in: a number (default 0, the first process) or `*` for every one.
//! STEP may be a range `FIRST-LAST`, every step of it (a rank slow for a
//! while), and POINT `data` (in the data path, before the batch is ready).
//! An entry fires at most once per step and process.
//!
//! The plan is the trainer's, not the runtime's: it reaches into the
//! runtime only through [`Hooks`] (a fault halfway through a commit) and the
//! runtime's [`UceInjector`].

use hatrain_worker::comm::Hooks;
use hatrain_worker::runtime::{UceInjector, hang};
use nix::sys::signal::{Signal, raise};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

/// Environment variable with the fault plan.
pub const ENV_FAULT_PLAN: &str = "HATRAIN_FAULT_PLAN";

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("invalid {ENV_FAULT_PLAN} entry {entry:?}: {detail}")]
    Invalid { entry: String, detail: String },
}

/// Where in a step a planned fault fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    /// Loading the step's batch.
    Data,
    Forward,
    Update,
    Commit,
    /// On the commit thread, before a snapshot's copy begins.
    Copy,
    /// Rebuilding the communicator to resume from the step named.
    Rebuild,
    /// The loop has ended at the step named, its snapshot sealed.
    End,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Action {
    Stop,
    Kill,
    Exit,
    /// Exit with code 0, as if training were over.
    ExitClean,
    /// Block forever, as a rank stuck in a driver call would.
    Hang,
    /// Sleep this many milliseconds: a slow but live rank.
    Sleep(u64),
    /// Allocate and touch this many MiB, and keep them.
    Alloc(u64),
    /// Fail (at `rebuild`: the rank cannot reach its next peer), every time.
    Fail,
    /// An uncorrectable memory error at a byte of a state buffer (by
    /// name), or outside every registered buffer (`None`).
    Uce(Option<String>, usize),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct PlanEntry {
    rank: usize,
    /// The first and last step it fires at.
    steps: (u64, u64),
    point: Point,
    action: Action,
}

/// The planned faults of this rank.
#[derive(Debug, Default)]
pub struct FaultPlan {
    /// Each entry, and the step after the last it fired at (0: none).
    entries: Vec<(PlanEntry, AtomicU64)>,
    /// Where a planned UCE goes: the state map's part names, and the
    /// runtime's injector (set once the runtime is connected).
    targets: OnceLock<(Vec<String>, UceInjector)>,
}

impl FaultPlan {
    /// Parses a plan, keeping the entries of `rank` that fire in
    /// `incarnation`.
    pub fn parse(text: &str, rank: usize, incarnation: u64) -> Result<Self, PlanError> {
        let mut entries = Vec::new();
        for entry in text.split(';').map(str::trim).filter(|e| !e.is_empty()) {
            let bad = |detail: &str| PlanError::Invalid {
                entry: entry.to_string(),
                detail: detail.to_string(),
            };
            let f: Vec<&str> = entry.split(':').collect();
            let (r, s, p, a, inc) = match f[..] {
                [r, s, p, a] => (r, s, p, a, "0"),
                [r, s, p, a, inc] => (r, s, p, a, inc),
                _ => return Err(bad("expected RANK:STEP:POINT:ACTION[:INCARNATION]")),
            };
            let fires_now = match inc {
                "*" => true,
                n => {
                    n.parse::<u64>()
                        .map_err(|_| bad("INCARNATION must be a number or *"))?
                        == incarnation
                }
            };
            let e = PlanEntry {
                rank: r.parse().map_err(|_| bad("RANK is not a number"))?,
                steps: {
                    let n = |x: &str| {
                        x.parse::<u64>()
                            .map_err(|_| bad("STEP is not a number or FIRST-LAST"))
                    };
                    match s.split_once('-') {
                        Some((a, b)) if n(a)? <= n(b)? => (n(a)?, n(b)?),
                        Some(_) => return Err(bad("STEP range FIRST-LAST ends before it begins")),
                        None => (n(s)?, n(s)?),
                    }
                },
                point: match p {
                    "data" => Point::Data,
                    "forward" => Point::Forward,
                    "update" => Point::Update,
                    "commit" => Point::Commit,
                    "copy" => Point::Copy,
                    "rebuild" => Point::Rebuild,
                    "end" => Point::End,
                    _ => {
                        return Err(bad(
                            "POINT must be data, forward, update, commit, copy, rebuild or end",
                        ));
                    }
                },
                action: match a {
                    "stop" => Action::Stop,
                    "kill" => Action::Kill,
                    "exit" => Action::Exit,
                    "exit0" => Action::ExitClean,
                    "fail" => Action::Fail,
                    "hang" => Action::Hang,
                    "uce-outside" => Action::Uce(None, 0),
                    other => match (other.strip_prefix("sleep"), other.strip_prefix("uce-")) {
                        (Some(ms), _) => {
                            Action::Sleep(ms.parse().map_err(|_| bad("sleepMS needs a number"))?)
                        }
                        (None, None) if other.starts_with("alloc") => Action::Alloc(
                            other["alloc".len()..]
                                .parse()
                                .map_err(|_| bad("allocMB needs a number"))?,
                        ),
                        (_, Some(target)) => {
                            let (buf, off) = target
                                .rsplit_once('-')
                                .ok_or_else(|| bad("uce-BUFFER-OFFSET or uce-outside"))?;
                            Action::Uce(
                                Some(buf.to_string()),
                                off.parse().map_err(|_| bad("OFFSET is not a number"))?,
                            )
                        }
                        _ => {
                            return Err(bad(
                                "ACTION must be stop, kill, exit, exit0, fail, hang, sleepMS, allocMB, uce-BUFFER-OFFSET or uce-outside",
                            ));
                        }
                    },
                },
            };
            if e.rank == rank && fires_now {
                entries.push((e, AtomicU64::new(0)));
            }
        }
        Ok(Self {
            entries,
            targets: OnceLock::new(),
        })
    }

    /// Fires the entry for (`step`, `point`), if any and not yet fired.
    pub fn hit(&self, step: u64, point: Point) {
        for (e, fired) in &self.entries {
            let within = e.steps.0 <= step && step <= e.steps.1;
            if within && e.point == point && fired.fetch_max(step + 1, Ordering::SeqCst) <= step {
                eprintln!(
                    "fault plan: rank {} {:?} at step {step} ({point:?})",
                    e.rank, e.action
                );
                if let Action::Uce(target, offset) = &e.action {
                    self.inject_uce(target.as_deref(), *offset);
                    continue;
                }
                match e.action {
                    Action::Stop => {
                        let _ = raise(Signal::SIGSTOP);
                    }
                    Action::Kill => {
                        let _ = raise(Signal::SIGKILL);
                    }
                    Action::Exit => std::process::exit(17),
                    Action::ExitClean => std::process::exit(0),
                    Action::Hang => hang(),
                    Action::Sleep(ms) => thread::sleep(Duration::from_millis(ms)),
                    Action::Alloc(mib) => {
                        // Touched page by page, so the memory is really used.
                        let mut v: Vec<u8> = Vec::new();
                        for _ in 0..mib {
                            v.extend(std::iter::repeat_n(1u8, 1 << 20));
                        }
                        std::mem::forget(v);
                    }
                    Action::Uce(..) | Action::Fail => {}
                }
            }
        }
    }

    /// Whether a `fail` entry names (`step`, `point`): unlike the others it
    /// holds every time it is asked (a rebuild that keeps failing).
    pub fn fails(&self, step: u64, point: Point) -> bool {
        self.entries.iter().any(|(e, _)| {
            e.steps.0 <= step && step <= e.steps.1 && e.point == point && e.action == Action::Fail
        })
    }

    /// Tells the plan where its UCEs go: the part names of the rank's
    /// state map and the runtime's injector.
    pub fn set_targets(&self, parts: Vec<String>, injector: UceInjector) {
        let _ = self.targets.set((parts, injector));
    }
}

impl FaultPlan {
    /// Injects a UCE into state part `target` at byte `offset` (or, with
    /// `None`, outside every registered buffer).
    pub fn inject_uce(&self, target: Option<&str>, offset: usize) {
        let Some((parts, injector)) = self.targets.get() else {
            eprintln!("fault plan: the runtime is not connected; no UCE injected");
            return;
        };
        match target {
            None => injector.inject_outside(),
            Some(name) => match parts.iter().position(|p| p == name) {
                Some(part) => injector.inject(part, offset),
                None => eprintln!("fault plan: no state part named {name:?}"),
            },
        }
    }
}

impl Hooks for FaultPlan {
    fn before_copy(&self, step: u64) {
        self.hit(step, Point::Copy);
    }
    fn commit_halfway(&self, step: u64) {
        self.hit(step, Point::Commit);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_plans_parse_and_filter() {
        let p =
            FaultPlan::parse("1:12:forward:stop; 2:20:update:kill;1:30:commit:exit", 1, 0).unwrap();
        assert_eq!(p.entries.len(), 2);
        assert_eq!(p.entries[1].0.point, Point::Commit);
        let p = FaultPlan::parse("0:3:forward:alloc512:*", 0, 2).unwrap();
        assert_eq!(p.entries[0].0.action, Action::Alloc(512));
        assert!(
            FaultPlan::parse("1:12:forward:stop", 1, 1)
                .unwrap()
                .entries
                .is_empty()
        );
        let p = FaultPlan::parse("0:5-7:data:sleep0;0:9:data:sleep0", 0, 0).unwrap();
        assert_eq!(p.entries[0].0.steps, (5, 7));
        assert_eq!(p.entries[1].0.steps, (9, 9));
        // Once per step of the range: 5, 6 and 7 each fire once.
        for step in [4, 5, 5, 6, 7, 7, 8] {
            p.hit(step, Point::Data);
        }
        assert_eq!(p.entries[0].1.load(Ordering::SeqCst), 8);
        assert_eq!(
            p.entries[1].1.load(Ordering::SeqCst),
            0,
            "step 9 not reached"
        );
        for bad in [
            "1:12:forward",
            "1:7-5:forward:sleep1",
            "1:5-x:forward:sleep1",
            "x:1:forward:stop",
            "1:1:sideways:stop",
            "1:1:forward:nap",
            "1:1:forward:allocx",
        ] {
            let e = FaultPlan::parse(bad, 1, 0).unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
    }
}
