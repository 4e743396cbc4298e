//! Whose key a request's key is: keys are scoped by client.

use std::fmt;
use std::sync::Arc;

use http::header::HeaderName;
use http::request::Parts;

use crate::problem::Problem;

/// Reads which client sent a request from its parts.
type ReadClient = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// Which client a request's key belongs to, so that one client never sees another's
/// response, nor learns which keys another used: the same key from two clients is two keys.
/// Chosen when the layer is made ([`IdempotencyLayer::new`](crate::IdempotencyLayer::new)).
///
/// A request whose client cannot be told is refused with [`Problem::ClientUnidentified`]
/// (401) before anything runs. Read the client from what an authentication layer in front
/// has checked, never from a value the caller may set freely: whoever can claim a client's
/// identity can read that client's stored responses.
#[derive(Clone)]
pub struct ClientScope(Scope);

#[derive(Clone)]
enum Scope {
    Shared,
    Read(Arc<ReadClient>),
}

impl fmt::Debug for ClientScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            Scope::Shared => "ClientScope::shared",
            Scope::Read(_) => "ClientScope::by",
        })
    }
}

impl ClientScope {
    /// One scope for every caller: for an endpoint with a single caller, such as a payment
    /// provider's notifications. Anyone who can reach the endpoint and knows a key gets
    /// that key's response.
    pub fn shared() -> Self {
        ClientScope(Scope::Shared)
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
        ClientScope(Scope::Read(Arc::new(read)))
    }

    /// The client of the request whose parts are `parts`: empty when shared.
    pub(crate) fn of(&self, parts: &Parts) -> Result<String, Problem> {
        match &self.0 {
            Scope::Shared => Ok(String::new()),
            Scope::Read(read) => read(parts).ok_or(Problem::ClientUnidentified),
        }
    }
}
