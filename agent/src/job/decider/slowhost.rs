//! A host that holds the job back, handed to a standby host (`--on-slow
//! replace`): the controller orders it out of the job, and once its
//! heartbeats stop its ranks go to the standby by the host-loss path,
//! filled from their peer replicas, as from any lost host. The driver
//! asks on every tick while the finding's hand-over pays
//! ([`crate::slow::hand_host_over_pays`]); the controller orders a host
//! out once, and only when nothing is lost by it.

use super::step::{Facts, Out};
use super::{Controller, Down};
use crate::recovery::{HostLoss, Level};

impl Controller {
    /// Every rank of host `node`, and no other, holds the job back, and
    /// handing the host over pays (`detail`: by how much, since when). It
    /// leaves the job when a standby host heard now can take its ranks
    /// and another live host holds a replica of each; otherwise the
    /// finding is only reported (said once). While a recovery, a
    /// take-over, a fill or a shared checkpoint is under way, nothing is
    /// decided: the driver asks again.
    pub(super) fn on_slow_host(&mut self, facts: &Facts, node: u64, detail: String, out: &mut Out) {
        if !self.rules.reboot
            || self.stopped()
            || self.slow_hosts.contains_key(&node)
            || !self.members.contains(&node)
            || facts.gone.contains(&node)
            || !facts.acting()
        {
            return;
        }
        if self.machine.recovering()
            || self.settling.is_some()
            || self.cut_off.is_some()
            || self.waiting.is_some()
            || self.writing.is_some()
            || !self.filling.is_empty()
        {
            return;
        }
        self.note_held(self.node, facts.own_held.iter().copied());
        let ranks = self.ranks_on(node);
        let kept_back = if !self.spares.iter().any(|s| self.heard.contains(s)) {
            Some("no standby host is heard".to_string())
        } else {
            let lost = self.state_lost(node, &facts.gone);
            (!lost.is_empty())
                .then(|| format!("no other live host holds a replica of ranks {lost:?} yet"))
        };
        if let Some(why) = kept_back {
            if self.slow_kept.insert(node) {
                out.ready.note(
                    Level::Warn,
                    format!(
                        "host {node} (ranks {ranks:?}) holds the job back ({detail}); it stays: {why}"
                    ),
                );
            }
            return;
        }
        out.ready.note(
            Level::Warn,
            format!(
                "host {node} (ranks {ranks:?}) holds the job back ({detail}): it leaves the job, and its ranks go to a standby host as a lost host's"
            ),
        );
        self.slow_hosts.insert(node, detail.clone());
        if node == self.node {
            out.ready.leave = Some(detail);
        } else {
            let down = Down {
                leave: Some(detail),
                ..Down::default()
            };
            self.order(node, down, out);
        }
    }

    /// `loss` as the faults show it: a host ordered out for holding the
    /// job back says so.
    pub(super) fn why_lost(&self, mut loss: HostLoss) -> HostLoss {
        if let Some(why) = self.slow_hosts.get(&loss.node) {
            loss.detail = format!(
                "handed to a standby host: it held the job back ({why}); {}",
                loss.detail
            );
        }
        loss
    }
}

#[cfg(test)]
mod tests {
    use super::super::step::{Input, Ready};
    use super::*;
    use crate::coordinator::View;
    use std::time::Duration;

    /// [`super::super::tests::ring`]: 3 hosts of 2 ranks, each holding the
    /// replicas of the one before it, and standby 3.
    fn ring() -> Controller {
        super::super::tests::ring()
    }

    fn facts(gone: &[u64]) -> Facts {
        Facts {
            view: Some(View {
                live: vec![0, 1, 2, 3],
                lost: gone.to_vec(),
                follows: Some(0),
                acting: true,
                term: 1,
                acted: 1,
            }),
            gone: gone.to_vec(),
            // Host 0 holds host 2's replicas.
            own_held: vec![4, 5],
            ..Facts::default()
        }
    }

    fn slow(c: &mut Controller, node: u64, gone: &[u64]) -> Ready {
        let input = Input::SlowHost {
            node,
            detail: "compute +30 ms".into(),
        };
        c.step(Duration::from_secs(9), &facts(gone), input)
    }

    fn leave_orders(r: &Ready) -> Vec<(u64, String)> {
        r.orders
            .iter()
            .filter_map(|(n, d)| Some((*n, d.leave.clone()?)))
            .collect()
    }

    #[test]
    fn a_slow_host_is_ordered_out_once_and_its_loss_says_why() {
        let mut c = ring();
        let r = slow(&mut c, 1, &[]);
        assert_eq!(leave_orders(&r), vec![(1, "compute +30 ms".to_string())]);
        assert_eq!(r.leave, None);
        assert!(r.notes.iter().any(|n| n.text.contains("leaves the job")));
        // Asked again on the next tick: ordered out already.
        let again = slow(&mut c, 1, &[]);
        assert!(leave_orders(&again).is_empty() && again.notes.is_empty());
        // Its loss, when its heartbeats stop, says why.
        let loss = c.why_lost(super::super::tests::lost(1));
        assert!(
            loss.detail
                .starts_with("handed to a standby host: it held the job back (compute +30 ms); "),
            "{}",
            loss.detail
        );
        let other = c.why_lost(super::super::tests::lost(2));
        assert!(!other.detail.contains("held the job back"));
        // The controller's own host leaves itself.
        let mut own = ring();
        let r = slow(&mut own, 0, &[]);
        assert_eq!(r.leave.as_deref(), Some("compute +30 ms"));
        assert!(leave_orders(&r).is_empty());
    }

    #[test]
    fn a_slow_host_stays_without_a_standby_or_a_replica_of_each_rank() {
        // No standby heard: it stays, said once.
        let mut unheard = ring();
        unheard.heard.remove(&3);
        let r = slow(&mut unheard, 1, &[]);
        assert!(leave_orders(&r).is_empty());
        assert!(
            r.notes
                .iter()
                .any(|n| n.text.contains("no standby host is heard"))
        );
        assert!(slow(&mut unheard, 1, &[]).notes.is_empty(), "said once");
        // Heard later: it is handed over then.
        unheard.heard.insert(3);
        assert_eq!(leave_orders(&slow(&mut unheard, 1, &[])).len(), 1);
        // Host 2 holds host 1's replicas; with host 2 gone, they are
        // nowhere: host 1 stays.
        let mut bare = ring();
        let r = slow(&mut bare, 1, &[2]);
        assert!(leave_orders(&r).is_empty());
        assert!(
            r.notes
                .iter()
                .any(|n| n.text.contains("replica of ranks [2, 3]")),
            "{:?}",
            r.notes
        );
        // A host that holds no ranks (a standby), or is lost, is no member.
        let mut spare = ring();
        assert!(leave_orders(&slow(&mut spare, 3, &[])).is_empty());
        // During a recovery: nothing now, asked again later.
        let mut busy = ring();
        busy.filling.insert(4);
        let r = slow(&mut busy, 1, &[]);
        assert!(leave_orders(&r).is_empty() && r.notes.is_empty());
        busy.filling.clear();
        assert_eq!(leave_orders(&slow(&mut busy, 1, &[])).len(), 1);
        // Without worker reboot, no standby takes ranks.
        let mut off = ring();
        off.rules.reboot = false;
        assert!(leave_orders(&slow(&mut off, 1, &[])).is_empty());
    }
}
