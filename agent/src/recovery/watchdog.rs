//! The hang watchdog, as pure state and functions of time: it follows each
//! rank's progress (a completed step or a heartbeat at a step boundary),
//! learns the job's step time, and names the ranks to kill.
//!
//! # Who is blamed
//!
//! A rank waiting in a collective is waiting for a peer. So:
//! - stalled ranks outside a collective are blamed first;
//! - while every stalled rank waits in a collective, the ranks they wait
//!   for are the live ranks outside one: those of them without progress for
//!   the job's adaptive bound are blamed, whatever start-up grace a freshly
//!   restarted one would have for itself; the waiting ranks are never
//!   blamed while such a rank exists;
//! - only when every live rank waits in a collective (they wait for each
//!   other) are the stalled ones blamed.

use super::RankView;
use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

/// When a rank counts as hung.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HangPolicy {
    /// A fixed bound (`--hang-timeout-secs`), instead of the adaptive one.
    pub fixed: Option<Duration>,
    /// The adaptive bound is `factor` × the median step time, but never
    /// less than `floor`.
    pub factor: f64,
    pub floor: Duration,
    /// Until a rank has completed `warmup_steps` steps (model build,
    /// checkpoint load, first step), it has this long.
    pub startup_grace: Duration,
    pub warmup_steps: u64,
}

impl Default for HangPolicy {
    fn default() -> Self {
        Self {
            fixed: None,
            factor: 10.0,
            floor: Duration::from_secs(30),
            startup_grace: Duration::from_secs(600),
            warmup_steps: 3,
        }
    }
}

/// How long a rank may go without progress before it is declared hung.
pub fn hang_bound(policy: &HangPolicy, median_step: Option<Duration>, steps_seen: u64) -> Duration {
    if let Some(fixed) = policy.fixed {
        return fixed;
    }
    match median_step {
        Some(m) if steps_seen >= policy.warmup_steps => m.mul_f64(policy.factor).max(policy.floor),
        _ => policy.startup_grace,
    }
}

/// The watchdog's view of one rank's process.
#[derive(Debug, Clone, Copy)]
struct Progress {
    step: u64,
    heartbeat: u64,
    /// When the rank last made progress.
    since: Duration,
    last_step_at: Duration,
    /// Steps this process has been seen to complete.
    steps_seen: u64,
}

/// Step durations kept for the median.
const SAMPLES: usize = 256;

/// A rank the watchdog blames, and what it saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Culprit {
    pub rank: usize,
    pub seen: String,
}

/// Progress of every rank, and the job's recent step times.
#[derive(Debug, Default)]
pub struct Watch {
    ranks: HashMap<usize, Progress>,
    samples: VecDeque<Duration>,
}

impl Watch {
    /// Takes in a tick's views: a completed step or a heartbeat is progress.
    pub fn observe(&mut self, now: Duration, views: &[RankView]) {
        for v in views {
            if !v.alive || !v.registered {
                continue;
            }
            let p = self.ranks.entry(v.rank).or_insert(Progress {
                step: v.step,
                heartbeat: v.heartbeat,
                since: now,
                last_step_at: now,
                steps_seen: 0,
            });
            if v.step > p.step {
                let n = u32::try_from(v.step - p.step).unwrap_or(u32::MAX);
                self.samples
                    .push_back(now.saturating_sub(p.last_step_at) / n);
                if self.samples.len() > SAMPLES {
                    self.samples.pop_front();
                }
                p.steps_seen += u64::from(n);
                p.last_step_at = now;
            }
            if v.step != p.step || v.heartbeat != p.heartbeat {
                p.since = now;
                p.step = v.step;
                p.heartbeat = v.heartbeat;
            }
        }
    }

    /// The median recent step time.
    pub fn median(&self) -> Option<Duration> {
        let mut sorted: Vec<Duration> = self.samples.iter().copied().collect();
        sorted.sort();
        sorted.get(sorted.len() / 2).copied()
    }

    /// Paused time is not a hang: every rank's clock starts again at `now`;
    /// each keeps the steps it was seen to complete.
    pub fn restart_clocks(&mut self, now: Duration) {
        for p in self.ranks.values_mut() {
            p.since = now;
            p.last_step_at = now;
        }
    }

