//! Exits that never came: a rank's exit is reported where its host's
//! agent sends it, and a controller lost before it took the report leaves
//! its successor seeing the rank dead with no exit. Seen so for
//! [`EXIT_UNREPORTED`], it failed all the same.

use super::*;

/// How long a registered rank may be seen dead before its exit, never
/// reported, is taken as a crash.
pub const EXIT_UNREPORTED: Duration = Duration::from_secs(2);

impl Machine {
    /// `rank`'s exit came and waits to be decided (the controller holds
    /// it while it may not act): it is not an unreported one.
    pub fn exit_held(&mut self, rank: usize) {
        self.exits.insert(rank);
    }

    /// A registered rank seen dead for [`EXIT_UNREPORTED`] whose exit never
    /// came (it was reported to a controller lost before it took it, and
    /// a successor inherited the job) failed all the same: it is restarted
    /// like a crash, or its peers would wait for it for ever.
    pub(super) fn unreported_exits(&mut self, now: Duration) {
        if matches!(self.state, State::Done(_)) {
            return;
        }
        let dead: Vec<usize> = self
            .participants()
            .into_iter()
            .filter(|r| {
                let v = self.view(*r);
                !v.alive && v.registered && !self.exits.contains(r)
            })
            .collect();
        self.unreported.retain(|r, _| dead.contains(r));
        for r in dead {
            let since = *self.unreported.entry(r).or_insert(now);
            if now.saturating_sub(since) < EXIT_UNREPORTED {
                continue;
            }
            self.unreported.remove(&r);
            self.exits.insert(r);
            if let Some(v) = self.views.get_mut(&r) {
                v.alive = false;
            }
            let step = self.view(r).step;
            let detail = format!(
                "its process is gone and its exit was not reported within {EXIT_UNREPORTED:?} (it went to a controller that was lost)"
            );
            self.killed.remove(&r);
            self.failure(
                now,
                r,
                FaultKind::Crash,
                detail,
                "failed (its exit status was lost)",
                None,
                step,
            );
        }
    }
}
