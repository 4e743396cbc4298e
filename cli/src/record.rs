//! The record table, on PostgreSQL or on MySQL and MariaDB (`--store`): `stuck`, `release`,
//! `mark-done`, `stats`, `purge`, and the record's part of `inspect`. The SQL is the
//! library's ([`PgRecordAdmin`], [`MysqlRecordAdmin`], [`Retention`]); each command is
//! written once, over [`Records`], which holds either store's admin.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use deadpool_postgres::{ManagerConfig, Pool, RecyclingMethod};
use oncely::mysql::sqlx::mysql::MySqlPoolOptions;
use oncely::mysql::sqlx::{self, Executor, MySqlConnection, MySqlPool, Row};
use oncely::postgres::Table;
use oncely::record::{
    MysqlRecordAdmin, MysqlRecordStore, PgRecordAdmin, PgRecordStore, RecordRow, RecordStats, RecordStatus,
    ResponseRow, Retention, RetentionPass, RetentionStore, StuckReport,
};
use serde::Serialize;

use crate::error::{CliError, Remote};
use crate::output::{self, Report, cut, rfc3339, when, when_opt};
use crate::{Globals, PurgeArgs, SettleArgs};

/// The store holding the record table (`--store`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Store {
    /// PostgreSQL at --database-url; --schema is the table's schema (default oncely).
    Postgres,
    /// MySQL 8 or MariaDB at --mysql-url; --schema is the table's database (default the
    /// URL's).
    Mysql,
}

/// The schema of the record table on PostgreSQL when `--schema` names none.
const DEFAULT_PG_SCHEMA: &str = "oncely";

/// The record table of `--store`, `--schema` and `--table`, with the service it is on.
pub(crate) struct Records {
    admin: Admin,
    /// The table as reports name it: `"schema"."table"`, or `` `database`.`table` ``.
    pub(crate) name: String,
    pub(crate) remote: Remote,
}

/// Either store's admin, with its pool (for the retention pass). Both admins have the same
/// methods with the same meaning; [`on_admin!`] calls one on whichever is here.
enum Admin {
    Postgres(PgRecordAdmin, Pool),
    Mysql(MysqlRecordAdmin, MySqlPool),
}

/// `$call`, awaited, on the admin `$records` holds, named `$admin`: one text for both
/// stores, which the compiler checks against each.
macro_rules! on_admin {
    ($records:expr, $admin:ident => $call:expr) => {
        match &$records.admin {
            Admin::Postgres($admin, _) => $call.await,
            Admin::Mysql($admin, _) => $call.await,
        }
    };
}

impl Records {
    /// A pool on the record table; it connects on first use, within `--timeout`.
    pub(crate) fn new(globals: &Globals) -> Result<Self, CliError> {
        match globals.store {
            Store::Postgres => Self::postgres(globals),
            Store::Mysql => Self::mysql(globals),
        }
    }

    fn postgres(globals: &Globals) -> Result<Self, CliError> {
        let schema = globals.schema.as_deref().unwrap_or(DEFAULT_PG_SCHEMA);
        let table = Table::new(schema, &globals.table)?;
        let remote = Remote::new("PostgreSQL", &globals.database_url, globals.timeout);
        let tls = globals.tls()?;
        let mut config = oncely::tls::postgres::config(&globals.database_url, &tls)
            .map_err(|error| remote.failed(error))?;
        config.connect_timeout(remote.backstop());
        // The server gives up when the tool does: a statement the tool stopped waiting for
        // (a count on a huge table, an update waiting on a consumer's row lock) must not go
        // on running, or commit after the tool reported a timeout.
        let millis = globals.timeout.as_millis();
        config.options(format!("-c statement_timeout={millis} -c lock_timeout={millis}"));
        let manager = oncely::tls::postgres::manager(
            config,
            &tls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        )?;
        let pool = Pool::builder(manager)
            .max_size(2)
            .build()
            .map_err(|error| remote.failed(error))?;
        Ok(Records {
            name: table.to_string(),
            admin: Admin::Postgres(PgRecordAdmin::new(pool.clone(), table), pool),
            remote,
        })
    }

