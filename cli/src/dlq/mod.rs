//! `oncely dlq`: dead letters, read through oncely's dead-letter schema
//! ([`oncely::dead_letter`]), whichever broker they came through. The commands are written
//! once here, over [`DeadLetters`]; what depends on the broker is in its module (`amqp.rs`:
//! RabbitMQ's `QUEUE.dlq`; `rocketmq.rs`: a RocketMQ dead-letter topic).

mod amqp;
mod rocketmq;

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
    /// Lists dead letters (and leaves them there).
    #[command(
        after_help = "Example:\n  oncely dlq list --queue orders --reason rejected --since 2h\n  \
                            oncely dlq list --topic rocketmq_points_dead_letters --route credit_points"
    )]
    List(Filter),
    /// Shows one dead letter whole: properties, headers and body.
    #[command(after_help = "Example:\n  oncely dlq show --queue orders --position 3")]
    Show(ShowArgs),
    /// Sends dead letters back where they were consumed from, with a fresh attempt counter
    /// and the reason kept in a history header; each is removed only once the broker
    /// confirmed its copy.
    #[command(after_help = "Example:\n  oncely dlq replay --queue orders --reason rejected --dry-run")]
    Replay(ChangeArgs),
    /// Deletes dead letters.
    #[command(after_help = "Example:\n  oncely dlq purge --queue orders --reason bad_body --yes")]
    Purge(ChangeArgs),
}

/// Where the dead letters are: RabbitMQ's `--queue` or RocketMQ's `--topic`.
#[derive(Clone, Debug, Args)]
#[group(required = true, multiple = false)]
pub(crate) struct Destination {
    /// RabbitMQ: the work queue; its dead letters are in QUEUE.dlq.
    #[arg(long)]
    queue: Option<String>,
    /// RocketMQ: the dead-letter topic the listeners' `DeadLetterTopic` writes to.
    #[arg(long)]
    topic: Option<String>,
}

/// Which dead letters a command takes.
#[derive(Clone, Debug, Args)]
pub(crate) struct Filter {
    #[command(flatten)]
    at: Destination,
    /// Only this reason.
    #[arg(long, value_parser = reason_parser())]
    reason: Option<DeadLetterReason>,
    /// Only dead letters of this route.
    #[arg(long)]
    route: Option<String>,
    /// Only dead letters dead-lettered within this long (`2h`, `30m`).
    #[arg(long, value_parser = humantime::parse_duration)]
    since: Option<Duration>,
    /// At most this many (RabbitMQ stops reading there; RocketMQ reads every dead letter not
    /// handled yet first).
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
    #[command(flatten)]
    at: Destination,
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

/// Runs a `dlq` command on the broker its destination names.
pub(crate) async fn run(globals: &Globals, command: &DlqCommand) -> Result<(), CliError> {
    let at = match command {
        DlqCommand::List(filter) => &filter.at,
        DlqCommand::Show(args) => &args.at,
        DlqCommand::Replay(args) | DlqCommand::Purge(args) => &args.filter.at,
    };
    match (&at.queue, &at.topic) {
        (Some(queue), _) => {
            on(
                amqp::DeadLetterQueue::open(globals, queue).await?,
                globals,
                command,
            )
            .await
        }
        (None, Some(topic)) => {
            on(
                rocketmq::DeadLetterTopic::open(globals, topic).await?,
                globals,
                command,
            )
            .await
        }
        (None, None) => unreachable!("clap requires --queue or --topic"),
    }
}

async fn on<D: DeadLetters>(dead: D, globals: &Globals, command: &DlqCommand) -> Result<(), CliError> {
    match command {
        DlqCommand::List(filter) => list(dead, globals, filter).await,
        DlqCommand::Show(args) => show(dead, globals, args).await,
        DlqCommand::Replay(args) => change(dead, globals, args, Action::Replay).await,
        DlqCommand::Purge(args) => change(dead, globals, args, Action::Purge).await,
    }
}

/// One broker's dead-letter destination, as the commands use it. Dead letters read stay
/// where they are until [`remove`](Self::remove)d; [`finish`](Self::finish) leaves the others
/// as they were and lets go of the broker.
trait DeadLetters {
    /// A dead letter as the broker handed it over.
    type Message;

    /// Its name in reports: `orders.dlq`, `topic points_dead_letters`.
    fn name(&self) -> &str;

    /// Reads the dead letters there now, in order and numbered from 1, leaving them in place;
    /// those arriving meanwhile are not waited for. Reading may stop once `filter`'s
    /// `--limit` matched.
    async fn read(
        &mut self,
        filter: Option<&Filter>,
    ) -> Result<Vec<(DeadLetterInfo, Self::Message)>, CliError>;

    /// `message` whole, for `dlq show`.
    fn whole<'m>(&self, message: &'m Self::Message) -> Whole<'m>;

