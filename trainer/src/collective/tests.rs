use super::*;
use hatrain_shared::store::StoreServer;
use proptest::prelude::*;

/// A message's length is 64 bits: a resize's contribution may pass
/// 4 GiB (about a billion float32 elements).
#[test]
fn headers_carry_lengths_past_4_gib_and_refuse_what_is_not_a_message() {
    for len in [
        0,
        1,
        u64::from(u32::MAX),
        u64::from(u32::MAX) + 1,
        5 << 30,
        u64::MAX,
    ] {
        let h = header(7, 3, len);
        assert_eq!(parse_header(&h), Some((7, 3, len)));
    }
    let mut h = header(7, 3, 9);
    h[0] ^= 1;
    assert_eq!(parse_header(&h), None);
}

proptest! {
    #[test]
    fn parsing_any_header_never_panics(bytes in proptest::array::uniform24(any::<u8>())) {
        let _ = parse_header(&bytes);
    }
}

/// Runs the reduce-scatter schedule on in-memory ranks.
fn simulate_reduce_scatter(inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let w = inputs.len();
    let n = inputs[0].len();
    let mut bufs = inputs.to_vec();
    for step in 0..w.saturating_sub(1) {
        let sent: Vec<Vec<f32>> = (0..w)
            .map(|r| bufs[r][shard_range(n, w, reduce_scatter_send(r, step, w))].to_vec())
            .collect();
        for (r, buf) in bufs.iter_mut().enumerate() {
            let prev = (r + w - 1) % w;
            let chunk = reduce_scatter_recv(r, step, w);
            assert_eq!(
                chunk,
                reduce_scatter_send(prev, step, w),
                "schedule mismatch"
            );
            let range = shard_range(n, w, chunk);
            for (a, b) in buf[range].iter_mut().zip(&sent[prev]) {
                *a += b;
            }
        }
    }
    bufs
}

proptest! {
    #[test]
    fn ring_schedule_reduces_every_chunk_once(world in 1usize..9, n in 0usize..200) {
        // Integers in f32 add exactly, so the result must equal the sum.
        let inputs: Vec<Vec<f32>> = (0..world)
            .map(|r| (0..n).map(|i| ((r * 1000 + i) % 977) as f32).collect())
            .collect();
        let out = simulate_reduce_scatter(&inputs);
        for (r, out_r) in out.iter().enumerate() {
            for i in shard_range(n, world, r) {
                let want: f32 = inputs.iter().map(|b| b[i]).sum();
                prop_assert_eq!(out_r[i], want);
            }
        }
        for r in 0..world {
            for step in 0..world.saturating_sub(1) {
                let prev = (r + world - 1) % world;
                prop_assert_eq!(all_gather_recv(r, step, world), all_gather_send(prev, step, world));
            }
        }
    }
}

fn key() -> Secret {
    Secret::from_bytes([5; hatrain_shared::auth::KEY_LEN])
}

fn rank_thread<T: Send + 'static>(
    addr: SocketAddr,
    rank: usize,
    world: usize,
    f: impl Fn(Communicator) -> T + Send + 'static,
) -> thread::JoinHandle<T> {
    thread::spawn(move || {
        let mut store = StoreClient::connect(addr, Duration::from_secs(5), Some(key())).unwrap();
        let comm = Communicator::connect(
            &mut store,
            rank,
            world,
            7,
            Duration::from_secs(10),
            Some(&key()),
            &|| false,
        )
        .unwrap();
        f(comm)
    })
}

pub(super) fn run_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(Communicator) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), Some(key())).unwrap();
    let addr = server.local_addr();
    let handles: Vec<_> = (0..world)
        .map(|rank| rank_thread(addr, rank, world, f.clone()))
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn a_stranger_at_a_ring_listener_is_closed_before_any_tensor_byte() {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), Some(key())).unwrap();
    let addr = server.local_addr();
    let gather = |mut c: Communicator| c.all_gather_f64(c.rank() as f64 + 0.5).unwrap();
    let r0 = rank_thread(addr, 0, 2, gather);
    // The stranger reads rank 0's listener from the store (as if it had
    // seen it somehow) and claims to be rank 1 of epoch 7.
    let mut peek = StoreClient::connect(addr, Duration::from_secs(5), Some(key())).unwrap();
    let listener: SocketAddr = peek
        .get(&ring_key(7, 0), Duration::from_secs(10))
        .unwrap()
        .parse()
        .unwrap();
    let mut stranger = TcpStream::connect(listener).unwrap();
    let mut hello = [0u8; HELLO];
    hello[0..4].copy_from_slice(&MAGIC);
    hello[4..12].copy_from_slice(&7u64.to_le_bytes());
    hello[12..20].copy_from_slice(&1u64.to_le_bytes());
    stranger.write_all(&hello).unwrap();
    let r1 = rank_thread(addr, 1, 2, gather);
    // Its forged proof.
    let _ = stranger.write_all(&[0xAB; TAG_LEN]);
    assert_eq!(r0.join().unwrap(), vec![0.5, 1.5]);
    assert_eq!(r1.join().unwrap(), vec![0.5, 1.5]);
    // All it ever got was rank 0's nonce and proof; then the close.
    stranger
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut got = Vec::new();
    let _ = stranger.read_to_end(&mut got);
    assert!(got.len() <= NONCE_LEN + TAG_LEN, "{} bytes", got.len());
}

#[test]
fn tcp_ring_reduce_scatter_and_all_gather() {
    for world in [1, 2, 3, 4] {
        let n = 300_001; // large enough to fill the socket buffers
        let out = run_ranks(world, move |mut c| {
            let r = c.rank();
            let mut buf: Vec<f32> = (0..n).map(|i| ((i + r) % 5) as f32).collect();
            let mine = c.reduce_scatter_sum(&mut buf).unwrap();
            let mut full = vec![0f32; n];
            full[mine.clone()].copy_from_slice(&buf[mine]);
            c.all_gather(&mut full).unwrap();
            let losses = c.all_gather_f64(r as f64 * 1.5).unwrap();
            (full, losses)
        });
        let want: Vec<f32> = (0..n)
            .map(|i| (0..world).map(|r| ((i + r) % 5) as f32).sum())
            .collect();
        for (full, losses) in out {
            assert_eq!(full, want, "world {world}");
            assert_eq!(
                losses,
                (0..world).map(|r| r as f64 * 1.5).collect::<Vec<_>>()
            );
        }
    }
}

#[test]
fn abort_releases_a_blocked_collective() {
    let out = run_ranks(2, |mut c| {
        if c.rank() == 0 {
            // Rank 0 waits on a peer that never sends; an abort from
            // another thread must release it.
            let h = c.abort_handle();
            let t = thread::spawn(move || {
                thread::sleep(Duration::from_millis(100));
                h.abort();
            });
            let mut buf = vec![0f32; 10];
            let r = c.all_gather(&mut buf);
            t.join().unwrap();
            Some(r.unwrap_err().to_string())
        } else {
            thread::sleep(Duration::from_millis(500));
            None
        }
    });
    let e = out[0].as_ref().unwrap();
    assert!(e.contains("aborted"), "{e}");
}
