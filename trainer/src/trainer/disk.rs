//! The trainer's own checkpoints: `--load` into this rank's shard, and the
//! collective save (every rank writes its directory; rank 0 commits the
//! tracker; every phase is agreed on by all ranks, so a failure anywhere is
//! a failure everywhere and the previous checkpoint stays).

use super::*;

impl Trainer<'_> {
    pub(super) fn load(&mut self, dir: &Path, comm: &mut Communicator) -> Result<u64, TrainError> {
        let args = self.args;
        let lead = self.rank == 0;
        let iteration = checkpoint::read_tracker(dir).map_err(TrainError::Load)?;
        let with_moments = !args.finetune && !args.no_load_optim;
        let loaded = ck::load_shard(dir, iteration, &self.cfg, self.shard.clone(), with_moments)
            .map_err(TrainError::Load)?;
        {
            let mut params = write(&self.state.params);
            params[self.shard.clone()].copy_from_slice(&loaded.params);
            comm.all_gather(&mut params)?;
        }
        let warn = |what: &str| {
            if lead {
                eprintln!(
                    "warning: {what}; this resume is NOT exact: the run will differ from an uninterrupted one"
                );
            }
        };
        if args.finetune {
            warn(
                "--finetune loads only the weights and starts at step 0 with fresh optimizer state and RNG",
            );
            return Ok(iteration);
        }
        let s = &mut self.state.scalars;
        s.step = loaded.iteration;
        s.data_position = loaded.data_position;
        match loaded.moments {
            Some((m, v)) => {
                write(&self.state.exp_avg).copy_from_slice(&m);
                write(&self.state.exp_avg_sq).copy_from_slice(&v);
            }
            None => warn("--no-load-optim starts AdamW's moments from zero"),
        }
        if args.no_load_rng {
            warn("--no-load-rng restarts the data sampler's RNG from the seed");
        } else {
            s.rng = SplitMix64::new(loaded.rng_state);
        }
        if lead {
            println!(
                "resumed from {} at iteration {iteration} (saved by {} rank(s))",
                dir.display(),
                loaded.saved_world_size
            );
        }
        Ok(iteration)
    }

    pub(super) fn save(
        &mut self,
        dir: &Path,
        comm: &mut Communicator,
    ) -> Result<PathBuf, TrainError> {
        let (rank, world) = (self.rank, self.world);
        let iteration = self.state.scalars.step;
        // Rank 0 prepares the directory; the others wait for it.
        let prepared = if rank == 0 {
            checkpoint::begin_save(dir, iteration).map(|_| ())
        } else {
            Ok(())
        };
        agree(comm, iteration, prepared)?;
        let tmp = checkpoint::tmp_iter_dir(dir, iteration);
        let written = {
            let (p, m, v) = (
                read(&self.state.params),
                read(&self.state.exp_avg),
                read(&self.state.exp_avg_sq),
            );
            let meta = self.state.scalars.encode();
            let parts: [&[u8]; 4] = [
                &meta,
                bytemuck::cast_slice(&p),
                bytemuck::cast_slice(&m),
                bytemuck::cast_slice(&v),
            ];
            let views = parts.map(hatrain_shared::statemap::PartView::whole);
            checkpoint::write_rank(&tmp, &self.map, rank, iteration, &views)
        };
        agree(comm, iteration, written)?;
        // Rank 0 publishes; everyone learns whether it worked.
        let committed = if rank == 0 {
            checkpoint::commit_save(dir, iteration, world).map(|_| ())
        } else {
            Ok(())
        };
        agree(comm, iteration, committed)?;
        Ok(checkpoint::iter_dir(dir, iteration))
    }
}

/// One phase of a collective save: every rank learns every rank's outcome.
/// Returns this rank's own error, or names the ranks that failed elsewhere.
fn agree(
    comm: &mut Communicator,
    iteration: u64,
    mine: Result<(), CheckpointError>,
) -> Result<(), TrainError> {
    let status = comm.all_gather_f64(if mine.is_ok() { 1.0 } else { 0.0 })?;
    mine.map_err(|source| TrainError::Save { iteration, source })?;
    let ranks: Vec<usize> = (0..status.len()).filter(|&r| status[r] != 1.0).collect();
    if ranks.is_empty() {
        Ok(())
    } else {
        Err(TrainError::SaveElsewhere { iteration, ranks })
    }
}
