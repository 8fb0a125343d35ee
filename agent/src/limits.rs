//! The agent's descriptor limit. An agent holds a descriptor per control
//! connection, two pipes per worker, the snapshot stores, the replica
//! streams and, while it saves, the checkpoint's files: the usual soft
//! limit of 1,024 is soon reached on a big host. So at start the agent
//! raises its soft `RLIMIT_NOFILE` to the hard limit (as systemd does for
//! its services), and gives its children the soft limit it was started
//! with: a worker's `select(2)` (Python's among them) breaks on descriptors
//! past 1,023.

use std::sync::atomic::{AtomicU64, Ordering};

/// The soft limit the agent was started with; `u64::MAX` until raised.
static STARTED_WITH: AtomicU64 = AtomicU64::new(u64::MAX);

/// Raises the soft descriptor limit to the hard one. Returns the limits
/// before and after.
pub fn raise_nofile() -> std::io::Result<(u64, u64)> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    STARTED_WITH.store(soft, Ordering::Relaxed);
    Ok((soft, hard))
}

/// In a child between fork and exec: the soft descriptor limit the agent
/// was started with, if the agent raised it. Only getrlimit(2) and
/// setrlimit(2), async-signal-safe system calls; a failure is ignored (the
/// child then keeps the agent's limit).
pub fn restore_nofile_in_child() {
    let soft = STARTED_WITH.load(Ordering::Relaxed);
    if soft == u64::MAX {
        return;
    }
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for getrlimit(2) to fill and for
    // setrlimit(2) to read; neither keeps the pointer.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && soft < lim.rlim_cur {
            lim.rlim_cur = soft;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Raised here and given back to a child: its soft limit is the one
    /// this process started with.
    #[test]
    fn the_agent_raises_its_limit_and_its_children_get_the_one_it_started_with() {
        use std::os::unix::process::CommandExt;
        let (soft, hard) = raise_nofile().unwrap();
        let (now, _) =
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap();
        assert_eq!(now, hard);
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", "ulimit -Sn"]);
        // SAFETY: restore_nofile_in_child only calls getrlimit(2) and
        // setrlimit(2).
        unsafe {
            cmd.pre_exec(|| {
                restore_nofile_in_child();
                Ok(())
            });
        }
        let out = cmd.output().unwrap();
        let child: String = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let want = if soft == libc::RLIM_INFINITY {
            "unlimited".to_string()
        } else {
            soft.to_string()
        };
        assert_eq!(child, want);
    }
}
