//! With etcd, a controller acts only while it holds its lease and the
//! job's leader key. While it does not (etcd lost its quorum, or this
//! host is cut off from it), training goes on, and a fault waits: the
//! events that would start a recovery are held here, undecided, and the
//! ranks that depend on the faulty one wait in their collectives. When
//! the controller acts again (etcd answers, and the key is still its own)
//! they are decided in order; when `--coordinator-timeout` passes first,
//! the job writes its last words from the snapshots and stops, saying why.
//!
//! Routine events still go through: the views of the ranks, a save's
//! parts, a registration, a worker that finished (exit 0), SIGTERM.

use super::Driver;
use super::decider::Decider;
use crate::config::CoordinatorChoice;
use crate::reaper::ExitStatus;
use crate::recovery::{Event, HostLoss};
use crate::supervisor::Supervisor;
use std::time::Instant;

/// Faults held while this controller may not act.
#[derive(Debug)]
pub(super) struct Held {
    /// When the first one came.
    pub since: Instant,
    pub events: Vec<Event>,
}

/// An event that starts (or changes) a recovery.
fn is_fault(e: &Event) -> bool {
    match e {
        Event::Exited { status, .. } => *status != ExitStatus::Exited(0),
        Event::Unfit { .. }
        | Event::Uce { .. }
        | Event::SpawnFailed { .. }
        | Event::DeviceFault { .. }
        | Event::RebuildFailed { .. }
        | Event::HostLost(_)
        | Event::Interrupted => true,
        Event::Tick(_)
        | Event::Registered { .. }
        | Event::Collected { .. }
        | Event::Written { .. }
        | Event::DumpRequested
        | Event::Shutdown
        | Event::Unled { .. } => false,
    }
}

impl Driver<'_> {
    /// `event` to decide now, or `None`: it is a fault, and this
    /// controller does not hold its lease in etcd.
    pub(super) fn unless_unled(&mut self, event: Event) -> Option<Event> {
        if !matches!(self.cfg.ha.coordinator, CoordinatorChoice::Etcd(_))
            || !is_fault(&event)
            || self.acting()
        {
            return Some(event);
        }
        let Decider::Controller(c) = &mut self.decider else {
            return Some(event);
        };
        if c.given_up {
            return Some(event);
        }
        let first = self
            .peers
            .as_ref()
            .is_none_or(|p| p.membership.seen().view.acted == 0);
        let held = c.waiting.get_or_insert_with(|| {
            if first {
                tracing::info!(
                    "an event to decide before this controller holds the job's leader key in etcd: it waits for the key"
                );
            } else {
                tracing::warn!(
                    "a fault, and this controller does not hold its lease in etcd: the job waits for etcd (or --coordinator-timeout)"
                );
            }
            Held {
                since: Instant::now(),
                events: Vec::new(),
            }
        });
        held.events.push(event);
        None
    }

    /// On a tick: the faults held are decided once this controller acts
    /// again; past `--coordinator-timeout` the job writes its last words
    /// and stops.
    pub(super) fn lead_or_give_up(&mut self, sup: &mut Supervisor) {
        let acting = self.acting();
        let timeout = self.cfg.ha.coordinator_timeout;
        if self.outcome.is_some() {
            return;
        }
        let Decider::Controller(c) = &mut self.decider else {
            return;
        };
        let Some(since) = c.waiting.as_ref().map(|h| h.since) else {
            return;
        };
        if acting {
            let held = c.waiting.take().map(|h| h.events).unwrap_or_default();
            tracing::warn!(
                waited_s = since.elapsed().as_secs_f64(),
                faults = held.len(),
                "this controller holds its lease in etcd: deciding the faults that waited"
            );
            for e in held {
                self.decide(sup, e);
            }
            return;
        }
        if since.elapsed() < timeout {
            return;
        }
        self.give_up(sup, Vec::new());
    }

    /// Past `--coordinator-timeout`: the faults held (and the host losses
    /// `losses`, held back as well) are decided without etcd, toward the
    /// last words, and the job stops.
    pub(super) fn give_up(&mut self, sup: &mut Supervisor, losses: Vec<HostLoss>) {
        let timeout = self.cfg.ha.coordinator_timeout;
        let Decider::Controller(c) = &mut self.decider else {
            return;
        };
        if c.given_up {
            return;
        }
        c.given_up = true;
        let held = c.waiting.take().map(|h| h.events).unwrap_or_default();
        let reason = format!(
            "a fault waited {} s (--coordinator-timeout-secs) for etcd ({}), and this controller could not hold its lease and the job's leader key meanwhile: writing the last words from the snapshots and stopping",
            timeout.as_secs_f64(),
            match &self.cfg.ha.coordinator {
                CoordinatorChoice::Etcd(e) => e.join(","),
                CoordinatorChoice::Embedded => String::new(),
            }
        );
        tracing::error!(reason, "stopping");
        self.stop_reason = Some(reason.clone());
        self.decide(sup, Event::Unled { reason });
        for e in held {
            self.decide(sup, e);
        }
        self.on_hosts_lost(sup, losses);
    }
}
