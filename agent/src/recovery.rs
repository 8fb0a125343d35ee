//! Recovery decisions, as pure functions of the job's state and
//! configuration (no clock reads, no I/O): what to do when a worker exits,
//! and which step every rank can return to.

use crate::reaper::ExitStatus;
use hatrain_shared::ha::HaModes;
use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

/// Limits on restarting a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Restarts allowed per rank over the whole job.
    pub max_restarts: u32,
    /// At most `max_in_window` restarts of one rank within `window`.
    pub window: Duration,
    pub max_in_window: u32,
    /// A rank that crashes at the same step this many times in a row is
    /// given up on: restarting it again would only repeat the crash.
    pub max_same_step: u32,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            max_restarts: 10,
            window: Duration::from_secs(60),
            max_in_window: 5,
            max_same_step: 3,
        }
    }
}

/// What happened to one rank so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankHistory {
    pub restarts: u32,
    /// Times (since the job started) of recent restarts.
    pub recent: VecDeque<Duration>,
    /// Step of the last crash and how many crashes in a row hit it.
    pub last_crash_step: Option<u64>,
    pub same_step_crashes: u32,
}

impl RankHistory {
    /// Records a crash at `step` that is being restarted at `now`.
    pub fn record_restart(&mut self, now: Duration, step: u64, policy: &RestartPolicy) {
        self.restarts += 1;
        self.recent.push_back(now);
        while self
            .recent
            .front()
            .is_some_and(|t| now.saturating_sub(*t) > policy.window)
        {
            self.recent.pop_front();
        }
        if self.last_crash_step == Some(step) {
            self.same_step_crashes += 1;
        } else {
            self.last_crash_step = Some(step);
            self.same_step_crashes = 1;
        }
    }
}

/// What to do after a worker exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitDecision {
    /// Others still run normally.
    Wait,
    /// Every worker finished successfully.
    Finished,
    /// Restart the rank in place and recover the job.
    Restart { rank: usize },
    /// Stop the job, ending with `code`.
    Stop { rank: usize, code: i32 },
}

/// Decides what the exit of `rank` (with `status`, after completing
/// `crash_step` steps) means. `running` is how many other workers still run.
#[allow(clippy::too_many_arguments)]
pub fn on_exit(
    now: Duration,
    rank: usize,
    status: ExitStatus,
    crash_step: u64,
    running: usize,
    history: &RankHistory,
    modes: &HaModes,
    policy: &RestartPolicy,
) -> (ExitDecision, String) {
    if status.success() {
        return if running == 0 {
            (
                ExitDecision::Finished,
                "every worker finished successfully".into(),
            )
        } else {
            (
                ExitDecision::Wait,
                format!("rank {rank} finished; {running} worker(s) still running"),
            )
        };
    }
    let stop = |reason: String| {
        (
            ExitDecision::Stop {
                rank,
                code: status.code(),
            },
            reason,
        )
    };
    if !modes.recover {
        return stop(format!(
            "rank {rank} failed ({status}) and worker reboot is not enabled: stopping the job"
        ));
    }
    if history.restarts >= policy.max_restarts {
        return stop(format!(
            "rank {rank} failed ({status}) after {} restarts, the --max-restarts limit: giving up",
            history.restarts
        ));
    }
    let in_window = history
        .recent
        .iter()
        .filter(|t| now.saturating_sub(**t) <= policy.window)
        .count() as u32;
    if in_window >= policy.max_in_window {
        return stop(format!(
            "rank {rank} failed ({status}) for the {}th time within {:?}: restart rate limit reached, giving up",
            in_window + 1,
            policy.window
        ));
    }
    if history.last_crash_step == Some(crash_step)
        && history.same_step_crashes + 1 >= policy.max_same_step
    {
        return stop(format!(
            "rank {rank} failed ({status}) at step {crash_step} on {} attempts in a row: it would only crash again, giving up",
            history.same_step_crashes + 1
        ));
    }
    (
        ExitDecision::Restart { rank },
        format!(
            "rank {rank} failed ({status}) after step {crash_step}: restarting it in place (restart {} of at most {})",
            history.restarts + 1,
            policy.max_restarts
        ),
    )
}

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

/// How long a rank may go without progress (a completed step or a
/// heartbeat at a step boundary) before it is declared hung.
pub fn hang_bound(policy: &HangPolicy, median_step: Option<Duration>, steps_seen: u64) -> Duration {
    if let Some(fixed) = policy.fixed {
        return fixed;
    }
    match median_step {
        Some(m) if steps_seen >= policy.warmup_steps => m.mul_f64(policy.factor).max(policy.floor),
        _ => policy.startup_grace,
    }
}

