//! `hatrain-storeprobe`: what a process without the job's secret (run as
//! another user by the tests) tries against a job's rendezvous store.
//!
//! - `flood ADDR SECONDS`: reads and writes keys for SECONDS, on fresh
//!   connections, with frames that carry a made-up tag; prints
//!   `accepted=N refused=M` (accepted: answers that came back at all).
//! - `idle ADDR N SECONDS`: opens N connections and sends nothing; after
//!   SECONDS prints `opened=N closed=M` (closed by the server).

use hatrain_shared::auth::{HELLO_LEN, TAG_LEN};
use hatrain_shared::rendezvous::{PROTOCOL, Request};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

fn flood(addr: SocketAddr, secs: u64) -> (u64, u64) {
    let (mut accepted, mut refused) = (0, 0);
    let end = Instant::now() + Duration::from_secs(secs);
    let mut i = 0u64;
    while Instant::now() < end {
        i += 1;
        let Ok(mut s) = TcpStream::connect(addr) else {
            refused += 1;
            continue;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let mut hello = [0u8; HELLO_LEN];
        if s.read_exact(&mut hello).is_err() {
            refused += 1;
            continue;
        }
        let req = if i.is_multiple_of(2) {
            Request::Get {
                key: "epoch/1/ring/0".into(),
                wait_ms: 0,
            }
        } else {
            Request::Set {
                key: format!("epoch/{}/ring/0", i % 5),
                value: "127.0.0.1:1".into(),
            }
        };
        let body = serde_json::to_vec(&req).expect("json");
        let mut frame = PROTOCOL.encode(&body).expect("frame");
        frame.extend_from_slice(&[0x5A; TAG_LEN]);
        let _ = s.write_all(&frame);
        let mut reply = [0u8; 1];
        match s.read(&mut reply) {
            Ok(n) if n > 0 => accepted += 1,
            _ => refused += 1,
        }
    }
    (accepted, refused)
}

fn idle(addr: SocketAddr, n: usize, secs: u64) -> (usize, usize) {
    let mut conns: Vec<TcpStream> = (0..n)
        .filter_map(|_| TcpStream::connect(addr).ok())
        .collect();
    let opened = conns.len();
    std::thread::sleep(Duration::from_secs(secs));
    let mut closed = 0;
    for c in &mut conns {
        let _ = c.set_read_timeout(Some(Duration::from_millis(50)));
        let mut b = [0u8; 64];
        // The hello, then the close.
        let mut total = 0;
        loop {
            match c.read(&mut b) {
                Ok(0) => {
                    closed += 1;
                    break;
                }
                Ok(k) => total += k,
                Err(_) => break,
            }
            if total > HELLO_LEN {
                break;
            }
        }
    }
    (opened, closed)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let addr = |i: usize| -> Option<SocketAddr> { args.get(i)?.parse().ok() };
    let num = |i: usize| -> Option<u64> { args.get(i)?.parse().ok() };
    match (args.get(1).map(String::as_str), addr(2)) {
        (Some("flood"), Some(a)) => {
            let (acc, refd) = flood(a, num(3).unwrap_or(3));
            println!("accepted={acc} refused={refd}");
            ExitCode::SUCCESS
        }
        (Some("idle"), Some(a)) => {
            let (opened, closed) = idle(a, num(3).unwrap_or(1000) as usize, num(4).unwrap_or(7));
            println!("opened={opened} closed={closed}");
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("usage: hatrain-storeprobe flood ADDR SECONDS | idle ADDR N SECONDS");
            ExitCode::from(2)
        }
    }
}
