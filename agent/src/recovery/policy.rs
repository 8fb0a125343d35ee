//! Decisions about one rank, as pure functions of what happened to it and
//! the configuration (no clock reads, no I/O): whether a failed worker is
//! restarted, whether a clean exit is really the end, and what an
//! uncorrectable memory error calls for.

use crate::reaper::ExitStatus;
use hatrain_shared::ha::HaModes;
use std::collections::VecDeque;
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
    on_failure(
        now,
        rank,
        &format!("failed ({status})"),
        status.code(),
        crash_step,
        history,
        modes,
        policy,
    )
}

/// Decides what a failure of `rank` (`what` says how it failed; `code` is
/// the job's exit code if it stops here) after completing `crash_step`
/// steps calls for: a restart in place, within the limits, or the end.
#[allow(clippy::too_many_arguments)]
pub fn on_failure(
    now: Duration,
    rank: usize,
    what: &str,
    code: i32,
    crash_step: u64,
    history: &RankHistory,
    modes: &HaModes,
    policy: &RestartPolicy,
) -> (ExitDecision, String) {
    let stop = |reason: String| (ExitDecision::Stop { rank, code }, reason);
    if !modes.recover {
        return stop(format!(
            "rank {rank} {what} and worker reboot is not enabled: stopping the job"
        ));
    }
    if history.restarts >= policy.max_restarts {
        return stop(format!(
            "rank {rank} {what} after {} restarts, the --max-restarts limit: giving up",
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
            "rank {rank} {what} for the {}th time within {:?}: restart rate limit reached, giving up",
            in_window + 1,
            policy.window
        ));
    }
    if history.last_crash_step == Some(crash_step)
        && history.same_step_crashes + 1 >= policy.max_same_step
    {
        return stop(format!(
            "rank {rank} {what} at step {crash_step} on {} attempts in a row: it would only crash again, giving up",
            history.same_step_crashes + 1
        ));
    }
    (
        ExitDecision::Restart { rank },
        format!(
            "rank {rank} {what} after step {crash_step}: restarting it in place (restart {} of at most {})",
            history.restarts + 1,
            policy.max_restarts
        ),
    )
}

/// Whether an out-of-memory kill of `rank` (`oom`) ends the job: after
/// `restarted` restarts for out-of-memory kills in this job, at most `limit`
/// are allowed, since a restart at the same size usually meets the same
/// end. Returns the reason when it does.
pub fn out_of_memory_again(rank: usize, oom: bool, restarted: u32, limit: u32) -> Option<String> {
    (oom && restarted >= limit).then(|| {
        format!(
            "rank {rank} ran out of memory (killed by the kernel's OOM killer) after {restarted} restart(s) for running out of memory: a restart at the same size would meet the same end, so the job stops"
        )
    })
}

/// Whether rank `rank`'s clean exit after completing `step` steps is a
/// fault: it is when the rank never said it had finished (`finished`: its
/// control page reached the finished phase; a worker that never registered
/// cannot say so and is believed). Returns the reason when it is a fault.
pub fn early_exit(rank: usize, step: u64, finished: bool) -> Option<String> {
    (!finished).then(|| {
        format!(
            "rank {rank} exited 0 after step {step} without finishing its training loop: the exit is a fault, not the end of training"
        )
    })
}

/// Whether the clean exits of `gone` (rank, last step) left ranks waiting
/// for them: `waiting` are live ranks parked for a recovery that nothing
/// started (their collective with the gone rank failed). Then the exits
/// were not the end of training. Returns the reason.
pub fn left_waiting(gone: &[(usize, u64)], waiting: &[(usize, u64)]) -> Option<String> {
    let (&(rank, step), &(w, at)) = (gone.first()?, waiting.first()?);
    Some(format!(
        "rank {rank} exited 0 after step {step}, but rank {w} waits for it at step {at}: its peers have not finished, so the exit is a fault, not the end of training"
    ))
}

/// What an uncorrectable memory error in a registered state part calls for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UceAction {
    /// Every rank returns to s* and the step is recomputed; no restart.
    Repair,
    /// The rank is killed and rebooted (worker reboot).
    Reboot,
    /// Nothing can repair it: the job stops (after the last-words dump).
    Stop,
}

/// The action for a UCE in part `part` of rank `rank`, by mode.
pub fn uce_action(modes: &HaModes, rank: usize, part: &str) -> (UceAction, String) {
    if modes.retry {
        (
            UceAction::Repair,
            format!(
                "rank {rank}: uncorrectable memory error in {part}: every rank returns to s* and recomputes (no restart)"
            ),
        )
    } else if modes.recover {
        (
            UceAction::Reboot,
            format!(
                "rank {rank}: uncorrectable memory error in {part}, step repair not enabled: rebooting the rank"
            ),
        )
    } else {
        (
            UceAction::Stop,
            format!("rank {rank}: uncorrectable memory error in {part} and no repair is enabled"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_allows_the_limit_of_restarts_and_no_more() {
        for restarted in 0..4 {
            for limit in 0..3 {
                let stop = out_of_memory_again(1, true, restarted, limit);
                assert_eq!(stop.is_some(), restarted >= limit, "{restarted} {limit}");
                assert!(out_of_memory_again(1, false, restarted, limit).is_none());
            }
        }
        let why = out_of_memory_again(3, true, 1, 1).unwrap();
        assert!(why.contains("rank 3 ran out of memory"), "{why}");
    }

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
    fn early_exits_are_faults_and_the_last_step_is_not() {
        assert_eq!(early_exit(0, 40, true), None);
        let why = early_exit(1, 14, false).unwrap();
        assert!(
            why.contains("rank 1 exited 0 after step 14 without finishing"),
            "{why}"
        );
        assert_eq!(left_waiting(&[(2, 40)], &[]), None);
        assert_eq!(left_waiting(&[], &[(0, 39)]), None);
        let why = left_waiting(&[(2, 40)], &[(0, 39)]).unwrap();
        assert!(
            why.contains("rank 2 exited 0 after step 40")
                && why.contains("rank 0 waits for it at step 39"),
            "{why}"
        );
    }

    #[test]
    fn uce_actions_by_mode() {
        let m = |retry, recover| HaModes {
            dump: true,
            retry,
            recover,
            elastic: false,
        };
        assert_eq!(
            uce_action(&m(true, true), 1, "exp_avg").0,
            UceAction::Repair
        );
        assert_eq!(
            uce_action(&m(true, false), 1, "exp_avg").0,
            UceAction::Repair
        );
        assert_eq!(
            uce_action(&m(false, true), 1, "exp_avg").0,
            UceAction::Reboot
        );
        let (a, why) = uce_action(&m(false, false), 1, "exp_avg");
        assert_eq!(a, UceAction::Stop);
        assert!(
            why.contains("exp_avg") && why.contains("no repair"),
            "{why}"
        );
    }
}
