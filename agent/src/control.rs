//! The agent's control socket: a Unix socket that workers register on and
//! `agentctl` queries. Each connection's requests are framed and parsed
//! here and handed to the job's event loop with the peer's uid (from
//! SO_PEERCRED); a request that changes anything is refused unless it comes
//! from the agent's own uid or root. Malformed input gets an error reply,
//! never a crash.
//!
//! Connections are bounded, per client process (SO_PEERCRED's pid) and in
//! all, below the agent's descriptor limit: a client that holds more gets
//! an error frame and a closed connection, so that the descriptors the
//! persister and the workers need are never taken by idle clients. A
//! quarter of the places is kept for the agent's own children (its
//! workers), which other clients cannot fill. An accept that fails (out of
//! descriptors) waits a moment before the next, instead of spinning.

use hatrain_shared::control::{PROTOCOL, Request, Response};
use hatrain_shared::frame::{FrameError, HEADER_LEN};
use std::path::{Path, PathBuf};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

/// A request for the job's event loop, with the channel for its reply.
#[derive(Debug)]
pub struct ControlMsg {
    pub request: Request,
    pub reply: oneshot::Sender<Response>,
}

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("cannot listen on the control socket {path}")]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Connections one client process may hold at once: a worker holds one or
/// two, `agentctl` one.
pub const MAX_PER_CLIENT: usize = 16;

/// How long the accept loop waits after a failed accept (EMFILE, ENFILE,
/// ENOMEM): the pending connection stays queued meanwhile.
const ACCEPT_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// Connections held at once in all, for a process whose soft descriptor
/// limit is `nofile`: a quarter of it (the rest is the persister's, the
/// workers' pipes, the stores' and the replicas'), between 16 and 1024.
pub fn max_connections(nofile: u64) -> usize {
    usize::try_from(nofile / 4)
        .unwrap_or(usize::MAX)
        .clamp(16, 1024)
}

/// The connections held now, per client process and in all.
#[derive(Debug, Default)]
struct Held {
    per_client: std::collections::HashMap<i32, usize>,
    total: usize,
}

/// Why a connection is turned away.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum Refusal {
    #[error(
        "too many connections to the agent from process {pid}: it holds {MAX_PER_CLIENT}, the most one client may; close some"
    )]
    Client { pid: i32 },
    #[error("the agent holds {max} control connections, the most it takes; try again later")]
    Full { max: usize },
}

impl Held {
    /// Takes a place for a connection of process `pid` (0: unknown), a
    /// child of the agent or not, or says why there is none.
    fn admit(&mut self, pid: i32, child: bool, max: usize) -> Result<(), Refusal> {
        let n = self.per_client.get(&pid).copied().unwrap_or(0);
        if n >= MAX_PER_CLIENT {
            return Err(Refusal::Client { pid });
        }
        let bound = if child { max } else { max - max / 4 };
        if self.total >= bound {
            return Err(Refusal::Full { max: bound });
        }
        self.per_client.insert(pid, n + 1);
        self.total += 1;
        Ok(())
    }

    fn release(&mut self, pid: i32) {
        if let Some(n) = self.per_client.get_mut(&pid) {
            *n -= 1;
            if *n == 0 {
                self.per_client.remove(&pid);
            }
            self.total -= 1;
        }
    }
}

/// A place taken by [`Held::admit`], given back when the connection ends.
struct Place {
    held: std::sync::Arc<std::sync::Mutex<Held>>,
    pid: i32,
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Ok(mut h) = self.held.lock() {
            h.release(self.pid);
        }
    }
}

/// Whether process `pid` is a child of this one (`/proc/PID/stat`'s ppid).
fn is_child(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The command name, in parentheses, may hold spaces: the fields after
    // its closing one are state, then ppid.
    let ppid = stat
        .rfind(')')
        .and_then(|at| stat[at + 1..].split_whitespace().nth(1))
        .and_then(|p| p.parse::<u32>().ok());
    ppid == Some(std::process::id())
}

/// The soft limit on this process's open descriptors.
fn nofile() -> u64 {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_or(1024, |(soft, _)| soft)
}

