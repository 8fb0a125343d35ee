use super::*;
use crate::auth::KEY_LEN;
use std::io::Write;

fn local() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn key() -> Secret {
    Secret::from_bytes([9; KEY_LEN])
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < end, "{what}");
        thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn set_get_add_and_wait() {
    for secret in [None, Some(key())] {
        let server = StoreServer::bind(local(), secret.clone()).unwrap();
        let addr = server.local_addr();
        let s2 = secret.clone();
        let waiter = thread::spawn(move || {
            let mut c = StoreClient::connect(addr, Duration::from_secs(5), s2).unwrap();
            c.get("k", Duration::from_secs(10)).unwrap()
        });
        let mut c = StoreClient::connect(addr, Duration::from_secs(5), secret).unwrap();
        assert_eq!(c.add("n", 2).unwrap(), 2);
        assert_eq!(c.add("n", 3).unwrap(), 5);
        thread::sleep(Duration::from_millis(20));
        c.set("k", "v").unwrap();
        assert_eq!(waiter.join().unwrap(), "v");
        let e = c.get("absent", Duration::from_millis(10)).unwrap_err();
        assert!(e.to_string().contains("absent"), "{e}");
        assert_eq!(server.stats().refused, 0);
    }
}

#[test]
fn without_the_secret_nothing_is_read_or_changed_and_it_is_counted() {
    let server = StoreServer::bind(local(), Some(key())).unwrap();
    let addr = server.local_addr();
    let mut owner = StoreClient::connect(addr, Duration::from_secs(5), Some(key())).unwrap();
    owner.set("epoch/1/ring/0", "127.0.0.1:4000").unwrap();
    // No secret: the client refuses to even try.
    let e = StoreClient::connect(addr, Duration::from_secs(5), None).unwrap_err();
    assert!(e.to_string().contains("authenticates"), "{e}");
    // The wrong secret: its first request is refused, and the
    // connection closed.
    let wrong = StoreClient::connect(
        addr,
        Duration::from_secs(5),
        Some(Secret::from_bytes([1; KEY_LEN])),
    );
    assert!(wrong.is_err());
    // A raw client that copies a real client's frame to another
    // connection (a replay under another nonce), and one that flips a bit.
    let hello = |s: &mut TcpStream| {
        let mut h = [0u8; HELLO_LEN];
        s.read_exact(&mut h).unwrap();
        Hello::decode(&h).unwrap()
    };
    let mut a = TcpStream::connect(addr).unwrap();
    let ha = hello(&mut a);
    let mut sa = Session::new(PROTOCOL, Role::Client, ha, Some(key()));
    let req = serde_json::to_vec(&Request::Set {
        key: "epoch/1/ring/0".into(),
        value: "127.0.0.1:2".into(),
    })
    .unwrap();
    let sealed = sa.seal(&req).unwrap();
    let mut b = TcpStream::connect(addr).unwrap();
    let _ = hello(&mut b);
    b.write_all(&sealed).unwrap();
    let mut flipped = sealed.clone();
    flipped[HEADER_LEN + 3] ^= 1;
    let mut c = TcpStream::connect(addr).unwrap();
    let _ = hello(&mut c);
    let _ = c.write_all(&flipped);
    wait_for("three refusals", || server.stats().refused >= 3);
    assert_eq!(
        owner.get("epoch/1/ring/0", Duration::ZERO).unwrap(),
        "127.0.0.1:4000"
    );
    // A server without the secret cannot pose as the job's store.
    let fake = StoreServer::bind(local(), None).unwrap();
    let e =
        StoreClient::connect(fake.local_addr(), Duration::from_secs(5), Some(key())).unwrap_err();
    assert!(
        e.to_string().contains("not this job's rendezvous store"),
        "{e}"
    );
}

#[test]
fn idle_strangers_are_bounded_and_closed_and_the_job_still_meets() {
    let server = StoreServer::bind(local(), Some(key())).unwrap();
    let addr = server.local_addr();
    let idle: Vec<TcpStream> = (0..MAX_UNAUTHENTICATED + 50)
        .filter_map(|_| TcpStream::connect(addr).ok())
        .collect();
    wait_for("the oldest idle connections closed", || {
        server.stats().over_limit >= 50
    });
    assert!(server.stats().open <= MAX_UNAUTHENTICATED as u64);
    // The job still meets at once, while the strangers wait.
    let t = Instant::now();
    let mut c = StoreClient::connect(addr, Duration::from_secs(10), Some(key())).unwrap();
    c.set("x", "y").unwrap();
    assert_eq!(c.get("x", Duration::ZERO).unwrap(), "y");
    assert!(t.elapsed() < AUTH_DEADLINE, "{:?}", t.elapsed());
    wait_for("the idle ones closed at the deadline", || {
        server.stats().timed_out >= MAX_UNAUTHENTICATED as u64 - 1
    });
    assert_eq!(server.stats().open, 1, "only the job's connection is left");
    drop(idle);
}

#[test]
fn a_connection_closed_after_its_hello_is_tried_again() {
    // What a flood of strangers does to a rank that connects in the
    // middle of it: the store sends its hello, then closes the
    // connection as the oldest unauthenticated one before the rank's
    // first request is read. A stand-in does exactly that to the first
    // connection, then passes the next ones through to the real store.
    let server = StoreServer::bind(local(), Some(key())).unwrap();
    let real = server.local_addr();
    let front = std::net::TcpListener::bind(local()).unwrap();
    let addr = front.local_addr().unwrap();
    let proxy = thread::spawn(move || {
        let (mut first, _) = front.accept().unwrap();
        let mut upstream = TcpStream::connect(real).unwrap();
        let mut hello = [0u8; HELLO_LEN];
        upstream.read_exact(&mut hello).unwrap();
        first.write_all(&hello).unwrap();
        drop(first);
        drop(upstream);
        let (down, _) = front.accept().unwrap();
        let up = TcpStream::connect(real).unwrap();
        let pipe = |mut from: TcpStream, mut to: TcpStream| {
            thread::spawn(move || {
                let _ = io::copy(&mut from, &mut to);
                let _ = to.shutdown(std::net::Shutdown::Both);
            })
        };
        let a = pipe(down.try_clone().unwrap(), up.try_clone().unwrap());
        let b = pipe(up, down);
        let _ = (a.join(), b.join());
    });
    let mut c = StoreClient::connect(addr, Duration::from_secs(10), Some(key())).unwrap();
    c.set("x", "y").unwrap();
    assert_eq!(c.get("x", Duration::ZERO).unwrap(), "y");
    drop(c);
    proxy.join().unwrap();
    // A wrong secret is tried a few times, not until the timeout, and
    // the error says what is likely.
    let e = StoreClient::connect(
        real,
        Duration::from_secs(600),
        Some(Secret::from_bytes([1; KEY_LEN])),
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            RendezvousError::Unanswered {
                times: MAX_UNANSWERED,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("secret is not the job's"), "{e}");
}
