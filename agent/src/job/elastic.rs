//! Elastic training on this host: the replicas of leaving ranks that its
//! ranks bring to a shrink, and a rank's new store when it takes its new
//! place (its layout changes with its shard).

use super::Driver;
use super::decider::Give;
use crate::supervisor::Supervisor;
use hatrain_shared::control::{Donation, Response};
use hatrain_shared::shm::{self, Geometry, Store};
use hatrain_shared::statemap::StateMap;
use std::sync::Arc;

impl Driver<'_> {
    /// This host holds the replicas of `leaving` at `step`: its lowest rank
    /// brings them to the reshape to that step (what it brought to an
    /// earlier one is forgotten).
    pub(super) fn donate(&mut self, sup: &Supervisor, step: u64, leaving: Vec<usize>) {
        let Some(&to) = sup.ranks().iter().min() else {
            return;
        };
        tracing::info!(
            rank = to,
            ?leaving,
            step,
            "bringing the leaving ranks' replicas to the reshape"
        );
        let (at, ranks) = self.donations.entry(to).or_default();
        if *at != step {
            *at = step;
            ranks.clear();
        }
        ranks.extend(leaving);
    }

    /// The replicas rank `rank` brings to the reshape to `step`.
    pub(super) fn donations(&self, rank: usize, step: u64) -> Response {
        let replicator = self.peers.as_ref().and_then(|p| p.replicator.as_ref());
        let mut donations = Vec::new();
        let brings = self.donations.get(&rank).filter(|(at, _)| *at == step);
        for lost in brings.into_iter().flat_map(|(_, ranks)| ranks) {
            match replicator.and_then(|r| r.replica(*lost)) {
                Some((s, m)) => donations.push(Donation {
                    rank: *lost,
                    store: s.path().to_path_buf(),
                    map: (*m).clone(),
                }),
                None => {
                    return Response::Error {
                        message: format!(
                            "rank {rank} brings rank {lost} to the reshape to step {step}, but this host holds no replica of it"
                        ),
                    };
                }
            }
        }
        Response::Donations {
            sliced: self.cfg.ha.slices,
            donations,
        }
    }

    /// Standby `g.to` plays node `g.node` again, its ranks back in the
    /// group: this host places replicas on it (none to hand over: those
    /// ranks start with nothing).
    pub(super) fn regrow(&self, g: &Give) {
        if let Some(r) = self.peers.as_ref().and_then(|p| p.replicator.as_ref()) {
            r.unretire(g.node);
            r.replace(g.node, g.to);
        }
    }

    /// The group shrinks without the hosts this agent lost: the replicas
    /// are placed past them from now on.
    pub(super) fn retire_lost(&self) {
        if let Some(r) = self.peers.as_ref().and_then(|p| p.replicator.as_ref()) {
            for &node in &self.lost {
                r.retire(node);
            }
        }
    }

    /// Rank `rank` (process `pid`) takes a new place under the reshape of
    /// `epoch`: its store is made anew for `map` (a new file, so the
    /// worker's mapping of the old one stays valid until it lets go).
    pub(super) fn reshape(
        &mut self,
        sup: &Supervisor,
        rank: usize,
        pid: u32,
        epoch: u64,
        map: StateMap,
    ) -> Response {
        let refuse = |message: String| Response::Error { message };
        if !sup.ranks().contains(&rank) || !self.stores.contains_key(&rank) {
            return refuse(format!(
                "rank {rank} is not a registered rank of this host {:?}",
                sup.ranks()
            ));
        }
        if let Err(e) = map.validate() {
            return refuse(format!("rank {rank}: {e}"));
        }
        let sliced = self.cfg.ha.slices && map.has_replicated();
        let total = map.slot_bytes(sliced) as usize;
        let layout = map.slot_layout_hash(sliced);
        let name = format!("rank_{rank:05}.shm");
        let geometry = Geometry::new(self.cfg.ha.slots, total);
        self.dir.forget(&name);
        let created = self
            .dir
            .create(&name)
            .map_err(|e| e.to_string())
            .and_then(|(file, path)| {
                Store::create_in(
                    file,
                    &path,
                    rank,
                    geometry,
                    layout,
                    shm::hash_str(self.cfg.job_id.as_str()),
                )
                .map_err(|e| e.to_string())
            });
        let store = match created {
            Ok(s) => Arc::new(s),
            Err(e) => {
                self.dir.forget(&name);
                self.stores.remove(&rank);
                return refuse(format!(
                    "cannot make the snapshot store of rank {rank} for its new place: {e}"
                ));
            }
        };
        tracing::info!(rank, pid, epoch, bytes = total, sliced, path = %store.path().display(), "snapshot store made for the rank's new place");
        self.stores.insert(rank, Arc::clone(&store));
        let replicator = self.peers.as_ref().and_then(|p| p.replicator.as_ref());
        if let Some(r) = replicator {
            let json = serde_json::to_vec(&map).ok().map(Into::into);
            r.add_rank(rank, Arc::clone(&store), json);
        }
        self.maps.insert(rank, Arc::new(map));
        Response::Reshaped {
            store: store.path().to_path_buf(),
            sliced,
        }
    }
}
