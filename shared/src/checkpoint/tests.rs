//! Tests of the checkpoint format: round trips, every named error, atomic
//! saves and the readers on arbitrary bytes.

use super::*;
use crate::statemap::{
    CheckpointMap, Dtype, FieldValue, FileMap, MetaField, Part, Sharing, TensorMap,
};
use proptest::prelude::*;

/// A map of a meta block and one f32 part of `n` elements, half of which
/// go to `a.safetensors` and all of it to `b.safetensors`.
fn map(world: usize, n: u64) -> StateMap {
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
                len: n,
                sharing: Sharing::Unique,
            },
        ],
        checkpoint: Some(CheckpointMap {
            dir: "/unused".into(),
            interval: 0,
            world_size: world,
            files: vec![
                FileMap {
                    name: "a.safetensors".into(),
                    tensors: vec![TensorMap {
                        name: "half".into(),
                        part: 1,
                        range: 0..n / 2,
                        shape: None,
                        offsets: None,
                    }],
                },
                FileMap {
                    name: "b.safetensors".into(),
                    tensors: vec![TensorMap {
                        name: "all".into(),
                        part: 1,
                        range: 0..n,
                        shape: None,
                        offsets: None,
                    }],
                },
            ],
            fields: vec![
                MetaField {
                    name: "note".into(),
                    value: FieldValue::Const(serde_json::json!({"z": 1, "a": [2]})),
                },
                MetaField {
                    name: "counter".into(),
                    value: FieldValue::U64 { part: 0, offset: 0 },
                },
            ],
            linked: None,
        }),
        global_batch: None,
    }
}

fn save(dir: &Path, iteration: u64, world: usize) {
    let m = map(world, 10);
    let tmp = begin_save(dir, iteration).unwrap();
    for rank in 0..world {
        let meta = (iteration * 100 + rank as u64).to_le_bytes();
        let w: Vec<f32> = (0..10).map(|i| i as f32 + rank as f32).collect();
        write_rank(
            &tmp,
            &m,
            rank,
            iteration,
            &[
                PartView::whole(&meta),
                PartView::whole(bytemuck::cast_slice(&w)),
            ],
        )
        .unwrap();
    }
    commit_save(dir, iteration, world).unwrap();
}

#[test]
fn written_ranks_read_back_with_their_fields_in_order() {
    let d = tempfile::tempdir().unwrap();
    save(d.path(), 20, 2);
    assert_eq!(read_tracker(d.path()).unwrap(), 20);
    let it = iter_dir(d.path(), 20);
    let meta = read_rank_meta(&it, 1, 2).unwrap();
    assert_eq!((meta.iteration, meta.world_size, meta.rank), (20, 2, 1));
    assert_eq!(meta.fields["counter"], serde_json::json!(2001));
    assert_eq!(meta.fields["note"], serde_json::json!({"a": [2], "z": 1}));
    let text = fs::read_to_string(rank_dir(&it, 1).join(META_FILE)).unwrap();
    let order: Vec<usize> = [
        "\"format\"",
        "\"rank\"",
        "\"note\"",
        "\"counter\"",
        "\"files\"",
    ]
    .iter()
    .map(|k| text.find(k).unwrap())
    .collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{text}");
    let dir = rank_dir(&it, 1);
    let b = read_verified(&dir, &meta, "b.safetensors").unwrap();
    let all = tensor_bytes(&dir.join("b.safetensors"), &b, "all", Dtype::F32, 10).unwrap();
    let want: Vec<f32> = (1..11).map(|i| i as f32).collect();
    assert_eq!(all, bytemuck::cast_slice::<f32, u8>(&want));
    let a = read_verified(&dir, &meta, "a.safetensors").unwrap();
    let e = tensor_bytes(&dir.join("a.safetensors"), &a, "half", Dtype::F32, 10).unwrap_err();
    assert!(e.to_string().contains("expected F32 of 10 elements"), "{e}");
}

/// Rank `rank` of 2 holding rows `2 * rank..2 * rank + 2` of a 4 × 3
/// tensor, a whole 0-dimensional one, and a JSON metadata block.
fn sharded_map() -> StateMap {
    let mut m = map(2, 7);
    let ck = m.checkpoint.as_mut().unwrap();
    ck.files = vec![FileMap {
        name: "model.safetensors".into(),
        tensors: vec![
            TensorMap {
                name: "model.w".into(),
                part: 1,
                range: 0..6,
                shape: Some(vec![2, 3]),
                offsets: Some(vec![0, 0]),
            },
            TensorMap {
                name: "optim.step".into(),
                part: 1,
                range: 6..7,
                shape: Some(vec![]),
                offsets: None,
            },
        ],
    }];
    ck.fields = vec![MetaField {
        name: "torch".into(),
        value: FieldValue::Json { part: 0 },
    }];
    ck.linked = Some("dcp".into());
    m.parts[0].len = 32;
    m
}

