//! Whose key a request's key is: keys are scoped by client.

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, KeyInit, Mac};
use http::header::HeaderName;
use http::request::Parts;
use sha2::{Digest, Sha256};

use crate::problem::Problem;

/// Reads which client sent a request from its parts.
type ReadClient = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// The bytes of a client's hash kept in its scope: 128 bits, as 32 hex digits.
const SCOPE_LEN: usize = 16;

/// The hex digits of a scope that logs and the command line show.
pub(crate) const SHOWN_SCOPE_LEN: usize = 8;

/// Which client a request's key belongs to, so that one client never sees another's
/// response, nor learns which keys another used: the same key from two clients is two keys.
/// Chosen when the layer is made ([`IdempotencyLayer::new`](crate::IdempotencyLayer::new)).
///
/// A request whose client cannot be told is refused with [`Problem::ClientUnidentified`]
/// (401) before anything runs. Read the client from what an authentication layer in front
/// has checked, never from a value the caller may set freely: whoever can claim a client's
/// identity can read that client's stored responses.
///
/// The identity itself is never stored nor logged: a key is scoped by a hash of it, 128 bits
/// of HMAC-SHA-256 under the secret given to [`with_secret`](Self::with_secret), written as
/// 32 hex digits (`3f9a…:order-42` in the record and response tables, the one-time token
/// table's `client` column and the Redis flag's keys; this crate's logs and `oncely inspect`
/// show the first eight digits, while the tiers' own logs — a dead letter, a store failure —
/// name the key as stored). An identity that is itself a secret, such as an API key, is then
/// safe wherever the tables, their backups or the logs go. Without a secret the hash is a plain
/// SHA-256 of the identity: it hides an API key (its entropy defeats guessing), but whoever
/// reads the tables can test a guess of a low-entropy identity (a tenant's name) and learn
/// which keys it used — give a secret when the identities can be guessed. The secret is for
/// good: a new one scopes every client anew, so the keys stored under the old one are not
/// found (their retries run again) until they expire.
#[derive(Clone)]
pub struct ClientScope {
    read: Scope,
    hash: ScopeHash,
}

#[derive(Clone)]
enum Scope {
    Shared,
    Read(Arc<ReadClient>),
}

/// How an identity becomes its scope.
#[derive(Clone)]
enum ScopeHash {
    /// SHA-256 of the identity.
    Plain,
    /// HMAC-SHA-256 of the identity under the application's secret.
    Keyed(Hmac<Sha256>),
}

impl fmt::Debug for ClientScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let read = match self.read {
            Scope::Shared => "ClientScope::shared",
            Scope::Read(_) => "ClientScope::by",
        };
        let hash = match self.hash {
            ScopeHash::Plain => "SHA-256",
            ScopeHash::Keyed(_) => "HMAC-SHA-256",
        };
        write!(f, "{read} ({hash})")
    }
}

impl ClientScope {
    /// One scope for every caller: for an endpoint with a single caller, such as a payment
    /// provider's notifications. Anyone who can reach the endpoint and knows a key gets
    /// that key's response.
    pub fn shared() -> Self {
        ClientScope {
            read: Scope::Shared,
            hash: ScopeHash::Plain,
        }
    }

    /// The value of the request header `name`, e.g. an API key or a tenant id that a layer
    /// in front has checked. Panics if `name` is not a valid lowercase header name, as
    /// `HeaderName::from_static` does.
    pub fn header(name: &'static str) -> Self {
        let name = HeaderName::from_static(name);
        ClientScope::by(move |parts| {
            let value = parts.headers.get(&name)?.to_str().ok()?;
            (!value.is_empty()).then(|| value.to_owned())
        })
    }

    /// What `read` answers for the request, e.g. the principal an authentication layer in
    /// front put in the request's extensions; `None` when it cannot tell.
    pub fn by(read: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        ClientScope {
            read: Scope::Read(Arc::new(read)),
            hash: ScopeHash::Plain,
        }
    }

