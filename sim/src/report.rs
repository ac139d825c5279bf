//! Output: the scenario × strategy table, CSV and JSON. Everything printed to stdout comes from
//! here and depends only on the seed and the options, never on the wall clock.

use std::fmt::Write as _;

use serde::Serialize;

use crate::llm_tokens::{LlmRow, LlmRun};
use crate::metrics::Summary;
use crate::options::Format;
use crate::per_subject::{SubjectRow, SubjectRun};
use crate::simulation::ScenarioRun;
use crate::sliding_window::WindowRow;

/// The CSV header, also the column order of the table (which leaves out the raw counts).
pub const CSV_HEADER: &str = "scenario,strategy,overshoot_window,overshoot_1s,goodput,\
goodput_healthy,floor_s,false_denial_rate,goodput_converged,false_denial_converged,p50_decision_ms,p99_decision_ms,\
convergence_s,forwarded_fraction,never,decisions,admitted_tokens,ideal_tokens,\
store_calls_per_decision,store_calls_decide,store_calls_reserved,store_calls_reserve_denied,\
store_calls_refund";

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_string(), |x| format!("{x:.digits$}"))
}

/// Seconds on floors per region (`a/b/c`), or `0` when no region was ever on its floors.
fn floors(s: &Summary) -> String {
    if s.floor_s.iter().all(|&f| f == 0.0) {
        return "0".to_string();
    }
    s.floor_s
        .iter()
        .map(|f| format!("{f:.0}"))
        .collect::<Vec<_>>()
        .join("/")
}

fn conv(s: &Summary) -> String {
    match (s.demand_shifts, s.convergence_s) {
        (0, _) => "-".to_string(),
        (_, None) => "never".to_string(),
        (_, Some(x)) => format!("{x:.0}"),
    }
}

/// What `sim` prints on stdout. `table`: the suite's table, then per_subject's, the
/// sliding-window policies' and llm_tokens', each after a blank line. `csv`: one table, the
/// first that ran of the suite's, per_subject's and llm_tokens' (the options see to it that
/// the others have files of their own). `json`: one document. `windows`: the sliding-window
/// policies' rows (empty when they did not run); the CSV table leaves them out, one table
/// being one header.
pub fn render(
    format: Format,
    runs: &[ScenarioRun],
    subjects: Option<&SubjectRun>,
    windows: &[WindowRow],
    llm: Option<&LlmRun>,
) -> String {
    match format {
        Format::Table => {
            let mut parts = Vec::new();
            if !runs.is_empty() || (subjects.is_none() && llm.is_none()) {
                parts.push(table(runs));
            }
            if let Some(run) = subjects {
                parts.push(crate::per_subject::table(run));
            }
            if !windows.is_empty() {
                parts.push(crate::sliding_window::table(windows));
            }
            if let Some(run) = llm {
                parts.push(crate::llm_tokens::table(run));
            }
            parts.join("\n")
        }
        Format::Csv => match (subjects, llm) {
            (Some(run), _) if runs.is_empty() => crate::per_subject::csv(run),
            (None, Some(run)) if runs.is_empty() => crate::llm_tokens::csv(run),
            _ => csv(runs),
        },
        Format::Json => json(runs, subjects, windows, llm),
    }
}

/// A fixed-width table, one row per (scenario, strategy).
pub fn table(runs: &[ScenarioRun]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<16} {:<19} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8} {:>7} {:>7} {:>6} {:>6} {:>6} {:>6}",
        "scenario",
        "strategy",
        "over(W)",
        "over(1s)",
        "goodput",
        "good_ok",
        "floor_s",
        "false_dn",
        "fd_conv",
        "p50_ms",
        "p99_ms",
        "conv_s",
        "fwd",
        "never",
        "calls"
    );
    for run in runs {
        for s in run.strategies.iter().map(|r| &r.summary) {
            let _ = writeln!(
                out,
                "{:<16} {:<19} {:>8.3} {:>8.3} {:>8} {:>8} {:>9} {:>8} {:>8} {:>7.1} {:>7.1} {:>6} {:>6} {:>6} {:>6}",
                s.scenario,
                s.strategy,
                s.overshoot_window,
                s.overshoot_1s,
                opt(s.goodput, 3),
                opt(s.goodput_healthy, 3),
                floors(s),
                opt(s.false_denial_rate.map(|x| 100.0 * x), 2) + "%",
                opt(s.false_denial_converged.map(|x| 100.0 * x), 2) + "%",
                s.p50_decision_ms,
                s.p99_decision_ms,
                conv(s),
                opt(s.forwarded.map(|x| 100.0 * x), 1) + "%",
                s.never,
                opt(s.store_calls_per_decision(), 3),
            );
        }
    }
    out
}

