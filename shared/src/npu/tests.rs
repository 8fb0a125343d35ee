//! The fixtures in `fixtures/`:
//! - `health-ok.txt`: Ascend's documentation of `npu-smi info -t health`;
//! - `health-alarm.txt`: MindCluster's fault-diagnosis test fixture
//!   `kg_parse/npu_info_after.txt`;
//! - `health-uce.txt` and `ecc.txt`: written in the format of the `npu-smi`
//!   source (`npu_info_print.c`: `%-40s : %u`, codes as `%04X`), since no
//!   public capture of a UCE reading exists;
//! - `health-unknown.txt`: the status of an absent device;
//! - `health-damaged-*.txt`, `health-truncated.txt`: damaged text;
//! - `torch-npu-errors.txt`: torch_npu's error texts (`NPUException.cpp`,
//!   `NPUQueue.cpp`), each after the action it must map to.

use super::*;
use proptest::prelude::*;

fn ev(device: u32, code: u32, time_ms: u64) -> DeviceEvent {
    DeviceEvent {
        device,
        code,
        severity: 2,
        assertion: 1,
        time_ms,
        name: String::new(),
    }
}

#[test]
fn the_default_table_maps_the_documented_codes() {
    let t = FaultTable::default();
    let d = t.classify(HBM_UCE, 2);
    assert_eq!(
        (d.class, d.action, d.known),
        (Class::RestartBusiness, Action::Uce, true)
    );
    assert_eq!(t.classify(0x80E1_8402, 2).action, Action::Host);
    assert_eq!(t.classify(0x80E1_8404, 2).class, Class::RestartNPU);
    assert_eq!(t.classify(0x80E1_8404, 2).action, Action::Crash);
    assert_eq!(t.classify(0x80E1_8008, 3).action, Action::Crash);
    assert_eq!(t.classify(0x80E0_1809, 3).action, Action::Ignore);
    assert_eq!(t.classify(0x40F8_4E00, 3).action, Action::Host);
    for code in UCE_SIDE_EFFECTS {
        assert_eq!(t.classify(code, 2).class, Class::RestartRequest);
    }
    // Unknown codes: MindCluster's rule on the severity.
    let minor = t.classify(0x1234_5678, 1);
    assert_eq!(
        (minor.class, minor.action, minor.known),
        (Class::NotHandleFault, Action::Ignore, false)
    );
    let major = t.classify(0x1234_5678, 2);
    assert_eq!(
        (major.class, major.action),
        (Class::SeparateNPU, Action::Host)
    );
}

#[test]
fn action_names_are_their_serialised_names() {
    for a in [
        Action::Ignore,
        Action::Uce,
        Action::Crash,
        Action::Hang,
        Action::Host,
    ] {
        assert_eq!(serde_json::to_value(a).unwrap(), a.name());
    }
}

