//! Reading the daemon's Prometheus text exposition.

/// The value of one sample in Prometheus text exposition: the line of metric `name` carrying
/// every `label="value"` pair in `labels` (in any order). `None` when no such sample exists.
pub fn metric_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let (label_set, value) = match rest.strip_prefix('{') {
            Some(r) => r.split_once('}')?,
            None => ("", rest),
        };
        let pairs: Vec<&str> = label_set.split(',').collect();
        let all = labels
            .iter()
            .all(|(k, v)| pairs.contains(&format!("{k}=\"{v}\"").as_str()));
        all.then(|| value.trim().parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::metric_value;

    #[test]
    fn metric_value_finds_a_sample_by_labels_in_any_order() {
        let text = "# TYPE quotad_decisions_total counter\n\
            quotad_decisions_total{policy=\"p\",region=\"b\",outcome=\"allowed\"} 3\n\
            quotad_decisions_total{policy=\"p\",region=\"b\",outcome=\"degraded_open\"} 17\n\
            quotad_degraded{region=\"b\"} 1\n";
        let open = [
            ("outcome", "degraded_open"),
            ("region", "b"),
            ("policy", "p"),
        ];
        assert_eq!(
            metric_value(text, "quotad_decisions_total", &open),
            Some(17.0)
        );
        assert_eq!(
            metric_value(text, "quotad_degraded", &[("region", "b")]),
            Some(1.0)
        );
        assert_eq!(
            metric_value(text, "quotad_degraded", &[("region", "a")]),
            None
        );
        assert_eq!(metric_value(text, "quotad_decisions", &open), None);
    }
}
