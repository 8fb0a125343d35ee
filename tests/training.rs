//! The reference trainer learns, is deterministic, and resumes exactly from
//! its disk checkpoints, also at another world size. Every run here is real:
//! `hatrain-agent launch` starts 2 or 4 worker processes that train over TCP.

mod common;
use common::*;

fn path_arg(flag: &str, p: &std::path::Path) -> Vec<String> {
    vec![flag.to_string(), p.display().to_string()]
}

#[test]
fn default_model_learns_toward_the_entropy_floor() {
    let d = tempfile::tempdir().unwrap();
    let log = d.path().join("log.jsonl");
    let mut args = s(&["--train-iters", "60", "--log-interval", "20"]);
    args.extend(path_arg("--log-jsonl", &log));
    let out = run_launch(4, "learn", &args);
    assert_success(&out, "training the default model");
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The floor is printed for a person and logged for machines; both agree.
    let printed: f64 = stdout
        .split("entropy rate ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|x| x.parse().ok())
        .expect("entropy rate printed");
    let log = read_log(&log);
    let floor = log[0]["entropy_floor"].as_f64().unwrap();
    assert!((printed - floor).abs() < 1e-3, "{printed} vs {floor}");
    let l = losses(&log);
    assert_eq!(l.len(), 60);
    let (first, last) = (l[0].1, l[59].1);
    assert!(
        first - last >= 0.5 * (first - floor),
        "loss went {first} -> {last}, floor {floor}: not halfway"
    );
}

#[test]
fn resume_reproduces_an_uninterrupted_run_bit_for_bit() {
    let d = tempfile::tempdir().unwrap();
    let (straight_log, resumed_log, ckpt) = (
        d.path().join("straight.jsonl"),
        d.path().join("resumed.jsonl"),
        d.path().join("ckpt"),
    );
    let mut straight = tiny_args(40);
    straight.extend(path_arg("--log-jsonl", &straight_log));
    assert_success(&run_launch(4, "straight", &straight), "straight run");

    let mut first = tiny_args(20);
    first.extend(path_arg("--save", &ckpt));
    assert_success(&run_launch(4, "first-half", &first), "first half");
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt")).unwrap(),
        "20\n"
    );

    let mut second = tiny_args(40);
    second.extend(path_arg("--load", &ckpt));
    second.extend(path_arg("--log-jsonl", &resumed_log));
    assert_success(&run_launch(4, "second-half", &second), "resumed run");

    let (a, b) = (read_log(&straight_log), read_log(&resumed_log));
    assert_eq!(
        final_checksum(&a),
        final_checksum(&b),
        "final parameters differ"
    );
    let tail: Vec<_> = losses(&a).into_iter().filter(|(s, _)| *s > 20).collect();
    let resumed = losses(&b);
    assert_eq!(resumed.len(), 20);
    for ((sa, la), (sb, lb)) in tail.iter().zip(&resumed) {
        assert_eq!(sa, sb);
        assert_eq!(
            la.to_bits(),
            lb.to_bits(),
            "loss of step {sa} differs: {la} vs {lb}"
        );
    }
}

#[test]
fn resume_at_another_world_size_continues_to_learn() {
    let d = tempfile::tempdir().unwrap();
    let (log4, log2, ckpt) = (
        d.path().join("four.jsonl"),
        d.path().join("two.jsonl"),
        d.path().join("ckpt"),
    );
    let mut first = tiny_args(30);
    first.extend(path_arg("--save", &ckpt));
    first.extend(path_arg("--log-jsonl", &log4));
    assert_success(&run_launch(4, "save4", &first), "4-rank run");
    let mut second = tiny_args(70);
    second.extend(path_arg("--load", &ckpt));
    second.extend(path_arg("--log-jsonl", &log2));
    let out = run_launch(2, "load2", &second);
    assert_success(&out, "2-rank resume");
    assert!(String::from_utf8_lossy(&out.stdout).contains("saved by 4 rank(s)"));

    let (a, b) = (read_log(&log4), read_log(&log2));
    assert_eq!(b[0]["resumed_from"], 30);
    assert_eq!(b[0]["world_size"], 2);
    let at_save = losses(&a).last().unwrap().1;
    let l = losses(&b);
    assert_eq!(l.first().unwrap().0, 31);
    // The first resumed step continues from the saved weights (a fresh model
    // would start near ln 64 = 4.16) and training keeps improving.
    assert!(
        (l[0].1 - at_save).abs() < 0.3,
        "resumed at {} after {at_save}",
        l[0].1
    );
    let tail_mean = l[l.len() - 10..].iter().map(|x| x.1).sum::<f64>() / 10.0;
    assert!(
        tail_mean < at_save,
        "loss {at_save} at the save, {tail_mean} at the end"
    );
}

#[test]
fn same_seed_same_world_gives_identical_runs() {
    let d = tempfile::tempdir().unwrap();
    let mut sums = Vec::new();
    for i in 0..2 {
        let log = d.path().join(format!("{i}.jsonl"));
        let mut args = tiny_args(15);
        args.extend(path_arg("--log-jsonl", &log));
        assert_success(&run_launch(2, "det", &args), "run");
        sums.push((final_checksum(&read_log(&log)), losses(&read_log(&log))));
    }
    assert_eq!(sums[0], sums[1]);
}
