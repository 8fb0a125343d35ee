//! The command line: `run`, `plan`, `chart` and `costs`.

use crate::chart::{Line, goodput_by_size};
use crate::costs::{Measured, Published};
use crate::plan::plan;
use crate::policy::{Params, Policy, Setting};
use crate::rates::Rates;
use crate::report;
use crate::run::{default_threads, study};
use crate::scale::{Scale, Scaled};
use crate::trace::{Shape, kind_rates};

/// The largest job simulated.
pub const MAX_ACCELERATORS: u32 = 10_000_000;
/// The longest span simulated.
pub const MAX_DAYS: f64 = 3650.0;
/// The most faults one run may draw (its trace is held in memory).
pub const MAX_FAULTS: f64 = 1e7;
/// The most runs of `run` and `chart` (each keeps its four outcomes).
pub const MAX_SEEDS: u64 = 1_000_000;
/// The most runs of `plan` (each keeps an outcome per candidate).
pub const MAX_PLAN_SEEDS: u64 = 10_000;
/// The most threads.
pub const MAX_THREADS: usize = 1024;
use anyhow::{Result, bail};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "hatrain-sim",
    version,
    about = "What a fault-tolerance setup is worth on a cluster, on hatrain's measured costs"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Compare the four policies on the same fault traces.
    Run {
        #[command(flatten)]
        model: Model,
        #[command(flatten)]
        setting: SettingArgs,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// The cheapest hatrain setting that reaches a goodput target.
    Plan {
        #[command(flatten)]
        model: Model,
        /// The median goodput to reach, in (0, 1).
        #[arg(long, default_value_t = 0.99)]
        target: f64,
        /// The smallest share of hosts an elastic job keeps.
        #[arg(long, default_value_t = 0.5)]
        min_hosts_frac: f64,
        #[arg(long)]
        json: bool,
    },
    /// Draw goodput against cluster size for each policy into a PNG.
    Chart {
        #[command(flatten)]
        model: Model,
        #[command(flatten)]
        setting: SettingArgs,
        /// The PNG to write.
        #[arg(long)]
        out: PathBuf,
        /// Cluster sizes, accelerators.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "1024,2048,4096,8192,16384,32768,65536,100000"
        )]
        sizes: Vec<u32>,
    },
    /// Print the measured costs in use and where each came from.
    Costs {
        /// A costs file the benchmarks wrote (default: the checked-in one).
        #[arg(long, env = "HATRAIN_SIM_COSTS")]
        costs: Option<PathBuf>,
    },
}