/// s\*: the newest step for which every rank has a sealed, verified
/// snapshot. `per_rank[r]` lists rank r's verified snapshot steps.
pub fn consistent_step(per_rank: &[Vec<u64>]) -> Option<u64> {
    let mut iter = per_rank.iter();
    let first: BTreeSet<u64> = iter.next()?.iter().copied().collect();
    iter.fold(first, |acc, steps| {
        let s: BTreeSet<u64> = steps.iter().copied().collect();
        acc.intersection(&s).copied().collect()
    })
    .last()
    .copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KILL: ExitStatus = ExitStatus::Signaled(9);
    const RECOVER: HaModes = HaModes {
        dump: true,
        retry: false,
        recover: true,
        elastic: false,
    };

    fn decide(
        h: &RankHistory,
        status: ExitStatus,
        step: u64,
        running: usize,
        modes: HaModes,
    ) -> ExitDecision {
        on_exit(
            Duration::from_secs(1000),
            2,
            status,
            step,
            running,
            h,
            &modes,
            &RestartPolicy::default(),
        )
        .0
    }

    #[test]
    fn exit_decisions() {
        let fresh = RankHistory::default();
        let ok = ExitStatus::Exited(0);
        assert_eq!(decide(&fresh, ok, 5, 0, RECOVER), ExitDecision::Finished);
        assert_eq!(decide(&fresh, ok, 5, 3, RECOVER), ExitDecision::Wait);
        assert_eq!(
            decide(&fresh, ok, 5, 3, HaModes::default()),
            ExitDecision::Wait
        );
        for status in [KILL, ExitStatus::Exited(1)] {
            assert_eq!(
                decide(&fresh, status, 5, 3, RECOVER),
                ExitDecision::Restart { rank: 2 }
            );
            assert_eq!(
                decide(&fresh, status, 5, 3, HaModes::default()),
                ExitDecision::Stop {
                    rank: 2,
                    code: status.code()
                }
            );
        }
    }

    #[test]
    fn limits_give_up_with_reasons() {
        let p = RestartPolicy::default();
        // Total restarts.
        let h = RankHistory {
            restarts: p.max_restarts,
            ..Default::default()
        };
        let (d, why) = on_exit(Duration::ZERO, 1, KILL, 9, 3, &h, &RECOVER, &p);
        assert!(
            matches!(d, ExitDecision::Stop { .. }) && why.contains("--max-restarts"),
            "{why}"
        );
        // Rate: five restarts in the last minute.
        let mut h = RankHistory::default();
        for (i, step) in (0..5).zip(10..) {
            h.record_restart(Duration::from_secs(100 + i), step, &p);
        }
        let (d, why) = on_exit(Duration::from_secs(110), 1, KILL, 99, 3, &h, &RECOVER, &p);
        assert!(
            matches!(d, ExitDecision::Stop { .. }) && why.contains("rate limit"),
            "{why}"
        );
        // The same restarts spread over hours are fine.
        let mut h = RankHistory::default();
        for (i, step) in (0..5).zip(10..) {
            h.record_restart(Duration::from_secs(1000 * i), step, &p);
        }
        let (d, _) = on_exit(Duration::from_secs(6000), 1, KILL, 99, 3, &h, &RECOVER, &p);
        assert_eq!(d, ExitDecision::Restart { rank: 1 });
        // The same step again and again.
        let mut h = RankHistory::default();
        h.record_restart(Duration::from_secs(0), 7, &p);
        h.record_restart(Duration::from_secs(100), 7, &p);
        let (d, why) = on_exit(Duration::from_secs(200), 1, KILL, 7, 3, &h, &RECOVER, &p);
        assert!(
            matches!(d, ExitDecision::Stop { .. }) && why.contains("at step 7 on 3 attempts"),
            "{why}"
        );
        let (d, _) = on_exit(Duration::from_secs(200), 1, KILL, 8, 3, &h, &RECOVER, &p);
        assert_eq!(d, ExitDecision::Restart { rank: 1 });
    }

    #[test]
    fn hang_bounds() {
        let p = HangPolicy {
            floor: Duration::from_millis(300),
            startup_grace: Duration::from_secs(60),
            ..HangPolicy::default()
        };
        let ms = Duration::from_millis;
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

    #[test]
    fn consistent_step_cases() {
        assert_eq!(consistent_step(&[]), None);
        assert_eq!(consistent_step(&[vec![4, 5], vec![5, 4], vec![4]]), Some(4));
        assert_eq!(consistent_step(&[vec![4, 5], vec![6, 7]]), None);
        assert_eq!(consistent_step(&vec![vec![9, 10]; 4]), Some(10));
    }

    /// What the `k` slots of a rank hold after a fault: the rank completed
    /// `done` steps; if `sealed_newest`, its commit of `done` finished (else
    /// that copy was torn and does not count). A rank killed inside the
    /// update of `done + 1` has the same slots: a state mid-update is never
    /// sealed, which is why it can never be chosen.
    fn slots(done: u64, sealed_newest: bool, k: u64) -> Vec<u64> {
        let newest = if sealed_newest {
            done
        } else {
            done.saturating_sub(1)
        };
        (0..k).filter_map(|i| newest.checked_sub(i)).collect()
    }

    proptest! {
        #[test]
        fn s_star_with_a_rank_mid_update_and_one_behind(
            s in 2u64..1000,
            ranks in proptest::collection::vec((any::<bool>(), any::<bool>()), 2..9),
            k in 2u64..4,
        ) {
            // Ranks run in lockstep: each has completed s or s-1 steps. No
            // rank completes step s before every rank passed the start-update
            // fence of s, which waits for its commit of s-1: so when some
            // rank completed s, the ranks behind have sealed s-1.
            let someone_ahead = ranks.iter().any(|r| !r.0);
            let per_rank: Vec<Vec<u64>> = ranks
                .iter()
                .map(|&(behind, sealed)| slots(s - u64::from(behind), sealed || (behind && someone_ahead), k))
                .collect();
            let newest: Vec<u64> = per_rank.iter().map(|v| v[0]).collect();
            // s* is the oldest rank's newest sealed step: every other rank
            // still holds it, and no torn or mid-update state is ever used.
            prop_assert_eq!(consistent_step(&per_rank), newest.iter().min().copied());
        }

        #[test]
        fn consistent_step_is_the_newest_common(ranks in proptest::collection::vec(proptest::collection::vec(0u64..20, 0..4), 1..6)) {
            let got = consistent_step(&ranks);
            let common = (0..20u64).filter(|s| ranks.iter().all(|r| r.contains(s))).max();
            prop_assert_eq!(got, common);
        }
    }
}
