//! Elastic training: a reshape directive gives this rank a new place `r′`
//! of `W′` in the data-parallel group, at step `s*`.
//!
//! 1. The rank brings its state to `s*` (kept live, or restored from its
//!    snapshot) and notes what it contributes: the scalars, its ZeRO shard
//!    of both moments, and the lost ranks' state its agent reads from their
//!    replicas (the donations).
//! 2. It builds the communicator of `W′` at its new place.
//! 3. The ranks tell each other what they hold (an all-gather of element
//!    ranges, not elements) and every contributor must agree on the
//!    scalars. Each then takes, of each moment, the elements of its new
//!    shard `shard_range(numel, W′, r′)`, and of the parameters (the same
//!    on every rank) those it lacks after a sliced restore: each element it
//!    does not hold comes from one holder, point to point
//!    ([`hatrain_shared::resize::route`]): through shared memory from a
//!    rank of its host (`local`), over the ring (`all_to_all_bytes`) from
//!    the others; what it holds does not move. Every element must come
//!    from somewhere. The log's `reshape` event gives every rank's bytes,
//!    by way, beside what an all-gather would have moved.
//! 4. Only then does it take the new place with the runtime (new state
//!    map, new store), and commit `s*` as the first snapshot of the new
//!    layout.
//!
//! Until step 4 the old moment buffers and the old store are untouched
//! (the parameters may take the values of `s*` in step 3): a fault during
//! the exchange brings another reshape directive (or a resume), and the
//! rank, still counted torn, starts again from its snapshot of `s*`.
//!
//! The global batch and the sample order do not depend on the world size
//! (every rank draws every seed; rank `r` takes sequences `r·B/W..`), so a
//! run after a reshape at `s*` is the run a fresh start at `W′` from a
//! checkpoint of `s*` would make.

use super::local::Local;
use super::*;

/// A run of elements of one buffer (1 parameters, 2 and 3 the moments).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Piece {
    part: u8,
    start: usize,
    data: Vec<f32>,
}