    /// Whether `replay` may send this dead letter back: oncely's, with a source this
    /// destination replays to.
    fn replayable(&self, info: &DeadLetterInfo) -> bool;

    /// Before a replay reads anything (a dry run too): checks that copies have somewhere to
    /// go.
    async fn check_replay(&self) -> Result<(), CliError>;

    /// Sends a copy of `message` back to its source — the dead-letter metadata and the
    /// runner's counters dropped, the reason kept in the history — and waits until the broker
    /// stored it.
    async fn replay(&mut self, info: &DeadLetterInfo, message: &Self::Message) -> Result<(), CliError>;

    /// Removes a dead letter read, in the order read. Answers how many others, left in
    /// place, had to be written again at the end of the destination for that.
    async fn remove(&mut self, info: &DeadLetterInfo, message: &Self::Message) -> Result<usize, CliError>;

    /// Leaves every dead letter read and not removed in the destination, and lets go of the
    /// broker.
    async fn finish(self) -> Result<(), CliError>;
}

/// A dead letter whole, as `dlq show` prints it.
struct Whole<'m> {
    /// The broker's properties of the message (ids, times, keys).
    properties: BTreeMap<&'static str, String>,
    /// Its headers or user properties, as text.
    headers: BTreeMap<String, String>,
    body: &'m [u8],
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
    /// This letter, taken as not oncely's whatever its headers say: the broker dead-lettered
    /// it itself. Listed, never replayed nor purged.
    fn not_oncely(mut self) -> Self {
        self.oncely = false;
        self
    }

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
    destination: String,
    /// Messages read (every one, up to `--limit` matches).
    read: usize,
    dead_letters: Vec<DeadLetterInfo>,
}

impl Report for ListView {
    fn human(&self) -> String {
        if self.dead_letters.is_empty() {
            return format!(
                "no matching dead letter in {} ({} read)",
                self.destination, self.read
            );
        }
        format!(
            "{}\n{} matching of {} read in {}",
            letters_table(&self.dead_letters),
            self.dead_letters.len(),
            self.read,
            self.destination
        )
    }
}

/// `dlq replay` and `dlq purge`'s report.
#[derive(Debug, Serialize)]
struct ChangeView {
    /// `replay` or `purge`.
    action: &'static str,
    destination: String,
    dry_run: bool,
    /// Those replayed or purged (with `--dry-run`: those that would be).
    done: Vec<DeadLetterInfo>,
    /// Matching dead letters left in place: their headers are not oncely's, or (`replay`)
    /// their source is not where this destination replays to.
    not_oncely: Vec<DeadLetterInfo>,
    /// Matching dead letters left in place because the command stopped on an error.
    not_done: usize,
    /// Dead letters left in place that had to be written again at the end of the
    /// destination, so that those done could be removed (RocketMQ; see `rocketmq.rs`).
    written_again: usize,
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
        text.push_str(&format!("{verb} {} from {}", self.done.len(), self.destination));
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
                "; left in place, not oncely's or from elsewhere (x-oncely-source): {}",
                positions.join(", ")
            ));
        }
        if self.written_again > 0 {
            text.push_str(&format!(
                "; {} left in place were written again at the end of {}",
                self.written_again, self.destination
            ));
        }
        text
    }
}

/// `oncely dlq list`.
async fn list<D: DeadLetters>(mut dead: D, globals: &Globals, filter: &Filter) -> Result<(), CliError> {
    let read = dead.read(Some(filter)).await?;
    let now = SystemTime::now();
    let view = ListView {
        destination: dead.name().to_owned(),
        read: read.len(),
        dead_letters: read
            .iter()
            .map(|(info, _)| info)
            .filter(|info| info.matches(filter, now))
            .cloned()
            .collect(),
    };
    dead.finish().await?;
    output::print(&view, globals.json)
}

/// `dlq show`'s report.
#[derive(Debug, Serialize)]
struct ShowView {
    dead_letter: DeadLetterInfo,
    properties: BTreeMap<&'static str, String>,
    headers: BTreeMap<String, String>,
    /// `utf-8` (lossy) or `hex`.
    body_encoding: &'static str,
    body: String,
}

impl ShowView {
    fn new(info: &DeadLetterInfo, whole: Whole<'_>, hex: bool) -> Self {
        let (body_encoding, body) = match hex {
            true => (
                "hex",
                whole.body.iter().map(|byte| format!("{byte:02x}")).collect(),
            ),
            false => ("utf-8", String::from_utf8_lossy(whole.body).into_owned()),
        };
        ShowView {
            dead_letter: info.clone(),
            properties: whole.properties,
            headers: whole.headers,
            body_encoding,
            body,
        }
    }
}

