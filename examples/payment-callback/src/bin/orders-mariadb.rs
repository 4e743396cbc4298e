//! Run with: `cargo run -p payment-callback --bin orders-mariadb` (Ctrl-C to stop); it
//! listens on `LISTEN_ADDR` (default `127.0.0.1:3001`), with its tables in the database of
//! `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`) and API keys hashed under
//! `ONCELY_CLIENT_SECRET`; `ssl-mode=VERIFY_IDENTITY` in the URL connects over TLS, trusting
//! the CA in `ONCELY_CA_CERT`.
//!
//! The README's order API on MariaDB: `POST /orders` with an `Idempotency-Key` and an
//! `x-api-key`; the order, the record and the stored response commit together.

use oncely::mysql::{Table, migrate, sqlx};
use oncely_http::MysqlResponses;
use payment_callback::{orders_mariadb, setting};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = setting("MYSQL_URL", "mysql://root@127.0.0.1:3306/test");
    // Sized for the requests in flight at once: each holds a connection for its transaction.
    let options = oncely::tls::mysql::options(&url, &oncely::tls::TlsSettings::from_env()?)?;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(32)
        .connect_with(options)
        .await?;
    let records = Table::new("api_record")?;
    migrate(&pool, &records).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS api_orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, body TEXT NOT NULL) \
         ENGINE = InnoDB",
    )
    .execute(&pool)
    .await?;
    let secret = setting("ONCELY_CLIENT_SECRET", "a development secret, not for production");
    MysqlResponses::new(pool.clone(), &records)?.migrate().await?;
    let app = orders_mariadb::orders(pool, records, secret.as_bytes())?;
    let address = setting("LISTEN_ADDR", "127.0.0.1:3001");
    let listener = tokio::net::TcpListener::bind(&address).await?;
    println!("listening on http://{address}/orders");
    axum::serve(listener, app).await?;
    Ok(())
}
