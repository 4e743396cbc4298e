//! Reading business keys (and entity ids, and states) from deliveries.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use serde_json::Value;

use crate::envelope::{BusinessKey, Delivery};
use crate::error::{ConfigError, InputError};

/// The maximum key length, in bytes, unless configured otherwise.
pub const DEFAULT_MAX_KEY_LEN: usize = 256;

/// One field of a delivery that a key can be read from.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyField {
    /// The broker's key field: RocketMQ `KEYS`.
    BrokerKey,
    /// The broker's message id: AMQP `message_id`, RocketMQ `UNIQ_KEY`.
    MessageId,
    /// A named header (AMQP) or user property (RocketMQ).
    Header(String),
    /// A value in a JSON body, by JSON pointer (RFC 6901), e.g. `/orderId`. Strings are taken
    /// as they are, integers within 64 bits in their decimal spelling; other numbers are
    /// refused ([`InputError::KeyNumberInexact`]).
    JsonPointer(String),
}

impl fmt::Display for KeyField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyField::BrokerKey => f.write_str("broker key"),
            KeyField::MessageId => f.write_str("message id"),
            KeyField::Header(name) => write!(f, "header {name:?}"),
            KeyField::JsonPointer(pointer) => write!(f, "body pointer {pointer:?}"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    Literal(String),
    Field(KeyField),
}

/// Reads a key from a delivery: one field, or a template that composes fields and literal
/// text, e.g. `{/orderId}:deduct_stock` → `order_123:deduct_stock`.
///
/// Every failure is a typed [`InputError`] that makes the delivery a dead letter: a key is never
/// replaced by a random id, because a random id would make every redelivery look new. A
/// field holding a control character (NUL, newline, …) is refused
/// ([`InputError::KeyControlCharacter`]) before any store sees it.
///
/// Template syntax: `{message_id}`, `{broker_key}`, `{header:NAME}`, `{/json/pointer}`;
/// `{{` and `}}` stand for literal braces. A template needs at least one field: a key made
/// of literals alone would be the same for every message.
///
/// ```
/// use oncely::{Delivery, KeyExtractor, Source};
///
/// let extractor = KeyExtractor::template("{/orderId}:deduct_stock").unwrap();
/// let delivery = Delivery::new(Source::new("orders"), r#"{"orderId":"order_123"}"#);
/// assert_eq!(extractor.extract(&delivery).unwrap().as_str(), "order_123:deduct_stock");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyExtractor {
    parts: Arc<[Part]>,
    /// The characters a field's value is written with percent-encoded ([`escaped`]): none
    /// for one field.
    escaped: Arc<[char]>,
    max_len: usize,
}

impl KeyExtractor {
    /// A key that is exactly one field's value.
    pub fn field(field: KeyField) -> Self {
        Self::of_parts(vec![Part::Field(field)], DEFAULT_MAX_KEY_LEN)
    }

    /// The extractor of `parts`, its escaped characters found once, here.
    fn of_parts(parts: Vec<Part>, max_len: usize) -> Self {
        KeyExtractor {
            escaped: escaped(&parts).into(),
            parts: parts.into(),
            max_len,
        }
    }

    /// The broker's key field (RocketMQ `KEYS`).
    pub fn broker_key() -> Self {
        Self::field(KeyField::BrokerKey)
    }

    /// The broker's message id (AMQP `message_id`, RocketMQ `UNIQ_KEY`).
    ///
    /// Catches producer retries that reuse the id, but not a second message with a new id
    /// for the same business operation: prefer a business field where there is one.
    pub fn message_id() -> Self {
        Self::field(KeyField::MessageId)
    }

    /// A named header or user property.
    pub fn header(name: impl Into<String>) -> Self {
        Self::field(KeyField::Header(name.into()))
    }

    /// A value in a JSON body by JSON pointer, e.g. `/orderId` or `/order/id`.
    pub fn json_pointer(pointer: impl Into<String>) -> Self {
        Self::field(KeyField::JsonPointer(pointer.into()))
    }

