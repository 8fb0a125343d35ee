//! A rank parked by the agent: it waits for the directive and carries it
//! out (a resume at s*, or a reshape at a new place in the group).

use super::*;

/// Where a resume's time went: parked until the directive came, restoring
/// the snapshot, building the new communicator, and gathering the
/// replicated parts of sliced snapshots.
#[derive(Debug, Default)]
struct ResumeTimes {
    awaited: Duration,
    restore: Duration,
    communicator: Duration,
    gather: Duration,
}

impl Trainer<'_> {
    /// Whether this rank holds the whole state of `step` without a
    /// communicator: its snapshots are not sliced, or every other rank's
    /// store is on this host and holds its slice of `step`.
    fn whole_here(&self, rt: &Runtime, step: u64) -> bool {
        if !rt.sliced() {
            return true;
        }
        (0..self.world)
            .filter(|&r| r != self.rank)
            .all(|r| match rt.restore_sibling(step, r, r) {
                Ok(()) => true,
                Err(e) => {
                    eprintln!(
                        "rank {}: rank {r}'s slice of step {step} is not readable here ({e}): gathering it",
                        self.rank
                    );
                    false
                }
            })
    }

    /// Waits for the agent's directive and carries it out: restores the
    /// snapshot of the step it names (unless the live state is exactly that
    /// step) and joins the new epoch's communicator. At the last step there
    /// is nothing left to train (the other ranks may have finished and
    /// left): no communicator is built (`None`).
    pub(super) fn recover(
        &mut self,
        rt: &mut Runtime,
        dist: &mut Dist,
    ) -> Result<Option<Communicator>, TrainError> {
        let parked = Instant::now();
        loop {
            match rt.await_directive() {
                Directive::Resume { epoch, step } => {
                    // Where a resume's time goes, for its log event.
                    let mut times = ResumeTimes {
                        awaited: parked.elapsed(),
                        ..ResumeTimes::default()
                    };
                    let live = !self.torn && self.state.scalars.step == step;
                    let t = Instant::now();
                    if !live {
                        let meta = rt.restore(step)?;
                        self.state.scalars = Scalars::decode(&meta).ok_or_else(|| {
                            TrainError::Args("snapshot metadata block is malformed".into())
                        })?;
                        self.torn = false;
                    }
                    times.restore = t.elapsed();
                    self.epoch = epoch;
                    if step >= self.args.train_iters && self.whole_here(rt, step) {
                        eprintln!(
                            "rank {}: resumed at step {step}, the last, under epoch {epoch}",
                            self.rank
                        );
                        self.log.write(serde_json::json!({
                            "event": "resume", "step": step, "epoch": epoch, "restored": !live,
                        }))?;
                        return Ok(None);
                    }
                    let t = Instant::now();
                    let built = if self.plan.fails(step, Point::Rebuild) {
                        Err(TrainError::Collective(CollectiveError::Connect {
                            epoch,
                            peer: (self.rank + 1) % self.world,
                            addr: "(the fault plan)".into(),
                            source: std::io::ErrorKind::ConnectionRefused.into(),
                        }))
                    } else {
                        dist.communicator(epoch, &|| rt.directive_pending())
                    };
                    // Sliced snapshots restore this rank's slice of the
                    // parameters: one all-gather, in which every rank (kept
                    // or restored) gives its slice, rebuilds the rest.
                    let built = built.and_then(|mut comm| {
                        times.communicator = t.elapsed();
                        rt.set_communicator(&comm);
                        let t = Instant::now();
                        rt.rebuild_replicated(|buf| comm.all_gather(buf))?;
                        times.gather = t.elapsed();
                        Ok(comm)
                    });
                    match built {
                        Ok(comm) => {
                            eprintln!(
                                "rank {}: resumed at step {step} under epoch {epoch} ({})",
                                self.rank,
                                if live {
                                    "live state kept"
                                } else {
                                    "restored from shared memory"
                                }
                            );
                            self.log.write(serde_json::json!({
                                "event": "resume", "step": step, "epoch": epoch, "restored": !live,
                                "awaited_s": times.awaited.as_secs_f64(),
                                "restore_s": times.restore.as_secs_f64(),
                                "communicator_s": times.communicator.as_secs_f64(),
                                "gather_s": times.gather.as_secs_f64(),
                            }))?;
                            return Ok(Some(comm));
                        }
                        // A newer directive came while building: obey it.
                        Err(TrainError::Collective(CollectiveError::Aborted { .. })) => {}
                        Err(e) => {
                            let peer = match &e {
                                TrainError::Collective(c) => c.peer(),
                                _ => None,
                            };
                            eprintln!(
                                "rank {}: rebuilding the communicator for epoch {epoch} failed: {}; told the agent",
                                self.rank,
                                error_chain(&e)
                            );
                            rt.rebuild_failed(epoch, peer);
                        }
                    }
                }
                Directive::Reshape {
                    epoch,
                    step,
                    rank,
                    world,
                } => {
                    let place = (
                        usize::try_from(rank).unwrap_or(usize::MAX),
                        usize::try_from(world).unwrap_or(0),
                    );
                    let reshaped = self.reshape(rt, dist, epoch, step, place);
                    if reshaped.is_err() {
                        // The rank keeps its place until a reshape completes.
                        dist.place(self.rank, self.world);
                    }
                    match reshaped {
                        Ok(comm) => return Ok(Some(comm)),
                        Err(TrainError::Collective(CollectiveError::Aborted { .. })) => {}
                        Err(TrainError::Collective(c)) => {
                            eprintln!(
                                "rank {}: reshaping under epoch {epoch} failed: {}; told the agent",
                                self.rank,
                                error_chain(&c)
                            );
                            rt.rebuild_failed(epoch, c.peer());
                        }
                        Err(e) => return Err(e),
                    }
                }
                Directive::Stop | Directive::Pause { .. } | Directive::None => {
                    return Err(TrainError::Stopped);
                }
            }
        }
    }
}
