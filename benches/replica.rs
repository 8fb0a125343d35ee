//! The replica stream against raw TCP, for the same bytes, on loopback, in
//! the same run:
//! - `raw TCP`: one thread writes a snapshot's bytes from memory into a
//!   socket, another reads them into touched memory;
//! - `replica`: a snapshot sealed in a real store is streamed by one agent's
//!   replicator (127.0.0.1) to another's (127.0.0.2) over ZeroMQ, framed,
//!   tagged (keyed BLAKE3) and checked on arrival, written into the
//!   holder's replica store and sealed there after its checksum verified;
//!   timed from the seal at the owner to the receipt at the owner.
//!
//! The two are interleaved, `ROUNDS` times each; the table gives each
//! median, its throughput, and the ratio of replica to raw-TCP throughput.
//! `HATRAIN_BENCH_MIB` sets the snapshot size (default 256).

mod common;
use common::{bench_mib, median};
use hatrain_agent::replicator::{self, Replicator, ReplicatorConfig};
use hatrain_shared::auth::Secret;
use hatrain_shared::shm::{Geometry, Store};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

const ROUNDS: usize = 7;

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
        sender.add_rank(0, Arc::clone(&store));
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
            if r.streams[0].ranks.first().and_then(|k| k.replica_step) == Some(self.step) {
                return t.elapsed().as_secs_f64();
            }
            assert!(Instant::now() < deadline, "not replicated: {r:?}");
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

fn main() {
    let mib = bench_mib(256);
    let len = mib << 20;
    let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    let mut pair = Pair::new(len);
    // The first transfer makes the holder's store (first touch of its
    // memory): not timed.
    pair.replicate(&data);
    let mut buf = vec![1u8; len];
    let (mut tcp, mut rep) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let (secs, back) = raw_tcp(&data, buf);
        buf = back;
        tcp.push(secs);
        rep.push(pair.replicate(&data));
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
    let h = pair.holder.report();
    assert_eq!(
        h.rejected_forged + h.rejected_malformed + h.rejected_replayed,
        0
    );
}
