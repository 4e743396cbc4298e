//! `oncely`: the operator's command line for oncely's stores and dead letters.
//!
//! - `inspect KEY [--entity E]`: the key's record row (PostgreSQL, or MySQL/MariaDB with
//!   `--store mysql`), flag marker (Redis) and, with `--entity`, the entity's lock and
//!   fencing counter, in one view;
//! - `stuck`: `PROCESSING` rows past their lease; `release KEY` / `mark-done KEY` settle one
//!   by hand after asking (`--yes` for scripts);
//! - `stats`: rows by status, oldest `PROCESSING`, table size, retention horizon;
//! - `purge --older-than DURATION`: one pass of the library's retention service;
//! - `dlq list|show|replay|purge --queue QUEUE | --topic TOPIC`: RabbitMQ's dead letters in
//!   `QUEUE.dlq`, or those of a RocketMQ dead-letter topic;
//! - `completions SHELL`: shell completions.
//!
//! Tables for people, `--json` for scripts. It reads the consumers' settings: `DATABASE_URL`
//! (or `MYSQL_URL` with `--store mysql`), `REDIS_URL`, `AMQP_ADDR`, `ROCKETMQ_NAMESRV`, and
//! for TLS `ONCELY_CA_CERT`, `ONCELY_TLS_CERT`, `ONCELY_TLS_KEY` (`--ca-cert`,
//! `--client-cert`, `--client-key`); schema, table and Redis prefix are flags. On MySQL `--schema` names the record table's
//! database (default: the one in `MYSQL_URL`), since a MySQL table lives in a database.
//!
//! # Exit codes
//!
//! | code | meaning |
//! |---|---|
//! | 0 | done (also: nothing to do, e.g. `mark-done` on a `SUCCESS` row) |
//! | 1 | error: a store or broker unreachable, failing or not answering within `--timeout`; a queue or topic that does not exist; a row not in a state the action applies to; an incomplete `inspect` (a store could not be read: what the others said is shown); dead letters `replay` left in place because they are not oncely's |
//! | 2 | usage: bad arguments (clap's), an invalid `--schema` or `--table`, TLS files missing or not PEM |
//! | 3 | not found: an unknown key, no dead letter with the id or position `dlq show` asked for |
//! | 4 | busy: another retention runner holds the lock (`purge`) |
//! | 5 | declined at the confirmation prompt: nothing was changed |

// rocketmq-client-rust's consumer start is a deep future: its layout needs more than the
// default query depth of 128.
#![recursion_limit = "256"]

mod dlq;
mod error;
mod inspect;
mod output;
mod record;
mod redis;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, CommandFactory, Parser, Subcommand};

use crate::error::CliError;
use crate::record::Settlement;

/// The exit codes, as `--help` shows them.
const EXIT_CODES: &str = "\
Exit codes:
  0  done (or nothing to do)
  1  error: a store or broker failed or did not answer within --timeout, a queue or topic
     does not exist, a row is not in a state the action applies to, an incomplete inspect,
     dead letters left in place by replay because they are not oncely's
  2  usage: bad arguments, an invalid --schema or --table, TLS files missing or not PEM
  3  not found: unknown key, no such dead letter
  4  busy: another retention runner holds the lock
  5  declined at the confirmation prompt";

/// Inspect and repair oncely's stores, and list or replay its dead letters.
#[derive(Debug, Parser)]
#[command(name = "oncely", version, after_help = EXIT_CODES)]
struct Cli {
    #[command(flatten)]
    globals: Globals,
    #[command(subcommand)]
    command: Command,
}

