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
use super::decider::{Controller, Decider};
use crate::config::CoordinatorChoice;
use crate::reaper::ExitStatus;
use crate::recovery::{Event, HostLoss};
use crate::supervisor::Supervisor;
use std::time::{Duration, Instant};

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

/// What a controller does at a tick about the faults it holds while it
/// may not act.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum UnledVerdict {
    /// Nothing held, or it waits still.
    Wait,
    /// It acts again: the faults held, in order, and how long they waited.
    Decide {
        events: Vec<Event>,
        waited: Duration,
    },
    /// `--coordinator-timeout` passed first: the last words, then stop.
    GiveUp,
}

impl Controller {
    /// Holds `event`, a fault seen at `now` while this controller may not
    /// act; true for the first one held.
    pub(super) fn hold_unled(&mut self, event: Event, now: Instant) -> bool {
        let first = self.waiting.is_none();
        self.waiting
            .get_or_insert_with(|| Held {
                since: now,
                events: Vec::new(),
            })
            .events
            .push(event);
        first
    }

    /// At `now`: the faults held are decided once this controller acts,
    /// or given up to the last words past `timeout`.
    pub(super) fn unled_verdict(
        &mut self,
        now: Instant,
        acting: bool,
        timeout: Duration,
    ) -> UnledVerdict {
        let Some(since) = self.waiting.as_ref().map(|h| h.since) else {
            return UnledVerdict::Wait;
        };
        let waited = now.saturating_duration_since(since);
        if acting {
            let events = self.waiting.take().map(|h| h.events).unwrap_or_default();
            return UnledVerdict::Decide { events, waited };
        }
        if waited < timeout {
            return UnledVerdict::Wait;
        }
        UnledVerdict::GiveUp
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
        if c.hold_unled(event, Instant::now()) {
            if first {
                tracing::info!(
                    "an event to decide before this controller holds the job's leader key in etcd: it waits for the key"
                );
            } else {
                tracing::warn!(
                    "a fault, and this controller does not hold its lease in etcd: the job waits for etcd (or --coordinator-timeout)"
                );
            }
        }
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
        match c.unled_verdict(Instant::now(), acting, timeout) {
            UnledVerdict::Wait => {}
            UnledVerdict::Decide { events, waited } => {
                tracing::warn!(
                    waited_s = waited.as_secs_f64(),
                    faults = events.len(),
                    "this controller holds its lease in etcd: deciding the faults that waited"
                );
                for e in events {
                    self.decide(sup, e);
                }
            }
            UnledVerdict::GiveUp => self.give_up(sup, Vec::new()),
        }
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