#[test]
fn shards_keep_their_shape_and_offsets_and_every_rank_is_linked_into_one_folder() {
    let d = tempfile::tempdir().unwrap();
    let tmp = begin_save(d.path(), 5).unwrap();
    for rank in 0..2usize {
        let mut m = sharded_map();
        let t = &mut m.checkpoint.as_mut().unwrap().files[0].tensors[0];
        t.offsets = Some(vec![2 * rank as u64, 0]);
        let doc = format!("{{\"rank\":{rank}}}");
        let mut meta = (doc.len() as u32).to_le_bytes().to_vec();
        meta.extend(doc.as_bytes());
        meta.resize(32, 0);
        let w: Vec<f32> = (0..7).map(|i| (10 * rank + i) as f32).collect();
        let parts = [
            PartView::whole(&meta),
            PartView::whole(bytemuck::cast_slice(&w)),
        ];
        write_rank(&tmp, &m, rank, 5, &parts).unwrap();
    }
    commit_save(d.path(), 5, 2).unwrap();
    let it = iter_dir(d.path(), 5);
    let meta = read_rank_meta(&it, 1, 2).unwrap();
    assert_eq!(meta.fields["torch"], serde_json::json!({"rank": 1}));
    for rank in 0..2usize {
        let linked = it
            .join("dcp")
            .join(format!("rank_{rank:05}-model.safetensors"));
        let bytes = fs::read(&linked).unwrap();
        assert_eq!(
            bytes,
            fs::read(rank_dir(&it, rank).join("model.safetensors")).unwrap()
        );
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("model.w").unwrap().shape(), [2, 3]);
        assert_eq!(st.tensor("optim.step").unwrap().shape(), [0usize; 0]);
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let info: serde_json::Value =
            serde_json::from_str(&header.metadata().as_ref().unwrap()[DCP_SHARDING_INFO]).unwrap();
        assert_eq!(
            info["model.w"]["saved_offsets"],
            serde_json::json!([2 * rank, 0])
        );
        assert_eq!(info["optim.step"]["saved_offsets"], serde_json::json!([]));
        assert!(
            it.join("dcp")
                .join(format!("rank_{rank:05}-meta.json"))
                .is_file()
        );
    }
}

#[test]
fn shapes_offsets_json_fields_and_linked_folders_are_checked() {
    let refused = |f: &dyn Fn(&mut CheckpointMap), needle: &str| {
        let mut m = sharded_map();
        f(m.checkpoint.as_mut().unwrap());
        let e = m.validate().unwrap_err().to_string();
        assert!(e.contains(needle), "{needle:?} not in {e}");
    };
    refused(
        &|c| c.files[0].tensors[0].shape = Some(vec![4, 3]),
        "does not hold its 6 elements",
    );
    refused(
        &|c| c.files[0].tensors[0].shape = Some(vec![1; 9]),
        "does not hold",
    );
    refused(
        &|c| c.files[0].tensors[0].offsets = Some(vec![0]),
        "1 offsets for 2 dimensions",
    );
    refused(
        &|c| c.fields[0].value = FieldValue::Json { part: 1 },
        "not a U8 part",
    );
    refused(&|c| c.linked = Some("../up".into()), "must be a plain name");
    refused(
        &|c| c.linked = Some("rank_00001".into()),
        "must be a plain name",
    );
    sharded_map().validate().unwrap();
}

proptest! {
    /// A JSON field read from arbitrary bytes is a value or nothing.
    #[test]
    fn a_json_field_of_any_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let m = sharded_map();
        let w = [0u8; 28];
        let _ = m.field(&FieldValue::Json { part: 0 }, &[PartView::whole(&bytes), PartView::whole(&w)]);
    }
}

#[test]
fn resave_of_same_iteration_replaces_it() {
    let d = tempfile::tempdir().unwrap();
    save(d.path(), 10, 2);
    save(d.path(), 10, 3);
    assert_eq!(
        read_rank_meta(&iter_dir(d.path(), 10), 2, 3)
            .unwrap()
            .world_size,
        3
    );
    assert!(!d.path().join("iter_0000010_old").exists());
}

#[test]
fn tracker_errors_name_the_file() {
    let d = tempfile::tempdir().unwrap();
    let e = read_tracker(d.path()).unwrap_err().to_string();
    assert!(
        e.contains(TRACKER_FILE) && e.contains("no checkpoint tracker"),
        "{e}"
    );
    fs::write(d.path().join(TRACKER_FILE), "fifty\n").unwrap();
    let e = read_tracker(d.path()).unwrap_err().to_string();
    assert!(
        e.contains(TRACKER_FILE) && e.contains("garbled") && e.contains("fifty"),
        "{e}"
    );
}

