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

use super::Controller;
use crate::reaper::ExitStatus;
use crate::recovery::Event;
use std::time::Duration;

/// Faults held while this controller may not act.
#[derive(Debug)]
pub(in crate::job) struct Held {
    /// When the first one came.
    pub since: Duration,
    pub events: Vec<Event>,
}

/// An event that starts (or changes) a recovery.
pub(in crate::job) fn is_fault(e: &Event) -> bool {
    match e {
        Event::Exited { status, .. } => *status != ExitStatus::Exited(0),
        Event::Unfit { .. }
        | Event::Uce { .. }
        | Event::SpawnFailed { .. }
        | Event::DeviceFault { .. }
        | Event::Slow { .. }
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
pub(in crate::job) enum UnledVerdict {
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
    pub(in crate::job) fn hold_unled(&mut self, event: Event, now: Duration) -> bool {
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
    pub(in crate::job) fn unled_verdict(
        &mut self,
        now: Duration,
        acting: bool,
        timeout: Duration,
    ) -> UnledVerdict {
        let Some(since) = self.waiting.as_ref().map(|h| h.since) else {
            return UnledVerdict::Wait;
        };
        let waited = now.saturating_sub(since);
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
