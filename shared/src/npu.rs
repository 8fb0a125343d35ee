//! Ascend NPU faults, in hatrain's terms: the fault table that maps the
//! driver's event codes (DCMI, `npu-smi`) to MindCluster's fault classes
//! and to hatrain's actions, the filter that drops a UCE's side effects and
//! escalates repeated UCEs, the error texts torch_npu raises in a worker,
//! and the output of `npu-smi info -t health` and `-t ecc`.
//!
//! Sources of the facts below (public): MindCluster's
//! `component/ascend-device-plugin/build/faultCode.json` (the classes),
//! its device plugin's `HbmFaultManager` and clusterd's `uceaccompany`
//! (side effects within 5 s of a UCE), `faultCustomization.json` (a UCE
//! twice in 24 h goes to manual isolation); torch_npu's
//! `csrc/core/npu/NPUException.cpp` (the texts); the CANN driver's
//! `npu-smi` source, `npu_info_print.c` (the output formats).
//!
//! Everything here is pure: no device, no library, no process. The agent's
//! fault sources feed it.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

/// What hatrain does about a fault on a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Nothing: logged only.
    Ignore,
    /// An uncorrectable memory error: the ranks on the device repair the
    /// step from their snapshot (or a replica).
    Uce,
    /// The ranks on the device are rebooted in place.
    Crash,
    /// The watchdog's path: the ranks on the device are taken as hung.
    Hang,
    /// The device is lost to the job: its host is treated as lost.
    Host,
}

impl Action {
    /// Its name, as in the table file and `agentctl faults`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ignore => "ignore",
            Self::Uce => "uce",
            Self::Crash => "crash",
            Self::Hang => "hang",
            Self::Host => "host",
        }
    }
}

/// MindCluster's fault classes (`faultCode.json`), and the escalation class
/// of repeated faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Class {
    NotHandleFault,
    RestartRequest,
    RestartBusiness,
    FreeRestartNPU,
    RestartNPU,
    SeparateNPU,
    PreSeparateNPU,
    SubHealthFault,
    ManuallySeparateNPU,
}

impl Class {
    /// hatrain's action for a code of this class that the table does not
    /// name otherwise.
    pub fn action(self) -> Action {
        match self {
            Self::NotHandleFault | Self::PreSeparateNPU | Self::SubHealthFault => Action::Ignore,
            Self::RestartRequest
            | Self::RestartBusiness
            | Self::FreeRestartNPU
            | Self::RestartNPU => Action::Crash,
            Self::SeparateNPU | Self::ManuallySeparateNPU => Action::Host,
        }
    }
}

/// DCMI's multi-bit ECC error on an HBM access: the UCE.
pub const HBM_UCE: u32 = 0x80E0_1801;
/// AI core and vector core bus errors that follow a UCE.
pub const UCE_SIDE_EFFECTS: [u32; 2] = [0x80C9_8009, 0x80CB_8009];

/// The codes the table ships with: (code, class, action, meaning).
const DEFAULT_CODES: [(u32, Class, Action, &str); 9] = [
    (
        HBM_UCE,
        Class::RestartBusiness,
        Action::Uce,
        "multi-bit ECC error on an HBM access (UCE)",
    ),
    (
        0x80E0_1809,
        Class::NotHandleFault,
        Action::Ignore,
        "HBM patrol scrub found a multi-bit error",
    ),
    (
        0x80E1_8400,
        Class::NotHandleFault,
        Action::Ignore,
        "multi-bit error reported with its host pid",
    ),
    (
        0x80E1_8402,
        Class::SeparateNPU,
        Action::Host,
        "isolated HBM lines reached 64",
    ),
    (
        0x80E1_8404,
        Class::RestartNPU,
        Action::Crash,
        "UCE storm shielding",
    ),
    (
        0x80E1_8008,
        Class::RestartNPU,
        Action::Crash,
        "HBM controller multi-bit error",
    ),
    (
        0x80C9_8009,
        Class::RestartRequest,
        Action::Crash,
        "AI core bus error",
    ),
    (
        0x80CB_8009,
        Class::RestartRequest,
        Action::Crash,
        "vector core bus error",
    ),
    // A dropped card has no device left for a rank restarted in place.
    (
        0x40F8_4E00,
        Class::RestartNPU,
        Action::Host,
        "card drop (inter-board heartbeat lost)",
    ),
];

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Row {
    /// The event code, as 8 hex digits (`0x` optional).
    #[serde(with = "hex_code")]
    pub code: u32,
    pub class: Class,
    /// Defaults to the class's action.
    #[serde(default)]
    pub action: Option<Action>,
    #[serde(default)]
    pub meaning: String,
}