    /// On MySQL a table lives in a database, which the connection names: `--schema` when
    /// given (validated as on PostgreSQL), else the one in `--mysql-url`.
    fn mysql(globals: &Globals) -> Result<Self, CliError> {
        let table = oncely::mysql::Table::new(globals.table.as_str())?;
        let remote = Remote::new("MySQL", &globals.mysql_url, globals.timeout);
        let options = oncely::tls::mysql::options(&globals.mysql_url, &globals.tls()?)
            .map_err(|error| remote.failed(error))?;
        let database = match &globals.schema {
            Some(schema) => oncely::mysql::Ident::new(schema.as_str())?.as_str().to_owned(),
            None => options.get_database().map(str::to_owned).ok_or_else(|| {
                remote.failed("no database: name it in --mysql-url (mysql://HOST/DATABASE) or with --schema")
            })?,
        };
        let timeout = globals.timeout;
        let pool = MySqlPoolOptions::new()
            .max_connections(2)
            // Connecting included.
            .acquire_timeout(remote.backstop())
            .after_connect(move |connection, _| Box::pin(bound_session(connection, timeout)))
            .connect_lazy_with(options.database(&database));
        Ok(Records {
            name: format!("`{database}`.{table}"),
            admin: Admin::Mysql(MysqlRecordAdmin::new(pool.clone(), table), pool),
            remote,
        })
    }

    /// `key`'s row, if it has one.
    pub(crate) async fn inspect(&self, key: &str) -> Result<Option<RecordRow>, CliError> {
        self.remote
            .call(async { on_admin!(self, admin => admin.inspect(key)) })
            .await
    }

    /// `key`'s stored HTTP response (oncely-http's, beside the table), if there is one.
    pub(crate) async fn response(&self, key: &str) -> Result<Option<ResponseRow>, CliError> {
        self.remote
            .call(async { on_admin!(self, admin => admin.response(key)) })
            .await
    }

    /// The keys HTTP routes recorded for `key` under a client's scope.
    pub(crate) async fn scoped_keys(&self, key: &str) -> Result<Vec<String>, CliError> {
        self.remote
            .call(async { on_admin!(self, admin => admin.scoped_keys(key)) })
            .await
    }

    /// `key`'s row, or [`CliError::NotFound`].
    async fn row(&self, key: &str) -> Result<RecordRow, CliError> {
        self.inspect(key)
            .await?
            .ok_or_else(|| CliError::NotFound(format!("no record of key {key:?} in {}", self.name)))
    }

    async fn stuck(&self, limit: usize) -> Result<StuckReport, CliError> {
        self.remote
            .call(async { on_admin!(self, admin => admin.stuck(limit)) })
            .await
    }

    /// `seen` settled as `action`, if it still is the row seen: true when it changed.
    async fn settle(&self, seen: &RecordRow, action: Settlement, force: bool) -> Result<bool, CliError> {
        self.remote
            .call(async {
                match action {
                    Settlement::Release => on_admin!(self, admin => admin.release(seen, force)),
                    Settlement::MarkDone => on_admin!(self, admin => admin.mark_done(seen, force)),
                }
            })
            .await
    }

    async fn stats(&self) -> Result<RecordStats, CliError> {
        self.remote
            .call(async { on_admin!(self, admin => admin.stats()) })
            .await
    }

    async fn purgeable(&self, age: Duration) -> Result<u64, CliError> {
        self.remote
            .call(async { on_admin!(self, admin => admin.purgeable(age)) })
            .await
    }

    async fn held_by_responses(&self, age: Duration) -> Result<u64, CliError> {
        self.remote
            .call(async { on_admin!(self, admin => admin.held_by_responses(age)) })
            .await
    }
}

/// Bounds every statement of a new MySQL session on the server, as `statement_timeout` and
/// `lock_timeout` do on PostgreSQL: a statement the tool stopped waiting for must not go on
/// running, or commit after the tool reported a timeout (closing the connection does not stop
/// it). MariaDB's `max_statement_time` (seconds) bounds every statement, lock waits
/// included; MySQL has no such variable (setting it fails), and its `max_execution_time`
/// (milliseconds) bounds read-only `SELECT`s only, so there the row-lock
/// (`innodb_lock_wait_timeout`) and metadata-lock (`lock_wait_timeout`) waits, whole
/// seconds, are what bound an `UPDATE` or a purge's `DELETE`. The server is told apart by
/// its version, one query per connection.
async fn bound_session(connection: &mut MySqlConnection, timeout: Duration) -> Result<(), sqlx::Error> {
    // `Executor`'s methods, not `query_scalar`'s: their futures are `Send` for every
    // lifetime, which `after_connect` needs.
    let version: String = connection.fetch_one("SELECT VERSION()").await?.try_get(0)?;
    // Zero would mean no limit.
    let statement = match version.contains("MariaDB") {
        true => format!("max_statement_time = {:.3}", timeout.as_secs_f64().max(0.001)),
        false => format!("max_execution_time = {}", timeout.as_millis().max(1)),
    };
    let lock_wait = (timeout.as_secs() + u64::from(timeout.subsec_nanos() > 0)).max(1);
    let set = format!(
        "SET SESSION {statement}, innodb_lock_wait_timeout = {lock_wait}, lock_wait_timeout = {lock_wait}"
    );
    connection.execute(set.as_str()).await?;
    Ok(())
}