impl Trainer<'_> {
    /// Carries out `Reshape { epoch, step, rank, world }`.
    pub(super) fn reshape(
        &mut self,
        rt: &mut Runtime,
        dist: &mut Dist,
        epoch: u64,
        step: u64,
        (rank, world): (usize, usize),
    ) -> Result<Communicator, TrainError> {
        if world == 0 || rank >= world || !self.args.global_batch.is_multiple_of(world) {
            return Err(TrainError::Args(format!(
                "cannot take place {rank} of {world}: the global batch {} must be a positive multiple of the world size",
                self.args.global_batch
            )));
        }
        let numel = self.model.numel();
        // 1. What this rank brings: its state at s*, and the lost ranks'.
        let (scalars, mut pieces, params_held) = self.contribution(rt, step)?;
        let scalars = Some(scalars).filter(|_| !pieces.is_empty());
        for d in rt.donations(step)? {
            pieces.extend(donation_pieces(&d, numel)?);
        }
        // 2. The new group's communicator.
        dist.place(rank, world);
        let mut comm = dist.communicator(epoch, &|| rt.directive_pending())?;
        rt.set_communicator(&comm);

        // 3. Who holds what (a small all-gather); then each place takes
        //    only the elements of its new shard and of the parameters it
        //    lacks, each from one holder, point to point.
        let shard = shard_range(numel, world, rank);
        let mut held: Held = pieces
            .iter()
            .map(|p| (p.part, p.start..p.start + p.data.len()))
            .collect();
        if !params_held.is_empty() {
            held.push((1, params_held.clone()));
        }
        let described = comm.all_gather_bytes(&describe(scalars.as_ref(), &held))?;
        let mut agreed = scalars;
        let mut holds = Vec::with_capacity(world);
        for (from, bytes) in described.iter().enumerate() {
            let (s, theirs) = undescribe(bytes, numel).ok_or_else(|| {
                TrainError::Args(format!("reshape: rank {from}'s holdings are malformed"))
            })?;
            match (s, agreed) {
                (Some(s), Some(a)) if s != a => {
                    return Err(TrainError::Args(format!(
                        "reshape: rank {from} is at step {} (data position {}), another at step {} ({})",
                        s.step, s.data_position, a.step, a.data_position
                    )));
                }
                (Some(s), None) => agreed = Some(s),
                _ => {}
            }
            let mut by_part = vec![Vec::new(); 3];
            for (part, range) in theirs {
                by_part[usize::from(part) - 1].push(range);
            }
            holds.push(by_part);
        }
        let needs: Vec<Vec<Vec<Range<usize>>>> = (0..world)
            .map(|q| {
                let s = shard_range(numel, world, q);
                vec![vec![0..numel], vec![s.clone()], vec![s]]
            })
            .collect();
        let moves = hatrain_shared::resize::route(&holds, &needs).map_err(|e| {
            TrainError::Args(format!(
                "reshape to {world} ranks at step {step}: {e} (a lost rank's replica is missing)"
            ))
        })?;
        let mut out = vec![Vec::new(); world];
        {
            let p = read(&self.state.params);
            let mut to_send: Vec<Vec<Piece>> = vec![Vec::new(); world];
            for m in moves.iter().filter(|m| m.from == rank) {
                let part = m.part as u8 + 1;
                let data = if part == 1
                    && params_held.start <= m.range.start
                    && m.range.end <= params_held.end
                {
                    p[m.range.clone()].to_vec()
                } else {
                    pieces
                        .iter()
                        .find(|x| {
                            x.part == part
                                && x.start <= m.range.start
                                && m.range.end <= x.start + x.data.len()
                        })
                        .map(|x| x.data[m.range.start - x.start..m.range.end - x.start].to_vec())
                        .ok_or_else(|| {
                            TrainError::Args(format!(
                                "reshape: this rank was to send {m:?}, which it does not hold"
                            ))
                        })?
                };
                to_send[m.to].push(Piece {
                    part,
                    start: m.range.start,
                    data,
                });
            }
            for (t, ps) in to_send.iter().enumerate() {
                if !ps.is_empty() {
                    out[t] = encode(None, ps);
                }
            }
        }
        // Ranks of this host take their pieces through shared memory; the
        // barrier orders every file before its reading.
        let local = Local::here();
        let keys = comm.all_gather_bytes(Local::key(local.as_ref()))?;
        let sibling = |q: usize| q != rank && !keys[rank].is_empty() && keys[q] == keys[rank];
        let mut shm_sent = 0;
        if let Some(l) = &local {
            for (t, bytes) in out.iter_mut().enumerate() {
                if sibling(t) && !bytes.is_empty() && l.put(epoch, rank, t, bytes) {
                    shm_sent += bytes.len();
                    *bytes = Vec::new();
                }
            }
        }
        let any_siblings = (0..world)
            .any(|q| !keys[q].is_empty() && keys.iter().filter(|k| **k == keys[q]).count() > 1);
        if any_siblings {
            comm.barrier()?;
        }
        let sent: usize = out.iter().map(Vec::len).sum();
        let mut got = comm.all_to_all_bytes(out)?;
        let received: usize = got.iter().map(Vec::len).sum();
        let mut shm_received = 0;
        if let Some(l) = &local {
            // A sibling that could not leave a file sent its pieces over
            // the ring instead.
            for (from, bytes) in got.iter_mut().enumerate() {
                let expected = moves.iter().any(|m| m.from == from && m.to == rank);
                if sibling(from) && expected && bytes.is_empty() {
                    *bytes = l.take(epoch, from, rank)?;
                    shm_received += bytes.len();
                }
            }
        }
        let moved = moved_by_rank(&mut comm, [sent, received, shm_sent, shm_received], &holds)?;
        let (mut m, mut v) = (vec![0f32; shard.len()], vec![0f32; shard.len()]);
        let mut have = [vec![false; shard.len()], vec![false; shard.len()]];
        let mut params_have = vec![false; numel];
        params_have[params_held.clone()].fill(true);
        {
            let mut p = write(&self.state.params);
            // What this rank holds itself, then what it was sent.
            let mut theirs_all = vec![pieces];
            for (from, bytes) in got.iter().enumerate().filter(|(_, b)| !b.is_empty()) {
                let (_, theirs) = decode(bytes, numel).ok_or_else(|| {
                    TrainError::Args(format!("reshape: rank {from}'s pieces are malformed"))
                })?;
                theirs_all.push(theirs);
            }
            for piece in theirs_all.into_iter().flatten() {
                let range = piece.start..piece.start + piece.data.len();
                let (dst, seen, base) = match piece.part {
                    1 => (&mut p[..], &mut params_have[..], 0),
                    2 => (&mut m[..], &mut have[0][..], shard.start),
                    _ => (&mut v[..], &mut have[1][..], shard.start),
                };
                let lo = range.start.max(base);
                let hi = range.end.min(base + dst.len());
                if lo < hi {
                    dst[lo - base..hi - base]
                        .copy_from_slice(&piece.data[lo - range.start..hi - range.start]);
                    seen[lo - base..hi - base].fill(true);
                }
            }
        }
        let missing = |name: &str, seen: &[bool], base: usize| -> Result<(), TrainError> {
            match seen.iter().position(|s| !s) {
                None => Ok(()),
                Some(i) => Err(TrainError::Args(format!(
                    "reshape to {world} ranks at step {step}: element {} of {name} came from no rank (a lost rank's replica is missing)",
                    base + i
                ))),
            }
        };
        missing("exp_avg", &have[0], shard.start)?;
        missing("exp_avg_sq", &have[1], shard.start)?;
        missing("params", &params_have, 0)?;
        let scalars = agreed.ok_or_else(|| {
            TrainError::Args(format!(
                "reshape to {world} ranks at step {step}: no rank holds the state"
            ))
        })?;
        if scalars.step != step {
            return Err(TrainError::Args(format!(
                "reshape to step {step}: the ranks' state is of step {}",
                scalars.step
            )));
        }

        // 4. The new place: its state map and store, and s* as its first
        //    snapshot.
        let save = self.args.save.as_ref().map(|dir| SaveTo {
            dir: dir.clone(),
            interval: self.args.save_interval,
        });
        let map = ck::state_map(
            &self.cfg,
            world,
            rank,
            save.as_ref(),
            serde_json::to_value(self.args).unwrap_or(serde_json::Value::Null),
        );
        let (m, v) = (shared(m), shared(v));
        rt.reshape(
            epoch,
            step,
            map.clone(),
            vec![
                Arc::clone(&self.state.params),
                Arc::clone(&m),
                Arc::clone(&v),
            ],
        )?;
        rt.set_communicator(&comm);
        self.state.exp_avg = m;
        self.state.exp_avg_sq = v;
        self.state.scalars = scalars;
        self.map = map;
        self.rank = rank;
        self.world = world;
        self.shard = shard;
        self.epoch = epoch;
        self.torn = false;
        rt.commit(step, epoch, scalars.encode(), CommitOf::Start);
        self.log = JsonLog::open(self.args.log_jsonl.as_deref(), rank == 0)?;
        eprintln!(
            "rank {rank}: reshaped to {world} ranks at step {step} under epoch {epoch} ({sent} bytes sent and {received} received over the network, {shm_sent} and {shm_received} through shared memory)"
        );
        self.log.write(serde_json::json!({
            "event": "reshape", "step": step, "epoch": epoch, "world_size": world,
            "bytes_sent": sent, "bytes_received": received,
            "bytes_sent_shm": shm_sent, "bytes_received_shm": shm_received,
            "by_rank": moved,
        }))?;
        Ok(comm)
    }

    /// This rank's state at `step` (restored from its snapshot unless the
    /// live state is exactly there): its scalars, its moments as pieces,
    /// and the elements of the parameters it holds (all, unless a sliced
    /// snapshot was restored).
    fn contribution(
        &mut self,
        rt: &mut Runtime,
        step: u64,
    ) -> Result<(Scalars, Vec<Piece>, Range<usize>), TrainError> {
        let live = !self.torn && self.state.scalars.step == step;
        let mut params_held = 0..self.model.numel();
        if !live && !rt.has_snapshots() {
            // A rank joining a growing group: it brings nothing.
            return Ok((self.state.scalars, Vec::new(), 0..0));
        }
        if !live {
            let meta = rt.restore(step)?;
            self.state.scalars = Scalars::decode(&meta)
                .ok_or_else(|| TrainError::Args("snapshot metadata block is malformed".into()))?;
            // Still torn until the reshape completes: with a sliced
            // snapshot only this rank's slice of the parameters is valid,
            // so an attempt that fails restores again.
            params_held = rt.held().first().cloned().unwrap_or(params_held);
        }
        let start = self.shard.start;
        let pieces = vec![
            Piece {
                part: 2,
                start,
                data: read(&self.state.exp_avg).clone(),
            },
            Piece {
                part: 3,
                start,
                data: read(&self.state.exp_avg_sq).clone(),
            },
        ];
        Ok((self.state.scalars, pieces, params_held))
    }
}

