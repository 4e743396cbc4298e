//! The `Idempotency-Key` header, and the business key a request is remembered under.

use std::fmt;

use http::HeaderMap;
use http::header::HeaderName;

use crate::client::{SHOWN_SCOPE_LEN, shown};
use crate::problem::Problem;

/// The request header that carries the key (draft-ietf-httpapi-idempotency-key-header-07).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The response header that marks a stored response answered again: `true`. Stripe's name
/// for it; the draft names none.
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The longest key accepted unless configured otherwise, in bytes: 255, Stripe's limit.
pub const DEFAULT_MAX_KEY_LEN: usize = 255;

/// Reads the one `name` header as a key: `Ok(None)` when there is none.
///
/// Draft-07 makes the value a structured-field string (RFC 8941: `"…"`, printable ASCII,
/// `\"` and `\\` escaped). A bare value of printable ASCII without quotes, backslashes,
/// spaces, commas or semicolons is read the same way, because many clients (Stripe's among
/// them) send keys unquoted. Two headers, a list, parameters, other characters, an empty key
/// or one longer than `max_len` bytes are refused ([`Problem::KeyMalformed`]).
pub(crate) fn read_key(
    headers: &HeaderMap,
    name: &HeaderName,
    max_len: usize,
) -> Result<Option<String>, Problem> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(Problem::key_malformed(format!("more than one `{name}` header")));
    }
    let key = parse_value(value.as_bytes()).map_err(Problem::key_malformed)?;
    if key.is_empty() {
        return Err(Problem::key_malformed(format!("`{name}` is empty")));
    }
    if key.len() > max_len {
        return Err(Problem::key_malformed(format!(
            "`{name}` is {} bytes long; at most {max_len} are accepted",
            key.len()
        )));
    }
    Ok(Some(key))
}

/// A structured-field string, or a bare token of the same characters.
fn parse_value(raw: &[u8]) -> Result<String, String> {
    let trimmed = raw.trim_ascii();
    let Some(quoted) = trimmed.strip_prefix(b"\"") else {
        return match trimmed.iter().find(|&&byte| !is_bare(byte)) {
            None => Ok(String::from_utf8_lossy(trimmed).into_owned()),
            Some(&byte) => Err(format!(
                "the key holds {:?}, which only a quoted structured-field string may",
                char::from(byte)
            )),
        };
    };
    let mut key = String::new();
    let mut bytes = quoted.iter();
    loop {
        match bytes.next() {
            None => return Err("the quoted key has no closing quote".to_owned()),
            Some(b'"') => break,
            Some(b'\\') => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => key.push(char::from(escaped)),
                _ => return Err("a backslash in a quoted key escapes only `\"` or `\\`".to_owned()),
            },
            Some(&byte @ 0x20..=0x7e) => key.push(char::from(byte)),
            Some(&byte) => {
                return Err(format!(
                    "the key holds byte {byte:#04x}: only printable ASCII is allowed"
                ));
            }
        }
    }
    if bytes.next().is_some() {
        return Err(
            "text after the quoted key: a list or parameters, where one string is expected".to_owned(),
        );
    }
    Ok(key)
}

/// Printable ASCII that needs no quoting.
fn is_bare(byte: u8) -> bool {
    matches!(byte, 0x21..=0x7e) && !matches!(byte, b'"' | b'\\' | b',' | b';')
}

/// The business key of `key` sent by the client whose scope is `scope` (32 hex digits, see
/// [`ClientScope`](crate::ClientScope), or empty when shared): `scope:key`. The scope holds
/// no colon, so no two (client, key) pairs compose the same text.
pub(crate) fn scoped(scope: &str, key: &str) -> String {
    let mut scoped = String::with_capacity(scope.len() + key.len() + 1);
    scoped.push_str(scope);
    scoped.push(':');
    scoped.push_str(key);
    scoped
}

