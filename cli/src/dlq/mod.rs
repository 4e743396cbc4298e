//! `oncely dlq`: dead letters, read through oncely's dead-letter schema
//! ([`oncely::dead_letter`]), whichever broker they came through. What depends on the broker
//! is in its module (`amqp.rs`: RabbitMQ's `QUEUE.dlq`).

mod amqp;

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{ArgGroup, Args, Subcommand};
use oncely::DeadLetterReason;
use oncely::dead_letter::MAX_VALUE_CHARS;
use serde::Serialize;

use crate::Globals;
use crate::error::CliError;
use crate::output::{self, Report, cut};

/// The longest detail one entry of the history header keeps, in characters.
const HISTORY_DETAIL_CHARS: usize = 160;

/// What `oncely dlq` does.
#[derive(Debug, Subcommand)]
pub(crate) enum DlqCommand {
    /// Lists the dead letters of QUEUE.dlq (and leaves them there).
    #[command(after_help = "Example:\n  oncely dlq list --queue orders --reason rejected --since 2h")]
    List(Filter),
    /// Shows one dead letter whole: properties, headers and body.
    #[command(after_help = "Example:\n  oncely dlq show --queue orders --position 3")]
    Show(ShowArgs),
    /// Sends dead letters back to their work queue with a fresh attempt counter and the
    /// reason kept in a history header; each is removed only once the broker confirmed its
    /// copy.
    #[command(after_help = "Example:\n  oncely dlq replay --queue orders --reason rejected --dry-run")]
    Replay(ChangeArgs),
    /// Deletes dead letters.
    #[command(after_help = "Example:\n  oncely dlq purge --queue orders --reason bad_body --yes")]
    Purge(ChangeArgs),
}

/// Which dead letters a command takes.
#[derive(Clone, Debug, Args)]
pub(crate) struct Filter {
    /// The work queue; its dead letters are in QUEUE.dlq.
    #[arg(long)]
    queue: String,
    /// Only this reason.
    #[arg(long, value_parser = reason_parser())]
    reason: Option<DeadLetterReason>,
    /// Only dead letters of this route.
    #[arg(long)]
    route: Option<String>,
    /// Only dead letters dead-lettered within this long (`2h`, `30m`).
    #[arg(long, value_parser = humantime::parse_duration)]
    since: Option<Duration>,
    /// At most this many (reading stops there).
    #[arg(long)]
    limit: Option<usize>,
}

/// `--reason`: one of the library's codes, listed in `--help` and completions.
fn reason_parser() -> impl TypedValueParser<Value = DeadLetterReason> {
    PossibleValuesParser::new(DeadLetterReason::ALL.map(DeadLetterReason::code))
        .map(|code| DeadLetterReason::from_code(&code).expect("every listed code is a reason's"))
}

/// `dlq show`'s arguments.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("which").required(true).args(["id", "position"])))]
pub(crate) struct ShowArgs {
    /// The work queue; its dead letters are in QUEUE.dlq.
    #[arg(long)]
    queue: String,
    /// The dead letter with this message id.
    #[arg(long)]
    id: Option<String>,
    /// The dead letter at this position, as `dlq list` numbers them (from 1).
    #[arg(long)]
    position: Option<usize>,
    /// Print the body in hexadecimal rather than as UTF-8 text.
    #[arg(long)]
    body_hex: bool,
}

/// `dlq replay` and `dlq purge`'s arguments.
#[derive(Debug, Args)]
pub(crate) struct ChangeArgs {
    #[command(flatten)]
    filter: Filter,
    /// Show what would be done, change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Do not ask for confirmation.
    #[arg(long, short)]
    yes: bool,
}

/// Runs a `dlq` command.
pub(crate) async fn run(globals: &Globals, command: &DlqCommand) -> Result<(), CliError> {
    match command {
        DlqCommand::List(filter) => amqp::list(globals, filter).await,
        DlqCommand::Show(args) => amqp::show(globals, args).await,
        DlqCommand::Replay(args) => amqp::replay(globals, args).await,
        DlqCommand::Purge(args) => amqp::purge(globals, args).await,
    }
}

