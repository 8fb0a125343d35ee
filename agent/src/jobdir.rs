//! The job's folder in shared memory: `<shm root>/<job id>/`, holding the
//! ranks' stores, the control socket and the job's secret.
//!
//! INVARIANT: the agent uses a root and a job folder only after
//! [`hatrain_shared::trust`] accepted them (not a symlink, its own or
//! root's, writable by nobody else), creates its files relative to the job
//! folder's handle without following symlinks (`openat(2)` with
//! `O_NOFOLLOW`), and removes only the files it names itself, then the
//! folder (and the root, if it made it) when empty. A bad job id never gets
//! here: it is a [`JobId`].

use hatrain_shared::ident::JobId;
use hatrain_shared::trust::{self, Kind, TrustError};
use nix::fcntl::{OFlag, openat};
use nix::sys::stat::Mode;
use nix::unistd::{UnlinkatFlags, unlinkat};
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// The control socket's name in the job folder.
pub const SOCKET: &str = "agent.sock";
/// The job's secret's file name in the job folder.
pub const SECRET: &str = "secret";

/// Whether `name` is one of the agent's own files.
fn is_ours(name: &str) -> bool {
    name == SOCKET
        || name == SECRET
        || name
            .strip_prefix("rank_")
            .and_then(|r| r.strip_suffix(".shm"))
            .is_some_and(|n| n.len() == 5 && n.bytes().all(|b| b.is_ascii_digit()))
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
}

/// The job's folder, verified and held open.
#[derive(Debug)]
pub struct JobDir {
    root: PathBuf,
    path: PathBuf,
    fd: OwnedFd,
    created_root: bool,
    /// Files the agent made here, removed at the end.
    made: Vec<String>,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> JobDirError + '_ {
    move |source| JobDirError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl JobDir {
    /// Creates (or, when it exists and is trusted, reuses) `root` and the
    /// job's folder in it. Files of the agent's own that a killed earlier
    /// agent of this job left behind are removed; anything else in the
    /// folder is left alone.
    pub fn open(root: &Path, job: &JobId) -> Result<Self, JobDirError> {
        let me = trust::me();
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
        trust::check(root, Kind::Dir, me)?;
        let path = root.join(job);
        match std::fs::symlink_metadata(&path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&path)
                .map_err(io_err(&path))?,
            Err(e) => return Err(io_err(&path)(e)),
            Ok(_) => {}
        }
        trust::check(&path, Kind::Dir, me)?;
        let fd = openat(
            nix::fcntl::AT_FDCWD,
            &path,
            OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_RDONLY,
            Mode::empty(),
        )
        .map_err(|e| io_err(&path)(e.into()))?;
        let dir = Self {
            root: root.to_path_buf(),
            path,
            fd,
            created_root,
            made: Vec::new(),
        };
        dir.clear_stale();
        Ok(dir)
    }

    /// Removes the agent's own files left by an earlier agent of this job.
    fn clear_stale(&self) {
        let Ok(entries) = std::fs::read_dir(&self.path) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            if is_ours(name) {
                tracing::warn!(dir = %self.path.display(), file = name, "removing a stale file of this job");
                let _ = unlinkat(&self.fd, name, UnlinkatFlags::NoRemoveDir);
            } else {
                tracing::warn!(dir = %self.path.display(), file = name, "a file the agent did not make is in the job folder; left alone");
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
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

    /// Records that the agent made `name` here by other means (the control
    /// socket is bound by path).
    pub fn made(&mut self, name: &str) {
        if !self.made.iter().any(|m| m == name) {
            self.made.push(name.to_string());
        }
    }

    /// Removes what the agent made, then the folder, then the root if the
    /// agent created it (or it is the default root) and it is empty; a job
    /// folder that is not empty stays, with a warning.
    pub fn remove(self) {
        for name in &self.made {
            match unlinkat(&self.fd, name.as_str(), UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(nix::errno::Errno::ENOENT) => {}
                Err(e) => {
                    tracing::error!(dir = %self.path.display(), file = %name, error = %e, "cannot remove")
                }
            }
        }
        drop(self.fd);
        if let Err(e) = std::fs::remove_dir(&self.path) {
            tracing::warn!(dir = %self.path.display(), error = %e, "the job folder is not removed");
        }
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
        for ours in ["agent.sock", "rank_00003.shm", "secret"] {
            assert!(is_ours(ours), "{ours}");
        }
        for theirs in ["rank_3.shm", "data", "rank_00003.shm.bak", "../x"] {
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
