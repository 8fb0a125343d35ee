//! The job's clock: the time since the job started, which the recovery
//! machine runs on, also on an agent that started later (a successor, the
//! next agent of a served job).

use std::time::Duration;

/// The job's clock for an agent `uptime` into its life, which began at
/// `agent_started_unix_s`, in a job that began at `job_started_unix_s`.
pub(super) fn job_clock(
    uptime: Duration,
    agent_started_unix_s: f64,
    job_started_unix_s: f64,
) -> Duration {
    let ahead = agent_started_unix_s - job_started_unix_s;
    Duration::try_from_secs_f64((uptime.as_secs_f64() + ahead).max(0.0)).unwrap_or(uptime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_job_clock_counts_from_the_jobs_start_whichever_agent_reads_it() {
        let s = Duration::from_secs;
        // The agent that started the job.
        assert_eq!(job_clock(s(5), 1_000.0, 1_000.0), s(5));
        // The next agent of a served job, an hour in.
        assert_eq!(job_clock(s(5), 4_600.0, 1_000.0), s(3_605));
        // A successor whose agent started just before the job did.
        assert_eq!(job_clock(s(5), 999.0, 1_000.0), s(4));
        assert_eq!(job_clock(s(0), 999.0, 1_000.0), Duration::ZERO);
    }
}
