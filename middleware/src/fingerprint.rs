//! Fingerprints: telling a true duplicate from a key reused with another payload.

use std::fmt;
use std::sync::Arc;

use crate::envelope::Delivery;
use crate::error::{ConfigError, InputError};

/// A 128-bit hash of a message body (XXH3-128), stored with a key so that the same key
/// arriving with another payload is told apart from a true duplicate.
///
/// Not cryptographic: it catches keys reused by mistake, not an adversary forging bodies.
/// Stable across processes, versions and platforms, so it can be stored durably.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(u128);

impl Fingerprint {
    /// The fingerprint of a route whose policy is [`FingerprintPolicy::off()`]: it matches
    /// every fingerprint, and every fingerprint matches it ([`matches`](Fingerprint::matches)).
    /// A body whose hash is this value (one chance in 2¹²⁸) is compared with nothing.
    pub const UNCHECKED: Fingerprint = Fingerprint(0);

    /// True when a key recorded with `recorded` may be taken as a duplicate of a delivery
    /// carrying `self`: the two are equal, or either is [`UNCHECKED`](Fingerprint::UNCHECKED)
    /// (recorded while the route's fingerprint was off, or checked while it is off).
    pub fn matches(self, recorded: Fingerprint) -> bool {
        self == recorded || self == Fingerprint::UNCHECKED || recorded == Fingerprint::UNCHECKED
    }

    /// The fingerprint of `body`.
    pub fn of(body: &[u8]) -> Self {
        Fingerprint(xxhash_rust::xxh3::xxh3_128(body))
    }

    /// The raw 128-bit value.
    pub fn as_u128(self) -> u128 {
        self.0
    }