/// Where the stores and the broker are: the consumers' own settings.
#[derive(Clone, Debug, Args)]
pub(crate) struct Globals {
    /// The PostgreSQL holding the record table (with --store postgres, the default).
    #[arg(
        long,
        global = true,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
    /// The store holding the record table.
    #[arg(long, global = true, value_enum, default_value_t = record::Store::Postgres)]
    store: record::Store,
    /// The MySQL or MariaDB holding the record table (with --store mysql).
    #[arg(
        long,
        global = true,
        env = "MYSQL_URL",
        hide_env_values = true,
        default_value = "mysql://root@127.0.0.1:3306/test"
    )]
    mysql_url: String,
    /// The record table's schema (PostgreSQL; default oncely), or its database (MySQL;
    /// default the one in --mysql-url).
    #[arg(long, global = true)]
    schema: Option<String>,
    /// The record table.
    #[arg(long, global = true, default_value = "consumption_record")]
    table: String,
    /// The Redis of the flag and lock tiers. `inspect` asks Redis only when this, or
    /// --redis-prefix, or --entity is given: a stack without Redis tiers has nothing there.
    #[arg(long, global = true, env = "REDIS_URL", hide_env_values = true)]
    redis_url: Option<String>,
    /// The Redis key prefix the routes use [default: oncely].
    #[arg(long, global = true)]
    redis_prefix: Option<String>,
    /// The RabbitMQ of the dead letters.
    #[arg(
        long,
        global = true,
        env = "AMQP_ADDR",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_addr: String,
    /// The RocketMQ name server of the dead-letter topics.
    #[arg(
        long,
        global = true,
        env = "ROCKETMQ_NAMESRV",
        hide_env_values = true,
        default_value = "127.0.0.1:9876"
    )]
    rocketmq_namesrv: String,
    /// The PEM file of the certificate authorities to trust on TLS connections (`amqps://`,
    /// `rediss://`, `sslmode=require`, `ssl-mode=VERIFY_IDENTITY`): for PostgreSQL and Redis
    /// instead of the platform's, for RabbitMQ beside them, for MySQL beside Mozilla's.
    /// Given, it makes PostgreSQL and MySQL URLs without a verifying mode require TLS.
    #[arg(long, global = true, env = oncely::tls::CA_CERT_ENV)]
    ca_cert: Option<std::path::PathBuf>,
    /// The PEM file of the client certificate for servers that ask for one (mutual TLS);
    /// needs --client-key.
    #[arg(long, global = true, env = oncely::tls::CLIENT_CERT_ENV, requires = "client_key")]
    client_cert: Option<std::path::PathBuf>,
    /// The PEM file of the client certificate's unencrypted private key; needs --client-cert.
    #[arg(long, global = true, env = oncely::tls::CLIENT_KEY_ENV, requires = "client_cert")]
    client_key: Option<std::path::PathBuf>,
    /// How long connecting, and each call, may take (`500ms`, `5s`, `1m`).
    #[arg(long, global = true, default_value = "5s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Print JSON for scripts instead of tables.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A key's record row, Redis flag marker and (with --entity) lock, in one view.
    #[command(after_help = "Example:\n  oncely inspect order-1042 --entity sku-7")]
    Inspect(InspectArgs),
    /// PROCESSING rows past their lease, oldest lease first, with their count.
    #[command(after_help = "Example:\n  oncely stuck --limit 50")]
    Stuck {
        /// How many rows to show at most.
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// A stuck key whose effect did not happen: PROCESSING → FAILURE, so that its next
    /// delivery runs it again.
    #[command(after_help = "Example:\n  oncely release order-1042")]
    Release(SettleArgs),
    /// A key whose effect happened: PROCESSING or FAILURE → SUCCESS, so that later
    /// deliveries are duplicates.
    #[command(after_help = "Example:\n  oncely mark-done order-1042 --yes")]
    MarkDone(SettleArgs),
    /// Rows by status, oldest PROCESSING, table size, retention horizon.
    #[command(after_help = "Example:\n  oncely stats --json")]
    Stats,
    /// Deletes SUCCESS rows not updated for a while, in batches, as the retention service
    /// does (one runner at a time); safe while consumers run.
    #[command(after_help = "Example:\n  oncely purge --older-than 30d --batch-rows 10000")]
    Purge(PurgeArgs),
    /// Dead letters: list, show, replay or purge those of RabbitMQ's QUEUE.dlq (--queue) or
    /// of a RocketMQ dead-letter topic (--topic).
    #[command(after_help = "Example:\n  oncely dlq list --queue orders --reason rejected")]
    Dlq {
        #[command(subcommand)]
        command: dlq::DlqCommand,
    },
    /// Prints shell completions.
    #[command(after_help = "Example:\n  oncely completions bash > /etc/bash_completion.d/oncely")]
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// `inspect`'s arguments.
#[derive(Debug, Args)]
pub(crate) struct InspectArgs {
    /// The business key, as the route extracts it; for an HTTP route (oncely-http), the
    /// client's `Idempotency-Key` or token, with --client.
    key: String,
    /// Also show the lock of this entity (the lock tier's key, e.g. the SKU).
    #[arg(long)]
    entity: Option<String>,
    /// The client whose key KEY is, on an HTTP route that scopes keys by client
    /// (`ClientScope`): the identity the route reads, e.g. the API key. Looked up as the
    /// route stores it, scoped by its hash. An identity that is a secret is better passed
    /// in ONCELY_CLIENT than on the command line, which the shell's history and `ps` show.
    #[arg(long, env = "ONCELY_CLIENT", hide_env_values = true)]
    client: Option<String>,
    /// The secret the route's `ClientScope::with_secret` hashes identities with, if it has
    /// one (with --client).
    #[arg(
        long,
        env = "ONCELY_CLIENT_SECRET",
        hide_env_values = true,
        requires = "client"
    )]
    client_secret: Option<String>,
}

