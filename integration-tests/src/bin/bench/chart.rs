//! The chart `make bench` writes beside `BENCHMARKS.md`, drawn with `plotters`: a panel per
//! table that asks for one, top down in the report's order, each under its table's full
//! title (the settings it ran at included), wrapped to the chart's width. A
//! [`Plot::Curves`] table is drawn as throughput against in-flight concurrency, its
//! store's raw limit dashed, on log scales, with the legend beside the plot; a
//! [`Plot::Bars`] table (a broker end to end, the figure users of an adapter care about
//! most) as horizontal bars, the baseline's first, each named above and its rate at its end.
//!
//! The SVG leaves the font to the viewer, so no text can be measured here: every width is
//! estimated on the wide side ([`Face::width`]) and every line that would not fit is
//! wrapped, so that nothing is cut at the chart's edges. Within a panel every series has a
//! colour of its own ([`palette`]).

use std::error::Error;

use integration_tests::thousands;
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::report::{Plot, Section};

/// The chart's heading in `BENCHMARKS.md`.
pub(crate) const TITLE: &str = "Throughput against in-flight concurrency, and end to end through the brokers";
/// The chart's alternative text in `BENCHMARKS.md`.
pub(crate) const ALT: &str = "throughput of each tier against in-flight concurrency, and of RabbitMQ and RocketMQ \
     consumers end to end";

/// The chart's width; a panel's height follows from what it holds.
pub(crate) const WIDTH: u32 = 900;
/// Between the chart's edges and any text or plot.
pub(crate) const MARGIN: u32 = 12;
/// A curves panel's plot: its width (the legend has the rest) and height.
const CURVE_PLOT_WIDTH: u32 = 430;
const CURVE_PLOT_HEIGHT: u32 = 300;
/// A line of a legend or a bar's name, and the space between two legend entries.
const LINE: u32 = 17;
const ENTRY_GAP: u32 = 5;
/// A bar, and the space below it before the next bar's name.
const BAR_THICKNESS: u32 = 16;
const BAR_GAP: u32 = 12;
/// Below a plot: the axis labels and the axis's description.
pub(crate) const AXIS_AREA: u32 = 40;
/// Left of a plot: the axis labels (up to `1,000,000`) and the axis's description.
pub(crate) const Y_AXIS_AREA: u32 = 84;
pub(crate) const FONT: &str = "sans-serif";
/// Font sizes as plotters takes them: its SVG backend writes a size asked for divided by
/// 1.24, so these come out as 16 px bold, 13 px and 12 px.
pub(crate) const TITLE_FACE: Face = Face {
    size: 20.0,
    bold: true,
};
pub(crate) const TEXT_FACE: Face = Face {
    size: 16.0,
    bold: false,
};
pub(crate) const AXIS_SIZE: f64 = 15.0;

/// A part of the SVG drawing.
pub(crate) type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// A font of the chart: its size as plotters takes it, and whether bold.
#[derive(Clone, Copy)]
pub(crate) struct Face {
    pub(crate) size: f64,
    pub(crate) bold: bool,
}

impl Face {
    /// A character's width estimated on the wide side: DejaVu Sans, the widest common
    /// sans-serif, averages about 0.52 em a character over the bench's labels (0.58 bold);
    /// 0.6 and 0.66 leave room for capitals and digits.
    fn char_width(self) -> f64 {
        let em = self.size / 1.24;
        em * if self.bold { 0.66 } else { 0.6 }
    }

    /// How wide `text` comes out at most, in pixels.
    pub(crate) fn width(self, text: &str) -> u32 {
        (text.chars().count() as f64 * self.char_width()).ceil() as u32
    }

    /// This font as plotters draws it, anchored at `pos`.
    pub(crate) fn style(self, pos: Pos) -> TextStyle<'static> {
        let style = [FontStyle::Normal, FontStyle::Bold][usize::from(self.bold)];
        TextStyle::from((FONT, self.size, style)).pos(pos)
    }
}