    /// A fingerprint from its raw value, as read back from a store.
    pub fn from_u128(value: u128) -> Self {
        Fingerprint(value)
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

/// What of a delivery a route fingerprints ([`Route::with_fingerprint`](crate::Route::with_fingerprint)).
///
/// Every tier that remembers a key (flag, record) stores the fingerprint with it; a later
/// delivery of the key with another fingerprint is dead-lettered as `payload_mismatch`
/// instead of being acked as a duplicate, because a key reused for another payload is a
/// bug to look at, never an effect to drop silently.
///
/// This is what AWS Lambda Powertools calls *payload validation*
/// (`payload_validation_jmespath`): there, the whole event is hashed unless a JMESPath
/// selects the fields that must match, and a mismatch raises
/// `IdempotencyValidationError`. Here the selection is a list of JSON pointers
/// ([`fields`](FingerprintPolicy::fields)), the default is the whole body, and validation can
/// be turned [`off`](FingerprintPolicy::off); a mismatch is a dead letter with its reason.
///
/// Changing the policy of a live route changes the fingerprints of new deliveries: a
/// duplicate of a key remembered under the old policy then looks like another payload
/// (turning it off is the exception: [`off`](FingerprintPolicy::off) matches whatever was
/// recorded). Change it when no duplicates of older keys are expected, or pass through
/// `off` for the retention time. Two limits of `off`: a key first remembered while it was
/// off stays unchecked for as long as it is remembered, and consumers of a version before
/// `off` existed compare its fingerprint exactly — deploy the version everywhere first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FingerprintPolicy(Policy);

#[derive(Clone, Debug, Default, PartialEq, Eq)]
enum Policy {
    #[default]
    WholeBody,
    CanonicalJson,
    Fields(Arc<[String]>),
    Off,
}

impl FingerprintPolicy {
    /// The whole body, byte for byte: any difference is another payload. The default.
    pub fn whole_body() -> Self {
        FingerprintPolicy(Policy::WholeBody)
    }

    /// The whole body as JSON, canonicalised: object keys sorted, whitespace dropped, so
    /// producers that serialise the same payload in another key order or layout send the
    /// same payload. Numbers as in [`fields`](FingerprintPolicy::fields). A body that is not
    /// JSON is dead-lettered (`invalid_key`).
    pub fn canonical_json() -> Self {
        FingerprintPolicy(Policy::CanonicalJson)
    }

    /// No payload check: every delivery of a remembered key is a duplicate.
    pub fn off() -> Self {
        FingerprintPolicy(Policy::Off)
    }

    /// The values at `pointers` (RFC 6901, e.g. `/orderId`, `/amount/value`): a producer
    /// that re-sends an order with a new `sentAt` or trace id is still a duplicate.
    ///
    /// A field absent from the body counts as absent, which differs from `null`. Values are
    /// compared as parsed JSON: whitespace and object key order inside a field do not
    /// matter; numbers are compared as 64-bit integers or, beyond those, as doubles (about
    /// 15 significant digits: send values that need more as strings), so `1` and `1.0`
    /// differ. A body that is not JSON is dead-lettered (`invalid_key`).
    ///
    /// [`ConfigError::InvalidFingerprint`] when there are none, or one is neither empty (the
    /// whole document) nor starts with `/` — such a pointer would never match anything, and
    /// every payload would look the same.
    pub fn fields<I, P>(pointers: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = P>,
        P: Into<String>,
    {
        let pointers: Vec<String> = pointers.into_iter().map(Into::into).collect();
        if pointers.is_empty() {
            return Err(ConfigError::InvalidFingerprint {
                reason: "no field: list at least one JSON pointer, or use FingerprintPolicy::off()"
                    .to_owned(),
            });
        }
        if let Some(bad) = pointers.iter().find(|p| !p.is_empty() && !p.starts_with('/')) {
            return Err(ConfigError::InvalidFingerprint {
                reason: format!("{bad:?} is not a JSON pointer: it must start with `/`"),
            });
        }
        Ok(FingerprintPolicy(Policy::Fields(pointers.into())))
    }

    /// The fingerprint of `delivery` under this policy, covering its
    /// [context](Delivery::with_fingerprint_context) too when it has one.
    pub(crate) fn fingerprint(&self, delivery: &Delivery) -> Result<Fingerprint, InputError> {
        let selected = self.of_body(delivery)?;
        match delivery.fingerprint_context() {
            Some(context) if selected != Fingerprint::UNCHECKED => {
                // Length-prefixed, so that no context and selection can write the same bytes.
                let mut covered = (context.len() as u64).to_le_bytes().to_vec();
                covered.extend_from_slice(context);
                covered.extend_from_slice(&selected.as_u128().to_le_bytes());
                Ok(Fingerprint::of(&covered))
            }
            _ => Ok(selected),
        }
    }

    /// The fingerprint of what this policy selects of `delivery`'s body.
    fn of_body(&self, delivery: &Delivery) -> Result<Fingerprint, InputError> {
        match &self.0 {
            Policy::WholeBody => Ok(Fingerprint::of(delivery.body())),
            Policy::Off => Ok(Fingerprint::UNCHECKED),
            Policy::CanonicalJson => {
                let mut canonical = Vec::new();
                write_canonical(delivery.json()?, &mut canonical);
                Ok(Fingerprint::of(&canonical))
            }
            Policy::Fields(pointers) => {
                let document = delivery.json()?;
                let mut selected = Vec::new();
                for pointer in pointers.iter() {
                    // Length-prefixed, so that no two selections can write the same bytes.
                    selected.extend_from_slice(&(pointer.len() as u64).to_le_bytes());
                    selected.extend_from_slice(pointer.as_bytes());
                    match document.pointer(pointer) {
                        None => selected.push(0),
                        Some(value) => {
                            selected.push(1);
                            let mut canonical = Vec::new();
                            write_canonical(value, &mut canonical);
                            selected.extend_from_slice(&(canonical.len() as u64).to_le_bytes());
                            selected.extend_from_slice(&canonical);
                        }
                    }
                }
                Ok(Fingerprint::of(&selected))
            }
        }
    }
}

/// Writes `value` as compact JSON with every object's keys sorted. serde_json keeps keys
/// sorted only while no crate in the build enables its `preserve_order` feature, so the
/// order is fixed here rather than relied on.
fn write_canonical(value: &serde_json::Value, out: &mut Vec<u8>) {
    use serde_json::Value;
    match value {
        Value::Array(items) => {
            out.push(b'[');
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        Value::Object(fields) => {
            let mut fields: Vec<_> = fields.iter().collect();
            fields.sort_unstable_by_key(|(name, _)| *name);
            out.push(b'{');
            for (index, (name, field)) in fields.into_iter().enumerate() {
                if index > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(Value::from(name.as_str()).to_string().as_bytes());
                out.push(b':');
                write_canonical(field, out);
            }
            out.push(b'}');
        }
        // -0.0 and 0.0 are one number (and equal as parsed JSON): one spelling.
        Value::Number(number) if number.as_f64() == Some(0.0) && number.is_f64() => {
            out.extend_from_slice(b"0.0")
        }
        scalar => out.extend_from_slice(scalar.to_string().as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::Source;

    fn delivery(body: &'static str) -> Delivery {
        Delivery::new(Source::new("q"), body)
    }

    #[test]
    fn fingerprint_is_stable_and_payload_sensitive() {
        let a = Fingerprint::of(b"{\"orderId\":1}");
        assert_eq!(a, Fingerprint::of(b"{\"orderId\":1}"));
        assert_ne!(a, Fingerprint::of(b"{\"orderId\":2}"));
        assert_eq!(Fingerprint::from_u128(a.as_u128()), a);
        assert_eq!(a.to_string().len(), 32);
    }

    #[test]
    fn fields_ignore_everything_else_and_unchecked_matches_all() {
        let policy = FingerprintPolicy::fields(["/orderId", "/amount"]).unwrap();
        let of = |body| policy.fingerprint(&delivery(body)).unwrap();
        let first = of(r#"{"orderId":"o-1","amount":{"value":5,"unit":"EUR"},"sentAt":1}"#);
        assert_eq!(
            first,
            of(r#"{ "sentAt":2, "amount":{"unit":"EUR","value":5}, "orderId":"o-1" }"#)
        );
        assert_ne!(
            first,
            of(r#"{"orderId":"o-1","amount":{"value":6,"unit":"EUR"}}"#)
        );
        assert_ne!(
            of(r#"{"orderId":"o-1"}"#),
            of(r#"{"orderId":"o-1","amount":null}"#)
        );
        assert!(policy.fingerprint(&delivery("not json")).is_err());
        assert!(FingerprintPolicy::fields(Vec::<String>::new()).is_err());
        assert!(FingerprintPolicy::fields(["orderId"]).is_err());

        let canonical = FingerprintPolicy::canonical_json();
        let of = |body| canonical.fingerprint(&delivery(body)).unwrap();
        assert_eq!(
            of(r#"{"a":1,"b":[1,{"d":2,"c":3}]}"#),
            of(r#"{ "b": [1, {"c":3, "d":2}], "a": 1 }"#)
        );
        assert_ne!(of(r#"{"a":1}"#), of(r#"{"a":2}"#));
        assert_eq!(
            of(r#"{"a":-0.0}"#),
            of(r#"{"a":0.0}"#),
            "one number, one fingerprint"
        );
        assert_ne!(
            of(r#"{"a":1.0}"#),
            of(r#"{"a":1}"#),
            "as documented: 1 and 1.0 differ"
        );
        assert!(canonical.fingerprint(&delivery("not json")).is_err());

        let in_context = |context: &'static str| {
            let delivery = delivery(r#"{"orderId":"o-1"}"#).with_fingerprint_context(context);
            policy.fingerprint(&delivery).unwrap()
        };
        assert_ne!(in_context("POST /orders"), in_context("POST /refunds"));
        let without_context = policy.fingerprint(&delivery(r#"{"orderId":"o-1"}"#)).unwrap();
        assert_ne!(in_context("POST /orders"), without_context);
        let unchecked = delivery("x").with_fingerprint_context("POST /orders");
        assert_eq!(
            FingerprintPolicy::off().fingerprint(&unchecked).unwrap(),
            Fingerprint::UNCHECKED
        );

        let off = FingerprintPolicy::off().fingerprint(&delivery("x")).unwrap();
        assert!(off.matches(first) && first.matches(off));
        assert!(!first.matches(of(r#"{"orderId":"o-2"}"#)));
    }
}

/// Properties over inputs no one wrote by hand: `PROPTEST_CASES` sets how many (256 unless
/// set; `make fuzz` runs many more).
#[cfg(test)]
mod properties {
    use proptest::prelude::*;
    use serde_json::{Map, Number, Value};

    use super::*;
    use crate::envelope::Source;

    /// Any JSON document: scalars (integers, finite doubles, strings, booleans, null) in
    /// arrays and objects, a few levels deep.
    fn document() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |number| number.is_finite())
                .prop_map(|number| Value::Number(Number::from_f64(number).expect("finite"))),
            "\\PC{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-c]{1,2}", inner, 0..4)
                    .prop_map(|fields| Value::Object(fields.into_iter().collect::<Map<_, _>>())),
            ]
        })
    }

    /// `value` written with every object's keys in reverse order and spaces between tokens:
    /// the same document as another producer might serialise it.
    fn written_otherwise(value: &Value) -> String {
        match value {
            Value::Array(items) => {
                let items: Vec<String> = items.iter().map(written_otherwise).collect();
                format!("[ {} ]", items.join(" , "))
            }
            Value::Object(fields) => {
                let fields: Vec<String> = fields
                    .iter()
                    .rev()
                    .map(|(name, field)| {
                        format!("{} : {}", Value::from(name.as_str()), written_otherwise(field))
                    })
                    .collect();
                format!("{{ {} }}", fields.join(" , "))
            }
            scalar => scalar.to_string(),
        }
    }

    fn canonical(body: String) -> Fingerprint {
        let delivery = Delivery::new(Source::new("q"), body);
        FingerprintPolicy::canonical_json()
            .fingerprint(&delivery)
            .expect("a JSON body")
    }

    proptest! {
        /// Equal documents fingerprint alike however they are written; unequal ones apart.
        #[test]
        fn prop_equal_documents_fingerprint_alike_and_unequal_ones_apart(a in document(), b in document()) {
            prop_assert_eq!(canonical(a.to_string()), canonical(written_otherwise(&a)));
            prop_assert_eq!(a == b, canonical(a.to_string()) == canonical(b.to_string()), "{} vs {}", a, b);
        }

        /// Any body under any policy answers a fingerprint or a typed refusal, never a panic.
        #[test]
        fn prop_any_body_fingerprints_or_is_refused(body in prop::collection::vec(any::<u8>(), 0..200)) {
            let delivery = Delivery::new(Source::new("q"), body);
            for policy in [
                FingerprintPolicy::whole_body(),
                FingerprintPolicy::canonical_json(),
                FingerprintPolicy::fields(["/a", "/b/0", ""]).expect("pointers"),
            ] {
                let _ = policy.fingerprint(&delivery);
            }
        }
    }
}