    /// A template of fields and literal text; see the type's docs for the syntax.
    pub fn template(template: &str) -> Result<Self, ConfigError> {
        let parts = parse_template(template).map_err(|reason| ConfigError::InvalidTemplate {
            template: template.to_owned(),
            reason: reason.to_owned(),
        })?;
        Ok(Self::of_parts(parts, DEFAULT_MAX_KEY_LEN))
    }

    /// Appends `:namespace` to every key, so that one message id or order id can stand for
    /// several operations (`order_123:deduct_stock`, `order_123:grant_points`).
    pub fn with_namespace(self, namespace: &str) -> Self {
        let mut parts = self.parts.to_vec();
        parts.push(Part::Literal(format!(":{namespace}")));
        Self::of_parts(parts, self.max_len)
    }

    /// Sets the maximum key length in bytes (default [`DEFAULT_MAX_KEY_LEN`]). Longer keys
    /// are rejected with [`InputError::KeyTooLong`], never truncated: truncation could merge keys.
    pub fn with_max_len(mut self, max_len: usize) -> Self {
        self.max_len = max_len;
        self
    }

    /// Reads the key from `delivery`. The body is parsed as JSON only when a part needs it,
    /// and then only once per delivery ([`Delivery::json`]).
    ///
    /// A template of two fields or more writes each field's value with `%` and the first
    /// character of each separator (the text between two fields) percent-encoded (`%25`,
    /// `:` as `%3A`), so that no two deliveries with different values compose the same key:
    /// `{/a}:{/b}` would otherwise read `x:y` and `z` as it reads `x` and `y:z`. Read left
    /// to right, a value then ends at the first raw separator character, and every `%` in it
    /// starts an escape — which is why a separator may not start with `%`. Values without
    /// those characters, and one field's value always, are written as they are.
    pub fn extract(&self, delivery: &Delivery) -> Result<BusinessKey, InputError> {
        let mut key = String::new();
        for part in self.parts.iter() {
            match part {
                Part::Literal(text) => key.push_str(text),
                Part::Field(field) => {
                    let value = read_field(field, delivery)?;
                    if value.is_empty() {
                        return Err(InputError::KeyEmpty {
                            field: field.to_string(),
                        });
                    }
                    if let Some(character) = value.chars().find(|c| c.is_control()) {
                        return Err(InputError::KeyControlCharacter {
                            field: field.to_string(),
                            character,
                        });
                    }
                    push_escaped(&mut key, &value, &self.escaped);
                }
            }
        }
        if key.len() > self.max_len {
            return Err(InputError::KeyTooLong {
                len: key.len(),
                max: self.max_len,
            });
        }
        Ok(BusinessKey::new(key))
    }
}

/// The characters a field's value is written with percent-encoded: `%` and the first
/// character of each separator between two fields, for a template of two fields or more;
/// none for one field. Enough for no two sets of values to compose one key (see
/// [`KeyExtractor::extract`]); escaping more would change keys for no gain.
fn escaped(parts: &[Part]) -> Vec<char> {
    let separators: Vec<char> = parts
        .windows(3)
        .filter_map(|window| match window {
            [Part::Field(_), Part::Literal(text), Part::Field(_)] => text.chars().next(),
            _ => None,
        })
        .collect();
    if separators.is_empty() {
        return Vec::new();
    }
    let mut escaped = vec!['%'];
    for separator in separators {
        if !escaped.contains(&separator) {
            escaped.push(separator);
        }
    }
    escaped
}

/// `value` onto `key`, with each of `escaped` written as the `%XX` of its UTF-8 bytes.
fn push_escaped(key: &mut String, value: &str, escaped: &[char]) {
    if escaped.is_empty() {
        key.push_str(value);
        return;
    }
    for character in value.chars() {
        match escaped.contains(&character) {
            true => {
                let mut bytes = [0; 4];
                for byte in character.encode_utf8(&mut bytes).bytes() {
                    key.push_str(&format!("%{byte:02X}"));
                }
            }
            false => key.push(character),
        }
    }
}