mod hex_code {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(code: &u32, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("0x{code:08X}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
        let text = String::deserialize(d)?;
        super::parse_code(&text).ok_or_else(|| {
            serde::de::Error::custom(format!("{text:?} is not an event code (8 hex digits)"))
        })
    }
}

/// Parses an event code: up to 8 hex digits, `0x` optional.
pub fn parse_code(text: &str) -> Option<u32> {
    let t = text.trim();
    let t = t
        .strip_prefix("0x")
        .or_else(|| t.strip_prefix("0X"))
        .unwrap_or(t);
    if t.is_empty() || t.len() > 8 || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(t, 16).ok()
}

/// The file `--fault-table` reads: rows that replace or add to the
/// defaults, and the filter's windows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableFile {
    #[serde(default)]
    pub codes: Vec<Row>,
    /// Side effects this long after a UCE on the same device are dropped.
    #[serde(default)]
    pub side_effect_window_ms: Option<u64>,
    /// This many UCEs on one device within `uce_repeat_window_s` take the
    /// device out (its host is treated as lost).
    #[serde(default)]
    pub uce_repeat_count: Option<u32>,
    #[serde(default)]
    pub uce_repeat_window_s: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error("fault table {path}: cannot read it")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("fault table {path}: {source}")]
    Parse {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("fault table {path}: code 0x{code:08X} is listed twice")]
    Duplicate { path: String, code: u32 },
    #[error("fault table {path}: uce_repeat_count must be at least 2 (got {got})")]
    Repeat { path: String, got: u32 },
}

/// How a fault was judged: its class, the action, and whether the table
/// named its code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    pub class: Class,
    pub action: Action,
    pub known: bool,
}

/// Event codes → classes → actions, and the filter's windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultTable {
    rows: BTreeMap<u32, (Class, Action, String)>,
    pub side_effect_window: Duration,
    pub uce_repeat_count: u32,
    pub uce_repeat_window: Duration,
}

impl Default for FaultTable {
    fn default() -> Self {
        Self {
            rows: DEFAULT_CODES
                .iter()
                .map(|&(code, class, action, meaning)| (code, (class, action, meaning.to_string())))
                .collect(),
            side_effect_window: Duration::from_secs(5),
            uce_repeat_count: 2,
            uce_repeat_window: Duration::from_secs(24 * 3600),
        }
    }
}

impl FaultTable {
    /// The defaults with `file`'s rows and windows over them; `path` names
    /// the file in errors.
    pub fn with_overrides(file: TableFile, path: &str) -> Result<Self, TableError> {
        let mut t = Self::default();
        let mut seen = std::collections::BTreeSet::new();
        for row in file.codes {
            if !seen.insert(row.code) {
                return Err(TableError::Duplicate {
                    path: path.into(),
                    code: row.code,
                });
            }
            let action = row.action.unwrap_or_else(|| row.class.action());
            t.rows.insert(row.code, (row.class, action, row.meaning));
        }
        if let Some(ms) = file.side_effect_window_ms {
            t.side_effect_window = Duration::from_millis(ms);
        }
        if let Some(n) = file.uce_repeat_count {
            if n < 2 {
                return Err(TableError::Repeat {
                    path: path.into(),
                    got: n,
                });
            }
            t.uce_repeat_count = n;
        }
        if let Some(s) = file.uce_repeat_window_s {
            t.uce_repeat_window = Duration::from_secs(s);
        }
        Ok(t)
    }

    /// Reads a `--fault-table` file (JSON, [`TableFile`]).
    pub fn load(path: &std::path::Path) -> Result<Self, TableError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| TableError::Read {
            path: name.clone(),
            source,
        })?;
        let file: TableFile = serde_json::from_str(&text).map_err(|source| TableError::Parse {
            path: name.clone(),
            source,
        })?;
        Self::with_overrides(file, &name)
    }

    /// The rows, code order: (code, class, action, meaning).
    pub fn rows(&self) -> impl Iterator<Item = (u32, Class, Action, &str)> {
        self.rows
            .iter()
            .map(|(&c, (class, action, m))| (c, *class, *action, m.as_str()))
    }

    /// How `code`, reported at DCMI `severity` (0 warning, 1 minor, 2
    /// major, 3 critical), is handled. A code the table does not name is
    /// MindCluster's NotHandleFault at warning or minor severity, else
    /// SeparateNPU.
    pub fn classify(&self, code: u32, severity: u8) -> Decision {
        match self.rows.get(&code) {
            Some(&(class, action, _)) => Decision {
                class,
                action,
                known: true,
            },
            None => {
                let class = if severity <= 1 {
                    Class::NotHandleFault
                } else {
                    Class::SeparateNPU
                };
                Decision {
                    class,
                    action: class.action(),
                    known: false,
                }
            }
        }
    }
}

