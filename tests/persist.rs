//! The agent-side periodic save: the agent writes `--save-interval`
//! checkpoints from the held snapshots, off the training path; they are the
//! very bytes the trainer's own collective save writes, also when workers
//! are killed and rebooted meanwhile, and the foundation's loader reads them
//! at the same and at another world size. In a job of two hosts each
//! agent writes its ranks' share and the controller commits a step only
//! once every rank's directory is written.

mod common;
use common::hosts::*;
use common::*;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const ITERS: u64 = 40;
const INTERVAL: u64 = 10;

fn train(log: &Path, extra: &[&str]) -> Vec<String> {
    let mut a = tiny_args(ITERS);
    a.extend(["--log-jsonl".into(), log.display().to_string()]);
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// [`train`] saving every [`INTERVAL`] steps into `ckpt`.
fn saving(log: &Path, ckpt: &Path) -> Vec<String> {
    let interval = INTERVAL.to_string();
    train(
        log,
        &[
            "--save",
            ckpt.to_str().unwrap(),
            "--save-interval",
            &interval,
        ],
    )
}

/// A 4-rank launch with extra agent flags and an optional fault plan.
fn launch(job: &str, agent_flags: &[&str], train: &[String], plan: Option<&str>) -> Command {
    let launch = Launch::new(4)
        .job(job)
        .flags(agent_flags)
        .args(train)
        .env_remove("HIGH_AVAILABILITY");
    match plan {
        Some(p) => launch.fault_plan(p),
        None => launch.no_fault_plan(),
    }
    .command()
}

fn run(name: &str, cmd: impl FnOnce(&str) -> Command) -> (String, String) {
    let job = job_id(name);
    let out = Job::spawn(cmd(&job), &job).wait_output(Duration::from_secs(300));
    assert_success(&out, name);
    assert!(job_pids(&job).is_empty(), "{name}: processes left behind");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn iterations(ckpt: &Path) -> BTreeSet<u64> {
    std::fs::read_dir(ckpt)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().ok()?;
            name.strip_prefix("iter_")?.parse().ok()
        })
        .collect()
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(files(&p));
        } else {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// Two checkpoints of one iteration hold the same bytes: every tensor file
/// identical, and `meta.json` identical but for the recorded `--save` and log paths.
fn assert_same_checkpoint(a: &Path, b: &Path) {
    let (fa, fb) = (files(a), files(b));
    let rel = |root: &Path, f: &[PathBuf]| -> Vec<PathBuf> {
        f.iter()
            .map(|p| p.strip_prefix(root).unwrap().to_path_buf())
            .collect()
    };
    assert_eq!(
        rel(a, &fa),
        rel(b, &fb),
        "{} vs {}",
        a.display(),
        b.display()
    );
    assert!(
        fa.iter()
            .any(|p| p.extension().is_some_and(|e| e == "safetensors"))
    );
    for (x, y) in fa.iter().zip(&fb) {
        let (bx, by) = (std::fs::read(x).unwrap(), std::fs::read(y).unwrap());
        if x.file_name().is_some_and(|n| n == "meta.json") {
            let mut jx: serde_json::Value = serde_json::from_slice(&bx).unwrap();
            let mut jy: serde_json::Value = serde_json::from_slice(&by).unwrap();
            for key in ["save", "log_jsonl"] {
                jx["args"][key] = serde_json::Value::Null;
                jy["args"][key] = serde_json::Value::Null;
            }
            assert_eq!(jx, jy, "{}", x.display());
        } else {
            assert!(bx == by, "{} differs from {}", x.display(), y.display());
        }
    }
}

/// Copies `iteration` of `from` into a fresh directory whose tracker names
/// it: how a user resumes from an older checkpoint.
fn only(from: &Path, iteration: u64, to: &Path) {
    let name = format!("iter_{iteration:07}");
    for f in files(&from.join(&name)) {
        let dst = to
            .join(&name)
            .join(f.strip_prefix(from.join(&name)).unwrap());
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(&f, &dst).unwrap();
    }
    std::fs::write(
        to.join("latest_checkpointed_iteration.txt"),
        format!("{iteration}\n"),
    )
    .unwrap();
}

#[test]
fn agent_saves_are_the_trainers_bytes_and_load_at_any_world_size() {
    let d = tempfile::tempdir().unwrap();
    let p = |n: &str| d.path().join(n);

    // The trainer saves for itself, no faults.
    let (ref_log, ref_ckpt) = (p("ref.jsonl"), p("ref-ckpt"));
    let ref_args = saving(&ref_log, &ref_ckpt);
    let (out, _) = run("persist-ref", |job| {
        launch(job, &["--trainer-saves"], &ref_args, None)
    });
    assert!(out.contains("saved iteration 10"), "{out}");
    assert_eq!(iterations(&ref_ckpt), BTreeSet::from([10, 20, 30, 40]));
    let reference = read_log(&ref_log);

    // The agent saves, while two workers are killed and rebooted in place.
    let (log, ckpt) = (p("agent.jsonl"), p("agent-ckpt"));
    let args = saving(&log, &ckpt);
    let (out, err) = run("persist-agent", |job| {
        launch(
            job,
            &[
                "--enable-high-availability",
                "--enable-worker-reboot",
                "--snapshot-slots",
                "3",
            ],
            &args,
            Some("2:15:update:kill;1:23:commit:kill"),
        )
    });
    assert!(out.contains("written by the agent"), "{out}");
    assert!(!out.contains("saved iteration"), "the trainer saved: {out}");
    assert_eq!(err.matches("replacement started").count(), 2, "{err}");
    let run = read_log(&log);
    assert_eq!(final_checksum(&reference), final_checksum(&run));

    // Every save step is on disk, or the agent said it skipped it because
    // the disk was busy; the final step always is.
    let written = iterations(&ckpt);
    assert!(written.contains(&ITERS), "{written:?}");
    for it in (INTERVAL..ITERS).step_by(INTERVAL as usize) {
        assert!(
            written.contains(&it) || err.contains("skipping to the newest held step"),
            "iteration {it} neither written nor said skipped: {written:?}\n{err}"
        );
    }
    assert!(written.iter().all(|it| it % INTERVAL == 0), "{written:?}");
    for &it in &written {
        let name = format!("iter_{it:07}");
        assert_same_checkpoint(&ckpt.join(&name), &ref_ckpt.join(&name));
    }
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt")).unwrap(),
        format!("{ITERS}\n")
    );

    // The oldest agent-written iteration resumes to the reference's
    // weights at the same world size, and loads at world size 2.
    let first = *written.iter().next().unwrap();
    let older = p("older");
    only(&ckpt, first, &older);
    for (nproc, name) in [(4, "same"), (2, "half")] {
        let log = p(&format!("resume-{name}.jsonl"));
        let args = train(&log, &["--load", older.to_str().unwrap()]);
        assert_success(&run_launch(nproc, "persist-resume", &args), name);
        let b = read_log(&log);
        assert_eq!(b[0]["resumed_from"], first);
        assert_eq!(b[0]["start_step"], first);
        let l = losses(&b);
        assert_eq!(l.last().unwrap().0, ITERS);
        if nproc == 4 {
            assert_eq!(final_checksum(&reference), final_checksum(&b));
            let want = final_losses(&reference);
            for (step, loss) in l {
                assert_eq!(loss.to_bits(), want[&step].to_bits(), "loss of step {step}");
            }
        } else {
            assert!(l.iter().all(|(_, x)| x.is_finite()));
            assert!(l.last().unwrap().1 < l[0].1 + 0.05, "{l:?}");
        }
    }
}

