//! A serving host agent for the tests, and jobs started under it by the
//! real `mpirun` (Open MPI, Debian's `openmpi-bin`, installed through the
//! project's own script the first time).

use super::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Once;
use std::time::Duration;

/// Installs Open MPI once per test process.
pub fn need_mpirun() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/system-packages.sh");
        let st = Command::new(script)
            .arg("openmpi-bin")
            .status()
            .expect("run scripts/system-packages.sh");
        assert!(st.success(), "cannot install openmpi-bin");
    });
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
        let socket = dir.join("run/agent.sock");
        let shm = dir.join("shm");
        let mut cmd = Command::new(agent());
        cmd.arg("serve")
            .arg("--socket")
            .arg(&socket)
            .arg("--shm-root")
            .arg(&shm)
            .args(["--stop-grace-secs", "3"])
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
