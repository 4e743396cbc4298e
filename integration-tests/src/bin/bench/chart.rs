//! The chart `make bench` writes beside `BENCHMARKS.md`, drawn with `plotters`: on top, each
//! tier's throughput against in-flight concurrency next to its store's raw limit, on log
//! scales, with the legend beside the plot; below, RabbitMQ end to end as bars, a raw lapin
//! consumer next to the runner with each stack of tiers — the figure users of the adapter
//! care about most.

use std::error::Error;

use integration_tests::thousands;
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::report::{Plot, Section};

/// The chart's heading in `BENCHMARKS.md`.
pub(crate) const TITLE: &str = "Throughput against in-flight concurrency, and RabbitMQ end to end";
/// The chart's alternative text in `BENCHMARKS.md`.
pub(crate) const ALT: &str =
    "throughput of each tier against in-flight concurrency, and of RabbitMQ consumers end to end";

const WIDTH: u32 = 900;
const CURVES_HEIGHT: u32 = 420;
/// Height of one bar with its label above it.
const BAR_HEIGHT: u32 = 46;
/// Above and below the bars: the panel's title and the axis.
const BARS_MARGINS: u32 = 90;
const FONT: &str = "sans-serif";
/// Font sizes as plotters takes them: its SVG backend writes a size asked for divided by
/// 1.24, so these come out as 16, 13 and 12 px.
const CAPTION_SIZE: f64 = 20.0;
const TEXT_SIZE: f64 = 16.0;
const AXIS_SIZE: f64 = 15.0;
/// Wider than the average sans-serif character at the legend's 13 px, so that the legend's
/// width, computed from its longest label, never clips it.
const LEGEND_CHAR_WIDTH: u32 = 8;

/// A part of the SVG drawing.
type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// One line of the throughput chart: operations per second at each in-flight level.
struct Curve {
    name: String,
    points: Vec<(f64, f64)>,
    /// Drawn dashed: the store's raw limit the tier is compared with.
    baseline: bool,
}

/// One bar of the end-to-end chart.
struct Bar {
    name: String,
    per_second: f64,
    ratio: f64,
}

/// The chart as SVG: the panels the sections have data for.
pub(crate) fn render(sections: &[Section]) -> Result<String, Box<dyn Error>> {
    let curves = curves(sections);
    let (bars_title, bars) = bars(sections);
    let bars_height = if bars.is_empty() {
        0
    } else {
        BARS_MARGINS + BAR_HEIGHT * bars.len() as u32
    };
    let curves_height = if curves.is_empty() { 0 } else { CURVES_HEIGHT };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, (curves_height + bars_height).max(1)))
            .into_drawing_area();
        root.fill(&WHITE)?;
        let (top, bottom) = root.split_vertically(curves_height);
        if !curves.is_empty() {
            draw_curves(&top, &curves)?;
        }
        if !bars.is_empty() {
            draw_bars(&bottom, &bars_title, &bars)?;
        }
        root.present()?;
    }
    Ok(svg)
}

/// The curves of every [`Plot::Curves`] section: per operation, and the baseline.
fn curves(sections: &[Section]) -> Vec<Curve> {
    let mut curves: Vec<Curve> = Vec::new();
    for section in sections {
        let Plot::Curves(store) = section.plot else {
            continue;
        };
        let mut baseline = Curve {
            name: format!("{store}{}", section.baseline_name),
            points: Vec::new(),
            baseline: true,
        };
        for row in &section.rows {
            let level = row.in_flight as f64;
            if !baseline.points.iter().any(|(at, _)| *at == level) {
                baseline.points.push((level, row.baseline));
            }
            // The legend has room for the name, not the parenthesised detail.
            let name = format!("{store}{}", row.what.split(" (").next().unwrap_or(&row.what));
            match curves.iter_mut().find(|curve| curve.name == name) {
                Some(curve) => curve.points.push((level, row.per_second)),
                None => curves.push(Curve {
                    name,
                    points: vec![(level, row.per_second)],
                    baseline: false,
                }),
            }
        }
        curves.push(baseline);
    }
    for curve in &mut curves {
        // Backticks mark code in Markdown; in the chart they would only be noise.
        curve.name.retain(|c| c != '`');
    }
    curves
}

