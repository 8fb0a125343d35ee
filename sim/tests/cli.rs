//! The binary as a user meets it: tables, JSON, the planner, the chart,
//! and clear errors for bad input.

use std::process::{Command, Output};

fn sim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hatrain-sim"))
        .args(args)
        .env_remove("HATRAIN_SIM_COSTS")
        .output()
        .expect("hatrain-sim runs")
}

fn stdout(o: &Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn refused(o: &Output) -> String {
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8(o.stderr.clone()).unwrap()
}

const SMALL: [&str; 6] = ["--accelerators", "1024", "--days", "20", "--seeds", "8"];

#[test]
fn run_prints_every_policy_and_json_says_the_same_twice_over() {
    let mut args = vec!["run"];
    args.extend(SMALL);
    let table = stdout(&sim(&args));
    for name in [
        "disk restart ",
        "memory restart ",
        "hatrain  ",
        "hatrain elastic ",
    ] {
        assert_eq!(
            table.lines().filter(|l| l.starts_with(name)).count(),
            2,
            "{name:?}: a row in each table: {table}"
        );
    }
    assert!(table.contains(" redone "), "{table}");
    args.push("--json");
    let a = stdout(&sim(&args));
    let b = stdout(&sim(&args));
    assert_eq!(a, b, "the same seed prints the same JSON");
    let v: serde_json::Value = serde_json::from_str(&a).unwrap();
    let policies = v["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 4);
    for p in policies {
        let g = p["goodput"]["median"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&g), "{p}");
    }
    args.extend(["--seed", "2"]);
    let c: serde_json::Value = serde_json::from_str(&stdout(&sim(&args))).unwrap();
    assert_ne!(c["policies"], v["policies"], "another seed, other faults");
}

#[test]
fn plan_names_a_setting_or_what_stands_in_the_way() {
    // 97% is within reach at the published rates, and out of it when
    // every rate is a thousandfold (at a hundredfold the measured costs
    // decide: with a cheap enough step, a setting still reaches it).
    let mut args = vec!["plan", "--target", "0.97"];
    args.extend(SMALL);
    let out = stdout(&sim(&args));
    assert!(out.starts_with("cheapest setting reaching 97.00%"), "{out}");
    args.extend(["--rate-scale", "1000"]);
    let out = stdout(&sim(&args));
    assert!(out.contains("what stands in the way:"), "{out}");
}

#[test]
fn chart_writes_a_png() {
    let d = tempfile::tempdir().unwrap();
    let png = d.path().join("g.png");
    let out = stdout(&sim(&[
        "chart",
        "--out",
        png.to_str().unwrap(),
        "--sizes",
        "1024,4096",
        "--days",
        "10",
        "--seeds",
        "4",
    ]));
    assert!(out.contains("wrote"), "{out}");
    assert_eq!(&std::fs::read(&png).unwrap()[..8], b"\x89PNG\r\n\x1a\n");
}

#[test]
fn bad_input_is_refused_with_its_name() {
    let e = refused(&sim(&["run", "--days", "0"]));
    assert!(e.contains("--days 0"), "{e}");
    let e = refused(&sim(&["run", "--seeds", "0"]));
    assert!(e.contains("--seeds 0"), "{e}");
    let e = refused(&sim(&["run", "--uce-rate=-1"]));
    assert!(e.contains("rate uce"), "{e}");
    let e = refused(&sim(&["plan", "--target", "1.5"]));
    assert!(e.contains("--target 1.5"), "{e}");
    let e = refused(&sim(&["run", "--days", "1e305"]));
    assert!(e.contains("--days"), "{e}");
    let e = refused(&sim(&["run", "--uce-rate", "1e308"]));
    assert!(e.contains("rate uce"), "{e}");
    let e = refused(&sim(&["run", "--accelerators", "4000000000"]));
    assert!(e.contains("--accelerators"), "{e}");
    let e = refused(&sim(&[
        "run",
        "--accelerators",
        "10000000",
        "--days",
        "3650",
    ]));
    assert!(e.contains("faults per run"), "{e}");
    let e = refused(&sim(&["run", "--seeds", "18446744073709551615"]));
    assert!(e.contains("--seeds"), "{e}");
    let e = refused(&sim(&["plan", "--seeds", "100000"]));
    assert!(e.contains("--seeds 100000"), "{e}");
    let e = refused(&sim(&["run", "--threads", "1000000"]));
    assert!(e.contains("--threads"), "{e}");
    let e = refused(&sim(&["run", "--step-secs", "NaN"]));
    assert!(e.contains("step_s"), "{e}");
    let e = refused(&sim(&["run", "--init-secs", "1e308"]));
    assert!(e.contains("init_s"), "{e}");
    let e = refused(&sim(&["run", "--repair-hours", "1e305"]));
    assert!(e.contains("repair_hours"), "{e}");
    let e = refused(&sim(&["run", "--costs", "/nonexistent/costs.json"]));
    assert!(e.contains("/nonexistent/costs.json"), "{e}");

    let d = tempfile::tempdir().unwrap();
    let bad = d.path().join("costs.json");
    let mut v: serde_json::Value = serde_json::from_str(hatrain_sim::costs::DEFAULT_COSTS).unwrap();
    v["costs"].as_object_mut().unwrap().remove("grow_pause_s");
    std::fs::write(&bad, v.to_string()).unwrap();
    let e = refused(&sim(&["costs", "--costs", bad.to_str().unwrap()]));
    assert!(
        e.contains("grow_pause_s") && e.contains("--bench elastic"),
        "{e}"
    );
    std::fs::write(&bad, b"\x00\xff not json").unwrap();
    let e = refused(&sim(&["run", "--costs", bad.to_str().unwrap()]));
    assert!(e.contains("is not hatrain-sim-costs JSON"), "{e}");
    assert_eq!(
        std::fs::read(&bad).unwrap(),
        b"\x00\xff not json",
        "left as it was"
    );
}

#[test]
fn costs_lists_every_figure_with_its_bench() {
    let out = stdout(&sim(&["costs"]));
    assert!(out.starts_with("measured on "), "{out}");
    assert_eq!(out.matches("cargo bench").count(), 16, "{out}");
}

fn json(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&stdout(&sim(args))).unwrap()
}

