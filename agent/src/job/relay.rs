//! The workers' way to the job's rendezvous store when the job spans
//! several hosts: a TCP relay in their own agent.
//!
//! Every agent of such a job hosts a store; the one in use is the
//! controller's. A worker's `HATRAIN_AGENT_STORE` names its own agent's
//! relay, which passes each connection through, byte for byte (the store's
//! own authentication included), to the store of the node this agent
//! follows now. So when the controller's host is lost and another takes
//! over, the workers' next connection (each epoch's rendezvous opens one)
//! reaches the successor's store; the workers never learn where it moved.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// How long a connection waits for a store to pass it to (while the
/// agents choose a controller).
const UPSTREAM_WAIT: Duration = Duration::from_secs(60);

/// Listens on `ip` (a free port) until `stop`; each connection goes to
/// `upstream()` as it is when the connection comes. Returns the address.
pub(super) async fn start(
    ip: IpAddr,
    upstream: impl Fn() -> Option<SocketAddr> + Send + Sync + 'static,
    stop: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
    let addr = listener.local_addr()?;
    let upstream = std::sync::Arc::new(upstream);
    tokio::spawn(async move {
        loop {
            let (conn, from) = tokio::select! {
                _ = stop.cancelled() => return,
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, "the store relay cannot accept");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let (upstream, stop) = (std::sync::Arc::clone(&upstream), stop.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = stop.cancelled() => {}
                    r = pass(conn, &*upstream) => if let Err(e) = r {
                        tracing::debug!(%from, error = %e, "store relay connection ended");
                    }
                }
            });
        }
    });
    Ok(addr)
}

/// Passes `conn` through to the store `upstream()` names, once it names
/// one.
async fn pass(
    mut conn: TcpStream,
    upstream: &(dyn Fn() -> Option<SocketAddr> + Send + Sync),
) -> std::io::Result<()> {
    let deadline = Instant::now() + UPSTREAM_WAIT;
    let to = loop {
        if let Some(a) = upstream() {
            break a;
        }
        if Instant::now() >= deadline {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no controller's store to pass the connection to",
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut up = TcpStream::connect(to).await?;
    let _ = conn.set_nodelay(true);
    let _ = up.set_nodelay(true);
    tokio::io::copy_bidirectional(&mut conn, &mut up).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// An echo server that prefixes what it sends back with `tag`.
    async fn echo(tag: u8) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut b = [0u8; 64];
                    while let Ok(n) = c.read(&mut b).await {
                        if n == 0 || c.write_all(&[&[tag], &b[..n]].concat()).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn ask(relay: SocketAddr, what: &[u8]) -> Vec<u8> {
        let mut c = TcpStream::connect(relay).await.unwrap();
        c.write_all(what).await.unwrap();
        let mut b = vec![0u8; what.len() + 1];
        c.read_exact(&mut b).await.unwrap();
        b
    }

    #[tokio::test]
    async fn each_connection_goes_to_the_store_followed_when_it_comes() {
        let (a, b) = (echo(b'a').await, echo(b'b').await);
        let to = Arc::new(Mutex::new(None));
        let stop = CancellationToken::new();
        let t = Arc::clone(&to);
        let relay = start(
            "127.0.0.1".parse().unwrap(),
            move || *t.lock().unwrap(),
            stop.clone(),
        )
        .await
        .unwrap();
        // A connection that comes before any store is known waits for one.
        let early = tokio::spawn(ask(relay, b"x"));
        tokio::time::sleep(Duration::from_millis(200)).await;
        *to.lock().unwrap() = Some(a);
        assert_eq!(early.await.unwrap(), b"ax");
        assert_eq!(ask(relay, b"hello").await, b"ahello");
        // The controller moved: the next connection reaches the new store.
        *to.lock().unwrap() = Some(b);
        assert_eq!(ask(relay, b"hi").await, b"bhi");
        stop.cancel();
    }
}
