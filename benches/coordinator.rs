//! The etcd coordinator, measured.
//!
//! 1. **The controller's host lost**, embedded coordinator against etcd,
//!    in the same run: four hosts of one rank each and a standby (agents
//!    on 127.0.0.1–5, each its own shm root), the `10m` model; host 0 (the
//!    controller's) vanishes during step K (its agent and worker SIGKILLed,
//!    its shared memory deleted). Its successor takes over and gives rank
//!    0 to the standby, filled from its peer replica on host 1. Timed from
//!    the kill to the first step completed after it, and to step K
//!    completed again. With etcd (one local member) the loss is seen when
//!    host 0's lease expires (TTL = the host timeout, 3 s); with the
//!    embedded coordinator, at once when its heartbeat connection drops.
//! 2. **4,096 simulated agents** against one local etcd member: each holds
//!    a lease (TTL 3 s) and a membership key under a job prefix and keeps
//!    its lease alive every second, as an agent does (4,096 keep-alives
//!    per second offered). Reported: the keep-alives answered per second
//!    and their latency. Then the real coordinator of node 0 (what the
//!    controller runs) watches the 4,097 members; one simulated agent
//!    stops its keep-alives, and the time from its lease's expiry (its
//!    last keep-alive answered + the TTL) to the coordinator's view
//!    naming it lost is measured, five times.
//!
//! `HATRAIN_BENCH_AGENTS` changes the 4,096.

mod common;
use common::etcd::Etcd;
use common::hosts::{Launch, secret_file, timings, vanish};
use common::ports::free_ports;
use common::{median, train_args, wait_step};
use etcd_client::{Client, GetOptions, PutOptions};
use hatrain_agent::coordinator::Coordinator;
use hatrain_agent::coordinator::etcd::{Etcd as EtcdCoordinator, EtcdConfig};
use std::path::Path;
use std::process::Child;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(300);
const TTL: i64 = 3;

fn controller_lost(dir: &Path, secret: &Path, k: u64, etcd: Option<&str>) -> (f64, f64) {
    let tag = if etcd.is_some() { "etcd" } else { "emb" };
    let log = dir.join(format!("{tag}-{k}.jsonl"));
    let train = train_args("10m", k + 2, &log, &[]);
    let extra: Vec<&str> = match etcd {
        Some(url) => vec!["--coordinator", url],
        None => Vec::new(),
    };
    let l = Launch {
        dir,
        job: format!("{tag}{k}"),
        ports: free_ports::<2>().into(),
        secret,
        ha: true,
        nnodes: 4,
        standbys: 1,
        slots: 4,
        extra: &extra,
        train: &train,
    };
    let mut agents: Vec<Child> = (0..5).map(|n| l.start(n)).collect();
    wait_step(&log, LIMIT, |e| e["step"].as_u64() == Some(k - 1)).expect("reach K-1");
    let t_kill = vanish(&mut agents[0], &l.shm(0));
    for (n, a) in agents.iter_mut().enumerate().skip(1) {
        l.expect_success(n, a);
    }
    let (first, back, _) = timings(&log, t_kill, k);
    (first, back)
}

/// One simulated agent: its lease, kept alive every second until `stop`.
async fn simulated(
    mut c: Client,
    prefix: String,
    node: u64,
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
    latencies: Arc<std::sync::Mutex<Vec<f64>>>,
    last: Arc<std::sync::Mutex<Option<Instant>>>,
) {
    let lease = c.lease_grant(TTL, None).await.expect("a lease").id();
    c.put(
        format!("{prefix}members/{node}"),
        format!("{{\"node\":{node}}}"),
        Some(PutOptions::new().with_lease(lease)),
    )
    .await
    .expect("a member key");
    let (mut keeper, mut answers) = c.lease_keep_alive(lease).await.expect("keep-alive");
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let sent = Instant::now();
        if keeper.keep_alive().await.is_err() {
            continue;
        }
        if let Ok(Some(a)) = answers.message().await
            && a.ttl() > 0
        {
            answered.fetch_add(1, Ordering::Relaxed);
            latencies
                .lock()
                .unwrap()
                .push(sent.elapsed().as_secs_f64() * 1e3);
            *last.lock().unwrap() = Some(Instant::now());
        }
    }
}

type Last = Arc<std::sync::Mutex<Option<Instant>>>;

