//! The replica stream against raw TCP, for the same bytes, on loopback, in
//! the same run:
//! - `raw TCP`: one thread writes a snapshot's bytes from memory into a
//!   socket, another reads them into touched memory;
//! - `replica`: a snapshot sealed in a real store is streamed by one agent's
//!   replicator (127.0.0.1) to another's (127.0.0.2) over ZeroMQ, framed,
//!   tagged (GMAC) and checked on arrival, written into the
//!   holder's replica store and sealed there after its checksum verified;
//!   timed from the seal at the owner to the receipt at the owner.
//!
//! The two are interleaved, `ROUNDS` times each; the table gives each
//! median, its throughput, and the ratio of replica to raw-TCP throughput.
//! `HATRAIN_BENCH_MIB` sets the snapshot size (default 256).
//!
//! Then what replication costs training: two hosts (agents on 127.0.0.1
//! and 127.0.0.2) of one rank each, the reference trainer with a snapshot
//! every step, `--replicas 1` against `--replicas 0`, for the `10m` and
//! `100m` models (`HATRAIN_BENCH_SIZES` narrows it; empty: the stream
//! alone). The two run
//! interleaved `HATRAIN_BENCH_REPS` times (default 3); each run's figure is
//! its median step time over steps 3-9, and the table gives the median
//! over runs and the ratio on ÷ off.
//!
//! With `HATRAIN_BENCH_EMULATE_MS=MS`, the same two hosts with the trainer's
//! `--emulate-device MS` (each step's forward and backward a wait of MS ms
//! holding no host core, as on an accelerator host; the state and the
//! update the model's): a snapshot every step and one peer replica against
//! neither (no replica, no snapshot after the start), for the models of
//! `HATRAIN_BENCH_SIZES`, interleaved `HATRAIN_BENCH_REPS` times.

// The agent's allocator, so that the replicator in this process allocates
// its frames as it does in `hatrain-agent`.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod common;
use common::launch::Launch;
use common::{bench_mib, median, train_args};
use hatrain_agent::replicator::{self, Replicator, ReplicatorConfig};
use hatrain_shared::auth::Secret;
use hatrain_shared::shm::{Geometry, Store};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

const ROUNDS: usize = 7;

/// The CPU time of this process so far (every thread), seconds.
fn process_cpu_s() -> f64 {
    use nix::sys::resource::{UsageWho, getrusage};
    let u = getrusage(UsageWho::RUSAGE_SELF).expect("getrusage");
    let s = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
    s(u.user_time()) + s(u.system_time())
}

/// Sends `data` over a fresh loopback connection into `buf` (touched
/// memory, as the holder's pre-faulted store is); returns the seconds and
/// the buffer.
fn raw_tcp(data: &[u8], mut buf: Vec<u8>) -> (f64, Vec<u8>) {
    let listener = TcpListener::bind("127.0.0.2:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let reader = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.read_exact(&mut buf).unwrap();
        s.write_all(&[1]).unwrap();
        buf
    });
    let t = Instant::now();
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(data).unwrap();
    let mut ack = [0u8];
    s.read_exact(&mut ack).unwrap();
    let secs = t.elapsed().as_secs_f64();
    (secs, reader.join().unwrap())
}

fn cfg(node: u64, bind: &str, dir: &std::path::Path) -> ReplicatorConfig {
    ReplicatorConfig {
        secret: Secret::from_bytes([7; 32]),
        node,
        bind: bind.parse().unwrap(),
        dir: dir.to_path_buf(),
        slots: 2,
        ranks_per_node: 1,
        chunk: replicator::CHUNK,
        window: replicator::WINDOW,
    }
}

struct Pair {
    _dirs: (tempfile::TempDir, tempfile::TempDir),
    sender: Arc<Replicator>,
    holder: Arc<Replicator>,
    store: Arc<Store>,
    step: u64,
}

impl Pair {
    fn new(len: usize) -> Self {
        let dirs = (
            tempfile::tempdir_in("/dev/shm").unwrap(),
            tempfile::tempdir_in("/dev/shm").unwrap(),
        );
        let holder = Replicator::listen(cfg(1, "127.0.0.2", dirs.1.path())).unwrap();
        holder.hold_for(0);
        let sender = Replicator::listen(cfg(0, "127.0.0.1", dirs.0.path())).unwrap();
        let store = Arc::new(
            Store::create(
                &hatrain_shared::shm::store_path(dirs.0.path(), 0),
                0,
                Geometry::new(2, len),
                1,
                2,
            )
            .unwrap(),
        );
        sender.add_rank(0, Arc::clone(&store), None);
        sender.stream_to(1, holder.endpoint().to_string());
        Self {
            _dirs: dirs,
            sender,
            holder,
            store,
            step: 0,
        }
    }