impl Report for ShowView {
    fn human(&self) -> String {
        let properties = output::fields(self.properties.iter().map(|(name, value)| (*name, value.clone())));
        let headers = output::fields(
            self.headers
                .iter()
                .map(|(name, value)| (name.as_str(), value.clone())),
        );
        format!(
            "dead letter #{}\n\nproperties\n{properties}\n\nheaders\n{headers}\n\nbody ({} bytes, {})\n{}",
            self.dead_letter.position, self.dead_letter.body_bytes, self.body_encoding, self.body
        )
    }
}

/// `oncely dlq show`.
async fn show<D: DeadLetters>(mut dead: D, globals: &Globals, args: &ShowArgs) -> Result<(), CliError> {
    let read = dead.read(None).await?;
    let found = read.iter().find(|(info, _)| match (&args.id, args.position) {
        (Some(id), _) => info.message_id.as_ref() == Some(id),
        (None, Some(position)) => info.position == position,
        (None, None) => false,
    });
    let view = found.map(|(info, message)| ShowView::new(info, dead.whole(message), args.body_hex));
    let name = dead.name().to_owned();
    dead.finish().await?;
    match view {
        Some(view) => output::print(&view, globals.json),
        None => Err(CliError::NotFound(match &args.id {
            Some(id) => format!("no dead letter with message id {id:?} in {name}"),
            None => format!("no dead letter at that position in {name}"),
        })),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Replay,
    Purge,
}

/// Reads, asks, then replays or purges the matching dead letters one by one, and leaves the
/// rest in place. Stops at the first failure: those not done stay where they were.
async fn change<D: DeadLetters>(
    mut dead: D,
    globals: &Globals,
    args: &ChangeArgs,
    action: Action,
) -> Result<(), CliError> {
    let filter = &args.filter;
    if action == Action::Replay {
        dead.check_replay().await?;
    }
    let read = dead.read(Some(filter)).await?;
    let now = SystemTime::now();
    let (matching, not_oncely): (Vec<_>, Vec<_>) = read
        .iter()
        .filter(|(info, _)| info.matches(filter, now))
        .partition(|(info, _)| match action {
            // A replay sends a copy only where this destination replays to: a dead letter
            // that is not oncely's, or that names another source (moved or written by hand),
            // stays where it is.
            Action::Replay => dead.replayable(info),
            // The broker's own dead letters (past its delivery limit) are the only copy left
            // of their message: the tool deletes oncely's only.
            Action::Purge => info.oncely,
        });
    let mut view = ChangeView {
        action: match action {
            Action::Replay => "replay",
            Action::Purge => "purge",
        },
        destination: dead.name().to_owned(),
        dry_run: args.dry_run,
        done: Vec::new(),
        not_oncely: not_oncely.iter().map(|(info, _)| info.clone()).collect(),
        not_done: 0,
        written_again: 0,
    };
    let answer = match args.dry_run {
        true => {
            view.done = matching.iter().map(|(info, _)| info.clone()).collect();
            Ok(())
        }
        false => apply(&mut dead, globals, args, action, &matching, &mut view).await,
    };
    // The report first: what was done must reach the operator even if leaving the rest in
    // place fails (the connection died with the error that stopped the command).
    let finished = dead.finish().await;
    output::print(&view, globals.json)?;
    answer?;
    finished?;
    match view.not_oncely.len() {
        0 => Ok(()),
        skipped => Err(CliError::Incomplete(format!(
            "{skipped} dead letters are not oncely's, or name another source, and were left in place \
             (see `oncely dlq show`)"
        ))),
    }
}

/// Confirms, then replays or purges `matching` in order, noting each done in `view`.
async fn apply<D: DeadLetters>(
    dead: &mut D,
    globals: &Globals,
    args: &ChangeArgs,
    action: Action,
    matching: &[&(DeadLetterInfo, D::Message)],
    view: &mut ChangeView,
) -> Result<(), CliError> {
    if matching.is_empty() {
        return Ok(());
    }
    let question = match action {
        Action::Replay => format!(
            "replay {} dead letters from {} to where they were consumed from?",
            matching.len(),
            dead.name()
        ),
        Action::Purge => format!("delete {} dead letters from {}?", matching.len(), dead.name()),
    };
    output::confirm(question, args.yes).await?;
    let bar = output::progress(matching.len() as u64, view.action, globals.json);
    for (index, (info, message)) in matching.iter().enumerate() {
        let step = match action {
            Action::Replay => dead.replay(info, message).await,
            Action::Purge => Ok(()),
        };
        let removed = match step {
            Ok(()) => dead.remove(info, message).await,
            Err(error) => Err(error),
        };
        match removed {
            Ok(written_again) => view.written_again += written_again,
            Err(error) => {
                bar.abandon();
                view.not_done = matching.len() - index;
                return Err(error);
            }
        }
        view.done.push(info.clone());
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(())
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
