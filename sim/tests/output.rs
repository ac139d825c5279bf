//! What the binary prints, read by stock readers: `--format csv` is one table that Python's
//! `csv` module loads (with the very command sim/README.md shows), `--format json` one
//! document holding both tables, and an output that cannot be written is refused before the
//! run, without a panic.

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

/// A run with both tables that a debug build finishes in well under a second: two scenarios
/// (one a partition), two strategies, few tenants and subjects.
const SMALL: [&str; 18] = [
    "--duration",
    "20",
    "--warmup",
    "5",
    "--tenants",
    "4",
    "--subjects",
    "500",
    "--scenario",
    "steady",
    "--scenario",
    "partition",
    "--scenario",
    "per_subject",
    "--strategy",
    "independent",
    "--strategy",
    "quotad",
];
/// Rows of the suite's table in [`SMALL`]: scenarios × strategies.
const SUITE_ROWS: usize = 2 * 2;
/// Rows of per_subject's table: its two classes × its four strategies.
const SUBJECT_ROWS: usize = 2 * 4;

fn sim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sim"))
        .args(args)
        .output()
        .expect("sim runs")
}

/// `sim` with [`SMALL`] and `extra`, which must succeed; its stdout.
fn sim_ok(extra: &[&str]) -> String {
    let args: Vec<&str> = SMALL.iter().chain(extra).copied().collect();
    let out = sim(&args);
    assert!(
        out.status.success(),
        "sim {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// Runs `python3 -c program` with `stdin`; its exit status, stdout and stderr.
fn python(program: &str, stdin: &str) -> (bool, String, String) {
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(program)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(stdin.as_bytes())
        .expect("python3 reads its stdin");
    let out = child.wait_with_output().expect("python3 ends");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// With Python's `csv` module: the input is one table (every row as wide as the header, the
/// header never repeated); prints the header, then the number of rows.
const ONE_TABLE: &str = r#"
import csv, sys
rows = list(csv.reader(sys.stdin))
header = rows[0]
assert all(len(r) == len(header) for r in rows), [len(r) for r in rows]
assert header not in rows[1:], "a second header"
print(",".join(header))
print(len(rows) - 1)
"#;

/// The header and row count of `csv`, checked by [`ONE_TABLE`].
fn one_table(csv: &str) -> (String, usize) {
    let (ok, stdout, stderr) = python(ONE_TABLE, csv);
    assert!(ok, "not one table:\n{stderr}\n{csv}");
    let (header, rows) = stdout.trim_end().split_once('\n').expect("two lines");
    (header.to_string(), rows.parse().expect("a count"))
}

/// The Python program of sim/README.md's example that loads the suite's CSV.
fn readme_load_command() -> String {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("sim/README.md");
    let (_, after) = readme
        .split_once("<!-- tests/output.rs: load-csv -->")
        .expect("sim/README.md marks the example that loads the CSV");
    let block = after
        .split("```")
        .nth(1)
        .expect("a code block after the marker");
    let line = block
        .lines()
        .find_map(|l| l.strip_prefix("python3 -c '"))
        .expect("a python3 -c '...' line");
    let (program, redirect) = line.split_once('\'').expect("a closing quote");
    assert_eq!(
        redirect.trim(),
        "< suite.csv",
        "the example reads suite.csv"
    );
    program.to_string()
}

#[test]
fn csv_is_one_table_that_pythons_csv_module_loads() {
    let dir = tempfile::tempdir().unwrap();
    let subjects_path = dir.path().join("per_subject.csv");
    let stdout = sim_ok(&[
        "--format",
        "csv",
        "--per-subject-csv",
        subjects_path.to_str().unwrap(),
    ]);
    assert_eq!(
        one_table(&stdout),
        (sim::report::CSV_HEADER.into(), SUITE_ROWS)
    );
    let subjects = std::fs::read_to_string(&subjects_path).unwrap();
    assert_eq!(
        one_table(&subjects),
        (sim::per_subject::CSV_HEADER.into(), SUBJECT_ROWS)
    );

    // The checker refuses the two tables in one stream.
    let (ok, _, _) = python(ONE_TABLE, &format!("{stdout}{subjects}"));
    assert!(!ok, "two tables passed for one");

    // sim/README.md's example loads it and names the worst row.
    let (ok, printed, stderr) = python(&readme_load_command(), &stdout);
    assert!(ok, "the README's example failed:\n{stderr}");
    let worst = stdout
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect::<Vec<_>>())
        .reduce(|a, b| {
            // The first of equal rows, as Python's max() keeps.
            let x = |r: &[&str]| r[2].parse::<f64>().unwrap();
            if x(&b) > x(&a) {
                b
            } else {
                a
            }
        })
        .unwrap();
    assert_eq!(
        printed.trim_end(),
        format!(
            "{SUITE_ROWS} rows; worst overshoot(W): {} {} {}",
            worst[2], worst[0], worst[1]
        )
    );
}

#[test]
fn per_subject_alone_is_the_csv_table() {
    let out = sim(&[
        "--duration",
        "20",
        "--subjects",
        "500",
        "--scenario",
        "per_subject",
        "--format",
        "csv",
    ]);
    assert!(out.status.success());
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        one_table(&stdout),
        (sim::per_subject::CSV_HEADER.into(), SUBJECT_ROWS)
    );
}

/// `sim --format csv` with nothing more (the default suite, per_subject included) is one table:
/// per_subject, with nowhere to go, does not run, and stderr says how to get it.
#[test]
fn csv_alone_is_the_suites_table_and_says_where_per_subject_goes() {
    let args: Vec<&str> = SMALL.iter().copied().chain(["--format", "csv"]).collect();
    let out = sim(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("--per-subject-csv"), "{stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        one_table(&stdout),
        (sim::report::CSV_HEADER.into(), SUITE_ROWS)
    );
}

/// The keys of every object in `rows`, which must be the same for all.
fn keys(rows: &[Value]) -> Vec<String> {
    let mut first: Vec<String> = rows[0].as_object().unwrap().keys().cloned().collect();
    first.sort();
    for r in rows {
        let mut k: Vec<String> = r.as_object().unwrap().keys().cloned().collect();
        k.sort();
        assert_eq!(k, first, "rows with different keys");
    }
    first
}

fn sorted(names: impl Iterator<Item = &'static str>) -> Vec<String> {
    let mut v: Vec<String> = names.map(String::from).collect();
    v.sort();
    v
}

#[test]
fn json_is_one_document_with_both_tables_named_as_in_csv() {
    let doc: Value = serde_json::from_str(&sim_ok(&["--format", "json"])).expect("one document");
    let top: Vec<&String> = doc.as_object().expect("an object").keys().collect();
    assert_eq!(
        top,
        ["llm_tokens", "per_subject", "scenarios", "sliding_window"]
    );
    let scenarios = doc["scenarios"].as_array().unwrap();
    let subjects = doc["per_subject"].as_array().unwrap();
    assert_eq!(
        (scenarios.len(), subjects.len()),
        (SUITE_ROWS, SUBJECT_ROWS)
    );
    assert_eq!(
        keys(scenarios),
        sorted(sim::report::CSV_HEADER.split(',').chain(["demand_shifts"]))
    );
    assert_eq!(
        keys(subjects),
        sorted(sim::per_subject::CSV_HEADER.split(','))
    );

    // The same rows, in the same order, with the same values as the CSV (to its precision).
    let dir = tempfile::tempdir().unwrap();
    let subjects_path = dir.path().join("per_subject.csv");
    let csv = sim_ok(&[
        "--format",
        "csv",
        "--per-subject-csv",
        subjects_path.to_str().unwrap(),
    ]);
    let subjects_csv = std::fs::read_to_string(&subjects_path).unwrap();
    for (csv, rows) in [(&csv, scenarios), (&subjects_csv, subjects)] {
        let mut lines = csv.lines();
        let header: Vec<&str> = lines.next().unwrap().split(',').collect();
        for (line, row) in lines.zip(rows) {
            for (name, cell) in header.iter().zip(line.split(',')) {
                let v = &row[*name];
                match (cell.parse::<f64>(), v) {
                    (Ok(x), Value::Number(n)) => assert!(
                        (x - n.as_f64().unwrap()).abs() < 1e-4,
                        "{name}: CSV {cell}, JSON {n}"
                    ),
                    (_, Value::String(s)) => assert_eq!(s, cell, "{name}"),
                    (_, Value::Null) => {
                        assert!(
                            cell.is_empty() || cell == "never",
                            "{name}: CSV {cell}, JSON null"
                        )
                    }
                    (_, Value::Array(a)) => assert_eq!(a.len(), cell.split('/').count(), "{name}"),
                    _ => panic!("{name}: CSV {cell}, JSON {v}"),
                }
            }
        }
    }

    // A table that did not run is an empty array.
    let out = sim(&[
        "--duration",
        "5",
        "--tenants",
        "2",
        "--scenario",
        "steady",
        "--strategy",
        "quotad",
        "--format",
        "json",
    ]);
    let doc: Value = serde_json::from_slice(&out.stdout).expect("one document");
    assert_eq!(doc["scenarios"].as_array().unwrap().len(), 1);
    assert_eq!(doc["per_subject"], Value::Array(vec![]));
    assert_eq!(doc["llm_tokens"], Value::Array(vec![]));
}

/// Exit code 1, a message naming `path`, no panic, nothing on stdout.
fn assert_refused(out: &Output, path: &Path) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&path.display().to_string()), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(out.stdout.is_empty(), "the run went ahead");
}