    /// Seals the next step and times it until the holder's receipt.
    fn replicate(&mut self, data: &[u8]) -> f64 {
        self.step += 1;
        let slot = self.store.writable_slot().unwrap();
        self.store
            .write_slot(slot, 0, self.step, 0, &[data], &mut |_, _| true)
            .unwrap();
        let t = Instant::now();
        let deadline = t + Duration::from_secs(120);
        loop {
            let r = self.sender.report();
            if r.streams
                .first()
                .and_then(|s| s.ranks.first())
                .and_then(|k| k.replica_step)
                == Some(self.step)
            {
                return t.elapsed().as_secs_f64();
            }
            assert!(Instant::now() < deadline, "not replicated: {r:?}");
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// What one run of [`step_time`] measured.
struct StepTimes {
    /// Median step time of steps 3-9, seconds.
    median: f64,
    /// The time rank 0's training thread was held by hatrain in each of
    /// those steps, ms.
    held_ms: Vec<f64>,
    /// Rank 0's snapshot copies over the run: the commit thread's CPU
    /// seconds, the bytes sealed and the snapshots.
    copies: Option<(f64, u64, u64)>,
}

/// One run of `size` on two hosts of one rank each, with `replicas` peer
/// replicas and the trainer's `extra` flags (see [`StepTimes`]).
fn step_time(dir: &Path, size: &str, replicas: usize, extra: &[&str]) -> StepTimes {
    let secret = common::hosts::secret_file(dir, "3c");
    let log = dir.join(format!("steps-{size}-{replicas}.jsonl"));
    let _ = std::fs::remove_file(&log);
    let [master, rdzv] = common::ports::free_ports::<2>();
    let job = format!("bench-replica-{}", std::process::id());
    let mut hosts: Vec<_> = ["127.0.0.1", "127.0.0.2"]
        .iter()
        .enumerate()
        .map(|(k, addr)| {
            Launch::bare(1)
                .job(&job)
                .stop_grace_secs(2)
                .high_availability()
                .shm_root(dir.join(format!("host{k}")))
                .option("--nnodes", "2")
                .option("--node-rank", k.to_string())
                .option("--master-addr", "127.0.0.1")
                .option("--master-port", master.to_string())
                .option("--rdzv-port", rdzv.to_string())
                .option("--local-addr", addr)
                .option("--replicas", replicas.to_string())
                .option("--secret-file", &secret)
                .args(train_args(size, 9, &log, extra))
                .env("RUST_LOG", "warn")
                .command()
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start hatrain-agent")
        })
        .collect();
    for h in &mut hosts {
        assert!(h.wait().unwrap().success(), "a host failed");
    }
    let steps: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .collect();
    let copies = steps
        .iter()
        .rev()
        .find(|e| e["event"] == "final")
        .and_then(|e| {
            let c = &e["snapshot_copies"];
            Some((
                c["cpu_s"].as_f64()?,
                c["bytes"].as_u64()?,
                c["sealed"].as_u64()?,
            ))
        });
    let steps: Vec<&serde_json::Value> = steps
        .iter()
        .filter(|e| e["event"] == "step" && e["step"].as_u64() > Some(2))
        .collect();
    let field = |k: &str| -> Vec<f64> { steps.iter().map(|e| e[k].as_f64().unwrap()).collect() };
    StepTimes {
        median: median(field("step_time_s")),
        held_ms: field("held_ms"),
        copies,
    }
}

/// `HATRAIN_BENCH_SIZES` (else `default`) and `HATRAIN_BENCH_REPS` (else 3).
fn sizes_and_reps(default: &str) -> (String, usize) {
    let sizes = std::env::var("HATRAIN_BENCH_SIZES").unwrap_or_else(|_| default.into());
    let reps = std::env::var("HATRAIN_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    (sizes, reps)
}

fn training_overhead() {
    let (sizes, reps) = sizes_and_reps("10m,100m");
    let dir = tempfile::tempdir().unwrap();
    println!();
    println!("step time, 2 hosts x 1 rank, median over {reps} interleaved runs of steps 3-9");
    println!(
        "{:<8} {:>14} {:>14} {:>10}",
        "model", "replicas 1 s", "replicas 0 s", "on / off"
    );
    for size in sizes.split(',').filter(|s| !s.is_empty()) {
        let (mut on, mut off) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            on.push(step_time(dir.path(), size, 1, &[]).median);
            off.push(step_time(dir.path(), size, 0, &[]).median);
        }
        eprintln!("{size}: runs on {on:?} off {off:?}");
        let (a, b) = (median(on), median(off));
        println!("{size:<8} {a:>14.4} {b:>14.4} {:>10.3}", a / b);
        // The simulator's figure is the 10m model's, as for the snapshot.
        if size == "10m" {
            common::costs::record(
                "replica_step_ratio",
                a / b,
                "cargo bench -p hatrain-scenarios --bench replica: step time with one peer replica ÷ none (2 hosts x 1 rank on one machine, 10m model)",
            );
        }
    }
}

/// `HATRAIN_BENCH_EMULATE_MS`: the step ratio on an emulated accelerator
/// host (see the module's doc).
fn emulated_overhead(ms: &str) {
    let (sizes, reps) = sizes_and_reps("100m");
    let dir = tempfile::tempdir().unwrap();
    println!();
    println!(
        "step time with --emulate-device {ms}, 2 hosts x 1 rank, median over {reps} interleaved runs of steps 3-9"
    );
    println!(
        "{:<8} {:>22} {:>14} {:>10} {:>8}",
        "model", "snapshot+replica s", "neither s", "ratio", "spread"
    );
    let mut held_rows = Vec::new();
    for size in sizes.split(',').filter(|s| !s.is_empty()) {
        let (mut on, mut off) = (Vec::new(), Vec::new());
        let (mut held_on, mut held_off, mut per_gb) = (Vec::new(), Vec::new(), Vec::new());
        let mut snapshot_gb = Vec::new();
        for _ in 0..reps {
            let r = step_time(dir.path(), size, 1, &["--emulate-device", ms]);
            on.push(r.median);
            held_on.extend(r.held_ms);
            if let Some((cpu, bytes, sealed)) = r.copies.filter(|c| c.1 > 0 && c.2 > 0) {
                per_gb.push(cpu / (bytes as f64 / 1e9));
                snapshot_gb.push(bytes as f64 / sealed as f64 / 1e9);
            }
            let flags = ["--emulate-device", ms, "--snapshot-interval", "1000000"];
            let r = step_time(dir.path(), size, 0, &flags);
            off.push(r.median);
            held_off.extend(r.held_ms);
        }
        held_rows.push((size.to_string(), held_on, held_off, per_gb, snapshot_gb));
        eprintln!("{size}: runs on {on:?} off {off:?}");
        // The spread: the largest and smallest per-run ratio, in order.
        let ratios: Vec<f64> = on.iter().zip(&off).map(|(a, b)| a / b).collect();
        let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = ratios.iter().copied().fold(0.0, f64::max);
        let (a, b) = (median(on), median(off));
        println!(
            "{size:<8} {a:>22.4} {b:>14.4} {:>10.4} {lo:.4}-{hi:.4}",
            a / b
        );
    }
    println!();
    println!(
        "time rank 0's training thread is held by hatrain per step (ms), every step 3-9 of every run"
    );
    println!(
        "{:<8} {:>24} {:>24}",
        "model", "snapshot+replica median/max", "neither median/max"
    );
    let mut cpu_rows = Vec::new();
    // (snapshot GB, median held ms) per model, for the simulator.
    let mut held_by_gb = Vec::new();
    for (size, on, off, per_gb, gb) in held_rows {
        if !gb.is_empty() {
            held_by_gb.push((median(gb), median(on.clone())));
        }
        let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        let (mon, moff) = (max(&on), max(&off));
        println!(
            "{size:<8} {:>24} {:>24}",
            format!("{:.3} / {mon:.3}", median(on)),
            format!("{:.3} / {moff:.3}", median(off))
        );
        cpu_rows.push((size, per_gb));
    }
    println!();
    println!(
        "rank 0's commit thread, CPU seconds per GB snapshotted (median and spread over runs)"
    );
    let mut last_per_gb = None;
    for (size, per_gb) in cpu_rows {
        if !per_gb.is_empty() {
            last_per_gb = Some(median(per_gb.clone()));
        }
        let lo = per_gb.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = per_gb.iter().copied().fold(0.0, f64::max);
        if per_gb.is_empty() {
            println!("{size:<8} -");
        } else {
            println!("{size:<8} {:.4} ({lo:.4}-{hi:.4})", median(per_gb));
        }
    }
    // The simulator's per-GB costs: the held time's fixed part and slope
    // between the smallest and the largest model, and the largest model's
    // CPU per GB snapshotted.
    let source =
        format!("HATRAIN_BENCH_EMULATE_MS={ms} cargo bench -p hatrain-scenarios --bench replica");
    if let (Some(&(g0, h0)), Some(&(g1, h1))) = (held_by_gb.first(), held_by_gb.last())
        && g1 > g0
    {
        let slope = ((h1 - h0) / (g1 - g0)).max(0.0);
        common::costs::record(
            "held_ms_per_gb",
            slope,
            &format!(
                "{source}: median held ms per step, (largest model − smallest) ÷ their snapshot GB per rank"
            ),
        );
        common::costs::record(
            "held_ms_fixed",
            (h0 - slope * g0).max(0.0),
            &format!(
                "{source}: median held ms per step of the smallest model less its per-GB part"
            ),
        );
    }
    if let Some(v) = last_per_gb {
        common::costs::record(
            "snapshot_cpu_s_per_gb",
            v,
            &format!("{source}: rank 0's commit-thread CPU seconds ÷ GB sealed, the largest model"),
        );
    }
}

fn main() {
    if let Ok(ms) = std::env::var("HATRAIN_BENCH_EMULATE_MS") {
        emulated_overhead(&ms);
        return;
    }
    let mib = bench_mib(256);
    let len = mib << 20;
    let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    let mut pair = Pair::new(len);
    // The first transfer makes the holder's store (first touch of its
    // memory): not timed.
    pair.replicate(&data);
    let mut buf = vec![1u8; len];
    let (mut tcp, mut rep) = (Vec::new(), Vec::new());
    // The CPU time of every thread but this one (which writes the owner's
    // snapshots) while the replicas go: both agents' replica threads and
    // ZeroMQ's I/O threads.
    let mut replica_cpu = 0.0;
    for _ in 0..ROUNDS {
        let (secs, back) = raw_tcp(&data, buf);
        buf = back;
        tcp.push(secs);
        let (process, main) = (process_cpu_s(), hatrain_shared::thread_cpu_ns());
        rep.push(pair.replicate(&data));
        let main_s = (hatrain_shared::thread_cpu_ns() - main) as f64 / 1e9;
        replica_cpu += process_cpu_s() - process - main_s;
    }
    assert_eq!(buf[..], data[..], "raw TCP delivered every byte");
    let (t, r) = (median(tcp), median(rep));
    let gbs = |s: f64| len as f64 / s / 1e9;
    println!("snapshot of {mib} MiB, median of {ROUNDS} interleaved rounds");
    println!("{:<28} {:>10} {:>10}", "", "seconds", "GB/s");
    println!("{:<28} {:>10.4} {:>10.2}", "raw TCP (loopback)", t, gbs(t));
    println!(
        "{:<28} {:>10.4} {:>10.2}",
        "replica (seal to receipt)",
        r,
        gbs(r)
    );
    println!("replica throughput / raw TCP: {:.3}", t / r);
    // The figures each side publishes now and then.
    std::thread::sleep(Duration::from_millis(300));
    let (s, h) = (pair.sender.report(), pair.holder.report());
    let sent = &s.streams[0];
    let per_gb = |cpu: f64, bytes: u64| cpu / (bytes as f64 / 1e9);
    let replica_per_gb = per_gb(replica_cpu, (len * ROUNDS) as u64);
    println!(
        "replica CPU seconds per GB, every thread of both agents (ZeroMQ's I/O threads included): {replica_per_gb:.3}"
    );
    common::costs::record(
        "replica_cpu_s_per_gb",
        replica_per_gb,
        "cargo bench -p hatrain-scenarios --bench replica: CPU seconds of both agents' threads (ZeroMQ's I/O threads included) while a snapshot is replicated, per GB",
    );
    println!(
        "replica CPU seconds per GB (every transfer): sender thread {:.3}, receiver thread {:.3}, both {:.3} (ZeroMQ's I/O threads not counted)",
        per_gb(sent.cpu_s, sent.bytes_sent),
        per_gb(h.receive_cpu_s, h.received_bytes),
        per_gb(sent.cpu_s, sent.bytes_sent) + per_gb(h.receive_cpu_s, h.received_bytes),
    );
    let h = pair.holder.report();
    assert_eq!(
        h.rejected_forged + h.rejected_malformed + h.rejected_replayed,
        0
    );
    drop(pair);
    training_overhead();
}
