//! The report `make bench` writes: `BENCHMARKS.md`, with a table per tier, the machine it
//! ran on, and an SVG chart of throughput against in-flight concurrency.

use std::fmt::Write as _;
use std::process::Command;

use integration_tests::thousands;

/// The chart's file name, next to `BENCHMARKS.md`.
pub(crate) const CHART: &str = "benchmarks.svg";

/// A row of a tier's table.
pub(crate) struct Row {
    pub(crate) what: &'static str,
    pub(crate) in_flight: usize,
    pub(crate) per_second: f64,
    pub(crate) baseline: f64,
}

/// One tier's table in the report.
pub(crate) struct Section {
    pub(crate) title: String,
    pub(crate) baseline_name: &'static str,
    pub(crate) rows: Vec<Row>,
    pub(crate) note: Option<String>,
}

impl Section {
    pub(crate) fn markdown(&self) -> String {
        let mut out = format!("### {}\n\n", self.title);
        out += &format!(
            "| measured | in flight | per second | {} per second | ratio |\n",
            self.baseline_name
        );
        out += "|---|---:|---:|---:|---:|\n";
        for row in &self.rows {
            out += &format!(
                "| {} | {} | {:.0} | {:.0} | {:.2}× |\n",
                row.what,
                row.in_flight,
                row.per_second,
                row.baseline,
                row.per_second / row.baseline
            );
        }
        if let Some(note) = &self.note {
            out += &format!("\n{note}\n");
        }
        out
    }
}

/// One line of the chart: throughput at each in-flight level.
pub(crate) struct Series {
    name: String,
    points: Vec<(usize, f64)>,
}

/// Everything one run measured, printed as it goes and written to `BENCHMARKS.md`.
#[derive(Default)]
pub(crate) struct Report {
    pub(crate) sections: Vec<Section>,
    pub(crate) series: Vec<Series>,
    pub(crate) summary: Vec<String>,
}

impl Report {
    pub(crate) fn add(&mut self, section: Section) {
        println!("\n{}", section.markdown());
        self.sections.push(section);
    }

    /// Adds the rows of `rows` measured at several in-flight levels as chart lines: one for
    /// the baseline (`baseline_name`) and one per measured operation.
    pub(crate) fn add_curves(&mut self, prefix: &str, baseline_name: &str, rows: &[Row]) {
        let mut baseline = Series {
            name: format!("{prefix}{baseline_name}"),
            points: Vec::new(),
        };
        for row in rows {
            if !baseline.points.iter().any(|(level, _)| *level == row.in_flight) {
                baseline.points.push((row.in_flight, row.baseline));
            }
            // The chart's legend has room for the name, not the parenthesised detail.
            let short = row.what.split(" (").next().unwrap_or(row.what);
            let name = format!("{prefix}{short}");
            match self.series.iter_mut().find(|series| series.name == name) {
                Some(series) => series.points.push((row.in_flight, row.per_second)),
                None => self.series.push(Series {
                    name,
                    points: vec![(row.in_flight, row.per_second)],
                }),
            }
        }
        self.series.push(baseline);
    }
}

/// What the numbers were measured on: cores, CPU, memory, kernel, and the servers' versions.
pub(crate) fn machine() -> String {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let cpu = cpuinfo
        .lines()
        .find_map(|line| {
            line.strip_prefix("model name")
                .map(|rest| rest.trim_start_matches([' ', '\t', ':']))
        })
        .unwrap_or("unknown CPU");
    let memory_gib = read("/proc/meminfo")
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|rest| rest.trim().trim_end_matches(" kB").parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0 / 1024.0);
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let command = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .output()
            .ok()
            .map(|output| {
                String::from_utf8_lossy(&output.stdout)
                    .lines()
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_owned()
            })
            .filter(|line| !line.is_empty())
            .unwrap_or_else(|| "unknown".into())
    };
    let mut out = String::new();
    let _ = writeln!(out, "| machine | |\n|---|---|");
    let _ = writeln!(
        out,
        "| date (UTC) | {} |",
        command("date", &["-u", "+%Y-%m-%d %H:%M"])
    );
    let _ = writeln!(out, "| cores | {cores} |");
    let _ = writeln!(out, "| CPU | {cpu} |");
    let _ = writeln!(out, "| memory | {memory_gib:.0} GiB |");
    let _ = writeln!(out, "| kernel | {} |", read("/proc/sys/kernel/osrelease").trim());
    let _ = writeln!(out, "| Redis | {} |", command("redis-server", &["--version"]));
    let _ = writeln!(out, "| PostgreSQL | {} |", command("psql", &["--version"]));
    let _ = writeln!(out, "| RabbitMQ | {} |", command("rabbitmqctl", &["version"]));
    let _ = writeln!(out, "| rustc | {} |", command("rustc", &["--version"]));
    out
}

