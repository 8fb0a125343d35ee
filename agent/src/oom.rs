//! Out-of-memory kills: whether the kernel's OOM killer ended a worker.
//!
//! A worker that dies of a SIGKILL the agent did not send may have been
//! chosen by the OOM killer. Two witnesses:
//!
//! 1. the kernel's log (`/dev/kmsg`, readable by root): a record
//!    `Killed process PID (` written after the worker started. It names
//!    the process, so it is believed whenever it can be read;
//! 2. otherwise the worker's memory cgroup, which counts the kills it
//!    suffered: `oom_kill N` in `memory.events` (cgroup v2) or
//!    `memory.oom_control` (cgroup v1). A count that rose since the worker
//!    started (or since the last kill measured in that cgroup) is an OOM
//!    kill; it cannot tell two workers of one cgroup apart.
//!
//! The cgroup is read from `/proc/PID/cgroup` when the worker starts (it
//! inherits the agent's, unless something moves it), and found through
//! `/proc/self/mountinfo`, so both hierarchies and any mount point work.
//! Everything here reads files only; nothing decides what a kill means
//! (that is the recovery machine's).

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The `oom_score_adj` a worker starts with: when memory runs out, the
/// kernel's OOM killer takes a worker (whose loss the agent recovers from)
/// before the agent that supervises them (whose loss ends the job).
pub const WORKER_OOM_SCORE_ADJ: &[u8] = b"500";

/// Raises the calling process's `oom_score_adj` to
/// [`WORKER_OOM_SCORE_ADJ`]; for a new worker, between fork and exec.
/// Raising it needs no privilege (proc(5)); a failure leaves it as it was.
///
/// Only open(2), write(2) and close(2): async-signal-safe.
pub fn prefer_as_oom_victim() {
    // SAFETY: a static NUL-terminated path, a live byte slice and the fd
    // just opened; nothing allocates.
    unsafe {
        let fd = libc::open(
            c"/proc/self/oom_score_adj".as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        );
        if fd >= 0 {
            let _ = libc::write(
                fd,
                WORKER_OOM_SCORE_ADJ.as_ptr().cast(),
                WORKER_OOM_SCORE_ADJ.len(),
            );
            libc::close(fd);
        }
    }
}

/// The file of a memory cgroup that counts its OOM kills.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OomCounter(PathBuf);

impl OomCounter {
    /// The counter of `pid`'s memory cgroup, if it has one that is mounted.
    pub fn of(pid: i32) -> Option<Self> {
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        counter_path(&cgroup, &mounts).map(Self)
    }

    /// The kills counted so far.
    pub fn kills(&self) -> Option<u64> {
        parse_oom_kills(&std::fs::read_to_string(&self.0).ok()?)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

/// The `oom_kill` count of a `memory.events` or `memory.oom_control` file.
pub fn parse_oom_kills(text: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next()? == "oom_kill").then(|| w.next()?.parse().ok())?
    })
}

/// Where the OOM count of the memory cgroup in `proc_cgroup` (the text of
/// `/proc/PID/cgroup`) lives, given the mounts in `mountinfo` (the text of
/// `/proc/self/mountinfo`). A v1 memory hierarchy wins over the unified
/// one, since the controller is then there.
pub fn counter_path(proc_cgroup: &str, mountinfo: &str) -> Option<PathBuf> {
    // mountinfo(5): ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [TAGS...] - FSTYPE SOURCE SUPEROPTS
    let mounts: Vec<(&str, &str, &str, &str)> = mountinfo
        .lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let pre: Vec<&str> = pre.split_whitespace().collect();
            let post: Vec<&str> = post.split_whitespace().collect();
            Some((*pre.get(3)?, *pre.get(4)?, *post.first()?, *post.get(2)?))
        })
        .collect();
    let under = |root: &str, mountpoint: &str, path: &str| -> PathBuf {
        let rel = path
            .strip_prefix(root)
            .filter(|_| root != "/")
            .unwrap_or(path)
            .trim_start_matches('/');
        Path::new(&unescape(mountpoint)).join(rel)
    };
    let mut v2 = None;
    for line in proc_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            v2 = Some(path);
        } else if controllers.split(',').any(|c| c == "memory") {
            let (root, mp, _, _) = mounts.iter().find(|(_, _, fs, opts)| {
                *fs == "cgroup" && opts.split(',').any(|o| o == "memory")
            })?;
            return Some(under(root, mp, path).join("memory.oom_control"));
        }
    }
    let path = v2?;
    let (root, mp, _, _) = mounts.iter().find(|(_, _, fs, _)| *fs == "cgroup2")?;
    Some(under(root, mp, path).join("memory.events"))
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether the kernel-log records in `records` (`/dev/kmsg` lines:
/// `PRIO,SEQ,USEC,FLAGS;TEXT`) say the OOM killer killed `pid` at or after
/// `since_us` on the kernel's clock.
pub fn kmsg_names(records: &str, pid: i32, since_us: u64) -> bool {
    let needle = format!("Killed process {pid} (");
    records.lines().any(|r| {
        let Some((head, text)) = r.split_once(';') else {
            return false;
        };
        let usec = head.split(',').nth(2).and_then(|u| u.parse::<u64>().ok());
        usec.is_some_and(|u| u >= since_us) && text.contains(&needle)
    })
}

/// The kernel's log as it is now (every record still in its buffer);
/// `None` if it cannot be read (not root, or no `/dev/kmsg`).
fn read_kmsg() -> Option<String> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")
        .ok()?;
    let mut out = String::new();
    let mut buf = vec![0u8; 8192];
    // Bounded: the ring buffer holds at most a few MiB of records.
    for _ in 0..100_000 {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                out.push_str(&String::from_utf8_lossy(&buf[..n]));
                if !out.ends_with('\n') {
                    out.push('\n');
                }
            }
            // A record overwritten while we read: go on with the next.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(_) => break,
        }
    }
    Some(out)
}

