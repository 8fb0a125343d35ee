//! A network partition, for real: each host of the job (three of two ranks
//! and a standby) runs in a network namespace of its own, the four joined
//! by a bridge in a fifth (10.77.0.1–4, which exist only inside them:
//! the agents and workers are the only ones to use them, from inside their
//! namespaces; the test reaches the agents by their control sockets). The
//! link of host 0, whose agent runs the job's controller, is taken down
//! while the job stands still, then restored.
//!
//! The majority side (hosts 1, 2 and the standby) agrees on a successor,
//! which acts and recovers host 0's ranks on the standby from their
//! replicas; host 0, cut off, never acts while it is (its agent says so in
//! `agentctl status` while the successor acts), decides nothing on the
//! hosts it lost, and stops saying why: once its link is back and it hears
//! that the others follow another controller, or when nobody acted for it
//! within 10 s, whichever it sees first. The job ends as one host
//! of six ranks does. Every namespace, process and shm file is gone after.

mod common;
use common::hosts::*;
use common::*;
use std::process::{Command, Output};
use std::time::Duration;

/// Network namespaces of one test: a hub with a bridge, and one per host
/// linked to it by a veth pair.
struct Net {
    prefix: String,
    hosts: usize,
}

fn ip(args: &[&str]) {
    let o = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        o.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&o.stderr)
    );
}

impl Net {
    fn new(hosts: usize) -> Self {
        let prefix = format!("hat{}", std::process::id() % 100_000);
        let net = Self { prefix, hosts };
        let hub = net.hub();
        ip(&["netns", "add", &hub]);
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &hub, "link", "set", "br0", "up"]);
        for k in 0..hosts {
            let (ns, inner, outer) = (net.ns(k), net.inner(k), net.outer(k));
            ip(&["netns", "add", &ns]);
            ip(&[
                "link", "add", &inner, "netns", &ns, "type", "veth", "peer", "name", &outer,
                "netns", &hub,
            ]);
            ip(&["-n", &hub, "link", "set", &outer, "master", "br0", "up"]);
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", Self::addr(k)),
                "dev",
                &inner,
            ]);
            ip(&["-n", &ns, "link", "set", &inner, "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
        }
        net
    }

    fn hub(&self) -> String {
        format!("{}-hub", self.prefix)
    }

    fn ns(&self, k: usize) -> String {
        format!("{}-h{k}", self.prefix)
    }

    fn inner(&self, k: usize) -> String {
        format!("{}i{k}", self.prefix)
    }

    fn outer(&self, k: usize) -> String {
        format!("{}o{k}", self.prefix)
    }

    fn addr(k: usize) -> String {
        format!("10.77.0.{}", k + 1)
    }

    /// Host `k`'s link down (`false`) or up again.
    fn link(&self, k: usize, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.hub(), "link", "set", &self.outer(k), state]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let all: Vec<String> = (0..self.hosts)
            .map(|k| self.ns(k))
            .chain([self.hub()])
            .collect();
        for ns in &all {
            if let Ok(o) = Command::new("ip").args(["netns", "pids", ns]).output() {
                for pid in String::from_utf8_lossy(&o.stdout)
                    .split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok())
                {
                    kill(pid, libc::SIGKILL);
                }
            }
        }
        for ns in &all {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The namespaces of this test are gone.
fn assert_no_namespace(prefix: &str) {
    let o = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let left = String::from_utf8_lossy(&o.stdout);
    assert!(
        !left.lines().any(|l| l.starts_with(prefix)),
        "namespaces left: {left}"
    );
}

#[test]
fn a_partition_never_makes_two_controllers_and_the_cut_off_side_decides_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, reference) = six_ranks_reference(tmp.path());
    let net = Net::new(4);
    let prefix = net.prefix.clone();
    let JobParts {
        secret,
        shm,
        job,
        ports,
        log,
        args,
    } = job_parts(tmp.path(), "partition", 4, &train);
    let mut agents: Vec<Job> = (0..4)
        .map(|k| {
            let at = Place {
                netns: Some(net.ns(k)),
                master: Net::addr(0),
                local: Net::addr(k),
            };
            let mut flags = vec!["--standby-nodes", "1", "--hang-timeout-secs", "40"];
            if k == 3 {
                flags.push("--standby");
            }
            let mut c = reboot_node_at(&at, k, 3, 2, &shm[k], &job, ports, &secret, &args, &flags);
            // Rank 0, on host 0, naps in step 30: the job stands still.
            c.env("HATRAIN_FAULT_PLAN", "0:30:forward:sleep8000");
            host_job(c, &job, k)
        })
        .collect();
    let status = |k: usize| shm[k].join(&job).join("agent.sock");
    let held = poll_agentctl(&status(1), "status", Duration::from_secs(120), |v| {
        let held = v["status"]["replicas"]["held"].as_array()?;
        [0u64, 1]
            .iter()
            .all(|&r| {
                held.iter()
                    .any(|h| h["rank"] == r && h["steps"][0].as_u64().is_some_and(|s| s >= 29))
            })
            .then_some(())
    });
    assert!(held.is_some(), "host 1 never held ranks 0 and 1 at step 29");

    net.link(0, false);
    // The majority side's successor acts; meanwhile host 0 does not.
    let successor = poll_agentctl(&status(1), "status", Duration::from_secs(60), |v| {
        let m = &v["status"]["membership"];
        (m["acting"] == true && m["follows"] == 1).then(|| m["term"].as_u64())
    });
    assert!(successor.is_some(), "node 1 never acted for the majority");
    let cut_off = poll_agentctl(&status(0), "status", Duration::from_secs(10), |v| {
        Some(v["status"]["membership"]["acting"].as_bool())
    })
    .flatten();
    assert_eq!(
        cut_off,
        Some(false),
        "host 0, cut off, waits without acting (None: it ended or does not answer)"
    );
    net.link(0, true);

    let outs: Vec<Output> = agents
        .iter_mut()
        .map(|a| a.wait_output(Duration::from_secs(300)))
        .collect();
    let all: String = outs
        .iter()
        .enumerate()
        .map(|(k, o)| format!("--- host {k}\n{}", stderr(o)))
        .collect();
    let host0 = stderr(&outs[0]);
    assert_eq!(outs[0].status.code(), Some(3), "host 0 stops:\n{all}");
    assert!(
        host0.contains("cut off from the majority of the job's agents"),
        "host 0 says why it stopped:\n{host0}"
    );
    for decision in ["recovering on a standby host", "host 1 lost", "host 2 lost"] {
        assert!(
            !host0.contains(decision),
            "host 0 decided while cut off ({decision}):\n{host0}"
        );
    }
    assert!(
        stderr(&outs[1]).contains("host 0 lost: recovering on a standby host"),
        "node 1 recovered host 0's ranks on the standby:\n{all}"
    );
    for rank in [0, 1] {
        assert!(
            stderr(&outs[3]).contains(&format!("store filled from the peer replica rank={rank}")),
            "the standby filled rank {rank}:\n{all}"
        );
    }
    for (k, o) in outs.iter().enumerate().skip(1) {
        assert_success(o, &format!("host {k}"));
    }
    let run = read_log(&log);
    assert_eq!(
        final_losses(&run),
        final_losses(&reference),
        "every step's loss"
    );
    assert_eq!(final_checksum(&run), final_checksum(&reference));
    for root in &shm {
        assert_nothing_left(root);
    }
    drop(net);
    assert_no_namespace(&prefix);
}
