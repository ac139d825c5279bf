//! SVG plots of one scenario as small multiples: one panel per strategy, all on the same axes,
//! so no strategy's line hides another's and panels compare by eye.
//!
//! - `<scenario>_admitted.svg`: tokens admitted per second by each strategy (a line in the
//!   strategy's own colour) over the ideal (what one shadow global bucket admits: a grey area)
//!   and the global budget (a dashed black line, labelled in every panel).
//! - `<scenario>_overshoot.svg`: overshoot(W) per second against its bound of 1 (dashed black).
//!
//! A strategy keeps its colour in every plot and every run, whichever strategies were chosen.

use std::path::Path;

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;

use crate::simulation::ScenarioRun;
use crate::strategy::StrategyKind;

/// Why a plot could not be drawn.
#[derive(Debug, thiserror::Error)]
#[error("plotting {path}: {message}")]
pub struct PlotError {
    pub path: String,
    pub message: String,
}

/// One colour per strategy, in [`StrategyKind::ALL`] order; none grey or black, which the
/// ideal and the budget use.
const STRATEGY_COLORS: [RGBColor; StrategyKind::ALL.len()] = [
    RGBColor(214, 39, 40),   // independent: red
    RGBColor(140, 86, 75),   // static_split: brown
    RGBColor(148, 103, 189), // global_store: purple
    RGBColor(255, 127, 14),  // async_broadcast: orange
    RGBColor(227, 119, 194), // rebalance_no_lease: pink
    RGBColor(31, 119, 180),  // quotad: blue
    RGBColor(23, 190, 207),  // quotad_reserved: cyan
    RGBColor(44, 160, 44),   // quotad_pinned: green
];

const IDEAL_FILL: RGBColor = RGBColor(205, 205, 205);
const REFERENCE_INK: RGBColor = BLACK;
const GRID_INK: RGBColor = RGBColor(232, 232, 232);
const FONT: &str = "sans-serif";

const WIDTH_PX: u32 = 1200;
const HEADER_PX: u32 = 92;
const PANEL_PX: u32 = 250;

/// The colour of the strategy named `name` (as [`StrategyKind::name`] spells it).
pub fn strategy_color(name: &str) -> RGBColor {
    StrategyKind::ALL
        .iter()
        .position(|k| k.name() == name)
        .map_or(RGBColor(90, 90, 90), |i| STRATEGY_COLORS[i])
}

type Points = Vec<(f64, f64)>;

/// A horizontal line every panel draws over its data, with its label.
struct Reference {
    y: f64,
    label: &'static str,
    legend: &'static str,
}

/// One figure: a header with the title and the key, then one panel per strategy.
struct Figure<'a> {
    title: String,
    y_label: &'a str,
    /// Decimals on the y axis.
    y_decimals: usize,
    reference: Reference,
    /// The ideal's points, drawn under every panel's line; `None` in the overshoot plot.
    ideal: Option<Points>,
    panels: Vec<(&'a str, Points)>,
}

impl Figure<'_> {
    fn x_max(&self) -> f64 {
        self.panels
            .iter()
            .flat_map(|p| p.1.iter())
            .chain(self.ideal.iter().flatten())
            .map(|p| p.0)
            .fold(1.0, f64::max)
    }

    /// The same y range in every panel: the highest point of any series or the reference.
    fn y_max(&self) -> f64 {
        let top = self
            .panels
            .iter()
            .flat_map(|p| p.1.iter())
            .chain(self.ideal.iter().flatten())
            .map(|p| p.1)
            .fold(self.reference.y, f64::max);
        if top > 0.0 {
            top * 1.08
        } else {
            1.0
        }
    }
}

