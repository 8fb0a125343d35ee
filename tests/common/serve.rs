//! A serving host agent for the tests, and jobs started under it by the
//! real `mpirun` (Open MPI, Debian's `openmpi-bin`, installed through the
//! project's own script the first time).

use super::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Once;
use std::time::Duration;

/// Installs Debian's `package` through the project's script, once per
/// test process (`once` is the caller's).
fn install_once(once: &'static Once, package: &str) {
    once.call_once(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/system-packages.sh");
        let st = Command::new(script)
            .arg(package)
            .status()
            .expect("run scripts/system-packages.sh");
        assert!(st.success(), "cannot install {package}");
    });
}

/// Installs Open MPI once per test process.
pub fn need_mpirun() {
    static ONCE: Once = Once::new();
    install_once(&ONCE, "openmpi-bin");
}

/// Checks that the serving agent of `dir` left no job's state behind.
pub fn assert_no_job_state(dir: &Path) {
    let state: Vec<_> = std::fs::read_dir(dir.join("run/jobs"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name())
                .filter(|n| n != ".lock")
                .collect()
        })
        .unwrap_or_default();
    assert!(state.is_empty(), "no job state is left: {state:?}");
}

/// `hatrain-agent serve` on a socket and shm root of a temporary folder;
/// dropping it kills it (and anything carrying its tag).
pub struct Serve {
    pub job: Job,
    pub socket: PathBuf,
    pub shm: PathBuf,
}

impl Serve {
    pub fn start(dir: &Path, extra_env: &[(&str, &str)]) -> Self {
        Self::start_with(dir, extra_env, &[])
    }

    pub fn start_with(dir: &Path, extra_env: &[(&str, &str)], args: &[&str]) -> Self {
        let socket = dir.join("run/agent.sock");
        let shm = dir.join("shm");
        let mut cmd = Command::new(agent());
        cmd.arg("serve")
            .arg("--socket")
            .arg(&socket)
            .arg("--shm-root")
            .arg(&shm)
            .args(["--stop-grace-secs", "3"])
            .args(args)
            .env("RUST_LOG", "info")
            .envs(extra_env.iter().copied());
        let job = Job::spawn(cmd, &job_id("serve"));
        assert!(
            wait_until(Duration::from_secs(20), || socket.exists()),
            "the serving agent made no socket"
        );
        Self { job, socket, shm }
    }
}

/// `mpirun -np N hatrain-agent exec [ha] -- hatrain-train ARGS`, against
/// `socket`, as job `job`, with `env` passed to the ranks.
pub fn mpirun(
    n: usize,
    socket: &Path,
    job: &str,
    ha: &[&str],
    train: &[String],
    env: &[(&str, &str)],
) -> Command {
    need_mpirun();
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &n.to_string(),
    ])
    .args([
        "-x",
        "HATRAIN_AGENT_SOCKET",
        "-x",
        "HATRAIN_JOB_ID",
        "-x",
        TAG,
    ]);
    for (k, _) in env {
        c.args(["-x", k]);
    }
    c.arg(agent())
        .arg("exec")
        .args(ha)
        .arg("--")
        .arg(trainer())
        .args(train)
        .env("HATRAIN_AGENT_SOCKET", socket)
        .env("HATRAIN_JOB_ID", job)
        .env("OMP_NUM_THREADS", "1")
        .env("RAYON_NUM_THREADS", "1")
        .envs(env.iter().copied());
    c
}

/// `GET /metrics` from 127.0.0.1:`port`: the status line and the body.
pub fn scrape(port: u16) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("the metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP reply");
    (
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    )
}

/// Runs `promtool check metrics` on `text` (Debian's `prometheus`,
/// installed the first time): what it printed, and whether it passed.
pub fn promtool_check(text: &str) -> (bool, String) {
    use std::io::Write;
    static ONCE: Once = Once::new();
    install_once(&ONCE, "prometheus");
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), said)
}
