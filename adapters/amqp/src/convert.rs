//! lapin deliveries → oncely deliveries.

use lapin::message::Delivery as AmqpDelivery;
use lapin::types::{AMQPValue, FieldTable};
use oncely::{Delivery, Headers, Source};

/// The header carrying oncely's attempt number on messages the runner sends back for a
/// retry; absent on a first delivery.
pub const ATTEMPT_HEADER: &str = "x-oncely-attempt";

/// Converts one lapin delivery from `queue` into an oncely [`Delivery`]: the message id,
/// headers, body, attempt number (from [`ATTEMPT_HEADER`], 1 when absent) and the broker's
/// redelivered flag. AMQP has no separate key field, so the broker key stays empty; key a
/// route by message id, a header or the body.
///
/// Header values keep their bytes for strings and byte arrays and their decimal spelling
/// for numbers and booleans; nested tables and arrays are left out.
pub fn to_delivery(delivery: &AmqpDelivery, queue: &str) -> Delivery {
    let properties = &delivery.properties;
    let headers = properties.headers().as_ref().map(to_headers).unwrap_or_default();
    let attempt = properties.headers().as_ref().and_then(attempt_of).unwrap_or(1);
    let mut converted = Delivery::new(Source::new(queue), delivery.data.clone())
        .with_headers(headers)
        .with_attempt(attempt)
        .with_redelivered(delivery.redelivered);
    if let Some(id) = properties.message_id() {
        converted = converted.with_message_id(id.as_str());
    }
    converted
}

fn to_headers(table: &FieldTable) -> Headers {
    let mut headers = Headers::new();
    for (name, value) in table.inner() {
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

fn attempt_of(table: &FieldTable) -> Option<u32> {
    let value = table.inner().get(ATTEMPT_HEADER)?;
    // A producer may send any number here: beyond u32 it saturates (and the route's limit
    // applies at once), below 1 it reads as a first attempt.
    integer_of(value).map(|attempt| u32::try_from(attempt.max(1)).unwrap_or(u32::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_keep_strings_and_numbers_and_read_the_attempt() {
        let mut table = FieldTable::default();
        table.insert("x-order".into(), AMQPValue::LongString("o-1".into()));
        table.insert("x-count".into(), AMQPValue::LongInt(-3));
        table.insert(ATTEMPT_HEADER.into(), AMQPValue::LongLongInt(4));
        table.insert("x-nested".into(), AMQPValue::FieldTable(FieldTable::default()));
        let headers = to_headers(&table);
        assert_eq!(headers.get("x-order").map(|v| v.as_ref()), Some(&b"o-1"[..]));
        assert_eq!(headers.get("x-count").map(|v| v.as_ref()), Some(&b"-3"[..]));
        assert!(headers.get("x-nested").is_none());
        assert_eq!(attempt_of(&table), Some(4));
        assert_eq!(attempt_of(&FieldTable::default()), None);
        // A producer's header is not trusted to fit: it saturates instead of overflowing.
        let mut forged = FieldTable::default();
        forged.insert(ATTEMPT_HEADER.into(), AMQPValue::LongLongInt(i64::MAX));
        assert_eq!(attempt_of(&forged), Some(u32::MAX));
        forged.insert(ATTEMPT_HEADER.into(), AMQPValue::LongLongInt(-5));
        assert_eq!(attempt_of(&forged), Some(1));
    }
}
