//! lapin deliveries → oncely deliveries.

use lapin::message::Delivery as AmqpDelivery;
use lapin::types::{AMQPValue, FieldTable};
use oncely::{Delivery, Headers, Source};
use xxhash_rust::xxh3::Xxh3;

/// The header carrying oncely's attempt number, in decimal text: on the runner's retry
/// copies (sealed, read only under a valid [`SEAL_HEADER`]) and on its dead letters
/// (unsealed: the attempt it was dead-lettered at). The same name and type as
/// [`oncely::dead_letter::ATTEMPTS`], which it is; absent on a first delivery.
pub const ATTEMPT_HEADER: &str = oncely::dead_letter::ATTEMPTS;

/// Header on the runner's copies that come back to it (retries, suspects, deliveries handed
/// back at shutdown): a checksum over the copy's counters ([`ATTEMPT_HEADER`],
/// [`RETURNS_HEADER`](crate::RETURNS_HEADER)), its body and its work queue. The runner reads
/// its counters only when the seal matches, so counters that a producer sets, or copies
/// from a message it consumed elsewhere, change nothing: the delivery counts as a first one.
/// The runner's dead letters carry no seal, so one replayed to the work queue starts
/// afresh (a message the broker dead-letters itself, past its delivery limit, keeps its
/// headers).
///
/// A checksum, not a signature: it guards against headers set or copied by mistake, not
/// against a producer that forges them on purpose (keep such producers away from the
/// topology's queues with RabbitMQ's permissions).
pub const SEAL_HEADER: &str = "x-oncely-seal";

/// Converts one lapin delivery from `queue` into an oncely [`Delivery`]: the message id,
/// headers, body, attempt number (from [`ATTEMPT_HEADER`] under a valid [`SEAL_HEADER`], 1
/// otherwise) and the broker's redelivered flag. AMQP has no separate key field, so the
/// broker key stays empty; key a route by message id, a header or the body.
///
/// Header values keep their bytes for strings and byte arrays and their decimal spelling
/// for numbers and booleans; nested tables and arrays are left out.
///
/// oncely's dead-letter metadata ([`oncely::dead_letter::SCHEMA`]) is left out: on a
/// message coming in, it is a producer's, not oncely's.
pub fn to_delivery(delivery: &AmqpDelivery, queue: &str) -> Delivery {
    let properties = &delivery.properties;
    let headers = properties.headers().as_ref().map_or_else(Headers::new, |table| {
        text_headers(table, |name| !oncely::dead_letter::is_schema(name))
    });
    let attempt = Counters::of(delivery, queue).attempt;
    let mut converted = Delivery::new(Source::new(queue), delivery.data.clone())
        .with_headers(headers)
        .with_attempt(attempt)
        .with_redelivered(delivery.redelivered);
    if let Some(id) = properties.message_id() {
        converted = converted.with_message_id(id.as_str());
    }
    converted
}

/// Every header of `table` as text, as [`to_delivery`] reads them (strings as they are,
/// numbers and booleans spelt out, nested tables and arrays left out), oncely's dead-letter
/// metadata included: for readers of dead letters.
pub fn headers_of(table: &FieldTable) -> Headers {
    text_headers(table, |_| true)
}

/// The headers of `table` whose names `keep` takes, as text.
fn text_headers(table: &FieldTable, keep: impl Fn(&str) -> bool) -> Headers {
    let mut headers = Headers::new();
    for (name, value) in table.inner().iter().filter(|(name, _)| keep(name.as_str())) {
        let bytes: Option<Vec<u8>> = match value {
            AMQPValue::LongString(text) => Some(text.as_bytes().to_vec()),
            AMQPValue::ShortString(text) => Some(text.as_str().as_bytes().to_vec()),
            AMQPValue::ByteArray(bytes) => Some(bytes.as_slice().to_vec()),
            AMQPValue::Boolean(value) => Some(value.to_string().into_bytes()),
            AMQPValue::FieldArray(_) | AMQPValue::FieldTable(_) => None,
            number => integer_of(number).map(|value| value.to_string().into_bytes()),
        };
        if let Some(bytes) = bytes {
            headers.insert(name.as_str(), bytes);
        }
    }
    headers
}

