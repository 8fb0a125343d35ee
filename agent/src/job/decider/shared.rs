//! A checkpoint several hosts write (the last words of a job of several
//! hosts, or a dump asked of it), as the controller decides it: who writes
//! which rank, the shares counted as they come, and the checkpoint whole
//! once every share is in, or failed when one failed or its host was lost.
//!
//! The disk is the driver's (`super::super::lastwords`): it makes the
//! iteration's `_tmp` directory and sends the shares ([`WriteStart`]), and
//! commits the checkpoint or removes the directory ([`WriteEnd`]); what
//! came of it returns as [`Event::Written`].

use super::Controller;
use super::step::Out;
use crate::recovery::{Event, Level, WriteFailed};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// A checkpoint the hosts are writing, each its share.
#[derive(Debug, Clone, PartialEq)]
pub(in crate::job) struct SharedWrite {
    epoch: u64,
    step: u64,
    /// The size of the group the snapshots are of.
    world: usize,
    started: Duration,
    /// Hosts whose share is not in yet.
    waiting: BTreeSet<u64>,
    failed: Vec<String>,
}

/// A checkpoint to start: the iteration's `_tmp` directory is made, then
/// each host is sent its share (the ranks it writes, from its own stores
/// or the replicas it holds).
#[derive(Debug, Clone, PartialEq)]
pub struct WriteStart {
    pub epoch: u64,
    pub step: u64,
    pub shares: BTreeMap<u64, Vec<usize>>,
}

/// Every share is in: the checkpoint of `step` (of `world` ranks) is to be
/// committed, or, when a share failed (`failed` says how), its `_tmp`
/// directory removed. Either way nothing on disk claims a checkpoint that
/// is not whole.
#[derive(Debug, Clone, PartialEq)]
pub struct WriteEnd {
    pub epoch: u64,
    pub step: u64,
    pub world: usize,
    /// From the start to the last share, on the job's clock.
    pub seconds: f64,
    pub failed: Vec<String>,
}

impl Controller {
    /// The machine asked for the checkpoint of `step` under `epoch`: each
    /// live rank is written by its host, each rank of a lost host by a host
    /// holding its replica of the step. It fails at once when some rank's
    /// state of that step is nowhere.
    pub(super) fn start_write(&mut self, now: Duration, epoch: u64, step: u64, out: &mut Out) {
        let shares = match self.shares(step) {
            Ok(s) => s,
            Err(missing) => {
                let why = format!(
                    "no live host holds a verified snapshot of step {step} of ranks {missing:?}"
                );
                return self.decide(
                    now,
                    Event::Written {
                        epoch,
                        result: Err(WriteFailed(why)),
                    },
                    out,
                );
            }
        };
        out.ready.note(
            Level::Info,
            format!("the hosts write the checkpoint of step {step}, each its share: {shares:?}"),
        );
        self.writing = Some(SharedWrite {
            epoch,
            step,
            world: self.machine.layout_size(),
            started: now,
            waiting: shares.keys().copied().collect(),
            failed: Vec::new(),
        });
        out.ready.write = Some(WriteStart {
            epoch,
            step,
            shares,
        });
    }

    /// Host `node`'s share of the checkpoint of `epoch` is written, or
    /// failed: the checkpoint ends once every share is in.
    pub(super) fn share_written(
        &mut self,
        now: Duration,
        node: u64,
        epoch: u64,
        result: Result<f64, WriteFailed>,
        out: &mut Out,
    ) {
        let Some(w) = self.writing.as_mut().filter(|w| w.epoch == epoch) else {
            return;
        };
        if !w.waiting.remove(&node) {
            return;
        }
        match result {
            Ok(secs) => out.ready.note(
                Level::Info,
                format!("host {node} wrote its share of the checkpoint in {secs:.3} s"),
            ),
            Err(m) => w.failed.push(format!("host {node}: {m}")),
        }
        self.write_ends(now, out);
    }

    /// Hosts lost while they wrote their share: the checkpoint fails.
    pub(super) fn shares_lost(&mut self, now: Duration, lost: &[u64], out: &mut Out) {
        let Some(w) = self.writing.as_mut() else {
            return;
        };
        for n in lost {
            if w.waiting.remove(n) {
                w.failed
                    .push(format!("host {n}: lost while it wrote its share"));
            }
        }
        self.write_ends(now, out);
    }

    /// What came of a checkpoint carried out here: a shared one the
    /// driver could not start (already on disk, no `_tmp` directory) is
    /// over.
    pub(super) fn write_settled(&mut self, epoch: u64) {
        if self.writing.as_ref().is_some_and(|w| w.epoch == epoch) {
            self.writing = None;
        }
    }

    fn write_ends(&mut self, now: Duration, out: &mut Out) {
        if self.writing.as_ref().is_none_or(|w| !w.waiting.is_empty()) {
            return;
        }
        let Some(w) = self.writing.take() else {
            return;
        };
        out.ready.commit = Some(WriteEnd {
            epoch: w.epoch,
            step: w.step,
            world: w.world,
            seconds: now.saturating_sub(w.started).as_secs_f64(),
            failed: w.failed,
        });
    }
}