/// `BENCHMARKS.md`: how it was made, the machine, the targets, every table and the chart.
pub(crate) fn markdown(machine: &str, report: &Report) -> String {
    let mut out = String::from(
        "# oncely benchmarks\n\n\
         Written by `make bench`; every figure below comes from one run on the machine described, \
         and every ratio compares two figures measured in that same run, alternately, five \
         rounds each (medians), so that the machine's own noise hits both sides. Client and \
         servers share the machine's cores: these are ratios to the raw limit of each store \
         here, not absolute capacities.\n\n",
    );
    out += machine;
    out += "\n## Against the targets\n\n";
    for line in &report.summary {
        let _ = writeln!(out, "- {line}");
    }
    out += "\n## Tables\n\n";
    for section in &report.sections {
        out += &section.markdown();
        out += "\n";
    }
    let _ = writeln!(
        out,
        "## Throughput against in-flight concurrency\n\n![throughput against in-flight concurrency]({CHART})"
    );
    out
}

/// Colours of the chart's lines, in series order.
const COLOURS: [&str; 6] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];

/// An SVG line chart of every series: in-flight level on a log₂ axis, operations per second
/// on a log₁₀ axis (the stores differ by orders of magnitude).
pub(crate) fn chart(series: &[Series]) -> String {
    let (width, height) = (760.0, 440.0);
    let (left, right, top, bottom) = (80.0, 250.0, 30.0, 50.0);
    let (plot_w, plot_h) = (width - left - right, height - top - bottom);
    let points = series.iter().flat_map(|series| series.points.iter());
    let (mut min_level, mut max_level, mut min_y, mut max_y) = (usize::MAX, 1, f64::MAX, 1.0_f64);
    for &(level, per_second) in points {
        min_level = min_level.min(level);
        max_level = max_level.max(level);
        min_y = min_y.min(per_second);
        max_y = max_y.max(per_second);
    }
    let (min_level, max_level) = (min_level.max(1) as f64, max_level.max(2) as f64);
    let (decade_low, decade_high) = (min_y.max(1.0).log10().floor(), max_y.max(10.0).log10().ceil());
    let x = |level: f64| {
        left + plot_w * (level.log2() - min_level.log2()) / (max_level.log2() - min_level.log2())
    };
    let y = |per_second: f64| {
        top + plot_h * (1.0 - (per_second.max(1.0).log10() - decade_low) / (decade_high - decade_low))
    };

    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="18" text-anchor="middle" font-size="14">Throughput against in-flight concurrency (log scales)</text>
"#,
        left + plot_w / 2.0
    );
    let mut decade = decade_low;
    while decade <= decade_high {
        let at = y(10f64.powf(decade));
        let _ = writeln!(
            svg,
            r##"<line x1="{left}" y1="{at:.1}" x2="{:.1}" y2="{at:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            left + plot_w,
            left - 6.0,
            at + 4.0,
            thousands(10f64.powf(decade))
        );
        decade += 1.0;
    }
    let mut level = min_level;
    while level <= max_level {
        let at = x(level);
        let _ = writeln!(
            svg,
            r##"<line x1="{at:.1}" y1="{top}" x2="{at:.1}" y2="{:.1}" stroke="#eee"/><text x="{at:.1}" y="{:.1}" text-anchor="middle">{level}</text>"##,
            top + plot_h,
            top + plot_h + 16.0
        );
        level *= 2.0;
    }
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">operations in flight</text><text x="16" y="{:.1}" text-anchor="middle" transform="rotate(-90 16 {:.1})">operations per second</text>"#,
        left + plot_w / 2.0,
        height - 10.0,
        top + plot_h / 2.0,
        top + plot_h / 2.0
    );
    for (index, series) in series.iter().enumerate() {
        let colour = COLOURS[index % COLOURS.len()];
        let dash = if series.name.contains("raw") || series.name.contains("single-row") {
            r#" stroke-dasharray="5 4""#
        } else {
            ""
        };
        let path: Vec<String> = series
            .points
            .iter()
            .map(|&(level, per_second)| format!("{:.1},{:.1}", x(level as f64), y(per_second)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>"#,
            path.join(" ")
        );
        for &(level, per_second) in &series.points {
            let _ = writeln!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{colour}"><title>{}: {} at {level}</title></circle>"#,
                x(level as f64),
                y(per_second),
                escape(&series.name),
                thousands(per_second)
            );
        }
        let legend_y = top + 14.0 + 18.0 * index as f64;
        let _ = writeln!(
            svg,
            r#"<line x1="{:.1}" y1="{legend_y:.1}" x2="{:.1}" y2="{legend_y:.1}" stroke="{colour}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}">{}</text>"#,
            width - right + 12.0,
            width - right + 34.0,
            width - right + 40.0,
            legend_y + 4.0,
            escape(&series.name)
        );
    }
    svg += "</svg>\n";
    svg
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('`', "")
}
