//! What the operator sees and answers, written once: a report as a table or as JSON, times,
//! progress bars and the confirmation prompt.

use std::io::{BufRead, IsTerminal, Write};
use std::time::{Duration, SystemTime};

use comfy_table::{ContentArrangement, Table, presets};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use crate::error::CliError;

/// A command's report: JSON with `--json` (for scripts), text and tables otherwise.
pub(crate) trait Report: Serialize {
    /// The report for people.
    fn human(&self) -> String;
}

/// Prints `report` on standard output, as JSON when `json`.
pub(crate) fn print(report: &impl Report, json: bool) -> Result<(), CliError> {
    let text = match json {
        true => serde_json::to_string_pretty(report).map_err(std::io::Error::other)?,
        false => report.human(),
    };
    writeln!(std::io::stdout().lock(), "{}", text.trim_end())?;
    Ok(())
}

/// A table with `header`, in the house style.
pub(crate) fn table(header: &[&str]) -> Table {
    let mut table = Table::new();
    table
        .load_preset(presets::UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(header.iter().copied());
    table
}

/// A two-column table of names and values, for one item's fields.
pub(crate) fn fields<'a>(rows: impl IntoIterator<Item = (&'a str, String)>) -> Table {
    let mut table = Table::new();
    table
        .load_preset(presets::UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Disabled);
    for (name, value) in rows {
        table.add_row([name.to_owned(), value]);
    }
    table
}

/// `at` for JSON: RFC 3339 in UTC, to the millisecond.
pub(crate) fn rfc3339(at: SystemTime) -> String {
    humantime::format_rfc3339_millis(at).to_string()
}

/// `at` for people: to the second, and how long ago or ahead it is.
pub(crate) fn when(at: SystemTime) -> String {
    let relative = match at.duration_since(SystemTime::now()) {
        Ok(ahead) => format!("in {}", rounded(ahead)),
        Err(past) => format!("{} ago", rounded(past.duration())),
    };
    format!("{} ({relative})", humantime::format_rfc3339_seconds(at))
}

/// An optional time for people: `-` when absent.
pub(crate) fn when_opt(at: Option<SystemTime>) -> String {
    at.map_or_else(|| "-".to_owned(), when)
}

/// `duration` in its two largest units (`3h 12m`, `9days 13h`; milliseconds below a
/// second), for people.
pub(crate) fn rounded(duration: Duration) -> String {
    let rounded = match duration < Duration::from_secs(1) {
        true => Duration::from_millis(duration.as_millis() as u64),
        false => Duration::from_secs(duration.as_secs()),
    };
    let text = humantime::format_duration(rounded).to_string();
    text.split(' ').take(2).collect::<Vec<_>>().join(" ")
}

/// `text` cut to `max` characters, with `…` where it was cut: for table cells.
pub(crate) fn cut(text: &str, max: usize) -> String {
    match text.chars().count() > max {
        true => format!(
            "{}…",
            text.chars().take(max.saturating_sub(1)).collect::<String>()
        ),
        false => text.to_owned(),
    }
}

/// A progress bar of `len` steps on standard error, hidden with `--json` or when standard
/// error is not a terminal (a script's log would fill with redraws).
pub(crate) fn progress(len: u64, what: &str, json: bool) -> ProgressBar {
    if json || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({per_sec}, {eta} left)")
        .expect("a valid template")
        .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(what.to_owned());
    bar
}

/// Asks `question` on standard error and reads the answer from standard input, unless `yes`
/// (`--yes`, for scripts). Anything but `y` or `yes` (an empty line, end of input) declines.
pub(crate) async fn confirm(question: String, yes: bool) -> Result<(), CliError> {
    if yes {
        return Ok(());
    }
    // Off the runtime's threads: a broker connection's heartbeats go on while the operator
    // thinks.
    let answer = tokio::task::spawn_blocking(move || {
        eprint!("{question} [y/N] ");
        std::io::stderr().flush()?;
        let mut answer = String::new();
        if std::io::stdin().lock().read_line(&mut answer)? == 0 {
            // No input at all: end the prompt's line before what follows.
            eprintln!();
        }
        Ok::<_, std::io::Error>(answer)
    })
    .await
    .map_err(std::io::Error::other)??;
    match answer.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" => Ok(()),
        _ => Err(CliError::Declined),
    }
}