/// The job, its faults and the costs of recovering from them.
#[derive(Debug, Clone, Args)]
pub struct Model {
    /// Accelerators in the job.
    #[arg(long, default_value_t = 16_384)]
    pub accelerators: u32,
    /// Accelerators per host.
    #[arg(long, default_value_t = 8)]
    pub per_host: u32,
    /// Days simulated.
    #[arg(long, default_value_t = 54.0)]
    pub days: f64,
    /// The first seed; run i uses a seed derived from it and i.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Runs (seeds) per policy.
    #[arg(long, default_value_t = 200)]
    pub seeds: u64,
    /// Threads (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// hatrain's measured costs, as the benchmarks write them (default:
    /// the checked-in latest run).
    #[arg(long, env = "HATRAIN_SIM_COSTS")]
    pub costs: Option<PathBuf>,
    /// Every fault rate below multiplied by this.
    #[arg(long, default_value_t = 1.0)]
    pub rate_scale: f64,
    /// UCEs per accelerator-day [Llama 3, Table 5: HBM3 72 + SRAM 19 of
    /// 419 interruptions, 54 days, 16,384 GPUs].
    #[arg(long)]
    pub uce_rate: Option<f64>,
    /// Worker crashes per accelerator-day [Llama 3: software bug 54, GPU
    /// system processor 17, silent data corruption 6, dependency 2].
    #[arg(long)]
    pub crash_rate: Option<f64>,
    /// Hangs per accelerator-day [Llama 3: network switch or cable 35,
    /// NCCL watchdog 7].
    #[arg(long)]
    pub hang_rate: Option<f64>,
    /// Host losses per host-day [Llama 3: faulty GPU 148, host maintenance
    /// 32, and 27 other host parts; Meta's research clusters: about 5e-3
    /// failures per node-day].
    #[arg(long)]
    pub host_rate: Option<f64>,
    /// Mean hours to repair a lost host [assumed: 12; no source above
    /// gives one].
    #[arg(long)]
    pub repair_hours: Option<f64>,
    /// Failure-domain losses per domain-day [assumed: 2e-4; no source above
    /// gives a per-rack rate].
    #[arg(long)]
    pub domain_rate: Option<f64>,
    /// Hosts per failure domain [assumed: 4, a rack].
    #[arg(long)]
    pub domain_hosts: Option<u32>,
    /// Silent slowdowns per host-day [assumed: 5e-4].
    #[arg(long)]
    pub slow_rate: Option<f64>,
    /// The job's speed while a host is slow [assumed: 0.8].
    #[arg(long)]
    pub slow_speed: Option<f64>,
    /// Mean hours a slowdown lasts [assumed: 1].
    #[arg(long)]
    pub slow_hours: Option<f64>,
    /// Seconds per step [assumed: 10].
    #[arg(long, default_value_t = 10.0)]
    pub step_secs: f64,
    /// Seconds a checkpoint write takes [Meta's research clusters: about 5
    /// minutes].
    #[arg(long, default_value_t = 300.0)]
    pub ckpt_write_secs: f64,
    /// Seconds to read a checkpoint back [assumed: 120; with the restart
    /// below, restarts land in Meta's measured 5–20 minutes].
    #[arg(long, default_value_t = 120.0)]
    pub disk_load_secs: f64,
    /// Seconds to restart every process and join the collectives [assumed:
    /// 240, as above].
    #[arg(long, default_value_t = 240.0)]
    pub init_secs: f64,
    /// Seconds for the scheduler to requeue on a replacement host
    /// [assumed: 180, as above].
    #[arg(long, default_value_t = 180.0)]
    pub requeue_secs: f64,
    /// Seconds before a launcher notices a crashed worker [assumed: 30].
    #[arg(long, default_value_t = 30.0)]
    pub detect_crash_secs: f64,
    /// Seconds before a hang or a lost host ends in an error [PyTorch's
    /// default process-group timeout: 10 minutes].
    #[arg(long, default_value_t = 600.0)]
    pub detect_timeout_secs: f64,
    /// Seconds to read an in-memory checkpoint back [assumed: 10].
    #[arg(long, default_value_t = 10.0)]
    pub mem_load_secs: f64,
    /// hatrain's host-loss timeout [the agent's --host-timeout-secs
    /// default].
    #[arg(long, default_value_t = 3.0)]
    pub host_timeout_secs: f64,
    /// GB of training state per accelerator: hatrain's costs are scaled to
    /// it from their fixed and per-GB parts (see `hatrain_sim::scale`);
    /// without it, the step ratios and pauses are used as measured.
    #[arg(long)]
    pub state_gb: Option<f64>,
    /// Host cores per host that training leaves to hatrain's copies, with
    /// --state-gb [assumed: 16].
    #[arg(long, default_value_t = 16.0)]
    pub spare_cores: f64,
}

/// hatrain's settings, and the disk interval of every policy.
#[derive(Debug, Clone, Args)]
pub struct SettingArgs {
    /// Standby hosts held for the job (hatrain).
    #[arg(long, default_value_t = 2)]
    pub standby_hosts: u32,
    /// Other hosts holding each host's snapshots (hatrain's --replicas).
    #[arg(long, default_value_t = 1)]
    pub replicas: u32,
    /// Minutes of training between disk saves (default: Young–Daly).
    #[arg(long)]
    pub disk_interval_mins: Option<f64>,
    /// The smallest share of hosts an elastic job keeps.
    #[arg(long, default_value_t = 0.5)]
    pub min_hosts_frac: f64,
    /// Steps between hatrain's snapshots.
    #[arg(long, default_value_t = 1)]
    pub snapshot_every: u32,
    /// What hatrain does with a slow host: `replace` (hands it to a
    /// standby host, or out of an elastic group, once the slowdown cost
    /// the price of the hand-over) or `report` (it is left slow).
    #[arg(long, default_value = "replace", value_parser = ["report", "replace"])]
    pub on_slow: String,
}

impl SettingArgs {
    pub fn setting(&self) -> Result<Setting> {
        if let Some(m) = self.disk_interval_mins
            && !(m.is_finite() && m > 0.0)
        {
            bail!("--disk-interval-mins {m}: must be a number of minutes > 0");
        }
        if !(self.min_hosts_frac > 0.0 && self.min_hosts_frac <= 1.0) {
            bail!(
                "--min-hosts-frac {}: must be in (0, 1]",
                self.min_hosts_frac
            );
        }
        if self.snapshot_every == 0 {
            bail!("--snapshot-every 0: a snapshot every 1 step or more");
        }
        Ok(Setting {
            standby_hosts: self.standby_hosts,
            replicas: self.replicas,
            disk_interval_s: self.disk_interval_mins.map(|m| m * 60.0),
            min_hosts_frac: self.min_hosts_frac,
            snapshot_every: self.snapshot_every,
            on_slow_replace: self.on_slow == "replace",
        })
    }
}