impl Globals {
    /// The TLS settings of `--ca-cert`, `--client-cert` and `--client-key`, their files
    /// read: a missing one is the settings' fault (exit 2), whichever service it is for.
    pub(crate) fn tls(&self) -> Result<oncely::tls::TlsSettings, CliError> {
        let settings = oncely::tls::TlsSettings::from_paths(
            self.ca_cert.clone(),
            self.client_cert.clone(),
            self.client_key.clone(),
        )?;
        settings.check()?;
        Ok(settings)
    }

    /// The Redis to ask, if any was named (`--redis-url`, `REDIS_URL`, `--redis-prefix`), or
    /// `asked` says so anyway: its URL, by default Redis on this machine.
    pub(crate) fn redis_url(&self, asked: bool) -> Option<&str> {
        match (&self.redis_url, asked || self.redis_prefix.is_some()) {
            (Some(url), _) => Some(url),
            (None, true) => Some("redis://127.0.0.1:6379"),
            (None, false) => None,
        }
    }

    /// The Redis key prefix the routes use.
    pub(crate) fn redis_prefix(&self) -> &str {
        self.redis_prefix
            .as_deref()
            .unwrap_or(oncely::DEFAULT_REDIS_PREFIX)
    }
}

/// `release` and `mark-done`'s arguments.
#[derive(Debug, Args)]
pub(crate) struct SettleArgs {
    /// The business key.
    key: String,
    /// Do not ask for confirmation.
    #[arg(long, short)]
    yes: bool,
    /// Also when the row's lease still runs (its attempt may still be running).
    #[arg(long)]
    force: bool,
}

/// `purge`'s arguments.
#[derive(Debug, Args)]
pub(crate) struct PurgeArgs {
    /// Purge SUCCESS rows not updated for this long (`30d`, `12h`): keep it longer than the
    /// longest way a copy can come back (retries, dead-letter replays).
    #[arg(long, value_parser = humantime::parse_duration)]
    older_than: Duration,
    /// Rows one batch deletes at most (default: the library's).
    #[arg(long)]
    batch_rows: Option<u32>,
    /// Do not ask for confirmation.
    #[arg(long, short)]
    yes: bool,
    /// Also when --older-than is under a day.
    #[arg(long)]
    force: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Two threads: a blocking prompt must not stop a broker connection's heartbeats.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build();
    let answer = match runtime {
        Ok(runtime) => runtime.block_on(run(cli)),
        Err(error) => Err(CliError::Io(error)),
    };
    match answer {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("oncely: {}", error::chain(&error));
            ExitCode::from(error.exit_code())
        }
    }
}

async fn run(cli: Cli) -> Result<(), CliError> {
    let globals = &cli.globals;
    match &cli.command {
        Command::Inspect(args) => inspect::inspect(globals, args).await,
        Command::Stuck { limit } => record::stuck(globals, *limit).await,
        Command::Release(args) => record::settle(globals, args, Settlement::Release).await,
        Command::MarkDone(args) => record::settle(globals, args, Settlement::MarkDone).await,
        Command::Stats => record::stats(globals).await,
        Command::Purge(args) => record::purge(globals, args).await,
        Command::Dlq { command } => dlq::run(globals, command).await,
        Command::Completions { shell } => {
            clap_complete::generate(*shell, &mut Cli::command(), "oncely", &mut std::io::stdout());
            Ok(())
        }
    }
}
