//! The periodic and final checkpoints of a job of several hosts, written
//! by the agents from the snapshots, off the training path.
//!
//! Each host's persister writes its share of a save step (its ranks'
//! directories, into the iteration's `_tmp` directory) and reports it
//! ([`Up::Saved`]); the controller commits the iteration (the tracker
//! names it) only once every rank's directory of that step is written.
//! A step some share of which failed, or that a newer committed step
//! overtook, is never committed: its `_tmp` directory is removed. At the
//! end of a job that succeeded every host writes its share of the final
//! step, and the controller waits for them (or for the hosts to be lost)
//! before it commits and ends.

use super::Driver;
use super::decider::{Decider, Down, FINAL_WAIT, FinalSave, Inbox, Share, Up};
use super::orders::recv;
use crate::persister::{OwnedSource, PersistError};
use crate::recovery::{Event, WriteFailed};
use crate::supervisor::Supervisor;
use hatrain_shared::checkpoint;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

impl Driver<'_> {
    /// Polls the persister: periodic saves, and the dumps that finished.
    pub(super) fn poll_persister(&mut self, sup: &mut Supervisor) -> Option<Event> {
        let sources: HashMap<usize, OwnedSource> = sup
            .ranks()
            .iter()
            .filter_map(|&r| Some((r, self.source(r)?)))
            .collect();
        let p = self.persister.as_mut()?;
        let done = p.poll(sup.ranks(), |r| sources.get(&r).cloned());
        // One dump runs at a time, so at most one finishes per poll.
        let ranks = sup.ranks().to_vec();
        for (step, result) in p.take_shares() {
            self.share_saved(ranks.clone(), step, result);
        }
        let d = done.into_iter().next()?;
        if d.part {
            self.share_done(sup, d.epoch, d.result.map(|w| w.seconds));
            return None;
        }
        Some(Event::Written {
            epoch: d.epoch,
            result: d.result,
        })
    }

    /// This host's share of the periodic save of `step` is written (or
    /// failed): the controller counts it, a follower reports it.
    pub(super) fn share_saved(
        &mut self,
        ranks: Vec<usize>,
        step: u64,
        result: Result<f64, WriteFailed>,
    ) {
        match &self.decider {
            Decider::Controller(c) => {
                let me = c.node;
                self.ranks_saved(me, step, ranks, result);
            }
            Decider::Follower(_) => self.send_up(&Up::Saved {
                step,
                ranks,
                result,
            }),
        }
    }

    /// Host `node` wrote the directories of `ranks` of step `step` (or
    /// failed to): the controller counts it (`Controller::share_saved`),
    /// and the step is committed on disk once every rank's is written.
    pub(super) fn ranks_saved(
        &mut self,
        node: u64,
        step: u64,
        ranks: Vec<usize>,
        result: Result<f64, WriteFailed>,
    ) {
        let Some((dir, world)) = self
            .persister
            .as_ref()
            .map(|p| (p.dir().to_path_buf(), p.world()))
        else {
            tracing::warn!(
                node,
                step,
                "a host's share of a checkpoint, but no rank here registered a checkpoint layout"
            );
            return;
        };
        let Decider::Controller(c) = &mut self.decider else {
            return;
        };
        let v = c.share_saved(node, step, ranks, result.as_ref().map(|_| ()), world);
        for s in v.given_up {
            tracing::warn!(
                step = s,
                "a save step whose shares never all came is given up"
            );
            let _ = std::fs::remove_dir_all(checkpoint::tmp_iter_dir(&dir, s));
        }
        let (step, stale, world) = match v.share {
            Share::Counted => return,
            Share::Refused { rank } => {
                tracing::warn!(
                    node,
                    rank,
                    step,
                    "a share of a checkpoint with another host's rank refused"
                );
                return;
            }
            Share::Failed => {
                if let Err(m) = result {
                    tracing::warn!(node, step, reason = %m, "a host's share of a checkpoint failed: that step is not committed");
                }
                return;
            }
            Share::Whole { step, stale, world } => (step, stale, world),
        };
        let newer_on_disk = checkpoint::read_tracker(&dir).is_ok_and(|t| t >= step);
        let committed = if newer_on_disk {
            // Overtaken: a newer step is on disk already.
            let _ = std::fs::remove_dir_all(checkpoint::tmp_iter_dir(&dir, step));
            Ok(())
        } else {
            checkpoint::commit_save(&dir, step, world).map(|path| {
                tracing::info!(step, path = %path.display(), "checkpoint committed: every host wrote its share");
            })
        };
        if let Err(e) = &committed {
            tracing::error!(step, error = %e, "a checkpoint every host wrote its share of cannot be committed");
        }
        if let Decider::Controller(c) = &mut self.decider {
            c.final_committed(step, committed.as_ref().err().map(|e| e.to_string()));
        }
        // Steps overtaken by this one are never committed.
        for s in stale {
            let _ = std::fs::remove_dir_all(checkpoint::tmp_iter_dir(&dir, s));
        }
    }

    /// At the end of a job of several hosts that succeeded: writes this
    /// host's share of the final checkpoint; the controller then waits for
    /// the others' ([`Driver::final_pending`]).
    pub(super) fn final_share(&mut self, sources: &[OwnedSource]) -> Result<u64, PersistError> {
        let ranks: Vec<usize> = sources.iter().map(|s| s.rank).collect();
        let Some(p) = self.persister.as_mut() else {
            return Err(PersistError::NoLayout {
                rank: ranks.first().copied().unwrap_or(0),
            });
        };
        let last = sources
            .iter()
            .map(|s| s.store.page().step())
            .min()
            .unwrap_or(0);
        let t0 = Instant::now();
        let own = p.finish_part(sources);
        // A periodic share that finished meanwhile goes first.
        let earlier = p.take_shares();
        for (step, result) in earlier {
            self.share_saved(ranks.clone(), step, result);
        }
        let (step, result) = match &own {
            Ok(step) => (*step, Ok(t0.elapsed().as_secs_f64())),
            Err(e) => (last, Err(WriteFailed(e.to_string()))),
        };
        let now = self.now();
        if let Decider::Controller(c) = &mut self.decider {
            c.final_save = Some(FinalSave {
                step,
                until: now + FINAL_WAIT,
                failed: None,
            });
        }
        self.share_saved(ranks, step, result);
        own
    }

    /// Whether the controller still waits for shares of the final
    /// checkpoint (see [`Controller::final_pending`]).
    pub(super) fn final_pending(&self, lost: &[u64]) -> bool {
        match &self.decider {
            Decider::Controller(c) => c.final_pending(self.now(), lost),
            Decider::Follower(_) => false,
        }
    }

    /// The final checkpoint the controller committed, or why not; `None`
    /// when it did not wait for one.
    pub(super) fn final_committed(&self) -> Option<Result<(u64, PathBuf), PersistError>> {
        let Decider::Controller(c) = &self.decider else {
            return None;
        };
        let f = c.final_save.as_ref()?;
        let dir = self.persister.as_ref()?.dir().to_path_buf();
        let on_disk = checkpoint::read_tracker(&dir).ok();
        Some(match (&f.failed, on_disk) {
            (_, Some(t)) if t >= f.step => Ok((t, dir)),
            (Some(why), _) => Err(PersistError::NotCommitted {
                step: f.step,
                detail: why.clone(),
            }),
            (None, _) => Err(PersistError::NotCommitted {
                step: f.step,
                detail: "not every host's share was written in time (a host lost, or too slow)"
                    .into(),
            }),
        })
    }

    /// The controller tells every follower that the final checkpoint is
    /// settled.
    pub(super) fn final_settled(&self) {
        let Decider::Controller(c) = &self.decider else {
            return;
        };
        if c.final_save.is_none() {
            return;
        }
        for n in c.everyone() {
            self.send_down(
                n,
                Down {
                    final_done: true,
                    ..Down::default()
                },
            );
        }
    }

    /// A follower that sent its share of the final checkpoint stays (and
    /// so its report goes out) until the controller settled it, the
    /// controller's host is lost, or the wait is over; then its result:
    /// the checkpoint on disk, or why not.
    pub(super) async fn await_final(
        &mut self,
        sup: &mut Supervisor,
        rx: &mut Option<Inbox>,
        own: Result<u64, PersistError>,
    ) -> Result<(u64, PathBuf), PersistError> {
        let until = Instant::now() + FINAL_WAIT;
        while let Decider::Follower(f) = &self.decider {
            let leader_lost = self
                .peers
                .as_ref()
                .is_none_or(|p| p.membership.seen().lost().contains(&f.leader));
            if f.final_done || leader_lost || Instant::now() >= until {
                break;
            }
            tokio::select! {
                Some((from, bytes)) = recv(rx) => self.on_peer(sup, from, &bytes),
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
        let dir = self
            .persister
            .as_ref()
            .map(|p| p.dir().to_path_buf())
            .unwrap_or_default();
        match (own, checkpoint::read_tracker(&dir).ok()) {
            (Ok(step), Some(t))
            | (Err(PersistError::FinalStepMissing { last: step, .. }), Some(t))
                if t >= step =>
            {
                Ok((t, dir))
            }
            (Err(e), _) => Err(e),
            (Ok(step), _) => Err(PersistError::NotCommitted {
                step,
                detail: "the controller did not commit it (see its log)".into(),
            }),
        }
    }
}
