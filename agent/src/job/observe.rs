//! What the loop reads from the control pages for the machine: each rank's
//! [`RankView`], and the faults the workers recorded.

use super::Driver;
use crate::recovery::{Event, RankView};
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
                        }
                    }
                }
            })
            .collect()
    }

    /// Whether `rank`'s process died of a memory error outside its state
    /// (and clears the flag, which its replacement must not inherit).
    pub(super) fn take_fatal_uce(&self, rank: usize) -> bool {
        let Some(s) = self.stores.get(&rank) else {
            return false;
        };
        let (flags, _) = s.page().faults();
        let fatal = flags.contains(FaultFlags::UCE_FATAL);
        s.page()
            .clear_faults(FaultFlags::UCE_FATAL | FaultFlags::SIGBUS);
        fatal
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
