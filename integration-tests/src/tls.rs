//! The TLS listeners `services.sh tls` starts beside the plain ones (see `tls.sh`), and the
//! settings that reach them: the throwaway CA, the client certificate, and a CA that signed
//! nothing here.

use std::path::PathBuf;

use oncely::tls::TlsSettings;

/// The directory of the throwaway CA and certificates: `ONCELY_TLS_DIR`, or
/// `~/.cache/oncely/tls` (`ONCELY_CACHE/tls`).
pub fn tls_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("ONCELY_TLS_DIR") {
        return dir.into();
    }
    let cache = std::env::var_os("ONCELY_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cache/oncely")
        });
    cache.join("tls")
}

/// Trusts the throwaway CA and presents the client certificate.
pub fn settings() -> TlsSettings {
    let dir = tls_dir();
    assert!(
        dir.join("ca.pem").exists(),
        "no test CA in {}; run integration-tests/services.sh tls",
        dir.display()
    );
    TlsSettings::default()
        .with_ca_cert(dir.join("ca.pem"))
        .with_client_cert(dir.join("client.pem"), dir.join("client.key"))
}

/// Trusts only a CA that signed none of the listeners' certificates, and presents the
/// client certificate.
pub fn another_ca() -> TlsSettings {
    let dir = tls_dir();
    TlsSettings::default()
        .with_ca_cert(dir.join("other-ca.pem"))
        .with_client_cert(dir.join("client.pem"), dir.join("client.key"))
}

/// Trusts the throwaway CA, without a client certificate.
pub fn without_client_cert() -> TlsSettings {
    TlsSettings::default().with_ca_cert(tls_dir().join("ca.pem"))
}

/// The Redis TLS listener: `REDIS_TLS_URL`, or `rediss://127.0.0.1:6380` (asks for a client
/// certificate).
pub fn redis_tls_url() -> String {
    std::env::var("REDIS_TLS_URL").unwrap_or_else(|_| "rediss://127.0.0.1:6380".into())
}

/// PostgreSQL over TLS: `DATABASE_TLS_URL`, or the test database with `sslmode=require`.
pub fn database_tls_url() -> String {
    std::env::var("DATABASE_TLS_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test?sslmode=require".into())
}

/// MariaDB over TLS: `MYSQL_TLS_URL`, or the test server with `ssl-mode=VERIFY_IDENTITY`.
pub fn mysql_tls_url() -> String {
    std::env::var("MYSQL_TLS_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test?ssl-mode=VERIFY_IDENTITY".into())
}

/// RabbitMQ's TLS listener: `AMQP_TLS_ADDR`, or `amqps://guest:guest@127.0.0.1:5671/%2f`
/// (asks for a client certificate).
pub fn amqp_tls_addr() -> String {
    std::env::var("AMQP_TLS_ADDR").unwrap_or_else(|_| "amqps://guest:guest@127.0.0.1:5671/%2f".into())
}
