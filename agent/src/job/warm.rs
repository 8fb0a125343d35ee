//! Warm standbys on the job's side: a standby parks with a
//! [`Request::Standby`](hatrain_shared::control::Request::Standby), and a
//! rank the recovery restarts is handed to the oldest parked one, which
//! registers as that rank next (see `crate::supervisor::warm`).

use super::Driver;
use crate::supervisor::{Supervisor, SupervisorError};
use hatrain_shared::control::Response;
use tokio::sync::oneshot;

impl Driver<'_> {
    /// Standby `pid` has done its start-up: it waits for a rank.
    pub(super) fn park_standby(
        &mut self,
        sup: &Supervisor,
        pid: u32,
        reply: oneshot::Sender<Response>,
    ) {
        let running = i32::try_from(pid).is_ok_and(|p| sup.is_standby(p));
        if !running {
            let _ = reply.send(Response::Error {
                message: format!("pid {pid} is not a warm standby of this job"),
            });
            return;
        }
        tracing::info!(pid, "warm standby parked");
        self.parked.push_back((pid, reply));
    }

    /// Restarts `rank` as its `restarts`-th process: in a parked warm
    /// standby if one is left (elastic places excepted), else a fresh one.
    /// The pid that now plays `rank`, and whether it was a standby.
    pub(super) fn restart_rank(
        &mut self,
        sup: &mut Supervisor,
        rank: usize,
        restarts: u32,
    ) -> Result<(i32, bool), SupervisorError> {
        let place = self.decider.place_of(rank);
        // Only a rank whose process is gone can take a standby.
        let free = place.is_none() && sup.pid(rank).is_none();
        while free && let Some((pid, reply)) = self.parked.pop_front() {
            // A standby that died since it parked is no longer in the
            // supervisor's pool (its exit was reaped): dropped here.
            let Ok(p) = i32::try_from(pid) else { continue };
            if !sup.promote(rank, p) {
                continue;
            }
            let local_rank = sup.local_rank(rank).unwrap_or(0);
            // If it died just now, its exit comes next, as the rank's.
            let _ = reply.send(Response::Assigned {
                rank,
                local_rank,
                restarts,
                error_file: sup.error_file(rank),
            });
            return Ok((p, true));
        }
        sup.respawn(rank, restarts, place).map(|pid| (pid, false))
    }
}
