//! `oncely inspect`: one key as every tier's store remembers it, in one view. A store that
//! does not answer is reported in the view rather than hiding what the others said.

use serde::Serialize;

use crate::error::CliError;
use crate::output::{self, Report};
use crate::record::{Records, RowView};
use crate::redis::{FlagReport, LockReport, RedisStores};
use crate::{Globals, InspectArgs};

/// `inspect`'s report.
#[derive(Debug, Serialize)]
struct InspectView {
    key: String,
    /// `None`: no row, or the record's store could not be read (see `unavailable`).
    record: Option<RowView>,
    /// The record's store, as `unavailable` names it: `PostgreSQL` or `MySQL`.
    #[serde(skip)]
    record_store: &'static str,
    /// `None`: Redis could not be read.
    flag: Option<FlagReport>,
    /// `None`: no `--entity`, or Redis could not be read.
    lock: Option<LockReport>,
    entity: Option<String>,
    /// The stores that failed or did not answer, with their errors.
    unavailable: Vec<Unavailable>,
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
        let flag = match &self.flag {
            Some(flag) => output::fields(flag.fields()).to_string(),
            None => "could not be read (below)".to_owned(),
        };
        sections.push(format!("flag (Redis)\n{flag}"));
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
    let mut view = InspectView {
        key: args.key.clone(),
        record: None,
        record_store: records.remote.service,
        flag: None,
        lock: None,
        entity: args.entity.clone(),
        unavailable: Vec::new(),
    };
    // Each store on its own: one that does not answer does not delay the other's answer.
    let (record, redis) = tokio::join!(records.inspect(&args.key), redis_part(globals, args));
    match record {
        Ok(row) => view.record = row.map(RowView::from),
        Err(error) => view
            .unavailable
            .push(Unavailable::new(records.remote.service, &error)),
    }
    match redis {
        Ok((flag, lock)) => (view.flag, view.lock) = (Some(flag), lock),
        Err(error) => view.unavailable.push(Unavailable::new("Redis", &error)),
    }
    output::print(&view, globals.json)?;
    let known = view.record.is_some() || view.flag.as_ref().is_some_and(|flag| flag.state != "absent");
    match (view.unavailable.is_empty(), known) {
        (false, _) => Err(CliError::Incomplete(format!(
            "incomplete view of key {:?}: {} could not be read",
            args.key,
            view.unavailable
                .iter()
                .map(|u| u.store)
                .collect::<Vec<_>>()
                .join(" and ")
        ))),
        (true, false) => Err(CliError::NotFound(format!(
            "key {:?} is unknown: no record row, no flag marker",
            args.key
        ))),
        (true, true) => Ok(()),
    }
}

/// The flag marker, and the lock with `--entity`.
async fn redis_part(
    globals: &Globals,
    args: &InspectArgs,
) -> Result<(FlagReport, Option<LockReport>), CliError> {
    let redis = RedisStores::connect(globals).await?;
    let flag = redis.flag(&args.key).await?;
    let lock = match &args.entity {
        Some(entity) => Some(redis.lock(entity).await?),
        None => None,
    };
    Ok((flag, lock))
}