/// `text` broken between words into lines no wider than `width` at `face` (a word longer
/// than a line, which none of the bench's is, would stand on a line of its own).
pub(crate) fn wrap(text: &str, face: Face, width: u32) -> Vec<String> {
    let fits = (f64::from(width) / face.char_width()).floor() as usize;
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        let needed = line.chars().count() + 1 + word.chars().count();
        if !line.is_empty() && needed > fits {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() || lines.is_empty() {
        lines.push(line);
    }
    lines
}

/// Draws `lines` top down in `area`, the first's top at `(x, y)`, `step` pixels apart.
pub(crate) fn draw_lines(
    area: &Area<'_>,
    lines: &[String],
    (x, y): (i32, i32),
    face: Face,
    step: u32,
) -> Result<(), Box<dyn Error>> {
    let style = face.style(Pos::new(HPos::Left, VPos::Top));
    for (index, line) in lines.iter().enumerate() {
        let top = y + (step as i32) * index as i32;
        area.draw(&Text::new(line.clone(), (x, top), style.clone()))?;
    }
    Ok(())
}

/// `text` without its backticks: they mark code in Markdown, and in the chart they would
/// only be noise.
fn plain(text: &str) -> String {
    text.chars().filter(|c| *c != '`').collect()
}

/// A panel's title, wrapped to the chart's width.
pub(crate) fn title_lines(title: &str) -> Vec<String> {
    wrap(&plain(title), TITLE_FACE, WIDTH - 2 * MARGIN)
}

/// The height of the block [`draw_title`] draws `lines` in.
pub(crate) fn title_height(lines: &[String]) -> u32 {
    MARGIN + 22 * lines.len() as u32
}

/// Draws a panel's title `lines` at the top of `area`, and returns the area below them.
pub(crate) fn draw_title<'a>(area: &Area<'a>, lines: &[String]) -> Result<Area<'a>, Box<dyn Error>> {
    draw_lines(area, lines, (MARGIN as i32, MARGIN as i32), TITLE_FACE, 22)?;
    Ok(area.split_vertically(title_height(lines)).1)
}

/// `count` distinct colours, in order: Tableau's ten, then their ten lighter companions,
/// then as many more as needed, hues spread around the wheel by the golden angle at three
/// lightnesses, so that no two series of a panel share a colour however many it has.
pub(crate) fn palette(count: usize) -> Vec<RGBColor> {
    const TABLEAU: [u32; 20] = [
        0x1f77b4, 0xff7f0e, 0x2ca02c, 0xd62728, 0x9467bd, 0x8c564b, 0xe377c2, 0x7f7f7f, 0xbcbd22, 0x17becf,
        0xaec7e8, 0xffbb78, 0x98df8a, 0xff9896, 0xc5b0d5, 0xc49c94, 0xf7b6d2, 0xc7c7c7, 0xdbdb8d, 0x9edae5,
    ];
    let fixed = TABLEAU
        .iter()
        .map(|rgb| RGBColor((rgb >> 16) as u8, (rgb >> 8) as u8, *rgb as u8));
    let generated = (0..).map(|index: usize| {
        let hue = (index as f64 * 0.381_966).fract();
        let (r, g, b) = HSLColor(hue, 0.7, [0.3, 0.45, 0.6][index % 3]).rgb();
        RGBColor(r, g, b)
    });
    let mut candidates = fixed.chain(generated);
    let mut colours: Vec<RGBColor> = Vec::with_capacity(count);
    while colours.len() < count {
        // A generated colour that rounds to one already taken is skipped, not repeated.
        let colour = candidates.next().expect("endless colours");
        if !colours.contains(&colour) {
            colours.push(colour);
        }
    }
    colours
}

/// One line of a curves panel: operations per second at each in-flight level.
struct Curve {
    /// Its legend entry, wrapped to the legend's width.
    name: Vec<String>,
    points: Vec<(f64, f64)>,
    /// Drawn dashed: the store's raw limit the tier is compared with.
    baseline: bool,
}

/// One bar of a bars panel.
struct Bar {
    /// Its name above it, wrapped to the chart's width.
    name: Vec<String>,
    per_second: f64,
    ratio: f64,
}

/// What a panel shows.
enum Body {
    Curves(Vec<Curve>),
    Bars(Vec<Bar>),
}