fn many_agents(url: &str, n: u64) {
    let endpoints = vec![url.trim_start_matches("etcd://").to_string()];
    let prefix = "/hatrain/bench-many/".to_string();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let answered = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut stops = Vec::new();
    let mut lasts: Vec<Last> = Vec::new();
    rt.block_on(async {
        let clients: Vec<Client> = {
            let mut v = Vec::new();
            for _ in 0..16 {
                v.push(Client::connect(&endpoints, None).await.expect("etcd"));
            }
            v
        };
        let t0 = Instant::now();
        for node in 1..=n {
            let stop = Arc::new(AtomicBool::new(false));
            let last: Last = Arc::new(std::sync::Mutex::new(None));
            stops.push(Arc::clone(&stop));
            lasts.push(Arc::clone(&last));
            tokio::spawn(simulated(
                clients[node as usize % clients.len()].clone(),
                prefix.clone(),
                node,
                stop,
                Arc::clone(&answered),
                Arc::clone(&latencies),
                last,
            ));
        }
        // Every member joined.
        let mut c = clients[0].clone();
        loop {
            let got = c
                .get(
                    format!("{prefix}members/"),
                    Some(GetOptions::new().with_prefix().with_count_only()),
                )
                .await
                .expect("count");
            if got.count() as u64 >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        println!(
            "{n} simulated agents joined (a lease and a key each) in {:.2} s",
            t0.elapsed().as_secs_f64()
        );
    });
    // Keep-alive load, over 10 s.
    latencies.lock().unwrap().clear();
    let a0 = answered.load(Ordering::Relaxed);
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(10));
    let rate = (answered.load(Ordering::Relaxed) - a0) as f64 / t0.elapsed().as_secs_f64();
    let mut lat = std::mem::take(&mut *latencies.lock().unwrap());
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(f64::NAN)
    };
    println!(
        "keep-alives: {n} per second offered, {rate:.0} per second answered; latency p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        pct(0.5),
        pct(0.99),
        lat.last().copied().unwrap_or(f64::NAN)
    );
    // The controller's coordinator, as node 0 of n + 1.
    let mut coordinator = EtcdCoordinator::start(EtcdConfig {
        endpoints,
        prefix: prefix.clone(),
        nodes: n + 1,
        node: 0,
        ttl: Duration::from_secs(TTL as u64),
        about: "{}".into(),
    });
    let start = Instant::now();
    let clock = |s: Instant| s.elapsed();
    while coordinator.view(clock(start)).live.len() as u64 <= n {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the coordinator sees every member"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut decided = Vec::new();
    for (i, node) in [7u64, 1000, 2000, 3000, 4000].into_iter().enumerate() {
        let node = node.min(n);
        let idx = (node - 1) as usize;
        stops[idx].store(true, Ordering::Relaxed);
        // Its last answered keep-alive: the lease expires a TTL later.
        std::thread::sleep(Duration::from_millis(1100));
        let last = lasts[idx].lock().unwrap().expect("answered once");
        let expiry = last + Duration::from_secs(TTL as u64);
        let seen = loop {
            if coordinator.view(clock(start)).lost.contains(&node) {
                break Instant::now();
            }
            assert!(
                Instant::now() < expiry + Duration::from_secs(30),
                "node {node} is never lost"
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        let s = seen.saturating_duration_since(expiry).as_secs_f64();
        println!(
            "  loss {}: node {node}, lease expiry -> lost in the controller's view {s:.3} s",
            i + 1
        );
        decided.push(s);
    }
    println!(
        "median lease expiry -> the controller's view: {:.3} s (etcd checks expiries every 0.5 s; the coordinator reads the job's {} keys every 0.2 s)",
        median(decided),
        n + 2
    );
    for s in &stops {
        s.store(true, Ordering::Relaxed);
    }
    drop(coordinator);
    rt.shutdown_timeout(Duration::from_secs(2));
}

fn main() {
    let dir = tempfile::Builder::new()
        .prefix("hatrain-bench-")
        .tempdir_in("/dev/shm")
        .expect("tempdir");
    let etcd = Etcd::start(dir.path(), 1);
    let url = etcd.url();
    let secret = secret_file(dir.path(), "5a");
    println!(
        "the controller's host lost during step K (10m model, 4 hosts x 1 rank and a standby): seconds from the kill"
    );
    println!(
        "{:>3} {:>14} {:>14} {:>14} {:>14}",
        "K", "embedded 1st", "embedded K", "etcd 1st", "etcd K"
    );
    let (mut ef, mut ek, mut xf, mut xk) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for k in [23u64, 26, 29] {
        let (f1, k1) = controller_lost(dir.path(), &secret, k, None);
        let (f2, k2) = controller_lost(dir.path(), &secret, k, Some(&url));
        println!("{k:>3} {f1:>14.3} {k1:>14.3} {f2:>14.3} {k2:>14.3}");
        ef.push(f1);
        ek.push(k1);
        xf.push(f2);
        xk.push(k2);
    }
    let (ef, ek, xf, xk) = (median(ef), median(ek), median(xf), median(xk));
    println!(
        "median: embedded {ef:.3} s to the first step, {ek:.3} s to step K; etcd {xf:.3} s and {xk:.3} s; etcd / embedded: {:.2} (first step), {:.2} (step K)",
        xf / ef,
        xk / ek
    );
    let n = std::env::var("HATRAIN_BENCH_AGENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4096u64);
    many_agents(&url, n);
}