/// One dead letter, as the dead-letter schema describes it.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct DeadLetterInfo {
    /// Where it was in the dead-letter destination when read, from 1.
    position: usize,
    message_id: Option<String>,
    /// The reason code; `None` on a message whose headers are not oncely's.
    reason: Option<String>,
    route: Option<String>,
    attempts: Option<String>,
    /// Where it was consumed from: where a replay sends it.
    source: Option<String>,
    /// When, in ms since the Unix epoch.
    dead_lettered_at_ms: Option<u64>,
    detail: Option<String>,
    body_bytes: usize,
    /// Whether it carries oncely's dead-letter headers (a reason and a source).
    oncely: bool,
}

impl DeadLetterInfo {
    /// The dead letter at `position` with `metadata` (name → text), `message_id` and a body
    /// of `body_bytes`.
    fn new(
        position: usize,
        message_id: Option<String>,
        metadata: &BTreeMap<String, String>,
        body_bytes: usize,
    ) -> Self {
        use oncely::dead_letter::{ATTEMPTS, DEAD_LETTERED_AT, DETAIL, MESSAGE_ID, REASON, ROUTE, SOURCE};
        let get = |name: &str| metadata.get(name).cloned();
        DeadLetterInfo {
            position,
            message_id: message_id.or_else(|| get(MESSAGE_ID)),
            oncely: metadata.contains_key(REASON) && metadata.contains_key(SOURCE),
            reason: get(REASON),
            route: get(ROUTE),
            attempts: get(ATTEMPTS),
            source: get(SOURCE),
            dead_lettered_at_ms: get(DEAD_LETTERED_AT).and_then(|at| at.parse().ok()),
            detail: get(DETAIL),
            body_bytes,
        }
    }

    /// Whether `filter` takes it, at `now`.
    fn matches(&self, filter: &Filter, now: SystemTime) -> bool {
        let reason = filter
            .reason
            .is_none_or(|reason| self.reason.as_deref() == Some(reason.code()));
        let route = filter
            .route
            .as_ref()
            .is_none_or(|route| self.route.as_ref() == Some(route));
        let since = filter.since.is_none_or(|since| {
            let horizon = now.checked_sub(since).unwrap_or(UNIX_EPOCH);
            self.dead_lettered_at().is_some_and(|at| at >= horizon)
        });
        reason && route && since
    }

    fn dead_lettered_at(&self) -> Option<SystemTime> {
        self.dead_lettered_at_ms
            .map(|ms| UNIX_EPOCH + Duration::from_millis(ms))
    }

    /// `existing` history (the value of [`HISTORY`](oncely::dead_letter::HISTORY), if any)
    /// with this dead letter appended as `<dead-lettered-at ms> <reason>: <detail>`, entries
    /// joined by `; `. The oldest entries go first when the whole would be longer than
    /// [`MAX_VALUE_CHARS`]: the latest failure is the one a reader needs.
    fn history(&self, existing: Option<&str>) -> String {
        // `; ` separates the entries: inside a detail it becomes `, `, so that the history
        // splits back into the same entries.
        let detail: String = self
            .detail
            .as_deref()
            .unwrap_or_default()
            .replace("; ", ", ")
            .chars()
            .take(HISTORY_DETAIL_CHARS)
            .collect();
        let entry = format!(
            "{} {}: {detail}",
            self.dead_lettered_at_ms.unwrap_or_default(),
            self.reason.as_deref().unwrap_or("-")
        );
        let mut entries: Vec<&str> = existing
            .into_iter()
            .flat_map(|history| history.split("; "))
            .filter(|entry| !entry.is_empty())
            .collect();
        entries.push(&entry);
        let mut history = entries.join("; ");
        while history.chars().count() > MAX_VALUE_CHARS && entries.len() > 1 {
            entries.remove(0);
            history = entries.join("; ");
        }
        history.chars().take(MAX_VALUE_CHARS).collect()
    }
}

