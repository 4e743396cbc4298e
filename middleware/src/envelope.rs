//! The broker-neutral view of one delivery.

use std::any::{Any, TypeId};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use serde_json::Value;

use crate::error::InputError;
use crate::fingerprint::Fingerprint;

/// Where a delivery came from: its queue (AMQP) or topic (RocketMQ).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Source {
    /// The queue (AMQP) or topic (RocketMQ) name.
    pub name: String,
}

impl Source {
    /// The queue or topic named `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Source { name: name.into() }
    }
}

/// Where a delivery sits in the broker's log: RocketMQ's queue id and queue offset. AMQP
/// queues have no addressable position, so AMQP deliveries carry none.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Position {
    /// The queue (partition) within the topic.
    pub queue: u32,
    /// The message's offset within that queue.
    pub offset: u64,
}

/// Message headers (AMQP headers, RocketMQ user properties) as raw bytes by name.
///
/// Values are bytes because brokers do not promise UTF-8; a key read from a header is
/// checked for UTF-8 when it is extracted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Headers(BTreeMap<String, Bytes>);

impl Headers {
    /// No headers.
    pub fn new() -> Self {
        Headers::default()
    }

    /// Sets `name` to `value`, replacing an earlier value.
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<Bytes>) {
        self.0.insert(name.into(), value.into());
    }

    /// The value of `name`, if present.
    pub fn get(&self, name: &str) -> Option<&Bytes> {
        self.0.get(name)
    }

    /// All headers in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Bytes)> {
        self.0.iter().map(|(name, value)| (name.as_str(), value))
    }

    /// The number of headers.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when there are no headers.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One delivery as an adapter received it, before a business key is read from it.
///
/// Adapters build it from the broker's message; [`Route::handle`](crate::Route::handle) turns
/// it into an [`Envelope`] by extracting the business key.
///
/// The body is parsed as JSON at most once, on the first [`json`](Delivery::json) call:
/// the route's key, the lock's entity, the state guard's entity and state and the
/// fingerprint's fields all read that one parse.
#[derive(Clone, Debug)]
pub struct Delivery {
    message_id: Option<String>,
    broker_key: Option<Bytes>,
    tags: Option<String>,
    position: Option<Position>,
    headers: Headers,
    body: Bytes,
    attempt: u32,
    redelivered: bool,
    source: Source,
    json: ParsedBody,
    fingerprint_context: Option<Bytes>,
    extensions: Extensions,
}

/// The body's one JSON parse, once a reader asked for it. Its `Debug` says only whether it
/// happened: the body itself is already in the delivery's.
#[derive(Clone, Default)]
struct ParsedBody(OnceLock<Result<Value, Arc<serde_json::Error>>>);

impl fmt::Debug for ParsedBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.0.get() {
            None => "not parsed",
            Some(Ok(_)) => "parsed",
            Some(Err(_)) => "not JSON",
        };
        f.write_str(state)
    }
}

impl Delivery {
    /// A first delivery (attempt 1, not redelivered) of `body` from `source`.
    pub fn new(source: Source, body: impl Into<Bytes>) -> Self {
        Delivery {
            message_id: None,
            broker_key: None,
            tags: None,
            position: None,
            headers: Headers::new(),
            body: body.into(),
            attempt: 1,
            redelivered: false,
            source,
            json: ParsedBody::default(),
            fingerprint_context: None,
            extensions: Extensions::default(),
        }
    }

    /// Sets the broker's message id (AMQP `message_id`, RocketMQ `UNIQ_KEY`).
    pub fn with_message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// Sets the broker's key field (RocketMQ `KEYS`).
    pub fn with_broker_key(mut self, key: impl Into<Bytes>) -> Self {
        self.broker_key = Some(key.into());
        self
    }

    /// Sets the broker's tags (RocketMQ `TAGS`), which subscriptions filter on.
    pub fn with_tags(mut self, tags: impl Into<String>) -> Self {
        self.tags = Some(tags.into());
        self
    }

    /// Sets where the delivery sits in the broker's log.
    pub fn with_position(mut self, position: Position) -> Self {
        self.position = Some(position);
        self
    }

