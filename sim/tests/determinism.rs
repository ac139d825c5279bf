//! The binary is deterministic: the same seed and options print the same bytes, and bad
//! options are refused with a message naming them.

use std::process::Command;

fn run(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_sim"))
        .args(args)
        .output()
        .expect("sim runs")
}

/// Short runs of the scenarios with every kind of event (shifts, partitions of a follower and
/// of the leader, a flapping link, a long partition that heals, a crash, an agent holder stopped
/// and killed), so the test stays quick in debug builds.
const SHORT: [&str; 26] = [
    "--duration",
    "30",
    "--warmup",
    "5",
    "--tenants",
    "6",
    "--scenario",
    "follow_the_sun",
    "--scenario",
    "partition",
    "--scenario",
    "leader_crash",
    "--scenario",
    "agent_move",
    "--scenario",
    "agent_crash",
    "--scenario",
    "leader_partition",
    "--scenario",
    "flapping",
    "--scenario",
    "heal",
    "--format",
    "csv",
    "--jobs",
    "2",
];

#[test]
fn same_seed_same_bytes() {
    let args: Vec<&str> = ["--seed", "7"]
        .iter()
        .chain(SHORT.iter())
        .copied()
        .collect();
    let a = run(&args);
    let b = run(&args);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    assert!(!a.stdout.is_empty());
    assert_eq!(
        a.stdout, b.stdout,
        "two runs with one seed printed different results"
    );
    // The thread count does not change the output either.
    let mut one_job = args.clone();
    *one_job.last_mut().unwrap() = "1";
    assert_eq!(run(&one_job).stdout, a.stdout);
    // Every scenario and strategy has a row.
    let text = String::from_utf8(a.stdout).unwrap();
    assert_eq!(text.lines().count(), 1 + 8 * 8);
}

#[test]
fn another_seed_other_arrivals() {
    let a: Vec<&str> = ["--seed", "1"]
        .iter()
        .chain(SHORT.iter())
        .copied()
        .collect();
    let b: Vec<&str> = ["--seed", "2"]
        .iter()
        .chain(SHORT.iter())
        .copied()
        .collect();
    assert_ne!(run(&a).stdout, run(&b).stdout);
}

#[test]
fn bad_options_are_named_and_refused() {
    let out = run(&["--regions", "0", "--floor", "2", "--tick-ms", "3"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for name in ["--regions", "--floor", "--tick-ms"] {
        assert!(err.contains(name), "no mention of {name} in {err}");
    }
    let out = run(&["--scenario", "no_such_scenario"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no_such_scenario"));
}

#[test]
fn out_dir_gets_csv_and_svg() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(&[
        "--duration",
        "10",
        "--warmup",
        "2",
        "--tenants",
        "4",
        "--scenario",
        "skewed",
        "--strategy",
        "quotad",
        "--strategy",
        "independent",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let results = std::fs::read_to_string(dir.path().join("results.csv")).unwrap();
    assert!(results.starts_with("scenario,strategy,overshoot_window,overshoot_1s,goodput,"));
    assert_eq!(results.lines().count(), 3);
    for f in [
        "skewed_admitted.svg",
        "skewed_overshoot.svg",
        "skewed_series.csv",
    ] {
        let body = std::fs::read_to_string(dir.path().join(f)).unwrap();
        assert!(body.len() > 100, "{f} is nearly empty");
    }
    // One labelled panel per strategy; the ideal and the budget named in the key.
    let admitted = std::fs::read_to_string(dir.path().join("skewed_admitted.svg")).unwrap();
    for label in [
        "quotad",
        "independent",
        "ideal (one global token bucket)",
        "global budget",
    ] {
        assert!(admitted.contains(label), "admitted plot lacks {label:?}");
    }
    let overshoot = std::fs::read_to_string(dir.path().join("skewed_overshoot.svg")).unwrap();
    assert!(overshoot.contains("bound: 1"));
}