/// Dead letters as a table: the rows of `list`, `replay --dry-run` and the like.
fn letters_table(letters: &[DeadLetterInfo]) -> String {
    let mut table = output::table(&[
        "#",
        "message id",
        "reason",
        "route",
        "attempts",
        "dead-lettered",
        "detail",
        "body",
    ]);
    for letter in letters {
        let dash = |value: &Option<String>| value.clone().unwrap_or_else(|| "-".into());
        table.add_row([
            letter.position.to_string(),
            dash(&letter.message_id),
            dash(&letter.reason),
            dash(&letter.route),
            dash(&letter.attempts),
            output::when_opt(letter.dead_lettered_at()),
            cut(letter.detail.as_deref().unwrap_or("-"), 50),
            format!("{} B", letter.body_bytes),
        ]);
    }
    table.to_string()
}

/// `dlq list`'s report.
#[derive(Debug, Serialize)]
struct ListView {
    dead_letter_queue: String,
    /// Messages read (every one, up to `--limit` matches).
    read: usize,
    dead_letters: Vec<DeadLetterInfo>,
}

impl Report for ListView {
    fn human(&self) -> String {
        if self.dead_letters.is_empty() {
            return format!(
                "no matching dead letter in {} ({} read)",
                self.dead_letter_queue, self.read
            );
        }
        format!(
            "{}\n{} matching of {} read in {}",
            letters_table(&self.dead_letters),
            self.dead_letters.len(),
            self.read,
            self.dead_letter_queue
        )
    }
}

/// `dlq replay` and `dlq purge`'s report.
#[derive(Debug, Serialize)]
struct ChangeView {
    /// `replay` or `purge`.
    action: &'static str,
    dead_letter_queue: String,
    dry_run: bool,
    /// Those replayed or purged (with `--dry-run`: those that would be).
    done: Vec<DeadLetterInfo>,
    /// Matching dead letters `replay` left in place: their headers are not oncely's, or their
    /// source is not `--queue`.
    not_oncely: Vec<DeadLetterInfo>,
    /// Matching dead letters left in place because the command stopped on an error.
    not_done: usize,
}

impl Report for ChangeView {
    fn human(&self) -> String {
        let mut text = String::new();
        if !self.done.is_empty() {
            text.push_str(&letters_table(&self.done));
            text.push('\n');
        }
        let verb = match (self.action, self.dry_run) {
            ("replay", true) => "would replay",
            ("replay", false) => "replayed",
            (_, true) => "would purge",
            (_, false) => "purged",
        };
        text.push_str(&format!(
            "{verb} {} from {}",
            self.done.len(),
            self.dead_letter_queue
        ));
        if self.not_done > 0 {
            text.push_str(&format!(
                "; {} left in place after the error below",
                self.not_done
            ));
        }
        if !self.not_oncely.is_empty() {
            let positions: Vec<String> = self
                .not_oncely
                .iter()
                .map(|l| format!("#{}", l.position))
                .collect();
            text.push_str(&format!(
                "; left in place, not oncely's or from another queue (x-oncely-source): {}",
                positions.join(", ")
            ));
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter(at: u64, reason: &str, detail: &str) -> DeadLetterInfo {
        let metadata = BTreeMap::from([
            (oncely::dead_letter::REASON.to_owned(), reason.to_owned()),
            (oncely::dead_letter::DETAIL.to_owned(), detail.to_owned()),
            (oncely::dead_letter::DEAD_LETTERED_AT.to_owned(), at.to_string()),
        ]);
        DeadLetterInfo::new(1, None, &metadata, 0)
    }

    #[test]
    fn history_appends_and_keeps_the_latest_within_the_cap() {
        let first = letter(1, "rejected", "no such account");
        assert_eq!(first.history(None), "1 rejected: no such account");
        let second = letter(2, "bad_body", &"x".repeat(400));
        let history = second.history(Some("1 rejected: no such account"));
        assert_eq!(
            history,
            format!("1 rejected: no such account; 2 bad_body: {}", "x".repeat(160))
        );
        let mut long = String::new();
        for at in 0..10 {
            long = letter(at, "rejected", &"y".repeat(200)).history(Some(&long));
        }
        assert!(long.chars().count() <= MAX_VALUE_CHARS, "{long}");
        assert!(long.ends_with(&format!("9 rejected: {}", "y".repeat(160))));
        // A detail holding the separator stays one entry.
        let third = letter(3, "rejected", "a; b");
        assert_eq!(third.history(Some("1 x: y")), "1 x: y; 3 rejected: a, b");
    }
}
