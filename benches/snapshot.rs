//! Snapshot commit throughput against a memcpy of the same bytes into
//! pre-faulted memory, measured in the same run.
//!
//! Cases, each on `HATRAIN_BENCH_MIB` MiB of state (default 256, like the
//! 252 MiB per rank of the targets), as 3 buffers like parameters and two
//! AdamW moments:
//! - `memcpy`: `copy_from_slice` of the buffers into one touched buffer;
//! - `commit`: `Store::write_slot` (copy and xxh3 in one pass, then seal)
//!   into a pre-faulted shared-memory slot under /dev/shm;
//! - `restore`: `Store::read_slot` back into the buffers (verify and copy).
//!
//! Each case runs `REPS` times; the table gives the median and its ratio to
//! memcpy.

mod common;
use common::median;
use hatrain_shared::shm::{Geometry, Store, store_path};
use std::time::Instant;

const REPS: usize = 9;

fn main() {
    let mib = common::bench_mib(256);
    let per = mib * (1 << 20) / 12;
    let bufs: Vec<Vec<f32>> = (0..3)
        .map(|b| (0..per).map(|i| (i * (b + 1)) as f32 * 1e-3).collect())
        .collect();
    let total = per * 12;
    let dir = tempfile::Builder::new()
        .prefix("hatrain-bench-")
        .tempdir_in("/dev/shm")
        .expect("a directory under /dev/shm");
    let store =
        Store::create(&store_path(dir.path(), 0), 0, Geometry::new(2, total), 1, 1).expect("store");
    let mut dst = vec![0u8; total];
    dst.iter_mut().for_each(|b| *b = 1); // touched, like a pre-faulted slot
    let parts: Vec<&[u8]> = bufs
        .iter()
        .map(|b| bytemuck::cast_slice::<f32, u8>(b))
        .collect();

    let (mut memcpy, mut commit, mut restore) = (Vec::new(), Vec::new(), Vec::new());
    let mut back: Vec<Vec<f32>> = bufs.iter().map(|b| vec![0f32; b.len()]).collect();
    for step in 0..REPS as u64 {
        let t = Instant::now();
        let mut at = 0;
        for p in &parts {
            dst[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        memcpy.push(t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);

        let slot = store.writable_slot().expect("nothing is held");
        let t = Instant::now();
        store
            .write_slot(slot, 0, step, 0, &parts, &mut |_, _| true)
            .expect("commit");
        commit.push(t.elapsed().as_secs_f64());

        let t = Instant::now();
        let mut outs: Vec<&mut [u8]> = back
            .iter_mut()
            .map(|b| bytemuck::cast_slice_mut::<f32, u8>(b))
            .collect();
        store.read_slot(slot, &mut outs).expect("restore");
        restore.push(t.elapsed().as_secs_f64());
    }
    assert_eq!(back, bufs, "restored state differs");
    let base = median(memcpy.clone());
    println!("snapshot benchmark: {mib} MiB of state in 3 buffers, median of {REPS}");
    println!(
        "{:<10} {:>10} {:>10} {:>12}",
        "case", "median ms", "GB/s", "÷ memcpy"
    );
    for (name, v) in [("memcpy", memcpy), ("commit", commit), ("restore", restore)] {
        let m = median(v);
        println!(
            "{name:<10} {:>10.2} {:>10.2} {:>12.2}",
            m * 1e3,
            total as f64 / m / 1e9,
            base / m
        );
    }
}