    /// Sets one header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.headers.insert(name, value);
        self
    }

    /// Sets the attempt number (1 = first delivery). 0 is read as 1.
    pub fn with_attempt(mut self, attempt: u32) -> Self {
        self.attempt = attempt.max(1);
        self
    }

    /// Sets what, besides the body, makes this delivery's payload: an HTTP request's
    /// method and path, so that an idempotency key reused on another endpoint is another
    /// payload. Fingerprints then cover it before what the route's
    /// [`FingerprintPolicy`](crate::FingerprintPolicy) selects (unless the policy is off);
    /// without it, fingerprints are those of earlier versions.
    pub fn with_fingerprint_context(mut self, context: impl Into<Bytes>) -> Self {
        self.fingerprint_context = Some(context.into());
        self
    }

    /// Hands `value` to the stack: the envelope [`Route::handle`](crate::Route::handle) makes
    /// of this delivery starts with it in its [extensions](Envelope::extensions), where the
    /// tiers and the handler find it by type. For adapters that pass their own context (an
    /// HTTP request's parts) to the service at the bottom of the stack.
    pub fn with_extension<T: Send + Sync + 'static>(mut self, value: T) -> Self {
        self.extensions.insert(value);
        self
    }

    setters! {
        /// Replaces all headers.
        with_headers(headers: Headers);

        /// Marks the delivery as redelivered by the broker.
        with_redelivered(redelivered: bool);
    }

    /// The broker's message id, if the message has one.
    pub fn message_id(&self) -> Option<&str> {
        self.message_id.as_deref()
    }

    /// The broker's key field (RocketMQ `KEYS`), if any.
    pub fn broker_key(&self) -> Option<&Bytes> {
        self.broker_key.as_ref()
    }

    /// The broker's tags (RocketMQ `TAGS`), if any.
    pub fn tags(&self) -> Option<&str> {
        self.tags.as_deref()
    }

    /// Where the delivery sits in the broker's log, when the broker has positions.
    pub fn position(&self) -> Option<Position> {
        self.position
    }

    /// The headers or user properties.
    pub fn headers(&self) -> &Headers {
        &self.headers
    }

    /// The body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The attempt number: 1 for the first delivery, 2 for the first retry, and so on.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// True when the broker flagged the delivery as a redelivery.
    pub fn redelivered(&self) -> bool {
        self.redelivered
    }

    /// The broker and queue or topic.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// What besides the body is fingerprinted, if anything
    /// ([`with_fingerprint_context`](Delivery::with_fingerprint_context)).
    pub fn fingerprint_context(&self) -> Option<&Bytes> {
        self.fingerprint_context.as_ref()
    }

    /// The body parsed as JSON, parsed on the first call and kept: every later call (from
    /// any tier or the handler) reads the same parse. A body that is not JSON gives
    /// [`InputError::BodyNotJson`], every time.
    pub fn json(&self) -> Result<&Value, InputError> {
        self.json
            .0
            .get_or_init(|| serde_json::from_slice(&self.body).map_err(Arc::new))
            .as_ref()
            .map_err(|source| InputError::BodyNotJson {
                source: Arc::clone(source),
            })
    }
}

/// The business key: what "the same message" means for a route, e.g. `order_123:deduct_stock`.
///
/// Cheap to clone. Extracted by a [`KeyExtractor`](crate::KeyExtractor), which enforces a
/// maximum length; one built with [`BusinessKey::new`] is taken as given.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BusinessKey(Arc<str>);

impl BusinessKey {
    /// A key with exactly this text.
    pub fn new(key: impl Into<Arc<str>>) -> Self {
        BusinessKey(key.into())
    }

    /// The key's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for BusinessKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for BusinessKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// Values that tiers hand to the tiers behind them and to the handler, by type: for
/// example the lock's [`LockLease`](crate::lock::LockLease) with its fencing token.
///
/// Cloning shares the values (they are reference counted), so it stays cheap.
#[derive(Clone, Default)]
pub struct Extensions(HashMap<TypeId, Arc<dyn Any + Send + Sync>>);

impl Extensions {
    /// Stores `value`, replacing an earlier value of the same type.
    pub fn insert<T: Send + Sync + 'static>(&mut self, value: T) {
        self.0.insert(TypeId::of::<T>(), Arc::new(value));
    }

