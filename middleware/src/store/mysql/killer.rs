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
//!
//! Why the server is checked: a session id is a number per server run. After a failover (a
//! new primary behind the same address, another Galera node behind a load balancer) the
//! killer's new connection reaches another server, and after a restart the same server
//! counts its sessions from 1 again: there the same number may be another consumer's
//! session. A `KILL` is sent only on a connection to the server the session was on
//! (`@@hostname:@@port`), started before the session was (its `Uptime`); a session on a
//! server no longer reached ends when its statement does. Limits: two servers given the
//! same host name and port (containers often are) are told apart only by their start; and
//! behind a load balancer that spreads connections over several servers the killer tries
//! two connections per session, so a session on a server neither reached ends when its
//! statement does.
//!
//! Why every step is timed: a killer connection that hangs (a half-open socket after a
//! failover, a dropped SYN) would hold every queued slot, and the pool would run dry.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqlx::mysql::MySqlConnectOptions;
use sqlx::pool::PoolConnection;
use sqlx::{ConnectOptions, Connection, Executor, MySql, MySqlConnection, MySqlPool, Row};
use tokio::sync::mpsc;

/// How long the killer's connection stays open with nothing to kill.
const IDLE: Duration = Duration::from_secs(30);

/// How long connecting, and each `KILL`, may take before the killer gives up its
/// connection and that session (see [`BACK_OFF`]).
const ANSWER: Duration = Duration::from_secs(5);

/// How long, after the server could not be reached or did not answer a `KILL`, the killer
/// lets doomed sessions go without trying again: while it is down each would otherwise hold
/// its slot for [`ANSWER`] in turn.
const BACK_OFF: Duration = Duration::from_secs(1);

/// The SQL expression naming the server a connection is on: host name and port, which
/// MySQL and MariaDB both have (MariaDB has no `@@server_uuid`; Galera nodes may share a
/// `@@server_id`).
pub(crate) const SERVER: &str = "CONCAT(CAST(@@hostname AS CHAR), ':', CAST(@@port AS CHAR))";

/// A server session: the server it is on ([`SERVER`]), its id there (`CONNECTION_ID()`), and
/// when it was known to be alive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Session {
    /// The server, as [`SERVER`] names it.
    pub(crate) server: String,
    /// `CONNECTION_ID()` on that server.
    pub(crate) id: u64,
    /// An instant at which the session already existed (taken before the statement that
    /// read its id): a server that started after it has a session of the same id only by
    /// chance.
    pub(crate) alive_at: Instant,
}

/// Kills the server sessions of abandoned transactions, from one connection of its own,
/// made on the first kill and closed after [`IDLE`].
#[derive(Debug)]
pub(crate) struct Killer {
    options: MySqlConnectOptions,
    /// The queue to the killing task; replaced when that task has ended (with the runtime
    /// it ran on).
    queue: Mutex<Option<mpsc::UnboundedSender<Doomed>>>,
}

/// A session to kill, and the pool slot of its connection, held until it is killed.
struct Doomed {
    session: Session,
    _slot: Option<PoolConnection<MySql>>,
}

impl Killer {
    /// A killer that connects as `pool` does.
    pub(crate) fn new(pool: &MySqlPool) -> Self {
        Killer {
            options: (*pool.connect_options()).clone(),
            queue: Mutex::new(None),
        }
    }

