//! SVG plots of one scenario: admitted tokens per second against the global budget, and
//! overshoot(W) over time, one line per strategy.

use std::path::Path;

use plotters::prelude::*;

use crate::simulation::ScenarioRun;

/// Why a plot could not be drawn.
#[derive(Debug, thiserror::Error)]
#[error("plotting {path}: {message}")]
pub struct PlotError {
    pub path: String,
    pub message: String,
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

type Series<'a> = (&'a str, Vec<(f64, f64)>);

fn draw(path: &Path, title: &str, y_label: &str, series: &[Series<'_>]) -> Result<(), PlotError> {
    let err = |e: &dyn std::fmt::Display| PlotError {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    let x_max = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.0))
        .fold(1.0, f64::max);
    let y_max = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.1))
        .fold(0.0, f64::max);
    let y_max = if y_max > 0.0 { y_max * 1.1 } else { 1.0 };
    let root = SVGBackend::new(path, (1000, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("simulated seconds")
        .y_desc(y_label)
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (name, points)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| err(&e))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

/// Writes `<scenario>_admitted.svg` and `<scenario>_overshoot.svg` into `dir`.
pub fn plot_scenario(dir: &Path, run: &ScenarioRun) -> Result<(), PlotError> {
    let name = run.scenario.name();
    let secs = run.ideal_per_s.len();
    let budget: Vec<(f64, f64)> = (0..secs)
        .map(|s| (s as f64, run.budget_tokens_per_s))
        .collect();
    let ideal: Vec<(f64, f64)> = run
        .ideal_per_s
        .iter()
        .enumerate()
        .map(|(s, &v)| (s as f64, v as f64))
        .collect();
    let mut admitted: Vec<Series<'_>> = vec![("global budget", budget), ("ideal", ideal)];
    let mut overshoot: Vec<Series<'_>> = Vec::new();
    for s in &run.strategies {
        let label = s.summary.strategy.as_str();
        admitted.push((
            label,
            s.seconds
                .iter()
                .enumerate()
                .map(|(i, x)| (i as f64, x.admitted_tokens as f64))
                .collect(),
        ));
        overshoot.push((
            label,
            s.seconds
                .iter()
                .enumerate()
                .map(|(i, x)| (i as f64, x.overshoot_w))
                .collect(),
        ));
    }
    draw(
        &dir.join(format!("{name}_admitted.svg")),
        &format!("{name}: admitted tokens per second"),
        "tokens / s",
        &admitted,
    )?;
    draw(
        &dir.join(format!("{name}_overshoot.svg")),
        &format!("{name}: overshoot over the policy window"),
        "admitted ÷ (C + r·W)",
        &overshoot,
    )
}
