//! The agent's control socket: a Unix socket that workers register on and
//! `agentctl` queries. Each connection's requests are framed and parsed
//! here and handed to the job's event loop with the peer's uid (from
//! SO_PEERCRED); a request that changes anything is refused unless it comes
//! from the agent's own uid or root. Malformed input gets an error reply,
//! never a crash.

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
    tokio::spawn(async move {
        loop {
            let conn = tokio::select! {
                _ = shutdown.cancelled() => return,
                c = listener.accept() => c,
            };
            let Ok((stream, _)) = conn else { continue };
            let tx = tx.clone();
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = connection(stream, tx, me) => {}
                }
            });
        }
    });
    Ok(())
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
