//! The lock that claims a job's folder: `<shm root>/<job>/agent.lock`.
//!
//! An agent holds an exclusive `flock(2)` on this file for as long as it
//! runs; the kernel drops the lock when the agent's last descriptor of the
//! file closes, which includes every way of dying. So:
//!
//! - a second agent of the same job finds the lock held and refuses to
//!   start, naming the holder;
//! - a folder whose lock is free belongs to an agent that is gone: it is
//!   stale, and the next agent cleans it;
//! - a worker or `agentctl` talks to the agent behind a control socket only
//!   when the process on the socket's other end (`SO_PEERCRED`) is the one
//!   that holds the lock of the socket's folder.
//!
//! The file holds one line of JSON naming the holder, written after the
//! lock is taken:
//!
//! ```text
//! {"pid":1234,"started_unix_s":1796212345,"job":"hatrain-1234-5f3a9c01"}
//! ```
//!
//! INVARIANT: the lock's descriptor is close-on-exec, so no worker inherits
//! it past `exec` and an agent's lock never outlives the agent. Probing a
//! lock takes a shared lock for an instant when it is free; an agent that
//! finds its exclusive lock refused while the named holder is gone
//! therefore tries again for a moment before it believes it.

use nix::fcntl::{Flock, FlockArg, OFlag, openat};
use nix::sys::stat::Mode;
use serde::{Deserialize, Serialize};
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::path::Path;

/// The lock file's name in a job folder.
pub const LOCK: &str = "agent.lock";
/// Most bytes of a lock file that are read.
const MAX_LEN: u64 = 4096;

/// Who holds a job's lock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    pub pid: i32,
    pub started_unix_s: u64,
    pub job: String,
}

impl Holder {
    /// This process, started now, for `job`.
    pub fn me(job: &str) -> Self {
        Self {
            pid: std::process::id() as i32,
            started_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            job: job.to_string(),
        }
    }

    /// The line written into the lock file.
    pub fn line(&self) -> String {
        let mut s = serde_json::to_string(self).expect("a holder serializes");
        s.push('\n');
        s
    }

    /// When the holder started, as an RFC 3339 UTC time.
    pub fn started(&self) -> String {
        // RFC 3339 stops at year 9999; a later time is a garbled file.
        const LAST: u64 = 253_402_300_799;
        if self.started_unix_s > LAST {
            return format!("unix time {}", self.started_unix_s);
        }
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(self.started_unix_s);
        humantime::format_rfc3339_seconds(t).to_string()
    }

    /// Whether a process with the holder's pid exists (it may belong to
    /// another user: `EPERM` still means it exists).
    pub fn alive(&self) -> bool {
        self.pid > 0
            && !matches!(
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid), None),
                Err(nix::errno::Errno::ESRCH)
            )
    }
}

/// Parses a lock file's contents; `None` when they name no holder (an
/// empty file: its agent died before writing it, or is writing it now).
pub fn parse(bytes: &[u8]) -> Option<Holder> {
    let line = bytes.split(|b| *b == b'\n').next()?;
    serde_json::from_slice(line).ok()
}

/// What a probe of a job folder's lock found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockState {
    /// No lock file: no agent claimed the folder.
    Missing,
    /// The lock is free: the agent that made it is gone.
    Free,
    /// An agent holds the lock; `None` when it has not said who it is yet.
    Held(Option<Holder>),
}

/// Reads the holder line of an open lock file (bounded).
pub fn read_holder(file: &std::fs::File) -> Option<Holder> {
    let mut buf = Vec::new();
    file.take(MAX_LEN).read_to_end(&mut buf).ok()?;
    parse(&buf)
}

/// Probes the lock of the job folder open as `dir`, without following a
/// symlink and without blocking.
pub fn probe_at<D: AsFd>(dir: D) -> io::Result<LockState> {
    let fd = match openat(
        dir.as_fd(),
        LOCK,
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(nix::errno::Errno::ENOENT) => return Ok(LockState::Missing),
        Err(e) => return Err(e.into()),
    };
    let file = std::fs::File::from(fd);
    if !file.metadata()?.file_type().is_file() {
        return Err(io::Error::other(format!("{LOCK} is not a regular file")));
    }
    match Flock::lock(file, FlockArg::LockSharedNonblock) {
        // Free: our shared lock is dropped (unlocked) here at once.
        Ok(_free) => Ok(LockState::Free),
        Err((file, nix::errno::Errno::EWOULDBLOCK)) => Ok(LockState::Held(read_holder(&file))),
        Err((_, e)) => Err(e.into()),
    }
}

/// Probes the lock of the job folder at `dir`.
pub fn probe(dir: &Path) -> io::Result<LockState> {
    let d = std::fs::File::open(dir)?;
    probe_at(&d)
}

/// The jobs whose agents run under the shared-memory root `root`: each
/// folder whose lock is held, with its holder, sorted by name. Folders that
/// are not names, or whose lock is free or missing, are skipped.
pub fn running(root: &Path) -> io::Result<Vec<(crate::ident::JobId, Holder)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(root)? {
        let e = e?;
        let Some(job) = e
            .file_name()
            .to_str()
            .and_then(|n| crate::ident::JobId::new(n).ok())
        else {
            continue;
        };
        if !e.file_type()?.is_dir() {
            continue;
        }
        if let Ok(LockState::Held(Some(h))) = probe(&e.path()) {
            out.push((job, h));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_held_lock_names_its_holder_and_a_dropped_one_is_free() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(probe(d.path()).unwrap(), LockState::Missing);
        let f = std::fs::File::create(d.path().join(LOCK)).unwrap();
        let held = Flock::lock(f, FlockArg::LockExclusiveNonblock).unwrap();
        assert_eq!(probe(d.path()).unwrap(), LockState::Held(None));
        let me = Holder::me("j");
        std::fs::write(d.path().join(LOCK), me.line()).unwrap();
        assert_eq!(probe(d.path()).unwrap(), LockState::Held(Some(me.clone())));
        assert!(me.alive());
        assert!(me.started().ends_with('Z'), "{}", me.started());
        // The root holding this folder lists it as running.
        let root = tempfile::tempdir().unwrap();
        let job = root.path().join("j");
        std::fs::create_dir(&job).unwrap();
        std::fs::create_dir(root.path().join("gone")).unwrap();
        std::fs::write(root.path().join("gone").join(LOCK), b"").unwrap();
        let f = std::fs::File::create(job.join(LOCK)).unwrap();
        let _j = Flock::lock(f, FlockArg::LockExclusiveNonblock).unwrap();
        std::fs::write(job.join(LOCK), Holder::me("j").line()).unwrap();
        let jobs = running(root.path()).unwrap();
        assert_eq!(jobs.len(), 1);
        assert_eq!(jobs[0].0.as_str(), "j");
        drop(held);
        assert_eq!(probe(d.path()).unwrap(), LockState::Free);
        // A symlink in place of the lock file is not followed.
        std::fs::remove_file(d.path().join(LOCK)).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", d.path().join(LOCK)).unwrap();
        assert!(probe(d.path()).is_err());
    }

    proptest! {
        #[test]
        fn parsing_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse(&bytes);
        }

        #[test]
        fn holders_round_trip(pid in any::<i32>(), t in any::<u64>(), job in "[a-z0-9._-]{1,20}") {
            let h = Holder { pid, started_unix_s: t, job };
            let _ = h.started();
            prop_assert_eq!(parse(h.line().as_bytes()), Some(h));
        }
    }
}
