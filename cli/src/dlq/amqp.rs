//! RabbitMQ's dead letters: the dead-letter queue of a [`Topology`]'s work queue.
//!
//! Reading takes messages with `basic.get` without acknowledging them, on a channel of its
//! own; closing that channel gives the broker back every message not acknowledged, in
//! place. oncely's dead-letter queue has a delivery limit of
//! [`DEAD_LETTER_DELIVERY_LIMIT`](oncely_amqp::DEAD_LETTER_DELIVERY_LIMIT), so giving
//! messages back never drops one. A replayed or purged dead letter is acknowledged, which
//! removes it — for a replay, only after the broker confirmed its copy in the work queue:
//! a replay that dies halfway loses nothing (at worst one message is in both queues, and
//! the record takes the second as a duplicate).

use std::collections::BTreeMap;
use std::time::SystemTime;

use lapin::message::BasicGetMessage;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Confirmation, Connection, ConnectionProperties, ErrorKind};
use oncely::dead_letter;
use oncely_amqp::Topology;
use serde::Serialize;

use super::{ChangeArgs, ChangeView, DeadLetterInfo, Filter, ListView, ShowArgs};
use crate::Globals;
use crate::error::{CliError, Remote};
use crate::output::{self, Report};

/// The header quorum queues put on a message delivered again (RabbitMQ's): it belongs to
/// the delivery, not to a replayed copy.
const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// What a replayed copy must not carry: the dead-letter schema (the history keeps the
/// reason) and the runner's counters (a copy starts afresh).
const DEAD_LETTER_HEADERS: [&str; 11] = [
    dead_letter::REASON,
    dead_letter::DETAIL,
    dead_letter::ATTEMPTS,
    dead_letter::ROUTE,
    dead_letter::SOURCE,
    dead_letter::DEAD_LETTERED_AT,
    dead_letter::MESSAGE_ID,
    dead_letter::BODY_CUT,
    // `dead_letter::ATTEMPTS` above is also the runner's attempt counter.
    oncely_amqp::SEAL_HEADER,
    oncely_amqp::RETURNS_HEADER,
    DELIVERY_COUNT_HEADER,
];

/// A connection to `--amqp-addr`, for one work queue's dead letters.
struct Session {
    connection: Connection,
    remote: Remote,
    dead_letter_queue: String,
}

/// Dead letters taken from the dead-letter queue and not acknowledged yet, on their channel.
struct Held {
    channel: Channel,
    /// Every message read, in queue order, with what the schema says of it.
    letters: Vec<(DeadLetterInfo, BasicGetMessage)>,
}

impl Session {
    /// Connects and checks that `queue`'s dead-letter queue exists, declaring nothing.
    async fn open(globals: &Globals, queue: &str) -> Result<Self, CliError> {
        let remote = Remote::new("RabbitMQ", &globals.amqp_addr, globals.timeout);
        let connection = remote
            .call(Connection::connect(
                &globals.amqp_addr,
                ConnectionProperties::default(),
            ))
            .await?;
        let session = Session {
            connection,
            remote,
            dead_letter_queue: Topology::new(queue).dead_letter_queue().to_owned(),
        };
        session.ready(&session.dead_letter_queue).await?;
        Ok(session)
    }

    /// How many messages are ready in `queue`, by a passive declaration on a channel of its
    /// own (a failed one closes its channel): [`CliError::QueueNotFound`] if it does not exist.
    async fn ready(&self, queue: &str) -> Result<u32, CliError> {
        let channel = self.remote.call(self.connection.create_channel()).await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let declared = self
            .remote
            .call(channel.queue_declare(queue.into(), passive, FieldTable::default()))
            .await;
        match declared {
            Ok(declared) => {
                let _ = channel.close(200, "done".into()).await;
                Ok(declared.message_count())
            }
            Err(CliError::Service { source, .. }) if is_not_found(&*source) => Err(CliError::QueueNotFound {
                queue: queue.to_owned(),
                url: self.remote.url.clone(),
            }),
            Err(error) => Err(error),
        }
    }