    /// `rank` runs in a new process: its start-up grace applies again.
    pub fn new_process(&mut self, rank: usize) {
        self.ranks.remove(&rank);
    }

    /// The ranks to kill as hung (see the module doc), except `spared`
    /// (already being killed).
    pub fn culprits(
        &self,
        now: Duration,
        views: &[RankView],
        policy: &HangPolicy,
        spared: &HashSet<usize>,
    ) -> Vec<Culprit> {
        let median = self.median();
        let job_bound = hang_bound(policy, median, u64::MAX);
        let watched: Vec<(&RankView, Duration, Duration)> = views
            .iter()
            .filter(|v| v.alive && v.registered)
            .filter_map(|v| {
                let p = self.ranks.get(&v.rank)?;
                let stall = now.saturating_sub(p.since);
                Some((v, stall, hang_bound(policy, median, p.steps_seen)))
            })
            .collect();
        let steps_seen = |rank: usize| self.ranks.get(&rank).map_or(0, |p| p.steps_seen);
        let seen = |v: &RankView, stall: Duration, bound: Duration, extra: &str| Culprit {
            rank: v.rank,
            seen: format!(
                "no progress for {:.1} s (bound {:.1} s) in phase {:?}{} after step {} ({} step(s) in this process){extra}",
                stall.as_secs_f64(),
                bound.as_secs_f64(),
                v.phase,
                if v.in_collective {
                    ", waiting in a collective"
                } else {
                    ""
                },
                v.step,
                steps_seen(v.rank)
            ),
        };
        let stalled: Vec<&(&RankView, Duration, Duration)> = watched
            .iter()
            .filter(|(v, s, b)| s > b && !spared.contains(&v.rank))
            .collect();
        if stalled.is_empty() {
            return Vec::new();
        }
        let outside: Vec<Culprit> = stalled
            .iter()
            .filter(|(v, ..)| !v.in_collective)
            .map(|(v, s, b)| seen(v, *s, *b, ""))
            .collect();
        if !outside.is_empty() {
            return outside;
        }
        // Every stalled rank waits in a collective: for the live ranks that
        // are not in one (a spared one too: it is being killed already).
        let waiting: Vec<usize> = stalled.iter().map(|(v, ..)| v.rank).collect();
        let awaited: Vec<&(&RankView, Duration, Duration)> =
            watched.iter().filter(|(v, ..)| !v.in_collective).collect();
        if awaited.is_empty() {
            return stalled
                .iter()
                .map(|(v, s, b)| seen(v, *s, *b, ""))
                .collect();
        }
        awaited
            .iter()
            .filter(|(v, s, _)| *s > job_bound && !spared.contains(&v.rank))
            .map(|(v, s, _)| {
                seen(
                    v,
                    *s,
                    job_bound,
                    &format!(", while rank(s) {waiting:?} wait for it in a collective"),
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hatrain_shared::shm::Phase;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    fn view(rank: usize, step: u64, beat: u64, in_collective: bool) -> RankView {
        RankView {
            rank,
            alive: true,
            registered: true,
            phase: Phase::Computing,
            step,
            epoch: 0,
            heartbeat: beat,
            in_collective,
            acked: None,
            times: Default::default(),
            final_sealed: None,
        }
    }

    fn policy() -> HangPolicy {
        HangPolicy {
            floor: ms(300),
            startup_grace: Duration::from_secs(60),
            ..HangPolicy::default()
        }
    }

    #[test]
    fn hang_bounds() {
        let p = policy();
        // Warm-up: the grace, whatever the median.
        assert_eq!(hang_bound(&p, Some(ms(100)), 2), Duration::from_secs(60));
        assert_eq!(hang_bound(&p, None, 50), Duration::from_secs(60));
        // Adaptive, with the floor.
        assert_eq!(hang_bound(&p, Some(ms(100)), 3), ms(1000));
        assert_eq!(hang_bound(&p, Some(ms(10)), 3), ms(300));
        // A rank slowed to twice the median is far inside the bound.
        assert!(ms(200) < hang_bound(&p, Some(ms(100)), 10));
        let fixed = HangPolicy {
            fixed: Some(ms(5)),
            ..p
        };
        assert_eq!(hang_bound(&fixed, None, 0), ms(5));
    }

    /// Three ranks stepping every 100 ms for `steps` steps from `t0`.
    fn run(w: &mut Watch, t0: u64, steps: u64, ranks: &[usize]) -> u64 {
        let mut t = t0;
        for s in 1..=steps {
            t += 100;
            let views: Vec<RankView> = ranks.iter().map(|&r| view(r, s, s, false)).collect();
            w.observe(ms(t), &views);
        }
        t
    }

    #[test]
    fn a_rank_outside_a_collective_is_blamed_not_those_waiting_for_it() {
        let mut w = Watch::default();
        let t = run(&mut w, 0, 10, &[0, 1, 2]);
        // Rank 2 hangs in its forward pass after step 10; ranks 0 and 1 get
        // one step further and wait for it in a collective. The waiting ranks
        // made their last progress a little *before* the hung rank did.
        let before = vec![
            view(0, 10, 11, true),
            view(1, 10, 11, true),
            view(2, 10, 11, false),
        ];
        w.observe(ms(t + 5), &before);
        let hung = vec![
            view(0, 10, 11, true),
            view(1, 10, 11, true),
            view(2, 10, 12, false),
        ];
        w.observe(ms(t + 7), &hung);
        let spared = HashSet::new();
        // The waiting ranks are past the 1 s bound, the hung one (2 ms
        // behind) not yet: nobody is blamed, certainly not the waiting ones.
        assert!(
            w.culprits(ms(t + 1006), &hung, &policy(), &spared)
                .is_empty()
        );
        let c = w.culprits(ms(t + 1010), &hung, &policy(), &spared);
        assert_eq!(c.iter().map(|c| c.rank).collect::<Vec<_>>(), vec![2]);
        assert!(c[0].seen.contains("phase Computing"), "{c:?}");
    }

    #[test]
    fn a_fresh_rank_in_its_startup_grace_is_blamed_when_its_peers_wait_for_it() {
        let mut w = Watch::default();
        let t = run(&mut w, 0, 10, &[0, 1, 2]);
        // Rank 2 was restarted: a new process with its start-up grace (60 s).
        w.new_process(2);
        w.restart_clocks(ms(t));
        w.observe(
            ms(t),
            &[
                view(0, 10, 11, false),
                view(1, 10, 11, false),
                view(2, 10, 0, false),
            ],
        );
        // It completes one step, then hangs; its peers wait for it.
        let t = t + 100;
        let v = vec![
            view(0, 11, 12, true),
            view(1, 11, 12, true),
            view(2, 11, 1, false),
        ];
        w.observe(ms(t), &v);
        let spared = HashSet::new();
        assert!(w.culprits(ms(t + 900), &v, &policy(), &spared).is_empty());
        let c = w.culprits(ms(t + 1100), &v, &policy(), &spared);
        assert_eq!(
            c.iter().map(|c| c.rank).collect::<Vec<_>>(),
            vec![2],
            "{c:?}"
        );
        assert!(
            c[0].seen.contains("while rank(s) [0, 1] wait for it"),
            "{c:?}"
        );
        // Once it is being killed, the waiting ranks are not blamed for it.
        let spared: HashSet<usize> = [2].into();
        assert!(w.culprits(ms(t + 1200), &v, &policy(), &spared).is_empty());
    }

    #[test]
    fn ranks_that_all_wait_on_each_other_are_blamed_and_slow_ones_are_not() {
        let mut w = Watch::default();
        let t = run(&mut w, 0, 10, &[0, 1]);
        let v = vec![view(0, 10, 11, true), view(1, 10, 11, true)];
        w.observe(ms(t), &v);
        let c = w.culprits(ms(t + 1100), &v, &policy(), &HashSet::new());
        assert_eq!(c.len(), 2);
        // A slow rank that still heartbeats is never blamed.
        let mut w = Watch::default();
        let t = run(&mut w, 0, 10, &[0, 1]);
        for k in 1..30u64 {
            w.observe(
                ms(t + k * 100),
                &[view(0, 10, 11 + k, false), view(1, 10, 11, true)],
            );
        }
        let v = vec![view(0, 10, 40, false), view(1, 10, 11, true)];
        let c = w.culprits(ms(t + 3000), &v, &policy(), &HashSet::new());
        assert!(c.is_empty(), "{c:?}");
    }
}
