//! A checkpoint several hosts write: the last words of a job of several
//! hosts, or a dump asked of it.
//!
//! The controller plans who writes which rank ([`Controller::shares`]):
//! each live rank by its host, each rank of a lost host (with no standby
//! to take it) by a host holding its peer replica of the step. It makes
//! the iteration's `_tmp` directory, sends each host its share
//! ([`WritePart`]), and writes its own; every host writes its ranks'
//! directories from their snapshots or replicas on its persister's thread
//! and reports ([`Up::Wrote`]). Only once every share is written does the
//! controller commit the checkpoint (the tracker names it); a share that
//! failed, or a host lost while it wrote, fails the checkpoint and removes
//! the `_tmp` directory, so nothing on disk claims a checkpoint that is
//! not whole.
//!
//! [`Controller::shares`]: super::decider::Controller::shares

use super::Driver;
use super::decider::{Decider, Down, Up, WritePart};
use crate::persister::{OwnedSource, Share};
use crate::recovery::{Event, WriteFailed, Written};
use hatrain_shared::checkpoint;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Instant;

/// A checkpoint the hosts are writing, each its share.
#[derive(Debug)]
pub(super) struct SharedWrite {
    epoch: u64,
    step: u64,
    dir: PathBuf,
    world: usize,
    started: Instant,
    /// Hosts whose share is not written yet.
    waiting: BTreeSet<u64>,
    failed: Vec<String>,
}

impl SharedWrite {
    /// Every share is in: the checkpoint is committed, or (when a share
    /// failed) its `_tmp` directory removed.
    fn finish(self) -> Result<Written, WriteFailed> {
        let tmp = checkpoint::tmp_iter_dir(&self.dir, self.step);
        if let Some(on_disk) = checkpoint::read_tracker(&self.dir)
            .ok()
            .filter(|t| *t >= self.step)
        {
            // A periodic save as new was committed meanwhile: the tracker
            // never goes back.
            let _ = std::fs::remove_dir_all(&tmp);
            return Ok(Written {
                iteration: on_disk,
                dir: self.dir,
                written: false,
                seconds: 0.0,
            });
        }
        let result = if self.failed.is_empty() {
            checkpoint::commit_save(&self.dir, self.step, self.world).map_err(|e| e.to_string())
        } else {
            Err(self.failed.join("; "))
        };
        match result {
            Ok(_) => Ok(Written {
                iteration: self.step,
                dir: self.dir,
                written: true,
                seconds: self.started.elapsed().as_secs_f64(),
            }),
            Err(m) => {
                let _ = std::fs::remove_dir_all(&tmp);
                Err(m.into())
            }
        }
    }
}