    /// Reads the dead letters ready now, without acknowledging them, until `filter`'s
    /// `--limit` matched (every one without it).
    async fn read(&self, filter: Option<&Filter>) -> Result<Held, CliError> {
        let ready = self.ready(&self.dead_letter_queue).await? as usize;
        let channel = self.remote.call(self.connection.create_channel()).await?;
        let (now, mut matched) = (SystemTime::now(), 0);
        let mut letters = Vec::new();
        // Only those ready at the start: dead letters arriving meanwhile are not waited for.
        while letters.len() < ready && filter.is_none_or(|f| f.limit.is_none_or(|limit| matched < limit)) {
            let get = channel.basic_get(
                self.dead_letter_queue.as_str().into(),
                BasicGetOptions { no_ack: false },
            );
            let Some(message) = self.remote.call(get).await? else {
                break;
            };
            let info = describe(letters.len() + 1, &message);
            matched += usize::from(filter.is_none_or(|f| info.matches(f, now)));
            letters.push((info, message));
        }
        Ok(Held { channel, letters })
    }

    async fn close(self) {
        let _ = self.connection.close(200, "done".into()).await;
    }
}

impl Held {
    /// Gives the broker back every message not acknowledged, in place.
    async fn give_back(self, remote: &Remote) -> Result<(), CliError> {
        remote.call(self.channel.close(200, "done".into())).await
    }
}

/// True when `error` is the broker's `NOT_FOUND`.
fn is_not_found(error: &(dyn std::error::Error + 'static)) -> bool {
    error.downcast_ref::<lapin::Error>().is_some_and(|error| {
        matches!(error.kind(), ErrorKind::ProtocolError(amqp)
            if matches!(amqp.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)))
    })
}

/// What the dead-letter schema says of `message`, at `position`.
fn describe(position: usize, message: &BasicGetMessage) -> DeadLetterInfo {
    let properties = &message.delivery.properties;
    let message_id = properties.message_id().as_ref().map(|id| id.to_string());
    DeadLetterInfo::new(
        position,
        message_id,
        &headers(message),
        message.delivery.data.len(),
    )
}

/// The message's headers as text, read as the runner reads them (`oncely_amqp::to_delivery`):
/// strings as they are, numbers and booleans spelled out; nested tables left out.
fn headers(message: &BasicGetMessage) -> BTreeMap<String, String> {
    // The queue only matters to the runner's counters, which are not read here.
    let delivery = oncely_amqp::to_delivery(&message.delivery, "");
    delivery
        .headers()
        .iter()
        .map(|(name, value)| (name.to_owned(), String::from_utf8_lossy(value).into_owned()))
        .collect()
}