#[test]
fn a_table_file_overrides_rows_and_windows_and_bad_files_say_what_is_wrong() {
    let file: TableFile = serde_json::from_str(
        r#"{"codes": [
            {"code": "0x80E18402", "class": "RestartNPU"},
            {"code": "8C1F860B", "class": "RestartRequest", "action": "hang", "meaning": "HCCL retry"}
        ], "side_effect_window_ms": 2000, "uce_repeat_count": 3, "uce_repeat_window_s": 60}"#,
    )
    .unwrap();
    let t = FaultTable::with_overrides(file, "t.json").unwrap();
    // The class's action when the row names none.
    assert_eq!(t.classify(0x80E1_8402, 2).action, Action::Crash);
    assert_eq!(t.classify(0x8C1F_860B, 2).action, Action::Hang);
    assert_eq!(
        t.classify(HBM_UCE, 2).action,
        Action::Uce,
        "the other defaults stay"
    );
    assert_eq!(t.side_effect_window, Duration::from_secs(2));
    assert_eq!(
        (t.uce_repeat_count, t.uce_repeat_window),
        (3, Duration::from_secs(60))
    );
    // A row is written back as it was read.
    let rows: Vec<Row> = t
        .rows()
        .map(|(code, class, action, meaning)| Row {
            code,
            class,
            action: Some(action),
            meaning: meaning.into(),
        })
        .collect();
    let again: Vec<Row> = serde_json::from_str(&serde_json::to_string(&rows).unwrap()).unwrap();
    assert_eq!(again, rows);

    let dir = tempfile::tempdir().unwrap();
    let bad = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        FaultTable::load(&p).unwrap_err().to_string()
    };
    let e = bad(
        "code.json",
        r#"{"codes": [{"code": "0x80E0180Z", "class": "RestartNPU"}]}"#,
    );
    assert!(e.contains("code.json") && e.contains("0x80E0180Z"), "{e}");
    let e = bad(
        "class.json",
        r#"{"codes": [{"code": "80E01801", "class": "Reboot"}]}"#,
    );
    assert!(e.contains("Reboot"), "{e}");
    let e = bad("field.json", r#"{"codez": []}"#);
    assert!(e.contains("codez"), "{e}");
    let e = bad(
        "twice.json",
        r#"{"codes": [{"code": "80E01801", "class": "RestartNPU"}, {"code": "0x80e01801", "class": "SeparateNPU"}]}"#,
    );
    assert!(e.contains("0x80E01801") && e.contains("twice"), "{e}");
    let e = bad("repeat.json", r#"{"uce_repeat_count": 1}"#);
    assert!(e.contains("uce_repeat_count"), "{e}");
    let e = FaultTable::load(&dir.path().join("absent.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("absent.json"), "{e}");
}

#[test]
fn side_effects_of_a_uce_are_dropped_within_the_window_on_its_device_only() {
    let mut f = Filter::new(FaultTable::default());
    assert!(matches!(f.judge(&ev(0, HBM_UCE, 10_000)), Verdict::Act(d) if d.action == Action::Uce));
    assert_eq!(
        f.judge(&ev(0, 0x80C9_8009, 13_000)),
        Verdict::Dropped("a side effect of a UCE on the same device")
    );
    // Reported a moment before the UCE (clocks of two reporters): dropped too.
    assert!(matches!(
        f.judge(&ev(0, 0x80CB_8009, 9_500)),
        Verdict::Dropped(_)
    ));
    // Another device, or later than the window: a fault of its own.
    assert!(
        matches!(f.judge(&ev(1, 0x80C9_8009, 13_000)), Verdict::Act(d) if d.action == Action::Crash)
    );
    assert!(
        matches!(f.judge(&ev(0, 0x80C9_8009, 15_001)), Verdict::Act(d) if d.action == Action::Crash)
    );
    // A recovery notice is never acted on.
    let mut recovered = ev(0, 0x80E1_8404, 20_000);
    recovered.assertion = 0;
    assert!(matches!(f.judge(&recovered), Verdict::Dropped(_)));
}

#[test]
fn repeated_uces_on_one_device_escalate_to_the_host() {
    let day = 24 * 3600 * 1000;
    let mut f = Filter::new(FaultTable::default());
    assert!(matches!(f.judge(&ev(0, HBM_UCE, 0)), Verdict::Act(_)));
    // Another device's first is its own.
    assert!(matches!(f.judge(&ev(1, HBM_UCE, 1000)), Verdict::Act(_)));
    // Device 0's second within 24 h: out.
    match f.judge(&ev(0, HBM_UCE, day - 1)) {
        Verdict::Escalated { decision, count } => {
            assert_eq!(
                (decision.class, decision.action, count),
                (Class::ManuallySeparateNPU, Action::Host, 2)
            );
        }
        v => panic!("{v:?}"),
    }
    // Device 1's second, more than 24 h after its first: a UCE again.
    assert!(
        matches!(f.judge(&ev(1, HBM_UCE, day + 1001)), Verdict::Act(d) if d.action == Action::Uce)
    );
}

#[test]
fn npu_smi_health_readings_parse_into_events_or_clear_errors() {
    let ok = parse_health(include_str!("fixtures/health-ok.txt")).unwrap();
    assert_eq!(
        ok,
        Health {
            status: HealthStatus::Ok,
            codes: vec![],
            info: vec![]
        }
    );
    assert!(health_events(&ok, 0, 0).is_empty());

    let alarm = parse_health(include_str!("fixtures/health-alarm.txt")).unwrap();
    assert_eq!(alarm.status, HealthStatus::Alarm);
    assert_eq!(alarm.codes, vec![0xA402_5021, 0x8C03_A000, 0x8C08_4E00]);
    assert_eq!(alarm.info.len(), 2, "{:?}", alarm.info);
    assert!(alarm.info[1].starts_with("node type=process-manager"));
    let evs = health_events(&alarm, 3, 77);
    assert_eq!(evs.len(), 3);
    assert!(
        evs.iter()
            .all(|e| e.device == 3 && e.severity == 2 && e.assertion == 1 && e.time_ms == 77)
    );

    let unknown = parse_health(include_str!("fixtures/health-unknown.txt")).unwrap();
    assert_eq!(unknown.status, HealthStatus::Unknown);

    // A UCE reading: the UCE acted on, its side effect dropped.
    let uce = parse_health(include_str!("fixtures/health-uce.txt")).unwrap();
    assert_eq!(uce.status, HealthStatus::Critical);
    let mut f = Filter::new(FaultTable::default());
    let verdicts: Vec<Verdict> = health_events(&uce, 0, 5)
        .iter()
        .map(|e| f.judge(e))
        .collect();
    assert!(
        matches!(verdicts[0], Verdict::Act(d) if d.action == Action::Uce),
        "{verdicts:?}"
    );
    assert!(matches!(verdicts[1], Verdict::Dropped(_)), "{verdicts:?}");

    let e = parse_health(include_str!("fixtures/health-damaged-status.txt")).unwrap_err();
    assert!(
        e.to_string().contains("line 1") && e.to_string().contains("Fine"),
        "{e}"
    );
    let e = parse_health(include_str!("fixtures/health-damaged-code.txt")).unwrap_err();
    assert!(e.to_string().contains("80E0180Z"), "{e}");
    let e = parse_health(include_str!("fixtures/health-truncated.txt")).unwrap_err();
    assert_eq!(e, NpuSmiError::Missing("Error Code"));
    assert_eq!(
        parse_health("").unwrap_err(),
        NpuSmiError::Missing("Health Status")
    );
}

#[test]
fn npu_smi_ecc_listings_parse() {
    let ecc = parse_ecc(include_str!("fixtures/ecc.txt")).unwrap();
    assert_eq!(ecc.hbm_double_bit(), Some(1));
    assert_eq!(ecc.hbm_isolated_pages(), Some(2));
    assert_eq!(ecc.counts["HBM Single Bit Aggregate Total Err Cnt"], 12);
    assert_eq!(ecc.counts["DDR Double Bit Error Count"], 0);
    assert_eq!(
        parse_ecc("npu-smi: command not found\n").unwrap_err(),
        NpuSmiError::Missing("Error Count")
    );
}

#[test]
fn torch_npu_error_texts_map_to_their_actions() {
    let mut seen = 0;
    for line in include_str!("fixtures/torch-npu-errors.txt").lines() {
        let (want, text) = line.split_once('\t').unwrap();
        let text = text.replace("\\n", "\n");
        let got = classify_text(&text).map(|(a, _)| a);
        let want = match want {
            "uce" => Some(Action::Uce),
            "crash" => Some(Action::Crash),
            "hang" => Some(Action::Hang),
            "ignore" => Some(Action::Ignore),
            "none" => None,
            w => panic!("fixture: {w}"),
        };
        assert_eq!(got, want, "{text}");
        seen += 1;
    }
    assert!(seen >= 15);
    // The words that decided are named.
    assert_eq!(
        classify_text("x UCE ERROR y"),
        Some((Action::Uce, "UCE ERROR"))
    );
}

#[test]
fn event_codes_parse_as_hex() {
    assert_eq!(parse_code("0x80E01801"), Some(HBM_UCE));
    assert_eq!(parse_code("80e01801"), Some(HBM_UCE));
    assert_eq!(parse_code(" 8C03A000 "), Some(0x8C03_A000));
    for bad in ["", "0x", "80E018011", "80E0180Z", "-1", "+1"] {
        assert_eq!(parse_code(bad), None, "{bad}");
    }
}

proptest! {
    #[test]
    fn parsers_never_panic_on_arbitrary_text(text in "\\PC{0,400}") {
        let _ = parse_health(&text);
        let _ = parse_ecc(&text);
        let _ = classify_text(&text);
        let _ = parse_code(&text);
        let _ = serde_json::from_str::<TableFile>(&text);
    }

    #[test]
    fn health_like_text_never_panics(
        lines in prop::collection::vec(
            (prop::sample::select(vec!["Health Status", "Error Code", "Error Information", "", "HBM Double Bit Error Count"]),
             "[ :A-Za-z0-9]{0,30}"),
            0..8,
        )
    ) {
        let text: String = lines.iter().map(|(n, v)| format!("\t{n} : {v}\n")).collect();
        let _ = parse_health(&text);
        let _ = parse_ecc(&text);
    }

    #[test]
    fn the_filter_never_panics_and_never_acts_on_recovery_notices(
        evs in prop::collection::vec((0u32..4, any::<u32>(), 0u8..4, 0u8..3, any::<u64>()), 0..40)
    ) {
        let mut f = Filter::new(FaultTable::default());
        for (device, code, severity, assertion, time_ms) in evs {
            let e = DeviceEvent { device, code, severity, assertion, time_ms, name: String::new() };
            let v = f.judge(&e);
            if assertion == 0 {
                prop_assert!(matches!(v, Verdict::Dropped(_)));
            }
        }
    }
}
