//! The agent's modules in layers: a module may use the modules of its own
//! layer's lower neighbours and below, never one above. The test below
//! reads the sources and holds the crate to it, so that no circle of
//! imports comes back.
//!
//! ```text
//!  8  launch serve exec            the verbs
//!  7  job                          the event loop of one host's part
//!  6  settings                     flags and environment -> config
//!  5  config                       LaunchConfig, worker specs, errors
//!  4  supervisor                   spawning and reaping the workers
//!  3  shim replicator coordinator  exec shims' side, peer replicas, membership
//!  2  persister cli spec           checkpoints, argument types, worker specs
//!  1  output recovery              worker output, the recovery machine
//!  0  reaper oom limits faults jobdir control notify metrics slow
//! ```

/// Each module's layer (the table above).
pub const LAYERS: &[(&str, u8)] = &[
    ("reaper", 0),
    ("oom", 0),
    ("limits", 0),
    ("faults", 0),
    ("jobdir", 0),
    ("control", 0),
    ("notify", 0),
    ("metrics", 0),
    ("slow", 0),
    ("output", 1),
    ("recovery", 1),
    ("persister", 2),
    ("cli", 2),
    ("spec", 2),
    ("shim", 3),
    ("replicator", 3),
    ("coordinator", 3),
    ("supervisor", 4),
    ("config", 5),
    ("settings", 6),
    ("job", 7),
    ("launch", 8),
    ("serve", 8),
    ("exec", 8),
];

#[cfg(test)]
mod tests {
    use super::LAYERS;
    use std::collections::BTreeSet;
    use std::path::Path;

    /// The modules `crate::NAME` names in the production code of `src`
    /// (comments and `#[cfg(test)]` modules left out).
    fn uses(src: &str) -> BTreeSet<String> {
        let code = src.split("#[cfg(test)]").next().unwrap_or("");
        let mut out = BTreeSet::new();
        for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
            let mut rest = line;
            while let Some(at) = rest.find("crate::") {
                rest = &rest[at + "crate::".len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                out.insert(name);
            }
        }
        out
    }

    fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                files(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }

    #[test]
    fn no_module_uses_one_of_a_higher_layer() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let layer = |m: &str| LAYERS.iter().find(|(n, _)| *n == m).map(|(_, l)| *l);
        let mut all = Vec::new();
        files(&src, &mut all);
        let mut wrong = Vec::new();
        for path in all {
            let rel = path.strip_prefix(&src).unwrap();
            let top = rel
                .components()
                .next()
                .unwrap()
                .as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string();
            if ["lib", "main", "bin", "layers"].contains(&top.as_str()) {
                continue;
            }
            let own = layer(&top).unwrap_or_else(|| panic!("module {top} has no layer"));
            let text = std::fs::read_to_string(&path).unwrap();
            for used in uses(&text) {
                if used == top {
                    continue;
                }
                match layer(&used) {
                    Some(l) if l > own => wrong.push(format!(
                        "{} (layer {own}) uses crate::{used} (layer {l})",
                        rel.display()
                    )),
                    _ => {}
                }
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    /// The machines decide on the instant and the facts they are given:
    /// the single-host recovery machine (`recovery/`) and the job's
    /// controller (`job/decider*`) read no clock, no file and no socket in
    /// their production code.
    #[test]
    fn the_machines_read_no_clock_no_disk_and_no_socket() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut all = vec![src.join("job/decider.rs")];
        files(&src.join("job/decider"), &mut all);
        files(&src.join("recovery"), &mut all);
        let forbidden = [
            "Instant",
            "SystemTime",
            "std::fs",
            "fs::",
            "File::",
            "tokio",
            "std::net",
            "zmq",
        ];
        let mut wrong = Vec::new();
        for path in all {
            let rel = path.strip_prefix(&src).unwrap().display().to_string();
            let name = path.file_name().unwrap().to_string_lossy();
            // Test modules: a simulated cluster, a simulated job.
            if name == "tests.rs" || rel.contains("/tests/") || rel.contains("/sim") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap_or("");
            for (n, line) in code.lines().enumerate() {
                if line.trim_start().starts_with("//") {
                    continue;
                }
                for f in forbidden.iter().filter(|f| line.contains(*f)) {
                    wrong.push(format!("{rel}:{}: {f}: {}", n + 1, line.trim()));
                }
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }
}
