//! Finds the project's binaries (`hatrain-agent`, `agentctl`,
//! `hatrain-train`, ...) for the demo, the scenario tests and the
//! benchmarks, which start them as the real processes they are.
//!
//! Run from cargo (`cargo run`, `cargo test`, `cargo bench` set `CARGO`),
//! every binary of the workspace is built first, once per process, in the
//! caller's profile, so a test never runs a stale binary of another crate;
//! cargo prints its progress on stderr as usual. Otherwise the binaries are
//! looked for beside the running executable, then on `PATH`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

#[derive(Debug, Clone, thiserror::Error)]
pub enum BinError {
    #[error("`{command}` failed: {detail}")]
    Build { command: String, detail: String },
    #[error(
        "cannot find the {name} binary (looked beside {beside} and on PATH; build it with `cargo build --release`)"
    )]
    NotFound { name: String, beside: String },
}

/// The workspace's root manifest (this crate sits one level below it).
fn manifest() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap_or(Path::new("."))
        .join("Cargo.toml")
}

/// Builds every workspace binary and returns their paths by name.
fn build(cargo: &str) -> Result<HashMap<String, PathBuf>, BinError> {
    let mut cmd = Command::new(cargo);
    cmd.arg("build")
        .arg("--manifest-path")
        .arg(manifest())
        .args([
            "--workspace",
            "--bins",
            "--message-format=json-render-diagnostics",
        ]);
    if !cfg!(debug_assertions) {
        cmd.arg("--release");
    }
    let command = format!("{cmd:?}");
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| BinError::Build {
            command: command.clone(),
            detail: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(BinError::Build {
            command,
            detail: format!("{} (its errors are above)", out.status),
        });
    }
    let mut bins = HashMap::new();
    for line in out.stdout.split(|b| *b == b'\n') {
        let Ok(msg) = serde_json::from_slice::<serde_json::Value>(line) else {
            continue;
        };
        let is_bin = msg["target"]["kind"]
            .as_array()
            .is_some_and(|k| k.iter().any(|k| k == "bin"));
        if msg["reason"] == "compiler-artifact"
            && is_bin
            && let (Some(name), Some(exe)) =
                (msg["target"]["name"].as_str(), msg["executable"].as_str())
        {
            bins.insert(name.to_string(), PathBuf::from(exe));
        }
    }
    Ok(bins)
}

/// The path of the project binary `name`.
pub fn locate(name: &str) -> Result<PathBuf, BinError> {
    static BUILT: OnceLock<Result<HashMap<String, PathBuf>, BinError>> = OnceLock::new();
    if let Ok(cargo) = std::env::var("CARGO") {
        let built = BUILT
            .get_or_init(|| build(&cargo))
            .as_ref()
            .map_err(Clone::clone)?;
        if let Some(p) = built.get(name) {
            return Ok(p.clone());
        }
    }
    let exe = std::env::current_exe().ok();
    let beside = exe.as_deref().and_then(Path::parent);
    // A test or bench executable lives in target/<profile>/deps/.
    let candidates = beside
        .into_iter()
        .flat_map(|d| {
            [
                d.join(name),
                d.parent().map(|p| p.join(name)).unwrap_or_default(),
            ]
        })
        .chain(
            std::env::var_os("PATH")
                .iter()
                .flat_map(std::env::split_paths)
                .map(|d| d.join(name))
                .collect::<Vec<_>>(),
        );
    for c in candidates {
        if c.is_file() {
            return Ok(c);
        }
    }
    Err(BinError::NotFound {
        name: name.to_string(),
        beside: beside.map_or("?".into(), |d| d.display().to_string()),
    })
}
