//! A standby host: it takes the ranks of a lost host and fills their
//! stores from their peer replicas, which the hosts holding them hand over.

use super::Driver;
use super::decider::{Adopt, Give, Mirror};
use crate::supervisor::Supervisor;

impl Driver<'_> {
    /// Streams the replicas this host holds of lost host `g.node`'s ranks
    /// to the standby `g.to`.
    pub(super) fn give(&self, g: &Give) {
        let Some(p) = &self.peers else {
            return;
        };
        let Some(r) = &p.replicator else {
            return;
        };
        // The standby plays the lost node from now on.
        r.replace(g.node, g.to);
        let held: Vec<u64> = r
            .report()
            .held
            .into_iter()
            .filter(|h| h.from_node == g.node)
            .map(|h| h.rank)
            .collect();
        if held.is_empty() {
            return;
        }
        let Some(endpoint) = p.standbys.lock().expect("not poisoned").get(&g.to).cloned() else {
            tracing::error!(
                standby = g.to,
                "the standby's address is not known: its ranks cannot be filled from here"
            );
            return;
        };
        let mut stores = Vec::new();
        let maps = r.replica_maps();
        for rank in held {
            let path = crate::replicator::inbox::replica_path(self.dir.path(), rank);
            match hatrain_shared::shm::Store::open(&path) {
                Ok(s) => stores.push((rank, std::sync::Arc::new(s), maps.get(&rank).cloned())),
                Err(e) => {
                    tracing::error!(rank, error = %e, "a replica to hand over cannot be opened")
                }
            }
        }
        tracing::info!(standby = g.to, ranks = ?stores.iter().map(|s| s.0).collect::<Vec<_>>(), "handing the replicas of a lost host to a standby");
        r.hand_over(g.to, endpoint, stores);
    }

    /// The standbys that hold ranks and filled them all (as `m` says) are
    /// streamed to from now on.
    pub(super) fn standbys_ready(&self, m: &Mirror) {
        let Some(r) = self.peers.as_ref().and_then(|p| p.replicator.as_ref()) else {
            return;
        };
        let hosts: std::collections::BTreeSet<u64> = m.placement.values().copied().collect();
        for h in hosts {
            let filling = m
                .placement
                .iter()
                .any(|(rank, &n)| n == h && m.filling.contains(rank));
            if !filling {
                r.ready(h);
            }
        }
    }

    /// A standby takes a lost host's ranks: they are started when the
    /// controller says, and their stores filled from their replicas before
    /// their registrations go on.
    pub(super) fn adopt(&mut self, sup: &mut Supervisor, a: Adopt) {
        tracing::warn!(node = a.node, ranks = ?a.ranks, "taking the ranks of a lost host");
        // The ranks' own specs: the lost host may itself have been a
        // standby playing another node's ranks.
        sup.adopt((self.specs_for)(&a.ranks));
        if let Some(r) = self.peers.as_ref().and_then(|p| p.replicator.as_ref()) {
            for &rank in &a.ranks {
                r.adopt_rank(rank as u64);
            }
            // It streams the ranks it takes where the lost host streamed
            // its own, and holds what the lost host held.
            r.replace(a.node, r.node());
            if !a.fill {
                // Ranks joining a growing group have nothing to fill.
                r.filled();
            }
        }
        if !a.fill {
            self.filled.extend(&a.ranks);
            self.joining.extend(&a.ranks);
        }
        self.adopted.extend(a.ranks);
    }

    /// The registrations of adopted ranks whose stores can be filled from
    /// their replicas now: filled, then passed on to the controller.
    pub(super) fn fill_adopted(&mut self, sup: &mut Supervisor) {
        let waiting: Vec<usize> = self.filling.keys().copied().collect();
        for rank in waiting {
            let Some(store) = self.stores.get(&rank).cloned() else {
                continue;
            };
            let path = crate::replicator::inbox::replica_path(self.dir.path(), rank as u64);
            let Ok(replica) = hatrain_shared::shm::Store::open(&path) else {
                continue;
            };
            match store.fill_from(&replica) {
                Ok(info) => {
                    tracing::info!(rank, step = info.step, "store filled from the peer replica");
                    drop(replica);
                    // This host holds the rank itself from now on.
                    if let Some(r) = self.peers.as_ref().and_then(|p| p.replicator.as_ref()) {
                        r.release(rank);
                    }
                    let Some((reply, answer, checkpoint)) = self.filling.remove(&rank) else {
                        continue;
                    };
                    self.filled.insert(rank);
                    self.unanswered.insert(rank, (reply, answer));
                    self.feed(sup, self.registered_event(rank, checkpoint));
                    if self.adopted.iter().all(|r| self.filled.contains(r))
                        && let Some(r) = self.peers.as_ref().and_then(|p| p.replicator.as_ref())
                    {
                        r.filled();
                    }
                }
                Err(e) => tracing::debug!(rank, error = %e, "replica not ready to fill from"),
            }
        }
    }
}
