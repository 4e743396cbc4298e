//! The `amqp` benchmark's tables, notes and targets, from the medians of its rounds.

use super::services::{Record, Store};
use super::{Consumer, DUPLICATES_PREFETCH, MESSAGES, Measured, Rounds, SERVERS, SETTINGS};
use crate::cpu::{BUDGET_HEADING, CpuTime, budget_line, cpu_table};
use crate::measure::median;
use crate::report::{Plot, Report, Row, Section, Target};
use crate::workload::{Copies, DUPLICATE_PERCENT, NEAR, WITH_DUPLICATES};

/// The targets against the at-least-once consumer: the record run as given, at least this
/// many times its rate.
const AGAINST_AT_LEAST_ONCE: [(Record, f64); 3] = [
    (Record::Batched, 1.2),
    (Record::BatchHandler, 2.0),
    (Record::PerDelivery, 0.6),
];

/// The medians of `rounds`: rate, CPU, deliveries per transaction, and the most doubled.
fn medians(rounds: &[Measured]) -> Measured {
    let cpu: Vec<_> = rounds.iter().map(|measured| measured.cpu).collect();
    let per_transaction: Vec<f64> = rounds
        .iter()
        .filter_map(|measured| measured.per_transaction)
        .collect();
    Measured {
        per_second: median(rounds.iter().map(|measured| measured.per_second).collect()),
        cpu: CpuTime::median(&cpu),
        per_transaction: (!per_transaction.is_empty()).then(|| median(per_transaction)),
        // Any round that doubled an effect counts: exactly once is not a median.
        doubled: rounds.iter().filter_map(|measured| measured.doubled).max(),
    }
}

/// The medians of what `key` measured.
fn of<K: PartialEq + std::fmt::Debug>(rounds: &[(K, Vec<Measured>)], key: K) -> Measured {
    let (_, all) = (rounds.iter())
        .find(|(each, _)| *each == key)
        .unwrap_or_else(|| panic!("nothing measured {key:?}"));
    medians(all)
}

/// Adds every table and target of `rounds` to `report`.
pub(super) fn report(report: &mut Report, rounds: &Rounds) {
    for store in [Store::Postgres, Store::Mysql] {
        against_at_least_once(report, rounds, store);
    }
    without_a_database(report, rounds);
    duplicates(report, rounds);
    if !rounds.peers.is_empty() {
        peers(report, rounds);
    }
}

/// "at 64 in flight" or "at the runner's default, 512 in flight".
fn setting(prefetch: u16) -> String {
    match prefetch {
        oncely_amqp::DEFAULT_PREFETCH => {
            format!("prefetch and concurrency {prefetch} (the runner's default)")
        }
        _ => format!("prefetch and concurrency {prefetch}"),
    }
}

/// The full stack on `store` against the at-least-once consumer writing the same row, at
/// each setting: its table, CPU, deliveries per transaction and targets.
fn against_at_least_once(report: &mut Report, rounds: &Rounds, store: Store) {
    let mut rows = Vec::new();
    let mut cpu_rows = Vec::new();
    let mut notes = String::new();
    let mut budgets = String::from(BUDGET_HEADING);
    for prefetch in SETTINGS {
        let baseline = of(&rounds.fresh, (Consumer::AtLeastOnce(store), prefetch));
        cpu_rows.push((
            format!("{} at {prefetch}", Consumer::AtLeastOnce(store).name()),
            baseline.cpu,
        ));
        for (record, at_least) in AGAINST_AT_LEAST_ONCE {
            let consumer = Consumer::FullStack(store, record);
            let measured = of(&rounds.fresh, (consumer, prefetch));
            let row = Row {
                what: consumer.name(),
                in_flight: usize::from(prefetch),
                per_second: measured.per_second,
                baseline: baseline.per_second,
                lowest_ratio: None,
            };
            let what = format!(
                "RabbitMQ, {}, {} on {store_name}",
                setting(prefetch),
                consumer.name(),
                store_name = store.name()
            );
            report.add_target(Target {
                what: what.clone(),
                ratio: row.ratio(),
                baseline: format!("the at-least-once consumer writing its row on {}", store.name()),
                at_least,
            });
            budgets.push_str(&budget_line(&what, at_least, baseline.per_second, &measured.cpu));
            if let Some(per_transaction) = measured.per_transaction {
                notes.push_str(&format!(
                    "- {}, {}: {per_transaction:.1} deliveries per transaction\n",
                    consumer.name(),
                    setting(prefetch)
                ));
            }
            cpu_rows.push((format!("{} at {prefetch}", consumer.name()), measured.cpu));
            rows.push(row);
        }
    }
    let cpu = cpu_table(&SERVERS, cpu_rows.iter().map(|(what, cpu)| (what.as_str(), cpu)));
    report.add(Section {
        title: format!(
            "RabbitMQ end to end on {}: exactly-once against at-least-once ({MESSAGES} messages; each row and its baseline at the same prefetch and concurrency, in flight below)",
            store.name()
        ),
        baseline_name: match store {
            Store::Postgres => "at-least-once consumer writing its row on PostgreSQL",
            Store::Mysql => "at-least-once consumer writing its row on MariaDB",
        },
        unit: Some("messages"),
        rows,
        note: Some(format!(
            "The baseline is a lapin consumer that writes each message's row in a transaction of its own \
             (one autocommitted, prepared `INSERT` on a pool of 16) and acks after the commit, one task per \
             delivery. The full stack: the Redis flag with the record behind it and the Redis lock as one \
             tier, then the transactional record on the same pool of 16, its handler writing the same row in \
             the record's transaction; acked after the commit.\n\n{notes}\n{cpu}{budgets}"
        )),
        plot: Plot::Bars,
    });
}

