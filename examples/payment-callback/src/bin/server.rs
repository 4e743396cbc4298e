//! Run with: `cargo run -p payment-callback --bin server` (Ctrl-C to stop); it listens on
//! `LISTEN_ADDR` (default `127.0.0.1:3000`), with the record on `DATABASE_URL` and the flag
//! on `REDIS_URL`.
//!
//! The payment-notification endpoint alone, for a provider (or `driver --url`) to call.

use payment_callback::{app, setting, setup};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (pool, records) = setup().await?;
    let address = setting("LISTEN_ADDR", "127.0.0.1:3000");
    let listener = tokio::net::TcpListener::bind(&address).await?;
    println!("listening on http://{address}/notify");
    axum::serve(listener, app(pool, records).await?).await?;
    Ok(())
}