/// One table's panel.
struct Panel {
    /// The table's title, wrapped.
    title: Vec<String>,
    /// What the axis of the bars counts, e.g. `messages`; of curves, with the store:
    /// `Redis operations`.
    unit: String,
    body: Body,
}

/// The chart as SVG: the panels of the sections that have one.
pub(crate) fn render(sections: &[Section]) -> Result<String, Box<dyn Error>> {
    let panels: Vec<Panel> = sections.iter().filter_map(Panel::of).collect();
    let height: u32 = panels.iter().map(Panel::height).sum();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height.max(1))).into_drawing_area();
        root.fill(&WHITE)?;
        let mut rest = root.clone();
        for (index, panel) in panels.iter().enumerate() {
            let (area, below) = rest.split_vertically(panel.height());
            if index > 0 {
                // A rule between panels, so that a title reads with the plot below it.
                let rule = [(MARGIN as i32, 0), ((WIDTH - MARGIN) as i32, 0)];
                area.draw(&PathElement::new(rule, BLACK.mix(0.25)))?;
            }
            panel.draw(&area)?;
            rest = below;
        }
        root.present()?;
    }
    Ok(svg)
}

impl Panel {
    /// The panel of `section`, if it asks for one.
    fn of(section: &Section) -> Option<Panel> {
        let unit = section.unit.unwrap_or("operations");
        let (unit, body) = match section.plot {
            // "Redis operations", "HTTP requests": the panel's store, as its title may not say.
            Plot::Curves(store) => {
                let store = store.trim_end_matches(": ");
                (format!("{store} {unit}"), Body::Curves(curves(section)))
            }
            Plot::Bars => (unit.to_owned(), Body::Bars(bars(section))),
            Plot::None => return None,
        };
        Some(Panel {
            title: title_lines(&section.title),
            unit,
            body,
        })
    }

    /// The panel's height: its title, then its plot and legend, or its bars and axis.
    fn height(&self) -> u32 {
        let body = match &self.body {
            Body::Curves(curves) => {
                let legend: u32 = (curves.iter())
                    .map(|curve| LINE * curve.name.len() as u32 + ENTRY_GAP)
                    .sum();
                CURVE_PLOT_HEIGHT.max(legend + 2 * MARGIN)
            }
            Body::Bars(bars) => bars_height(bars) + AXIS_AREA + 2 * MARGIN,
        };
        title_height(&self.title) + body + MARGIN
    }

    /// Draws the panel into `area`, which is [`height`](Panel::height) high.
    fn draw(&self, area: &Area<'_>) -> Result<(), Box<dyn Error>> {
        let body = draw_title(area, &self.title)?;
        match &self.body {
            Body::Curves(curves) => draw_curves(&body, &self.unit, curves),
            Body::Bars(bars) => draw_bars(&body, &self.unit, bars),
        }
    }
}

/// The curves of a [`Plot::Curves`] section: one per operation, then the baseline.
fn curves(section: &Section) -> Vec<Curve> {
    let legend_text = WIDTH - CURVE_PLOT_WIDTH - 48 - MARGIN;
    let name = |what: &str| wrap(&plain(what), TEXT_FACE, legend_text);
    let mut curves: Vec<Curve> = Vec::new();
    let mut baseline = Curve {
        name: name(section.baseline_name),
        points: Vec::new(),
        baseline: true,
    };
    for row in &section.rows {
        let level = row.in_flight as f64;
        if !baseline.points.iter().any(|(at, _)| *at == level) {
            baseline.points.push((level, row.baseline));
        }
        let what = name(&row.what);
        match curves.iter_mut().find(|curve| curve.name == what) {
            Some(curve) => curve.points.push((level, row.per_second)),
            None => curves.push(Curve {
                name: what,
                points: vec![(level, row.per_second)],
                baseline: false,
            }),
        }
    }
    curves.push(baseline);
    curves
}

