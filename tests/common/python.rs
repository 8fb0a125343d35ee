//! The Python side of the tests: the virtual environment with the `hatrain`
//! wheel (built from this checkout), numpy and torch, made by
//! `scripts/python-env.sh` once per test process.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// Runs set-up script `scripts/<name>` (idempotent) and returns the path
/// it prints: the python of the environment it made.
pub fn set_up(name: &str) -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(name);
    // The wheel takes the agent's binaries the tests run (built by cargo
    // for them) instead of building release ones.
    let bins = super::agent();
    let out = Command::new("bash")
        .arg(&script)
        .env(
            "HATRAIN_AGENT_BINS",
            bins.parent().expect("the agent's folder"),
        )
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("run scripts/{name}: {e}"));
    assert!(out.status.success(), "scripts/{name} failed");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// The python of the environment with this checkout's `hatrain` wheel.
pub fn python() -> &'static Path {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| set_up("python-env.sh"))
}

/// A script of `tests/python/`.
pub fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(name)
}

/// An example of the repository (`examples/`).
pub fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(name)
}

/// `hatrain-agent launch` of `nproc` ranks of `python <args>` in `dir`, with
/// worker reboot and step repair on and `extra` flags before `--`.
pub fn launch(nproc: usize, extra: &[&str], args: &[&str], dir: &Path) -> Command {
    let mut flags = vec![
        "--enable-high-availability",
        "--enable-worker-reboot",
        "--enable-hbmfault-repair",
    ];
    flags.extend(extra);
    launch_plain(nproc, &flags, args, dir)
}

/// `hatrain-agent launch` of `nproc` ranks of `python <args>` in `dir`, with
/// only the `extra` flags: without high availability, a worker's exit ends
/// the job, as under torchrun.
pub fn launch_plain(nproc: usize, extra: &[&str], args: &[&str], dir: &Path) -> Command {
    super::launch::Launch::bare(nproc)
        .stop_grace_secs(3)
        .flags(extra)
        .program(python())
        .args(args)
        .current_dir(dir)
        .env_remove("HATRAIN_JOB_ID")
        .env_remove("SLURM_JOB_ID")
        .env_remove("OMP_NUM_THREADS")
        .env("RUST_LOG", "info")
        .command()
}

/// Held by each test of a binary that runs PyTorch jobs: one job at a time
/// (two gloo jobs on a 2-core machine slow each other into timeouts).
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}
