//! Prometheus metrics: `--metrics-addr` serves `/metrics` (through the
//! `prometheus-client` crate, over `hyper`): OpenMetrics text to a scraper
//! that asks for it (Prometheus does, in its `Accept` header), else the
//! classic text format (0.0.4), which `promtool check metrics` and older
//! tools read.
//!
//! A scrape asks each job the agent runs for its status over the job's own
//! control socket (what `agentctl status` shows) and renders it: so the
//! numbers are the job's, taken when asked, and a job that is busy does
//! not hold the endpoint up for more than a moment. Counters count over a
//! job's life (its fault history is kept across recoveries and agent
//! restarts); the recovery-time histogram is built from the same history.

use hatrain_shared::control::{FaultKind, PROTOCOL, Request, Response, StatusReport};
use http_body_util::Full;
use hyper::body::Bytes;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// The jobs whose metrics are served: id to control socket.
pub type Jobs = Arc<Mutex<BTreeMap<String, PathBuf>>>;

/// How long a scrape waits for one job's status.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct JobLabel {
    job: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RankLabels {
    job: String,
    rank: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatLabels {
    job: String,
    rank: String,
    stat: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    job: String,
    rank: String,
    phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SideLabels {
    job: String,
    side: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FaultLabels {
    job: String,
    kind: String,
    action: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HostLabels {
    job: String,
    state: String,
}

type GaugeF = Gauge<f64, AtomicU64>;

fn kind_name(kind: FaultKind) -> String {
    serde_json::to_value(kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{kind:?}"))
}

/// The OpenMetrics text of `reports`.
pub fn render(reports: &[StatusReport]) -> String {
    let mut reg = Registry::default();
    let jobs = Gauge::<i64>::default();
    jobs.set(reports.len() as i64);
    reg.register("hatrain_jobs", "Jobs this agent runs", jobs);

    let world = Family::<JobLabel, Gauge>::default();
    let uptime = Family::<JobLabel, GaugeF>::default();
    let recovering = Family::<JobLabel, Gauge>::default();
    let epoch = Family::<JobLabel, Gauge>::default();
    let step_time = Family::<JobLabel, GaugeF>::default();
    let step = Family::<RankLabels, Gauge>::default();
    let restarts = Family::<RankLabels, Counter>::default();
    let snap_age = Family::<RankLabels, GaugeF>::default();
    let snap_bytes = Family::<RankLabels, Gauge>::default();
    let held = Family::<StatLabels, GaugeF>::default();
    let held_total = Family::<RankLabels, Counter<f64, AtomicU64>>::default();
    let held_steps = Family::<RankLabels, Counter>::default();
    let copy_s = Family::<RankLabels, Counter<f64, AtomicU64>>::default();
    let copy_cpu = Family::<RankLabels, Counter<f64, AtomicU64>>::default();
    let copy_bytes = Family::<RankLabels, Counter>::default();
    let copy_skipped = Family::<RankLabels, Counter>::default();
    let copy_thinned = Family::<RankLabels, Counter>::default();
    let phase_s = Family::<PhaseLabels, Counter<f64, AtomicU64>>::default();
    let timed_steps = Family::<RankLabels, Counter>::default();
    let slowdown = Family::<PhaseLabels, GaugeF>::default();
    let faults = Family::<FaultLabels, Counter>::default();
    let recovery = Family::<JobLabel, Histogram>::new_with_constructor(|| {
        Histogram::new(exponential_buckets(0.1, 2.0, 13))
    });
    let saves = Family::<JobLabel, Counter>::default();
    let skipped = Family::<JobLabel, Counter>::default();
    let ckpt_bytes = Family::<JobLabel, Counter>::default();
    let replica_lag = Family::<RankLabels, Gauge>::default();
    let replica_risk = Family::<RankLabels, Gauge>::default();
    let hosts = Family::<HostLabels, Gauge>::default();
    let replica_cpu = Family::<SideLabels, Counter<f64, AtomicU64>>::default();
    let replica_bytes = Family::<SideLabels, Counter>::default();

    for r in reports {
        let job = JobLabel { job: r.job.clone() };
        world.get_or_create(&job).set(r.world_size as i64);
        uptime.get_or_create(&job).set(r.uptime_s);
        recovering.get_or_create(&job).set(i64::from(r.recovering));
        epoch.get_or_create(&job).set(r.epoch as i64);
        if let Some(t) = r.step_time_s {
            step_time.get_or_create(&job).set(t);
        }
        for w in &r.workers {
            let l = RankLabels {
                job: r.job.clone(),
                rank: w.rank.to_string(),
            };
            step.get_or_create(&l).set(w.step as i64);
            restarts.get_or_create(&l).inc_by(w.restarts);
            if let Some(s) = &w.last_snapshot {
                snap_age.get_or_create(&l).set(s.age_s);
                snap_bytes.get_or_create(&l).set(s.bytes as i64);
            }
            if let Some(h) = &w.held_time {
                for (stat, ms) in [("p50", h.p50_ms), ("p99", h.p99_ms), ("max", h.max_ms)] {
                    let ql = StatLabels {
                        job: r.job.clone(),
                        rank: w.rank.to_string(),
                        stat: stat.into(),
                    };
                    held.get_or_create(&ql).set(ms / 1e3);
                }
                held_total
                    .get_or_create(&l)
                    .inc_by(h.mean_ms * h.steps as f64 / 1e3);
                held_steps.get_or_create(&l).inc_by(h.steps);
            }
            if let Some(t) = &w.step_times {
                let phases = [
                    ("data", t.data_ms),
                    ("compute", t.compute_ms),
                    ("collective", t.collective_ms),
                    ("update", t.update_ms),
                    ("step", t.step_ms),
                ];
                for (phase, ms) in phases {
                    let pl = PhaseLabels {
                        job: r.job.clone(),
                        rank: w.rank.to_string(),
                        phase: phase.into(),
                    };
                    phase_s.get_or_create(&pl).inc_by(ms * t.steps as f64 / 1e3);
                }
                timed_steps.get_or_create(&l).inc_by(t.steps);
            }
            if let Some(c) = &w.copies {
                copy_s.get_or_create(&l).inc_by(c.copy_s);
                copy_cpu.get_or_create(&l).inc_by(c.cpu_s);
                copy_bytes.get_or_create(&l).inc_by(c.bytes);
                copy_skipped.get_or_create(&l).inc_by(c.skipped);
                copy_thinned.get_or_create(&l).inc_by(c.thinned);
            }
        }
        for f in r.slow.iter().filter(|f| !f.ended && f.step_ms > 0.0) {
            let pl = PhaseLabels {
                job: r.job.clone(),
                rank: f.rank.to_string(),
                phase: f.phase.clone(),
            };
            slowdown.get_or_create(&pl).set(f.excess_ms / f.step_ms);
        }
        for f in &r.faults {
            let l = FaultLabels {
                job: r.job.clone(),
                kind: kind_name(f.kind),
                action: f.class.name().into(),
            };
            faults.get_or_create(&l).inc();
            if let Some(s) = f.recovery_s {
                recovery.get_or_create(&job).observe(s);
            }
        }
        if let Some(p) = &r.persist {
            saves.get_or_create(&job).inc_by(p.saves);
            skipped.get_or_create(&job).inc_by(p.skipped.len() as u64);
            ckpt_bytes.get_or_create(&job).inc_by(p.bytes_written);
        }
        // The ranks step together: a replica's lag is behind this host's
        // newest snapshot.
        let newest = r
            .workers
            .iter()
            .filter_map(|w| w.last_snapshot.as_ref().map(|s| s.step))
            .max();
        if let (Some(rep), Some(newest)) = (&r.replicas, newest) {
            for h in &rep.held {
                let l = RankLabels {
                    job: r.job.clone(),
                    rank: h.rank.to_string(),
                };
                let held = h.steps.first().copied().unwrap_or(0);
                replica_lag
                    .get_or_create(&l)
                    .set(newest.saturating_sub(held) as i64);
            }
        }
        if let Some(rep) = &r.replicas {
            let side = |side: &str| SideLabels {
                job: r.job.clone(),
                side: side.into(),
            };
            let sent: u64 = rep.streams.iter().map(|s| s.bytes_sent).sum();
            let cpu: f64 = rep.streams.iter().map(|s| s.cpu_s).sum();
            replica_bytes.get_or_create(&side("send")).inc_by(sent);
            replica_cpu.get_or_create(&side("send")).inc_by(cpu);
            replica_bytes
                .get_or_create(&side("receive"))
                .inc_by(rep.received_bytes);
            replica_cpu
                .get_or_create(&side("receive"))
                .inc_by(rep.receive_cpu_s);
        }
        // With several holders, one current replica is enough.
        let mut risk = std::collections::BTreeMap::new();
        for k in r
            .replicas
            .iter()
            .flat_map(|rep| &rep.streams)
            .flat_map(|s| &s.ranks)
        {
            *risk.entry(k.rank).or_insert(true) &= k.at_risk;
        }
        for (rank, at) in risk {
            let l = RankLabels {
                job: r.job.clone(),
                rank: rank.to_string(),
            };
            replica_risk.get_or_create(&l).set(i64::from(at));
        }
        if let Some(m) = &r.membership {
            for (state, n) in [
                ("live", m.live.len()),
                ("lost", m.lost.len()),
                ("starting", m.starting.len()),
            ] {
                let l = HostLabels {
                    job: r.job.clone(),
                    state: state.into(),
                };
                hosts.get_or_create(&l).set(n as i64);
            }
        }
    }
    reg.register(
        "hatrain_world_size",
        "Ranks in the job's data-parallel group",
        world,
    );
    reg.register_with_unit(
        "hatrain_uptime",
        "Time since the job started",
        Unit::Seconds,
        uptime,
    );
    reg.register(
        "hatrain_recovering",
        "1 while the job recovers from a fault",
        recovering,
    );
    reg.register("hatrain_epoch", "The job's recovery epoch", epoch);
    reg.register_with_unit(
        "hatrain_step_duration",
        "Median recent step time, as the hang watchdog measures it",
        Unit::Seconds,
        step_time,
    );
    reg.register("hatrain_step", "The newest step each rank reached", step);
    reg.register(
        "hatrain_worker_restarts",
        "Times each rank's worker was restarted",
        restarts,
    );
    reg.register_with_unit(
        "hatrain_snapshot_age",
        "Age of each rank's newest sealed snapshot",
        Unit::Seconds,
        snap_age,
    );
    reg.register_with_unit(
        "hatrain_snapshot",
        "Size of each rank's newest sealed snapshot",
        Unit::Bytes,
        snap_bytes,
    );
    reg.register_with_unit(
        "hatrain_step_held",
        "Time each rank's training thread spent in hatrain's calls per step (stat p50 and p99 are upper bounds, max the longest)",
        Unit::Seconds,
        held,
    );
    reg.register_with_unit(
        "hatrain_step_held_sum",
        "Time each rank's training thread spent in hatrain's calls, summed over its steps",
        Unit::Seconds,
        held_total,
    );
    reg.register(
        "hatrain_step_held_steps",
        "Steps whose held time is counted",
        held_steps,
    );
    reg.register_with_unit(
        "hatrain_snapshot_copy",
        "Time the commit thread spent copying the sealed snapshots",
        Unit::Seconds,
        copy_s,
    );
    reg.register_with_unit(
        "hatrain_snapshot_copy_cpu",
        "CPU time the commit thread used for the sealed snapshots",
        Unit::Seconds,
        copy_cpu,
    );
    reg.register_with_unit(
        "hatrain_snapshot_copied",
        "Bytes of the sealed snapshots",
        Unit::Bytes,
        copy_bytes,
    );
    reg.register(
        "hatrain_snapshots_skipped",
        "Snapshots abandoned because the update began before their copy finished (--snapshot-window skip)",
        copy_skipped,
    );
    reg.register_with_unit(
        "hatrain_rank_phase",
        "Time each rank's training steps spent in each phase (data, compute, collective, update) and in whole steps, summed over the steps timed",
        Unit::Seconds,
        phase_s,
    );
    reg.register(
        "hatrain_rank_slowdown",
        "A slow rank's excess work per step over the other ranks', as a fraction of the step, by the phase that grew (present while the finding lasts)",
        slowdown,
    );
    reg.register(
        "hatrain_rank_timed_steps",
        "Steps whose phases are timed",
        timed_steps,
    );
    reg.register(
        "hatrain_snapshots_thinned",
        "Snapshots not taken because every slot but the newest was held (for a checkpoint being written, or for the peer replicas while they catch up)",
        copy_thinned,
    );
    reg.register(
        "hatrain_faults",
        "Faults seen, by kind and the action taken",
        faults,
    );
    reg.register_with_unit(
        "hatrain_recovery_duration",
        "Time from a fault's detection to the first step after its recovery",
        Unit::Seconds,
        recovery,
    );
    reg.register(
        "hatrain_checkpoint_saves",
        "Checkpoints written from the snapshots",
        saves,
    );
    reg.register(
        "hatrain_checkpoint_saves_skipped",
        "Checkpoint steps passed over because the disk was still busy",
        skipped,
    );
    reg.register_with_unit(
        "hatrain_checkpoint_written",
        "Bytes of the checkpoints written from the snapshots",
        Unit::Bytes,
        ckpt_bytes,
    );
    reg.register(
        "hatrain_replica_lag_steps",
        "Steps a held peer replica is behind this host's newest snapshot",
        replica_lag,
    );
    reg.register(
        "hatrain_replica_at_risk",
        "1 while every peer replica of this host's rank is behind every step this host keeps but the one its next snapshot overwrites: a loss of this host then could not be recovered from memory",
        replica_risk,
    );
    reg.register_with_unit(
        "hatrain_replica_cpu",
        "CPU time of the replica threads (side send: the streams of this host's snapshots; receive: the replicas held here), ZeroMQ's I/O thread not counted",
        Unit::Seconds,
        replica_cpu,
    );
    reg.register_with_unit(
        "hatrain_replica_streamed",
        "Snapshot bytes sent to peers (side send) and written into the replicas held here (side receive)",
        Unit::Bytes,
        replica_bytes,
    );
    reg.register(
        "hatrain_hosts",
        "The job's hosts by state, as this agent hears them",
        hosts,
    );
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &reg) {
        tracing::warn!(error = %e, "cannot encode the metrics");
    }
    out
}

/// A job's status, asked over its control socket.
async fn status(socket: &Path) -> Option<StatusReport> {
    let mut s = tokio::net::UnixStream::connect(socket).await.ok()?;
    let frame = PROTOCOL
        .encode(&serde_json::to_vec(&Request::Status).ok()?)
        .ok()?;
    s.write_all(&frame).await.ok()?;
    let mut header = [0u8; hatrain_shared::frame::HEADER_LEN];
    s.read_exact(&mut header).await.ok()?;
    let mut body = vec![0u8; PROTOCOL.parse_header(&header).ok()?];
    s.read_exact(&mut body).await.ok()?;
    match PROTOCOL.parse_json(&body).ok()? {
        Response::Status(r) => Some(*r),
        _ => None,
    }
}

async fn scrape(jobs: &Jobs) -> String {
    let sockets: Vec<PathBuf> = jobs
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .values()
        .cloned()
        .collect();
    let mut reports = Vec::with_capacity(sockets.len());
    for s in sockets {
        if let Ok(Some(r)) = tokio::time::timeout(ASK_TIMEOUT, status(&s)).await {
            reports.push(r);
        }
    }
    render(&reports)
}

/// The classic text format (0.0.4) of an OpenMetrics text: a counter's
/// HELP and TYPE name its `_total` sample, and UNIT and EOF go.
pub fn classic(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{p}{name}_total {tail}"))
        });
        match renamed {
            Some(l) => out.push_str(&l),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

type Reply = hyper::Response<Full<Bytes>>;

async fn handle(
    req: hyper::Request<hyper::body::Incoming>,
    jobs: Jobs,
) -> Result<Reply, std::convert::Infallible> {
    let openmetrics = req
        .headers()
        .get_all(hyper::header::ACCEPT)
        .iter()
        .any(|v| {
            v.to_str()
                .is_ok_and(|v| v.contains("application/openmetrics-text"))
        });
    let (code, kind, body) = if req.method() == hyper::Method::GET && req.uri().path() == "/metrics"
    {
        let text = scrape(&jobs).await;
        match openmetrics {
            true => (
                200,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                text,
            ),
            false => (
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                classic(&text),
            ),
        }
    } else {
        (
            404,
            "text/plain; charset=utf-8",
            "only GET /metrics is served here\n".to_string(),
        )
    };
    let mut reply = hyper::Response::new(Full::new(Bytes::from(body)));
    *reply.status_mut() = hyper::StatusCode::from_u16(code).unwrap_or(hyper::StatusCode::OK);
    if let Ok(v) = hyper::header::HeaderValue::from_str(kind) {
        reply.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    Ok(reply)
}

/// Serves `/metrics` on `addr` until `shutdown`; the address it listens on.
pub async fn serve(
    addr: SocketAddr,
    jobs: Jobs,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    if !local.ip().is_loopback() {
        tracing::warn!(addr = %local, "metrics are served beyond this host (not a loopback address)");
    }
    tracing::info!(addr = %local, "serving Prometheus metrics at /metrics");
    tokio::spawn(async move {
        loop {
            let conn = tokio::select! {
                _ = shutdown.cancelled() => return,
                c = listener.accept() => c,
            };
            let Ok((stream, _)) = conn else { continue };
            let jobs = Arc::clone(&jobs);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| handle(req, Arc::clone(&jobs)));
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, service)
                    .await;
            });
        }
    });
    Ok(local)
}

/// A `--metrics-addr` that is neither a port nor an address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--metrics-addr {0:?}: expected PORT (on 127.0.0.1) or ADDR:PORT")]
pub struct MetricsAddrError(String);

/// `--metrics-addr`: `PORT` (on 127.0.0.1) or `ADDR:PORT`.
pub fn parse_addr(s: &str) -> Result<SocketAddr, MetricsAddrError> {
    if let Ok(port) = s.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    s.parse().map_err(|_| MetricsAddrError(s.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hatrain_shared::control::FaultRecord;

    #[test]
    fn the_classic_format_names_counters_by_their_samples() {
        let r = StatusReport {
            job: "j".into(),
            world_size: 2,
            local_ranks: 2,
            epoch: 1,
            modes: Default::default(),
            uptime_s: 3.0,
            recovering: false,
            activity: None,
            store: None,
            store_addr: None,
            workers: vec![],
            faults: vec![FaultRecord {
                id: 1,
                ranks: vec![1],
                kind: FaultKind::Uce,
                detail: String::new(),
                detected_unix_s: 0.0,
                s_star: Some(3),
                action: "rank 1: uncorrectable memory error in params: every rank returns to s* and recomputes (no restart)".into(),
                class: hatrain_shared::control::FaultAction::Repair,
                recovery_s: Some(0.5),
                steps_lost: Some(1),
                reason: String::new(),
            }],
            persist: None,
            replicas: Some(hatrain_shared::control::ReplicaReport {
                listen: "tcp://127.0.0.1:1".into(),
                streams: vec![hatrain_shared::control::StreamReport {
                    node: 1,
                    endpoint: "tcp://127.0.0.2:1".into(),
                    connected: true,
                    bytes_sent: 2_000_000_000,
                    chunks_sent: 0,
                    cpu_s: 0.5,
                    ranks: vec![hatrain_shared::control::RankReplicaReport {
                        rank: 3,
                        local_step: Some(9),
                        replica_step: Some(5),
                        lag_steps: Some(4),
                        lag_bytes: 10,
                        abandoned: 2,
                        at_risk: true,
                    }],
                }],
                held: vec![],
                rejected_malformed: 0,
                rejected_forged: 0,
                rejected_replayed: 0,
                received_bytes: 1_000_000_000,
                receive_cpu_s: 0.25,
                kept: Default::default(),
            }),
            membership: None,
            resizes: vec![],
            step_time_s: Some(0.25),
            slow: Vec::new(),
        };
        let om = render(&[r]);
        assert!(om.ends_with("# EOF\n"), "{om}");
        assert!(om.contains("# TYPE hatrain_faults counter"), "{om}");
        let c = classic(&om);
        assert!(c.contains("# TYPE hatrain_faults_total counter"), "{c}");
        assert!(c.contains("# HELP hatrain_faults_total Faults seen"), "{c}");
        assert!(
            c.contains("hatrain_faults_total{job=\"j\",kind=\"uce\",action=\"repair\"} 1"),
            "{c}"
        );
        assert!(
            c.contains("hatrain_step_duration_seconds{job=\"j\"} 0.25"),
            "{c}"
        );
        assert!(
            c.contains("hatrain_replica_at_risk{job=\"j\",rank=\"3\"} 1"),
            "{c}"
        );
        assert!(
            c.contains("hatrain_replica_cpu_seconds_total{job=\"j\",side=\"send\"} 0.5"),
            "{c}"
        );
        assert!(
            c.contains(
                "hatrain_replica_streamed_bytes_total{job=\"j\",side=\"receive\"} 1000000000"
            ),
            "{c}"
        );
        assert!(!c.contains("# EOF") && !c.contains("# UNIT"), "{c}");
    }
}