/// A job of two hosts of two ranks: each agent writes its ranks' share of
/// every save step, and the controller commits a step only once every
/// rank's directory is written. Host 1's share of iteration 20 cannot be
/// written (a file stands where rank 2's directory goes): 20 is never
/// committed, and goes once a newer step is; every committed iteration is
/// the bytes the trainer's own save writes at one host of four ranks.
#[test]
fn hosts_write_their_shares_and_a_step_is_committed_only_once_every_rank_is_written() {
    let d = tempfile::tempdir().unwrap();
    let p = |n: &str| d.path().join(n);
    let interval = INTERVAL.to_string();
    let (ref_log, ref_ckpt) = (p("ref.jsonl"), p("ref-ckpt"));
    let ref_args = saving(&ref_log, &ref_ckpt);
    run("shares-ref", |job| {
        launch(job, &["--trainer-saves"], &ref_args, None)
    });
    let reference = read_log(&ref_log);

    let ckpt = p("ckpt");
    let tmp20 = hatrain_shared::checkpoint::tmp_iter_dir(&ckpt, 20);
    std::fs::create_dir_all(&tmp20).unwrap();
    std::fs::write(
        hatrain_shared::checkpoint::rank_dir(&tmp20, 2),
        "in the way",
    )
    .unwrap();
    let mut base = tiny_args(ITERS);
    base.extend(s(&[
        "--save",
        ckpt.to_str().unwrap(),
        "--save-interval",
        &interval,
    ]));
    let parts = job_parts(d.path(), "shares", 2, &base);
    let mut hosts: Vec<Job> = (0..2)
        .map(|k| {
            let mut c = reboot_node(
                k,
                2,
                2,
                &parts.shm[k],
                &parts.job,
                parts.ports,
                &parts.secret,
                &parts.args,
                &["--snapshot-slots", "3"],
            );
            c.env_remove("HATRAIN_FAULT_PLAN");
            host_job(c, &parts.job, k)
        })
        .collect();
    let outs: Vec<std::process::Output> = hosts
        .iter_mut()
        .map(|h| h.wait_output(Duration::from_secs(300)))
        .collect();
    let err = |k: usize| String::from_utf8_lossy(&outs[k].stderr).into_owned();
    for (k, out) in outs.iter().enumerate() {
        assert_success(out, &format!("host {k}"));
        assert_nothing_left(&parts.shm[k]);
    }
    let out = String::from_utf8_lossy(&outs[0].stdout);
    assert!(out.contains("written by the agent"), "{out}");
    assert!(!out.contains("saved iteration"), "the trainer saved: {out}");
    assert_eq!(
        final_checksum(&read_log(&parts.log)),
        final_checksum(&reference)
    );

    let (controller, blocked) = (err(0), err(1));
    assert!(
        blocked.contains("this host's share of a checkpoint") && blocked.contains("step=20"),
        "host 1 says its share of 20 failed:\n{blocked}"
    );
    assert!(
        controller.contains("a host's share of a checkpoint failed")
            && controller.contains("checkpoint committed: every host wrote its share"),
        "{controller}"
    );
    let written = iterations(&ckpt);
    assert!(
        !written.contains(&20),
        "20 is committed without rank 2: {written:?}"
    );
    assert!(written.contains(&ITERS), "{written:?}");
    let skipped = |k: usize| err(k).contains("skipping to the newest held step");
    for it in [10, 30] {
        assert!(
            written.contains(&it) || skipped(0) || skipped(1),
            "iteration {it} neither written nor said skipped: {written:?}\n{}",
            saves_said(&[err(0), err(1)])
        );
    }
    for &it in &written {
        let name = format!("iter_{it:07}");
        assert_same_checkpoint(&ckpt.join(&name), &ref_ckpt.join(&name));
    }
    assert!(
        !tmp20.exists() || skipped(0),
        "the uncommitted iteration 20 is left in {}",
        tmp20.display()
    );
}

