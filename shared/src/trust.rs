//! Whether a folder or file may be trusted before it is used: the agent's
//! shared-memory root and job folder, the stores and the control socket in
//! it, as seen by the agent, the workers and `agentctl`.
//!
//! Trusted means: the thing itself is not a symbolic link, it belongs to
//! this process's user or to root, and nobody else may write to it (group
//! or others). A folder of root's with the sticky bit (like `/dev/shm`
//! itself) may be writable by all: nobody can then rename or remove what
//! another user put in it. Every refusal names the path, its owner and its
//! mode.

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Why a path was not trusted.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is a symbolic link; refusing to follow it (give the real path instead)")]
    Symlink { path: PathBuf },
    #[error("{path} is a {kind}, not a {want}")]
    Kind {
        path: PathBuf,
        kind: &'static str,
        want: &'static str,
    },
    #[error(
        "{path} belongs to uid {owner} (mode {mode:04o}), not to this user (uid {me}) or root; refusing to use it"
    )]
    Owner {
        path: PathBuf,
        owner: u32,
        mode: u32,
        me: u32,
    },
    #[error(
        "{path} (owner uid {owner}) has mode {mode:04o}: others may write to it; refusing to use it"
    )]
    Writable {
        path: PathBuf,
        owner: u32,
        mode: u32,
    },
}

/// What a path should be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Dir,
    File,
    Socket,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Self::Dir => "folder",
            Self::File => "regular file",
            Self::Socket => "socket",
        }
    }
}

fn kind_of(t: fs::FileType) -> &'static str {
    if t.is_dir() {
        "folder"
    } else if t.is_file() {
        "regular file"
    } else if t.is_socket() {
        "socket"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_symlink() {
        "symbolic link"
    } else {
        "device or special file"
    }
}

/// This process's effective uid.
pub fn me() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Checks that `path` is a `kind` (not a symbolic link to one), owned by
/// `me` or root, and writable by nobody else (see the module doc for
/// root's sticky folders).
pub fn check(path: &Path, kind: Kind, me: u32) -> Result<fs::Metadata, TrustError> {
    let meta = fs::symlink_metadata(path).map_err(|source| TrustError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let t = meta.file_type();
    if t.is_symlink() {
        return Err(TrustError::Symlink {
            path: path.to_path_buf(),
        });
    }
    let ok_kind = match kind {
        Kind::Dir => t.is_dir(),
        Kind::File => t.is_file(),
        Kind::Socket => t.is_socket(),
    };
    if !ok_kind {
        return Err(TrustError::Kind {
            path: path.to_path_buf(),
            kind: kind_of(t),
            want: kind.name(),
        });
    }
    let (owner, mode) = (meta.uid(), meta.mode() & 0o7777);
    if owner != me && owner != 0 {
        return Err(TrustError::Owner {
            path: path.to_path_buf(),
            owner,
            mode,
            me,
        });
    }
    let sticky_root_dir = kind == Kind::Dir && owner == 0 && mode & 0o1000 != 0;
    if mode & 0o022 != 0 && !sticky_root_dir {
        return Err(TrustError::Writable {
            path: path.to_path_buf(),
            owner,
            mode,
        });
    }
    Ok(meta)
}

/// The default shared-memory root: `/dev/shm/hatrain` for root, else
/// `/dev/shm/hatrain-<uid>`, so that users of one host never share one.
pub fn default_shm_root() -> PathBuf {
    match me() {
        0 => PathBuf::from("/dev/shm/hatrain"),
        uid => PathBuf::from(format!("/dev/shm/hatrain-{uid}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &Path, m: u32) {
        fs::set_permissions(p, fs::Permissions::from_mode(m)).unwrap();
    }

    #[test]
    fn folders_and_files_are_trusted_only_when_safe() {
        let d = tempfile::tempdir().unwrap();
        let me = me();
        let dir = d.path().join("root");
        fs::create_dir(&dir).unwrap();
        mode(&dir, 0o700);
        check(&dir, Kind::Dir, me).unwrap();
        mode(&dir, 0o777);
        let e = check(&dir, Kind::Dir, me).unwrap_err().to_string();
        assert!(
            e.contains("mode 0777") && e.contains("others may write"),
            "{e}"
        );
        mode(&dir, 0o755);
        // Someone else's folder: as root, give it to nobody; as a user, ask
        // for it as another uid.
        let other = if me == 0 {
            nix::unistd::chown(&dir, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
            me
        } else {
            me + 1
        };
        let e = check(&dir, Kind::Dir, other).unwrap_err().to_string();
        assert!(
            e.contains("belongs to uid") && e.contains("mode 0755"),
            "{e}"
        );
        if me == 0 {
            nix::unistd::chown(&dir, Some(nix::unistd::Uid::from_raw(0)), None).unwrap();
        }
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        let e = check(&link, Kind::Dir, me).unwrap_err().to_string();
        assert!(e.contains("link") && e.contains("symbolic link"), "{e}");
        let file = dir.join("f");
        fs::write(&file, b"x").unwrap();
        mode(&file, 0o600);
        check(&file, Kind::File, me).unwrap();
        let e = check(&file, Kind::Dir, me).unwrap_err().to_string();
        assert!(e.contains("is a regular file, not a folder"), "{e}");
        mode(&file, 0o666);
        assert!(check(&file, Kind::File, me).is_err());
    }

    #[test]
    fn the_default_root_is_per_user() {
        let r = default_shm_root();
        assert!(r.starts_with("/dev/shm"));
        if me() != 0 {
            assert!(r.to_string_lossy().ends_with(&format!("-{}", me())));
        }
    }
}