/// A scoped key as logs show it: the scope cut to its first eight hex digits.
pub(crate) struct Shown<'a>(pub(crate) &'a str);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.split_once(':') {
            Some((scope, key)) if scope.len() > SHOWN_SCOPE_LEN => {
                write!(f, "{}…:{key}", shown(scope))
            }
            _ => f.write_str(self.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn read(values: &[&'static str]) -> Result<Option<String>, Problem> {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static(value));
        }
        read_key(&headers, &IDEMPOTENCY_KEY, 16)
    }

    #[test]
    fn reads_quoted_and_bare_keys() {
        assert_eq!(read(&[]).unwrap(), None);
        assert_eq!(read(&[r#""8e03978e""#]).unwrap().as_deref(), Some("8e03978e"));
        assert_eq!(
            read(&[r#""a \"b\" \\c""#]).unwrap().as_deref(),
            Some(r#"a "b" \c"#)
        );
        assert_eq!(read(&["8e03-978e"]).unwrap().as_deref(), Some("8e03-978e"));
    }

    #[test]
    fn refuses_what_is_not_one_valid_key() {
        for bad in [
            &[r#""a""#, r#""b""#][..],
            &[r#""""#],
            &[r#""a", "b""#],
            &[r#""a";p=1"#],
            &[r#""unclosed"#],
            &[r#""a\x""#],
            &["a b"],
            &["a,b"],
            &[r#""0123456789abcdefg""#],
        ] {
            assert!(
                matches!(read(bad), Err(Problem::KeyMalformed { .. })),
                "{bad:?} was accepted"
            );
        }
        let mut headers = HeaderMap::new();
        headers.insert(
            IDEMPOTENCY_KEY,
            HeaderValue::from_bytes(b"\"caf\xc3\xa9\"").unwrap(),
        );
        assert!(
            read_key(&headers, &IDEMPOTENCY_KEY, 16).is_err(),
            "non-ASCII accepted"
        );
    }

    #[test]
    fn a_scoped_key_is_shown_with_its_scope_cut() {
        let scope = "9ad33a4371b016b0d5901b55cf0f8e1f";
        assert_eq!(scoped(scope, "order:42"), format!("{scope}:order:42"));
        assert_eq!(scoped("", "order-42"), ":order-42");
        assert_eq!(
            Shown(&scoped(scope, "order:42")).to_string(),
            "9ad33a43…:order:42"
        );
        assert_eq!(Shown(":order-42").to_string(), ":order-42");
    }
}

/// Properties over inputs no one wrote by hand: `PROPTEST_CASES` sets how many (256 unless
/// set; `make fuzz` runs many more).
#[cfg(test)]
mod properties {
    use http::HeaderValue;
    use proptest::collection::vec;
    use proptest::prelude::*;

    use super::*;
    use crate::layer::MAX_SCOPED_KEY_LEN;

    /// `key` as a structured-field string: quoted, `"` and `\` escaped.
    fn quoted(key: &str) -> String {
        let mut quoted = String::from("\"");
        for character in key.chars() {
            if matches!(character, '"' | '\\') {
                quoted.push('\\');
            }
            quoted.push(character);
        }
        quoted.push('"');
        quoted
    }

    fn read_value(value: &HeaderValue) -> Result<Option<String>, Problem> {
        let mut headers = HeaderMap::new();
        headers.insert(IDEMPOTENCY_KEY, value.clone());
        read_key(&headers, &IDEMPOTENCY_KEY, DEFAULT_MAX_KEY_LEN)
    }

    proptest! {
        /// Any header value is a key a store can keep, or refused: printable ASCII, not
        /// empty, within the limit, and within the scoped key's limit once scoped.
        #[test]
        fn prop_any_idempotency_key_header_is_a_storable_key_or_refused(bytes in vec(any::<u8>(), 0..400)) {
            let Ok(value) = HeaderValue::from_bytes(&bytes) else { return Ok(()) };
            match read_value(&value) {
                Ok(Some(key)) => {
                    prop_assert!(!key.is_empty());
                    prop_assert!(key.len() <= DEFAULT_MAX_KEY_LEN);
                    prop_assert!(key.bytes().all(|byte| (0x20..=0x7e).contains(&byte)), "{key:?}");
                    let stored = scoped(&"f".repeat(32), &key);
                    prop_assert!(stored.len() <= MAX_SCOPED_KEY_LEN);
                }
                Ok(None) => prop_assert!(false, "a header read as no key"),
                Err(problem) => {
                    let malformed = matches!(problem, Problem::KeyMalformed { .. });
                    prop_assert!(malformed, "{problem:?}");
                }
            }
        }

        /// Every printable key written as a structured-field string reads back as itself, so
        /// two different keys never read as one.
        #[test]
        fn prop_a_quoted_key_reads_back_as_itself(key in "[ -~]{1,255}") {
            let value = HeaderValue::from_str(&quoted(&key)).expect("printable ASCII");
            prop_assert_eq!(read_value(&value), Ok(Some(key)));
        }

        /// Two (client, key) pairs never make one stored key.
        #[test]
        fn prop_two_clients_or_two_keys_never_share_a_stored_key(
            a in ("[0-9a-f]{32}|", "[ -~]{1,64}"),
            b in ("[0-9a-f]{32}|", "[ -~]{1,64}"),
        ) {
            prop_assert_eq!(a == b, scoped(&a.0, &a.1) == scoped(&b.0, &b.1));
        }
    }
}
