//! Ending the server sessions of abandoned transactions, with a bounded number of
//! connections: one per layer.
//!
//! Why a session must be killed: a transaction abandoned mid-statement (a copy of a key
//! waiting on its row lock whose client hung up, a handler cut off by a timeout) leaves its
//! server thread running that statement; closing the socket is noticed only when the
//! statement ends — for a lock wait, when the lock is granted or `innodb_lock_wait_timeout`
//! (50 s) runs out. Until then the server keeps the thread and its locks, and the pool,
//! which has already let the slot go, opens a new connection in its place. MySQL has no
//! out-of-band cancel (PostgreSQL's `CancelRequest`): only a `KILL` from another session ends
//! it at once.
//!
//! Why bounded: a connection of its own per `KILL` let 500 abandoned copies open 500
//! connections at once. Here one connection per layer sends every `KILL`, one after another
//! (each a fraction of a millisecond), and the abandoned connection keeps its pool slot until
//! its session is killed — so the pool cannot open a new connection beside a zombie, and the
//! server sees at most the pool's connections plus this one.

use std::sync::OnceLock;
use std::time::Duration;

use sqlx::mysql::MySqlConnectOptions;
use sqlx::pool::PoolConnection;
use sqlx::{ConnectOptions, Connection, Executor, MySql, MySqlConnection, MySqlPool};
use tokio::sync::mpsc;

/// How long the killer's connection stays open with nothing to kill.
const IDLE: Duration = Duration::from_secs(30);

/// Kills the server sessions of abandoned transactions, from one connection of its own,
/// made on the first kill and closed after [`IDLE`].
#[derive(Debug)]
pub(crate) struct Killer {
    options: MySqlConnectOptions,
    queue: OnceLock<mpsc::UnboundedSender<Doomed>>,
}

/// A session to kill, and the pool slot of its connection, held until it is killed.
struct Doomed {
    session: u64,
    _slot: Option<PoolConnection<MySql>>,
}

impl Killer {
    /// A killer that connects as `pool` does.
    pub(crate) fn new(pool: &MySqlPool) -> Self {
        Killer {
            options: (*pool.connect_options()).clone(),
            queue: OnceLock::new(),
        }
    }

    /// Kills the server session `session`, soon, on the killer's connection; `slot`, its
    /// connection (already marked to close), goes back to the pool once that is done.
    /// Without a Tokio runtime (a drop at shutdown) the slot is let go at once, and the
    /// server ends the session when its statement ends.
    pub(crate) fn kill(&self, session: u64, mut slot: Option<PoolConnection<MySql>>) {
        if let Some(connection) = slot.as_mut() {
            connection.close_on_drop();
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let queue = self.queue.get_or_init(|| {
            let (queue, doomed) = mpsc::unbounded_channel();
            runtime.spawn(kill_all(self.options.clone(), doomed));
            queue
        });
        // The receiver lives as long as the killer: this fails only if its task died with
        // its runtime, and then there is nothing to kill from.
        let _ = queue.send(Doomed { session, _slot: slot });
    }
}

/// Kills each doomed session in turn, on one connection, until every sender is gone.
async fn kill_all(options: MySqlConnectOptions, mut doomed: mpsc::UnboundedReceiver<Doomed>) {
    let mut connection: Option<MySqlConnection> = None;
    loop {
        let next = match connection {
            Some(_) => match tokio::time::timeout(IDLE, doomed.recv()).await {
                Ok(next) => next,
                Err(_) => {
                    if let Some(idle) = connection.take() {
                        let _ = idle.close().await;
                    }
                    continue;
                }
            },
            None => doomed.recv().await,
        };
        let Some(next) = next else {
            return;
        };
        // Once more on a fresh connection if the old one broke.
        for _ in 0..2 {
            if connection.is_none() {
                connection = options.connect().await.ok();
            }
            let Some(killer) = connection.as_mut() else {
                break;
            };
            match killer
                .execute(sqlx::raw_sql(&format!("KILL {}", next.session)))
                .await
            {
                Ok(_) => break,
                // 1094, "unknown thread": it is gone already.
                Err(sqlx::Error::Database(_)) => break,
                Err(_) => connection = None,
            }
        }
        // Its slot goes back to the pool only now.
        drop(next);
    }
}
