//! A controller cut off from the majority of the job's agents decides
//! nothing. Hosts it stops hearing may be alive on the other side of a
//! partition, where a successor that a majority follows takes over (and
//! may declare this host lost, giving its ranks to a standby): deciding on
//! them here would make two controllers. So their losses wait. When this
//! agent acts again (the partition mended before anyone took over), it
//! decides on them; when another agent acts under a newer term, or nobody
//! does within [`SUCCESSOR_WAIT`], this host stops, saying why. Its ranks
//! wait meanwhile, their collectives held up by the hosts they lost.

use super::Controller;
use crate::coordinator::View;
use crate::recovery::HostLoss;
use std::time::Duration;

/// Host losses a controller without a majority holds back.
#[derive(Debug)]
pub(in crate::job) struct CutOff {
    pub since: Duration,
    pub losses: Vec<HostLoss>,
}

/// What a controller cut off from the majority does now.
#[derive(Debug, Clone, PartialEq)]
pub(in crate::job) enum CutOffVerdict {
    /// Nothing is held back, or it waits still.
    Wait,
    /// A majority follows it again: it decides on the losses held back.
    Decide(Vec<HostLoss>),
    /// With etcd, nobody acted in time and it follows nobody else: the
    /// losses go toward the last words, as a fault would.
    GiveUp(Vec<HostLoss>),
    /// Another agent acts in its place: it stops.
    Replaced { by: u64 },
    /// Nobody acted within the successor wait: it stops.
    TimedOut,
}

impl Controller {
    /// Holds back `loss`, seen at `now`, while no majority follows.
    pub(in crate::job) fn hold_back(&mut self, loss: HostLoss, now: Duration) {
        self.cut_off
            .get_or_insert_with(|| CutOff {
                since: now,
                losses: Vec::new(),
            })
            .losses
            .push(loss);
    }

    /// The hosts whose losses are held back, in words.
    pub(in crate::job) fn cut_off_hosts(&self) -> String {
        self.cut_off
            .iter()
            .flat_map(|x| &x.losses)
            .map(|l| match l.ranks.is_empty() {
                true => format!("host {} (a standby)", l.node),
                false => format!("host {} (ranks {:?})", l.node, l.ranks),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// What this controller does at `now` about the losses it holds back,
    /// given the coordinator's `view`, how long it waits for a successor,
    /// and whether etcd coordinates the job.
    pub(in crate::job) fn cut_off_verdict(
        &mut self,
        now: Duration,
        view: &View,
        wait: Duration,
        etcd: bool,
    ) -> CutOffVerdict {
        let Some(since) = self.cut_off.as_ref().map(|x| x.since) else {
            return CutOffVerdict::Wait;
        };
        let take = |c: &mut Self| c.cut_off.take().map(|x| x.losses).unwrap_or_default();
        if view.acting {
            return CutOffVerdict::Decide(take(self));
        }
        let waited = now.saturating_sub(since) >= wait;
        let leads = view.follows.is_none_or(|n| n == self.node);
        if waited && leads && etcd {
            return CutOffVerdict::GiveUp(take(self));
        }
        match view.follows {
            Some(n) if n != self.node => CutOffVerdict::Replaced { by: n },
            _ if waited => CutOffVerdict::TimedOut,
            _ => CutOffVerdict::Wait,
        }
    }
}