/// The bars of the [`Plot::Bars`] section, the baseline's first, and the section's title.
fn bars(sections: &[Section]) -> (String, Vec<Bar>) {
    let Some(section) = sections.iter().find(|section| matches!(section.plot, Plot::Bars)) else {
        return (String::new(), Vec::new());
    };
    let baseline = section.rows.first().map_or(0.0, |row| row.baseline);
    let bars = std::iter::once(Bar {
        name: section.baseline_name.into(),
        per_second: baseline,
        ratio: 1.0,
    })
    .chain(section.rows.iter().map(|row| Bar {
        name: row.what.clone(),
        per_second: row.per_second,
        ratio: row.ratio(),
    }))
    .collect();
    (section.title.clone(), bars)
}

/// A colour per line or bar, in order.
fn colour(index: usize) -> RGBColor {
    const COLOURS: [RGBColor; 6] = [
        RGBColor(0x1f, 0x77, 0xb4),
        RGBColor(0xff, 0x7f, 0x0e),
        RGBColor(0x2c, 0xa0, 0x2c),
        RGBColor(0xd6, 0x27, 0x28),
        RGBColor(0x94, 0x67, 0xbd),
        RGBColor(0x8c, 0x56, 0x4b),
    ];
    COLOURS[index % COLOURS.len()]
}

/// The smallest and largest of `values`.
fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values.fold((f64::MAX, f64::MIN), |(low, high), value| {
        (low.min(value), high.max(value))
    })
}

