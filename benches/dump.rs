//! Last-words dump write throughput against a plain sequential write of the
//! same bytes to the same disk, measured in the same run.
//!
//! One rank's snapshot of about `HATRAIN_BENCH_MIB` MiB (default 256) sits
//! sealed in a shared-memory store, laid out as the trainer's (metadata,
//! parameters, two AdamW moments, world size 1). Cases, `REPS` times each:
//! - `plain write+fsync`: the same number of bytes written to one file and
//!   fsynced, in the same directory;
//! - `dump`: `persister::write_checkpoint`, which verifies the slot, writes
//!   the checkpoint shard (safetensors and meta.json, fsynced), verifies the
//!   slot again and publishes the tracker.
//!
//! The directory is `HATRAIN_BENCH_DIR` (default `target/bench-dump`).

mod common;
use common::median;
use hatrain_agent::persister::{RankSource, write_checkpoint};
use hatrain_shared::shm::{Geometry, Store, store_path};
use hatrain_trainer::checkpoint::{SaveTo, state_map};
use std::io::Write;
use std::time::Instant;

const REPS: usize = 9;

fn main() {
    let mib = common::bench_mib(256);
    let model = common::model_of_mib(mib);
    let n = model.numel();
    let dir = std::env::var_os("HATRAIN_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("target/bench-dump"));
    let save_to = SaveTo {
        dir: dir.join("ckpt"),
        interval: 0,
    };
    // One rank of a world of one: its moments are the whole buffer.
    let map = state_map(&model, 1, 0, Some(&save_to), serde_json::Value::Null);
    let total = 24 + 12 * n;
    let shm = tempfile::Builder::new()
        .prefix("hatrain-bench-")
        .tempdir_in("/dev/shm")
        .expect("shm dir");
    let store = Store::create(
        &store_path(shm.path(), 0),
        0,
        Geometry::new(2, total),
        map.layout_hash(),
        1,
    )
    .expect("store");
    let floats: Vec<f32> = (0..3 * n).map(|i| i as f32 * 1e-3).collect();
    let mut meta = Vec::new();
    for w in [7u64, 11, 13] {
        meta.extend_from_slice(&w.to_le_bytes());
    }
    store
        .write_slot(
            0,
            0,
            7,
            0,
            &[&meta, bytemuck::cast_slice(&floats)],
            &mut |_, _| true,
        )
        .expect("seal the snapshot");
    let src = [RankSource {
        rank: 0,
        store: &store,
        map: &map,
        sliced: false,
    }];

    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("bench directory");
    let bytes: &[u8] = bytemuck::cast_slice(&floats);
    let (mut plain, mut dump) = (Vec::new(), Vec::new());
    for _ in 0..REPS {
        let path = dir.join("plain.bin");
        let t = Instant::now();
        let mut f = std::fs::File::create(&path).expect("create");
        f.write_all(&meta)
            .and_then(|()| f.write_all(bytes))
            .expect("write");
        f.sync_all().expect("fsync");
        plain.push(t.elapsed().as_secs_f64());
        std::fs::remove_file(&path).expect("remove");

        let out = dir.join("ckpt");
        let t = Instant::now();
        write_checkpoint(&src, 7, &out).expect("dump");
        dump.push(t.elapsed().as_secs_f64());
        std::fs::remove_dir_all(&out).expect("remove");
    }
    let base = median(plain.clone());
    println!(
        "last-words dump: {:.0} MiB snapshot of one rank, median of {REPS}",
        total as f64 / (1 << 20) as f64
    );
    println!(
        "{:<20} {:>10} {:>10} {:>14}",
        "case", "median s", "GB/s", "÷ plain write"
    );
    let dumped = median(dump.clone());
    for (name, v) in [("plain write+fsync", plain), ("dump", dump)] {
        let m = median(v);
        println!(
            "{name:<20} {m:>10.4} {:>10.2} {:>14.2}",
            total as f64 / m / 1e9,
            base / m
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    // The table's last column is plain ÷ m; the simulator takes the dump's
    // time over the plain write's (above 1: the dump is slower).
    common::costs::record(
        "dump_time_ratio",
        dumped / base,
        "cargo bench -p hatrain-scenarios --bench dump: last-words dump ÷ plain write+fsync",
    );
}
