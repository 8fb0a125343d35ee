//! Ascend NPU faults, with no NPU: a stand-in `libdcmi.so` (the
//! `hatrain-dcmi-standin` cdylib, built here) replays recorded DCMI fault
//! events into real training runs under the agent, loaded through the
//! agent's `--dcmi-library`: the same dynamic-loading path as the real
//! library. Device i is local rank i's (no `ASCEND_RT_VISIBLE_DEVICES`).
//!
//! - a UCE (0x80E01801) on device 1: rank 1 repairs the step, no process
//!   restarts, bit-identical; the AI-core bus error that follows it is
//!   dropped and logged;
//! - a RestartNPU code (0x80E18404) on device 0: rank 0 is rebooted in
//!   place, bit-identical (by a subscription, and by polling when the
//!   library refuses the subscription);
//! - a SeparateNPU code (0x80E18402): the job writes its last words and
//!   stops;
//! - a second UCE on one device within the window: escalated, the same;
//! - without the library, `npu-smi`'s readings (a stand-in script printing
//!   recorded output), with `--devices 4,5`: a UCE in device 5's health
//!   reading, then a rise of device 4's ECC double-bit count; local ranks 1
//!   and 0 repair their steps, bit-identical.

mod common;
use common::dcmi::{event, standin};
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const ITERS: u64 = 40;
/// Rank 0 takes its time at this step, so that an event posted once it
/// is reached lands in the middle of the run.
const SLOW_STEP: u64 = 12;

/// What the test does once rank 0 has completed a step.
type Post<'a> = &'a dyn Fn(&Run);

struct Run {
    dir: tempfile::TempDir,
    job: String,
    plan: String,
    /// Flags of the agent's before `--` (the stand-in library by default).
    agent_args: Vec<String>,
}