/// The pieces of a lost rank's donated state: its parameters (the slice
/// its replica holds) and its moments, at its old shard.
fn donation_pieces(d: &Donated, numel: usize) -> Result<Vec<Piece>, TrainError> {
    let bad = |why: &str| {
        TrainError::Args(format!(
            "the replica of rank {} does not fit this model: {why}",
            d.rank
        ))
    };
    let [(params_at, params), (m_at, m), (v_at, v)] = &d.parts[..] else {
        return Err(bad("it does not hold three buffers"));
    };
    if d.map.parts[1..]
        .iter()
        .any(|p| p.dtype != hatrain_shared::statemap::Dtype::F32)
    {
        return Err(bad("its buffers are not float32"));
    }
    let floats = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let shard = match d.map.parts.get(1).map(|p| p.sharing) {
        Some(hatrain_shared::statemap::Sharing::Replicated { group, index })
            if index < group && d.map.parts[1].len == numel as u64 =>
        {
            shard_range(numel, group, index)
        }
        _ => return Err(bad("its parameters are not a replicated part of this size")),
    };
    if *m_at != (0..shard.len()) || *v_at != (0..shard.len()) {
        return Err(bad("its moments are not its shard"));
    }
    Ok(vec![
        Piece {
            part: 1,
            start: params_at.start,
            data: floats(params),
        },
        Piece {
            part: 2,
            start: shard.start,
            data: floats(m),
        },
        Piece {
            part: 3,
            start: shard.start,
            data: floats(v),
        },
    ])
}