impl Model {
    /// The simulation's inputs, each checked; errors name the flag.
    pub fn params(&self, accelerators: u32) -> Result<Params> {
        if accelerators == 0 || self.per_host == 0 {
            bail!("--accelerators and --per-host must be at least 1");
        }
        if accelerators > MAX_ACCELERATORS {
            bail!("--accelerators {accelerators}: at most {MAX_ACCELERATORS}");
        }
        if !(self.days > 0.0 && self.days <= MAX_DAYS) {
            bail!(
                "--days {}: must be a number of days > 0 and ≤ {MAX_DAYS}",
                self.days
            );
        }
        if !(self.rate_scale.is_finite() && self.rate_scale >= 0.0) {
            bail!("--rate-scale {}: must be ≥ 0", self.rate_scale);
        }
        let d = Rates::llama3();
        let rates = Rates {
            uce: self.uce_rate.unwrap_or(d.uce),
            crash: self.crash_rate.unwrap_or(d.crash),
            hang: self.hang_rate.unwrap_or(d.hang),
            host: self.host_rate.unwrap_or(d.host),
            repair_hours: self.repair_hours.unwrap_or(d.repair_hours),
            domain: self.domain_rate.unwrap_or(d.domain),
            domain_hosts: self.domain_hosts.unwrap_or(d.domain_hosts),
            slow: self.slow_rate.unwrap_or(d.slow),
            slow_speed: self.slow_speed.unwrap_or(d.slow_speed),
            slow_hours: self.slow_hours.unwrap_or(d.slow_hours),
        }
        .scaled(self.rate_scale);
        rates
            .validate()
            .map_err(|e| anyhow::anyhow!("fault rates: {e}"))?;
        let published = Published {
            step_s: self.step_secs,
            ckpt_write_s: self.ckpt_write_secs,
            disk_load_s: self.disk_load_secs,
            init_s: self.init_secs,
            requeue_s: self.requeue_secs,
            detect_crash_s: self.detect_crash_secs,
            detect_timeout_s: self.detect_timeout_secs,
            mem_load_s: self.mem_load_secs,
            host_timeout_s: self.host_timeout_secs,
        };
        published
            .validate()
            .map_err(|e| anyhow::anyhow!("costs: {e}"))?;
        let mut measured = measured(self.costs.as_deref())?;
        if let Some((_, scaled)) = self.scaled(&measured)? {
            measured = scaled;
        }
        let shape = Shape {
            accelerators,
            per_host: self.per_host,
            span_s: self.days * 86_400.0,
        };
        let faults: f64 = kind_rates(&shape, &rates).iter().sum::<f64>() * shape.span_s;
        if faults > MAX_FAULTS {
            bail!(
                "--accelerators {accelerators}, --days {} and the fault rates give {faults:.3e} faults per run: at most {MAX_FAULTS:.0e}",
                self.days
            );
        }
        Ok(Params {
            shape,
            rates,
            published,
            measured,
        })
    }

    /// With `--state-gb`: the costs scaled to it, and what they came to.
    pub fn scaled(&self, m: &Measured) -> Result<Option<(Scaled, Measured)>> {
        let Some(state_gb) = self.state_gb else {
            return Ok(None);
        };
        if !(state_gb > 0.0 && state_gb <= 10_000.0) {
            bail!("--state-gb {state_gb}: must be a number of GB > 0 and ≤ 10000");
        }
        if !(self.spare_cores > 0.0 && self.spare_cores <= 10_000.0) {
            bail!(
                "--spare-cores {}: must be > 0 and ≤ 10000",
                self.spare_cores
            );
        }
        let Some(per_gb) = m.per_gb else {
            bail!(
                "--state-gb needs hatrain's per-GB costs (held_ms_fixed, held_ms_per_gb, snapshot_cpu_s_per_gb, replica_cpu_s_per_gb, recovery_s_per_gb, pause_state_gb), and the costs file measured on {} has none",
                m.machine
            );
        };
        let scale = Scale {
            state_gb,
            spare_cores: self.spare_cores,
        };
        let (out, why) = scale.apply(m, &per_gb, self.per_host, self.step_secs);
        Ok(Some((why, out)))
    }

    /// Threads to run on: `--threads` or every core, no more than runs.
    pub fn threads(&self) -> Result<usize> {
        let t = self.threads.unwrap_or_else(default_threads);
        if t == 0 || t > MAX_THREADS {
            bail!("--threads {t}: between 1 and {MAX_THREADS}");
        }
        Ok(t.min(usize::try_from(self.seeds).unwrap_or(usize::MAX))
            .max(1))
    }