/// `oncely dlq list`.
pub(super) async fn list(globals: &Globals, filter: &Filter) -> Result<(), CliError> {
    let session = Session::open(globals, &filter.queue).await?;
    let held = session.read(Some(filter)).await?;
    let now = SystemTime::now();
    let view = ListView {
        dead_letter_queue: session.dead_letter_queue.clone(),
        read: held.letters.len(),
        dead_letters: held
            .letters
            .iter()
            .map(|(info, _)| info)
            .filter(|info| info.matches(filter, now))
            .cloned()
            .collect(),
    };
    held.give_back(&session.remote).await?;
    session.close().await;
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
pub(super) async fn show(globals: &Globals, args: &ShowArgs) -> Result<(), CliError> {
    let session = Session::open(globals, &args.queue).await?;
    let held = session.read(None).await?;
    let found = held
        .letters
        .iter()
        .find(|(info, _)| match (&args.id, args.position) {
            (Some(id), _) => info.message_id.as_ref() == Some(id),
            (None, Some(position)) => info.position == position,
            (None, None) => false,
        });
    let view = found.map(|(info, message)| show_view(info, message, args.body_hex));
    held.give_back(&session.remote).await?;
    session.close().await;
    match view {
        Some(view) => output::print(&view, globals.json),
        None => Err(CliError::NotFound(match (&args.id, args.position) {
            (Some(id), _) => format!("no dead letter with message id {id:?} in {}", session_queue(args)),
            _ => format!("no dead letter at that position in {}", session_queue(args)),
        })),
    }
}

fn session_queue(args: &ShowArgs) -> String {
    Topology::new(args.queue.as_str()).dead_letter_queue().to_owned()
}

fn show_view(info: &DeadLetterInfo, message: &BasicGetMessage, hex: bool) -> ShowView {
    let props = &message.delivery.properties;
    let mut properties = BTreeMap::new();
    let mut put = |name: &'static str, value: Option<String>| {
        if let Some(value) = value {
            properties.insert(name, value);
        }
    };
    put("message_id", props.message_id().as_ref().map(|v| v.to_string()));
    put(
        "correlation_id",
        props.correlation_id().as_ref().map(|v| v.to_string()),
    );
    put(
        "content_type",
        props.content_type().as_ref().map(|v| v.to_string()),
    );
    put(
        "content_encoding",
        props.content_encoding().as_ref().map(|v| v.to_string()),
    );
    put("type", props.kind().as_ref().map(|v| v.to_string()));
    put("app_id", props.app_id().as_ref().map(|v| v.to_string()));
    put("timestamp", props.timestamp().map(|v| v.to_string()));
    put("delivery_mode", props.delivery_mode().map(|v| v.to_string()));
    let body = &message.delivery.data;
    let (body_encoding, body) = match hex {
        true => ("hex", body.iter().map(|byte| format!("{byte:02x}")).collect()),
        false => ("utf-8", String::from_utf8_lossy(body).into_owned()),
    };
    ShowView {
        dead_letter: info.clone(),
        properties,
        headers: headers(message),
        body_encoding,
        body,
    }
}

/// `oncely dlq replay`.
pub(super) async fn replay(globals: &Globals, args: &ChangeArgs) -> Result<(), CliError> {
    change(globals, args, Action::Replay).await
}

/// `oncely dlq purge`.
pub(super) async fn purge(globals: &Globals, args: &ChangeArgs) -> Result<(), CliError> {
    change(globals, args, Action::Purge).await
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Replay,
    Purge,
}

/// Reads, asks, then replays or purges the matching dead letters one by one, and gives the
/// rest back. Stops at the first failure: those not done stay in the dead-letter queue.
async fn change(globals: &Globals, args: &ChangeArgs, action: Action) -> Result<(), CliError> {
    let filter = &args.filter;
    let session = Session::open(globals, &filter.queue).await?;
    if action == Action::Replay {
        // Before anything is read: a missing work queue is a clear error, not a returned copy.
        session.ready(&filter.queue).await?;
    }
    let held = session.read(Some(filter)).await?;
    let now = SystemTime::now();
    // A replay sends a copy only back to --queue: a dead letter that is not oncely's, or
    // that names another queue as its source (moved or written by hand), stays where it is.
    let replayable =
        |info: &DeadLetterInfo| info.oncely && info.source.as_deref() == Some(filter.queue.as_str());
    let (matching, not_oncely): (Vec<_>, Vec<_>) = held
        .letters
        .iter()
        .filter(|(info, _)| info.matches(filter, now))
        .partition(|(info, _)| match action {
            Action::Replay => replayable(info),
            // The broker's own dead letters (past its delivery limit) are the only copy left
            // of their message: the tool deletes oncely's only.
            Action::Purge => info.oncely,
        });
    let mut view = ChangeView {
        action: match action {
            Action::Replay => "replay",
            Action::Purge => "purge",
        },
        dead_letter_queue: session.dead_letter_queue.clone(),
        dry_run: args.dry_run,
        done: Vec::new(),
        not_oncely: not_oncely.iter().map(|(info, _)| info.clone()).collect(),
        not_done: 0,
    };
    let answer = match args.dry_run {
        true => {
            view.done = matching.iter().map(|(info, _)| info.clone()).collect();
            Ok(())
        }
        false => apply(&session, globals, args, action, &matching, &mut view).await,
    };
    // The report first: what was done must reach the operator even if giving the rest back
    // fails (the channel died with the error that stopped the command).
    let given_back = held.give_back(&session.remote).await;
    session.close().await;
    output::print(&view, globals.json)?;
    answer?;
    given_back?;
    match view.not_oncely.len() {
        0 => Ok(()),
        skipped => Err(CliError::Incomplete(format!(
            "{skipped} dead letters are not oncely's, or name another queue as their source, and were left \
             in place (see `oncely dlq show`)"
        ))),
    }
}