/// The bars of a [`Plot::Bars`] section, the baseline's first.
fn bars(section: &Section) -> Vec<Bar> {
    let name = |what: &str| wrap(&plain(what), TEXT_FACE, WIDTH - 2 * MARGIN);
    let baseline = section.rows.first().map_or(0.0, |row| row.baseline);
    std::iter::once(Bar {
        name: name(section.baseline_name),
        per_second: baseline,
        ratio: 1.0,
    })
    .chain(section.rows.iter().map(|row| Bar {
        name: name(&row.what),
        per_second: row.per_second,
        ratio: row.ratio(),
    }))
    .collect()
}

/// The smallest and largest of `values`.
fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values.fold((f64::MAX, f64::MIN), |(low, high), value| {
        (low.min(value), high.max(value))
    })
}

/// Throughput against in-flight level, both on log scales (the operations differ by orders
/// of magnitude, the levels by factors of four), with the legend in a column of its own on
/// the right.
fn draw_curves(area: &Area<'_>, unit: &str, curves: &[Curve]) -> Result<(), Box<dyn Error>> {
    let (plot, legend) = area.split_horizontally(CURVE_PLOT_WIDTH);
    let plot = plot.split_vertically(CURVE_PLOT_HEIGHT).0;
    let points = || curves.iter().flat_map(|curve| curve.points.iter());
    let (low_level, high_level) = bounds(points().map(|(level, _)| *level));
    let (low, high) = bounds(points().map(|(_, per_second)| *per_second));
    // Whole decades, so that every grid line is a power of ten.
    let decades = 10f64.powf(low.max(1.0).log10().floor())..10f64.powf(high.max(10.0).log10().ceil());
    let mut chart = ChartBuilder::on(&plot)
        .margin(MARGIN)
        .x_label_area_size(AXIS_AREA)
        .y_label_area_size(Y_AXIS_AREA)
        .build_cartesian_2d(
            (low_level..high_level.max(low_level * 2.0)).log_scale().base(2.0),
            decades.log_scale(),
        )?;
    chart
        .configure_mesh()
        // Between powers of two, light lines would mark nothing anyone reads off.
        .x_max_light_lines(0)
        .x_desc(format!("{} in flight", unit.rsplit(' ').next().unwrap_or(unit)))
        .y_desc(format!("{unit} per second"))
        .x_label_formatter(&|level| format!("{level:.0}"))
        .y_label_formatter(&|per_second| thousands(*per_second))
        .label_style((FONT, AXIS_SIZE))
        .draw()?;
    let colours = palette(curves.len());
    for (curve, colour) in curves.iter().zip(&colours) {
        let style = colour.stroke_width(2);
        if curve.baseline {
            chart.draw_series(DashedLineSeries::new(curve.points.iter().copied(), 6, 4, style))?;
        } else {
            chart.draw_series(LineSeries::new(curve.points.iter().copied(), style))?;
        }
        let dots = curve
            .points
            .iter()
            .map(|point| Circle::new(*point, 3, colour.filled()));
        chart.draw_series(dots)?;
    }
    draw_legend(&legend, curves, &colours)
}

/// One entry a curve, top down: a sample of its line, then its name, wrapped.
fn draw_legend(area: &Area<'_>, curves: &[Curve], colours: &[RGBColor]) -> Result<(), Box<dyn Error>> {
    let mut y = MARGIN as i32 + 8;
    for (curve, colour) in curves.iter().zip(colours) {
        let style = colour.stroke_width(2);
        let middle = y + LINE as i32 / 2;
        let sample = [(8, middle), (40, middle)];
        if curve.baseline {
            area.draw(&DashedPathElement::new(sample, 6, 4, style))?;
        } else {
            area.draw(&PathElement::new(sample, style))?;
        }
        draw_lines(area, &curve.name, (48, y + 2), TEXT_FACE, LINE)?;
        y += (LINE * curve.name.len() as u32 + ENTRY_GAP) as i32;
    }
    Ok(())
}

/// The height of the bars themselves: each its name's lines, the bar and a gap.
fn bars_height(bars: &[Bar]) -> u32 {
    (bars.iter())
        .map(|bar| LINE * bar.name.len() as u32 + BAR_THICKNESS + BAR_GAP)
        .sum()
}

/// A bar's rate and ratio, written at its end.
fn bar_value(bar: &Bar, unit: &str) -> String {
    format!("{} {unit}/s ({:.2}×)", thousands(bar.per_second), bar.ratio)
}

