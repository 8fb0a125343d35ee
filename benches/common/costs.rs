//! The costs file the goodput simulator (`hatrain-sim`) reads: benchmarks
//! merge their measured medians into it with [`record`].
//!
//! The file is `HATRAIN_SIM_COSTS`, else `target/sim-costs.json` at the
//! workspace root:
//!
//! ```json
//! {
//!   "format": "hatrain-sim-costs",
//!   "version": 1,
//!   "machine": "2 cores, 8 GiB",
//!   "costs": {
//!     "<key>": { "value": 1.02, "source": "<how it was measured>", "measured": "YYYY-MM-DD" }
//!   }
//! }
//! ```
//!
//! Entries of other keys are kept; a file that is not of this format is
//! left alone (a warning says why, and the value is not recorded).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

const FORMAT: &str = "hatrain-sim-costs";
const VERSION: u64 = 1;

/// The whole file. Fields this version does not know are kept as they are.
#[derive(Serialize, Deserialize)]
struct CostsFile {
    format: String,
    version: u64,
    #[serde(default)]
    machine: String,
    costs: BTreeMap<String, Entry>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

/// One measured cost.
#[derive(Serialize, Deserialize)]
struct Entry {
    value: f64,
    source: String,
    measured: String,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

/// Where the costs file is: `HATRAIN_SIM_COSTS`, else
/// `<workspace root>/target/sim-costs.json`.
pub fn path() -> PathBuf {
    match std::env::var_os("HATRAIN_SIM_COSTS") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap_or(Path::new("."))
            .join("target/sim-costs.json"),
    }
}

/// This machine: "<N> cores, <M> GiB" (`available_parallelism` and
/// MemTotal of /proc/meminfo, rounded to a GiB).
pub fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .unwrap_or(0);
    let gib = (kib as f64 / (1u64 << 20) as f64).round() as u64;
    format!("{cores} cores, {gib} GiB")
}

/// Today's UTC date, YYYY-MM-DD.
fn today() -> String {
    humantime::format_rfc3339(SystemTime::now()).to_string()[..10].to_string()
}

/// The costs file at `path`; `None` when there is none.
fn load(path: &Path) -> Result<Option<CostsFile>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read it: {e}")),
    };
    let file: CostsFile = serde_json::from_str(&text)
        .map_err(|e| format!("it is not a costs file of format \"{FORMAT}\": {e}"))?;
    if file.format != FORMAT {
        return Err(format!(
            "its format is \"{}\", not \"{FORMAT}\"",
            file.format
        ));
    }
    if file.version != VERSION {
        return Err(format!("its version is {}, not {VERSION}", file.version));
    }
    Ok(Some(file))
}

/// Writes `text` to `path` through a temporary file in the same directory
/// and a rename.
fn write_atomic(path: &Path, text: &str) -> std::io::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(d) = dir {
        std::fs::create_dir_all(d)?;
    }
    let name = path.file_name().map_or("sim-costs.json".into(), |n| {
        n.to_string_lossy().into_owned()
    });
    let tmp = dir
        .unwrap_or(Path::new("."))
        .join(format!(".{name}.tmp-{}", std::process::id()));
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(text.as_bytes())?;
        f.sync_all()
    });
    match written.and_then(|()| std::fs::rename(&tmp, path)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Merges the cost `key` = `value`, measured today on this machine as
/// `source` says, into the costs file (made when absent). A file that is
/// not a costs file, or a value that is not finite, is not written: a
/// warning on stderr says why.
pub fn record(key: &str, value: f64, source: &str) {
    let path = path();
    let skip = |why: &str| {
        eprintln!(
            "warning: not recording {key} = {value} in {}: {why}",
            path.display()
        );
    };
    if !value.is_finite() {
        return skip("the value is not a finite number");
    }
    let mut file = match load(&path) {
        Ok(Some(f)) => f,
        Ok(None) => CostsFile {
            format: FORMAT.into(),
            version: VERSION,
            machine: String::new(),
            costs: BTreeMap::new(),
            other: BTreeMap::new(),
        },
        Err(why) => return skip(&format!("{why}; the file is left as it is")),
    };
    file.machine = machine();
    file.costs.insert(
        key.into(),
        Entry {
            value,
            source: source.into(),
            measured: today(),
            other: BTreeMap::new(),
        },
    );
    let text = match serde_json::to_string_pretty(&file) {
        Ok(t) => t + "\n",
        Err(e) => return skip(&format!("cannot encode it: {e}")),
    };
    match write_atomic(&path, &text) {
        Ok(()) => println!("recorded {key} = {value} in {}", path.display()),
        Err(e) => skip(&format!("cannot write it: {e}")),
    }
}
