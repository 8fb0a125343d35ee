//! Debian's `etcd-server`, started by the tests themselves: a member (or a
//! cluster of them) on loopback ports, its data under a temporary folder,
//! killed by pid when the test ends, even when it fails.

use super::ports::free_port_list;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Installs `etcd-server` the first time (the project's own script).
pub fn install() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/system-packages.sh");
    let ok = Command::new(&script)
        .arg("etcd-server")
        .status()
        .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    assert!(ok.success(), "{} etcd-server failed", script.display());
}

/// One etcd member.
pub struct Member {
    pub name: String,
    pub client: u16,
    pub peer: u16,
    pub dir: PathBuf,
    child: Option<Child>,
    log: PathBuf,
}

/// A running etcd cluster (one member or several).
pub struct Etcd {
    pub members: Vec<Member>,
    cluster: String,
}

impl Etcd {
    /// Starts `n` members under `dir` and waits until each takes
    /// connections. A port chosen free may be taken by another test before
    /// etcd binds it: the members are then started again on other ports.
    pub fn start(dir: &Path, n: usize) -> Self {
        install();
        for attempt in 0.. {
            match Self::try_start(dir, n, attempt) {
                Ok(e) => return e,
                Err(e) if attempt < 4 => drop(e),
                Err(e) => panic!("etcd never started on free ports:\n{}", e.logs()),
            }
        }
        unreachable!("the loop returns or panics")
    }

    /// [`Etcd::start`], once: `Err` (the members stopped) when one could
    /// not bind its ports.
    fn try_start(dir: &Path, n: usize, attempt: usize) -> Result<Self, Self> {
        let ports = free_port_list(2 * n);
        let members: Vec<Member> = (0..n)
            .map(|i| Member {
                name: format!("m{i}"),
                client: ports[2 * i],
                peer: ports[2 * i + 1],
                dir: dir.join(format!("etcd-m{i}-{attempt}")),
                child: None,
                log: dir.join(format!("etcd-m{i}-{attempt}.log")),
            })
            .collect();
        let cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        let mut e = Self { members, cluster };
        for i in 0..n {
            e.run(i, "new");
        }
        for i in 0..n {
            if !e.wait_up(i) {
                return Err(e);
            }
        }
        Ok(e)
    }

    /// `etcd://...` naming every member.
    pub fn url(&self) -> String {
        let eps: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client))
            .collect();
        format!("etcd://{}", eps.join(","))
    }

    fn run(&mut self, i: usize, state: &str) {
        let cluster = self.cluster.clone();
        let m = &mut self.members[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&m.log)
            .expect("etcd log");
        let client = format!("http://127.0.0.1:{}", m.client);
        let peer = format!("http://127.0.0.1:{}", m.peer);
        let mut child = Command::new("etcd");
        child
            .args(["--name", &m.name, "--data-dir"])
            .arg(&m.dir)
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args([
                "--initial-cluster",
                &cluster,
                "--initial-cluster-state",
                state,
            ])
            .args(["--initial-cluster-token", "hatrain-test"])
            .args(["--logger", "zap", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("etcd log"))
            .stderr(log);
        // SAFETY: prctl(2) is async-signal-safe; an etcd whose test died
        // (SIGKILL included) dies with it.
        unsafe {
            use std::os::unix::process::CommandExt;
            child.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = child.spawn().expect("etcd starts (Debian's etcd-server)");
        m.child = Some(child);
    }

    /// Waits until member `i` takes connections; false if it could not
    /// bind its ports (another process took one first).
    fn wait_up(&mut self, i: usize) -> bool {
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = format!("127.0.0.1:{}", self.members[i].client)
            .parse()
            .unwrap();
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            let m = &mut self.members[i];
            let log = std::fs::read_to_string(&m.log).unwrap_or_default();
            let exited = m
                .child
                .as_mut()
                .is_some_and(|c| c.try_wait().ok().flatten().is_some());
            if exited && log.contains("address already in use") {
                return false;
            }
            assert!(
                Instant::now() < deadline,
                "etcd member {} never took connections:\n{log}",
                m.name,
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        true
    }

    /// SIGKILLs member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts member `i` again, on its data.
    pub fn restart(&mut self, i: usize) {
        self.run(i, "existing");
        assert!(
            self.wait_up(i),
            "etcd member {} could not take its ports again:\n{}",
            self.members[i].name,
            self.logs()
        );
    }

    /// Every member's log.
    pub fn logs(&self) -> String {
        self.members
            .iter()
            .map(|m| {
                format!(
                    "--- etcd {} ---\n{}",
                    m.name,
                    std::fs::read_to_string(&m.log).unwrap_or_default()
                )
            })
            .collect()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
            let _ = std::fs::remove_dir_all(&self.members[i].dir);
        }
    }
}
