//! The periodic saves, the skipping on a slow disk, and the final save.
use super::*;
use hatrain_shared::shm::{Geometry, HoldRefused, Store, store_path};
use hatrain_shared::statemap::{
    CheckpointMap, Dtype, FieldValue, FileMap, MetaField, Part, Sharing, StateMap, TensorMap,
};
use std::sync::mpsc;

/// Two ranks with a real store of `slots` slots each, of a workload the
/// persister knows only by its map: an 8-byte block and 1000 floats.
struct Ranks {
    _dir: tempfile::TempDir,
    sources: Vec<OwnedSource>,
}

const N: u64 = 1000;

/// A workload the persister knows only by its map (the write module's
/// tests use it too).
pub(super) fn map() -> StateMap {
    StateMap {
        parts: vec![
            Part {
                name: "meta".into(),
                dtype: Dtype::U8,
                len: 8,
                sharing: Sharing::Unique,
            },
            Part {
                name: "w".into(),
                dtype: Dtype::F32,
                len: N,
                sharing: Sharing::Unique,
            },
        ],
        checkpoint: Some(CheckpointMap {
            dir: "/unused".into(),
            interval: 10,
            world_size: 2,
            files: vec![FileMap {
                name: "w.safetensors".into(),
                tensors: vec![TensorMap {
                    name: "w".into(),
                    part: 1,
                    range: 0..N,
                    shape: None,
                    offsets: None,
                }],
            }],
            fields: vec![MetaField {
                name: "stamp".into(),
                value: FieldValue::U64 { part: 0, offset: 0 },
            }],
            linked: None,
        }),
        global_batch: None,
    }
}

fn ranks(slots: usize) -> Ranks {
    let dir = tempfile::tempdir().unwrap();
    let map = Arc::new(map());
    let total = map.total_bytes().unwrap() as usize;
    let sources = (0..2)
        .map(|rank| {
            let store = Store::create(
                &store_path(dir.path(), rank),
                rank,
                Geometry::new(slots, total),
                map.layout_hash(),
                2,
            )
            .unwrap();
            OwnedSource {
                rank,
                store: Arc::new(store),
                map: Arc::clone(&map),
                sliced: false,
            }
        })
        .collect();
    Ranks { _dir: dir, sources }
}

/// Seals `step` on every rank (the floats all `step`) and holds it;
/// returns each rank's hold outcome.
fn seal(r: &Ranks, step: u64) -> Vec<Result<(), HoldRefused>> {
    r.sources
        .iter()
        .map(|s| {
            let meta = (step * 10 + s.rank as u64).to_le_bytes();
            let w = vec![step as f32; N as usize];
            let parts: [&[u8]; 2] = [&meta, bytemuck::cast_slice(&w)];
            let slot = s.store.writable_slot().expect("a free slot");
            s.store
                .write_slot(slot, s.rank as u64, step, 0, &parts, &mut |_, _| true)
                .unwrap();
            s.store.page().hold(step, slot)
        })
        .collect()
}

/// Reads rank `rank`'s floats and stamp back from iteration `it`.
fn read_back(dir: &Path, it: u64, rank: usize) -> (Vec<f32>, u64) {
    let it_dir = checkpoint::iter_dir(dir, it);
    let meta = checkpoint::read_rank_meta(&it_dir, rank, 2).unwrap();
    let rdir = checkpoint::rank_dir(&it_dir, rank);
    let bytes = checkpoint::read_verified(&rdir, &meta, "w.safetensors").unwrap();
    let w = checkpoint::tensor_bytes(
        &rdir.join("w.safetensors"),
        &bytes,
        "w",
        Dtype::F32,
        N as usize,
    )
    .unwrap();
    let floats = w
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(meta.iteration, it);
    (floats, meta.fields["stamp"].as_u64().unwrap())
}

