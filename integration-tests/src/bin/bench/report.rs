//! The report `make bench` writes: `BENCHMARKS.md`, with the machine it ran on, the targets,
//! a table per benchmark and the chart (`benchmarks.svg`, drawn by [`crate::chart`]).

use std::fmt;
use std::path::Path;

use crate::chart;

/// The chart's file name, next to `BENCHMARKS.md`.
pub(crate) const CHART: &str = "benchmarks.svg";

/// A row of a benchmark's table: one operation at one in-flight level, next to its baseline
/// measured in the same rounds.
pub(crate) struct Row {
    pub(crate) what: String,
    pub(crate) in_flight: usize,
    pub(crate) per_second: f64,
    pub(crate) baseline: f64,
    /// The lowest ratio of any one round (its measurement against the baseline's taken beside
    /// it), when the row's medians come from rounds taking turns and a target bounds it.
    pub(crate) lowest_ratio: Option<f64>,
}

impl Row {
    /// Throughput as a multiple of the baseline's.
    pub(crate) fn ratio(&self) -> f64 {
        self.per_second / self.baseline
    }

    /// The ratio of the row of `rows` that measured `what` at `in_flight`.
    pub(crate) fn ratio_at(rows: &[Row], what: &str, in_flight: usize) -> f64 {
        rows.iter()
            .find(|row| row.what == what && row.in_flight == in_flight)
            .unwrap_or_else(|| panic!("no row measured {what} at {in_flight} in flight"))
            .ratio()
    }

    /// The ratio of the last row of `rows` that measured `what`: its highest in-flight level,
    /// which the targets are set at.
    pub(crate) fn last_ratio(rows: &[Row], what: &str) -> f64 {
        rows.iter()
            .rfind(|row| row.what == what)
            .unwrap_or_else(|| panic!("no row measured {what}"))
            .ratio()
    }
}

/// How a section's rows appear in the chart.
#[derive(Clone, Copy)]
pub(crate) enum Plot {
    /// As lines of throughput against in-flight level, one per operation and one for the
    /// baseline, each named after the store (the prefix, e.g. `Redis: `).
    Curves(&'static str),
    /// As bars, the baseline's first: measured at one in-flight level only.
    Bars,
    /// Not at all.
    None,
}

/// One benchmark's table in the report.
pub(crate) struct Section {
    pub(crate) title: String,
    /// What the rows are compared with, as the chart names it.
    pub(crate) baseline_name: &'static str,
    /// What the baseline counts when not operations, e.g. `messages`: the table's column
    /// then reads "raw lapin consumer, messages per second".
    pub(crate) unit: Option<&'static str>,
    pub(crate) rows: Vec<Row>,
    pub(crate) note: Option<String>,
    pub(crate) plot: Plot,
}

impl fmt::Display for Section {
    /// The section as Markdown: its title, its table, its note.
    fn fmt(&self, out: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = self.unit.map(|unit| format!(", {unit}")).unwrap_or_default();
        writeln!(out, "### {}\n", self.title)?;
        writeln!(
            out,
            "| measured | in flight | per second | {}{unit} per second | ratio |",
            self.baseline_name
        )?;
        writeln!(out, "|---|---:|---:|---:|---:|")?;
        for row in &self.rows {
            writeln!(
                out,
                "| {} | {} | {:.0} | {:.0} | {:.2}× |",
                row.what,
                row.in_flight,
                row.per_second,
                row.baseline,
                row.ratio()
            )?;
        }
        if let Some(note) = &self.note {
            write!(out, "\n{note}\n")?;
        }
        Ok(())
    }
}

/// A ratio an issue set a target for, and whether this run met it.
pub(crate) struct Target {
    /// What was measured, e.g. "Redis flag claims at 64 in flight".
    pub(crate) what: String,
    pub(crate) ratio: f64,
    /// What the ratio is to, e.g. "raw SET NX PX".
    pub(crate) baseline: String,
    /// The lowest ratio that meets the target.
    pub(crate) at_least: f64,
}

impl fmt::Display for Target {
    fn fmt(&self, out: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = if self.ratio >= self.at_least {
            "met"
        } else {
            "not met"
        };
        write!(
            out,
            "{}: {:.2}× {} (target ≥ {:.2}×: {verdict})",
            self.what, self.ratio, self.baseline, self.at_least
        )
    }
}

/// Everything one run measured: printed as it goes, then written to `BENCHMARKS.md` (its
/// [`Display`](fmt::Display)) and the chart.
pub(crate) struct Report {
    /// The machine table (see [`crate::machine`]).
    machine: String,
    sections: Vec<Section>,
    targets: Vec<Target>,
}

impl Report {
    /// An empty report of a run on the machine `machine` describes; prints the header.
    pub(crate) fn new(machine: String) -> Self {
        println!("## oncely benchmarks\n\n{machine}");
        Report {
            machine,
            sections: Vec::new(),
            targets: Vec::new(),
        }
    }