/// What the hosts' logs say about checkpoints and their shares.
fn saves_said(logs: &[String]) -> String {
    logs.iter()
        .enumerate()
        .flat_map(|(k, log)| {
            log.lines()
                .filter(|l| l.contains("checkpoint") || l.contains("share"))
                .map(move |l| format!("host {k}: {l}"))
                .collect::<Vec<_>>()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Python processes that each open `n` connections to `socket` and hold
/// them until killed (what they could not open, they leave).
fn hold_connections(socket: &Path, n: usize) -> std::process::Child {
    let script = r#"
import socket, sys, time
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sys.argv[1])
        held.append(s)
    except OSError:
        s.close()
print(len(held), flush=True)
time.sleep(600)
"#;
    Command::new("python3")
        .args(["-c", script])
        .arg(socket)
        .arg(n.to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 starts")
}

/// CPU seconds (user and system) process `pid` has used.
fn cpu_seconds(pid: i32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split(' ').collect();
    // SAFETY: sysconf(3) reads a constant of the system; no memory.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / ticks
}

/// Clients of the agent's own user hold more connections to its control
/// socket than its descriptor limit (four processes of 150, against a hard
/// limit of 256) while the job saves every 10 steps: every checkpoint is
/// written, the agent spends little CPU meanwhile (no accept loop spinning
/// on EMFILE), and once they close, `status` is answered.
#[test]
fn held_control_connections_past_the_descriptor_limit_lose_no_checkpoint() {
    use std::os::unix::process::CommandExt;
    let d = tempfile::tempdir().unwrap();
    let (log, ckpt, shm) = (
        d.path().join("run.jsonl"),
        d.path().join("ckpt"),
        d.path().join("shm"),
    );
    let args = saving(&log, &ckpt);
    let job = job_id("fdhold");
    let shm_root = shm.display().to_string();
    // Rank 0 naps in steps 12 and 25, so that the job lasts while the
    // clients hold their connections.
    let mut cmd = launch(
        &job,
        &[
            "--enable-high-availability",
            "--enable-worker-reboot",
            "--shm-root",
            &shm_root,
        ],
        &args,
        Some("0:12:forward:sleep3000;0:25:forward:sleep3000"),
    );
    // SAFETY: setrlimit(2) only, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, 256, 256)
                .map_err(std::io::Error::from)
        });
    }
    let mut agent = Job::spawn(cmd, &job);
    let socket = shm.join(&job).join("agent.sock");
    assert!(
        wait_until(Duration::from_secs(60), || socket.exists()),
        "the agent's socket appears"
    );
    let mut holders: Vec<std::process::Child> =
        (0..4).map(|_| hold_connections(&socket, 150)).collect();
    for h in &mut holders {
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(h.stdout.as_mut().unwrap()),
            &mut line,
        )
        .unwrap();
    }
    let before = cpu_seconds(agent.pid());
    std::thread::sleep(Duration::from_secs(3));
    let used = cpu_seconds(agent.pid()) - before;
    for h in &mut holders {
        let _ = h.kill();
        let _ = h.wait();
    }
    let answered = poll_agentctl(&socket, "status", Duration::from_secs(30), |_| Some(()));
    let out = agent.wait_output(Duration::from_secs(300));
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_success(&out, "the job whose socket was crowded");
    assert!(
        used < 1.5,
        "the agent used {used:.2} s of CPU in 3 s while clients held its socket:\n{err}"
    );
    assert!(
        answered.is_some(),
        "status is answered once the clients close"
    );
    assert!(!err.contains("os error 24"), "out of descriptors:\n{err}");
    let written = iterations(&ckpt);
    for it in (INTERVAL..=ITERS).step_by(INTERVAL as usize) {
        assert!(
            written.contains(&it) || err.contains("skipping to the newest held step"),
            "iteration {it} neither written nor said skipped: {written:?}\n{err}"
        );
    }
    assert!(written.contains(&ITERS), "{written:?}\n{err}");
    assert!(job_pids(&job).is_empty(), "processes left behind");
}
