//! PostgreSQL over TLS: the connector a `deadpool_postgres::Manager` (or a
//! `tokio_postgres::connect`) takes, and URLs with libpq's verifying modes.

use std::str::FromStr;

use deadpool_postgres::tokio_postgres::config::SslMode;
use deadpool_postgres::tokio_postgres::{Config, NoTls};
use deadpool_postgres::{Manager, ManagerConfig};
pub use tokio_postgres_rustls::MakeRustlsConnect;

use super::{TlsError, TlsSettings};

/// The TLS connector of `settings`, for `Manager::new(config, connector)` or
/// `tokio_postgres::connect`. The connection uses TLS as the URL's `sslmode` says (see
/// [`config`]); the certificate is always verified, host name included.
pub fn connector(settings: &TlsSettings) -> Result<MakeRustlsConnect, TlsError> {
    Ok(MakeRustlsConnect::new(settings.client_config()?))
}

/// A pool manager of `config` (see [`config`]): through [`connector`] when its mode
/// requires TLS, in plain text otherwise — `prefer` (the default without settings)
/// connects in plain text, as oncely did before TLS, rather than fail on a server whose
/// certificate nobody asked to trust (Debian's "snakeoil" one). Ask for `sslmode=require`
/// (or give settings, which [`config`] turns into it) for TLS.
pub fn manager(
    config: Config,
    settings: &TlsSettings,
    manager_config: ManagerConfig,
) -> Result<Manager, TlsError> {
    Ok(match config.get_ssl_mode() {
        SslMode::Require => Manager::from_config(config, connector(settings)?, manager_config),
        _ => Manager::from_config(config, NoTls, manager_config),
    })
}

/// Parses a PostgreSQL URL or key-value string as libpq users write it: `sslmode=verify-ca`
/// and `verify-full` (which tokio-postgres does not parse) mean TLS required, verified as
/// every mode is, host name included (stricter than libpq's `verify-ca`). When `settings`
/// give a CA or a client certificate, `prefer` — named or libpq's default — becomes
/// `require`: settings for TLS never end in a plain-text connection to a server that does
/// not offer it. `sslmode=disable` stays plain.
pub fn config(url: &str, settings: &TlsSettings) -> Result<Config, deadpool_postgres::tokio_postgres::Error> {
    let url = url
        .replace("sslmode=verify-full", "sslmode=require")
        .replace("sslmode=verify-ca", "sslmode=require");
    let mut config = Config::from_str(&url)?;
    if config.get_ssl_mode() == SslMode::Prefer && settings.is_given() {
        config.ssl_mode(SslMode::Require);
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verifying_modes_require_tls_and_settings_raise_the_default() {
        let plain = TlsSettings::default();
        let given = TlsSettings::default().with_ca_cert("ca.pem");
        let mode = |url: &str, settings: &TlsSettings| config(url, settings).expect("a URL").get_ssl_mode();
        let url = "postgres://u@db.example:5432/shop";
        assert_eq!(mode(url, &plain), SslMode::Prefer);
        assert_eq!(mode(url, &given), SslMode::Require);
        assert_eq!(
            mode(&format!("{url}?sslmode=verify-full"), &plain),
            SslMode::Require
        );
        assert_eq!(
            mode(&format!("{url}?sslmode=verify-ca"), &plain),
            SslMode::Require
        );
        assert_eq!(mode(&format!("{url}?sslmode=disable"), &given), SslMode::Disable);
        assert_eq!(mode(&format!("{url}?sslmode=prefer"), &given), SslMode::Require);
        assert_eq!(mode(&format!("{url}?sslmode=prefer"), &plain), SslMode::Prefer);
        assert_eq!(
            mode("host=db.example sslmode=verify-full", &plain),
            SslMode::Require
        );
    }
}
