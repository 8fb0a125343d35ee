//! A one-node Slurm cluster for a test (Debian's `slurm-wlm` and `munge`,
//! installed through the project's own script the first time): munged (when
//! none runs), slurmctld and slurmd on ports of their own, with their
//! configuration, state and logs in a temporary folder. Dropping it stops
//! what it started, by pid.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

pub struct Slurm {
    dir: tempfile::TempDir,
    conf: PathBuf,
    /// Pid files of the daemons started here.
    pidfiles: Vec<PathBuf>,
}

fn pid_in(file: &Path) -> Option<i32> {
    std::fs::read_to_string(file).ok()?.trim().parse().ok()
}

fn run(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Slurm {
    pub fn start() -> Self {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/system-packages.sh");
        run(
            Command::new(script).args(["slurm-wlm", "munge"]),
            "install slurm-wlm and munge",
        );
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let mut pidfiles = Vec::new();
        // munged: one per host, shared; started here only when none runs.
        let running = Command::new("pgrep")
            .args(["-x", "munged"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !running {
            std::fs::create_dir_all("/run/munge").unwrap();
            run(
                Command::new("chown").args(["munge:munge", "/run/munge"]),
                "chown /run/munge",
            );
            // Its pid file goes where the munge user may write.
            run(
                Command::new("runuser").args(["-u", "munge", "--", "/usr/sbin/munged"]),
                "munged",
            );
            pidfiles.push(PathBuf::from("/run/munge/munged.pid"));
        }
        let host = String::from_utf8(Command::new("hostname").arg("-s").output().unwrap().stdout)
            .unwrap()
            .trim()
            .to_string();
        for sub in ["spool", "state", "log"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        let (ctld_pid, slurmd_pid) = (d.join("slurmctld.pid"), d.join("slurmd.pid"));
        let conf = d.join("slurm.conf");
        let ports = super::ports::free_ports::<2>();
        let text = format!(
            "ClusterName=hatrain\nSlurmctldHost={host}\nSlurmUser=root\nSlurmctldPort={}\nSlurmdPort={}\n\
             AuthType=auth/munge\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n\
             JobAcctGatherType=jobacct_gather/none\nSelectType=select/cons_tres\nReturnToService=2\n\
             SlurmctldPidFile={}\nSlurmdPidFile={}\nSlurmdSpoolDir={}\nStateSaveLocation={}\n\
             SlurmctldLogFile={}\nSlurmdLogFile={}\n\
             NodeName={host} CPUs=2 State=UNKNOWN\nPartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n",
            ports[0],
            ports[1],
            ctld_pid.display(),
            slurmd_pid.display(),
            d.join("spool").display(),
            d.join("state").display(),
            d.join("log/slurmctld.log").display(),
            d.join("log/slurmd.log").display(),
        );
        std::fs::write(&conf, text).unwrap();
        let mut s = Self {
            dir,
            conf,
            pidfiles,
        };
        run(
            Command::new("slurmctld").arg("-i").arg("-f").arg(&s.conf),
            "slurmctld",
        );
        s.pidfiles.push(ctld_pid);
        run(
            Command::new("slurmd")
                .args(["-N", &host, "-f"])
                .arg(&s.conf),
            "slurmd",
        );
        s.pidfiles.push(slurmd_pid);
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            let state = Command::new("sinfo")
                .args(["-h", "-o", "%T"])
                .env("SLURM_CONF", &s.conf)
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
                .unwrap_or_default();
            if state == "idle" {
                break;
            }
            assert!(
                Instant::now() < end,
                "the Slurm node is not idle ({state:?}); logs in {}",
                s.dir.path().join("log").display()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        s
    }

    /// `srun` against this cluster.
    pub fn srun(&self) -> Command {
        let mut c = Command::new("srun");
        c.env("SLURM_CONF", &self.conf);
        c
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        for file in self.pidfiles.iter().rev() {
            if let Some(pid) = pid_in(file) {
                super::kill(pid, libc::SIGTERM);
                let end = Instant::now() + Duration::from_secs(10);
                while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < end {
                    std::thread::sleep(Duration::from_millis(50));
                }
                super::kill(pid, libc::SIGKILL);
            }
        }
    }
}
