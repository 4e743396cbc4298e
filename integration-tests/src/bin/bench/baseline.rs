//! What the at-least-once consumer users run today does with a message: its business row,
//! written in a transaction of its own (one autocommitted `INSERT`, the cheapest way to
//! write it), before the ack.

use deadpool_postgres::Pool;
use oncely::mysql::sqlx::{self, MySqlPool};
use serde::Deserialize;

/// The row, as PostgreSQL takes it (prepared once per connection, as the stacks' handlers
/// prepare theirs).
const POSTGRES_INSERT: &str = "INSERT INTO stock_moves (order_id) VALUES ($1)";
/// The same on MySQL/MariaDB (sqlx prepares it once per connection).
const MYSQL_INSERT: &str = "INSERT INTO stock_moves (order_id) VALUES (?)";

/// A message's body as the at-least-once consumer reads it.
#[derive(Deserialize)]
struct Order<'a> {
    #[serde(rename = "orderId")]
    order_id: &'a str,
}

/// What a raw consumer does with each message before its ack.
#[derive(Clone)]
pub(crate) enum Writer {
    /// Nothing: the broker's and the client's cost alone.
    Nothing,
    /// The order's row on PostgreSQL.
    Postgres(Pool),
    /// The order's row on MySQL/MariaDB.
    Mysql(MySqlPool),
}

impl Writer {
    /// Writes the row of the order in `body`, if any; a failure panics (the bench's
    /// workloads never fail a write).
    pub(crate) async fn write(&self, body: &[u8]) {
        if let Writer::Nothing = self {
            return;
        }
        let order: Order<'_> = serde_json::from_slice(body).expect("an order's body");
        match self {
            Writer::Nothing => {}
            Writer::Postgres(pool) => {
                let client = pool.get().await.expect("a PostgreSQL connection");
                let insert = client.prepare_cached(POSTGRES_INSERT).await.expect("prepare");
                client
                    .execute(&insert, &[&order.order_id])
                    .await
                    .expect("the row");
            }
            Writer::Mysql(pool) => {
                sqlx::query(MYSQL_INSERT)
                    .bind(order.order_id)
                    .execute(pool)
                    .await
                    .expect("the row");
            }
        }
    }
}