    /// Scopes keys by HMAC-SHA-256 of the client's identity under `secret` (any length; 32
    /// random bytes is plenty) instead of its plain SHA-256, so that the tables tell nothing
    /// of an identity to whoever lacks the secret. Keep it as the application keeps its other
    /// secrets, and for good (see above). No effect on [`shared`](Self::shared).
    pub fn with_secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        let mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_ref());
        self.hash = ScopeHash::Keyed(mac.expect("HMAC takes a key of any length"));
        self
    }

    /// The scope of the request whose parts are `parts`: 32 hex digits of the client's hash,
    /// empty when shared.
    pub(crate) fn of(&self, parts: &Parts) -> Result<String, Problem> {
        match &self.read {
            Scope::Shared => Ok(String::new()),
            Scope::Read(read) => {
                let identity = read(parts).ok_or(Problem::ClientUnidentified)?;
                Ok(self.hash_of(&identity))
            }
        }
    }

    /// The business key under which a request of the client `identity` with the
    /// `Idempotency-Key` (or token) `key` is recorded: its scope, a colon, the key. For
    /// operators' tools (`oncely inspect --client`), which must scope a key as the route
    /// does: with the same secret, or none. With [`shared`](Self::shared), `identity` is
    /// ignored.
    pub fn stored_key(&self, identity: &str, key: &str) -> String {
        let scope = match &self.read {
            Scope::Shared => String::new(),
            Scope::Read(_) => self.hash_of(identity),
        };
        crate::key::scoped(&scope, key)
    }

    /// The scope of `identity`.
    fn hash_of(&self, identity: &str) -> String {
        let digest: [u8; 32] = match &self.hash {
            ScopeHash::Plain => Sha256::digest(identity.as_bytes()).into(),
            ScopeHash::Keyed(mac) => {
                let mut mac = mac.clone();
                mac.update(identity.as_bytes());
                mac.finalize().into_bytes().into()
            }
        };
        digest[..SCOPE_LEN]
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect()
    }
}

/// `scope` as logs show it: its first eight hex digits, so that a log line names the client
/// to whoever can compute its hash and to nobody else.
pub(crate) fn shown(scope: &str) -> &str {
    scope.get(..SHOWN_SCOPE_LEN).unwrap_or(scope)
}

#[cfg(test)]
mod tests {
    use http::Request;

    use super::*;

    fn parts(api_key: &str) -> Parts {
        Request::post("/")
            .header("x-api-key", api_key)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn a_scope_is_a_hash_that_never_holds_the_identity() {
        let plain = ClientScope::header("x-api-key");
        let keyed = ClientScope::header("x-api-key").with_secret(b"the application's secret");
        let alice = plain.of(&parts("sk_live_alice")).unwrap();
        assert_eq!(alice.len(), 2 * SCOPE_LEN);
        assert!(
            alice
                .bytes()
                .all(|byte| byte.is_ascii_hexdigit() && !byte.is_ascii_uppercase())
        );
        assert!(!alice.contains("sk_live"));
        // The first 16 bytes of SHA-256("sk_live_alice"), as `sha256sum` prints them.
        assert_eq!(alice, "9ad33a4371b016b0d5901b55cf0f8e1f");
        assert_eq!(plain.of(&parts("sk_live_alice")).unwrap(), alice, "stable");
        assert_ne!(plain.of(&parts("sk_live_bob")).unwrap(), alice);
        let keyed_alice = keyed.of(&parts("sk_live_alice")).unwrap();
        // HMAC-SHA-256 as Python's `hmac.new(secret, identity, sha256)` computes it.
        assert_eq!(keyed_alice, "9151b028a52afa2c13ccfff35b2ab02b");
        let other_secret = ClientScope::header("x-api-key").with_secret(b"another secret");
        assert_ne!(other_secret.of(&parts("sk_live_alice")).unwrap(), keyed_alice);
        assert_eq!(ClientScope::shared().of(&parts("sk_live_alice")).unwrap(), "");
        assert_eq!(shown(&alice), &alice[..8]);
        assert_eq!(
            plain.stored_key("sk_live_alice", "order-42"),
            format!("{alice}:order-42")
        );
        assert_eq!(
            ClientScope::shared().stored_key("anyone", "order-42"),
            ":order-42"
        );
    }
}
