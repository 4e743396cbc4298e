//! The PostgreSQL record table: `stuck`, `release`, `mark-done`, `stats`, `purge`, and the
//! record's part of `inspect`. The SQL is the library's ([`PgRecordAdmin`], [`Retention`]).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use deadpool_postgres::tokio_postgres::{Config, NoTls};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use oncely::postgres::Table;
use oncely::record::{
    PgRecordAdmin, PgRecordStore, RecordRow, RecordStats, RecordStatus, Retention, RetentionPass, StuckReport,
};
use serde::Serialize;

use crate::error::{CliError, Remote};
use crate::output::{self, Report, cut, rfc3339, when, when_opt};
use crate::{Globals, PurgeArgs, SettleArgs};

/// The record table of `--database-url`, `--schema` and `--table`.
pub(crate) struct Records {
    pub(crate) admin: PgRecordAdmin,
    pool: Pool,
    pub(crate) remote: Remote,
}

impl Records {
    /// A pool on the record table; it connects on first use, within `--timeout`.
    pub(crate) fn new(globals: &Globals) -> Result<Self, CliError> {
        let table = Table::new(&globals.schema, &globals.table)?;
        let remote = Remote::new("PostgreSQL", &globals.database_url, globals.timeout);
        let mut config: Config = globals
            .database_url
            .parse()
            .map_err(|error| remote.failed(error))?;
        config.connect_timeout(globals.timeout);
        // The server gives up when the tool does: a statement the tool stopped waiting for
        // (a count on a huge table, an update waiting on a consumer's row lock) must not go
        // on running, or commit after the tool reported a timeout.
        let millis = globals.timeout.as_millis();
        config.options(format!("-c statement_timeout={millis} -c lock_timeout={millis}"));
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(2)
            .build()
            .map_err(|error| remote.failed(error))?;
        Ok(Records {
            admin: PgRecordAdmin::new(pool.clone(), table),
            pool,
            remote,
        })
    }

    /// `key`'s row, or [`CliError::NotFound`].
    async fn row(&self, key: &str) -> Result<RecordRow, CliError> {
        self.remote
            .call(self.admin.inspect(key))
            .await?
            .ok_or_else(|| CliError::NotFound(format!("no record of key {key:?} in {}", self.admin.table())))
    }
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
            key: row.key.clone(),
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
                row.key.clone(),
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
    let StuckReport { total, rows, .. } = records.remote.call(records.admin.stuck(limit)).await?;
    let view = StuckView {
        table: records.admin.table().to_string(),
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
    view.changed = match action {
        Settlement::Release => {
            records
                .remote
                .call(records.admin.release(&row, args.force))
                .await?
        }
        Settlement::MarkDone => {
            records
                .remote
                .call(records.admin.mark_done(&row, args.force))
                .await?
        }
    };
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
    let stats = records.remote.call(records.admin.stats()).await?;
    let view = StatsView {
        table: records.admin.table().to_string(),
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
}

impl Report for PurgedView {
    fn human(&self) -> String {
        format!(
            "purged {} SUCCESS rows older than {} from {} in {} batches, {:.1} s",
            self.rows,
            humantime::format_duration(Duration::from_millis(self.older_than_ms)),
            self.table,
            self.batches,
            self.seconds
        )
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
    let table = records.admin.table().clone();
    let age = args.older_than;
    if age < YOUNGEST_UNFORCED_PURGE && !args.force {
        return Err(CliError::Refused(format!(
            "--older-than {} is under a day: a purged key is new again, so copies still on their way \
             (retries, dead letters not replayed yet) would apply their effect again; keep the retention \
             above the retry ladder plus the replay window (README, \"The record's retention\"), or pass \
             --force",
            humantime::format_duration(age)
        )));
    }
    let purgeable = records.remote.call(records.admin.purgeable(age)).await?;
    let mut view = PurgedView {
        table: table.to_string(),
        older_than_ms: u64::try_from(age.as_millis()).unwrap_or(u64::MAX),
        rows: 0,
        batches: 0,
        seconds: 0.0,
    };
    if purgeable == 0 {
        return output::print(&view, globals.json);
    }
    let question = format!(
        "purge {purgeable} SUCCESS rows of {table} not updated for {}?",
        humantime::format_duration(age)
    );
    output::confirm(question, args.yes).await?;
    let mut retention = Retention::new(PgRecordStore::new(records.pool.clone(), table), age);
    if let Some(rows) = args.batch_rows {
        retention = retention.with_batch_rows(rows);
    }
    let bar = output::progress(purgeable, "purging", globals.json);
    let pass = run_watched(&retention, &bar, &records.remote).await;
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

/// One retention pass, given up when no batch completes within the timeout: a database
/// that stops answering ends the command instead of hanging it. The whole pass has no
/// limit (a large table takes many batches). Dropping the pass closes its session, which
/// lets the retention lock go.
async fn run_watched(
    retention: &Retention<PgRecordStore>,
    bar: &indicatif::ProgressBar,
    remote: &Remote,
) -> Result<RetentionPass, CliError> {
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