fn csv_row(s: &Summary) -> String {
    let o = |v: Option<f64>| v.map_or_else(String::new, |x| format!("{x:.6}"));
    format!(
        "{},{},{:.6},{:.6},{},{},{},{},{},{},{:.3},{:.3},{},{},{},{},{},{},{},{}",
        s.scenario,
        s.strategy,
        s.overshoot_window,
        s.overshoot_1s,
        o(s.goodput),
        o(s.goodput_healthy),
        s.floor_s
            .iter()
            .map(|f| format!("{f:.1}"))
            .collect::<Vec<_>>()
            .join("/"),
        o(s.false_denial_rate),
        o(s.goodput_converged),
        o(s.false_denial_converged),
        s.p50_decision_ms,
        s.p99_decision_ms,
        match (s.demand_shifts, s.convergence_s) {
            (0, _) => String::new(),
            (_, None) => "never".to_string(),
            (_, Some(x)) => format!("{x:.0}"),
        },
        o(s.forwarded),
        s.never,
        s.decisions,
        s.admitted_tokens,
        s.ideal_tokens,
        o(s.store_calls_per_decision()),
        s.store_calls.map_or_else(
            || ",,,".to_string(),
            |c| format!(
                "{},{},{},{}",
                c.decisions, c.reserved, c.reserve_denied, c.refunds
            )
        )
    )
}

/// CSV with [`CSV_HEADER`]; an empty cell means "not defined" (no demand shift, or nothing
/// the ideal admitted); `never` means a shift never settled.
pub fn csv(runs: &[ScenarioRun]) -> String {
    let mut out = String::from(CSV_HEADER);
    out.push('\n');
    for s in runs
        .iter()
        .flat_map(|r| r.strategies.iter().map(|x| &x.summary))
    {
        out.push_str(&csv_row(s));
        out.push('\n');
    }
    out
}

/// One (scenario, strategy) row in JSON: the CSV's columns by the same names, numbers as
/// numbers, `null` where the CSV cell is empty, `floor_s` an array of seconds per region; and
/// `demand_shifts`, which tells a `null` `convergence_s` apart: no shift (0) or one that never
/// settled (the CSV's `never`).
#[derive(Debug, Serialize)]
struct JsonRow<'a> {
    scenario: &'a str,
    strategy: &'a str,
    overshoot_window: f64,
    overshoot_1s: f64,
    goodput: Option<f64>,
    goodput_healthy: Option<f64>,
    floor_s: &'a [f64],
    false_denial_rate: Option<f64>,
    goodput_converged: Option<f64>,
    false_denial_converged: Option<f64>,
    p50_decision_ms: f64,
    p99_decision_ms: f64,
    convergence_s: Option<f64>,
    demand_shifts: usize,
    forwarded_fraction: Option<f64>,
    never: u64,
    decisions: u64,
    admitted_tokens: u64,
    ideal_tokens: u64,
    store_calls_per_decision: Option<f64>,
    store_calls_decide: Option<u64>,
    store_calls_reserved: Option<u64>,
    store_calls_reserve_denied: Option<u64>,
    store_calls_refund: Option<u64>,
}

impl<'a> From<&'a Summary> for JsonRow<'a> {
    fn from(s: &'a Summary) -> Self {
        Self {
            scenario: &s.scenario,
            strategy: &s.strategy,
            overshoot_window: s.overshoot_window,
            overshoot_1s: s.overshoot_1s,
            goodput: s.goodput,
            goodput_healthy: s.goodput_healthy,
            floor_s: &s.floor_s,
            false_denial_rate: s.false_denial_rate,
            goodput_converged: s.goodput_converged,
            false_denial_converged: s.false_denial_converged,
            p50_decision_ms: s.p50_decision_ms,
            p99_decision_ms: s.p99_decision_ms,
            convergence_s: s.convergence_s,
            demand_shifts: s.demand_shifts,
            forwarded_fraction: s.forwarded,
            never: s.never,
            decisions: s.decisions,
            admitted_tokens: s.admitted_tokens,
            ideal_tokens: s.ideal_tokens,
            store_calls_per_decision: s.store_calls_per_decision(),
            store_calls_decide: s.store_calls.map(|c| c.decisions),
            store_calls_reserved: s.store_calls.map(|c| c.reserved),
            store_calls_reserve_denied: s.store_calls.map(|c| c.reserve_denied),
            store_calls_refund: s.store_calls.map(|c| c.refunds),
        }
    }
}

