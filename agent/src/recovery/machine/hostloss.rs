//! A host of the job lost, as the machine takes it: its ranks go to a
//! standby host, the group shrinks (some ranks standing by so that its size
//! divides the global batch), or the job stops, saying why.

use super::*;

impl Machine {
    /// Another host is gone with its ranks. Their state lives on in their
    /// peer replicas: with worker reboot and a `spare` host, every lost rank
    /// is started there (its store filled from its replica by the hosts)
    /// and the job recovers as from a crash of all of them at once.
    /// Otherwise, with elastic training and at least `--min-nodes` hosts
    /// left, the group shrinks without them ([`Machine::shrink`]); else
    /// the job stops, saying so, after its last-words checkpoint when the
    /// dump mode is on: the hosts holding the lost ranks' replicas write
    /// those ranks.
    /// When some rank's state is gone with every replica of it,
    /// the job stops at once, naming those ranks and the newest complete
    /// checkpoint on disk: nothing can claim a later step.
    pub(super) fn host_lost(&mut self, now: Duration, loss: HostLoss) {
        let HostLoss {
            node,
            ranks,
            detail,
            spare,
            state_lost,
            on_disk,
            hosts_left,
            stand_by,
        } = loss;
        if matches!(
            self.state,
            State::Done(_)
                | State::Dumping {
                    then: AfterDump::Stop(_),
                    ..
                }
        ) {
            // The last words are under way: the lost ranks pause for
            // nothing (their state comes from their replicas).
            for r in &ranks {
                if let Some(v) = self.views.get_mut(r) {
                    v.alive = false;
                }
                // Gone with their host: no exit is coming.
                self.exits.insert(*r);
            }
            return;
        }
        let first = ranks.first().copied().unwrap_or(0);
        // Ranks joining the group hold nothing to protect yet.
        let joining = self.joining();
        let unprotected: Vec<usize> = ranks
            .iter()
            .copied()
            .filter(|r| !self.protected.contains(r) && !joining.contains(r))
            .collect();
        let standby = spare
            .filter(|_| self.cfg.modes.recover && unprotected.is_empty() && state_lost.is_empty());
        let elastic = standby.is_none()
            && self.cfg.modes.elastic
            && state_lost.is_empty()
            && unprotected.is_empty();
        let shrink = elastic && self.can_shrink(hosts_left);
        let stand_by: Vec<usize> = if shrink {
            stand_by
                .into_iter()
                .filter(|r| !ranks.contains(r) && self.participants().contains(r))
                .collect()
        } else {
            Vec::new()
        };
        let stay = self
            .participants()
            .iter()
            .filter(|r| !ranks.contains(r) && !stand_by.contains(r))
            .count();
        let standing = match self.global_batch {
            Some(b) if !stand_by.is_empty() => format!(
                "; ranks {stand_by:?} stand by, since the global batch of {b} needs a group size that divides it"
            ),
            _ => String::new(),
        };
        let min = self.cfg.min_nodes;
        let newest = on_disk.map_or_else(
            || "none (no rank registered a checkpoint directory)".to_string(),
            |d| d.to_string(),
        );
        let (level, text, action, reason) = match (standby, spare) {
            _ if !state_lost.is_empty() => (
                Level::Error,
                format!("host {node} lost with every replica of ranks {state_lost:?}"),
                (FaultAction::Stop, "stop the job".into()),
                format!(
                    "the state of ranks {state_lost:?} is lost: host {node} and every host holding their peer replicas are gone, so no checkpoint of a later step can be complete; the newest complete checkpoint on disk is {newest}"
                ),
            ),
            _ if shrink => (
                Level::Warn,
                format!("host {node} lost: shrinking the data-parallel group"),
                (
                    FaultAction::Shrink,
                    format!("go on with {stay} ranks{standing}"),
                ),
                format!(
                    "no standby host is left to take ranks {ranks:?}: with elastic training the {hosts_left} hosts left go on with {stay} ranks, their optimizer shards re-sliced from their snapshots and the leaving ranks' peer replicas{standing}"
                ),
            ),
            _ if elastic && self.cfg.modes.dump => (
                Level::Error,
                format!("host {node} lost"),
                (
                    FaultAction::LastWords,
                    "write the last-words checkpoint, then stop the job".into(),
                ),
                format!(
                    "host {node} holds ranks {ranks:?} and no standby host is left to take them; {hosts_left} host(s) would be left, fewer than --min-nodes {min}, so the group does not shrink: the last-words checkpoint takes their state from their peer replicas"
                ),
            ),
            _ if elastic => (
                Level::Error,
                format!("host {node} lost"),
                (FaultAction::Stop, "stop the job".into()),
                format!(
                    "host {node} holds ranks {ranks:?} and no standby host is left to take them; {hosts_left} host(s) would be left, fewer than --min-nodes {min}, so the group does not shrink"
                ),
            ),
            (Some(s), _) => (
                Level::Warn,
                format!("host {node} lost: recovering on a standby host"),
                (
                    FaultAction::Standby,
                    format!("restart ranks {ranks:?} on standby host {s}"),
                ),
                format!("standby host {s} takes ranks {ranks:?}, filled from their peer replicas"),
            ),
            (None, None) if self.cfg.modes.dump && unprotected.is_empty() => (
                Level::Error,
                format!("host {node} lost"),
                (
                    FaultAction::LastWords,
                    "write the last-words checkpoint, then stop the job".into(),
                ),
                format!(
                    "host {node} holds ranks {ranks:?} and no standby host is left to take them (start agents with --standby, or turn on elastic training to shrink the group): the last-words checkpoint takes their state from their peer replicas"
                ),
            ),
            (None, None) => (
                Level::Error,
                format!("host {node} lost"),
                (FaultAction::Stop, "stop the job".into()),
                format!(
                    "host {node} holds ranks {ranks:?} and no standby host is left to take them (start agents with --standby, or turn on elastic training to shrink the group)"
                ),
            ),
            (None, Some(_)) if !self.cfg.modes.recover => (
                Level::Error,
                format!("host {node} lost"),
                (FaultAction::Stop, "stop the job".into()),
                format!(
                    "host {node} holds ranks {ranks:?}: a standby host takes them by worker reboot, which is not enabled"
                ),
            ),
            (None, Some(_)) => (
                Level::Error,
                format!("host {node} lost"),
                (FaultAction::Stop, "stop the job".into()),
                format!(
                    "host {node} holds ranks {ranks:?}, and {unprotected:?} never registered with the hatrain runtime: no replica to restore them from"
                ),
            ),
        };
        self.out.notes.push(Note {
            level,
            rank: None,
            detail: Some(detail.clone()),
            reason: Some(reason.clone()),
            text,
        });
        let f = self.record_fault(now, first, FaultKind::HostLost, detail, action, reason);
        let mut named: BTreeSet<usize> = ranks.iter().copied().collect();
        named.extend(&state_lost);
        self.faults[f].ranks = named.into_iter().collect();
        if shrink {
            self.shrink(now, f, &ranks, &stand_by);
            return;
        }
        if standby.is_none() {
            // The lost ranks pause for nothing any more: a last-words
            // checkpoint (with the dump mode on) takes them from their
            // replicas.
            for r in &ranks {
                if let Some(v) = self.views.get_mut(r) {
                    v.alive = false;
                }
                // Gone with their host: no exit is coming.
                self.exits.insert(*r);
            }
            if state_lost.is_empty() && unprotected.is_empty() {
                self.stop_with(now, Outcome::RecoveryFailed);
            } else {
                self.finish(Outcome::RecoveryFailed);
            }
            return;
        }
        for r in ranks {
            let step = self.view(r).step;
            if let Some(v) = self.views.get_mut(&r) {
                v.alive = false;
                v.registered = false;
            }
            self.protected.remove(&r);
            self.killed.remove(&r);
            self.respawn(now, r, step);
        }
        self.recover(now, f);
    }
}