impl Driver<'_> {
    /// Whether this host is the controller of several hosts.
    pub(super) fn controls_hosts(&self) -> bool {
        matches!(&self.decider, Decider::Controller(c) if c.joined())
    }

    /// The controller of several hosts starts the checkpoint of `step`
    /// (asked under `epoch`): each host writes its share. An event when it
    /// is decided at once (on disk already, or impossible).
    pub(super) fn write_shared(&mut self, epoch: u64, step: u64) -> Option<Event> {
        let fail = |m: String| {
            Some(Event::Written {
                epoch,
                result: Err(m.into()),
            })
        };
        let Some(p) = self.persister.as_ref() else {
            return fail("no rank registered a checkpoint layout".into());
        };
        let dir = p.dir().to_path_buf();
        // The tracker never goes back: a periodic save of this step or a
        // newer one (whose shares were all written before a host was lost)
        // is what resumes.
        if let Some(on_disk) = checkpoint::read_tracker(&dir).ok().filter(|t| *t >= step) {
            return Some(Event::Written {
                epoch,
                result: Ok(Written {
                    iteration: on_disk,
                    dir,
                    written: false,
                    seconds: 0.0,
                }),
            });
        }
        let Decider::Controller(c) = &mut self.decider else {
            return None;
        };
        // The size of the group the snapshots are of (elastic training
        // resizes it).
        let world = c.machine.layout_size();
        let shares: BTreeMap<u64, Vec<usize>> = match c.shares(step) {
            Ok(s) => s,
            Err(missing) => {
                return fail(format!(
                    "no live host holds a verified snapshot of step {step} of ranks {missing:?}"
                ));
            }
        };
        if let Err(e) = checkpoint::begin_save(&dir, step) {
            return fail(e.to_string());
        }
        tracing::info!(
            step,
            ?shares,
            "the hosts write the checkpoint, each its share"
        );
        let me = c.node;
        c.writing = Some(SharedWrite {
            epoch,
            step,
            dir,
            world,
            started: Instant::now(),
            waiting: shares.keys().copied().collect(),
            failed: Vec::new(),
        });
        let mut own = None;
        for (node, ranks) in shares {
            let part = WritePart { epoch, step, ranks };
            if node == me {
                own = Some(part);
            } else {
                self.send_down(
                    node,
                    Down {
                        write: Some(part),
                        ..Down::default()
                    },
                );
            }
        }
        let part = own?;
        match self.write_part(part) {
            Ok(()) => None,
            Err(m) => self.share_written(me, epoch, Err(m)),
        }
    }

    /// Starts writing this host's share of a checkpoint, from its ranks'
    /// stores and the replicas it holds; `Err` when it cannot.
    pub(super) fn write_part(&mut self, part: WritePart) -> Result<(), WriteFailed> {
        if self.persister.is_none() {
            return Err("this host's ranks registered no checkpoint layout".into());
        }
        let mut sources: Vec<OwnedSource> =
            self.stores.keys().filter_map(|&r| self.source(r)).collect();
        let replicator = self.peers.as_ref().and_then(|p| p.replicator.as_ref());
        for &rank in &part.ranks {
            if sources.iter().any(|s| s.rank == rank) {
                continue;
            }
            let (store, map) = replicator.and_then(|r| r.replica(rank)).ok_or_else(|| {
                WriteFailed(format!(
                    "this host holds no replica of rank {rank} with its state map"
                ))
            })?;
            let sliced = self.cfg.ha.slices && map.has_replicated();
            if store.page().layout_hash() != map.slot_layout_hash(sliced) {
                return Err(WriteFailed(format!(
                    "the replica of rank {rank} does not have the layout of the state map it came with"
                )));
            }
            sources.push(OwnedSource {
                rank,
                store,
                map,
                sliced: self.cfg.ha.slices,
            });
        }
        tracing::info!(step = part.step, ranks = ?part.ranks, "writing this host's share of the checkpoint");
        if let Some(p) = self.persister.as_mut() {
            p.dump(part.epoch, part.step, sources, Share::Part(part.ranks));
        }
        Ok(())
    }

    /// This host's share is written (or failed): the controller counts
    /// it, a follower reports it.
    pub(super) fn share_done(
        &mut self,
        epoch: u64,
        result: Result<f64, WriteFailed>,
    ) -> Option<Event> {
        match &self.decider {
            Decider::Controller(c) => {
                let me = c.node;
                self.share_written(me, epoch, result)
            }
            Decider::Follower(_) => {
                self.send_up(&Up::Wrote { epoch, result });
                None
            }
        }
    }

    /// Host `node`'s share of the checkpoint of `epoch` is written, or
    /// failed: the checkpoint's result once every share is in.
    pub(super) fn share_written(
        &mut self,
        node: u64,
        epoch: u64,
        result: Result<f64, WriteFailed>,
    ) -> Option<Event> {
        let Decider::Controller(c) = &mut self.decider else {
            return None;
        };
        let w = c.writing.as_mut().filter(|w| w.epoch == epoch)?;
        if !w.waiting.remove(&node) {
            return None;
        }
        match result {
            Ok(secs) => tracing::info!(node, seconds = secs, "a host wrote its share"),
            Err(m) => w.failed.push(format!("host {node}: {m}")),
        }
        if !w.waiting.is_empty() {
            return None;
        }
        let w = c.writing.take()?;
        Some(Event::Written {
            epoch,
            result: w.finish(),
        })
    }

    /// Hosts lost while they wrote their share: the checkpoint fails.
    pub(super) fn shares_lost(&mut self, lost: &[u64]) -> Option<Event> {
        let Decider::Controller(c) = &self.decider else {
            return None;
        };
        let w = c.writing.as_ref()?;
        let epoch = w.epoch;
        let gone: Vec<u64> = w
            .waiting
            .iter()
            .copied()
            .filter(|n| lost.contains(n))
            .collect();
        gone.into_iter()
            .filter_map(|n| {
                self.share_written(n, epoch, Err("lost while it wrote its share".into()))
            })
            .last()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &std::path::Path, step: u64, failed: Vec<String>) -> SharedWrite {
        SharedWrite {
            epoch: 1,
            step,
            dir: dir.to_path_buf(),
            world: 1,
            started: Instant::now(),
            waiting: BTreeSet::new(),
            failed,
        }
    }

    /// A checkpoint whose shares are written is not committed over a newer
    /// one on disk (the tracker never goes back), nor when a share failed;
    /// either way its `_tmp` directory goes.
    #[test]
    fn last_words_never_move_the_tracker_back_and_a_failed_share_commits_nothing() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(checkpoint::TRACKER_FILE), "30\n").unwrap();
        let tmp = checkpoint::begin_save(d.path(), 25).unwrap();
        let w = write(d.path(), 25, Vec::new()).finish().unwrap();
        assert_eq!((w.iteration, w.written), (30, false));
        assert!(!tmp.exists());
        assert_eq!(checkpoint::read_tracker(d.path()).unwrap(), 30);

        let tmp = checkpoint::begin_save(d.path(), 40).unwrap();
        let e = write(d.path(), 40, vec!["host 2: disk full".into()])
            .finish()
            .unwrap_err();
        assert!(e.0.contains("host 2: disk full"), "{e}");
        assert!(!tmp.exists());
        assert_eq!(checkpoint::read_tracker(d.path()).unwrap(), 30);
    }
}