    /// Adds a benchmark's table, and prints it.
    pub(crate) fn add(&mut self, section: Section) {
        println!("\n{section}");
        self.sections.push(section);
    }

    /// Adds a target's verdict (printed at the end, with the others).
    pub(crate) fn add_target(&mut self, target: Target) {
        self.targets.push(target);
    }

    /// Prints the targets' verdicts.
    pub(crate) fn print_targets(&self) {
        println!();
        for target in &self.targets {
            println!("{target}");
        }
    }

    /// Writes `BENCHMARKS.md` and the chart into `directory`.
    pub(crate) fn write(&self, directory: &Path) -> Result<(), String> {
        let chart = chart::render(&self.sections).map_err(|error| format!("the chart: {error}"))?;
        std::fs::write(directory.join(CHART), chart)
            .and_then(|()| std::fs::write(directory.join("BENCHMARKS.md"), self.to_string()))
            .map_err(|error| error.to_string())
    }
}

impl fmt::Display for Report {
    /// `BENCHMARKS.md`: how it was made, the machine, the targets, every table and the chart.
    fn fmt(&self, out: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            out,
            "# oncely benchmarks\n\n\
             Written by `make bench`; every figure below comes from one run on the machine described, \
             and every ratio compares two figures measured in that same run, taking turns (five \
             rounds each for the Redis and PostgreSQL tiers, RocketMQ and HTTP, three for \
             RabbitMQ end to end, medians; one run each for the pre-filter and the long run), so that the machine's own noise hits both sides. Client and \
             servers share the machine's cores: these are ratios to the raw limit of each store \
             here, not absolute capacities.\n\n"
        )?;
        out.write_str(&self.machine)?;
        out.write_str("\n## Against the targets\n\n")?;
        for target in &self.targets {
            writeln!(out, "- {target}")?;
        }
        out.write_str("\n## Tables\n\n")?;
        for section in &self.sections {
            writeln!(out, "{section}")?;
        }
        writeln!(out, "## {}\n\n![{}]({CHART})", chart::TITLE, chart::ALT)
    }
}

/// The batched record's defaults, as the note under its measurements says them.
pub(crate) fn batched_defaults() -> String {
    use oncely::record::{
        DEFAULT_BATCH_HANDLER_LANES, DEFAULT_BATCH_HANDLER_MAX_BATCH, DEFAULT_LANES, DEFAULT_MAX_BATCH,
        DEFAULT_MAX_LINGER,
    };
    format!(
        "The batched record's defaults: {DEFAULT_LANES} lanes, batches of at most {DEFAULT_MAX_BATCH} \
         (with a batch handler {DEFAULT_BATCH_HANDLER_LANES} lanes of at most \
         {DEFAULT_BATCH_HANDLER_MAX_BATCH}), joiners taken in for {} ms.",
        DEFAULT_MAX_LINGER.as_millis()
    )
}