/// A record row in a report.
#[derive(Debug, Serialize)]
pub(crate) struct RowView {
    key: String,
    status: &'static str,
    attempts: u32,
    last_error: Option<String>,
    fingerprint: String,
    fencing_token: Option<u64>,
    lease_until: Option<String>,
    created_at: String,
    updated_at: String,
    #[serde(skip)]
    row: RecordRow,
}

impl From<RecordRow> for RowView {
    fn from(row: RecordRow) -> Self {
        RowView {
            key: output::shown_key(&row.key),
            status: row.status.as_str(),
            attempts: row.attempts,
            last_error: row.last_error.clone(),
            fingerprint: row.fingerprint.to_string(),
            fencing_token: row.fencing_token,
            lease_until: row.lease_until.map(rfc3339),
            created_at: rfc3339(row.created_at),
            updated_at: rfc3339(row.updated_at),
            row,
        }
    }
}

impl RowView {
    /// The row's fields, one per line, for `inspect`.
    pub(crate) fn fields(&self) -> Vec<(&'static str, String)> {
        let row = &self.row;
        vec![
            ("status", self.status.to_owned()),
            ("attempts", row.attempts.to_string()),
            ("last error", row.last_error.clone().unwrap_or_else(|| "-".into())),
            ("fingerprint", self.fingerprint.clone()),
            (
                "fencing token",
                row.fencing_token.map_or("-".into(), |token| token.to_string()),
            ),
            ("lease until", when_opt(row.lease_until)),
            ("first seen", when(row.created_at)),
            ("updated", when(row.updated_at)),
        ]
    }
}

/// `stuck`'s report.
#[derive(Debug, Serialize)]
struct StuckView {
    table: String,
    total: u64,
    rows: Vec<RowView>,
}

impl Report for StuckView {
    fn human(&self) -> String {
        if self.total == 0 {
            return format!("no PROCESSING row past its lease in {}", self.table);
        }
        let mut table = output::table(&["key", "attempts", "lease ran out", "first seen", "last error"]);
        for view in &self.rows {
            let row = &view.row;
            table.add_row([
                view.key.clone(),
                row.attempts.to_string(),
                when_opt(row.lease_until),
                when(row.created_at),
                cut(row.last_error.as_deref().unwrap_or("-"), 60),
            ]);
        }
        format!(
            "{table}\n{} of {} PROCESSING rows past their lease in {}, oldest lease first",
            self.rows.len(),
            self.total,
            self.table
        )
    }
}

/// `oncely stuck`.
pub(crate) async fn stuck(globals: &Globals, limit: usize) -> Result<(), CliError> {
    let records = Records::new(globals)?;
    let StuckReport { total, rows, .. } = records.stuck(limit).await?;
    let view = StuckView {
        table: records.name.clone(),
        total,
        rows: rows.into_iter().map(RowView::from).collect(),
    };
    output::print(&view, globals.json)
}

/// What an operator settles a stuck key as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Settlement {
    /// `release`: `PROCESSING` → `FAILURE`, run again by the next delivery.
    Release,
    /// `mark-done`: `PROCESSING` or `FAILURE` → `SUCCESS`, later deliveries are duplicates.
    MarkDone,
}

impl Settlement {
    fn name(self) -> &'static str {
        match self {
            Settlement::Release => "release",
            Settlement::MarkDone => "mark-done",
        }
    }

    fn target(self) -> RecordStatus {
        match self {
            Settlement::Release => RecordStatus::Failure,
            Settlement::MarkDone => RecordStatus::Success,
        }
    }
}

/// `release` and `mark-done`'s report.
#[derive(Debug, Serialize)]
struct SettledView {
    key: String,
    action: &'static str,
    from: &'static str,
    to: &'static str,
    changed: bool,
}

impl Report for SettledView {
    fn human(&self) -> String {
        match self.changed {
            true => format!("{}: {} → {}", self.key, self.from, self.to),
            false if self.from == "FAILURE" => format!(
                "{}: already FAILURE, which its next delivery takes over; nothing to do",
                self.key
            ),
            false => format!("{}: already {}, nothing to do", self.key, self.from),
        }
    }
}