/// Every table in one JSON document.
#[derive(Debug, Serialize)]
struct Document<'a> {
    scenarios: Vec<JsonRow<'a>>,
    per_subject: &'a [SubjectRow],
    sliding_window: &'a [WindowRow],
    llm_tokens: &'a [LlmRow],
}

/// JSON: one document, `{"scenarios": [...], "per_subject": [...], "sliding_window": [...],
/// "llm_tokens": [...]}`, each an array of rows keyed by the names of its CSV header (the
/// sliding-window rows by their fields), an empty array for a table that did not run.
pub fn json(
    runs: &[ScenarioRun],
    subjects: Option<&SubjectRun>,
    windows: &[WindowRow],
    llm: Option<&LlmRun>,
) -> String {
    let doc = Document {
        scenarios: runs
            .iter()
            .flat_map(|r| r.strategies.iter().map(|x| JsonRow::from(&x.summary)))
            .collect(),
        per_subject: subjects.map_or(&[], |s| &s.rows),
        sliding_window: windows,
        llm_tokens: llm.map_or(&[], |l| &l.rows),
    };
    serde_json::to_string_pretty(&doc).expect("rows serialise") + "\n"
}

/// Per-second series of one scenario as CSV: the ideal's admitted tokens and requests, and per
/// strategy admitted tokens, overshoot(W) and false denials (booked per matching bin).
pub fn series_csv(run: &ScenarioRun) -> String {
    let mut out = String::from("second,budget_tokens,ideal_tokens,ideal_requests");
    for s in &run.strategies {
        let _ = write!(
            out,
            ",{0}_tokens,{0}_overshoot_w,{0}_false_denials",
            s.summary.strategy
        );
    }
    out.push('\n');
    for (i, ideal) in run.ideal_per_s.iter().enumerate() {
        let requests = run
            .strategies
            .first()
            .map_or(0, |s| s.seconds[i].shadow_requests);
        let _ = write!(out, "{i},{:.3},{ideal},{requests}", run.budget_tokens_per_s);
        for s in &run.strategies {
            let sec = &s.seconds[i];
            let _ = write!(
                out,
                ",{},{:.6},{}",
                sec.admitted_tokens, sec.overshoot_w, sec.false_denials
            );
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::regional_store::StoreCalls;

    fn summary() -> Summary {
        Summary {
            scenario: "steady".into(),
            strategy: "quotad".into(),
            overshoot_window: 1.0,
            overshoot_1s: 0.5,
            goodput: Some(0.99),
            goodput_healthy: Some(1.0),
            floor_s: vec![0.0, 2.5],
            false_denial_rate: None,
            goodput_converged: Some(1.0),
            false_denial_converged: Some(0.0),
            p50_decision_ms: 0.5,
            p99_decision_ms: 0.5,
            demand_shifts: 1,
            convergence_s: None,
            forwarded: Some(0.25),
            never: 0,
            decisions: 10,
            store_calls: Some(StoreCalls {
                decisions: 1,
                reserved: 2,
                reserve_denied: 1,
                refunds: 0,
            }),
            agents: None,
            admitted_tokens: 5,
            ideal_tokens: 6,
        }
    }

    #[test]
    fn csv_rows_match_the_header() {
        let row = csv_row(&summary());
        assert_eq!(row.split(',').count(), CSV_HEADER.split(',').count());
        assert!(row.starts_with("steady,quotad,1.000000,0.500000,0.990000,1.000000,0.0/2.5,,"));
        assert!(row.ends_with(",0.400000,1,2,1,0"));
    }

    /// A JSON row has every CSV column under the same name, and `demand_shifts`.
    #[test]
    fn json_rows_are_keyed_by_the_csv_header() {
        let s = summary();
        let v = serde_json::to_value(JsonRow::from(&s)).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        let mut want: Vec<&str> = CSV_HEADER.split(',').chain(["demand_shifts"]).collect();
        let mut got = keys.clone();
        want.sort_unstable();
        got.sort_unstable();
        assert_eq!(got, want);
        assert_eq!(v["forwarded_fraction"], 0.25);
        assert_eq!(v["false_denial_rate"], serde_json::Value::Null);
        assert_eq!(v["store_calls_reserved"], 2);
        assert_eq!(v["floor_s"], serde_json::json!([0.0, 2.5]));
    }
}
