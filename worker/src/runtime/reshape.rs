//! A reshape (elastic training): the rank takes a new place in a resized
//! data-parallel group without leaving the process. Its state map changes
//! with the place (a ZeRO shard's length does), so the agent makes its
//! store anew for the new layout, and the runtime re-attaches to it. The
//! agent also names the replicas of lost ranks this rank brings to the
//! group: their bytes at the step the group resumes from are read here and
//! handed to the training loop, which re-slices them with the others'.

use super::{Runtime, RuntimeError, SharedBuf, check_buffers};
use hatrain_shared::control::{self, Donation, PROTOCOL, Request, Response};
use hatrain_shared::shm::{Phase, ShmError, Store};
use hatrain_shared::statemap::StateMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

/// A lost rank's state at the step of a reshape, read from its replica.
#[derive(Debug, Clone, PartialEq)]
pub struct Donated {
    pub rank: usize,
    /// Its state map (at its old place).
    pub map: StateMap,
    /// Its metadata block.
    pub meta: Vec<u8>,
    /// Per buffer (parts 1..), the elements the replica holds and their
    /// values.
    pub parts: Vec<(Range<usize>, Vec<f32>)>,
}

impl Runtime {
    /// Takes the new place `map` describes, under the reshape directive of
    /// `epoch` to `step`: `buffers` replace the registered ones (in the
    /// map's order), the agent makes the store anew for the new layout, and
    /// the replicas it names are read at `step`. The caller has restored or
    /// kept the old state at `step` before (the old store is gone after
    /// this), then fills `buffers` and commits `step` as its start.
    ///
    /// Without an agent this only swaps the buffers.
    pub fn reshape(
        &mut self,
        epoch: u64,
        step: u64,
        map: StateMap,
        buffers: Vec<SharedBuf>,
    ) -> Result<Vec<Donated>, RuntimeError> {
        let meta_len = check_buffers(&map, &buffers)?;
        self.wait_commit();
        let recover = self.recovers();
        // The old store's threads stop; its mapping goes once the SIGBUS
        // handler points at the new one.
        if let Some(mut a) = self.attached.take() {
            a.jobs.take();
            a.stop.store(true, Ordering::SeqCst);
            for t in a.threads.drain(..) {
                let _ = t.join();
            }
        }
        for (i, buf) in buffers.iter().enumerate() {
            let g = buf.read().unwrap_or_else(|p| p.into_inner());
            crate::uce::register(i + 1, g.as_ptr().cast(), g.len() * 4);
        }
        self.map = map;
        self.buffers = buffers;
        self.meta_len = meta_len;
        let Some(socket) = std::env::var_os(control::ENV_SOCKET).map(PathBuf::from) else {
            return Ok(Vec::new());
        };
        let mut conn = control::connect(&socket)?;
        PROTOCOL.send_json(
            &mut conn,
            &Request::Reshape {
                rank: self.rank,
                pid: std::process::id(),
                epoch,
                map: self.map.clone(),
            },
        )?;
        let (store, sliced, donations) = match PROTOCOL.recv_json(&mut conn)? {
            Response::Reshaped {
                store,
                sliced,
                donations,
            } => (store, sliced, donations),
            Response::Error { message } => return Err(RuntimeError::Refused(message)),
            other => {
                return Err(RuntimeError::Unexpected {
                    expected: "reshaped",
                    got: format!("{other:?}"),
                });
            }
        };
        let incarnation = std::env::var(super::ENV_RESTART_COUNT)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        self.attach(store, recover, sliced, incarnation)?;
        if let Some(a) = &self.attached {
            let page = a.store.page();
            page.set_step(step);
            page.set_epoch(epoch);
            page.set_phase(Phase::Restoring);
        }
        donations
            .into_iter()
            .map(|d| read_donation(d, step, sliced))
            .collect()
    }
}

/// Reads donation `d` at `step`: the newest sealed slot of that step that
/// verifies.
fn read_donation(d: Donation, step: u64, sliced: bool) -> Result<Donated, RuntimeError> {
    let me = hatrain_shared::trust::me();
    if let Some(dir) = d.store.parent() {
        hatrain_shared::trust::check(dir, hatrain_shared::trust::Kind::Dir, me)?;
    }
    hatrain_shared::trust::check(&d.store, hatrain_shared::trust::Kind::File, me)?;
    d.map.validate()?;
    let store = Store::open(&d.store)?;
    if store.page().layout_hash() != d.map.slot_layout_hash(sliced) {
        return Err(RuntimeError::Layout { path: d.store });
    }
    let held: Vec<Range<usize>> = (1..d.map.parts.len())
        .map(|i| {
            let r = d.map.held(i, sliced);
            r.start as usize..r.end as usize
        })
        .collect();
    let meta_len = d.map.parts.first().map_or(0, |p| p.len as usize);
    let mut last_err = None;
    for info in store.sealed().into_iter().filter(|i| i.step == step) {
        let mut meta = vec![0u8; meta_len];
        let mut data: Vec<Vec<f32>> = held.iter().map(|r| vec![0f32; r.len()]).collect();
        let mut outs: Vec<&mut [u8]> = vec![&mut meta[..]];
        outs.extend(
            data.iter_mut()
                .map(|v| bytemuck::cast_slice_mut(&mut v[..])),
        );
        match store.read_slot(info.slot, &mut outs) {
            Ok(read) if read.step == step => {
                return Ok(Donated {
                    rank: d.rank,
                    map: d.map,
                    meta,
                    parts: held.into_iter().zip(data).collect(),
                });
            }
            Ok(read) => {
                last_err = Some(ShmError::BadSlot {
                    path: d.store.clone(),
                    slot: read.slot,
                    detail: format!("holds step {}, not {step}", read.step),
                });
            }
            Err(e) => last_err = Some(e),
        }
    }
    Err(match last_err {
        Some(e) => e.into(),
        None => RuntimeError::NoSnapshot {
            step,
            path: d.store,
        },
    })
}
