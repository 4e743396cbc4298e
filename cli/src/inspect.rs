//! `oncely inspect`: one key as every tier's store remembers it, in one view. A store that
//! does not answer is reported in the view rather than hiding what the others said.

use oncely::record::ResponseRow;
use oncely_http::ClientScope;
use serde::Serialize;

use crate::error::CliError;
use crate::output::{self, Report, shown_key};
use crate::record::{Records, RowView};
use crate::redis::{FlagReport, LockReport, RedisStores};
use crate::{Globals, InspectArgs};

/// `inspect`'s report.
#[derive(Debug, Serialize)]
struct InspectView {
    /// The key looked up, its client's scope cut short.
    key: String,
    /// `None`: no row, or the record's store could not be read (see `unavailable`).
    record: Option<RowView>,
    /// The record's store, as `unavailable` names it: `PostgreSQL` or `MySQL`.
    #[serde(skip)]
    record_store: &'static str,
    /// The key's stored HTTP response (oncely-http's, beside the record table), if any.
    response: Option<ResponseView>,
    /// Keys an HTTP route recorded for this key under a client's scope, when the key has no
    /// row of its own: what to pass `--client` for.
    scoped_keys: Vec<String>,
    /// Redis was asked (`--redis-url`, `REDIS_URL`, `--redis-prefix` or `--entity`).
    #[serde(skip)]
    redis_asked: bool,
    /// `None`: Redis not asked, or it could not be read.
    flag: Option<FlagReport>,
    /// `None`: no `--entity`, or Redis could not be read.
    lock: Option<LockReport>,
    entity: Option<String>,
    /// The stores that failed or did not answer, with their errors.
    unavailable: Vec<Unavailable>,
}

/// A stored response in a report.
#[derive(Debug, Serialize)]
struct ResponseView {
    status: u16,
    content_type: Option<String>,
    body_bytes: u64,
    expires_at: String,
    expired: bool,
    #[serde(skip)]
    row: ResponseRow,
}

impl From<ResponseRow> for ResponseView {
    fn from(row: ResponseRow) -> Self {
        ResponseView {
            status: row.status,
            content_type: row.content_type.clone(),
            body_bytes: row.body_len,
            expires_at: output::rfc3339(row.expires_at),
            expired: row.expires_at <= std::time::SystemTime::now(),
            row,
        }
    }
}

impl ResponseView {
    fn fields(&self) -> Vec<(&'static str, String)> {
        let expiry = match self.expired {
            true => format!(
                "{}: answers 410 until purged with its record",
                output::when(self.row.expires_at)
            ),
            false => format!("{}: answered again until then", output::when(self.row.expires_at)),
        };
        vec![
            ("status", self.status.to_string()),
            (
                "content type",
                self.content_type.clone().unwrap_or_else(|| "-".into()),
            ),
            ("body", format!("{} B", self.body_bytes)),
            ("expires", expiry),
        ]
    }
}

/// A store that failed or did not answer.
#[derive(Debug, Serialize)]
struct Unavailable {
    store: &'static str,
    error: String,
}

impl Unavailable {
    fn new(store: &'static str, error: &CliError) -> Self {
        Unavailable {
            store,
            error: crate::error::chain(error),
        }
    }
}

impl Report for InspectView {
    fn human(&self) -> String {
        let mut sections = Vec::new();
        let record = match &self.record {
            Some(row) => output::fields(row.fields()).to_string(),
            None if self.unavailable(self.record_store) => "could not be read (below)".to_owned(),
            None => "no row".to_owned(),
        };
        sections.push(format!("record ({})\n{record}", self.record_store));
        if let Some(response) = &self.response {
            let fields = output::fields(response.fields());
            sections.push(format!("stored response ({})\n{fields}", self.record_store));
        }
        if !self.scoped_keys.is_empty() {
            sections.push(format!(
                "HTTP routes record a key as SCOPE:KEY, the scope a hash of the client (empty when \
                 shared); this key was recorded as:\n  {}\nlook one up with --client (and \
                 --client-secret, or ONCELY_CLIENT_SECRET, if the route has one)",
                self.scoped_keys.join("\n  ")
            ));
        }
        if self.redis_asked {
            let flag = match &self.flag {
                Some(flag) => output::fields(flag.fields()).to_string(),
                None => "could not be read (below)".to_owned(),
            };
            sections.push(format!("flag (Redis)\n{flag}"));
        }
        if let Some(entity) = &self.entity {
            let lock = match &self.lock {
                Some(lock) => output::fields(lock.fields()).to_string(),
                None => "could not be read (below)".to_owned(),
            };
            sections.push(format!("lock of entity {entity:?} (Redis)\n{lock}"));
        }
        for unavailable in &self.unavailable {
            sections.push(format!(
                "{} could not be read: {}",
                unavailable.store, unavailable.error
            ));
        }
        format!("key {:?}\n\n{}", self.key, sections.join("\n\n"))
    }
}