    /// The value of type `T`, if one was stored.
    pub fn get<T: Send + Sync + 'static>(&self) -> Option<&T> {
        self.0
            .get(&TypeId::of::<T>())
            .and_then(|value| value.downcast_ref())
    }
}

impl fmt::Debug for Extensions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Extensions").field("len", &self.0.len()).finish()
    }
}

/// One delivery with its business key: what every tier of the stack receives.
///
/// Cheap to clone: the delivery is shared, and extensions share their values.
#[derive(Clone, Debug)]
pub struct Envelope {
    key: BusinessKey,
    fingerprint: Fingerprint,
    delivery: Arc<Delivery>,
    route: Arc<str>,
    certainly_new: bool,
    extensions: Extensions,
}

impl Envelope {
    /// An envelope for `delivery` under `key`, fingerprinted by its whole body, on a route
    /// named `unnamed`: for tests and stacks called without a [`Route`](crate::Route).
    pub fn new(key: BusinessKey, delivery: Delivery) -> Self {
        let fingerprint = Fingerprint::of(delivery.body());
        Envelope::routed(Arc::from("unnamed"), key, fingerprint, delivery)
    }

    /// The envelope [`Route::handle`](crate::Route::handle) makes, with the fingerprint its
    /// policy computed.
    pub(crate) fn routed(
        route: Arc<str>,
        key: BusinessKey,
        fingerprint: Fingerprint,
        mut delivery: Delivery,
    ) -> Self {
        let extensions = std::mem::take(&mut delivery.extensions);
        Envelope {
            key,
            fingerprint,
            delivery: Arc::new(delivery),
            route,
            certainly_new: false,
            extensions,
        }
    }

    /// The business key.
    pub fn key(&self) -> &BusinessKey {
        &self.key
    }

    /// The payload's fingerprint, as the route's
    /// [`FingerprintPolicy`](crate::FingerprintPolicy) computed it.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// The name of the route handling the envelope.
    pub fn route(&self) -> &str {
        &self.route
    }

    #[cfg(feature = "metrics")]
    pub(crate) fn route_name(&self) -> &Arc<str> {
        &self.route
    }

    /// True when a pre-filter in front found the key certainly new: no delivery of it was
    /// settled in this process. Tiers that support it skip their lookups (the flag with
    /// [`with_record_behind`](crate::flag::FlagLayer::with_record_behind)).
    pub fn is_certainly_new(&self) -> bool {
        self.certainly_new
    }

    /// Marks the key certainly new, for the tiers behind.
    #[cfg(feature = "prefilter")]
    pub(crate) fn mark_certainly_new(&mut self) {
        self.certainly_new = true;
    }

    /// The delivery: body, headers, attempt, source and broker fields.
    pub fn delivery(&self) -> &Delivery {
        &self.delivery
    }

    /// Values set by the tiers in front, e.g. the lock's lease.
    pub fn extensions(&self) -> &Extensions {
        &self.extensions
    }

    /// Mutable access to the extensions, for tiers that hand something on.
    pub fn extensions_mut(&mut self) -> &mut Extensions {
        &mut self.extensions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extensions_are_shared_by_clones() {
        let mut ext = Extensions::default();
        ext.insert(7_u64);
        let copy = ext.clone();
        assert_eq!(copy.get::<u64>(), Some(&7));
        assert_eq!(copy.get::<u32>(), None);
    }

    #[test]
    fn attempt_zero_reads_as_first() {
        let delivery = Delivery::new(Source::new("q"), "x").with_attempt(0);
        assert_eq!(delivery.attempt(), 1);
    }

    #[test]
    fn the_body_is_parsed_once() {
        let delivery = Delivery::new(Source::new("q"), r#"{"a":1}"#);
        let first: *const Value = delivery.json().unwrap();
        let second: *const Value = delivery.json().unwrap();
        assert_eq!(first, second, "a second read parses again");
        assert!(Delivery::new(Source::new("q"), "nope").json().is_err());
    }
}