#[test]
fn outputs_that_cannot_be_written_are_refused_before_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no/such/dir/per_subject.csv");
    let args: Vec<&str> = SMALL
        .iter()
        .copied()
        .chain(["--format", "csv", "--per-subject-csv"])
        .chain([missing.to_str().unwrap()])
        .collect();
    assert_refused(&sim(&args), &missing);

    // A directory under a file.
    let file = dir.path().join("a_file");
    std::fs::write(&file, "").unwrap();
    let under_file = file.join("out");
    let args: Vec<&str> = SMALL
        .iter()
        .copied()
        .chain(["--out", under_file.to_str().unwrap()])
        .collect();
    assert_refused(&sim(&args), &under_file);

    // A per_subject file with no per_subject run is refused as an option (exit code 2).
    let out = sim(&["--scenario", "steady", "--per-subject-csv", "p.csv"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--per-subject-csv needs the per_subject scenario"),
        "{stderr}"
    );
}

/// `llm_tokens` alone prints its own table as CSV, and JSON carries its rows under its CSV's
/// names; with the suite's CSV on stdout it runs only with `--out`, into `llm_tokens.csv`.
#[test]
fn llm_tokens_prints_its_own_csv_and_json_rows() {
    let small = [
        "--duration",
        "20",
        "--warmup",
        "5",
        "--tenants",
        "2",
        "--scenario",
        "llm_tokens",
    ];
    let run = |extra: &[&str]| {
        let args: Vec<&str> = small.iter().chain(extra).copied().collect();
        let out = sim(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let csv = run(&["--format", "csv"]);
    assert_eq!(one_table(&csv), (sim::llm_tokens::CSV_HEADER.into(), 4));
    let doc: Value = serde_json::from_str(&run(&["--format", "json"])).expect("one document");
    let rows = doc["llm_tokens"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    assert_eq!(keys(rows), sorted(sim::llm_tokens::CSV_HEADER.split(',')));
    assert_eq!(doc["scenarios"], Value::Array(vec![]));

    // Beside the suite's CSV it has no place on stdout: a note, or a file with --out.
    let both = [
        "--scenario",
        "steady",
        "--strategy",
        "quotad",
        "--format",
        "csv",
    ];
    let out = sim(&small.iter().chain(&both).copied().collect::<Vec<_>>());
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("llm_tokens did not run"));
    let dir = tempfile::tempdir().unwrap();
    let args: Vec<&str> = small
        .iter()
        .chain(&both)
        .copied()
        .chain(["--out", dir.path().to_str().unwrap()])
        .collect();
    let out = sim(&args);
    assert!(out.status.success());
    assert_eq!(
        one_table(&String::from_utf8(out.stdout).unwrap()).0,
        sim::report::CSV_HEADER
    );
    let file = std::fs::read_to_string(dir.path().join("llm_tokens.csv")).unwrap();
    assert_eq!(one_table(&file), (sim::llm_tokens::CSV_HEADER.into(), 4));
}