fn draw(path: &Path, fig: &Figure<'_>) -> Result<(), PlotError> {
    let err = |e: &dyn std::fmt::Display| PlotError {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    let cols = if fig.panels.len() > 1 { 2 } else { 1 };
    let rows = fig.panels.len().div_ceil(cols).max(1);
    let height_px = HEADER_PX + rows as u32 * PANEL_PX;
    let root = SVGBackend::new(path, (WIDTH_PX, height_px)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (header, body) = root.split_vertically(HEADER_PX);
    draw_header(&header, fig).map_err(|e| err(&e))?;
    let (x_max, y_max) = (fig.x_max(), fig.y_max());
    for (area, (name, points)) in body.split_evenly((rows, cols)).iter().zip(&fig.panels) {
        draw_panel(area, fig, name, points, (x_max, y_max)).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}

type DrawResult = Result<(), DrawingAreaErrorKind<std::io::Error>>;

/// The title, and a key naming what is drawn the same way in every panel.
fn draw_header(area: &DrawingArea<SVGBackend<'_>, Shift>, fig: &Figure<'_>) -> DrawResult {
    area.draw(&Text::new(
        fig.title.as_str(),
        (20, 14),
        (FONT, 24).into_font().style(FontStyle::Bold),
    ))?;
    let key = (FONT, 15).into_font();
    let y = 62;
    let mut x = 20;
    if fig.ideal.is_some() {
        area.draw(&Rectangle::new(
            [(x, y - 7), (x + 34, y + 7)],
            IDEAL_FILL.filled(),
        ))?;
        area.draw(&Text::new(
            "ideal (one global token bucket)",
            (x + 42, y - 8),
            key.clone(),
        ))?;
        x += 320;
    }
    area.draw(&DashedPathElement::new(
        vec![(x, y), (x + 34, y)],
        8,
        5,
        REFERENCE_INK.stroke_width(2),
    ))?;
    area.draw(&Text::new(
        fig.reference.legend,
        (x + 42, y - 8),
        key.clone(),
    ))?;
    x += 42 + 9 * fig.reference.legend.len() as i32;
    // A swatch of every strategy colour: no one strategy stands for all of them.
    for (i, color) in STRATEGY_COLORS.iter().enumerate() {
        let x0 = x + 6 * i as i32;
        area.draw(&PathElement::new(
            vec![(x0, y), (x0 + 6, y)],
            color.stroke_width(4),
        ))?;
    }
    let swatch = 6 * STRATEGY_COLORS.len() as i32;
    area.draw(&Text::new(
        "a strategy: one panel each, in its own colour",
        (x + swatch + 8, y - 8),
        key,
    ))
}

fn draw_panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    fig: &Figure<'_>,
    name: &str,
    points: &Points,
    (x_max, y_max): (f64, f64),
) -> DrawResult {
    let color = strategy_color(name);
    let mut chart = ChartBuilder::on(area)
        .caption(
            name,
            (FONT, 18).into_font().style(FontStyle::Bold).color(&color),
        )
        .margin(8)
        .margin_right(20)
        .x_label_area_size(34)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .bold_line_style(GRID_INK)
        .x_desc("simulated seconds")
        .y_desc(fig.y_label)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.*}", fig.y_decimals))
        .label_style((FONT, 13))
        .draw()?;
    if let Some(ideal) = &fig.ideal {
        let mut outline = Vec::with_capacity(ideal.len() + 2);
        outline.push((ideal.first().map_or(0.0, |p| p.0), 0.0));
        outline.extend(ideal.iter().copied());
        outline.push((ideal.last().map_or(0.0, |p| p.0), 0.0));
        chart.draw_series(std::iter::once(Polygon::new(outline, IDEAL_FILL.filled())))?;
    }
    chart.draw_series(LineSeries::new(
        points.iter().copied(),
        color.stroke_width(2),
    ))?;
    // The reference goes on top, dashed, so a line running along it still shows through.
    let r = fig.reference.y;
    chart.draw_series(DashedLineSeries::new(
        [(0.0, r), (x_max, r)],
        8,
        5,
        REFERENCE_INK.stroke_width(2),
    ))?;
    chart.draw_series(std::iter::once(
        EmptyElement::at((0.0, r))
            + Text::new(fig.reference.label, (6, -18), (FONT, 13).into_font()),
    ))?;
    Ok(())
}

fn per_second(values: impl Iterator<Item = f64>) -> Points {
    values.enumerate().map(|(s, v)| (s as f64, v)).collect()
}

/// Writes `<scenario>_admitted.svg` and `<scenario>_overshoot.svg` into `dir`.
pub fn plot_scenario(dir: &Path, run: &ScenarioRun) -> Result<(), PlotError> {
    let name = run.scenario.name();
    let ideal = per_second(run.ideal_per_s.iter().map(|&v| v as f64));
    let admitted = Figure {
        title: format!("{name}: admitted tokens per second"),
        y_label: "tokens / s",
        y_decimals: 0,
        reference: Reference {
            y: run.budget_tokens_per_s,
            label: "global budget",
            legend: "global budget (Σ limit ÷ window)",
        },
        ideal: Some(ideal),
        panels: run
            .strategies
            .iter()
            .map(|s| {
                let tokens = s.seconds.iter().map(|x| x.admitted_tokens as f64);
                (s.summary.strategy.as_str(), per_second(tokens))
            })
            .collect(),
    };
    draw(&dir.join(format!("{name}_admitted.svg")), &admitted)?;
    let overshoot = Figure {
        title: format!("{name}: overshoot over the policy window"),
        y_label: "admitted ÷ (C + r·W)",
        y_decimals: 1,
        reference: Reference {
            y: 1.0,
            label: "bound: 1",
            legend: "bound: 1 = a window's budget (C + r·W)",
        },
        ideal: None,
        panels: run
            .strategies
            .iter()
            .map(|s| {
                let ratio = s.seconds.iter().map(|x| x.overshoot_w);
                (s.summary.strategy.as_str(), per_second(ratio))
            })
            .collect(),
    };
    draw(&dir.join(format!("{name}_overshoot.svg")), &overshoot)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_strategy_has_its_own_colour_apart_from_the_references() {
        let colors: Vec<RGBColor> = StrategyKind::ALL
            .iter()
            .map(|k| strategy_color(k.name()))
            .collect();
        for (i, a) in colors.iter().enumerate() {
            // Grey (equal channels) is the ideal's and black the references'.
            assert!(
                !(a.0 == a.1 && a.1 == a.2),
                "{:?} is grey",
                StrategyKind::ALL[i]
            );
            for b in &colors[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }
}
