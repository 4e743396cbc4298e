//! TLS to the stores, with one set of settings for every service: the certificate
//! authorities to trust, and a client certificate where a server asks for one (mutual TLS).
//!
//! oncely connects with [rustls](https://docs.rs/rustls) on its default cryptography
//! provider, aws-lc-rs: no OpenSSL to install or keep patched on the hosts, the same
//! verification on every platform, and the provider the RocketMQ client and most of the
//! ecosystem already build. A certificate is always verified — its chain up to a trusted
//! authority, and the server's name (or IP address) — whatever the URL's mode says
//! (`sslmode=require` verifies as `verify-full` does); there is no switch to skip it. The
//! exceptions are MySQL's: `PREFERRED` and `REQUIRED` without settings encrypt without
//! verifying, and `VERIFY_CA` verifies the chain without the host name, as MySQL's own
//! clients do.
//!
//! What each service takes:
//!
//! | service | URL | with these settings |
//! |---|---|---|
//! | PostgreSQL | `sslmode=require` (or `verify-ca`, `verify-full`) | [`postgres::config`], then [`postgres::manager`] or [`postgres::connector`] |
//! | MySQL, MariaDB | `ssl-mode=REQUIRED`, `VERIFY_CA` or `VERIFY_IDENTITY` | [`mysql::options`] |
//! | Redis (single node, cluster) | `rediss://` | [`redis::client`], [`redis::cluster_client`] |
//! | RabbitMQ | `amqps://` | `oncely_amqp::tls` (feature `tls` of oncely-amqp) |
//!
//! Limits: a URL whose mode asks for no TLS (`sslmode=disable`, `ssl-mode=DISABLED`,
//! `redis://`, `amqp://`) connects in plain text whatever these settings say. The drivers'
//! default modes are weaker than *required*: PostgreSQL's `prefer` connects in plain text
//! through [`postgres::manager`], and MySQL's `PREFERRED` encrypts when the server offers
//! it without verifying the certificate. [`postgres::config`] and [`mysql::options`] raise
//! those modes to *required and verified* once a CA or a client certificate is given, so
//! that settings for TLS never end in a silent plain-text connection.
//!
//! Whom each service trusts: PostgreSQL and Redis the given CA alone (else the platform's
//! authorities); RabbitMQ the given CA beside the platform's (lapin adds it); MySQL the
//! given CA beside Mozilla's authorities (sqlx's `webpki-roots`), never the platform's.
//! Encrypted private keys are not read: give the key in PKCS#8, PKCS#1 or SEC1 PEM without
//! a passphrase.

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The environment variable naming the PEM file of the authorities to trust
/// ([`TlsSettings::from_env`]).
pub const CA_CERT_ENV: &str = "ONCELY_CA_CERT";
/// The environment variable naming the PEM file of the client certificate (its chain).
pub const CLIENT_CERT_ENV: &str = "ONCELY_TLS_CERT";
/// The environment variable naming the PEM file of the client certificate's private key.
pub const CLIENT_KEY_ENV: &str = "ONCELY_TLS_KEY";

/// Why TLS settings could not be used. Each names the file at fault; none is a network
/// error (a refused certificate is the driver's error, on connecting).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file holds no PEM certificate, or one that cannot be parsed.
    #[error("{path} holds no readable PEM certificate{}", reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default())]
    NoCertificate {
        /// The file.
        path: PathBuf,
        /// What the parser said, if it said anything.
        reason: Option<String>,
    },
    /// A file holds no PEM private key oncely can read (encrypted keys are not read).
    #[error("{path} holds no unencrypted PEM private key (PKCS#8, PKCS#1 or SEC1): {reason}")]
    NoPrivateKey {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        reason: String,
    },
    /// A client certificate was given without its key, or a key without its certificate.
    #[error(
        "a client certificate needs both its certificate and its key ({CLIENT_CERT_ENV}, {CLIENT_KEY_ENV})"
    )]
    HalfAnIdentity,
    /// rustls refused the certificates or the key (a key that does not match its
    /// certificate, an authority it cannot use).
    #[error("the TLS settings were refused: {0}")]
    Refused(#[from] rustls::Error),
    /// No authority to trust: none was given, and the platform's store is empty or
    /// unreadable.
    #[error(
        "no certificate authority to trust: give one (--ca-cert, {CA_CERT_ENV}), or install the platform's ({0})"
    )]
    NoTrustedAuthority(String),
}

/// A client certificate's and its key's PEM text.
pub type ClientPem = (Vec<u8>, Vec<u8>);

/// The authorities to trust and the client certificate to present, for every service oncely
/// connects to. `Default` trusts the platform's authorities and presents no certificate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsSettings {
    ca_cert: Option<PathBuf>,
    client: Option<(PathBuf, PathBuf)>,
}

impl TlsSettings {
    /// Trusts the authorities in the PEM file `path` (one or several certificates; a
    /// managed service's CA bundle, a company's private CA): on PostgreSQL and Redis
    /// instead of the platform's, on RabbitMQ beside them, on MySQL beside Mozilla's (see
    /// the module's limits).
    pub fn with_ca_cert(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_cert = Some(path.into());
        self
    }

