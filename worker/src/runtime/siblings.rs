//! Sliced snapshots of ranks on one host: a restore reads the slices the
//! other ranks hold straight from their stores, beside this rank's in the
//! agent's folder, instead of gathering them over the communicator.

use super::{Runtime, RuntimeError, read_step};
use hatrain_shared::shm::{Store, store_path};
use hatrain_shared::statemap::Sharing;
use std::path::Path;

impl Runtime {
    /// With sliced snapshots: copies the slices that sibling rank `rank`
    /// holds in its sealed snapshot of `step` into this rank's buffers,
    /// reading the sibling's store, which lies beside this rank's in the
    /// agent's folder (a job whose ranks share one host). `index` is the
    /// sibling's number in the replication groups (its slice: see
    /// [`hatrain_shared::shard::shard_range`]). After this rank's
    /// [`Runtime::restore`] of `step` and this for every sibling, each
    /// replicated part is whole, with no collective. The copy is verified
    /// as it is made (the sibling's checksum covers the whole slot: its
    /// parts held by it alone are read and dropped). Nothing to do without
    /// sliced snapshots.
    ///
    /// Call it while the ranks restore: the sibling's snapshot of `step`
    /// is not rewritten before every rank has joined the next
    /// communicator.
    pub fn restore_sibling(
        &self,
        step: u64,
        rank: usize,
        index: usize,
    ) -> Result<(), RuntimeError> {
        let Some(a) = self.attached.as_ref().filter(|a| a.sliced) else {
            return Ok(());
        };
        let dir = a.store.path().parent().unwrap_or(Path::new("."));
        let path = store_path(dir, rank);
        let me = hatrain_shared::trust::me();
        hatrain_shared::trust::check(&path, hatrain_shared::trust::Kind::File, me)?;
        // The sibling's map is this one with its own place in each group.
        let mut map = self.map.clone();
        for p in &mut map.parts {
            if let Sharing::Replicated { group, index: i } = &mut p.sharing {
                if index >= *group {
                    return Err(RuntimeError::Buffers(format!(
                        "sibling index {index} outside a replication group of {group}"
                    )));
                }
                *i = index;
            }
        }
        let store = Store::open_lazily(&path)?;
        if store.page().layout_hash() != map.slot_layout_hash(true) {
            return Err(RuntimeError::Layout { path });
        }
        // A commit may still read borrowed memory (no lock guards it).
        self.wait_commit();
        let offsets = map.slot_offsets(true);
        // Per part (the meta block first): whether it is sliced across the
        // group; the others (the meta block, the sibling's own parts) are
        // read into scratch and dropped.
        let sliced: Vec<bool> = map
            .parts
            .iter()
            .map(|p| matches!(p.sharing, Sharing::Replicated { group, .. } if group > 1))
            .collect();
        let mut scratch: Vec<Vec<u8>> = offsets
            .iter()
            .zip(&sliced)
            .map(|(r, &s)| if s { Vec::new() } else { vec![0u8; r.len()] })
            .collect();
        let mut guards: Vec<_> = self.buffers.iter().map(|b| b.write()).collect();
        let (meta, parts) = scratch.split_first_mut().expect("the meta block is part 0");
        let mut outs: Vec<&mut [u8]> = vec![&mut meta[..]];
        for (i, (g, own)) in guards.iter_mut().zip(parts.iter_mut()).enumerate() {
            if sliced[i + 1] {
                let r = map.held(i + 1, true);
                outs.push(g.bytes_mut(r.start as usize..r.end as usize));
            } else {
                outs.push(&mut own[..]);
            }
        }
        read_step(&store, step, &mut outs)
    }
}