/// The runner alone and with the Redis flag against a consumer that only acks.
fn without_a_database(report: &mut Report, rounds: &Rounds) {
    let mut rows = Vec::new();
    for prefetch in SETTINGS {
        let baseline = of(&rounds.fresh, (Consumer::RawAck, prefetch));
        for consumer in [Consumer::Runner, Consumer::RunnerFlag] {
            let measured = of(&rounds.fresh, (consumer, prefetch));
            rows.push(Row {
                what: consumer.name(),
                in_flight: usize::from(prefetch),
                per_second: measured.per_second,
                baseline: baseline.per_second,
                lowest_ratio: None,
            });
        }
        report.add_target(Target {
            what: format!("RabbitMQ, {}, runner with the Redis flag", setting(prefetch)),
            ratio: Row::ratio_at(&rows, &Consumer::RunnerFlag.name(), usize::from(prefetch)),
            baseline: "a raw lapin consumer that only acks".into(),
            at_least: 0.8,
        });
    }
    report.add(Section {
        title: format!(
            "RabbitMQ end to end without a database ({MESSAGES} messages; each row and its baseline at the same prefetch and concurrency)"
        ),
        baseline_name: "raw lapin consumer, ack only",
        unit: Some("messages"),
        rows,
        note: None,
        plot: Plot::Bars,
    });
}

/// The batched record alone on the workload with duplicates near their original, against
/// the same with every duplicate far.
fn duplicates(report: &mut Report, rounds: &Rounds) {
    let mut rows = Vec::new();
    let mut notes = String::new();
    for consumer in super::WITH_DUPLICATES {
        let near = of(&rounds.duplicates, (consumer, Copies::HalfNear));
        let far = of(&rounds.duplicates, (consumer, Copies::Far));
        let row = Row {
            what: consumer.name(),
            in_flight: usize::from(DUPLICATES_PREFETCH),
            per_second: near.per_second,
            baseline: far.per_second,
            lowest_ratio: None,
        };
        report.add_target(Target {
            what: format!("RabbitMQ, duplicates near their original, {}", consumer.name()),
            ratio: row.ratio(),
            baseline: "the same workload with every duplicate far".into(),
            at_least: 0.9,
        });
        notes.push_str(&format!(
            "- {}: {} deliveries per transaction near, {} far; orders applied twice: {}\n",
            consumer.name(),
            shown(near.per_transaction),
            shown(far.per_transaction),
            near.doubled
                .max(far.doubled)
                .map_or("— (a primary key refuses a second row)".into(), |n| n
                    .to_string()),
        ));
        rows.push(row);
    }
    report.add(Section {
        title: format!(
            "RabbitMQ, {WITH_DUPLICATES} messages with {DUPLICATE_PERCENT} % duplicates at prefetch and concurrency {DUPLICATES_PREFETCH}: {} against {}",
            Copies::HalfNear.name(),
            Copies::Far.name()
        ),
        baseline_name: "every duplicate far",
        unit: Some("messages"),
        rows,
        note: Some(format!(
            "Half the duplicates re-sent with the original's message id, half with a new one; \"near\" is \
             within {NEAR} messages after the original, \"far\" a third of the workload or more later.\n\n{notes}"
        )),
        plot: Plot::None,
    });
}

/// oncely's full stack, batched, against mq-bridge's deduplication route on the half-near
/// workload.
fn peers(report: &mut Report, rounds: &Rounds) {
    let peer = of(&rounds.peers, Consumer::MqBridge);
    let oncely = of(
        &rounds.peers,
        Consumer::FullStack(Store::Postgres, Record::Batched),
    );
    let row = Row {
        what: format!(
            "oncely {}, PostgreSQL",
            Consumer::FullStack(Store::Postgres, Record::Batched).name()
        ),
        in_flight: usize::from(DUPLICATES_PREFETCH),
        per_second: oncely.per_second,
        baseline: peer.per_second,
        lowest_ratio: None,
    };
    report.add_target(Target {
        what: "RabbitMQ, the half-near duplicate workload, oncely's full stack, batched record".into(),
        ratio: row.ratio(),
        baseline: "mq-bridge 1.3's deduplication route on PostgreSQL".into(),
        at_least: 10.0,
    });
    let doubled = |measured: &Measured| measured.doubled.map_or("?".into(), |n| n.to_string());
    report.add(Section {
        title: format!(
            "RabbitMQ, a peer: {WITH_DUPLICATES} messages with {DUPLICATE_PERCENT} % duplicates ({}) on one classic queue, prefetch {DUPLICATES_PREFETCH}",
            Copies::HalfNear.name()
        ),
        baseline_name: "mq-bridge 1.3 deduplication route",
        unit: Some("messages"),
        rows: vec![row],
        note: Some(format!(
            "Orders applied twice (the most in any round): oncely {}, mq-bridge {}. mq-bridge deduplicates by \
             message id, as its route does by default, so a re-send with a new message id runs again; its \
             claim and its processed mark are statements of their own, outside the handler's transaction. \
             See `bench-peers/mq-bridge` for its settings (8 workers of batches of 8 at prefetch 64, the best \
             of its knobs tried here). oncely: the full stack, batched, {} deliveries per transaction, the \
             queue taken as it exists.",
            doubled(&oncely),
            doubled(&peer),
            shown(oncely.per_transaction)
        )),
        plot: Plot::None,
    });
}

/// A figure with one decimal, or a dash.
fn shown(figure: Option<f64>) -> String {
    figure.map_or("—".into(), |figure| format!("{figure:.1}"))
}