/// Microseconds on the clock `/dev/kmsg` stamps its records with
/// (`CLOCK_MONOTONIC`, near enough for "after the worker started").
pub fn kernel_now_us() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        t.tv_sec() as u64 * 1_000_000 + t.tv_nsec() as u64 / 1000
    })
}

#[derive(Debug, Clone)]
struct Watched {
    pid: i32,
    counter: Option<OomCounter>,
    started_us: u64,
}

/// The workers' memory cgroups and their OOM counts.
#[derive(Debug, Default)]
pub struct OomWatch {
    ranks: HashMap<usize, Watched>,
    /// The count of each counter last accounted for.
    seen: HashMap<OomCounter, u64>,
}

impl OomWatch {
    /// `rank`'s process `pid` has started.
    pub fn started(&mut self, rank: usize, pid: i32) {
        let counter = OomCounter::of(pid);
        if let Some(c) = &counter
            && let Some(n) = c.kills()
        {
            self.seen.entry(c.clone()).or_insert(n);
        }
        self.ranks.insert(
            rank,
            Watched {
                pid,
                counter,
                started_us: kernel_now_us().saturating_sub(1_000_000),
            },
        );
    }

    /// Whether `rank`'s process `pid`, which died of SIGKILL, was killed by
    /// the OOM killer. The kernel's log names the very process, so it is
    /// asked where it can be read; the cgroup's count, which cannot tell
    /// two workers of one cgroup apart, only where it cannot.
    pub fn killed(&mut self, rank: usize, pid: i32) -> bool {
        let Some(w) = self.ranks.get(&rank).filter(|w| w.pid == pid).cloned() else {
            return false;
        };
        // The count is taken in any case, so that a later kill is measured
        // from here.
        let counted = w.counter.as_ref().is_some_and(|c| {
            c.kills().is_some_and(|now| {
                let before = self.seen.insert(c.clone(), now).unwrap_or(now);
                now > before
            })
        });
        match read_kmsg() {
            Some(log) => kmsg_names(&log, pid, w.started_us),
            None => counted,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_worker_is_the_oom_killers_first_choice() {
        use std::os::unix::process::CommandExt;
        let mut cmd = std::process::Command::new("cat");
        cmd.arg("/proc/self/oom_score_adj");
        // SAFETY: the closure only calls open(2), write(2) and close(2).
        unsafe {
            cmd.pre_exec(|| {
                prefer_as_oom_victim();
                Ok(())
            });
        }
        let out = cmd.output().expect("cat runs");
        assert_eq!(out.stdout.trim_ascii(), WORKER_OOM_SCORE_ADJ);
    }

    const MOUNTS_V1: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
";
    const MOUNTS_V2: &str = "\
30 23 0:27 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
";

    #[test]
    fn the_counter_is_found_in_either_hierarchy() {
        let v1 = "9:name=systemd:/\n4:memory:/jobs/a\n0::/\n";
        assert_eq!(
            counter_path(v1, MOUNTS_V1).unwrap(),
            PathBuf::from("/sys/fs/cgroup/memory/jobs/a/memory.oom_control")
        );
        assert_eq!(
            counter_path("4:cpu,memory:/x\n", MOUNTS_V1).unwrap(),
            PathBuf::from("/sys/fs/cgroup/memory/x/memory.oom_control")
        );
        assert_eq!(
            counter_path("0::/user.slice/job\n", MOUNTS_V2).unwrap(),
            PathBuf::from("/sys/fs/cgroup/user.slice/job/memory.events")
        );
        // A v2 line with no cgroup2 mount, or nothing at all: no counter.
        assert_eq!(counter_path("0::/\n", MOUNTS_V1), None);
        assert_eq!(counter_path("", MOUNTS_V2), None);
        assert_eq!(counter_path("garbage", "garbage"), None);
    }

    #[test]
    fn counts_and_kernel_records_are_read() {
        assert_eq!(
            parse_oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"),
            Some(3)
        );
        assert_eq!(
            parse_oom_kills("low 0\nhigh 0\nmax 5\noom 2\noom_kill 2\noom_group_kill 0\n"),
            Some(2)
        );
        assert_eq!(parse_oom_kills("oom 1\n"), None);
        let log = "6,10,5000000,-;Memory cgroup out of memory: Killed process 4242 (hatrain-train) total-vm:1kB\n\
                   6,11,9000000,-;Killed process 77 (x)\n";
        assert!(kmsg_names(log, 4242, 4_000_000));
        assert!(
            !kmsg_names(log, 4242, 6_000_000),
            "before the worker started"
        );
        assert!(!kmsg_names(log, 424, 0), "another pid");
        assert!(kmsg_names(log, 77, 0));
        assert!(!kmsg_names("no semicolon\n,,x;Killed process 5 (\n", 5, 0));
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape(r"/a\040b"), "/a b");
        assert_eq!(unescape(r"/a\04"), r"/a\04");
        assert_eq!(unescape(r"\134"), "\\");
    }
}