    /// Presents the client certificate in the PEM file `cert` (the certificate first, then
    /// any intermediates) with its unencrypted private key in `key`, to servers that ask
    /// for one.
    pub fn with_client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.client = Some((cert.into(), key.into()));
        self
    }

    /// The settings named by [`CA_CERT_ENV`], [`CLIENT_CERT_ENV`] and [`CLIENT_KEY_ENV`];
    /// unset or empty ones are not given. A certificate without its key (or a key without
    /// its certificate) is [`TlsError::HalfAnIdentity`].
    pub fn from_env() -> Result<Self, TlsError> {
        let var = |name| std::env::var_os(name).filter(|value| !value.is_empty());
        Self::from_paths(
            var(CA_CERT_ENV).map(PathBuf::from),
            var(CLIENT_CERT_ENV).map(PathBuf::from),
            var(CLIENT_KEY_ENV).map(PathBuf::from),
        )
    }

    /// The settings of these paths, each optional, as a command line takes them: a client
    /// certificate needs both `client_cert` and `client_key`.
    pub fn from_paths(
        ca_cert: Option<PathBuf>,
        client_cert: Option<PathBuf>,
        client_key: Option<PathBuf>,
    ) -> Result<Self, TlsError> {
        let client = match (client_cert, client_key) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            _ => return Err(TlsError::HalfAnIdentity),
        };
        Ok(TlsSettings { ca_cert, client })
    }

    /// The PEM file of the authorities to trust, when one is given.
    pub fn ca_cert(&self) -> Option<&Path> {
        self.ca_cert.as_deref()
    }

    /// The PEM files of the client certificate and its key, when given.
    pub fn client_cert(&self) -> Option<(&Path, &Path)> {
        self.client
            .as_ref()
            .map(|(cert, key)| (cert.as_path(), key.as_path()))
    }

    /// Whether anything is given beyond the defaults: a URL's "TLS if offered" mode is then
    /// raised to "TLS required".
    pub fn is_given(&self) -> bool {
        self.ca_cert.is_some() || self.client.is_some()
    }

    /// A rustls client configuration of these settings, on aws-lc-rs: the given authorities
    /// or the platform's, and the client certificate if given.
    pub fn client_config(&self) -> Result<rustls::ClientConfig, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        match &self.ca_cert {
            Some(path) => {
                for certificate in read_certificates(path)? {
                    roots.add(certificate)?;
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                let (added, _) = roots.add_parsable_certificates(found.certs);
                if added == 0 {
                    let errors: Vec<String> = found.errors.iter().map(ToString::to_string).collect();
                    return Err(TlsError::NoTrustedAuthority(match errors.is_empty() {
                        true => "the platform's store is empty".into(),
                        false => errors.join("; "),
                    }));
                }
            }
        }
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots);
        Ok(match &self.client {
            Some((cert, key)) => builder.with_client_auth_cert(read_certificates(cert)?, read_key(key)?)?,
            None => builder.with_no_client_auth(),
        })
    }

    /// The given authorities' PEM text, read now and checked to hold at least one
    /// certificate, for drivers that take PEM themselves.
    pub fn ca_pem(&self) -> Result<Option<Vec<u8>>, TlsError> {
        let Some(path) = self.ca_cert.as_deref() else {
            return Ok(None);
        };
        read_certificates(path)?;
        read(path).map(Some)
    }

    /// Reads every file given, as a connection would: a missing or unreadable file is found
    /// now, as the settings' fault, rather than at a connection as the service's.
    pub fn check(&self) -> Result<(), TlsError> {
        if let Some(path) = &self.ca_cert {
            read_certificates(path)?;
        }
        if let Some((cert, key)) = &self.client {
            read_certificates(cert)?;
            read_key(key)?;
        }
        Ok(())
    }

    /// The client certificate's and key's PEM text, read now.
    pub fn client_pem(&self) -> Result<Option<ClientPem>, TlsError> {
        (self.client.as_ref())
            .map(|(cert, key)| Ok((read(cert)?, read(key)?)))
            .transpose()
    }
}

/// Installs aws-lc-rs as the process's rustls provider, unless one is installed already:
/// redis-rs builds its own rustls configuration from the process's provider, and finds
/// none when two providers are compiled in (another crate enabling `ring`).
#[cfg(feature = "redis")]
pub(crate) fn install_provider() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let no_certificate = |reason: Option<String>| TlsError::NoCertificate {
        path: path.to_owned(),
        reason,
    };
    let certificates = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| no_certificate(Some(error.to_string())))?;
    match certificates.is_empty() {
        true => Err(no_certificate(None)),
        false => Ok(certificates),
    }
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|error| TlsError::NoPrivateKey {
        path: path.to_owned(),
        reason: error.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_certificate_needs_its_key_and_the_key_its_certificate() {
        let half = TlsSettings::from_paths(None, Some("c.pem".into()), None);
        assert!(matches!(half, Err(TlsError::HalfAnIdentity)));
        let half = TlsSettings::from_paths(None, None, Some("k.pem".into()));
        assert!(matches!(half, Err(TlsError::HalfAnIdentity)));
        let none = TlsSettings::from_paths(None, None, None).expect("nothing given");
        assert!(!none.is_given());
    }

    #[test]
    fn a_file_without_a_certificate_is_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("oncely-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").expect("write");
        let error = TlsSettings::default()
            .with_ca_cert(&empty)
            .client_config()
            .unwrap_err();
        assert!(
            matches!(&error, TlsError::NoCertificate { path, .. } if *path == empty),
            "{error}"
        );
        let missing = dir.join("missing.pem");
        let error = TlsSettings::default()
            .with_ca_cert(&missing)
            .client_config()
            .unwrap_err();
        assert!(error.to_string().contains("missing.pem"), "{error}");
    }
}
