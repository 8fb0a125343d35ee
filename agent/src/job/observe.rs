//! What the loop reads from the control pages for the machine: each rank's
//! [`RankView`], and the faults the workers recorded.

use super::Driver;
use crate::reaper::ExitStatus;
use crate::recovery::{Event, ExitCause, Level, Note, RankView};
use crate::supervisor::Supervisor;
use hatrain_shared::shm::FaultFlags;

impl Driver<'_> {
    /// Every rank of this host, as its process and control page are now.
    pub(super) fn views(&self, sup: &Supervisor) -> Vec<RankView> {
        sup.ranks()
            .iter()
            .map(|&rank| {
                let alive = sup.pid(rank).is_some();
                match self.stores.get(&rank) {
                    None => RankView {
                        alive,
                        ..RankView::absent(rank)
                    },
                    Some(s) => {
                        let p = s.page();
                        RankView {
                            rank,
                            alive,
                            registered: true,
                            phase: p.phase(),
                            step: p.step(),
                            epoch: p.epoch(),
                            heartbeat: p.heartbeat(),
                            in_collective: p.in_collective(),
                            acked: p.acknowledged_directive(),
                            times: p.step_times(),
                            // Read only once the process has ended: its
                            // headers are final then.
                            final_sealed: match alive {
                                true => None,
                                false => s.sealed().first().map(|slot| slot.step),
                            },
                        }
                    }
                }
            })
            .collect()
    }

    /// What else is known of why `rank`'s process `pid` ended with
    /// `status`: a memory error outside its state (the flag is cleared,
    /// since its replacement must not inherit it), or the OOM killer.
    pub(super) fn exit_cause(&mut self, rank: usize, pid: i32, status: ExitStatus) -> ExitCause {
        let fatal_uce = self.stores.get(&rank).is_some_and(|s| {
            let (flags, _) = s.page().faults();
            s.page()
                .clear_faults(FaultFlags::UCE_FATAL | FaultFlags::SIGBUS);
            flags.contains(FaultFlags::UCE_FATAL)
        });
        if fatal_uce {
            ExitCause::FatalUce
        } else if status == ExitStatus::Signaled(libc::SIGKILL) && self.oom.killed(rank, pid) {
            ExitCause::OutOfMemory
        } else {
            ExitCause::Status
        }
    }

    /// The memory errors the workers repaired since the last tick, each
    /// reported once.
    pub(super) fn take_uces(&self, sup: &Supervisor) -> Vec<Event> {
        sup.ranks()
            .iter()
            .filter_map(|&rank| {
                let s = self.stores.get(&rank)?;
                let (flags, site) = s.page().faults();
                if !flags.contains(FaultFlags::UCE_REPAIRABLE) {
                    return None;
                }
                s.page().clear_faults(FaultFlags::UCE_REPAIRABLE);
                let part = self
                    .maps
                    .get(&rank)
                    .and_then(|m| m.parts.get(usize::try_from(site.part).ok()?))
                    .map_or_else(|| format!("part {}", site.part), |p| p.name.clone());
                Some(Event::Uce {
                    rank,
                    part,
                    offset: site.offset,
                })
            })
            .collect()
    }

    /// The failed communicator rebuilds the workers reported, each once.
    pub(super) fn take_rebuild_failures(&self, sup: &Supervisor) -> Vec<Event> {
        sup.ranks()
            .iter()
            .filter_map(|&rank| {
                let p = self.stores.get(&rank)?.page();
                if !p.faults().0.contains(FaultFlags::REBUILD_FAILED) {
                    return None;
                }
                p.clear_faults(FaultFlags::REBUILD_FAILED);
                let (epoch, peer) = p.rebuild_failure();
                Some(Event::RebuildFailed { rank, epoch, peer })
            })
            .collect()
    }
}

/// What a worker's error file (written by torch's `@record`) says ended it:
/// its message's first line.
pub fn root_cause(path: &std::path::Path) -> Option<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)
        .ok()?
        .take(1 << 20)
        .read_to_string(&mut text)
        .ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let m = &v["message"];
    let msg = m["message"].as_str().or_else(|| m.as_str())?;
    Some(msg.lines().next().unwrap_or(msg).to_string())
}

/// Logs a machine note at its level, with the rank and the fault's
/// detail as fields.
pub(super) fn log(n: &Note) {
    fn show(v: &Option<String>) -> Option<tracing::field::DisplayValue<&str>> {
        v.as_deref().map(tracing::field::display)
    }
    let (rank, detail, reason) = (n.rank, show(&n.detail), show(&n.reason));
    let text = n.text.as_str();
    match n.level {
        Level::Info => tracing::info!(rank, detail, reason, "{text}"),
        Level::Warn => tracing::warn!(rank, detail, reason, "{text}"),
        Level::Error => tracing::error!(rank, detail, reason, "{text}"),
    }
}
