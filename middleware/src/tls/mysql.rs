//! MySQL and MariaDB over TLS: sqlx's connect options with the settings' authorities and
//! client certificate.

use std::str::FromStr;

use sqlx::mysql::{MySqlConnectOptions, MySqlSslMode};

use super::TlsSettings;

/// The connect options of `url` (sqlx's MySQL URL: `ssl-mode=REQUIRED`, `VERIFY_CA`,
/// `VERIFY_IDENTITY`, …) with the CA and the client certificate of `settings`. When
/// `settings` give either, a mode weaker than verifying — none named (sqlx's default,
/// `PREFERRED`), `PREFERRED` or `REQUIRED` — becomes `VERIFY_IDENTITY` (MySQL's own
/// clients go to `VERIFY_CA` there): settings for TLS never end in a plain-text or
/// unverified connection. `DISABLED` stays plain.
///
/// Limits: without settings, sqlx's `PREFERRED` and `REQUIRED` encrypt without verifying
/// the certificate, as MySQL's clients do; `VERIFY_CA` verifies the chain but not the host
/// name, as MySQL defines it. The verifying modes trust the given CA beside Mozilla's
/// authorities (sqlx's `webpki-roots`), not the platform's. The files are read when a
/// connection is made, not here.
pub fn options(url: &str, settings: &TlsSettings) -> Result<MySqlConnectOptions, sqlx::Error> {
    let mut options = MySqlConnectOptions::from_str(url)?;
    let weaker_than_verifying = match options.get_ssl_mode() {
        MySqlSslMode::Preferred | MySqlSslMode::Required => true,
        MySqlSslMode::Disabled | MySqlSslMode::VerifyCa | MySqlSslMode::VerifyIdentity => false,
    };
    if let Some(ca) = settings.ca_cert() {
        options = options.ssl_ca(ca);
    }
    if let Some((cert, key)) = settings.client_cert() {
        options = options.ssl_client_cert(cert).ssl_client_key(key);
    }
    if weaker_than_verifying && settings.is_given() {
        options = options.ssl_mode(MySqlSslMode::VerifyIdentity);
    }
    Ok(options)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_settings_make_every_encrypting_mode_verify_and_leave_disabled_plain() {
        let given = TlsSettings::default().with_ca_cert("ca.pem");
        let mode = |url: &str, settings: &TlsSettings| {
            let options = options(url, settings).expect("a URL");
            format!("{:?}", options.get_ssl_mode())
        };
        let url = "mysql://u@db.example:3306/shop";
        assert_eq!(mode(url, &TlsSettings::default()), "Preferred");
        for named in [
            "",
            "?ssl-mode=PREFERRED",
            "?ssl-mode=REQUIRED",
            "?ssl-mode=required",
        ] {
            assert_eq!(
                mode(&format!("{url}{named}"), &given),
                "VerifyIdentity",
                "{named}"
            );
        }
        assert_eq!(mode(&format!("{url}?ssl-mode=VERIFY_CA"), &given), "VerifyCa");
        assert_eq!(mode(&format!("{url}?ssl-mode=DISABLED"), &given), "Disabled");
    }
}