fn read_field(field: &KeyField, delivery: &Delivery) -> Result<String, InputError> {
    let raw: Option<&Bytes> = match field {
        KeyField::BrokerKey => delivery.broker_key(),
        KeyField::Header(name) => delivery.headers().get(name),
        KeyField::MessageId => {
            return delivery
                .message_id()
                .map(str::to_owned)
                .ok_or_else(|| InputError::KeyMissing {
                    field: field.to_string(),
                });
        }
        KeyField::JsonPointer(pointer) => return read_pointer(pointer, delivery),
    };
    let raw = raw.ok_or_else(|| InputError::KeyMissing {
        field: field.to_string(),
    })?;
    std::str::from_utf8(raw)
        .map(str::to_owned)
        .map_err(|_| InputError::KeyNotUtf8 {
            field: field.to_string(),
        })
}

fn read_pointer(pointer: &str, delivery: &Delivery) -> Result<String, InputError> {
    let document = delivery.json()?;
    let not_scalar = |found| InputError::KeyNotScalar {
        pointer: pointer.to_owned(),
        found,
    };
    match document.pointer(pointer) {
        None | Some(Value::Null) => Err(InputError::PointerNotFound {
            pointer: pointer.to_owned(),
        }),
        Some(Value::String(text)) => Ok(text.clone()),
        // Without serde_json's arbitrary precision, integers beyond 64 bits and every
        // fraction arrive as f64: distinct ids could round to one key.
        Some(Value::Number(number)) if number.is_i64() || number.is_u64() => Ok(number.to_string()),
        Some(Value::Number(number)) => Err(InputError::KeyNumberInexact {
            pointer: pointer.to_owned(),
            number: number.to_string(),
        }),
        Some(Value::Bool(_)) => Err(not_scalar("a boolean")),
        Some(Value::Array(_)) => Err(not_scalar("an array")),
        Some(Value::Object(_)) => Err(not_scalar("an object")),
    }
}

fn parse_template(template: &str) -> Result<Vec<Part>, &'static str> {
    let mut parts = Vec::new();
    let mut literal = String::new();
    let mut chars = template.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                literal.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                literal.push('}');
            }
            '}' => return Err("unmatched `}` (write `}}` for a literal brace)"),
            '{' => {
                let mut name = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some(c) => name.push(c),
                        None => return Err("unclosed `{`"),
                    }
                }
                if !literal.is_empty() {
                    parts.push(Part::Literal(std::mem::take(&mut literal)));
                }
                parts.push(Part::Field(parse_placeholder(&name)?));
            }
            c => literal.push(c),
        }
    }
    if !literal.is_empty() {
        parts.push(Part::Literal(literal));
    }
    if !parts.iter().any(|part| matches!(part, Part::Field(_))) {
        return Err("no field in the template: every message would share one key");
    }
    let adjacent = parts
        .windows(2)
        .any(|pair| matches!(pair, [Part::Field(_), Part::Field(_)]));
    if adjacent {
        return Err(
            "two fields with no text between them: `{/a}{/b}` reads `ab`+`c` as it reads `a`+`bc`; put a separator between",
        );
    }
    let separator_starts_with_percent = parts.windows(3).any(|window| {
        matches!(window, [Part::Field(_), Part::Literal(text), Part::Field(_)] if text.starts_with('%'))
    });
    if separator_starts_with_percent {
        return Err(
            "a separator between two fields starts with `%`, which in a value starts an escape: `{/a}%{/b}` reads `x`+`25%25` as it reads `x%`+`2525`; start it with another character",
        );
    }
    Ok(parts)
}

