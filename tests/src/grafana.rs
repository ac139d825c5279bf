//! The Grafana dashboard `deploy/grafana/quotad.json`: its panels, and their queries with the
//! template variables replaced as Grafana would, ready to send to Prometheus.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use serde_json::Value;

/// `deploy/grafana/quotad.json`.
pub fn dashboard_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/quotad.json")
}

/// The dashboard, parsed.
pub fn load_dashboard() -> anyhow::Result<Value> {
    let path = dashboard_path();
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// Grafana's built-in interval variables, as a dashboard shown over the last hour with a
/// Prometheus scraping every second or so would have them.
pub const BUILT_IN_VARIABLES: &[(&str, &str)] = &[
    ("__rate_interval", "1m"),
    ("__interval", "15s"),
    ("__interval_ms", "15000"),
    ("__range", "1h"),
    ("__range_s", "3600"),
    ("__range_ms", "3600000"),
];

/// Every panel, rows' nested panels (those of a collapsed row) included, rows themselves too.
pub fn panels(dashboard: &Value) -> Vec<&Value> {
    fn walk<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for p in list.as_array().into_iter().flatten() {
            out.push(p);
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// One target of one panel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PanelQuery {
    pub panel: String,
    pub ref_id: String,
    pub expr: String,
}

/// Every target's `expr`, of every panel (rows' nested panels included).
pub fn queries(dashboard: &Value) -> Vec<PanelQuery> {
    let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
    panels(dashboard)
        .into_iter()
        .flat_map(|p| {
            p["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .map(move |t| PanelQuery {
                    panel: s(&p["title"]),
                    ref_id: s(&t["refId"]),
                    expr: s(&t["expr"]),
                })
        })
        .collect()
}

/// The template variable named `name`.
pub fn variable<'a>(dashboard: &'a Value, name: &str) -> Option<&'a Value> {
    dashboard["templating"]["list"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == name)
}

/// `expr` with every `$name`, `${name}` and `${name:format}` replaced by its value in `vars`:
/// an error names a variable `vars` does not have.
pub fn substitute(expr: &str, vars: &[(&str, &str)]) -> anyhow::Result<String> {
    let mut out = String::with_capacity(expr.len());
    let mut rest = expr;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let (name, tail) = match after.strip_prefix('{') {
            Some(braced) => {
                let (inside, tail) = braced
                    .split_once('}')
                    .with_context(|| format!("an unclosed `${{` in {expr:?}"))?;
                (inside.split(':').next().unwrap_or_default(), tail)
            }
            None => {
                let end = after
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(after.len());
                after.split_at(end)
            }
        };
        let Some((_, value)) = vars.iter().find(|(n, _)| *n == name) else {
            bail!("unknown variable `${name}` in {expr:?}");
        };
        out.push_str(value);
        rest = tail;
    }
    out.push_str(rest);
    Ok(out)
}

/// The metric and label of a `label_values(metric, label)` variable query.
pub fn label_values(definition: &str) -> Option<(&str, &str)> {
    let args = definition
        .trim()
        .strip_prefix("label_values(")?
        .strip_suffix(')')?;
    let (metric, label) = args.split_once(',')?;
    Some((metric.trim(), label.trim()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn queries_include_those_of_panels_nested_in_collapsed_rows() {
        let d = json!({"panels": [
            {"type": "row", "title": "Open", "panels": []},
            {"type": "timeseries", "title": "A", "targets": [
                {"refId": "A", "expr": "up"}, {"refId": "B", "expr": "quotad_degraded"}]},
            {"type": "row", "title": "Collapsed", "collapsed": true, "panels": [
                {"type": "stat", "title": "C", "targets": [{"refId": "A", "expr": "x"}]}]},
        ]});
        let found: Vec<(String, String)> =
            queries(&d).into_iter().map(|q| (q.panel, q.expr)).collect();
        let want = [("A", "up"), ("A", "quotad_degraded"), ("C", "x")]
            .map(|(p, e)| (p.to_string(), e.to_string()));
        assert_eq!(found, want);
        assert_eq!(panels(&d).len(), 4);
    }

    #[test]
    fn variables_are_replaced_in_every_syntax_and_unknown_ones_refused() {
        let vars = [("region", "b|c"), ("__rate_interval", "1m")];
        assert_eq!(
            substitute(
                r#"rate(m{region=~"$region"}[$__rate_interval]) + n{r="${region}", s="${region:regex}"}"#,
                &vars
            )
            .unwrap(),
            r#"rate(m{region=~"b|c"}[1m]) + n{r="b|c", s="b|c"}"#
        );
        // `$region_x` is another variable, not `$region` followed by `_x`.
        let err = substitute("m{r=\"$region_x\"}", &vars).unwrap_err();
        assert!(err.to_string().contains("$region_x"), "{err}");
        assert!(substitute("m[$__interval]", &vars).is_err());
        assert!(substitute("m ${region", &vars).is_err());
    }

    #[test]
    fn label_values_queries_are_read() {
        assert_eq!(
            label_values("label_values(quotad_degraded, region)"),
            Some(("quotad_degraded", "region"))
        );
        assert_eq!(label_values("query_result(up)"), None);
    }
}
