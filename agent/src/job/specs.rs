//! The worker specs of a host's ranks, and of the ranks it takes over.

use crate::config::LaunchConfig;
use crate::supervisor::WorkerSpec;
use std::collections::BTreeSet;

/// The worker specs of the ranks named.
pub(super) type SpecsFor<'a> = Box<dyn Fn(&[usize]) -> Vec<WorkerSpec> + 'a>;

/// The worker specs of the ranks named, with the job's variables `extra`
/// beside torchrun's. A rank's spec is the one its original node gives it:
/// a rank keeps its number, its local rank and its environment on
/// whichever host plays it (a standby that took it, or the standby after
/// that).
pub(super) fn specs_for<'a>(
    cfg: &'a LaunchConfig,
    (master_port, workers_store): (u16, std::net::SocketAddr),
    run_dir: &std::path::Path,
    extra: [(&'static str, String); 3],
) -> SpecsFor<'a> {
    let run_dir = run_dir.to_path_buf();
    Box::new(move |ranks| {
        let per_node = cfg.nproc_per_node.max(1);
        let nodes: BTreeSet<usize> = ranks.iter().map(|r| r / per_node).collect();
        let mut specs: Vec<WorkerSpec> = nodes
            .into_iter()
            .flat_map(|node| {
                let mut of = cfg.clone();
                of.node_rank = node;
                of.worker_specs(
                    &cfg.master_addr,
                    master_port,
                    workers_store,
                    &run_dir,
                    |k| cfg.env_var(k),
                )
            })
            .filter(|s| ranks.contains(&s.rank))
            .collect();
        for s in &mut specs {
            s.env
                .extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
        }
        specs
    })
}