#[test]
fn special_files_are_named_and_never_block() {
    let d = tempfile::tempdir().unwrap();
    save(d.path(), 5, 1);
    let dir = rank_dir(&iter_dir(d.path(), 5), 0);
    let meta = dir.join(META_FILE);
    fs::remove_file(&meta).unwrap();
    nix::unistd::mkfifo(
        &meta,
        nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
    )
    .unwrap();
    let e = read_rank_meta(&iter_dir(d.path(), 5), 0, 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank_00000/meta.json") && e.contains("is a FIFO"),
        "{e}"
    );
    fs::remove_file(&meta).unwrap();
    // A symlink loop: named as the file it is, not as a missing rank.
    std::os::unix::fs::symlink(&meta, &meta).unwrap();
    let e = read_rank_meta(&iter_dir(d.path(), 5), 0, 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank_00000/meta.json") && e.contains("symbolic links"),
        "{e}"
    );
    fs::remove_file(&meta).unwrap();
    fs::create_dir(&meta).unwrap();
    let e = read_rank_meta(&iter_dir(d.path(), 5), 0, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("is a directory"), "{e}");
    fs::remove_dir(&meta).unwrap();
    let e = read_rank_meta(&iter_dir(d.path(), 5), 0, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("meta.json: file missing"), "{e}");
    let e = read_rank_meta(&iter_dir(d.path(), 5), 3, 4)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank_00003") && e.contains("rank directory missing"),
        "{e}"
    );
}

#[test]
fn digests_are_xxh3_64() {
    // The reference vectors of XXH3-64 (seed 0): files written before
    // the hash crate changed verify as before.
    assert_eq!(digest_hex(b""), "2d06800538d394c2");
    assert_eq!(digest_hex(b"a"), "e6c632b61e964e1f");
}

#[test]
fn a_failed_save_leaves_the_previous_checkpoint() {
    let d = tempfile::tempdir().unwrap();
    save(d.path(), 10, 2);
    // The save of iteration 20 dies after rank 0 wrote its directory.
    let tmp = begin_save(d.path(), 20).unwrap();
    let w = [0f32; 10];
    write_rank(
        &tmp,
        &map(2, 10),
        0,
        20,
        &[
            PartView::whole(&[0u8; 8]),
            PartView::whole(bytemuck::cast_slice(&w)),
        ],
    )
    .unwrap();
    let e = commit_save(d.path(), 20, 2).unwrap_err().to_string();
    assert!(e.contains("incomplete") && e.contains("rank 1"), "{e}");
    assert_eq!(read_tracker(d.path()).unwrap(), 10);
    // A part of the wrong size is refused before anything is written.
    let short = [PartView::whole(&[0u8; 8]), PartView::whole(&[0u8; 4])];
    let e = write_rank(&tmp, &map(2, 10), 1, 20, &short)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("needs elements") && e.contains("only 0..1 were given"),
        "{e}"
    );
    let beyond = [
        PartView::whole(&[0u8; 8]),
        PartView {
            first: 9,
            bytes: &[0u8; 8],
        },
    ];
    let e = write_rank(&tmp, &map(2, 10), 1, 20, &beyond)
        .unwrap_err()
        .to_string();
    assert!(e.contains("beyond its 10 elements"), "{e}");
    save(d.path(), 20, 2);
    assert_eq!(read_tracker(d.path()).unwrap(), 20);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn meta_parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(META_FILE);
        fs::write(&p, &bytes).unwrap();
        prop_assert!(read_meta(&p).is_err());
    }

    #[test]
    fn corrupt_tensor_files_never_panic(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4)) {
        let d = tempfile::tempdir().unwrap();
        save(d.path(), 1, 1);
        let dir = rank_dir(&iter_dir(d.path(), 1), 0);
        let path = dir.join("b.safetensors");
        let mut bytes = fs::read(&path).unwrap();
        for (at, x) in flips {
            let i = at % bytes.len();
            bytes[i] ^= x | 1;
        }
        // Whatever the damage, the parser answers and does not panic.
        let _ = tensor_bytes(&path, &bytes, "all", Dtype::F32, 10);
        fs::write(&path, &bytes).unwrap();
        let meta = read_rank_meta(&iter_dir(d.path(), 1), 0, 1).unwrap();
        prop_assert!(read_verified(&dir, &meta, "b.safetensors").is_err());
    }
}