    /// `--seeds`, at most `max`.
    fn checked_seeds(&self, max: u64) -> Result<u64> {
        if self.seeds == 0 || self.seeds > max {
            bail!("--seeds {}: between 1 and {max}", self.seeds);
        }
        Ok(self.seeds)
    }
}

/// hatrain's costs: the file the benchmarks wrote, or the checked-in ones.
fn measured(path: Option<&std::path::Path>) -> Result<Measured> {
    Ok(match path {
        Some(p) => Measured::load(p)?,
        None => Measured::checked_in(),
    })
}

/// The four policies with one setting.
pub fn cases(setting: Setting) -> Vec<(Policy, Setting)> {
    Policy::ALL.iter().map(|p| (*p, setting)).collect()
}

/// Runs one command; what it prints goes to `out`.
pub fn execute(cli: Cli, out: &mut dyn std::io::Write) -> Result<()> {
    match cli.command {
        Command::Run {
            model,
            setting,
            json,
        } => {
            let params = model.params(model.accelerators)?;
            let scaled = model
                .scaled(&measured(model.costs.as_deref())?)?
                .map(|(why, _)| why);
            let seeds = model.checked_seeds(MAX_SEEDS)?;
            let summaries = study(
                &params,
                &cases(setting.setting()?),
                model.seed,
                seeds,
                model.threads()?,
            );
            if json {
                let v = serde_json::json!({
                    "accelerators": model.accelerators,
                    "hosts": params.shape.hosts(),
                    "days": model.days,
                    "seed": model.seed,
                    "seeds": seeds,
                    "rates": params.rates,
                    "published": params.published,
                    "measured": params.measured,
                    "scaled": scaled,
                    "policies": summaries,
                });
                writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
            } else {
                writeln!(
                    out,
                    "{} accelerators ({} hosts of {}), {} days, {} seeds from {}; hatrain's costs measured on {}\n",
                    model.accelerators,
                    params.shape.hosts(),
                    model.per_host,
                    model.days,
                    seeds,
                    model.seed,
                    params.measured.machine
                )?;
                if let Some(w) = &scaled {
                    writeln!(out, "{}", report::scaled(w))?;
                }
                write!(out, "{}", report::table(&summaries))?;
            }
        }
        Command::Plan {
            model,
            target,
            min_hosts_frac,
            json,
        } => {
            if !(target > 0.0 && target < 1.0) {
                bail!("--target {target}: must be a goodput in (0, 1)");
            }
            if !(min_hosts_frac > 0.0 && min_hosts_frac <= 1.0) {
                bail!("--min-hosts-frac {min_hosts_frac}: must be in (0, 1]");
            }
            let params = model.params(model.accelerators)?;
            let p = plan(
                &params,
                target,
                min_hosts_frac,
                model.seed,
                model.checked_seeds(MAX_PLAN_SEEDS)?,
                model.threads()?,
            );
            if json {
                writeln!(out, "{}", serde_json::to_string_pretty(&p)?)?;
            } else {
                write!(out, "{}", report::plan(&p))?;
            }
        }
        Command::Chart {
            model,
            setting,
            out: png,
            sizes,
        } => {
            let setting = setting.setting()?;
            let seeds = model.checked_seeds(MAX_SEEDS)?;
            let mut lines: Vec<Line> = Policy::ALL
                .iter()
                .map(|p| Line {
                    label: p.name().into(),
                    points: Vec::new(),
                })
                .collect();
            for &n in &sizes {
                let params = model.params(n)?;
                for (i, s) in study(
                    &params,
                    &cases(setting),
                    model.seed,
                    seeds,
                    model.threads()?,
                )
                .into_iter()
                .enumerate()
                {
                    let g = s.goodput;
                    lines[i].points.push((f64::from(n), g.median, g.p10, g.p90));
                }
            }
            let title = format!(
                "goodput by cluster size: {} days, {} seeds; hatrain: {} standby hosts, replicas {}, a snapshot every {} step(s)",
                model.days, seeds, setting.standby_hosts, setting.replicas, setting.snapshot_every
            );
            goodput_by_size(&png, &title, &lines)?;
            writeln!(out, "wrote {}", png.display())?;
        }
        Command::Costs { costs } => {
            let m = measured(costs.as_deref())?;
            writeln!(out, "measured on {}", m.machine)?;
            for (k, e) in &m.entries {
                writeln!(
                    out,
                    "{k:<22} {:>9.4}  {} ({})",
                    e.value, e.source, e.measured
                )?;
            }
        }
    }
    Ok(())
}
