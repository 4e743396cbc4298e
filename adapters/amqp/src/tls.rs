//! `amqps://` with a given CA and client certificate (feature `tls`).
//!
//! With the feature on, `amqps://` URLs connect over TLS through the re-exported
//! [`lapin`] (rustls on aws-lc-rs), trusting the platform's authorities. For a
//! private CA or a broker that asks for a client certificate (RabbitMQ's
//! `ssl_options.fail_if_no_peer_cert`), connect with [`config`]:
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use oncely_amqp::lapin::{Connection, ConnectionProperties, runtime};
//! use oncely_amqp::oncely::tls::TlsSettings;
//!
//! let settings = TlsSettings::from_env()?; // ONCELY_CA_CERT, ONCELY_TLS_CERT, ONCELY_TLS_KEY
//! let connection = Connection::connect_with_config(
//!     "amqps://guest:guest@rabbit.example:5671/%2f",
//!     ConnectionProperties::default(),
//!     oncely_amqp::tls::config(&settings)?,
//!     runtime::default_runtime()?,
//! )
//! .await?;
//! # Ok(()) }
//! ```
//!
//! Limit: lapin trusts a given CA *beside* the platform's authorities, not instead of
//! them (PostgreSQL and Redis trust only the given one; see `oncely::tls`).

pub use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use oncely::tls::{TlsError, TlsSettings};

/// lapin's TLS configuration of `settings`: their CA (beside the platform's) and client
/// certificate, read now.
pub fn config(settings: &TlsSettings) -> Result<OwnedTLSConfig, TlsError> {
    let cert_chain = match (settings.ca_pem()?, settings.ca_cert()) {
        (Some(pem), Some(path)) => Some(String::from_utf8(pem).map_err(|_| TlsError::NoCertificate {
            path: path.to_owned(),
            reason: Some("not PEM text".into()),
        })?),
        _ => None,
    };
    let identity = (settings.client_pem()?).map(|(pem, key)| OwnedIdentity::PKCS8 { pem, key });
    Ok(OwnedTLSConfig { identity, cert_chain })
}
