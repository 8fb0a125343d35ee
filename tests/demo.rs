//! The main job end to end, shortened: `hatrain-demo` on the tiny
//! model runs three real agents (reference; faults and SIGTERM; resume
//! from the last-words checkpoint), and must end bit-identical, with its
//! loss curve drawn and nothing left running; then three hosts and a
//! standby on loopback, one host lost and recovered on the standby,
//! bit-identical to one host of six ranks.

mod common;
use common::*;
use std::process::Command;
use std::time::Duration;

#[test]
fn demo_repairs_every_fault_and_resumes_from_its_last_words() {
    let d = tempfile::tempdir().unwrap();
    let (work, shm) = (d.path().join("demo"), d.path().join("shm"));
    let mut cmd = Command::new(bin("hatrain-demo"));
    cmd.args(["--steps", "60", "--save-interval", "20"])
        .args(["--model-size", "tiny"])
        .arg("--workdir")
        .arg(&work)
        .arg("--shm-root")
        .arg(&shm)
        .env_remove("HIGH_AVAILABILITY")
        .env_remove("HATRAIN_FAULT_PLAN")
        .env("RAYON_NUM_THREADS", "1");
    let mut guard = Job::spawn(cmd, "demo-unused");
    let pid = guard.pid();
    let out = guard.wait_output(Duration::from_secs(300));
    assert_success(&out, "demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("faults planned 5, handled 5"), "{stdout}");
    let it =
        std::fs::read_to_string(work.join("faulty/checkpoints/latest_checkpointed_iteration.txt"))
            .unwrap();
    let it: u64 = it.trim().parse().unwrap();
    assert!(
        stdout.contains(&format!("resumed from iteration {it}: final weights"))
            && stdout.contains("bit-identical")
            && stdout.contains("(agent exit 143)"),
        "{stdout}"
    );
    assert!((55..=60).contains(&it), "last words at {it}");
    assert!(
        stdout.contains("restart ranks [2, 3] on standby host 3; recovered from step")
            && stdout.contains(
                "host loss: every step's loss and the final weights equal to one host of six ranks: yes"
            ),
        "the host lost is recovered on the standby, bit-identical:\n{stdout}"
    );
    let png = std::fs::read(work.join("loss.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    for name in ["reference", "faulty", "resumed"] {
        assert!(
            job_pids(&format!("demo-{name}-{pid}")).is_empty(),
            "{name} left processes"
        );
    }
    assert_eq!(
        std::fs::read_dir(&shm).map_or(0, |d| d.count()),
        0,
        "shared memory left"
    );
}
