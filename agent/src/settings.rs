//! A launch's configuration from its command line and environment: what
//! `hatrain-agent launch` runs with, and what `serve` builds for a job whose
//! ranks another launcher started (from the flags `exec` forwards and the
//! ranks' environment).

use crate::cli::LaunchArgs;
use crate::config::{self, HaSettings, JobIdSource, LaunchConfig, LaunchError};
use crate::recovery::{HangPolicy, RestartPolicy};
use crate::spec::OutputPlan;
use hatrain_shared::ha::{self, HaFlags};
use std::time::Duration;

pub fn seconds(flag: &str, v: f64) -> Result<Duration, LaunchError> {
    Duration::try_from_secs_f64(v).map_err(|_| {
        LaunchError::Config(format!(
            "{flag} {v} must be a non-negative number of seconds"
        ))
    })
}

pub fn launch_config(
    a: LaunchArgs,
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<LaunchConfig, LaunchError> {
    let node_rank = config::resolve_node_rank(a.node_rank, get)?;
    let (job_id, source) = config::resolve_job_id(a.job_id, a.nnodes, node_rank, get)?;
    match source {
        JobIdSource::Given => tracing::info!(job = %job_id, "job id"),
        JobIdSource::Launcher(var) => {
            tracing::info!(job = %job_id, from = var, "job id (from the launcher's)")
        }
        JobIdSource::Made => tracing::info!(
            job = %job_id,
            "job id made for this launch (give --job-id to choose one); agentctl finds the job by it"
        ),
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let h = &a.ha;
    let flags = HaFlags {
        enable_high_availability: h.enable_high_availability,
        enable_hbmfault_repair: h.enable_hbmfault_repair,
        enable_worker_reboot: h.enable_worker_reboot,
        enable_elastic_training: h.enable_elastic_training,
    };
    let env = get(ha::ENV);
    let modes = ha::resolve(flags, env.as_deref(), a.nnodes * a.nproc_per_node)
        .map_err(|e| LaunchError::Config(e.to_string()))?;
    let ha = HaSettings {
        modes,
        policy: RestartPolicy {
            max_restarts: h
                .max_restarts
                .unwrap_or(RestartPolicy::default().max_restarts),
            window: seconds("--restart-window-secs", h.restart_window_secs)?,
            max_in_window: h.max_restarts_in_window,
            ..RestartPolicy::default()
        },
        shm_root: h
            .shm_root
            .clone()
            .unwrap_or_else(hatrain_shared::trust::default_shm_root),
        slots: h
            .snapshot_slots
            .unwrap_or(if a.nnodes > 1 && h.replicas > 0 { 3 } else { 2 }),
        pause_timeout: seconds("--pause-timeout-secs", h.pause_timeout_secs)?,
        hang: HangPolicy {
            fixed: h
                .hang_timeout_secs
                .map(|v| seconds("--hang-timeout-secs", v))
                .transpose()?,
            factor: if h.hang_factor.is_finite() && h.hang_factor >= 1.0 {
                h.hang_factor
            } else {
                return Err(LaunchError::Config(format!(
                    "--hang-factor {} must be at least 1",
                    h.hang_factor
                )));
            },
            floor: seconds("--hang-floor-secs", h.hang_floor_secs)?,
            startup_grace: seconds("--hang-startup-grace-secs", h.hang_startup_grace_secs)?,
            ..HangPolicy::default()
        },
        trainer_saves: h.trainer_saves,
        register_timeout: seconds("--register-timeout-secs", h.register_timeout_secs)?,
        slices: h.snapshot_slices == "on",
        replicas: h.replicas,
        host_timeout: seconds("--host-timeout-secs", h.host_timeout_secs)?,
        failure_domain: h.failure_domain.clone(),
        local_addr: h.local_addr,
        standby_nodes: h.standby_nodes,
        warm_standbys: h.warm_standby,
        on_slow: h.on_slow,
        slow_handover: seconds("--slow-handover-secs", h.slow_handover_secs)?,
        preload: h.preload.clone(),
        min_nodes: usize::try_from(h.min_nodes).unwrap_or(usize::MAX),
        standby: h.standby,
        coordinator: h.coordinator.parse().map_err(
            |e: crate::config::CoordinatorChoiceError| LaunchError::Config(e.to_string()),
        )?,
        coordinator_timeout: seconds("--coordinator-timeout-secs", h.coordinator_timeout_secs)?,
        fault_table: match &h.fault_table {
            Some(p) => hatrain_shared::npu::FaultTable::load(p)
                .map_err(|e| LaunchError::Config(format!("--fault-table: {e}")))?,
            None => hatrain_shared::npu::FaultTable::default(),
        },
        devices: h.devices.clone(),
        dcmi_library: h.dcmi_library.clone(),
        npu_smi: h.npu_smi.clone(),
    };
    if a.standalone && a.nnodes != 1 {
        return Err(LaunchError::Config(format!(
            "--standalone runs one host; --nnodes {} asks for more",
            a.nnodes
        )));
    }
    let command = config::worker_command(
        a.command,
        a.no_python,
        a.module,
        get("HATRAIN_PYTHON").map(Into::into),
    )?;
    Ok(LaunchConfig {
        nnodes: a.nnodes,
        node_rank,
        nproc_per_node: a.nproc_per_node,
        master_addr: a.master_addr,
        master_port: a.master_port,
        rdzv_port: a.rdzv_port,
        group_restarts: h.max_restarts.unwrap_or(0),
        output: OutputPlan {
            log_dir: a.log_dir,
            redirects: a.redirects,
            tee: a.tee,
            filter: a.local_ranks_filter.map(|f| f.0),
        },
        job_id,
        secret_file: a.secret_file,
        threads_per_worker: a
            .threads_per_worker
            .unwrap_or((cores / a.nproc_per_node.max(1)).max(1)),
        stop_grace: seconds("--stop-grace-secs", a.stop_grace_secs)?,
        command,
        ha,
        worker_env: None,
    })
}
