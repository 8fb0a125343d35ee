//! Checkpoint save and load throughput against a plain sequential write of
//! the same bytes to the same disk, measured in the same run.
//!
//! Cases (state of one rank: parameters and two AdamW moments, f32):
//! - `plain write+fsync`: one file of the same size, written and fsynced;
//! - `save 1 rank`: `begin_save` + `write_rank` (the trainer's state map)
//!   + `commit_save`;
//! - `load 1 rank`: `read_tracker` + `load_shard` with moments (page cache
//!   warm, like a resume right after a save).
//!
//! Each case runs `REPS` times; the table gives the median and its ratio to
//! the plain write. Size: `HATRAIN_BENCH_MIB` (default 256 MiB of state).

mod common;
use common::median;
use hatrain_shared::checkpoint;
use hatrain_trainer::checkpoint::{SaveTo, load_shard, state_map};
use std::io::Write;
use std::time::Instant;

const REPS: usize = 7;

fn main() {
    let mib = common::bench_mib(256);
    let model = common::model_of_mib(mib);
    let n = model.numel();
    let bytes = (n * 12) as f64;
    let p: Vec<f32> = (0..n).map(|i| i as f32 * 1e-3).collect();
    let m: Vec<f32> = (0..n).map(|i| -(i as f32)).collect();
    let v: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let dir = std::env::var_os("HATRAIN_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("target/bench-checkpoint"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("bench directory");
    let save_to = SaveTo {
        dir: dir.clone(),
        interval: 0,
    };
    let map = state_map(&model, 1, 0, Some(&save_to), serde_json::Value::Null);
    let meta: Vec<u8> = [1u64, 1, 2].iter().flat_map(|w| w.to_le_bytes()).collect();
    let mut plain = Vec::new();
    let mut save = Vec::new();
    let mut load = Vec::new();
    let all: Vec<u8> = [&p, &m, &v]
        .iter()
        .flat_map(|b| bytemuck::cast_slice::<f32, u8>(b).iter().copied())
        .collect();
    for rep in 0..REPS {
        let path = dir.join("plain.bin");
        let t = Instant::now();
        let mut f = std::fs::File::create(&path).expect("create");
        f.write_all(&all).expect("write");
        f.sync_all().expect("fsync");
        plain.push(t.elapsed().as_secs_f64());
        std::fs::remove_file(&path).expect("remove");

        let it = rep as u64 + 1;
        let t = Instant::now();
        let tmp = checkpoint::begin_save(&dir, it).expect("begin");
        let parts: [&[u8]; 4] = [
            &meta,
            bytemuck::cast_slice(&p),
            bytemuck::cast_slice(&m),
            bytemuck::cast_slice(&v),
        ];
        let views = parts.map(hatrain_shared::statemap::PartView::whole);
        checkpoint::write_rank(&tmp, &map, 0, it, &views).expect("write");
        checkpoint::commit_save(&dir, it, 1).expect("commit");
        save.push(t.elapsed().as_secs_f64());

        let t = Instant::now();
        let it = checkpoint::read_tracker(&dir).expect("tracker");
        let l = load_shard(&dir, it, &model, 0..n, true).expect("load");
        load.push(t.elapsed().as_secs_f64());
        assert_eq!(l.params.len(), n);
        if rep > 0 {
            let _ = std::fs::remove_dir_all(checkpoint::iter_dir(&dir, it - 1));
        }
    }
    let base = median(plain.clone());
    println!(
        "checkpoint benchmark: {:.0} MiB of state ({n} parameters), median of {REPS}",
        bytes / (1 << 20) as f64
    );
    println!(
        "{:<22} {:>10} {:>10} {:>14}",
        "case", "median s", "GB/s", "÷ plain write"
    );
    for (name, v) in [
        ("plain write+fsync", plain),
        ("save 1 rank", save),
        ("load 1 rank", load),
    ] {
        let med = median(v);
        println!(
            "{name:<22} {med:>10.4} {:>10.2} {:>14.2}",
            bytes / med / 1e9,
            base / med
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
