//! Checkpoints on the simulated cluster: a host's own checkpoint, and one
//! the hosts write each its share, into a `_tmp` directory the controller
//! commits. The disk records which ranks' directories were written, so a
//! commit that claims a checkpoint some rank is missing from is caught.

use super::{Cluster, Msg};
use crate::job::decider::{Input, Up, WriteEnd, WriteStart};
use crate::recovery::{Event, WriteFailed, Written};
use std::collections::BTreeSet;

/// How many ticks a host takes to write its share.
pub const SHARE_TICKS: u32 = 3;

/// The checkpoint directories on disk.
#[derive(Debug, Default)]
pub struct Disk {
    /// The `_tmp` directory of the step being written, and the ranks
    /// whose directories are in it.
    pub tmp: Option<(u64, BTreeSet<usize>)>,
    /// The steps committed, each with the ranks it holds.
    pub committed: Vec<(u64, BTreeSet<usize>)>,
}

impl Cluster {
    /// A checkpoint this host writes whole (a job of one host).
    pub(super) fn finish_write(&mut self) {
        let Some((epoch, step, left)) = self.writing.take() else {
            return;
        };
        if left > 0 {
            self.writing = Some((epoch, step, left - 1));
            return;
        }
        let result = Ok(Written {
            iteration: step,
            dir: "/ckpt".into(),
            written: true,
            seconds: 0.01,
        });
        if self.live(self.leader) {
            self.input(Input::Followed(Event::Written { epoch, result }));
        }
    }

    /// The controller's driver starts a checkpoint the hosts write: the
    /// `_tmp` directory, then each host its share.
    pub(super) fn start_write(&mut self, w: WriteStart) {
        self.disk.tmp = Some((w.step, BTreeSet::new()));
        for (node, ranks) in w.shares {
            if node == self.leader {
                self.hosts[node as usize].share = Some((w.epoch, ranks, SHARE_TICKS));
            } else {
                let write = crate::job::decider::WritePart {
                    epoch: w.epoch,
                    step: w.step,
                    ranks,
                };
                let down = super::Down {
                    write: Some(write),
                    ..super::Down::default()
                };
                self.send(self.leader, node, Msg::Down(Box::new(down)));
            }
        }
    }

    /// Every live host writing a share goes on; one done reports it.
    pub(super) fn write_shares(&mut self) {
        for node in 0..self.hosts.len() as u64 {
            if !self.live(node) {
                continue;
            }
            let Some((epoch, ranks, left)) = self.hosts[node as usize].share.take() else {
                continue;
            };
            if left > 0 {
                self.hosts[node as usize].share = Some((epoch, ranks, left - 1));
                continue;
            }
            if let Some((_, written)) = self.disk.tmp.as_mut() {
                written.extend(&ranks);
            }
            let result = Ok(0.01);
            if node == self.leader {
                if self.agent.is_some() {
                    self.input(Input::Wrote { epoch, result });
                }
            } else {
                self.send(node, self.leader, Msg::Up(Up::Wrote { epoch, result }));
            }
        }
    }

    /// The controller's driver commits the checkpoint every share of which
    /// is in, or removes it.
    pub(super) fn end_write(&mut self, end: WriteEnd) -> Input {
        let tmp = self.disk.tmp.take();
        let result = match tmp {
            Some((step, ranks)) if step == end.step && end.failed.is_empty() => {
                self.disk.committed.push((step, ranks));
                Ok(Written {
                    iteration: step,
                    dir: "/ckpt".into(),
                    written: true,
                    seconds: end.seconds,
                })
            }
            _ if !end.failed.is_empty() => Err(WriteFailed(end.failed.join("; "))),
            _ => Err(WriteFailed(format!(
                "no _tmp directory of step {} to commit",
                end.step
            ))),
        };
        Input::Followed(Event::Written {
            epoch: end.epoch,
            result,
        })
    }
}
