//! The job's folder in shared memory: `<shm root>/<job id>/`, holding the
//! lock that claims it, the ranks' stores, the control socket and the job's
//! secret.
//!
//! INVARIANT: the agent uses a root and a job folder only after
//! [`hatrain_shared::trust`] accepted them (not a symlink, its own or
//! root's, writable by nobody else), and only while it holds the folder's
//! lock ([`hatrain_shared::joblock`]): a second agent of the same job
//! refuses to start, and files are cleaned as stale only when their agent
//! is gone (the lock is free). It creates its files relative to the job
//! folder's handle without following symlinks (`openat(2)` with
//! `O_NOFOLLOW`), and removes only the files it names itself, the lock
//! last, then the folder (and the root, if it made it) when empty. A bad
//! job id never gets here: it is a [`JobId`].

use hatrain_shared::ident::JobId;
use hatrain_shared::joblock::{self, Holder};
use hatrain_shared::trust::{self, Kind, TrustError};
use nix::errno::Errno;
use nix::fcntl::{AtFlags, Flock, FlockArg, OFlag, openat};
use nix::sys::stat::{FileStat, Mode, fstat, fstatat};
use nix::unistd::{UnlinkatFlags, unlinkat};
use std::fs::File;
use std::io::{self, Seek, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The control socket's name in the job folder.
pub const SOCKET: &str = "agent.sock";
/// The job's secret's file name in the job folder.
pub const SECRET: &str = "secret";
/// The workers' own folder in the job folder (`HATRAIN_WORKER_DIR`): what
/// they put there (a framework's rendezvous files) goes with the job.
pub const WORKERS: &str = "workers";

/// Whether `name` is one of the agent's own files (the lock aside).
fn is_ours(name: &str) -> bool {
    name == SOCKET
        || name == SECRET
        || ["rank_", "replica_"].iter().any(|prefix| {
            name.strip_prefix(prefix)
                .and_then(|r| r.strip_suffix(".shm"))
                .is_some_and(|n| n.len() == 5 && n.bytes().all(|b| b.is_ascii_digit()))
        })
}

#[derive(Debug, thiserror::Error)]
pub enum JobDirError {
    #[error(transparent)]
    Untrusted(#[from] TrustError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("job {job} is already running ({holder}); choose another --job-id")]
    Running { job: JobId, holder: String },
}

/// The job's folder, verified, claimed and held open.
#[derive(Debug)]
pub struct JobDir {
    root: PathBuf,
    path: PathBuf,
    fd: OwnedFd,
    /// The folder's lock, held for the agent's lifetime.
    lock: Flock<File>,
    created_root: bool,
    /// Files the agent made here, removed at the end.
    made: Vec<String>,
    /// The agent made the workers' folder, removed (with what is in it)
    /// at the end.
    workers: bool,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> JobDirError + '_ {
    move |source| JobDirError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// How long an agent keeps trying for a lock whose named holder is gone
/// (a client's probe holds it for an instant) or that changes under it
/// (an agent that is exiting removes it).
const LOCK_RETRY: Duration = Duration::from_secs(2);

fn same_file(a: &FileStat, b: &FileStat) -> bool {
    a.st_dev == b.st_dev && a.st_ino == b.st_ino
}

/// One attempt at claiming the job folder.
enum Claim {
    Claimed(OwnedFd, Flock<File>),
    /// Held by another agent that runs.
    Held(Option<Holder>),
    /// Changed under us (a folder or lock file removed): try again.
    Retry,
}

impl JobDir {
    /// Creates (or, when it exists and is trusted, reuses) `root` and the
    /// job's folder in it, and claims the folder with its lock. A folder
    /// that another running agent holds is refused. Files of the agent's
    /// own that a dead earlier agent of this job left behind are removed
    /// with a warning; anything else in the folder is left alone. On any
    /// error, a root this call created is removed again when empty.
    pub fn open(root: &Path, job: &JobId) -> Result<Self, JobDirError> {
        let created_root = match std::fs::symlink_metadata(root) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(root)
                    .map_err(io_err(root))?;
                true
            }
            Err(e) => return Err(io_err(root)(e)),
            Ok(_) => false,
        };
        let opened = Self::claim(root, job, created_root, false);
        if opened.is_err() && created_root {
            let _ = std::fs::remove_dir(root);
        }
        opened
    }

    /// Claims the folder of a job whose agent is gone while its workers
    /// still run (a serving agent's restart): its files are kept, and
    /// removed when this agent's job ends.
    pub fn reopen(root: &Path, job: &JobId) -> Result<Self, JobDirError> {
        Self::claim(root, job, false, true)
    }

    fn claim(
        root: &Path,
        job: &JobId,
        created_root: bool,
        keep: bool,
    ) -> Result<Self, JobDirError> {
        let me = trust::me();
        trust::check(root, Kind::Dir, me)?;
        let path = root.join(job);
        let deadline = std::time::Instant::now() + LOCK_RETRY;
        let (fd, lock) = loop {
            let last = std::time::Instant::now() >= deadline;
            match Self::try_claim(&path, me)? {
                Claim::Claimed(fd, lock) => break (fd, lock),
                Claim::Held(Some(h)) if h.alive() || last => {
                    return Err(JobDirError::Running {
                        job: job.clone(),
                        holder: format!("agent pid {}, started at {}", h.pid, h.started()),
                    });
                }
                Claim::Held(None) if last => {
                    return Err(JobDirError::Running {
                        job: job.clone(),
                        holder: "its agent is starting".into(),
                    });
                }
                Claim::Held(_) | Claim::Retry => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let mut dir = Self {
            root: root.to_path_buf(),
            path,
            fd,
            lock,
            created_root,
            made: Vec::new(),
            workers: false,
        };
        dir.write_holder(job)?;
        if keep {
            dir.keep_files();
        } else {
            dir.clear_stale();
        }
        Ok(dir)
    }

    fn try_claim(path: &Path, me: u32) -> Result<Claim, JobDirError> {
        match std::fs::DirBuilder::new().mode(0o700).create(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_err(path)(e)),
        }
        trust::check(path, Kind::Dir, me)?;
        let fd = match openat(
            nix::fcntl::AT_FDCWD,
            path,
            OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_RDONLY,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            // Removed by an agent that was exiting.
            Err(Errno::ENOENT) => return Ok(Claim::Retry),
            Err(e) => return Err(io_err(path)(e.into())),
        };
        let lock_path = path.join(joblock::LOCK);
        let lock = match openat(
            &fd,
            joblock::LOCK,
            OFlag::O_CREAT | OFlag::O_RDWR | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        ) {
            Ok(l) => File::from(l),
            Err(Errno::ENOENT) => return Ok(Claim::Retry),
            Err(e) => return Err(io_err(&lock_path)(e.into())),
        };
        let lock = match Flock::lock(lock, FlockArg::LockExclusiveNonblock) {
            Ok(l) => l,
            Err((file, Errno::EWOULDBLOCK)) => {
                return Ok(Claim::Held(joblock::read_holder(&file)));
            }
            Err((_, e)) => return Err(io_err(&lock_path)(e.into())),
        };
        // INVARIANT: the lock counts only if it is still the folder's lock
        // file, in the folder at `path`: an agent that exits unlinks its
        // lock (while holding it), then removes the folder.
        let here = |r: nix::Result<FileStat>| r.map_err(|e| io_err(path)(e.into()));
        let held = here(fstat(lock.as_fd()))?;
        let named = match fstatat(&fd, joblock::LOCK, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(s) => s,
            Err(Errno::ENOENT) => return Ok(Claim::Retry),
            Err(e) => return Err(io_err(&lock_path)(e.into())),
        };
        let folder = match nix::sys::stat::lstat(path) {
            Ok(s) => s,
            Err(Errno::ENOENT) => return Ok(Claim::Retry),
            Err(e) => return Err(io_err(path)(e.into())),
        };
        if !same_file(&held, &named) || !same_file(&here(fstat(fd.as_fd()))?, &folder) {
            return Ok(Claim::Retry);
        }
        Ok(Claim::Claimed(fd, lock))
    }

    /// Says in the lock file who holds it.
    fn write_holder(&mut self, job: &JobId) -> Result<(), JobDirError> {
        let path = self.path.join(joblock::LOCK);
        let line = Holder::me(job.as_str()).line();
        let f: &mut File = &mut self.lock;
        f.set_len(0)
            .and_then(|()| f.rewind())
            .and_then(|()| f.write_all(line.as_bytes()))
            .map_err(io_err(&path))
    }

    /// Takes the agent's own files an earlier agent of this job left as
    /// this agent's.
    fn keep_files(&mut self) {
        let Ok(entries) = std::fs::read_dir(&self.path) else {
            return;
        };
        for e in entries.flatten() {
            if let Some(name) = e.file_name().to_str().filter(|n| is_ours(n)) {
                self.made(name);
            }
        }
    }

    /// Removes the agent's own files left by an earlier agent of this job
    /// (which is gone: this agent holds the lock now).
    fn clear_stale(&self) {
        let Ok(entries) = std::fs::read_dir(&self.path) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            if name == joblock::LOCK {
                continue;
            }
            if name == WORKERS {
                tracing::warn!(dir = %self.path.display(), "removing the workers' folder of this job, left by an agent that is gone");
                let _ = std::fs::remove_dir_all(self.path.join(WORKERS));
            } else if is_ours(name) {
                tracing::warn!(dir = %self.path.display(), file = name, "removing a stale file of this job, left by an agent that is gone");
                let _ = unlinkat(&self.fd, name, UnlinkatFlags::NoRemoveDir);
            } else {
                tracing::warn!(dir = %self.path.display(), file = name, "a file the agent did not make is in the job folder; left alone");
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The shared-memory root the folder is in.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Creates (or truncates) file `name` in the folder, mode 0600, without
    /// following a symlink; it is removed when the job ends.
    pub fn create(&mut self, name: &str) -> Result<(File, PathBuf), JobDirError> {
        debug_assert!(is_ours(name), "the agent names its own files");
        let path = self.path.join(name);
        let fd = openat(
            &self.fd,
            name,
            OFlag::O_CREAT | OFlag::O_TRUNC | OFlag::O_RDWR | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(|e| io_err(&path)(e.into()))?;
        if !self.made.iter().any(|m| m == name) {
            self.made.push(name.to_string());
        }
        Ok((File::from(fd), path))
    }

    /// Makes the workers' folder (mode 0700), removed with what is in it
    /// when the job ends, and returns its path.
    pub fn workers_dir(&mut self) -> Result<PathBuf, JobDirError> {
        let path = self.path.join(WORKERS);
        match nix::sys::stat::mkdirat(&self.fd, WORKERS, Mode::from_bits_truncate(0o700)) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(io_err(&path)(e.into())),
        }
        // Ours, a folder, and no one else's to write (not a planted link).
        trust::check(&path, Kind::Dir, nix::unistd::geteuid().as_raw())?;
        self.workers = true;
        Ok(path)
    }

    /// Removes file `name` that the agent made here (a store whose creation
    /// failed, or one a reshape replaces: a mapping of it stays valid).
    pub fn forget(&mut self, name: &str) {
        if let Some(i) = self.made.iter().position(|m| m == name) {
            self.made.remove(i);
            let _ = unlinkat(&self.fd, name, UnlinkatFlags::NoRemoveDir);
        }
    }

    /// Records that the agent made `name` here by other means (the control
    /// socket is bound by path).
    pub fn made(&mut self, name: &str) {
        if !self.made.iter().any(|m| m == name) {
            self.made.push(name.to_string());
        }
    }

    /// Removes what the agent made, then its lock (still holding it), then
    /// the folder, then the root if the agent created it (or it is the
    /// default root) and it is empty; a job folder that is not empty stays,
    /// with a warning.
    pub fn remove(self) {
        if self.workers {
            // remove_dir_all does not follow symbolic links.
            if let Err(e) = std::fs::remove_dir_all(self.path.join(WORKERS)) {
                tracing::warn!(dir = %self.path.display(), error = %e, "the workers' folder is not removed");
            }
        }
        for name in self.made.iter().map(String::as_str).chain([joblock::LOCK]) {
            match unlinkat(&self.fd, name, UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => {}
                Err(e) => {
                    tracing::error!(dir = %self.path.display(), file = %name, error = %e, "cannot remove")
                }
            }
        }
        drop(self.fd);
        match std::fs::remove_dir(&self.path) {
            Ok(()) => {}
            // Another agent of this job claimed the folder meanwhile.
            Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => {
                tracing::debug!(dir = %self.path.display(), "the job folder is in use again; kept")
            }
            Err(e) => {
                tracing::warn!(dir = %self.path.display(), error = %e, "the job folder is not removed")
            }
        }
        drop(self.lock);
        // The root goes too when empty: if this agent made it, or if it is
        // the default one (which another agent of this user may have made).
        let removable = self.created_root || self.root == trust::default_shm_root();
        if removable && std::fs::remove_dir(&self.root).is_err() {
            tracing::debug!(root = %self.root.display(), "the shm root is not empty; kept");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_files_only() {
        for ours in [
            "agent.sock",
            "rank_00003.shm",
            "replica_00007.shm",
            "secret",
        ] {
            assert!(is_ours(ours), "{ours}");
        }
        for theirs in [
            "rank_3.shm",
            "data",
            "rank_00003.shm.bak",
            "replica_x.shm",
            "../x",
        ] {
            assert!(!is_ours(theirs), "{theirs}");
        }
    }

    #[test]
    fn the_folder_is_made_used_and_removed_with_only_our_files() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("shm");
        let job = JobId::new("j").unwrap();
        let mut dir = JobDir::open(&root, &job).unwrap();
        let (_f, p) = dir.create("rank_00000.shm").unwrap();
        assert!(p.exists());
        dir.remove();
        assert!(!root.exists(), "the root it made is gone when empty");
        // A stale folder: our files go, a stranger's file stays, and so
        // does the folder.
        let mut dir = JobDir::open(&root, &job).unwrap();
        dir.create("rank_00001.shm").unwrap();
        std::fs::write(root.join("j/keep.txt"), b"mine").unwrap();
        drop(dir);
        let dir = JobDir::open(&root, &job).unwrap();
        assert!(!root.join("j/rank_00001.shm").exists());
        dir.remove();
        assert_eq!(std::fs::read(root.join("j/keep.txt")).unwrap(), b"mine");
    }

    #[test]
    fn a_held_folder_is_refused_with_its_holder_and_left_untouched() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("shm");
        let job = JobId::new("j").unwrap();
        let mut first = JobDir::open(&root, &job).unwrap();
        first.create("rank_00000.shm").unwrap();
        let e = JobDir::open(&root, &job).unwrap_err().to_string();
        let me = std::process::id();
        assert!(
            e.contains("job j is already running")
                && e.contains(&format!("agent pid {me}"))
                && e.contains("choose another --job-id"),
            "{e}"
        );
        assert!(
            root.join("j/rank_00000.shm").exists(),
            "the first job's files stay"
        );
        match hatrain_shared::joblock::probe(&root.join("j")).unwrap() {
            hatrain_shared::joblock::LockState::Held(Some(h)) => {
                assert_eq!((h.pid, h.job.as_str()), (me as i32, "j"));
            }
            other => panic!("the lock names its holder: {other:?}"),
        }
        // Another job beside it is fine.
        let other = JobDir::open(&root, &JobId::new("k").unwrap()).unwrap();
        other.remove();
        first.remove();
        assert!(!root.exists());
    }

    #[test]
    fn untrusted_roots_and_folders_are_refused_and_left_alone() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let job = JobId::new("j").unwrap();
        std::fs::create_dir(d.path().join("open")).unwrap();
        std::fs::set_permissions(
            d.path().join("open"),
            std::fs::Permissions::from_mode(0o777),
        )
        .unwrap();
        let e = JobDir::open(&d.path().join("open"), &job)
            .unwrap_err()
            .to_string();
        assert!(e.contains("open") && e.contains("mode 0777"), "{e}");
        assert!(!d.path().join("open/j").exists(), "nothing written there");
        let real = d.path().join("real");
        std::fs::create_dir(&real).unwrap();
        std::os::unix::fs::symlink(&real, d.path().join("link")).unwrap();
        let e = JobDir::open(&d.path().join("link"), &job)
            .unwrap_err()
            .to_string();
        assert!(e.contains("symbolic link"), "{e}");
        // A symlink in place of the job folder.
        std::os::unix::fs::symlink(&real, real.join("j")).unwrap();
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o700)).unwrap();
        let e = JobDir::open(&real, &job).unwrap_err().to_string();
        assert!(e.contains("real/j") && e.contains("symbolic link"), "{e}");
    }
}