/// Every rank's bytes moved in the reshape (`mine`: sent and received over
/// the network, then through shared memory), for rank 0's log, beside what
/// an all-gather of every rank's holdings (`holds`, in f32 elements) would
/// have brought it.
fn moved_by_rank(
    comm: &mut Communicator,
    mine: [usize; 4],
    holds: &[Vec<Vec<Range<usize>>>],
) -> Result<Vec<serde_json::Value>, TrainError> {
    let bytes: Vec<u8> = mine
        .iter()
        .flat_map(|b| (*b as u64).to_le_bytes())
        .collect();
    let held: Vec<u64> = holds
        .iter()
        .map(|parts| parts.iter().flatten().map(|r| 4 * r.len() as u64).sum())
        .collect();
    let all: u64 = held.iter().sum();
    comm.all_gather_bytes(&bytes)?
        .iter()
        .enumerate()
        .map(|(q, b)| {
            let w: Vec<u64> = b
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect();
            let ([sent, received, sent_shm, received_shm], 32) = (&w[..], b.len()) else {
                return Err(TrainError::Args(format!(
                    "reshape: rank {q}'s byte counts are malformed"
                )));
            };
            Ok(serde_json::json!({
                "sent": sent, "received": received,
                "sent_shm": sent_shm, "received_shm": received_shm,
                "all_gather": all - held.get(q).copied().unwrap_or(0),
            }))
        })
        .collect()
}

/// Runs of elements a rank holds: part (1 parameters, 2 and 3 the
/// moments) and range.
type Held = Vec<(u8, Range<usize>)>;

/// What a rank holds, for the others to plan the moves by: whether it
/// holds the state (u8), its scalars, the number of runs, then each run:
/// part (u8), start and length (u64).
fn describe(scalars: Option<&Scalars>, held: &[(u8, Range<usize>)]) -> Vec<u8> {
    let mut out = vec![u8::from(scalars.is_some())];
    out.extend(scalars.map_or_else(|| vec![0; META_LEN], Scalars::encode));
    out.extend_from_slice(&(held.len() as u64).to_le_bytes());
    for (part, r) in held {
        out.push(*part);
        out.extend_from_slice(&(r.start as u64).to_le_bytes());
        out.extend_from_slice(&(r.len() as u64).to_le_bytes());
    }
    out
}

/// The holdings in `b`; `None` unless every run lies inside a buffer of
/// `numel` elements and the bytes end with the last one.
fn undescribe(b: &[u8], numel: usize) -> Option<(Option<Scalars>, Held)> {
    let holds = match *b.first()? {
        0 => false,
        1 => true,
        _ => return None,
    };
    let scalars = holds.then_some(Scalars::decode(b.get(1..1 + META_LEN)?)?);
    let mut at = 1 + META_LEN;
    let word = |at: &mut usize| -> Option<usize> {
        let w = u64::from_le_bytes(b.get(*at..at.checked_add(8)?)?.try_into().ok()?);
        *at += 8;
        usize::try_from(w).ok()
    };
    let n = word(&mut at)?;
    let mut held = Vec::new();
    for _ in 0..n {
        let part = *b.get(at)?;
        at += 1;
        let start = word(&mut at)?;
        let len = word(&mut at)?;
        if !(1..=3).contains(&part) || start.checked_add(len)? > numel {
            return None;
        }
        held.push((part, start..start + len));
    }
    (at == b.len()).then_some((scalars, held))
}