pub(crate) fn integer_of(value: &AMQPValue) -> Option<i128> {
    Some(match value {
        AMQPValue::ShortShortInt(v) => i128::from(*v),
        AMQPValue::ShortShortUInt(v) => i128::from(*v),
        AMQPValue::ShortInt(v) => i128::from(*v),
        AMQPValue::ShortUInt(v) => i128::from(*v),
        AMQPValue::LongInt(v) => i128::from(*v),
        AMQPValue::LongUInt(v) => i128::from(*v),
        AMQPValue::LongLongInt(v) => i128::from(*v),
        AMQPValue::Timestamp(v) => i128::from(*v),
        _ => return None,
    })
}

/// A counter header's value: decimal text, as the runner writes it, or an integer, as
/// earlier versions wrote `x-oncely-returns` (the attempt counter changed its name as well,
/// so an earlier retry copy counts as a first delivery).
fn counter_of(value: &AMQPValue) -> Option<i128> {
    match value {
        AMQPValue::LongString(text) => std::str::from_utf8(text.as_bytes()).ok()?.parse().ok(),
        number => integer_of(number),
    }
}

/// The runner's counters of one message, carried by its copies under [`SEAL_HEADER`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Counters {
    /// Its attempt number, from 1.
    pub(crate) attempt: u32,
    /// How many times it came back unsettled while it ran alone; `None`: it never went
    /// through the suspect queue.
    pub(crate) returns: Option<u32>,
}

impl Counters {
    /// The counters of a message the runner has not seen before.
    pub(crate) const FIRST: Counters = Counters {
        attempt: 1,
        returns: None,
    };

    /// The counters `delivery` carries if their seal matches its body and `queue` (the
    /// topology's work queue); [`Counters::FIRST`] otherwise.
    pub(crate) fn of(delivery: &AmqpDelivery, queue: &str) -> Counters {
        Counters::sealed(delivery, queue).unwrap_or(Counters::FIRST)
    }

    /// The counters `delivery` carries if their seal matches its body and `queue`: `None`
    /// on a message the runner did not copy itself.
    pub(crate) fn sealed(delivery: &AmqpDelivery, queue: &str) -> Option<Counters> {
        let table = delivery.properties.headers().as_ref()?;
        let headers = table.inner();
        let read = |name: &str| headers.get(name).and_then(counter_of);
        let attempt = read(ATTEMPT_HEADER)?;
        // Beyond u32 a counter saturates, below 1 an attempt reads as the first.
        let counters = Counters {
            attempt: u32::try_from(attempt.max(1)).unwrap_or(u32::MAX),
            returns: read(crate::RETURNS_HEADER).map(|n| u32::try_from(n.max(0)).unwrap_or(u32::MAX)),
        };
        let sealed = match headers.get(SEAL_HEADER) {
            Some(AMQPValue::LongString(seal)) => {
                seal.as_bytes() == counters.seal(queue, &delivery.data).as_bytes()
            }
            _ => false,
        };
        sealed.then_some(counters)
    }

    /// Writes the counters and their seal for a copy of `body` that comes back to the
    /// runner of work queue `queue`.
    pub(crate) fn write_sealed(&self, headers: &mut FieldTable, queue: &str, body: &[u8]) {
        headers.insert(
            ATTEMPT_HEADER.into(),
            AMQPValue::LongString(self.attempt.to_string().into()),
        );
        match self.returns {
            Some(returns) => {
                headers.insert(
                    crate::RETURNS_HEADER.into(),
                    AMQPValue::LongString(returns.to_string().into()),
                );
            }
            // Another's count (a producer's, say) would be read back with the seal, which
            // then would not match: none is the count sealed.
            None if headers.contains_key(crate::RETURNS_HEADER) => {
                let mut others = headers.inner().clone();
                others.remove(crate::RETURNS_HEADER);
                *headers = FieldTable::from(others);
            }
            None => {}
        }
        headers.insert(
            SEAL_HEADER.into(),
            AMQPValue::LongString(self.seal(queue, body).into()),
        );
    }

