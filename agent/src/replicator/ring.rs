//! The replica placement as it changes: a standby that takes a lost
//! host's ranks plays that host's node from then on. The hosts that
//! streamed to the lost node stream to the standby, the standby streams the
//! ranks it took where the lost node streamed its own, and the holders of
//! the lost node's replicas take them from the standby.

use super::{Replicator, targets};
use std::collections::{BTreeMap, HashMap, HashSet};

/// The replica placement as this agent knows it: who streams to whom
/// ([`targets`] over the nodes' failure domains), and which node this
/// agent plays (its own, or that of the lost host whose ranks it took).
#[derive(Debug, Default)]
pub(super) struct Ring {
    /// Every node's failure-domain label; empty until known.
    pub(super) domains: Vec<Option<String>>,
    pub(super) replicas: usize,
    /// Where each host (node or standby) takes replicas.
    pub(super) endpoints: BTreeMap<u64, String>,
    pub(super) role: Option<u64>,
    /// The hosts this agent streams to.
    pub(super) streaming: HashSet<u64>,
    /// A standby filling the ranks it took holds nobody's replicas yet:
    /// the fill is what the paused job waits for.
    pub(super) filling: bool,
    /// Standbys that took a lost host's ranks and are still filling them:
    /// not streamed to until they are (they would refuse every chunk).
    pub(super) unready: HashSet<u64>,
    /// Nodes gone from the job for good (the group shrank without them):
    /// the placement skips them.
    pub(super) retired: HashSet<u64>,
}

impl Ring {
    /// The nodes that hold node `node`'s replicas now: its targets, past
    /// the retired nodes.
    fn holders(&self, node: usize) -> Vec<usize> {
        let n = self.domains.len();
        targets(node, &self.domains, n.saturating_sub(1))
            .into_iter()
            .filter(|t| !self.retired.contains(&(*t as u64)))
            .take(self.replicas)
            .collect()
    }
}

/// The host that plays node `node` now, following replacements.
pub(super) fn resolve(replaced: &HashMap<u64, u64>, mut node: u64) -> u64 {
    for _ in 0..=replaced.len() {
        match replaced.get(&node) {
            Some(&by) if by != node => node = by,
            _ => break,
        }
    }
    node
}

impl Replicator {
    /// The placement: every node's failure-domain label, and `replicas`
    /// per node.
    pub fn set_ring(&self, domains: Vec<Option<String>>, replicas: usize) {
        let mut ring = self.ring.lock().expect("not poisoned");
        ring.domains = domains;
        ring.replicas = replicas;
    }

    /// Host `node` takes replicas at `endpoint`.
    pub fn know(&self, node: u64, endpoint: String) {
        let mut ring = self.ring.lock().expect("not poisoned");
        ring.endpoints.insert(node, endpoint);
    }

    /// This agent plays node `node` in the placement: it holds the
    /// replicas of the nodes that stream to `node`, and streams its ranks
    /// to the hosts that play `node`'s targets now.
    pub fn play(&self, node: u64) {
        self.ring.lock().expect("not poisoned").role = Some(node);
        self.arrange();
    }

    /// Host `by` (a standby) took the ranks of lost node `lost`: it plays
    /// that node from now on. Hosts that streamed to `lost` stream to `by`,
    /// and the holders of `lost`'s replicas take them from `by`.
    pub fn replace(&self, lost: u64, by: u64) {
        if let Ok(mut m) = self.replaced.write() {
            m.insert(lost, by);
        }
        if by == self.cfg.node {
            self.ring.lock().expect("not poisoned").filling = true;
            self.play(lost);
        } else {
            self.ring.lock().expect("not poisoned").unready.insert(by);
            self.arrange();
        }
    }

    /// Host `host` left the job for good (the group shrank without it):
    /// the node it played is retired, and the nodes that streamed to it
    /// stream to the next ones in the placement, which hold their replicas
    /// from now on. A node that a standby plays since is not retired with
    /// the host it replaced.
    pub fn retire(&self, host: u64) {
        let replaced = self.replaced.read().map(|m| m.clone()).unwrap_or_default();
        let mut ring = self.ring.lock().expect("not poisoned");
        let nodes: Vec<u64> = (0..ring.domains.len() as u64)
            .filter(|&j| resolve(&replaced, j) == host)
            .collect();
        let mut changed = false;
        for j in nodes {
            changed |= ring.retired.insert(j);
        }
        drop(ring);
        if changed {
            tracing::info!(
                host,
                "the group shrank without this host: replicas placed past it"
            );
            self.arrange();
        }
    }

    /// Node `node` is back in the job (a standby plays it, its ranks back
    /// in a growing group).
    pub fn unretire(&self, node: u64) {
        if self
            .ring
            .lock()
            .expect("not poisoned")
            .retired
            .remove(&node)
        {
            self.arrange();
        }
    }

    /// Standby `host` filled the ranks it took (the controller says so):
    /// it is streamed to from now on, where the placement says.
    pub fn ready(&self, host: u64) {
        if self
            .ring
            .lock()
            .expect("not poisoned")
            .unready
            .remove(&host)
        {
            tracing::info!(node = host, "the standby filled the ranks it took");
            self.arrange();
        }
    }

    /// The ranks this standby took are filled: it holds the replicas of
    /// the node it plays from now on (their next snapshots come here).
    pub fn filled(&self) {
        self.ring.lock().expect("not poisoned").filling = false;
        self.arrange();
    }

    /// Opens the streams and takes the sources the placement asks of the
    /// node this agent plays, with the replacements known now.
    pub fn arrange(&self) {
        let replaced = self.replaced.read().map(|m| m.clone()).unwrap_or_default();
        let mut open = Vec::new();
        {
            let ring = self.ring.lock().expect("not poisoned");
            let Some(role) = ring.role else {
                return;
            };
            let n = ring.domains.len();
            if n == 0 {
                return;
            }
            for j in (0..n).filter(|&j| {
                j as u64 != role && !ring.filling && !ring.retired.contains(&(j as u64))
            }) {
                if ring.holders(j).contains(&(role as usize)) {
                    self.hold_for(j as u64);
                }
            }
            for t in ring.holders(role as usize) {
                let host = resolve(&replaced, t as u64);
                if host == self.cfg.node
                    || ring.streaming.contains(&host)
                    || ring.unready.contains(&host)
                {
                    continue;
                }
                match ring.endpoints.get(&host) {
                    Some(e) => open.push((host, e.clone())),
                    None => tracing::warn!(
                        node = host,
                        "where a replica holder takes replicas is not known: not streamed to"
                    ),
                }
            }
        }
        for (host, endpoint) in open {
            tracing::info!(node = host, endpoint = %endpoint, "streaming this host's snapshots");
            self.stream_to(host, endpoint);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_node_resolves_to_the_host_that_plays_it_now() {
        let m = HashMap::from([(1, 3), (3, 5), (7, 7)]);
        assert_eq!(resolve(&m, 0), 0, "never replaced");
        assert_eq!(resolve(&m, 1), 5, "its standby was lost and replaced too");
        assert_eq!(resolve(&m, 7), 7);
        let cycle = HashMap::from([(1, 2), (2, 1)]);
        assert!([1, 2].contains(&resolve(&cycle, 1)), "a cycle ends");
    }
}