    /// Kills `session`, soon, on the killer's connection; `slot`, its connection (marked
    /// here to close), goes back to the pool once that is done or given up. Called within a
    /// Tokio runtime, as sqlx requires of every drop of a pooled connection; without one,
    /// nothing is killed.
    pub(crate) fn kill(&self, session: &Session, mut slot: Option<PoolConnection<MySql>>) {
        if let Some(connection) = slot.as_mut() {
            connection.close_on_drop();
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut doomed = Doomed {
            session: session.clone(),
            _slot: slot,
        };
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(sender) = queue.as_ref() {
            match sender.send(doomed) {
                Ok(()) => return,
                Err(mpsc::error::SendError(back)) => doomed = back,
            }
        }
        // The first kill, or the task ended with the runtime it ran on: a new one, here.
        let (sender, receiver) = mpsc::unbounded_channel();
        runtime.spawn(kill_all(self.options.clone(), receiver));
        let _ = sender.send(doomed);
        *queue = Some(sender);
    }
}

/// A connection of the killer's, and the server run it reached.
struct KillerConnection {
    connection: MySqlConnection,
    reached: ServerRun,
}

/// One run of one server, as a connection of the killer's found it.
#[derive(Debug)]
struct ServerRun {
    /// As [`SERVER`] names it.
    server: String,
    /// When the connection read the server's `Uptime`, and what it read.
    read_at: Instant,
    uptime: Duration,
}

impl ServerRun {
    /// Whether `session` was on this run: the same server, started before the session was
    /// alive. `Uptime` is in whole seconds (a start it places up to a second late), so a
    /// session of the run's first second is not taken for its own — a `KILL` not sent
    /// costs a lock wait, one sent to a stranger costs its transaction.
    fn holds(&self, session: &Session) -> bool {
        self.server == session.server && self.read_at < session.alive_at + self.uptime
    }
}

/// Kills each doomed session in turn, on one connection, until every sender is gone.
async fn kill_all(options: MySqlConnectOptions, mut doomed: mpsc::UnboundedReceiver<Doomed>) {
    let mut killer: Option<KillerConnection> = None;
    let mut unreachable_until: Option<Instant> = None;
    loop {
        let next = match killer {
            Some(_) => match tokio::time::timeout(IDLE, doomed.recv()).await {
                Ok(next) => next,
                Err(_) => {
                    if let Some(idle) = killer.take() {
                        let _ = tokio::time::timeout(ANSWER, idle.connection.close()).await;
                    }
                    continue;
                }
            },
            None => doomed.recv().await,
        };
        let Some(next) = next else {
            return;
        };
        if unreachable_until.is_none_or(|until| Instant::now() >= until) {
            unreachable_until = None;
            if !kill_one(&options, &mut killer, &next.session).await {
                unreachable_until = Some(Instant::now() + BACK_OFF);
            }
        }
        // Its slot goes back to the pool only now.
        drop(next);
    }
}

/// Kills `session` on `killer`'s connection, or on a fresh one if that one broke, hung or
/// reached another server run; false when no connection could be made.
async fn kill_one(
    options: &MySqlConnectOptions,
    killer: &mut Option<KillerConnection>,
    session: &Session,
) -> bool {
    for _ in 0..2 {
        if killer.is_none() {
            *killer = connect(options).await;
        }
        let Some(connected) = killer.as_mut() else {
            return false;
        };
        if !connected.reached.holds(session) {
            tracing::debug!(session = session.id, server = %session.server, reached = ?connected.reached, "the killer reached another server run; connecting again");
            *killer = None;
            continue;
        }
        let kill = format!("KILL {}", session.id);
        match tokio::time::timeout(ANSWER, connected.connection.execute(sqlx::raw_sql(&kill))).await {
            // 1094, "unknown thread": it is gone already.
            Ok(Ok(_)) | Ok(Err(sqlx::Error::Database(_))) => return true,
            // The connection broke: once more, on a new one.
            Ok(Err(_)) => *killer = None,
            // No answer: taken as a server out of reach, so that each session queued behind
            // does not hold its slot through another wait.
            Err(_) => {
                *killer = None;
                return false;
            }
        }
    }
    tracing::warn!(
        session = session.id,
        server = %session.server,
        "an abandoned session is on a server run the killer no longer reaches; it ends when its statement does"
    );
    true
}

/// A new connection of the killer's and the server run it reached, within [`ANSWER`]; a
/// failure is logged, as no session is killed until a connection is made.
async fn connect(options: &MySqlConnectOptions) -> Option<KillerConnection> {
    let attempt = async {
        let mut connection = options.connect().await?;
        let server = sqlx::query_scalar(&format!("SELECT {SERVER}"))
            .fetch_one(&mut connection)
            .await?;
        // Text protocol: `SHOW` answers strings, and not every server prepares it.
        let status = connection
            .fetch_one(sqlx::raw_sql("SHOW GLOBAL STATUS LIKE 'Uptime'"))
            .await?;
        let uptime: String = status.try_get(1)?;
        let uptime = uptime
            .parse()
            .map_err(|_| sqlx::Error::Protocol(format!("an uptime that is not a number: {uptime}")))?;
        let reached = ServerRun {
            server,
            read_at: Instant::now(),
            uptime: Duration::from_secs(uptime),
        };
        Ok::<_, sqlx::Error>(KillerConnection { connection, reached })
    };
    match tokio::time::timeout(ANSWER, attempt).await {
        Ok(Ok(connected)) => Some(connected),
        Ok(Err(error)) => {
            tracing::warn!(%error, "the killer of abandoned sessions could not connect");
            None
        }
        Err(_) => {
            tracing::warn!("the killer of abandoned sessions could not connect within {ANSWER:?}");
            None
        }
    }
}

/// Against the server on `MYSQL_URL`: a session is killed only on the server run it lives on.
#[cfg(test)]
mod tests {
    use sqlx::mysql::MySqlPoolOptions;

