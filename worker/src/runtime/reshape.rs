//! A reshape (elastic training): the rank takes a new place in a resized
//! data-parallel group without leaving the process.
//!
//! 1. [`Runtime::donations`]: the agent names the replicas of lost ranks
//!    this rank brings to the group; their bytes at the step the group
//!    resumes from are read here and handed to the training loop, which
//!    re-slices them with the others'. The rank's store is untouched, so a
//!    reshape that fails here is tried again from it.
//! 2. [`Runtime::reshape`], once the new state is whole: its state map
//!    changes with the place (a ZeRO shard's length does), so the agent
//!    makes its store anew for the new layout, and the runtime re-attaches
//!    to it.

use super::{Buffer, Runtime, RuntimeError, check_buffers};
use hatrain_shared::control::{self, Donation, PROTOCOL, Request, Response};
use hatrain_shared::shm::{Phase, Store};
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
    /// bytes (little-endian, of the part's dtype).
    pub parts: Vec<(Range<usize>, Vec<u8>)>,
}

impl Runtime {
    /// The lost ranks' state at `step` that the agent says this rank
    /// brings to a reshape, read from their replicas (none without an
    /// agent).
    pub fn donations(&self, step: u64) -> Result<Vec<Donated>, RuntimeError> {
        let Some(socket) = std::env::var_os(control::ENV_SOCKET).map(PathBuf::from) else {
            return Ok(Vec::new());
        };
        let reply = ask(
            &socket,
            &Request::Donations {
                rank: self.rank,
                step,
            },
        )?;
        let (sliced, donations) = match reply {
            Response::Donations { sliced, donations } => (sliced, donations),
            other => return Err(unexpected("donations", other)),
        };
        donations
            .into_iter()
            .map(|d| read_donation(d, step, sliced))
            .collect()
    }

    /// Takes the new place `map` describes, under the reshape directive of
    /// `epoch` to `step`: `buffers` replace the registered ones (in the
    /// map's order), and the agent makes the store anew for the new layout
    /// (the old one, and its snapshots, are gone after this). The caller
    /// has filled `buffers` with the state at `step`, and commits it next
    /// as its start.
    ///
    /// Without an agent this only swaps the buffers.
    pub fn reshape<B: Into<Buffer>>(
        &mut self,
        epoch: u64,
        step: u64,
        map: StateMap,
        buffers: Vec<B>,
    ) -> Result<(), RuntimeError> {
        let buffers: Vec<Buffer> = buffers.into_iter().map(Into::into).collect();
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
            let (at, len) = buf.region();
            crate::uce::register(i + 1, at, len);
        }
        self.map = map;
        self.buffers = buffers;
        self.meta_len = meta_len;
        let Some(socket) = std::env::var_os(control::ENV_SOCKET).map(PathBuf::from) else {
            return Ok(());
        };
        let reply = ask(
            &socket,
            &Request::Reshape {
                rank: self.rank,
                pid: std::process::id(),
                epoch,
                map: self.map.clone(),
            },
        )?;
        let (store, sliced) = match reply {
            Response::Reshaped { store, sliced } => (store, sliced),
            other => return Err(unexpected("reshaped", other)),
        };
        let incarnation = crate::standby::restart_count();
        self.attach(store, recover, sliced, incarnation, true)?;
        if let Some(a) = &self.attached {
            let page = a.store.page();
            page.set_step(step);
            page.set_epoch(epoch);
            page.set_phase(Phase::Restoring);
        }
        Ok(())
    }
}

/// One request to the agent and its reply; a refusal is an error.
fn ask(socket: &std::path::Path, request: &Request) -> Result<Response, RuntimeError> {
    let mut conn = control::connect(socket)?;
    PROTOCOL.send_json(&mut conn, request)?;
    match PROTOCOL.recv_json(&mut conn)? {
        Response::Error { message } => Err(RuntimeError::Refused(message)),
        other => Ok(other),
    }
}

fn unexpected(expected: &'static str, got: Response) -> RuntimeError {
    RuntimeError::Unexpected {
        expected,
        got: format!("{got:?}"),
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
    let mut meta = vec![0u8; meta_len];
    let mut data: Vec<Vec<u8>> = held
        .iter()
        .zip(&d.map.parts[1..])
        .map(|(r, p)| vec![0u8; r.len() * p.dtype.size()])
        .collect();
    let mut outs: Vec<&mut [u8]> = vec![&mut meta[..]];
    outs.extend(data.iter_mut().map(|v| &mut v[..]));
    super::read_step(&store, step, &mut outs)?;
    Ok(Donated {
        rank: d.rank,
        map: d.map,
        meta,
        parts: held.into_iter().zip(data).collect(),
    })
}