/// Binds the socket (mode 0600: only its owner can connect) and serves it
/// until `shutdown`.
pub fn serve(
    path: &Path,
    tx: mpsc::Sender<ControlMsg>,
    shutdown: CancellationToken,
) -> Result<(), ControlError> {
    use std::os::unix::fs::PermissionsExt;
    let bind_err = |source| ControlError::Bind {
        path: path.to_path_buf(),
        source,
    };
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path).map_err(bind_err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(bind_err)?;
    let me = nix::unistd::geteuid().as_raw();
    let max = max_connections(nofile());
    let held = std::sync::Arc::new(std::sync::Mutex::new(Held::default()));
    tokio::spawn(async move {
        let mut said_full = false;
        loop {
            let conn = tokio::select! {
                _ = shutdown.cancelled() => return,
                c = listener.accept() => c,
            };
            let stream = match conn {
                Ok((stream, _)) => stream,
                Err(e) => {
                    if !said_full {
                        tracing::warn!(error = %e, "cannot accept a control connection: waiting a moment before the next");
                        said_full = true;
                    }
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        () = tokio::time::sleep(ACCEPT_PAUSE) => continue,
                    }
                }
            };
            said_full = false;
            let pid = stream.peer_cred().ok().and_then(|c| c.pid()).unwrap_or(0);
            let child = pid != 0 && is_child(pid);
            let admitted = held.lock().expect("not poisoned").admit(pid, child, max);
            if let Err(why) = admitted {
                tracing::debug!(pid, reason = %why, "control connection turned away");
                turn_away(&stream, &why);
                continue;
            }
            let place = Place {
                held: std::sync::Arc::clone(&held),
                pid,
            };
            let tx = tx.clone();
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                let _place = place;
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = connection(stream, tx, me) => {}
                }
            });
        }
    });
    Ok(())
}

/// Tells a client why its connection closes, if its socket takes the
/// frame at once (it never waits), and closes it.
fn turn_away(stream: &UnixStream, why: &Refusal) {
    let reply = Response::Error {
        message: why.to_string(),
    };
    if let Ok(bytes) = serde_json::to_vec(&reply)
        && let Ok(frame) = PROTOCOL.encode(&bytes)
    {
        let _ = stream.try_write(&frame);
    }
}

async fn read_request(
    stream: &mut UnixStream,
) -> Result<Option<Result<Request, FrameError>>, std::io::Error> {
    let mut header = [0u8; HEADER_LEN];
    match stream.read_exact(&mut header).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = match PROTOCOL.parse_header(&header) {
        Ok(len) => len,
        Err(e) => return Ok(Some(Err(e))),
    };
    let mut payload = vec![0u8; len];
    stream.read_exact(&mut payload).await?;
    Ok(Some(PROTOCOL.parse_json(&payload)))
}

/// Returns when the client closes its end, or sends while a request of its
/// waits for the reply (which this protocol does not allow): either way the
/// connection is over.
async fn hung_up(stream: &UnixStream) {
    let mut byte = [0u8; 1];
    loop {
        if stream.readable().await.is_err() {
            return;
        }
        match stream.try_read(&mut byte) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            _ => return,
        }
    }
}