/// A fault event of one device, as DCMI reports it (`dcmi_dms_fault_event`)
/// or as the `npu-smi` and polling sources make it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceEvent {
    /// The logical device id.
    pub device: u32,
    pub code: u32,
    /// 0 warning, 1 minor, 2 major, 3 critical.
    pub severity: u8,
    /// 0 recovered, 1 raised, 2 one-off.
    pub assertion: u8,
    /// When it was raised, in milliseconds (the source's clock).
    pub time_ms: u64,
    #[serde(default)]
    pub name: String,
}

/// What the filter made of an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Acted on.
    Act(Decision),
    /// Escalated: the `count`-th UCE on the device within the window.
    Escalated { decision: Decision, count: u32 },
    /// Not acted on, and why.
    Dropped(&'static str),
}

/// The table applied to a stream of events: recovered events are dropped,
/// a UCE's side effects within the window are dropped, and repeated UCEs on
/// one device escalate to [`Action::Host`].
#[derive(Debug, Clone)]
pub struct Filter {
    table: FaultTable,
    /// Per device, the times of its recent UCEs (oldest first).
    uces: HashMap<u32, VecDeque<u64>>,
}

impl Filter {
    pub fn new(table: FaultTable) -> Self {
        Self {
            table,
            uces: HashMap::new(),
        }
    }

    pub fn table(&self) -> &FaultTable {
        &self.table
    }

    pub fn judge(&mut self, ev: &DeviceEvent) -> Verdict {
        if ev.assertion == 0 {
            return Verdict::Dropped("a recovery notice, not a fault");
        }
        let window = u64::try_from(self.table.side_effect_window.as_millis()).unwrap_or(u64::MAX);
        if UCE_SIDE_EFFECTS.contains(&ev.code)
            && self
                .uces
                .get(&ev.device)
                .is_some_and(|t| t.iter().any(|&at| ev.time_ms.abs_diff(at) <= window))
        {
            return Verdict::Dropped("a side effect of a UCE on the same device");
        }
        let decision = self.table.classify(ev.code, ev.severity);
        if decision.action != Action::Uce {
            return Verdict::Act(decision);
        }
        let keep = u64::try_from(self.table.uce_repeat_window.as_millis()).unwrap_or(u64::MAX);
        let times = self.uces.entry(ev.device).or_default();
        times.retain(|&at| ev.time_ms.saturating_sub(at) <= keep);
        times.push_back(ev.time_ms);
        let count = u32::try_from(times.len()).unwrap_or(u32::MAX);
        if count >= self.table.uce_repeat_count {
            return Verdict::Escalated {
                decision: Decision {
                    class: Class::ManuallySeparateNPU,
                    action: Action::Host,
                    known: decision.known,
                },
                count,
            };
        }
        Verdict::Act(decision)
    }
}

/// How a torch_npu error text (a worker's stderr, or the exception the
/// binding caught) is handled: the action and the words that decided it.
/// `None` when the text is not an NPU fault.
pub fn classify_text(text: &str) -> Option<(Action, &'static str)> {
    // Checked in this order: a deliberate stop first (it is not a fault
    // even when a fault's words follow it), then the named errors, then
    // the bare error codes.
    const WORDS: [(&str, Action); 10] = [
        ("FORCE STOP", Action::Ignore),
        ("UCE ERROR", Action::Uce),
        ("HBM MULTI BIT ECC", Action::Uce),
        ("SUSPECT MEM ERROR", Action::Crash),
        ("HCCS LINK ERROR", Action::Crash),
        ("UB LINK ERROR", Action::Crash),
        ("HCCL OP RETRY FAILED", Action::Crash),
        ("SUSPECT REMOTE ERROR", Action::Crash),
        ("EI0002", Action::Hang),
        ("ARF FINISH", Action::Ignore),
    ];
    for (w, a) in WORDS {
        if text.contains(w) {
            return Some((a, w));
        }
    }
    let code = text
        .match_indices("error code is ")
        .filter_map(|(i, m)| {
            let rest = &text[i + m.len()..];
            let digits: &str = &rest[..rest.bytes().take_while(u8::is_ascii_digit).count()];
            digits.parse::<u32>().ok()
        })
        .next()?;
    match code {
        507053 | 507054 => Some((Action::Uce, "error code 507053/507054")),
        507055..=507057 | 507904 => Some((Action::Crash, "error code 507055-507057/507904")),
        507046..=507048 => Some((Action::Hang, "error code 507046-507048")),
        _ => None,
    }
}

/// `Health Status` of `npu-smi info -t health`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum HealthStatus {
    Ok,
    Warning,
    Alarm,
    Critical,
    /// The device is absent or not started.
    Unknown,
}

