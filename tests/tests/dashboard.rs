//! The Grafana dashboard `deploy/grafana/quotad.json` imports as it is and explains itself. Its
//! queries run against a real Prometheus scraping a real cluster in `alerts.rs`; here, what
//! needs no cluster:
//!
//! - a `datasource` variable of type Prometheus, used by every panel, target and variable, and
//!   a multi-value `region` variable from `label_values(…, region)`;
//! - every panel has a title, a description and a unit, a unique id and its own place on the
//!   grid; every target a unique `refId` and an `expr`;
//! - counters and histogram series are read through `rate`/`increase`, gauges never;
//! - every query follows the `region` selection, unless its description says why not.

use quotad_system_tests::grafana::{self, BUILT_IN_VARIABLES};
use quotad_system_tests::prometheus::metric_names;
use serde_json::Value;

fn text(v: &Value) -> &str {
    v.as_str().unwrap_or_default()
}

#[test]
fn the_dashboard_uses_a_prometheus_datasource_variable_and_a_region_variable() -> anyhow::Result<()>
{
    let d = grafana::load_dashboard()?;
    let schema = d["schemaVersion"].as_u64().unwrap_or_default();
    assert!((36..=41).contains(&schema), "schemaVersion {schema}");
    assert!(
        d["id"].is_null(),
        "an id would clash on import: {}",
        d["id"]
    );
    assert!(!text(&d["uid"]).is_empty() && !text(&d["title"]).is_empty());

    let ds = grafana::variable(&d, "datasource").expect("a `datasource` variable");
    assert_eq!(
        (text(&ds["type"]), text(&ds["query"])),
        ("datasource", "prometheus")
    );
    let region = grafana::variable(&d, "region").expect("a `region` variable");
    assert_eq!(region["datasource"]["uid"], "${datasource}");
    let (metric, label) =
        grafana::label_values(text(&region["definition"])).expect("label_values(…, region)");
    assert_eq!(label, "region");
    assert!(metric.starts_with("quotad_"), "{metric}");
    assert_eq!(region["query"]["query"], region["definition"]);
    assert_eq!(region["multi"], true);
    assert_eq!(region["includeAll"], true);
    assert_eq!(region["allValue"], ".*");
    // Nothing else: the queries are substituted with these and the built-in ones only.
    let names: Vec<&str> = d["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|v| text(&v["name"]))
        .collect();
    assert_eq!(names, ["datasource", "region"]);
    Ok(())
}

#[test]
fn every_panel_has_a_title_description_unit_and_its_own_place() -> anyhow::Result<()> {
    let d = grafana::load_dashboard()?;
    let panels = grafana::panels(&d);
    let mut ids = Vec::new();
    let mut cells = std::collections::HashMap::new();
    let mut overlaps = std::collections::BTreeSet::new();
    let mut problems = Vec::new();
    for p in &panels {
        let title = text(&p["title"]);
        ids.push(p["id"].as_u64().unwrap_or_default());
        let g = &p["gridPos"];
        let [x, y, w, h] = ["x", "y", "w", "h"].map(|k| g[k].as_u64().unwrap_or_default());
        if w == 0 || h == 0 || x + w > 24 {
            problems.push(format!("{title}: gridPos {g}"));
        }
        for cx in x..x + w {
            for cy in y..y + h {
                if let Some(other) = cells.insert((cx, cy), title) {
                    overlaps.insert(format!("{title} overlaps {other}"));
                }
            }
        }
        if title.is_empty() {
            problems.push(format!("panel {} has no title", p["id"]));
        }
        if p["type"] == "row" {
            continue;
        }
        if text(&p["description"]).len() < 20 {
            problems.push(format!("{title}: no description"));
        }
        if text(&p["fieldConfig"]["defaults"]["unit"]).is_empty() {
            problems.push(format!("{title}: no unit"));
        }
        if p["datasource"]["uid"] != "${datasource}" {
            problems.push(format!("{title}: datasource {}", p["datasource"]));
        }
        let targets = p["targets"].as_array().cloned().unwrap_or_default();
        if targets.is_empty() {
            problems.push(format!("{title}: no targets"));
        }
        let mut refs: Vec<&str> = targets.iter().map(|t| text(&t["refId"])).collect();
        refs.sort();
        refs.dedup();
        if refs.len() != targets.len() || refs.contains(&"") {
            problems.push(format!("{title}: refIds not unique"));
        }
        for t in &targets {
            if text(&t["expr"]).is_empty() || t["datasource"]["uid"] != "${datasource}" {
                problems.push(format!("{title}: target {t}"));
            }
        }
    }
    problems.extend(overlaps);
    let count = ids.len();
    ids.sort();
    ids.dedup();
    if ids.len() != count || ids.contains(&0) {
        problems.push(format!("panel ids not unique: {ids:?}"));
    }
    assert!(panels.len() >= 15, "{} panels", panels.len());
    assert!(problems.is_empty(), "{problems:#?}");
    Ok(())
}

/// Counters and histogram series only grow: a panel plots their rate. Gauges are plotted as
/// they are.
#[test]
fn counters_are_read_as_rates_and_gauges_as_values() -> anyhow::Result<()> {
    let d = grafana::load_dashboard()?;
    let mut problems = Vec::new();
    for q in grafana::queries(&d) {
        for name in metric_names(&q.expr) {
            let growing = ["_total", "_bucket", "_count", "_sum"]
                .iter()
                .any(|s| name.ends_with(s));
            for (at, _) in q.expr.match_indices(&name) {
                let before = q.expr[..at].trim_end();
                let rated = before.ends_with("rate(") || before.ends_with("increase(");
                if rated != growing {
                    problems.push(format!("{}: {name} in {}", q.panel, q.expr));
                }
            }
        }
        if q.expr.contains("histogram_quantile") && !q.expr.contains(" le)") {
            problems.push(format!("{}: a quantile not by `le`: {}", q.panel, q.expr));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
    Ok(())
}

#[test]
fn every_query_follows_the_region_selection_or_says_why_not() -> anyhow::Result<()> {
    let d = grafana::load_dashboard()?;
    let described: std::collections::HashMap<&str, &str> = grafana::panels(&d)
        .into_iter()
        .map(|p| (text(&p["title"]), text(&p["description"])))
        .collect();
    let mut vars = vec![("region", "a")];
    vars.extend_from_slice(BUILT_IN_VARIABLES);
    for q in grafana::queries(&d) {
        grafana::substitute(&q.expr, &vars)?;
        let says_why = described[q.panel.as_str()].contains("Not filtered by region");
        assert!(
            q.expr.contains("region=~\"$region\"") || says_why,
            "{}: {}",
            q.panel,
            q.expr
        );
    }
    Ok(())
}