async fn connection(mut stream: UnixStream, tx: mpsc::Sender<ControlMsg>, me: u32) {
    let uid = stream.peer_cred().map(|c| c.uid()).ok();
    loop {
        let (response, fatal) = match read_request(&mut stream).await {
            Ok(None) | Err(_) => return,
            Ok(Some(Err(e))) => {
                // A bad header leaves the stream out of sync: answer, hang up.
                let fatal = !matches!(e, FrameError::Decode { .. });
                (
                    Response::Error {
                        message: e.to_string(),
                    },
                    fatal,
                )
            }
            Ok(Some(Ok(request))) => {
                if request.mutates() && uid != Some(me) && uid != Some(0) {
                    (
                        Response::Error {
                            message: format!(
                                "permission denied: only uid {me} (the agent's) or root may send {request:?}; you are {uid:?}"
                            ),
                        },
                        false,
                    )
                } else {
                    let (reply, rx) = oneshot::channel();
                    if tx.send(ControlMsg { request, reply }).await.is_err() {
                        return;
                    }
                    // A client that hangs up while its request waits (a
                    // parked standby that died) ends the connection now,
                    // not when the reply comes.
                    tokio::select! {
                        r = rx => match r {
                            Ok(r) => (r, false),
                            Err(_) => return,
                        },
                        () = hung_up(&stream) => return,
                    }
                }
            }
        };
        let Ok(bytes) = serde_json::to_vec(&response) else {
            return;
        };
        let Ok(frame) = PROTOCOL.encode(&bytes) else {
            return;
        };
        if stream.write_all(&frame).await.is_err() || fatal {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn connections_are_bounded_per_client_and_in_all_and_places_come_back() {
        let mut h = Held::default();
        for _ in 0..MAX_PER_CLIENT {
            h.admit(7, false, 24).unwrap();
        }
        assert_eq!(h.admit(7, false, 24), Err(Refusal::Client { pid: 7 }));
        for _ in 0..2 {
            h.admit(8, false, 24).unwrap();
        }
        // Strangers fill three quarters; the rest is the children's.
        assert_eq!(h.admit(9, false, 24), Err(Refusal::Full { max: 18 }));
        for _ in 0..6 {
            h.admit(10, true, 24).unwrap();
        }
        assert_eq!(h.admit(11, true, 24), Err(Refusal::Full { max: 24 }));
        // A place freed goes to a child while the strangers hold theirs...
        h.release(8);
        assert_eq!(h.admit(9, false, 24), Err(Refusal::Full { max: 18 }));
        h.admit(11, true, 24).unwrap();
        // ...and to a stranger once the strangers hold fewer.
        for _ in 0..MAX_PER_CLIENT {
            h.release(7);
        }
        h.admit(9, false, 24).unwrap();
        h.release(7);
        assert_eq!(h.total, 9, "a release of nothing held changes nothing");
        assert!(!is_child(std::process::id() as i32));
        assert_eq!(max_connections(1024), 256);
        assert_eq!(max_connections(20), 16);
        assert_eq!(max_connections(1 << 20), 1024);
    }

    /// One client that opens more connections than it may: the extra ones
    /// are answered with an error and closed at once, and the ones it
    /// holds still serve it.
    #[tokio::test]
    async fn a_client_over_its_bound_is_answered_and_closed_and_its_held_ones_still_serve() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let (tx, mut rx) = mpsc::channel(4);
        let shutdown = CancellationToken::new();
        serve(&path, tx, shutdown.clone()).unwrap();
        let mut held = Vec::new();
        for _ in 0..MAX_PER_CLIENT {
            held.push(UnixStream::connect(&path).await.unwrap());
        }
        let mut extra = UnixStream::connect(&path).await.unwrap();
        let mut said = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), extra.read_to_end(&mut said))
            .await
            .expect("the extra connection is closed")
            .unwrap();
        let reply: Response = serde_json::from_slice(&said[HEADER_LEN..]).unwrap();
        assert!(
            matches!(&reply, Response::Error { message } if message.contains("too many connections")),
            "{reply:?}"
        );
        let frame = PROTOCOL
            .encode(&serde_json::to_vec(&Request::Status).unwrap())
            .unwrap();
        held[0].write_all(&frame).await.unwrap();
        let msg = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(msg.request, Request::Status);
        // Once some close, a new one is taken.
        drop(held.pop());
        let mut again = None;
        for _ in 0..100 {
            let mut c = UnixStream::connect(&path).await.unwrap();
            c.write_all(&frame).await.unwrap();
            if let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(200), rx.recv()).await {
                again = Some((c, m));
                break;
            }
        }
        assert!(again.is_some(), "a place freed is taken again");
        shutdown.cancel();
    }

    #[tokio::test]
    async fn a_client_that_hangs_up_while_its_request_waits_ends_its_connection() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let (tx, mut rx) = mpsc::channel(4);
        let shutdown = CancellationToken::new();
        serve(&path, tx, shutdown.clone()).unwrap();
        // A standby parks: its request waits for a reply that may never come.
        let mut client = UnixStream::connect(&path).await.unwrap();
        let frame = PROTOCOL
            .encode(&serde_json::to_vec(&Request::Standby { pid: 1 }).unwrap())
            .unwrap();
        client.write_all(&frame).await.unwrap();
        let msg = rx.recv().await.unwrap();
        assert_eq!(msg.request, Request::Standby { pid: 1 });
        let mut reply = msg.reply;
        // Still waiting while the client is there.
        assert!(
            tokio::time::timeout(Duration::from_millis(100), reply.closed())
                .await
                .is_err()
        );
        // It dies: the connection (and its wait for the reply) ends.
        drop(client);
        tokio::time::timeout(Duration::from_secs(10), reply.closed())
            .await
            .expect("the connection outlived its client");
        shutdown.cancel();
    }
}
