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

/// `duration` in its two largest units (`3h 12m`, `9 days 13h`; milliseconds below a
/// second), for people.
pub(crate) fn rounded(duration: Duration) -> String {
    let rounded = match duration < Duration::from_secs(1) {
        true => Duration::from_millis(duration.as_millis() as u64),
        false => Duration::from_secs(duration.as_secs()),
    };
    let text = self::duration(rounded);
    let mut parts = text.split(' ').peekable();
    let mut kept = Vec::new();
    // A unit spelt as a word (`8 days`) is two parts, a number and its word.
    while kept.len() < 2 {
        let Some(part) = parts.next() else { break };
        match parts.peek() {
            Some(word) if word.starts_with(|c: char| c.is_ascii_alphabetic()) => {
                kept.push(format!("{part} {}", parts.next().unwrap_or_default()));
            }
            _ => kept.push(part.to_owned()),
        }
    }
    kept.join(" ")
}

/// `duration` as humantime writes it, with a space before a unit spelt as a word: `8 days
/// 13h 2m`, `1 month 2 days`, where humantime writes `8days 13h 2m`.
pub(crate) fn duration(duration: Duration) -> String {
    humantime::format_duration(duration)
        .to_string()
        .split(' ')
        .map(|part| {
            let digits = part.find(|c: char| !c.is_ascii_digit()).unwrap_or(part.len());
            match part[digits..].len() > 2 {
                true => format!("{} {}", &part[..digits], &part[digits..]),
                false => part.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `key` as reports show it: a client's scope in front of an HTTP route's key (32 hex
/// digits and a colon, oncely-http's `ClientScope`) cut to its first eight digits, as the
/// route's logs show it.
pub(crate) fn shown_key(key: &str) -> String {
    match key.split_once(':') {
        Some((scope, rest)) if scope.len() == 32 && scope.bytes().all(|b| b.is_ascii_hexdigit()) => {
            format!("{}…:{rest}", &scope[..8])
        }
        _ => key.to_owned(),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_put_a_space_before_a_unit_spelt_as_a_word() {
        let day = 24 * 3600;
        assert_eq!(duration(Duration::from_secs(8 * day)), "8 days");
        assert_eq!(duration(Duration::from_secs(day + 3600 + 60)), "1 day 1h 1m");
        assert_eq!(duration(Duration::from_secs(90 * 60)), "1h 30m");
        assert_eq!(
            rounded(Duration::from_secs(9 * day + 13 * 3600 + 7)),
            "9 days 13h"
        );
        assert_eq!(rounded(Duration::from_secs(3 * 3600 + 12 * 60 + 5)), "3h 12m");
        assert_eq!(rounded(Duration::from_millis(250)), "250ms");
    }
}
