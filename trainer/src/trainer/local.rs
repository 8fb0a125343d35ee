//! A reshape's moves between ranks of one host go through shared memory,
//! not the ring: the sender leaves its bytes for the receiver in a file of
//! the workers' folder its agent gives it in `/dev/shm`
//! (`HATRAIN_WORKER_DIR`, private to the job's user and removed with the
//! job, so a file a failed reshape leaves goes with it), and the receiver
//! reads it and removes it. A byte is copied twice (into
//! the file, out of it) and crosses no socket.
//!
//! Ranks are of one host when their workers' folders are the same folder
//! of the same running kernel: the boot's id, the folder's device and its
//! inode. Ranks of another agent on this machine (another folder), or in
//! another mount namespace (another tmpfs, another device), never match,
//! so a file one leaves is always one the other can read.
//!
//! A sender that cannot write its file (a full `/dev/shm`) sends the bytes
//! over the ring instead, which the receiver sees as a message that came.
//! A receiver that cannot read an expected file fails the reshape as a
//! collective does (the agent tries it again) and leaves shared memory
//! out of this process's later reshapes.

use super::TrainError;
use crate::collective::CollectiveError;
use hatrain_shared::control::ENV_WORKER_DIR;
use std::fs::{self, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once a file a sibling left could not be read: later reshapes of
/// this process take every piece over the ring.
static UNREADABLE: AtomicBool = AtomicBool::new(false);

/// The workers' folder of this rank's agent, where ranks of its host meet.
#[derive(Debug, Clone)]
pub(super) struct Local {
    dir: PathBuf,
    /// Equal for ranks of one host (see the module doc).
    key: Vec<u8>,
}

impl Local {
    /// The workers' folder of the agent this rank is run by; `None`
    /// without an agent, or once a sibling's file could not be read.
    pub(super) fn here() -> Option<Self> {
        if UNREADABLE.load(Ordering::Relaxed) {
            return None;
        }
        Self::at(PathBuf::from(std::env::var_os(ENV_WORKER_DIR)?))
    }

    /// Ranks meeting in `dir`; `None` when it cannot be read.
    fn at(dir: PathBuf) -> Option<Self> {
        let meta = fs::metadata(&dir).ok()?;
        let boot = fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let key = format!("{}:{}:{}", boot.trim(), meta.dev(), meta.ino()).into_bytes();
        Some(Self { dir, key })
    }

    /// The key the ranks compare (empty without a [`Local`]).
    pub(super) fn key(me: Option<&Self>) -> &[u8] {
        me.map_or(&[], |l| &l.key)
    }

    fn path(&self, epoch: u64, from: usize, to: usize) -> PathBuf {
        self.dir.join(format!("reshape.{epoch}.{from}.{to}"))
    }

    /// Leaves `bytes` for place `to` under `epoch`; false (and nothing
    /// left behind) when the file cannot be written whole.
    pub(super) fn put(&self, epoch: u64, from: usize, to: usize, bytes: &[u8]) -> bool {
        let path = self.path(epoch, from, to);
        let written = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .and_then(|mut f| f.write_all(bytes));
        match written {
            Ok(()) => true,
            Err(e) => {
                let _ = fs::remove_file(&path);
                eprintln!(
                    "place {from}: cannot leave {} bytes for place {to} in {} ({e}): sending them over the ring",
                    bytes.len(),
                    path.display()
                );
                false
            }
        }
    }

    /// Takes what place `from` left for place `to` under `epoch`, and
    /// removes the file. The file must be this user's and no one else's to
    /// write (`hatrain_shared::trust`).
    pub(super) fn take(&self, epoch: u64, from: usize, to: usize) -> Result<Vec<u8>, TrainError> {
        let path = self.path(epoch, from, to);
        let read = hatrain_shared::trust::check(
            &path,
            hatrain_shared::trust::Kind::File,
            hatrain_shared::trust::me(),
        )
        .map_err(|e| e.to_string())
        .and_then(|meta| {
            let mut bytes = Vec::with_capacity(meta.len() as usize);
            fs::File::open(&path)
                .and_then(|mut f| f.read_to_end(&mut bytes))
                .map_err(|e| e.to_string())?;
            Ok(bytes)
        });
        let _ = fs::remove_file(&path);
        read.map_err(|e| {
            UNREADABLE.store(true, Ordering::Relaxed);
            TrainError::Collective(CollectiveError::Protocol {
                epoch,
                peer: from,
                detail: format!(
                    "the pieces place {from} left in {} cannot be read ({e}); later reshapes of this rank use the ring",
                    path.display()
                ),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn pieces_left_for_a_sibling_are_taken_once_and_removed() {
        let d = tempfile::tempdir().unwrap();
        let (a, b) = (
            Local::at(d.path().into()).unwrap(),
            Local::at(d.path().into()).unwrap(),
        );
        assert_eq!(a.key, b.key, "one folder, one host");
        let other = tempfile::tempdir().unwrap();
        assert_ne!(
            a.key,
            Local::at(other.path().into()).unwrap().key,
            "another folder"
        );
        assert!(a.put(7, 1, 0, b"pieces"));
        assert_eq!(b.take(7, 1, 0).unwrap(), b"pieces");
        assert_eq!(
            fs::read_dir(d.path()).unwrap().count(),
            0,
            "the file is gone"
        );
    }

    #[test]
    fn a_file_others_may_write_or_a_missing_one_fails_the_reshape() {
        let d = tempfile::tempdir().unwrap();
        let l = Local::at(d.path().into()).unwrap();
        assert!(l.put(3, 2, 1, b"x"));
        let path = l.path(3, 2, 1);
        fs::set_permissions(&path, fs::Permissions::from_mode(0o666)).unwrap();
        let e = l.take(3, 2, 1).unwrap_err().to_string();
        assert!(e.contains("place 2") && e.contains("cannot be read"), "{e}");
        assert!(!path.exists(), "not left behind");
        let e = l.take(4, 2, 1).unwrap_err().to_string();
        assert!(e.contains("cannot be read"), "{e}");
        // Later reshapes of this process would use the ring.
        assert!(UNREADABLE.swap(false, Ordering::Relaxed));
    }
}