    fn seal(&self, queue: &str, body: &[u8]) -> String {
        let mut hasher = Xxh3::with_seed(0x6f6e_6365_6c79);
        let returns = self.returns.map_or(-1, i64::from);
        for part in [
            queue.as_bytes(),
            &self.attempt.to_be_bytes(),
            &returns.to_be_bytes(),
            body,
        ] {
            hasher.update(&(part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        format!("{:032x}", hasher.digest128())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_keep_strings_and_numbers() {
        let mut table = FieldTable::default();
        table.insert("x-order".into(), AMQPValue::LongString("o-1".into()));
        table.insert("x-count".into(), AMQPValue::LongInt(-3));
        table.insert("x-nested".into(), AMQPValue::FieldTable(FieldTable::default()));
        let headers = headers_of(&table);
        assert_eq!(headers.get("x-order").map(|v| v.as_ref()), Some(&b"o-1"[..]));
        assert_eq!(headers.get("x-count").map(|v| v.as_ref()), Some(&b"-3"[..]));
        assert!(headers.get("x-nested").is_none());
    }

    fn delivery(headers: FieldTable, body: &[u8]) -> AmqpDelivery {
        let mut delivery = AmqpDelivery::mock(1, "".into(), "orders".into(), false, body.to_vec());
        delivery.properties = lapin::BasicProperties::default().with_headers(headers);
        delivery
    }

    #[test]
    fn counters_are_read_only_under_their_seal() {
        let counters = Counters {
            attempt: 4,
            returns: Some(2),
        };
        let mut sealed = FieldTable::default();
        counters.write_sealed(&mut sealed, "orders", b"body");
        assert_eq!(
            Counters::of(&delivery(sealed.clone(), b"body"), "orders"),
            counters
        );
        // Another body, another queue, or a counter changed after sealing: a first delivery.
        assert_eq!(
            Counters::of(&delivery(sealed.clone(), b"other"), "orders"),
            Counters::FIRST
        );
        assert_eq!(
            Counters::of(&delivery(sealed.clone(), b"body"), "payments"),
            Counters::FIRST
        );
        let mut forged = sealed.clone();
        forged.insert(ATTEMPT_HEADER.into(), AMQPValue::LongString("99".into()));
        assert_eq!(
            Counters::of(&delivery(forged, b"body"), "orders"),
            Counters::FIRST
        );
        // A producer's own counters, without a seal, change nothing.
        let mut unsealed = FieldTable::default();
        unsealed.insert(ATTEMPT_HEADER.into(), AMQPValue::LongLongInt(9));
        unsealed.insert(crate::RETURNS_HEADER.into(), AMQPValue::LongLongInt(9));
        assert_eq!(
            Counters::of(&delivery(unsealed, b"body"), "orders"),
            Counters::FIRST
        );
        assert_eq!(
            to_delivery(&delivery(sealed.clone(), b"body"), "orders").attempt(),
            4
        );
        // Written as text, one type with the dead letters' `x-oncely-attempts`.
        assert_eq!(
            sealed.inner().get(ATTEMPT_HEADER),
            Some(&AMQPValue::LongString("4".into()))
        );
    }
}

/// Properties over inputs no one wrote by hand: `PROPTEST_CASES` sets how many (256 unless
/// set; `make fuzz` runs many more).
#[cfg(test)]
mod properties {
    use lapin::types::{ByteArray, FieldArray, LongString, ShortString};
    use proptest::collection::{btree_map, vec};
    use proptest::prelude::*;

    use super::*;

    /// Any header value a producer may send, nested tables and arrays one level deep.
    fn value() -> impl Strategy<Value = AMQPValue> {
        let scalar = prop_oneof![
            vec(any::<u8>(), 0..40).prop_map(|bytes| AMQPValue::LongString(LongString::from(bytes))),
            "\\PC{0,20}".prop_map(|text| AMQPValue::ShortString(ShortString::from(text))),
            vec(any::<u8>(), 0..40).prop_map(|bytes| AMQPValue::ByteArray(ByteArray::from(bytes))),
            any::<bool>().prop_map(AMQPValue::Boolean),
            any::<i8>().prop_map(AMQPValue::ShortShortInt),
            any::<u32>().prop_map(AMQPValue::LongUInt),
            any::<i64>().prop_map(AMQPValue::LongLongInt),
            any::<f64>().prop_map(AMQPValue::Double),
        ];
        scalar.prop_recursive(1, 8, 4, |inner| {
            prop_oneof![
                vec(inner.clone(), 0..3).prop_map(|items| AMQPValue::FieldArray(FieldArray::from(items))),
                btree_map("[a-z-]{1,8}", inner, 0..3).prop_map(|fields| {
                    let mut table = FieldTable::default();
                    for (name, field) in fields {
                        table.insert(name.into(), field);
                    }
                    AMQPValue::FieldTable(table)
                }),
            ]
        })
    }

    /// Header names, oncely's own among them.
    fn name() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-zA-Z0-9_.-]{1,16}",
            proptest::sample::select(
                oncely::dead_letter::SCHEMA
                    .iter()
                    .chain(&[SEAL_HEADER, crate::RETURNS_HEADER, "x-delivery-count"])
                    .map(|name| name.to_string())
                    .collect::<Vec<_>>(),
            ),
        ]
    }

    proptest! {
        /// Any headers and body convert, never panicking: strings and byte arrays byte for
        /// byte, oncely's dead-letter metadata left out, and counters a producer set never
        /// read (no seal of theirs matches).
        #[test]
        fn prop_any_headers_convert(fields in btree_map(name(), value(), 0..8), body in vec(any::<u8>(), 0..64)) {
            let mut table = FieldTable::default();
            for (name, field) in &fields {
                table.insert(name.as_str().into(), field.clone());
            }
            let mut delivery = AmqpDelivery::mock(1, "".into(), "orders".into(), false, body);
            delivery.properties = lapin::BasicProperties::default().with_headers(table.clone());
            let converted = to_delivery(&delivery, "orders");
            for (name, field) in &fields {
                let kept = converted.headers().get(name);
                prop_assert_eq!(kept.is_some() && oncely::dead_letter::is_schema(name), false, "{} kept", name);
                if let (AMQPValue::LongString(text), false) = (field, oncely::dead_letter::is_schema(name)) {
                    prop_assert_eq!(kept.map(|value| value.as_ref()), Some(text.as_bytes()));
                }
            }
            let all = headers_of(&table);
            prop_assert!(all.len() <= fields.len());
            // A producer's counters and seal, whatever they say, are not the runner's.
            prop_assert_eq!(converted.attempt(), 1);
        }

        /// The runner's own sealed counters read back over any other headers; the same
        /// counters on another body, or for another queue, read as a first attempt.
        #[test]
        fn prop_sealed_counters_read_back(
            fields in btree_map(name(), value(), 0..8),
            body in vec(any::<u8>(), 0..64),
            attempt in 1..=u32::MAX,
            returns in proptest::option::of(any::<u32>()),
        ) {
            let mut table = FieldTable::default();
            for (name, field) in &fields {
                table.insert(name.as_str().into(), field.clone());
            }
            let counters = Counters { attempt, returns };
            counters.write_sealed(&mut table, "orders", &body);
            let copy = |body: Vec<u8>| {
                let mut delivery = AmqpDelivery::mock(1, "".into(), "orders".into(), false, body);
                delivery.properties = lapin::BasicProperties::default().with_headers(table.clone());
                delivery
            };
            prop_assert_eq!(Counters::of(&copy(body.clone()), "orders"), counters);
            prop_assert_eq!(to_delivery(&copy(body.clone()), "orders").attempt(), attempt);
            prop_assert_eq!(Counters::of(&copy(body.clone()), "payments"), Counters::FIRST);
            let mut other = body.clone();
            other.push(0);
            prop_assert_eq!(Counters::of(&copy(other), "orders"), Counters::FIRST);
        }
    }
}
