//! One install for a PyTorch user: the wheel `scripts/python-env.sh` builds,
//! installed alone into a fresh virtual environment, puts `hatrain-agent`
//! and `agentctl` on that environment's `PATH`, and the agent it gives
//! launches and protects `examples/torch_ddp.py` (a rank SIGKILLed and
//! restarted in place; the job ends with both ranks bit-identical).

mod common;

use common::examples::{events, final_digest};
use common::python::{example, python, serial};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The wheel the tests' environment was installed from.
fn wheel() -> PathBuf {
    python();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/python/wheels");
    let mut wheels: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    assert_eq!(
        wheels.len(),
        1,
        "one wheel in {}: {wheels:?}",
        dir.display()
    );
    wheels.pop().unwrap()
}

/// Runs `cmd` to success, returning its output.
fn ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = common::text(&out);
    assert!(out.status.success(), "{cmd:?}: {text}");
    text
}

#[test]
fn the_wheel_alone_installs_an_agent_that_protects_a_pytorch_job() {
    let _one_at_a_time = serial();
    let wheel = wheel();
    let dir = tempfile::tempdir().unwrap();
    // A fresh environment: torch and numpy come from the machine's torch
    // environment (as a user's would be installed already), hatrain only
    // from the wheel.
    let venv = dir.path().join("venv");
    let torch_python = common::python::set_up("torch-venv.sh");
    ok(Command::new(&torch_python).args(["-m", "venv"]).arg(&venv));
    let site = ok(Command::new(venv.join("bin/python")).args([
        "-c",
        "import sysconfig; print(sysconfig.get_path('purelib'))",
    ]));
    let torch_site = ok(Command::new(&torch_python).args([
        "-c",
        "import sysconfig; print(sysconfig.get_path('purelib'))",
    ]));
    std::fs::write(
        Path::new(site.trim()).join("torch-site.pth"),
        torch_site.trim(),
    )
    .unwrap();
    ok(Command::new(venv.join("bin/python"))
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--disable-pip-version-check",
        ])
        .arg(&wheel));

    // Only the environment's bin/ and the system's on PATH.
    let path = format!("{}:/usr/bin:/bin", venv.join("bin").display());
    let version = ok(Command::new("agentctl").arg("--version").env("PATH", &path));
    assert!(version.starts_with("agentctl "), "{version}");

    let run = |plan: Option<&str>| {
        let out_dir = tempfile::tempdir_in(dir.path()).unwrap();
        let log = out_dir.path().join("log.{rank}.jsonl");
        let mut cmd = Command::new("hatrain-agent");
        cmd.env("PATH", &path)
            .env_remove("HATRAIN_JOB_ID")
            .env_remove("SLURM_JOB_ID")
            .env_remove("OMP_NUM_THREADS")
            .env_remove("HATRAIN_FAULT_PLAN")
            .current_dir(out_dir.path())
            .args([
                "launch",
                "--nproc-per-node",
                "2",
                "--stop-grace-secs",
                "3",
                "--enable-high-availability",
                "--enable-worker-reboot",
                "--",
                "python",
            ])
            .arg(example("torch_ddp.py"))
            .args(["--steps", "12", "--log-jsonl"])
            .arg(&log);
        if let Some(p) = plan {
            cmd.env("HATRAIN_FAULT_PLAN", p);
        }
        let tag = common::job_id("wheel");
        let out = common::Job::spawn(cmd, &tag).wait_output(std::time::Duration::from_secs(300));
        let output = common::text(&out);
        assert!(out.status.success(), "{plan:?}: {output}");
        let logs: Vec<_> = (0..2)
            .map(|r| common::read_log(&out_dir.path().join(format!("log.{r}.jsonl"))))
            .collect();
        (logs, output)
    };
    let (clean, _) = run(None);
    let want = final_digest(&clean[0], 12);
    let (logs, output) = run(Some("1:5:update:kill:0"));
    // Rank 1 was killed and started again by the wheel's agent, and the
    // job ends as the run without the fault did.
    assert_eq!(events(&logs[1], "start").len(), 2, "{output}");
    for log in &logs {
        assert_eq!(final_digest(log, 12), want, "{output}");
    }
}