impl InspectView {
    fn unavailable(&self, store: &str) -> bool {
        self.unavailable
            .iter()
            .any(|unavailable| unavailable.store == store)
    }
}

/// `oncely inspect`. Exit 1 if a store could not be read (after the view), else 3 when no
/// store knows the key (no record row, no flag marker), else 0.
pub(crate) async fn inspect(globals: &Globals, args: &InspectArgs) -> Result<(), CliError> {
    let records = Records::new(globals)?;
    let key = match &args.client {
        Some(client) => {
            let scope = ClientScope::by(|_| None);
            let scope = match &args.client_secret {
                Some(secret) => scope.with_secret(secret),
                None => scope,
            };
            scope.stored_key(client, &args.key)
        }
        None => args.key.clone(),
    };
    let redis_url = globals.redis_url(args.entity.is_some());
    let mut view = InspectView {
        key: shown_key(&key),
        record: None,
        record_store: records.remote.service,
        response: None,
        scoped_keys: Vec::new(),
        redis_asked: redis_url.is_some(),
        flag: None,
        lock: None,
        entity: args.entity.clone(),
        unavailable: Vec::new(),
    };
    // Each store on its own: one that does not answer does not delay the other's answer.
    let (record, redis) = tokio::join!(record_part(&records, &key), async {
        match redis_url {
            Some(url) => Some(redis_part(globals, url, &key, args).await),
            None => None,
        }
    });
    match record {
        Ok((row, response, scoped_keys)) => {
            view.record = row.map(RowView::from);
            view.response = response.map(ResponseView::from);
            view.scoped_keys = scoped_keys.iter().map(|key| shown_key(key)).collect();
        }
        Err(error) => view
            .unavailable
            .push(Unavailable::new(records.remote.service, &error)),
    }
    match redis {
        Some(Ok((flag, lock))) => (view.flag, view.lock) = (Some(flag), lock),
        Some(Err(error)) => view.unavailable.push(Unavailable::new("Redis", &error)),
        None => {}
    }
    output::print(&view, globals.json)?;
    let known = view.record.is_some() || view.flag.as_ref().is_some_and(|flag| flag.state != "absent");
    match (view.unavailable.is_empty(), known) {
        (false, _) => Err(CliError::Incomplete(format!(
            "incomplete view of key {:?}: {} could not be read",
            view.key,
            view.unavailable
                .iter()
                .map(|u| u.store)
                .collect::<Vec<_>>()
                .join(" and ")
        ))),
        (true, false) => Err(CliError::NotFound(format!(
            "key {:?} is unknown: no row in {}{}",
            view.key,
            records.name,
            match view.redis_asked {
                true => ", no flag marker",
                false => " (Redis not asked: no --redis-url, REDIS_URL, --redis-prefix or --entity)",
            }
        ))),
        (true, true) => Ok(()),
    }
}

/// The record row, the stored response, and — when the key has no row — the client-scoped
/// keys recorded for it.
async fn record_part(
    records: &Records,
    key: &str,
) -> Result<
    (
        Option<oncely::record::RecordRow>,
        Option<ResponseRow>,
        Vec<String>,
    ),
    CliError,
> {
    let row = records.inspect(key).await?;
    let response = records.response(key).await?;
    let scoped_keys = match row {
        Some(_) => Vec::new(),
        None => records.scoped_keys(key).await?,
    };
    Ok((row, response, scoped_keys))
}

/// The flag marker, and the lock with `--entity`.
async fn redis_part(
    globals: &Globals,
    url: &str,
    key: &str,
    args: &InspectArgs,
) -> Result<(FlagReport, Option<LockReport>), CliError> {
    let redis = RedisStores::connect(globals, url).await?;
    let flag = redis.flag(key).await?;
    let lock = match &args.entity {
        Some(entity) => Some(redis.lock(entity).await?),
        None => None,
    };
    Ok((flag, lock))
}
