//! A checkpoint several hosts write: the last words of a job of several
//! hosts, or a dump asked of it.
//!
//! The controller's machine decides who writes which rank and counts the
//! shares (`super::decider::shared`); this is its disk and its wires. The
//! controller makes the iteration's `_tmp` directory, sends each host its
//! share ([`WritePart`]), and writes its own; every host writes its ranks'
//! directories from their snapshots or replicas on its persister's thread
//! and reports ([`Up::Wrote`]). Only once every share is written is the
//! checkpoint committed (the tracker names it); a share that failed, or a
//! host lost while it wrote, fails the checkpoint and removes the `_tmp`
//! directory, so nothing on disk claims a checkpoint that is not whole.

use super::Driver;
use super::decider::{Decider, Down, Input, Up, WriteEnd, WritePart, WriteStart};
use crate::persister::{OwnedSource, Share};
use crate::recovery::{Event, WriteFailed, Written};
use hatrain_shared::checkpoint;
use std::path::Path;

/// Commits the checkpoint every host wrote its share of in `dir`, or
/// removes its `_tmp` directory when a share failed, or when a periodic
/// save as new was committed meanwhile (the tracker never goes back).
fn commit(dir: &Path, end: WriteEnd) -> Result<Written, WriteFailed> {
    let tmp = checkpoint::tmp_iter_dir(dir, end.step);
    if let Some(on_disk) = checkpoint::read_tracker(dir)
        .ok()
        .filter(|t| *t >= end.step)
    {
        let _ = std::fs::remove_dir_all(&tmp);
        return Ok(Written {
            iteration: on_disk,
            dir: dir.to_path_buf(),
            written: false,
            seconds: 0.0,
        });
    }
    let result = if end.failed.is_empty() {
        checkpoint::commit_save(dir, end.step, end.world).map_err(|e| e.to_string())
    } else {
        Err(end.failed.join("; "))
    };
    match result {
        Ok(_) => Ok(Written {
            iteration: end.step,
            dir: dir.to_path_buf(),
            written: true,
            seconds: end.seconds,
        }),
        Err(m) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(m.into())
        }
    }
}

impl Driver<'_> {
    /// The controller starts the checkpoint the hosts write: its `_tmp`
    /// directory is made and each host sent its share. What to take in
    /// next: the checkpoint's result when it cannot start (on disk
    /// already, or no directory), this host's share when it cannot be
    /// written.
    pub(super) fn start_write(&mut self, w: WriteStart) -> Option<Input> {
        let WriteStart {
            epoch,
            step,
            shares,
        } = w;
        let done = |result| Some(Input::Followed(Event::Written { epoch, result }));
        let Some(p) = self.persister.as_ref() else {
            return done(Err("no rank registered a checkpoint layout".into()));
        };
        let dir = p.dir().to_path_buf();
        // The tracker never goes back: a periodic save of this step or a
        // newer one (whose shares were all written before a host was lost)
        // is what resumes.
        if let Some(on_disk) = checkpoint::read_tracker(&dir).ok().filter(|t| *t >= step) {
            return done(Ok(Written {
                iteration: on_disk,
                dir,
                written: false,
                seconds: 0.0,
            }));
        }
        if let Err(e) = checkpoint::begin_save(&dir, step) {
            return done(Err(e.to_string().into()));
        }
        let me = match &self.decider {
            Decider::Controller(c) => c.node,
            Decider::Follower(_) => return None,
        };
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
        let why = self.write_part(own?).err()?;
        Some(Input::Wrote {
            epoch,
            result: Err(why),
        })
    }

    /// Every share is in: the checkpoint is committed (or removed), and
    /// what came of it is for the controller to take in.
    pub(super) fn end_write(&mut self, end: WriteEnd) -> Input {
        let epoch = end.epoch;
        let result = match self.persister.as_ref() {
            Some(p) => commit(p.dir(), end),
            None => Err("no rank registered a checkpoint layout".into()),
        };
        Input::Followed(Event::Written { epoch, result })
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
        sup: &mut crate::supervisor::Supervisor,
        epoch: u64,
        result: Result<f64, WriteFailed>,
    ) {
        match &self.decider {
            Decider::Controller(_) => self.advance(sup, Input::Wrote { epoch, result }),
            Decider::Follower(_) => self.send_up(&Up::Wrote { epoch, result }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn end(step: u64, failed: Vec<String>) -> WriteEnd {
        WriteEnd {
            epoch: 1,
            step,
            world: 1,
            seconds: 0.5,
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
        let w = commit(d.path(), end(25, Vec::new())).unwrap();
        assert_eq!((w.iteration, w.written), (30, false));
        assert!(!tmp.exists());
        assert_eq!(checkpoint::read_tracker(d.path()).unwrap(), 30);

        let tmp = checkpoint::begin_save(d.path(), 40).unwrap();
        let e = commit(d.path(), end(40, vec!["host 2: disk full".into()])).unwrap_err();
        assert!(e.0.contains("host 2: disk full"), "{e}");
        assert!(!tmp.exists());
        assert_eq!(checkpoint::read_tracker(d.path()).unwrap(), 30);
    }
}