/// Throughput against in-flight level, both on log scales (the stores differ by orders of
/// magnitude, the levels by factors of four), with the legend in a column of its own on the
/// right, as wide as its longest label.
fn draw_curves(area: &Area<'_>, curves: &[Curve]) -> Result<(), Box<dyn Error>> {
    let longest = curves
        .iter()
        .map(|curve| curve.name.chars().count())
        .max()
        .unwrap_or(0) as u32;
    let (plot, legend) = area.split_horizontally(WIDTH - (60 + LEGEND_CHAR_WIDTH * longest));
    let points = || curves.iter().flat_map(|curve| curve.points.iter());
    let (low_level, high_level) = bounds(points().map(|(level, _)| *level));
    let (low, high) = bounds(points().map(|(_, per_second)| *per_second));
    // Whole decades, so that every grid line is a power of ten.
    let decades = 10f64.powf(low.max(1.0).log10().floor())..10f64.powf(high.max(10.0).log10().ceil());
    let mut chart = ChartBuilder::on(&plot)
        .caption(
            "Each tier against its store's raw limit (log scales)",
            (FONT, CAPTION_SIZE),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(
            (low_level..high_level.max(low_level * 2.0)).log_scale().base(2.0),
            decades.log_scale(),
        )?;
    chart
        .configure_mesh()
        // Between powers of two, light lines would mark nothing anyone reads off.
        .x_max_light_lines(0)
        .x_desc("operations in flight")
        .y_desc("operations per second")
        .x_label_formatter(&|level| format!("{level:.0}"))
        .y_label_formatter(&|per_second| thousands(*per_second))
        .label_style((FONT, AXIS_SIZE))
        .draw()?;
    for (index, curve) in curves.iter().enumerate() {
        let style = colour(index).stroke_width(2);
        if curve.baseline {
            chart.draw_series(DashedLineSeries::new(curve.points.iter().copied(), 6, 4, style))?;
        } else {
            chart.draw_series(LineSeries::new(curve.points.iter().copied(), style))?;
        }
        chart.draw_series(
            curve
                .points
                .iter()
                .map(|point| Circle::new(*point, 3, colour(index).filled())),
        )?;
    }
    draw_legend(&legend, curves)
}

/// One entry a curve, top down: a sample of its line, then its name.
fn draw_legend(area: &Area<'_>, curves: &[Curve]) -> Result<(), Box<dyn Error>> {
    for (index, curve) in curves.iter().enumerate() {
        let y = 60 + 22 * index as i32;
        let style = colour(index).stroke_width(2);
        let sample = [(8, y), (40, y)];
        if curve.baseline {
            area.draw(&DashedPathElement::new(sample, 6, 4, style))?;
        } else {
            area.draw(&PathElement::new(sample, style))?;
        }
        let text = TextStyle::from((FONT, TEXT_SIZE)).pos(Pos::new(HPos::Left, VPos::Center));
        area.draw(&Text::new(curve.name.clone(), (48, y), text))?;
    }
    Ok(())
}

/// Messages per second end to end as horizontal bars, each labelled above with its name,
/// its rate and its ratio to the first (the raw consumer).
fn draw_bars(area: &Area<'_>, title: &str, bars: &[Bar]) -> Result<(), Box<dyn Error>> {
    let (_, high) = bounds(bars.iter().map(|bar| bar.per_second));
    let slots = bars.len() as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(title, (FONT, CAPTION_SIZE))
        .margin(12)
        .x_label_area_size(40)
        .build_cartesian_2d(0.0..high.max(1.0) * 1.05, 0.0..slots)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .disable_y_axis()
        .max_light_lines(0)
        .x_desc("messages per second")
        .x_label_formatter(&|per_second| thousands(*per_second))
        .label_style((FONT, AXIS_SIZE))
        .draw()?;
    let text = TextStyle::from((FONT, TEXT_SIZE)).pos(Pos::new(HPos::Left, VPos::Bottom));
    for (index, bar) in bars.iter().enumerate() {
        // The first bar at the top, in slot `slots - 1`; in each slot the bar low, its label
        // right on top of it, and a gap to the next bar up, so a label reads with its bar.
        let slot = slots - 1.0 - index as f64;
        chart.draw_series([Rectangle::new(
            [(0.0, slot + 0.15), (bar.per_second, slot + 0.55)],
            colour(index).filled(),
        )])?;
        let label = format!(
            "{}: {} messages/s ({:.2}×)",
            bar.name,
            thousands(bar.per_second),
            bar.ratio
        );
        chart.draw_series([Text::new(label, (0.0, slot + 0.6), text.clone())])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Row;

    /// A section like the bench's, `plot`ted, with a row per operation and level.
    fn section(plot: Plot, baseline_name: &'static str, operations: &[&str], levels: &[usize]) -> Section {
        let rows = levels
            .iter()
            .flat_map(|&level| {
                operations.iter().enumerate().map(move |(rank, what)| Row {
                    what: (*what).into(),
                    in_flight: level,
                    per_second: (1_000 * level / (rank + 1)) as f64,
                    baseline: (1_200 * level) as f64,
                })
            })
            .collect();
        Section {
            title: format!("{baseline_name} and others"),
            baseline_name,
            unit: None,
            rows,
            note: None,
            plot,
        }
    }

    /// Every line and bar of a full run is in the chart, under the name its legend or label
    /// gives it (without backticks, with plotters' SVG escaping). The chart is left in the
    /// temporary directory as `oncely-benchmarks.svg`, to look at.
    #[test]
    fn every_line_and_bar_is_named() {
        let levels = [1, 4, 16, 64];
        let sections = [
            section(
                Plot::Curves("Redis: "),
                "raw `SET NX PX`",
                &[
                    "flag claim (`SET NX GET PX`)",
                    "flag claim + complete (2 round trips)",
                ],
                &levels,
            ),
            section(
                Plot::Curves("PostgreSQL: "),
                "single-row claim",
                &["record claim, coalesced (≤ 64 rows, ≤ 4 batches on the wire)"],
                &levels,
            ),
            section(
                Plot::Bars,
                "raw lapin consumer",
                &[
                    "runner, no tiers",
                    "runner, Redis flag",
                    "runner, Redis flag + PostgreSQL record",
                ],
                &[64],
            ),
            section(
                Plot::None,
                "without pre-filter",
                &["1 % duplicates, with pre-filter"],
                &[64],
            ),
        ];
        let svg = render(&sections).expect("a chart");
        std::fs::write(std::env::temp_dir().join("oncely-benchmarks.svg"), &svg).expect("written");
        for name in [
            "Redis: raw SET NX PX",
            "Redis: flag claim\n",
            "Redis: flag claim + complete",
            "PostgreSQL: single-row claim",
            "PostgreSQL: record claim, coalesced\n",
            "raw lapin consumer: ",
            "runner, no tiers: ",
            "runner, Redis flag: ",
            "runner, Redis flag + PostgreSQL record: ",
        ] {
            assert!(svg.contains(name), "{name:?} missing from the chart");
        }
        assert!(
            !svg.contains("pre-filter"),
            "the pre-filter has no place in the chart"
        );
    }
}