/// A writer that waits for the test's go-ahead before each checkpoint.
fn gated(p: &mut Persister) -> (mpsc::Sender<()>, mpsc::Receiver<u64>) {
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (started_tx, started_rx) = mpsc::channel::<u64>();
    let go = std::sync::Mutex::new(go_rx);
    p.write = Arc::new(move |src, step, dir| {
        started_tx.send(step).unwrap();
        go.lock().unwrap().recv().unwrap();
        write_checkpoint(src, step, dir)
    });
    (go_tx, started_rx)
}

fn settle(p: &mut Persister, r: &Ranks) {
    // Bounded only so that a broken writer fails the test instead of
    // hanging it: a loaded machine may take seconds to write.
    for _ in 0..30_000 {
        p.poll(&[0, 1], |i| Some(r.sources[i].clone()));
        if p.writing.is_none() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    panic!("the write did not finish");
}

#[test]
fn a_slow_disk_skips_to_the_newest_held_step_and_never_queues() {
    let r = ranks(3);
    let out = tempfile::tempdir().unwrap();
    let mut p = Persister::new(out.path().to_path_buf(), 10, 2, true);
    let (go, started) = gated(&mut p);
    let poll = |p: &mut Persister| p.poll(&[0, 1], |i| Some(r.sources[i].clone()));

    // Only rank 0 holds step 10: nothing starts, nothing is claimed.
    seal(&r, 5);
    let s = &r.sources;
    s[1].store
        .page()
        .release_hold(s[1].store.page().held().unwrap());
    s[0].store
        .page()
        .release_hold(s[0].store.page().held().unwrap());
    assert!(seal(&r, 10).iter().all(Result::is_ok));
    let h1 = s[1].store.page().held().unwrap();
    s[1].store.page().release_hold(h1);
    poll(&mut p);
    assert!(p.writing.is_none() && !s[0].store.page().held().unwrap().claimed);
    s[1].store.page().hold(10, h1.slot).unwrap();
    poll(&mut p);
    assert_eq!(started.recv().unwrap(), 10);
    assert!(s.iter().all(|x| x.store.page().held().unwrap().claimed));

    // The disk is slow: step 20 is sealed meanwhile but cannot be held,
    // and the held slot is never the one rewritten.
    let refused = seal(&r, 20);
    assert!(
        refused
            .iter()
            .all(|h| matches!(h, Err(HoldRefused::Busy(b)) if b.step == 10))
    );
    assert!(seal(&r, 21).iter().all(Result::is_err));
    for x in s {
        let h = x.store.page().held().unwrap();
        assert_eq!((h.step, x.store.verify(h.slot).unwrap().step), (10, 10));
    }
    poll(&mut p);
    assert_eq!(p.report().writing, Some(10));
    go.send(()).unwrap();
    settle(&mut p, &r);
    let rep = p.report();
    assert_eq!(
        (rep.last_saved, rep.saves, rep.writing),
        (Some(10), 1, None)
    );
    assert!(
        s.iter().all(|x| x.store.page().held().is_none()),
        "released"
    );

    // The next held step is 40: 20 and 30 were passed over and said so.
    assert!(seal(&r, 40).iter().all(Result::is_ok));
    poll(&mut p);
    assert_eq!(started.recv().unwrap(), 40);
    go.send(()).unwrap();
    settle(&mut p, &r);
    let rep = p.report();
    assert_eq!(rep.skipped, vec![20, 30]);
    assert_eq!((rep.last_saved, rep.saves), (Some(40), 2));

    // What was written is a checkpoint of exactly the held steps'
    // contents, laid out as the map says.
    assert_eq!(checkpoint::read_tracker(out.path()).unwrap(), 40);
    for it in [10u64, 40] {
        for rank in 0..2 {
            let (w, stamp) = read_back(out.path(), it, rank);
            assert!(w.iter().all(|v| *v == it as f32));
            assert_eq!(stamp, it * 10 + rank as u64);
        }
    }

    // A step already on disk (held again after a rollback) is released,
    // not written twice.
    assert!(seal(&r, 40).iter().all(Result::is_ok));
    poll(&mut p);
    assert!(p.writing.is_none());
    assert!(s.iter().all(|x| x.store.page().held().is_none()));
    drop(go);
}

/// Two ranks that sealed steps 7 and 8 and finished at 8, and a
/// final-only persister into a fresh directory.
fn finished() -> (Ranks, tempfile::TempDir, Persister) {
    let r = ranks(2);
    let out = tempfile::tempdir().unwrap();
    let p = Persister::new(out.path().to_path_buf(), 0, 2, true);
    seal(&r, 7);
    seal(&r, 8);
    for x in &r.sources {
        x.store.page().set_step(8);
    }
    (r, out, p)
}

#[test]
fn save_steps_never_written_before_the_final_one_are_said_skipped() {
    // Step 2's write was the last one started; the holds of 4 and 6
    // were refused while it ran; the job ends at 8.
    let r = ranks(2);
    let out = tempfile::tempdir().unwrap();
    let mut p = Persister::new(out.path().to_path_buf(), 2, 2, true);
    p.last_started = Some(2);
    seal(&r, 7);
    seal(&r, 8);
    for x in &r.sources {
        x.store.page().set_step(8);
    }
    assert_eq!(
        p.finish(&r.sources).unwrap(),
        Some((8, out.path().to_path_buf()))
    );
    assert_eq!(p.report().skipped, vec![4, 6]);
}

#[test]
fn finish_writes_the_final_step_once_and_says_when_it_cannot() {
    let (r, out, mut p) = finished();
    let done = Some((8, out.path().to_path_buf()));
    assert_eq!(p.finish(&r.sources).unwrap(), done);
    assert_eq!(checkpoint::read_tracker(out.path()).unwrap(), 8);
    assert_eq!(p.finish(&r.sources).unwrap(), done);
    assert_eq!(p.report().saves, 1, "not written twice");
    let e = p.finish(&r.sources[..1]).unwrap_err().to_string();
    assert!(e.contains("all 2 ranks"), "{e}");

    // Rank 1's final snapshot is corrupt: step 7 is the newest every
    // rank has; it is written, and the missing final step is an error.
    let (r, out, mut p) = finished();
    let slot8 = r.sources[1].store.find_step(8).unwrap().slot;
    r.sources[1].store.corrupt_slot_byte(slot8, 100);
    let e = p.finish(&r.sources).unwrap_err().to_string();
    assert!(
        e.contains("final step 8") && e.contains("iteration 7"),
        "{e}"
    );
    assert_eq!(checkpoint::read_tracker(out.path()).unwrap(), 7);
    assert_eq!(p.report().last_error.as_deref(), Some(e.as_str()));
}

fn io_failure(errno: i32) -> PersistError {
    PersistError::Checkpoint(hatrain_shared::checkpoint::CheckpointError::Io {
        path: "iter_0000010_tmp/model.safetensors".into(),
        source: std::io::Error::from_raw_os_error(errno),
    })
}

#[test]
fn a_write_out_of_descriptors_is_tried_again_and_a_full_disk_is_not() {
    assert!(io_failure(libc::EMFILE).is_transient());
    assert!(io_failure(libc::EINTR).is_transient());
    assert!(!io_failure(libc::ENOSPC).is_transient());
    assert!(!PersistError::NoSnapshot { rank: 0, step: 3 }.is_transient());
    let mut tries = 0;
    let r = with_retries(10, || {
        tries += 1;
        if tries < 3 {
            Err(io_failure(libc::EMFILE))
        } else {
            Ok(tries)
        }
    });
    assert_eq!(r.unwrap(), 3);
    let mut tries = 0;
    let r: Result<(), _> = with_retries(10, || {
        tries += 1;
        Err(io_failure(libc::ENOSPC))
    });
    assert!(r.is_err());
    assert_eq!(tries, 1, "a full disk is reported at once");
}