/// Confirms, then replays or purges `matching` in order, noting each done in `view`.
async fn apply(
    session: &Session,
    globals: &Globals,
    args: &ChangeArgs,
    action: Action,
    matching: &[&(DeadLetterInfo, BasicGetMessage)],
    view: &mut ChangeView,
) -> Result<(), CliError> {
    if matching.is_empty() {
        return Ok(());
    }
    let question = match action {
        Action::Replay => format!(
            "replay {} dead letters from {} to {}?",
            matching.len(),
            session.dead_letter_queue,
            args.filter.queue
        ),
        Action::Purge => format!(
            "delete {} dead letters from {}?",
            matching.len(),
            session.dead_letter_queue
        ),
    };
    output::confirm(question, args.yes).await?;
    let publisher = match action {
        Action::Replay => Some(confirming_channel(session).await?),
        Action::Purge => None,
    };
    let bar = output::progress(matching.len() as u64, view.action, globals.json);
    for (index, (info, message)) in matching.iter().enumerate() {
        let step = match &publisher {
            Some(publisher) => republish(session, publisher, info, message).await,
            None => Ok(()),
        };
        let acked = match step {
            Ok(()) => {
                session
                    .remote
                    .call(message.delivery.acker.ack(BasicAckOptions::default()))
                    .await
            }
            Err(error) => Err(error),
        };
        if let Err(error) = acked {
            bar.abandon();
            view.not_done = matching.len() - index;
            return Err(error);
        }
        view.done.push(info.clone());
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(())
}

/// A channel in confirm mode, for the replayed copies.
async fn confirming_channel(session: &Session) -> Result<Channel, CliError> {
    let channel = session.remote.call(session.connection.create_channel()).await?;
    session
        .remote
        .call(channel.confirm_select(ConfirmSelectOptions::default()))
        .await?;
    Ok(channel)
}

/// Publishes a copy of the dead letter `message` to its source queue through the default
/// exchange, persistent and mandatory, and waits for the broker's confirm.
async fn republish(
    session: &Session,
    publisher: &Channel,
    info: &DeadLetterInfo,
    message: &BasicGetMessage,
) -> Result<(), CliError> {
    let remote = &session.remote;
    let queue = info
        .source
        .as_deref()
        .expect("only dead letters whose source is --queue");
    let properties = message
        .delivery
        .properties
        .clone()
        .with_headers(replay_headers(message, info))
        .with_delivery_mode(2);
    let mandatory = BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    };
    let publish = publisher.basic_publish(
        "".into(),
        queue.into(),
        mandatory,
        &message.delivery.data,
        properties,
    );
    let confirm = remote.call(publish).await?;
    match remote.call(confirm).await? {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => Err(remote.failed(format!(
            "the copy of dead letter #{} was returned: no queue {queue:?} takes it",
            info.position
        ))),
        Confirmation::Nack(_) => Err(remote.failed(format!(
            "the broker refused the copy of dead letter #{}",
            info.position
        ))),
        Confirmation::NotRequested => Err(remote.failed("the channel is not in confirm mode")),
    }
}

/// The replayed copy's headers: the dead letter's own less the dead-letter schema and the
/// runner's counters, with the reason appended to the history; the original exchange and
/// routing key stay.
fn replay_headers(message: &BasicGetMessage, info: &DeadLetterInfo) -> FieldTable {
    let existing = headers(message).remove(dead_letter::HISTORY);
    let original = message.delivery.properties.headers().clone().unwrap_or_default();
    let mut headers = original.inner().clone();
    for name in DEAD_LETTER_HEADERS {
        headers.remove(name);
    }
    let mut headers = FieldTable::from(headers);
    headers.insert(
        dead_letter::HISTORY.into(),
        AMQPValue::LongString(info.history(existing.as_deref()).into()),
    );
    headers
}