impl HealthStatus {
    /// The DCMI severity that a code reported under this status has.
    pub fn severity(self) -> u8 {
        match self {
            Self::Ok | Self::Warning => 0,
            Self::Alarm => 2,
            Self::Critical | Self::Unknown => 3,
        }
    }
}

/// `npu-smi info -t health -i N -c 0`, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    pub status: HealthStatus,
    pub codes: Vec<u32>,
    /// The `Error Information` lines (without `NA`).
    pub info: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NpuSmiError {
    #[error("npu-smi output has no {0:?} line")]
    Missing(&'static str),
    #[error("npu-smi output line {line}: {what}: {text:?}")]
    Bad {
        line: usize,
        what: &'static str,
        text: String,
    },
}

/// A `name : value` line: both sides trimmed. A line with an empty name
/// continues the one before.
fn name_value(line: &str) -> Option<(&str, &str)> {
    let (n, v) = line.split_once(':')?;
    Some((n.trim(), v.trim()))
}

/// Parses `npu-smi info -t health -i N -c 0`.
pub fn parse_health(text: &str) -> Result<Health, NpuSmiError> {
    let mut status = None;
    let mut codes = None;
    let mut info = Vec::new();
    let mut in_info = false;
    for (i, line) in text.lines().enumerate() {
        let Some((name, value)) = name_value(line) else {
            continue;
        };
        let bad = |what, text: &str| NpuSmiError::Bad {
            line: i + 1,
            what,
            text: text.chars().take(200).collect(),
        };
        match name {
            "Health Status" => {
                in_info = false;
                status = Some(match value {
                    "OK" => HealthStatus::Ok,
                    "Warning" => HealthStatus::Warning,
                    "Alarm" => HealthStatus::Alarm,
                    "Critical" => HealthStatus::Critical,
                    "UNKNOWN" | "Unknown" => HealthStatus::Unknown,
                    _ => return Err(bad("unknown health status", value)),
                });
            }
            "Error Code" => {
                in_info = false;
                codes = Some(if value == "NA" || value.is_empty() {
                    Vec::new()
                } else {
                    value
                        .split_whitespace()
                        .map(|c| parse_code(c).ok_or_else(|| bad("not an error code", c)))
                        .collect::<Result<Vec<_>, _>>()?
                });
            }
            "Error Information" => {
                in_info = true;
                if value != "NA" && !value.is_empty() {
                    info.push(value.to_string());
                }
            }
            "" if in_info => info.push(value.to_string()),
            _ => in_info = false,
        }
    }
    Ok(Health {
        status: status.ok_or(NpuSmiError::Missing("Health Status"))?,
        codes: codes.ok_or(NpuSmiError::Missing("Error Code"))?,
        info,
    })
}

/// The events a health reading of `device` stands for, at `time_ms`: one
/// per error code, raised, at the status's severity.
pub fn health_events(h: &Health, device: u32, time_ms: u64) -> Vec<DeviceEvent> {
    h.codes
        .iter()
        .map(|&code| DeviceEvent {
            device,
            code,
            severity: h.status.severity(),
            assertion: 1,
            time_ms,
            name: h.info.first().cloned().unwrap_or_default(),
        })
        .collect()
}

/// `npu-smi info -t ecc -i N`, parsed: every `name : count` line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ecc {
    pub counts: BTreeMap<String, u64>,
}

impl Ecc {
    /// `HBM Double Bit Error Count` (volatile: cleared when the host
    /// reboots); a rise confirms a UCE.
    pub fn hbm_double_bit(&self) -> Option<u64> {
        self.counts.get("HBM Double Bit Error Count").copied()
    }

    /// `HBM Double Bit Isolated Pages Count`, or the single count the
    /// older tools print.
    pub fn hbm_isolated_pages(&self) -> Option<u64> {
        self.counts
            .get("HBM Double Bit Isolated Pages Count")
            .or_else(|| self.counts.get("HBM Isolated Pages Count"))
            .copied()
    }
}

/// Parses `npu-smi info -t ecc -i N`. Lines that are not `name : number`
/// (a title, a chip header, `NA`) are skipped; a file with no count at all
/// is an error.
pub fn parse_ecc(text: &str) -> Result<Ecc, NpuSmiError> {
    let mut ecc = Ecc::default();
    for line in text.lines() {
        let Some((name, value)) = name_value(line) else {
            continue;
        };
        if name.is_empty() {
            continue;
        }
        if let Ok(n) = value.parse::<u64>() {
            ecc.counts.insert(name.to_string(), n);
        }
    }
    if ecc.counts.is_empty() {
        return Err(NpuSmiError::Missing("Error Count"));
    }
    Ok(ecc)
}

#[cfg(test)]
mod tests;