/// `oncely release` and `oncely mark-done`: checks the row's state, asks, then changes it
/// only if it is still in that state.
pub(crate) async fn settle(globals: &Globals, args: &SettleArgs, action: Settlement) -> Result<(), CliError> {
    let records = Records::new(globals)?;
    let key = args.key.as_str();
    let row = records.row(key).await?;
    let mut view = SettledView {
        key: key.to_owned(),
        action: action.name(),
        from: row.status.as_str(),
        to: action.target().as_str(),
        changed: false,
    };
    if row.status == action.target() {
        // Asking for what is already so is not an error: a script may run twice.
        return output::print(&view, globals.json);
    }
    check_applies(&row, action, args.force)?;
    let lease = row
        .lease_until
        .map_or(String::new(), |lease| format!(", lease {}", when(lease)));
    let question = format!(
        "{} {key:?} ({}, attempt {}{lease}) → {}?",
        action.name(),
        row.status,
        row.attempts,
        action.target()
    );
    output::confirm(question, args.yes).await?;
    view.changed = records.settle(&row, action, args.force).await?;
    if !view.changed {
        return Err(CliError::Refused(format!(
            "key {key:?} changed while you confirmed (a delivery took it over, or its lease was renewed); \
             nothing was changed: look again with `oncely inspect`"
        )));
    }
    output::print(&view, globals.json)
}

/// Refuses an action on a row it does not apply to, or on an attempt that may still run.
fn check_applies(row: &RecordRow, action: Settlement, force: bool) -> Result<(), CliError> {
    if action == Settlement::Release && row.status != RecordStatus::Processing {
        return Err(CliError::Refused(format!(
            "key {:?} is {}: release applies to PROCESSING rows only",
            row.key, row.status
        )));
    }
    match row.lease_until {
        Some(lease) if lease > SystemTime::now() && !force => Err(CliError::Refused(format!(
            "key {:?} is PROCESSING with its lease running until {}: its attempt may still be running; \
             wait until it shows in `oncely stuck`, or pass --force",
            row.key,
            when(lease)
        ))),
        _ => Ok(()),
    }
}

/// `stats`' report.
#[derive(Debug, Serialize)]
struct StatsView {
    table: String,
    processing: u64,
    stuck: u64,
    success: u64,
    failure: u64,
    oldest_processing_created_at: Option<String>,
    oldest_processing_lease_until: Option<String>,
    table_bytes: u64,
    retention_horizon: Option<String>,
    #[serde(skip)]
    stats: RecordStats,
}

impl Report for StatsView {
    fn human(&self) -> String {
        let stats = &self.stats;
        let table = output::fields([
            (
                "PROCESSING",
                format!("{} ({} past their lease)", stats.processing, stats.stuck),
            ),
            ("SUCCESS", stats.success.to_string()),
            ("FAILURE", stats.failure.to_string()),
            ("oldest PROCESSING", when_opt(stats.oldest_processing_created_at)),
            ("earliest lease", when_opt(stats.oldest_processing_lease_until)),
            ("table size", bytes(stats.table_bytes)),
            ("retention horizon", when_opt(stats.oldest_success_updated_at)),
        ]);
        format!("{}\n{table}", self.table)
    }
}

/// `bytes` in binary units, for people.
fn bytes(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < units.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    match unit {
        0 => format!("{bytes} B"),
        _ => format!("{value:.1} {}", units[unit]),
    }
}

/// `oncely stats`.
pub(crate) async fn stats(globals: &Globals) -> Result<(), CliError> {
    let records = Records::new(globals)?;
    let stats = records.stats().await?;
    let view = StatsView {
        table: records.name.clone(),
        processing: stats.processing,
        stuck: stats.stuck,
        success: stats.success,
        failure: stats.failure,
        oldest_processing_created_at: stats.oldest_processing_created_at.map(rfc3339),
        oldest_processing_lease_until: stats.oldest_processing_lease_until.map(rfc3339),
        table_bytes: stats.table_bytes,
        retention_horizon: stats.oldest_success_updated_at.map(rfc3339),
        stats,
    };
    output::print(&view, globals.json)
}

/// `purge`'s report.
#[derive(Debug, Serialize)]
struct PurgedView {
    table: String,
    older_than_ms: u64,
    rows: u64,
    batches: u64,
    seconds: f64,
    /// Rows as old, kept because their stored responses (oncely-http's) still live: each
    /// goes with its response once that expired.
    kept_for_responses: u64,
}