impl Run {
    fn new(name: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("events")).unwrap();
        Self {
            dir,
            job: job_id(name),
            plan: format!("0:{SLOW_STEP}:forward:sleep1500"),
            agent_args: vec!["--dcmi-library".into(), standin().display().to_string()],
        }
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("run.jsonl")
    }

    fn events(&self) -> PathBuf {
        self.dir.path().join("events")
    }

    fn socket(&self) -> PathBuf {
        self.dir
            .path()
            .join("shm")
            .join(&self.job)
            .join("agent.sock")
    }

    fn ckpt(&self) -> PathBuf {
        self.dir.path().join("ckpt")
    }

    fn command(&self, ha: &[&str], env: &[(&str, &str)]) -> Command {
        let mut train = tiny_args(ITERS);
        train.extend(["--log-jsonl".into(), self.log().display().to_string()]);
        train.extend(["--save".into(), self.ckpt().display().to_string()]);
        train.extend(["--save-interval".into(), "10".into()]);
        let mut launch = Launch::new(2)
            .job(&self.job)
            .option("--snapshot-slots", "3")
            .flags(ha)
            .shm_root(self.dir.path().join("shm"))
            .flags(&self.agent_args)
            .args(train)
            .env("DCMI_STANDIN_DIR", self.events())
            .fault_plan(&self.plan)
            .env_remove("ASCEND_RT_VISIBLE_DEVICES")
            .env_remove("DCMI_STANDIN_SUBSCRIBE")
            .env_remove("HIGH_AVAILABILITY");
        for (k, v) in env {
            launch = launch.env(k, v);
        }
        launch.command()
    }

    /// Waits until rank 0 has completed `step`.
    fn wait_step(&self, job: &mut Job, step: u64) {
        let end = Instant::now() + Duration::from_secs(120);
        loop {
            let done = read_log(&self.log())
                .iter()
                .any(|e| e["event"] == "step" && e["step"].as_u64().is_some_and(|s| s >= step));
            if done {
                return;
            }
            let exited = job.child.as_mut().unwrap().try_wait().unwrap();
            assert!(exited.is_none(), "the job ended before step {step}");
            assert!(Instant::now() < end, "no step {step}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Posts recorded events for the stand-in to deliver.
    fn post(&self, name: &str, events: &[serde_json::Value]) {
        common::dcmi::post(&self.events(), name, events);
    }

    /// Runs with `ha`, posting `events` in turn at the given steps of
    /// rank 0.
    fn run(&self, ha: &[&str], env: &[(&str, &str)], events: &[(u64, Post<'_>)]) -> Output {
        let mut job = Job::spawn(self.command(ha, env), &self.job);
        for (step, post) in events {
            self.wait_step(&mut job, *step);
            post(self);
        }
        let out = job.wait_output(Duration::from_secs(180));
        assert!(job_pids(&self.job).is_empty());
        out
    }
}

fn reference() -> String {
    static SUM: OnceLock<String> = OnceLock::new();
    SUM.get_or_init(|| {
        let r = Run::new("npu-ref");
        let out = r.run(&["--enable-high-availability"], &[], &[]);
        assert_success(&out, "reference run");
        final_checksum(&read_log(&r.log()))
    })
    .clone()
}

fn started(stderr: &str) -> usize {
    stderr
        .lines()
        .filter(|l| l.contains("worker started"))
        .count()
}

#[test]
fn a_dcmi_uce_is_repaired_in_place_and_its_side_effect_is_dropped() {
    let want = reference();
    let mut r = Run::new("npu-uce");
    // Rank 0 takes its time at step 30 too, while agentctl is asked.
    r.plan = format!("0:{SLOW_STEP}:forward:sleep1500;0:30:forward:sleep4000");
    let shown = std::cell::RefCell::new(None);
    let ask = |r: &Run| {
        *shown.borrow_mut() = poll_agentctl(&r.socket(), "faults", Duration::from_secs(3), |v| {
            let d = v["device_faults"].as_array()?;
            (d.len() >= 2).then(|| d.clone())
        });
    };
    let post = |r: &Run| {
        r.post(
            "001",
            &[
                event(0x80E0_1801, 1, 100_000, "multi-bit ecc error on hbm access"),
                event(0x80C9_8009, 1, 102_000, "aicore bus error"),
            ],
        )
    };
    let ha = ["--enable-high-availability", "--enable-hbmfault-repair"];
    let out = r.run(&ha, &[], &[(SLOW_STEP - 1, &post), (29, &ask)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_success(&out, "run with a DCMI UCE");
    // agentctl faults shows both reports, with their codes, classes and
    // what was done.
    let shown = shown
        .take()
        .unwrap_or_else(|| panic!("agentctl faults showed no device faults: {stderr}"));
    assert_eq!(shown[0]["code"], 0x80E0_1801u32, "{shown:?}");
    assert_eq!(shown[0]["class"], "RestartBusiness");
    assert_eq!(shown[0]["action"], "uce");
    assert_eq!(shown[0]["ranks"], serde_json::json!([1]));
    assert_eq!(shown[1]["code"], 0x80C9_8009u32);
    assert_eq!(shown[1]["action"], "dropped");
    assert!(
        stderr.contains("watching Ascend NPU fault events (DCMI subscription)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("device fault source=\"dcmi\" device=1 rank=1 code=\"0x80E01801\" class=\"RestartBusiness\" action=uce"),
        "{stderr}"
    );
    assert!(stderr.contains("UCE: step repair rank=1"), "{stderr}");
    assert!(
        stderr.contains("code=\"0x80C98009\"")
            && stderr.contains("a side effect of a UCE on the same device"),
        "the bus error is dropped and logged: {stderr}"
    );
    assert_eq!(started(&stderr), 2, "no process restarted: {stderr}");
    assert_eq!(
        final_checksum(&read_log(&r.log())),
        want,
        "not bit-identical"
    );
}

#[test]
fn a_restart_npu_code_reboots_its_rank_in_place_by_subscription_or_by_polling() {
    let want = reference();
    for polled in [false, true] {
        let r = Run::new("npu-restart");
        let post = |r: &Run| {
            if polled {
                // The device's error codes now hold the code.
                std::fs::write(r.events().join("device-0.codes"), "80E18404").unwrap();
                std::fs::write(r.events().join("device-0.health"), "2").unwrap();
            } else {
                r.post(
                    "001",
                    &[event(0x80E1_8404, 0, 100_000, "uce storm shielding")],
                );
            }
        };
        let env: &[(&str, &str)] = if polled {
            &[("DCMI_STANDIN_SUBSCRIBE", "fail")]
        } else {
            &[]
        };
        let ha = ["--enable-high-availability", "--enable-worker-reboot"];
        let out = r.run(&ha, env, &[(SLOW_STEP - 1, &post)]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_success(&out, "run with a RestartNPU code");
        if polled {
            assert!(
                stderr.contains("polling error codes and health every second"),
                "{stderr}"
            );
        }
        assert!(
            stderr.contains("code=\"0x80E18404\" class=\"RestartNPU\" action=crash"),
            "{stderr}"
        );
        assert!(
            stderr.contains("device fault (crash): killing rank 0"),
            "{stderr}"
        );
        assert!(stderr.contains("restarting it in place"), "{stderr}");
        assert_eq!(started(&stderr), 3, "only rank 0 restarted: {stderr}");
        assert_eq!(
            final_checksum(&read_log(&r.log())),
            want,
            "not bit-identical ({polled})"
        );
    }
}

fn tracker(ckpt: &Path) -> Option<u64> {
    std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[test]
fn a_separate_npu_code_or_a_repeated_uce_ends_with_last_words() {
    // SeparateNPU: the chip is to be isolated.
    let r = Run::new("npu-separate");
    let post = |r: &Run| {
        r.post(
            "001",
            &[event(
                0x80E1_8402,
                1,
                100_000,
                "hbm isolated lines reached 64",
            )],
        )
    };
    let ha = [
        "--enable-high-availability",
        "--enable-worker-reboot",
        "--enable-hbmfault-repair",
    ];
    let out = r.run(&ha, &[], &[(SLOW_STEP - 1, &post)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("class=\"SeparateNPU\" action=host"),
        "{stderr}"
    );
    assert!(stderr.contains("device lost"), "{stderr}");
    let it = tracker(&r.ckpt()).unwrap_or(0);
    assert!(
        (SLOW_STEP - 1..ITERS).contains(&it),
        "the last words hold a step after the fault was seen, not the save of step 10: {it}\n{stderr}"
    );

    // A UCE, repaired; a second on the same device within the window:
    // escalated to the host, and the same end.
    let r = Run::new("npu-repeat");
    let first = |r: &Run| r.post("001", &[event(0x80E0_1801, 1, 100_000, "multi-bit ecc")]);
    let second = |r: &Run| r.post("002", &[event(0x80E0_1801, 1, 160_000, "multi-bit ecc")]);
    let out = r.run(
        &ha,
        &[],
        &[(SLOW_STEP - 1, &first), (SLOW_STEP + 6, &second)],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("UCE: step repair rank=1"), "{stderr}");
    assert!(
        stderr.contains("class=\"ManuallySeparateNPU\" action=host")
            && stderr.contains("UCE number 2 on this device"),
        "{stderr}"
    );
    assert!(stderr.contains("device lost"), "{stderr}");
    assert!(
        tracker(&r.ckpt()).is_some_and(|it| it > SLOW_STEP),
        "{stderr}"
    );
}

#[test]
fn without_the_library_npu_smi_readings_are_polled_and_devices_map_by_the_launch_list() {
    let want = reference();
    let mut r = Run::new("npu-smi");
    // npu-smi: `info -t health|ecc -i N [-c 0]` prints `health-N.txt` or
    // `ecc-N.txt` of the events folder, else a healthy reading or a zero
    // double-bit count.
    let smi = r.dir.path().join("npu-smi");
    std::fs::write(
        &smi,
        "#!/bin/sh\nf=\"$FAKE_NPU_SMI_DIR/$3-$5.txt\"\n\
         if [ -f \"$f\" ]; then cat \"$f\"\n\
         elif [ \"$3\" = ecc ]; then printf '\\tHBM Double Bit Error Count : 0\\n'\n\
         else printf '\\tHealth Status : OK\\n\\tError Code : NA\\n\\tError Information : NA\\n'; fi\n",
    )
    .unwrap();
    std::fs::set_permissions(&smi, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    r.agent_args = vec![
        "--dcmi-library".into(),
        r.dir.path().join("absent/libdcmi.so").display().to_string(),
        "--npu-smi".into(),
        smi.display().to_string(),
        "--devices".into(),
        "4,5".into(),
    ];
    r.plan = format!("0:{SLOW_STEP}:forward:sleep1500;0:22:forward:sleep2500");
    let put = |r: &Run, name: &str, text: &str| {
        // Written whole, then renamed into place.
        let tmp = r.events().join("reading.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, r.events().join(name)).unwrap();
    };
    // Device 5 (local rank 1): a health reading with the UCE and its side
    // effect. Device 4 (local rank 0), later: its ECC listing's double-bit
    // count rises, while its health reading stays healthy.
    let uce = |r: &Run| {
        put(
            r,
            "health-5.txt",
            include_str!("../shared/src/npu/fixtures/health-uce.txt"),
        )
    };
    let rise = |r: &Run| {
        put(
            r,
            "ecc-4.txt",
            include_str!("../shared/src/npu/fixtures/ecc.txt"),
        )
    };
    let ha = ["--enable-high-availability", "--enable-hbmfault-repair"];
    let events = r.events();
    let out = r.run(
        &ha,
        &[("FAKE_NPU_SMI_DIR", events.to_str().unwrap())],
        &[(SLOW_STEP - 1, &uce), (21, &rise)],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_success(&out, "run with npu-smi UCE readings");
    assert!(stderr.contains("DCMI library not loaded"), "{stderr}");
    assert!(
        stderr.contains("watching Ascend NPU health with npu-smi every second devices=[4, 5]"),
        "{stderr}"
    );
    assert!(
        stderr.contains("device fault source=\"npu-smi\" device=5 rank=1 code=\"0x80E01801\""),
        "{stderr}"
    );
    assert!(stderr.contains("UCE: step repair rank=1"), "{stderr}");
    assert!(
        stderr.contains("a side effect of a UCE on the same device"),
        "{stderr}"
    );
    assert!(
        stderr.contains("device fault source=\"npu-smi\" device=4 rank=0 code=\"0x80E01801\"")
            && stderr.contains("HBM double-bit error count rose from 0 to 1")
            && stderr.contains("UCE: step repair rank=0"),
        "{stderr}"
    );
    assert_eq!(started(&stderr), 2, "no process restarted: {stderr}");
    assert_eq!(
        final_checksum(&read_log(&r.log())),
        want,
        "not bit-identical"
    );
}
