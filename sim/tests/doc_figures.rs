//! The figures the docs quote are the simulator's. README.md, docs/architecture.md and
//! sim/README.md's own prose quote the default suite's tables in sim/README.md; each quote is
//! rebuilt here from those tables and must appear in the doc as written. The tables come from
//! `cargo run --release -p sim` (minutes in a debug build), so the run checked here is
//! sim/README.md's quick one: its command must print its table, byte for byte.

use std::path::Path;
use std::process::Command;

fn read(path: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The text between the first two fences after `marker`: the code block that follows it.
fn block_after<'a>(md: &'a str, marker: &str) -> &'a str {
    let (_, after) = md
        .split_once(marker)
        .unwrap_or_else(|| panic!("no {marker:?}"));
    let body = after.split("```").nth(1).expect("a code block");
    body.split_once('\n').expect("a fence line").1
}

/// A fixed-width table as printed by `sim`: whitespace-separated cells under a header.
struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// Parses the lines from the one starting with `first_column` on.
    fn parse(block: &str, first_column: &str) -> Self {
        let mut lines = block
            .lines()
            .skip_while(|l| !l.starts_with(first_column))
            .map(|l| l.split_whitespace().map(String::from).collect::<Vec<_>>());
        let header = lines.next().expect("a header");
        let rows: Vec<_> = lines.filter(|r| !r.is_empty()).collect();
        assert!(!rows.is_empty(), "no rows under {header:?}");
        assert!(rows.iter().all(|r| r.len() == header.len()));
        Self { header, rows }
    }

    fn col(&self, name: &str) -> usize {
        self.header
            .iter()
            .position(|h| h == name)
            .unwrap_or_else(|| panic!("no column {name}"))
    }

    /// The cell in column `name` of the row whose first two cells are `key`, without a `%`.
    fn cell(&self, key: (&str, &str), name: &str) -> &str {
        let c = self.col(name);
        let row = self
            .rows
            .iter()
            .find(|r| (r[0].as_str(), r[1].as_str()) == key)
            .unwrap_or_else(|| panic!("no row {key:?}"));
        row[c].trim_end_matches('%')
    }

    /// The rows whose second cell is `strategy`, as (first cell, cell in column `name`).
    fn column_of(&self, strategy: &str, name: &str) -> Vec<(&str, &str)> {
        let c = self.col(name);
        self.rows
            .iter()
            .filter(|r| r[1] == strategy)
            .map(|r| (r[0].as_str(), r[c].trim_end_matches('%')))
            .collect()
    }

    /// The largest figure of `strategy` in column `name` and the first row reaching it, as
    /// the docs quote it: "1.201 (`leader_partition`)".
    fn worst(&self, strategy: &str, name: &str) -> String {
        let cells = self.column_of(strategy, name);
        let (first, value) = cells
            .iter()
            .fold(cells[0], |a, &b| if num(b.1) > num(a.1) { b } else { a });
        format!("{value} (`{first}`)")
    }

    /// The smallest and largest figure of `strategy` in column `name` over `rows`: "0.64–1.00".
    fn range(&self, strategy: &str, rows: &[&str], name: &str) -> String {
        let cells: Vec<&str> = rows
            .iter()
            .map(|r| self.cell((r, strategy), name))
            .collect();
        let min = cells.iter().min_by(|a, b| num(a).total_cmp(&num(b)));
        let max = cells.iter().max_by(|a, b| num(a).total_cmp(&num(b)));
        format!("{}–{}", min.unwrap(), max.unwrap())
    }

    /// The largest figure of `strategy` over columns `names`, in every row.
    fn max(&self, strategy: &str, names: &[&str]) -> f64 {
        names
            .iter()
            .flat_map(|n| self.column_of(strategy, n))
            .map(|(_, v)| num(v))
            .fold(f64::MIN, f64::max)
    }
}

fn num(cell: &str) -> f64 {
    cell.parse()
        .unwrap_or_else(|_| panic!("{cell:?} is not a number"))
}

/// One decimal, as the docs round a percentage from the table: "13.67" → "13.7".
fn pct1(cell: &str) -> String {
    format!("{:.1}", num(cell))
}