/// Whether the rank holds the state (u8) and then its scalars, the
/// number of pieces, then each piece: part (u8), start and length (u64),
/// values.
fn encode(scalars: Option<&Scalars>, pieces: &[Piece]) -> Vec<u8> {
    let mut out = vec![u8::from(scalars.is_some())];
    out.extend(scalars.map_or_else(|| vec![0; META_LEN], Scalars::encode));
    out.extend_from_slice(&(pieces.len() as u64).to_le_bytes());
    for p in pieces {
        out.push(p.part);
        out.extend_from_slice(&(p.start as u64).to_le_bytes());
        out.extend_from_slice(&(p.data.len() as u64).to_le_bytes());
        out.extend_from_slice(bytemuck::cast_slice(&p.data));
    }
    out
}

/// The contribution in `b`; `None` unless every piece lies inside a buffer
/// of `numel` elements and the bytes end with the last one.
fn decode(b: &[u8], numel: usize) -> Option<(Option<Scalars>, Vec<Piece>)> {
    let holds = match *b.first()? {
        0 => false,
        1 => true,
        _ => return None,
    };
    let scalars = Scalars::decode(b.get(1..1 + META_LEN)?)?;
    let scalars = holds.then_some(scalars);
    let mut at = 1 + META_LEN;
    let word = |at: &mut usize| -> Option<u64> {
        let w = u64::from_le_bytes(b.get(*at..*at + 8)?.try_into().ok()?);
        *at += 8;
        Some(w)
    };
    let n = word(&mut at)?;
    let mut pieces = Vec::new();
    for _ in 0..n {
        let part = *b.get(at)?;
        at += 1;
        let start = usize::try_from(word(&mut at)?).ok()?;
        let len = usize::try_from(word(&mut at)?).ok()?;
        if !(1..=3).contains(&part) || start.checked_add(len)? > numel {
            return None;
        }
        let bytes = b.get(at..at.checked_add(len.checked_mul(4)?)?)?;
        at += bytes.len();
        let data = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        pieces.push(Piece { part, start, data });
    }
    (at == b.len()).then_some((scalars, pieces))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn contributions_round_trip() {
        let s = Scalars {
            step: 7,
            rng: SplitMix64::new(9),
            data_position: 84,
        };
        let pieces = vec![
            Piece {
                part: 2,
                start: 3,
                data: vec![1.0, -0.0, f32::NAN],
            },
            Piece {
                part: 1,
                start: 0,
                data: vec![],
            },
        ];
        let bytes = encode(Some(&s), &pieces);
        let (back_s, back) = decode(&bytes, 10).unwrap();
        assert_eq!(back_s, Some(s));
        let (none, _) = decode(&encode(None, &[]), 10).unwrap();
        assert_eq!(none, None);
        assert_eq!(back.len(), 2);
        assert_eq!(back[0].data[1].to_bits(), (-0.0f32).to_bits());
        assert!(back[0].data[2].is_nan());
        assert!(decode(&bytes, 5).is_none(), "a piece past the buffer");
        assert!(decode(&bytes[..bytes.len() - 1], 10).is_none());
    }

    #[test]
    fn holdings_round_trip() {
        let s = Scalars {
            step: 7,
            rng: SplitMix64::new(9),
            data_position: 84,
        };
        let held = vec![(2u8, 3..9), (1, 0..10)];
        let b = describe(Some(&s), &held);
        assert_eq!(undescribe(&b, 10), Some((Some(s), held)));
        assert!(undescribe(&b, 9).is_none(), "a run past the buffer");
        assert!(undescribe(&b[..b.len() - 1], 10).is_none());
        assert_eq!(undescribe(&describe(None, &[]), 4), Some((None, vec![])));
    }

    proptest! {
        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256), numel in 0usize..64) {
            let _ = decode(&bytes, numel);
            let _ = undescribe(&bytes, numel);
        }
    }
}