    use super::*;

    async fn pool() -> MySqlPool {
        let url = std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
        MySqlPoolOptions::new()
            .max_connections(4)
            .connect(&url)
            .await
            .expect("MySQL or MariaDB on MYSQL_URL")
    }

    /// A connection of `pool`'s, kept by the caller, and its session.
    async fn victim(pool: &MySqlPool) -> (PoolConnection<MySql>, Session) {
        let mut connection = pool.acquire().await.unwrap();
        let alive_at = Instant::now();
        let (id, server) = sqlx::query_as(&format!("SELECT CAST(CONNECTION_ID() AS UNSIGNED), {SERVER}"))
            .fetch_one(&mut *connection)
            .await
            .unwrap();
        (connection, Session { server, id, alive_at })
    }

    /// Whether the server still has a session of this id, asked on a connection of `observer`
    /// (never a victim's).
    async fn alive(observer: &MySqlPool, session: &Session) -> bool {
        let found: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?")
                .bind(session.id)
                .fetch_one(observer)
                .await
                .unwrap();
        found == 1
    }

    /// Whether the session is gone within 5 s.
    async fn killed(observer: &MySqlPool, session: &Session) -> bool {
        for _ in 0..100 {
            if !alive(observer, session).await {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    #[tokio::test]
    async fn a_session_named_on_another_server_is_left_alone() {
        let (victims, observer) = (pool().await, pool().await);
        let killer = Killer::new(&victims);
        let (_spared, session) = victim(&victims).await;
        let elsewhere = Session {
            server: format!("elsewhere-{}", session.server),
            ..session.clone()
        };
        let (_doomed, checked) = victim(&victims).await;
        // In turn on one connection: once `checked` is gone, `elsewhere` had its turn.
        killer.kill(&elsewhere, None);
        killer.kill(&checked, None);
        assert!(
            killed(&observer, &checked).await,
            "the session on this server was not killed"
        );
        assert!(
            alive(&observer, &session).await,
            "a session named on another server was killed here"
        );
    }

    #[test]
    fn a_killer_outlives_the_runtime_of_its_first_kill() {
        let first = tokio::runtime::Runtime::new().unwrap();
        let killer = first.block_on(async {
            let (victims, observer) = (pool().await, pool().await);
            let killer = Killer::new(&victims);
            let (_doomed, session) = victim(&victims).await;
            killer.kill(&session, None);
            assert!(killed(&observer, &session).await);
            killer
        });
        drop(first);
        let second = tokio::runtime::Runtime::new().unwrap();
        second.block_on(async {
            let (victims, observer) = (pool().await, pool().await);
            let (_doomed, session) = victim(&victims).await;
            killer.kill(&session, None);
            assert!(
                killed(&observer, &session).await,
                "the killer's task ended with its first runtime, and nothing was killed after"
            );
        });
    }

    #[test]
    fn a_session_from_before_the_server_started_is_not_its_own() {
        let read_at = Instant::now();
        let run = ServerRun {
            server: "db:3306".into(),
            read_at,
            uptime: Duration::from_secs(60),
        };
        let session = |server: &str, seconds_before_the_read: u64| Session {
            server: server.into(),
            id: 7,
            alive_at: read_at - Duration::from_secs(seconds_before_the_read),
        };
        assert!(run.holds(&session("db:3306", 30)));
        assert!(
            !run.holds(&session("db:3306", 90)),
            "a session of the run before a restart"
        );
        assert!(
            !run.holds(&session("db:3306", 60)),
            "a session of the run's first second"
        );
        assert!(
            !run.holds(&session("other:3306", 30)),
            "a session on another server"
        );
    }
}
