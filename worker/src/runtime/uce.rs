//! The runtime's side of uncorrectable memory errors: reporting a torn
//! step to the agent, whether the SIGBUS handler repaired the memory or the
//! device reported the error.

use super::Runtime;
use hatrain_shared::shm::UceSite;

impl Runtime {
    /// The UCE the SIGBUS handler repaired since the last check, if any:
    /// the live state is then torn and the step must be recomputed from the
    /// last consistent snapshot. Reports it in the control page.
    pub fn check_uce(&self) -> Option<crate::uce::Uce> {
        let t = std::time::Instant::now();
        let pending = crate::uce::take_pending();
        self.held_clock.add(t);
        let u = pending?;
        let name = self.part_name(u.part);
        eprintln!(
            "rank {}: uncorrectable memory error in {name} at byte {}: the step is thrown away and recomputed",
            self.rank, u.offset
        );
        self.record_uce(u.part, u.offset);
        Some(u)
    }

    /// An uncorrectable memory error the device reported (an NPU runtime's
    /// `UCE ERROR`, raised in the step) rather than a SIGBUS on host
    /// memory: the step is torn, as after a repaired SIGBUS, and is thrown
    /// away and recomputed from the last consistent snapshot. `part` is
    /// the part the device named, if it could (else the largest, the
    /// likeliest to hold the address). Reports it in the control page, where
    /// the agent takes it as a UCE of this rank.
    pub fn report_device_uce(&self, part: Option<usize>, why: &str) {
        let part = part
            .filter(|&p| p < self.map.parts.len())
            .or_else(|| self.map.largest_part())
            .unwrap_or(0);
        let name = self.part_name(part);
        eprintln!(
            "rank {}: the device reported an uncorrectable memory error ({why}): taken as one in {name}; the step is thrown away and recomputed",
            self.rank
        );
        self.record_uce(part, 0);
    }

    fn part_name(&self, part: usize) -> &str {
        self.map.parts.get(part).map_or("?", |p| p.name.as_str())
    }

    /// Tells the agent (in the control page) that the step is torn by a
    /// UCE at byte `offset` of `part`.
    fn record_uce(&self, part: usize, offset: usize) {
        if let Some(a) = &self.attached {
            a.store.page().record_uce(UceSite {
                part: part as u64,
                offset: offset as u64,
            });
        }
    }
}