fn step_ratio(v: &serde_json::Value, policy: &str) -> f64 {
    v["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["policy"] == policy)
        .and_then(|p| p["step_ratio"].as_f64())
        .unwrap_or_else(|| panic!("no {policy} in {v}"))
}

#[test]
fn a_run_scaled_to_a_state_size_says_so_and_costs_more_as_spare_cores_get_scarce() {
    let mut args = vec!["run"];
    args.extend(SMALL);
    args.push("--json");
    let measured = json(&args);
    assert!(measured["scaled"].is_null(), "{measured}");
    args.extend(["--state-gb", "10"]);
    let with = |cores: &'static str| {
        let mut a = args.clone();
        a.extend(["--spare-cores", cores]);
        json(&a)
    };
    let (plenty, scarce) = (with("64"), with("1"));
    let s = &plenty["scaled"];
    assert_eq!(s["scale"]["state_gb"], 10.0, "{s}");
    assert!(s["copy_s"].as_f64().unwrap() > 0.0, "{s}");
    // Recoveries grow with the state.
    let crash = |v: &serde_json::Value| v["measured"]["crash_pause_s"].as_f64().unwrap();
    assert!(crash(&plenty) > crash(&measured), "{plenty}");
    // Fewer spare cores never make a step cheaper, and one core cannot
    // copy 80 GB a step in a 10 s step.
    assert!(step_ratio(&scarce, "hatrain") > step_ratio(&plenty, "hatrain"));
    assert!(step_ratio(&scarce, "hatrain") > 1.5, "{scarce}");
    assert_eq!(step_ratio(&plenty, "disk"), 1.0);

    let mut table_args = vec!["run"];
    table_args.extend(SMALL);
    table_args.extend(["--state-gb", "10"]);
    let table = stdout(&sim(&table_args));
    assert!(
        table.contains("scaled to 10 GB of state per accelerator"),
        "{table}"
    );

    // Bad scales, and costs without their per-GB parts, are refused by name.
    let e = refused(&sim(&["run", "--state-gb", "0"]));
    assert!(e.contains("--state-gb 0"), "{e}");
    let e = refused(&sim(&["run", "--state-gb", "10", "--spare-cores=-1"]));
    assert!(e.contains("--spare-cores -1"), "{e}");
    let d = tempfile::tempdir().unwrap();
    let old = d.path().join("costs.json");
    let mut v: serde_json::Value = serde_json::from_str(hatrain_sim::costs::DEFAULT_COSTS).unwrap();
    for key in [
        "held_ms_fixed",
        "held_ms_per_gb",
        "snapshot_cpu_s_per_gb",
        "replica_cpu_s_per_gb",
        "recovery_s_per_gb",
        "pause_state_gb",
    ] {
        v["costs"].as_object_mut().unwrap().remove(key);
    }
    std::fs::write(&old, v.to_string()).unwrap();
    let mut old_args = vec!["run", "--state-gb", "10", "--costs", old.to_str().unwrap()];
    old_args.extend(SMALL);
    let e = refused(&sim(&old_args));
    assert!(e.contains("recovery_s_per_gb"), "{e}");
}