impl Report for PurgedView {
    fn human(&self) -> String {
        let mut report = format!(
            "purged {} SUCCESS rows older than {} from {} in {} batches, {:.1} s",
            self.rows,
            output::duration(Duration::from_millis(self.older_than_ms)),
            self.table,
            self.batches,
            self.seconds
        );
        if self.kept_for_responses > 0 {
            report.push_str(&format!(
                "; kept {} whose stored responses still live (each goes with its response once that expired)",
                self.kept_for_responses
            ));
        }
        report
    }
}

/// The youngest age `purge` takes without `--force`. The RabbitMQ runner's default retry
/// ladder alone takes about 25 minutes, RocketMQ's almost 5 hours, and dead letters wait
/// for an operator: an age under a day is a typo far more often than a choice.
const YOUNGEST_UNFORCED_PURGE: Duration = Duration::from_secs(24 * 3600);

/// `oncely purge`: counts, asks, then runs one pass of the library's [`Retention`], which
/// takes the table's retention lock first (exit 4 when another runner holds it).
pub(crate) async fn purge(globals: &Globals, args: &PurgeArgs) -> Result<(), CliError> {
    let records = Records::new(globals)?;
    let table = &records.name;
    let age = args.older_than;
    if age < YOUNGEST_UNFORCED_PURGE && !args.force {
        return Err(CliError::Refused(format!(
            "--older-than {} is under a day: a purged key is new again, so copies still on their way \
             (retries, dead letters not replayed yet) would apply their effect again; keep the retention \
             above the retry ladder plus the replay window (README, \"The record's retention\"), or pass \
             --force",
            output::duration(age)
        )));
    }
    let purgeable = records.purgeable(age).await?;
    let kept_for_responses = records.held_by_responses(age).await?;
    let mut view = PurgedView {
        table: table.clone(),
        older_than_ms: u64::try_from(age.as_millis()).unwrap_or(u64::MAX),
        rows: 0,
        batches: 0,
        seconds: 0.0,
        kept_for_responses,
    };
    if purgeable == 0 {
        return output::print(&view, globals.json);
    }
    let question = format!(
        "purge {purgeable} SUCCESS rows of {table} not updated for {}?",
        output::duration(age)
    );
    output::confirm(question, args.yes).await?;
    let bar = output::progress(purgeable, "purging", globals.json);
    let pass = match &records.admin {
        Admin::Postgres(admin, pool) => {
            let store = PgRecordStore::new(pool.clone(), admin.table().clone());
            run_watched(store, args, &bar, &records.remote).await
        }
        Admin::Mysql(admin, pool) => {
            let store = MysqlRecordStore::new(pool.clone(), admin.table().clone());
            run_watched(store, args, &bar, &records.remote).await
        }
    };
    bar.finish_and_clear();
    match pass? {
        RetentionPass::Busy => Err(CliError::Busy),
        RetentionPass::Purged {
            rows,
            batches,
            elapsed,
            ..
        } => {
            (view.rows, view.batches, view.seconds) = (rows, batches, elapsed.as_secs_f64());
            output::print(&view, globals.json)
        }
        // A pass of a kind this tool does not know yet: report it as it describes itself.
        other => Err(CliError::Incomplete(other.to_string())),
    }
}

/// One retention pass on `store` as `args` ask, given up when no batch completes within the
/// timeout: a database that stops answering ends the command instead of hanging it. The
/// whole pass has no limit (a large table takes many batches). Dropping the pass closes its
/// session, which lets the retention lock go.
async fn run_watched(
    store: impl RetentionStore,
    args: &PurgeArgs,
    bar: &indicatif::ProgressBar,
    remote: &Remote,
) -> Result<RetentionPass, CliError> {
    let mut retention = Retention::new(store, args.older_than);
    if let Some(rows) = args.batch_rows {
        retention = retention.with_batch_rows(rows);
    }
    let last_batch = Arc::new(Mutex::new(Instant::now()));
    let pass = {
        let last_batch = last_batch.clone();
        let bar = bar.clone();
        retention.run_once_with_progress(move |rows| {
            bar.inc(rows);
            *last_batch.lock().expect("never poisoned") = Instant::now();
        })
    };
    let watchdog = async {
        loop {
            tokio::time::sleep(remote.timeout / 4).await;
            if last_batch.lock().expect("never poisoned").elapsed() > remote.timeout {
                return;
            }
        }
    };
    tokio::select! {
        pass = pass => pass.map_err(|error| remote.failed(error)),
        () = watchdog => Err(CliError::Timeout {
            service: remote.service,
            url: remote.url.clone(),
            timeout: remote.timeout,
        }),
    }
}
