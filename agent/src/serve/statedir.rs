//! The serving agent's state folder: its lock, and each job's files in a
//! folder of its own (the first rank's registration, what the job keeps),
//! removed with what is left of a job that cannot be re-adopted.

use super::ServeError;
use super::wire::Registration;
use hatrain_shared::ident::JobId;
use std::path::{Path, PathBuf};

pub(super) fn lock_state_dir(dir: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, ServeError> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(".lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|source| ServeError::Bind {
            path: path.clone(),
            source,
        })?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .map_err(|_| ServeError::StateBusy(dir.to_path_buf()))
}

/// A job's files in the state folder, in a folder of its own: the
/// registration its first rank made, and what the job keeps ([`Kept`]).
#[derive(Debug, Clone)]
pub(super) struct StateFiles {
    dir: PathBuf,
    pub registration: PathBuf,
    pub kept: PathBuf,
}

impl StateFiles {
    pub fn of(dir: &Path, job: &str) -> Self {
        let dir = dir.join(job);
        Self {
            registration: dir.join("registration.json"),
            kept: dir.join("kept.json"),
            dir,
        }
    }

    pub fn write_registration(&self, reg: &Registration) -> std::io::Result<()> {
        make_private_dir(&self.dir)?;
        let json = serde_json::to_vec(reg).map_err(std::io::Error::other)?;
        crate::job::write_atomic(&self.registration, &json)
    }

    pub fn remove(&self) {
        let _ = std::fs::remove_file(&self.registration);
        let _ = std::fs::remove_file(&self.kept);
        let _ = std::fs::remove_file(self.kept.with_extension("json.tmp"));
        let _ = std::fs::remove_file(self.registration.with_extension("json.tmp"));
        let _ = std::fs::remove_dir(&self.dir);
    }
}

pub(super) fn make_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    hatrain_shared::trust::check(
        dir,
        hatrain_shared::trust::Kind::Dir,
        hatrain_shared::trust::me(),
    )
    .map(|_| ())
    .map_err(|e| std::io::Error::other(e.to_string()))
}

/// Removes what is left of a job that cannot be re-adopted: its state
/// files and its shared-memory folder.
pub(super) fn abandon(state_dir: &Path, shm_root: &Path, job: &str) {
    StateFiles::of(state_dir, job).remove();
    if let Ok(id) = JobId::new(job) {
        match crate::jobdir::JobDir::open(shm_root, &id) {
            Ok(dir) => dir.remove(),
            Err(e) => tracing::warn!(job, error = %e, "its shared memory is left"),
        }
    }
}