/// Throughput as horizontal bars, top down, each named above and with its rate and its
/// ratio to the first (the baseline) at its end; the axis runs far enough past the longest
/// bar for the widest such text.
fn draw_bars(area: &Area<'_>, unit: &str, bars: &[Bar]) -> Result<(), Box<dyn Error>> {
    let (_, high) = bounds(bars.iter().map(|bar| bar.per_second));
    let widest = (bars.iter())
        .map(|bar| TEXT_FACE.width(&bar_value(bar, unit)))
        .max()
        .unwrap_or(0);
    // Room on the right for half the axis's last label, centred on the axis's end.
    let right = 4 * MARGIN;
    let plot_width = f64::from(WIDTH - MARGIN - right);
    let x_max = high.max(1.0) * plot_width / (plot_width - f64::from(widest + 2 * MARGIN));
    // In pixels from the bottom of the bars, so that a slot's height is its pixels.
    let total = f64::from(bars_height(bars));
    let area = area
        .split_vertically(bars_height(bars) + AXIS_AREA + 2 * MARGIN)
        .0;
    let mut chart = ChartBuilder::on(&area)
        .margin(MARGIN)
        .margin_right(right)
        .x_label_area_size(AXIS_AREA)
        .build_cartesian_2d(0.0..x_max, 0.0..total)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .disable_y_axis()
        .max_light_lines(0)
        .x_desc(format!("{unit} per second"))
        .x_label_formatter(&|per_second| thousands(*per_second))
        .label_style((FONT, AXIS_SIZE))
        .draw()?;
    let name_style = TEXT_FACE.style(Pos::new(HPos::Left, VPos::Top));
    let value_style = TEXT_FACE.style(Pos::new(HPos::Left, VPos::Center));
    let gap = x_max * 6.0 / plot_width;
    let mut top = total;
    for (bar, colour) in bars.iter().zip(palette(bars.len())) {
        for (index, line) in bar.name.iter().enumerate() {
            let y = top - f64::from(LINE) * index as f64;
            chart.draw_series([Text::new(line.clone(), (0.0, y), name_style.clone())])?;
        }
        let bar_top = top - f64::from(LINE * bar.name.len() as u32);
        let bar_bottom = bar_top - f64::from(BAR_THICKNESS);
        let rectangle = [(0.0, bar_top), (bar.per_second, bar_bottom)];
        chart.draw_series([Rectangle::new(rectangle, colour.filled())])?;
        let value = (bar.per_second + gap, (bar_top + bar_bottom) / 2.0);
        chart.draw_series([Text::new(bar_value(bar, unit), value, value_style.clone())])?;
        top = bar_bottom - f64::from(BAR_GAP);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Row;

    /// How each benchmark's table is plotted, known by the start of its title.
    const PLOTS: [(&str, Plot); 6] = [
        ("Redis", Plot::Curves("Redis: ")),
        ("PostgreSQL", Plot::Curves("PostgreSQL: ")),
        ("MariaDB", Plot::Curves("MariaDB: ")),
        ("HTTP", Plot::Curves("HTTP: ")),
        ("RabbitMQ", Plot::Bars),
        ("RocketMQ", Plot::Bars),
    ];

    /// The tables of the repository's `BENCHMARKS.md` as the run that wrote it measured
    /// them: the chart of a real run, not of made-up names and titles.
    fn benchmarks_md() -> Vec<Section> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../BENCHMARKS.md");
        let report = std::fs::read_to_string(path).expect("BENCHMARKS.md");
        let section = |table: &str| {
            let mut lines = table.lines();
            let title = lines.next().expect("a title").to_owned();
            let start = PLOTS.iter().find(|(start, _)| title.starts_with(start));
            let header = lines
                .find(|line| line.starts_with("| measured"))
                .expect("a table");
            let column = header.split(" | ").nth(3).expect("the baseline's column");
            let column = column.trim_end_matches(" per second");
            let (baseline, unit) = match column.rsplit_once(", ") {
                Some((baseline, unit)) if ["messages", "requests"].contains(&unit) => (baseline, Some(unit)),
                _ => (column, None),
            };
            let cells = lines.skip(1).map_while(|line| line.strip_prefix("| "));
            let rows = cells.map(|line| {
                let cells: Vec<&str> = line.split(" | ").collect();
                let number = |cell: usize| -> f64 { cells[cell].parse().expect("a number") };
                Row {
                    what: cells[0].to_owned(),
                    in_flight: number(1) as usize,
                    per_second: number(2),
                    baseline: number(3),
                    lowest_ratio: None,
                }
            });
            Section {
                title,
                baseline_name: String::leak(baseline.to_owned()),
                unit: unit.map(|unit| &*String::leak(unit.to_owned())),
                rows: rows.collect(),
                note: None,
                plot: start.map_or(Plot::None, |(_, plot)| *plot),
            }
        };
        report.split("\n### ").skip(1).map(section).collect()
    }

    /// Each `<text>` of `svg` that is not rotated: how far left and right it reaches, its
    /// width estimated as the chart estimates it, and its text.
    fn texts(svg: &str) -> Vec<(f64, f64, String)> {
        let attribute = |element: &str, name: &str| {
            let start = element.find(&format!(" {name}=\""))? + name.len() + 3;
            Some(element[start..].split('"').next()?.to_owned())
        };
        // Only these two of the characters plotters escapes occur in the bench's texts.
        let unescape = |text: &str| text.replace("&apos;", "'").replace("&amp;", "&");
        (svg.split("<text").skip(1))
            .filter(|element| !element.split('>').next().unwrap_or("").contains("rotate"))
            .map(|element| {
                let (tag, rest) = element.split_once('>').expect("a text element");
                let text = unescape(rest.split("</text>").next().unwrap_or("").trim());
                let number = |name| {
                    attribute(tag, name)
                        .and_then(|value| value.parse().ok())
                        .expect(name)
                };
                let bold = tag.contains("font-weight=\"bold\"");
                let face = Face {
                    size: number("font-size") * 1.24,
                    bold,
                };
                let (x, width) = (number("x"), f64::from(face.width(&text)));
                match attribute(tag, "text-anchor").as_deref() {
                    Some("middle") => (x - width / 2.0, x + width / 2.0, text),
                    Some("end") => (x - width, x, text),
                    _ => (x, x + width, text),
                }
            })
            .collect()
    }

    /// The chart of `BENCHMARKS.md`'s run names every plotted table whole, every line and
    /// bar, and no text reaches past its edges; the pre-filter, which has no plot, is not in
    /// it. The chart is
    /// left in the temporary directory as `oncely-benchmarks.svg`, to look at.
    #[test]
    fn every_title_and_name_is_whole_and_inside() {
        let sections = benchmarks_md();
        let svg = render(&sections).expect("a chart");
        std::fs::write(std::env::temp_dir().join("oncely-benchmarks.svg"), &svg).expect("written");
        let texts = texts(&svg);
        for (left, right, text) in &texts {
            assert!(
                *left >= 0.0 && *right <= f64::from(WIDTH),
                "{text:?} reaches past an edge"
            );
        }
        let drawn: String = texts.iter().map(|(.., text)| format!("{text} ")).collect();
        let plotted = sections
            .iter()
            .filter(|section| !matches!(section.plot, Plot::None));
        let names = plotted.flat_map(|section| {
            let rows = section.rows.iter().map(|row| row.what.as_str());
            [section.title.as_str(), section.baseline_name]
                .into_iter()
                .chain(rows)
        });
        for name in names {
            // Without its backticks, its lines joined.
            let whole = plain(name).split_whitespace().collect::<Vec<_>>().join(" ");
            assert!(drawn.contains(&whole), "{name:?} is not whole in the chart");
        }
        assert!(
            !drawn.contains("pre-filter"),
            "the pre-filter has no place in the chart"
        );
    }

    /// No two colours of a palette are alike, up to well past the bench's largest panel.
    #[test]
    fn every_colour_of_a_palette_differs() {
        let colours = palette(64);
        let repeated = (0..colours.len()).find(|&index| colours[index + 1..].contains(&colours[index]));
        assert_eq!(repeated, None, "a colour comes twice");
    }
}