/// The doc's text with every run of whitespace (line breaks included) one space.
fn flat(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn suite() -> Table {
    Table::parse(
        block_after(&read("sim/README.md"), "## The default suite"),
        "scenario",
    )
}

fn subjects() -> Table {
    Table::parse(
        block_after(&read("sim/README.md"), "## Per-subject limits"),
        "class",
    )
}

/// sim/README.md's quick run: its command and the table it prints.
fn quick_run() -> (String, String) {
    let md = read("sim/README.md");
    let marker = "<!-- tests/doc_figures.rs: quick-run -->";
    let command = block_after(&md, marker).trim().to_string();
    let (_, after) = md.split_once(marker).unwrap();
    let (_, after_command) = after.split_once("```\n\n").expect("the command's block");
    (command, block_after(after_command, "").to_string())
}

fn quick() -> Table {
    Table::parse(&quick_run().1, "scenario")
}

/// Every quote in `doc` is there as written.
fn assert_quoted(doc: &str, quotes: &[String]) {
    let text = flat(&read(doc));
    let missing: Vec<&String> = quotes
        .iter()
        .filter(|q| !text.contains(q.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "{doc} does not quote the simulator's figures as sim/README.md's tables give them; \
         expected (whitespace aside):\n  {}",
        missing
            .iter()
            .map(|q| q.as_str())
            .collect::<Vec<_>>()
            .join("\n  ")
    );
}

/// Skewed and shifting demand, and leader loss: where the docs quote quotad's false denials.
const SHIFTING: [&str; 4] = ["skewed", "follow_the_sun", "leader_crash", "clock_drift"];

#[test]
fn readme_quotes_the_suite_tables() {
    let t = suite();
    let s = subjects();
    for strategy in ["quotad", "quotad_reserved"] {
        assert!(
            t.max(strategy, &["over(W)", "over(1s)"]) <= 1.0,
            "{strategy} above 1.000 while the docs say it never is"
        );
    }
    let scenarios = {
        let mut v: Vec<&str> = t.rows.iter().map(|r| r[0].as_str()).collect();
        v.dedup();
        v.len()
    };
    let strategies = t.rows.len() / scenarios;
    let ps = |strategy: &str, name: &str| s.cell(("api", strategy), name).to_string();
    let mut quotes = vec![
        format!("{scenarios} scenarios × {strategies} strategies"),
        format!(
            "| independent regional buckets | {} |",
            t.worst("independent", "over(W)")
        ),
        format!(
            "| one global store | {} | p50 {} ms outside its home; {} % false denials when a \
             region is cut off |",
            t.worst("global_store", "over(W)"),
            num(t.cell(("steady", "global_store"), "p50_ms")).floor(),
            pct1(t.cell(("partition", "global_store"), "false_dn"))
        ),
        format!(
            "| the same allocator without leases | {} |",
            t.worst("rebalance_no_lease", "over(W)")
        ),
        "| **quotad** | **≤ 1.000 in every scenario** |".to_string(),
        format!(
            "{} % false denials under skewed and shifting demand and leader loss",
            t.range("quotad", &SHIFTING, "false_dn")
        ),
        format!(
            "(`small_budget`, `slow_budget`: {} % and {} %)",
            t.cell(("small_budget", "quotad"), "false_dn"),
            t.cell(("slow_budget", "quotad"), "false_dn")
        ),
        "(`quotad_reserved`) | ≤ 1.000 in every scenario |".to_string(),
        format!(
            "(goodput {}, {} % false denials; there is no floor by default)",
            t.cell(("partition", "quotad"), "goodput"),
            pct1(t.cell(("partition", "quotad"), "false_dn"))
        ),
    ];
    for (label, strategy, entries) in [
        (
            "every region the whole limit (`local`)",
            "local",
            "none".to_string(),
        ),
        ("1/N a region (`even`)", "even", "none".to_string()),
        (
            "one share vector per plan and policy (`class_shares`)",
            "class_shares",
            ps("class_shares", "entries"),
        ),
    ] {
        quotes.push(format!(
            "| {label} | {} | {} % | {entries} |",
            ps(strategy, "over(W)"),
            ps(strategy, "false_dn")
        ));
    }
    quotes.push(format!(
        "| **{}** | **{} %** | **{} ({} % of subjects)** |",
        ps("quotad", "over(W)"),
        ps("quotad", "false_dn"),
        ps("quotad", "entries"),
        ps("quotad", "entries%")
    ));
    assert_quoted("README.md", &quotes);
}

#[test]
fn architecture_quotes_the_suite_table() {
    let t = suite();
    assert!(t.max("quotad", &["over(W)"]) <= 1.0);
    assert_quoted(
        "docs/architecture.md",
        &[format!(
            "quotad stays at or below 1.000 overshoot over the policy window in every scenario, \
             partition and leader crash included, where the same allocator without leases \
             reaches {} under a partition",
            t.cell(("partition", "rebalance_no_lease"), "over(W)")
        )],
    );
}

#[test]
fn sim_readme_prose_quotes_its_tables() {
    let t = suite();
    let s = subjects();
    let q = quick();
    let nl = |table: &Table, scenario: &str| {
        table
            .cell((scenario, "rebalance_no_lease"), "over(W)")
            .to_string()
    };
    let quotes = [
        format!(
            "`independent` reaches N×: {} over(W) under `retry_storm`, {} with a hot tenant, {} \
             over 1 s in `minute_bursts`",
            t.cell(("retry_storm", "independent"), "over(W)"),
            t.cell(("hot_tenant", "independent"), "over(W)"),
            t.cell(("minute_bursts", "independent"), "over(1s)")
        ),
        format!(
            "(goodput {}, {}% false denials; fail-open",
            t.cell(("partition", "global_store"), "goodput"),
            pct1(t.cell(("partition", "global_store"), "false_dn"))
        ),
        format!(
            "overshoots to **{}** in `partition` and **{}** in `leader_partition`",
            nl(&t, "partition"),
            nl(&t, "leader_partition")
        ),
        format!(
            "goodput is {} of the ideal and false denials {}% ({}% once converged); it settles \
             {} s after each follow-the-sun move and {} s after a leader crash",
            t.range("quotad", &SHIFTING, "goodput"),
            t.range("quotad", &SHIFTING, "false_dn"),
            t.range("quotad", &SHIFTING, "fd_conv"),
            t.cell(("follow_the_sun", "quotad"), "conv_s"),
            t.cell(("leader_crash", "quotad"), "conv_s")
        ),
        format!(
            "(`partition`: goodput {}, {}% false denials)",
            t.cell(("partition", "quotad"), "goodput"),
            pct1(t.cell(("partition", "quotad"), "false_dn"))
        ),
        format!(
            "when `rebalance_no_lease` reaches {:.2}",
            t.max("rebalance_no_lease", &["over(W)"])
        ),
        format!(
            "over(W) {}, healthy goodput {}, region 1 never on its floors",
            t.cell(("agent_move", "quotad"), "over(W)"),
            t.cell(("agent_move", "quotad"), "good_ok")
        ),
        format!(
            "Goodput is {} and false denials {}% ({}% once converged), settling {} s after demand \
             moves",
            t.cell(("agent_move", "quotad"), "goodput"),
            t.cell(("agent_move", "quotad"), "false_dn"),
            t.cell(("agent_move", "quotad"), "fd_conv"),
            t.cell(("agent_move", "quotad"), "conv_s")
        ),
        format!(
            "keeps the bound (over(W) {}, region 1 never on its floors) but costs the other \
             regions more than a release: healthy goodput {} (",
            t.cell(("agent_crash", "quotad"), "over(W)"),
            t.cell(("agent_crash", "quotad"), "good_ok")
        ),
        format!(
            "goodput {} and false denials {}% ({}% once converged), settling {} s after demand \
             moves. A killed daemon",
            t.cell(("agent_crash", "quotad"), "goodput"),
            t.cell(("agent_crash", "quotad"), "false_dn"),
            t.cell(("agent_crash", "quotad"), "fd_conv"),
            t.cell(("agent_crash", "quotad"), "conv_s")
        ),
        format!(
            "Without leases (`rebalance_no_lease`) nothing waits (healthy goodput {})",
            t.cell(("agent_crash", "rebalance_no_lease"), "good_ok")
        ),
        format!(
            "worst subject {} of its window budget (≤ 1.02), {}% false denials (≤ 1%), {} \
             coordinator entries ({}% of subjects, ≤ 1%)",
            s.cell(("api", "quotad"), "over(W)"),
            s.cell(("api", "quotad"), "false_dn"),
            s.cell(("api", "quotad"), "entries"),
            s.cell(("api", "quotad"), "entries%")
        ),
        format!(
            "without leases {} and {} against the full suite's {} and {}",
            nl(&q, "partition"),
            nl(&q, "leader_partition"),
            nl(&t, "partition"),
            nl(&t, "leader_partition")
        ),
    ];
    assert_quoted("sim/README.md", &quotes);
    for scenario in ["agent_move", "agent_crash"] {
        assert_eq!(
            t.cell((scenario, "quotad"), "floor_s"),
            "0",
            "sim/README.md says no region of {scenario} goes on its floors"
        );
    }
    assert!(
        num(t.cell(("agent_crash", "quotad"), "good_ok"))
            < num(t.cell(("agent_move", "quotad"), "good_ok")),
        "sim/README.md says a crash costs the other regions more than a graceful move"
    );
}

/// sim/README.md's quick run prints its table: the command is taken from the README and run
/// as written (the debug build prints what the release build printed).
#[test]
fn the_quick_run_prints_its_table() {
    let (command, expected) = quick_run();
    let (cargo, args) = command
        .split_once(" -- ")
        .expect("a cargo run command with arguments");
    assert_eq!(cargo, "cargo run --release -p sim");
    let out = Command::new(env!("CARGO_BIN_EXE_sim"))
        .args(args.split_whitespace())
        .output()
        .expect("sim runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        printed, expected,
        "`{command}` no longer prints sim/README.md's table: run it and update the table and \
         the figures quoted from it"
    );
}