fn parse_placeholder(name: &str) -> Result<KeyField, &'static str> {
    match name {
        "message_id" => Ok(KeyField::MessageId),
        "broker_key" => Ok(KeyField::BrokerKey),
        pointer if pointer.starts_with('/') => Ok(KeyField::JsonPointer(pointer.to_owned())),
        other => match other.strip_prefix("header:") {
            Some(header) if !header.is_empty() => Ok(KeyField::Header(header.to_owned())),
            _ => Err("unknown placeholder: use {message_id}, {broker_key}, {header:NAME} or {/json/pointer}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::Source;

    fn delivery(body: &'static [u8]) -> Delivery {
        Delivery::new(Source::new("test"), body)
    }

    #[test]
    fn reads_each_field_kind() {
        let d = delivery(br#"{"order":{"id":42},"sku":"A-1"}"#)
            .with_message_id("m-1")
            .with_broker_key("k-1")
            .with_header("x-biz", "h-1");
        let key = |e: KeyExtractor| e.extract(&d).unwrap().to_string();
        assert_eq!(key(KeyExtractor::message_id()), "m-1");
        assert_eq!(key(KeyExtractor::broker_key()), "k-1");
        assert_eq!(key(KeyExtractor::header("x-biz")), "h-1");
        assert_eq!(key(KeyExtractor::json_pointer("/order/id")), "42");
        assert_eq!(
            key(KeyExtractor::json_pointer("/sku").with_namespace("deduct_stock")),
            "A-1:deduct_stock"
        );
        let composed = KeyExtractor::template("order_{/order/id}:{header:x-biz}:{{x}}").unwrap();
        assert_eq!(key(composed), "order_42:h-1:{x}");
        // Two fields: `%` and the separator's first character escaped in their values, and
        // nothing else — the namespace's and the other literals' characters included.
        let d = d.with_header("x-biz", "h:1_%-");
        let composed = KeyExtractor::template("o_{/sku}:-{header:x-biz}_").unwrap();
        assert_eq!(composed.extract(&d).unwrap().as_str(), "o_A-1:-h%3A1_%25-_");
        let namespaced = KeyExtractor::template("{/sku}:{header:x-biz}")
            .unwrap()
            .with_namespace("deduct_stock");
        assert_eq!(
            namespaced.extract(&d).unwrap().as_str(),
            "A-1:h%3A1_%25-:deduct_stock"
        );
    }

    #[test]
    fn every_error_class_is_typed() {
        let plain = delivery(b"not json");
        assert!(matches!(
            KeyExtractor::message_id().extract(&plain),
            Err(InputError::KeyMissing { .. })
        ));
        assert!(matches!(
            KeyExtractor::header("x").extract(&plain.clone().with_header("x", "")),
            Err(InputError::KeyEmpty { .. })
        ));
        assert!(matches!(
            KeyExtractor::broker_key().extract(&plain.clone().with_broker_key(&b"\xff\xfe"[..])),
            Err(InputError::KeyNotUtf8 { .. })
        ));
        assert!(matches!(
            KeyExtractor::json_pointer("/id").extract(&plain),
            Err(InputError::BodyNotJson { .. })
        ));
        assert!(matches!(
            KeyExtractor::json_pointer("/id").extract(&delivery(b"\xff{}")),
            Err(InputError::BodyNotJson { .. })
        ));
        let json = delivery(br#"{"id":null,"flag":true,"list":[1]}"#);
        for pointer in ["/missing", "/id"] {
            assert!(matches!(
                KeyExtractor::json_pointer(pointer).extract(&json),
                Err(InputError::PointerNotFound { .. })
            ));
        }
        for pointer in ["/flag", "/list", ""] {
            assert!(matches!(
                KeyExtractor::json_pointer(pointer).extract(&json),
                Err(InputError::KeyNotScalar { .. })
            ));
        }
        let long = plain.clone().with_message_id("x".repeat(DEFAULT_MAX_KEY_LEN + 1));
        assert!(matches!(
            KeyExtractor::message_id().extract(&long),
            Err(InputError::KeyTooLong { len: 257, max: 256 })
        ));
        assert!(
            KeyExtractor::message_id()
                .with_max_len(300)
                .extract(&long)
                .is_ok()
        );
        for id in ["a\0b", "a\nb", "\u{1b}[0m"] {
            assert!(matches!(
                KeyExtractor::message_id().extract(&plain.clone().with_message_id(id)),
                Err(InputError::KeyControlCharacter { .. })
            ));
        }
        let numbers = delivery(br#"{"big":12345678901234567890123,"max":18446744073709551615,"neg":-9223372036854775808,"frac":1.5}"#);
        for pointer in ["/big", "/frac"] {
            assert!(matches!(
                KeyExtractor::json_pointer(pointer).extract(&numbers),
                Err(InputError::KeyNumberInexact { .. })
            ));
        }
        let exact = |pointer| {
            KeyExtractor::json_pointer(pointer)
                .extract(&numbers)
                .unwrap()
                .to_string()
        };
        assert_eq!(exact("/max"), "18446744073709551615");
        assert_eq!(exact("/neg"), "-9223372036854775808");
    }

    /// Every pair of values over an alphabet of `%`, the hex digits of `%25` and `%3A`, and
    /// separator characters, under every separator of one or two of them: no two pairs
    /// make one key (an escape left out would show: `x%3A`, `y` against `x:`, `y`), and the
    /// separators that start with `%` are refused.
    #[test]
    fn no_two_value_pairs_make_one_key() {
        let alphabet = ['%', '2', '5', '3', 'A', ':'];
        let up_to = |length: usize| {
            let mut all = vec![String::new()];
            let mut longest = vec![String::new()];
            for _ in 0..length {
                longest = longest
                    .iter()
                    .flat_map(|text| alphabet.iter().map(move |c| format!("{text}{c}")))
                    .collect();
                all.extend(longest.iter().cloned());
            }
            all.retain(|text| !text.is_empty());
            all
        };
        // Values of up to three characters under one-character separators, of up to two
        // under two-character ones: some 400,000 keys.
        for (separators, values) in [(up_to(1), up_to(3)), (up_to(2), up_to(2))] {
            for separator in separators {
                let Ok(keys) = KeyExtractor::template(&format!("{{header:a}}{separator}{{header:b}}")) else {
                    assert!(separator.starts_with('%'), "{separator:?} refused");
                    continue;
                };
                assert!(!separator.starts_with('%'), "{separator:?} accepted");
                let mut seen = std::collections::HashMap::new();
                for a in &values {
                    for b in &values {
                        let d = delivery(b"")
                            .with_header("a", a.clone())
                            .with_header("b", b.clone());
                        let key = keys.extract(&d).unwrap().to_string();
                        if let Some(earlier) = seen.insert(key.clone(), (a, b)) {
                            panic!("{separator:?}: {earlier:?} and {:?} both make {key}", (a, b));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bad_templates_are_config_errors() {
        for template in [
            "plain",
            "{",
            "}",
            "{nope}",
            "{header:}",
            "",
            "{/a}{/b}",
            "{/a}%{/b}",
            "{/a}%:{/b}",
        ] {
            let error = KeyExtractor::template(template).unwrap_err();
            assert!(
                matches!(error, ConfigError::InvalidTemplate { .. }),
                "{template}: {error}"
            );
        }
    }
}

/// Properties over inputs no one wrote by hand: `PROPTEST_CASES` sets how many (256 unless
/// set; `make fuzz` runs many more).
#[cfg(test)]
mod properties {
    use proptest::collection::vec;
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::*;
    use crate::envelope::Source;

    /// A template of one to three body fields `/f0`, `/f1`, … with literal text between and
    /// around them, and the literals.
    fn template() -> impl Strategy<Value = String> {
        (1..=3usize, vec("[a-z:_/.%{}-]{0,3}", 4)).prop_map(|(fields, literals)| {
            let literal = |text: &String| text.replace('{', "{{").replace('}', "}}");
            let mut template = literal(&literals[0]);
            for field in 0..fields {
                template.push_str(&format!("{{/f{field}}}"));
                // A separator between fields: adjacent fields, and a separator that starts
                // with `%`, are refused.
                let between = literal(&literals[field + 1]);
                if field + 1 < fields && (between.is_empty() || between.starts_with('%')) {
                    template.push(':');
                }
                template.push_str(&between);
            }
            template
        })
    }

    fn body(values: &[String]) -> Delivery {
        let mut document = serde_json::Map::new();
        for (field, value) in values.iter().enumerate() {
            document.insert(format!("f{field}"), json!(value));
        }
        Delivery::new(Source::new("q"), Value::Object(document).to_string())
    }

    proptest! {
        /// A key read by a template is one a store can keep — not empty, no control
        /// character, within the limit — or a typed refusal; and two deliveries whose fields
        /// differ never get one key.
        #[test]
        fn prop_template_keys_are_storable_and_never_shared(
            template in template(),
            // Mostly the characters of templates, `%` and hex digits, where two sets of values
            // could meet; then any printable text, then a control character.
            a in vec("[%2357ABDEF:_/.a-]{1,4}|\\PC{0,12}|[\\x00-\\x1f]", 3),
            b in vec("[%2357ABDEF:_/.a-]{1,4}|\\PC{0,12}|[\\x00-\\x1f]", 3),
        ) {
            let keys = KeyExtractor::template(&template).expect("a valid template");
            let fields = keys.parts.iter().filter(|part| matches!(part, Part::Field(_))).count();
            let (a, b) = (&a[..fields], &b[..fields]);
            let (key_a, key_b) = (keys.extract(&body(a)), keys.extract(&body(b)));
            for key in [&key_a, &key_b].into_iter().flatten() {
                prop_assert!(!key.as_str().is_empty());
                prop_assert!(!key.as_str().chars().any(char::is_control), "{key:?}");
                prop_assert!(key.as_str().len() <= DEFAULT_MAX_KEY_LEN);
            }
            if let (Ok(key_a), Ok(key_b)) = (&key_a, &key_b) {
                prop_assert_eq!(a == b, key_a == key_b, "{} made {} and {}", template, key_a, key_b);
            }
        }

        /// Two fields whose values hold the text between them, split otherwise — `x:y` and
        /// `z` against `x` and `y:z` — never make the same key.
        #[test]
        fn prop_values_split_otherwise_make_another_key(
            separator in "[:_/.%2A-]{1,2}",
            parts in ("[a-c25A:_/.%-]{1,3}", "[a-c25A:_/.%-]{1,3}", "[a-c25A:_/.%-]{1,3}"),
        ) {
            // Refused, as `bad_templates_are_config_errors` shows.
            prop_assume!(!separator.starts_with('%'));
            let (p, q, y) = parts;
            let keys = KeyExtractor::template(&format!("{{/f0}}{separator}{{/f1}}")).expect("a template");
            let original = [format!("{p}{separator}{q}"), y.clone()];
            let moved = [p, format!("{q}{separator}{y}")];
            let (a, b) = (keys.extract(&body(&original)), keys.extract(&body(&moved)));
            if let (Ok(a), Ok(b)) = (a, b) {
                prop_assert_eq!(original == moved, a == b, "{:?} and {:?} made {} and {}", original, moved, a, b);
            }
        }

        /// Any JSON pointer on any body answers a key or a typed refusal, never a panic.
        #[test]
        fn prop_a_pointer_on_any_body_answers(body in vec(any::<u8>(), 0..200), pointer in "(/[a-z0-9~]{0,4}){0,3}") {
            let delivery = Delivery::new(Source::new("q"), body);
            let _ = KeyExtractor::json_pointer(pointer).extract(&delivery);
        }

        /// Any template text is a template or a typed refusal, never a panic.
        #[test]
        fn prop_any_template_text_parses_or_is_refused(text in "[{}a-z:/_]{0,24}") {
            let _ = KeyExtractor::template(&text);
        }
    }
}
