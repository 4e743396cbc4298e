//! Redis over TLS (`rediss://`), single node and cluster: clients that trust the settings'
//! authorities and present their client certificate.

use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::{Client, ClientTlsConfig, IntoConnectionInfo, TlsCertificates};

use super::{TlsError, TlsSettings};

/// Why a Redis client with TLS settings could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisTlsError {
    /// The settings' files.
    #[error(transparent)]
    Settings(#[from] TlsError),
    /// The URL, or the client redis-rs builds from it.
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
}

/// The certificates redis-rs takes, read from `settings`.
fn certificates(settings: &TlsSettings) -> Result<TlsCertificates, TlsError> {
    Ok(TlsCertificates {
        client_tls: settings
            .client_pem()?
            .map(|(client_cert, client_key)| ClientTlsConfig {
                client_cert,
                client_key,
            }),
        root_cert: settings.ca_pem()?,
    })
}

/// A client of the Redis at `url`: over TLS when the URL is `rediss://`, trusting the
/// settings' authorities alone (else the platform's) and presenting their client
/// certificate; in plain text for `redis://` and `redis+unix://`. Its connections are what the flag, lock and delivery counters
/// take (`client.get_connection_manager()`).
pub fn client<T: IntoConnectionInfo>(url: T, settings: &TlsSettings) -> Result<Client, RedisTlsError> {
    let info = url.into_connection_info()?;
    // redis-rs builds a TLS client for `rediss://` only, and refuses any other address.
    if !matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. }) {
        return Ok(Client::open(info)?);
    }
    super::install_provider();
    Ok(Client::build_with_tls(info, certificates(settings)?)?)
}

/// A client of the Redis Cluster seeded by `urls` (`rediss://` each), trusting the
/// settings' authorities alone (else the platform's) and presenting their client
/// certificate to every node; its async connections (`get_async_connection`) are what the
/// stores take.
pub fn cluster_client<T: IntoConnectionInfo>(
    urls: impl IntoIterator<Item = T>,
    settings: &TlsSettings,
) -> Result<ClusterClient, RedisTlsError> {
    super::install_provider();
    Ok(ClusterClientBuilder::new(urls)
        .certs(certificates(settings)?)
        .build()?)
}
