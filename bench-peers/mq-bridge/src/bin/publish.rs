//! Smoke-test publisher for `mq-bridge-peer` (see `smoke.sh`); not part of any measurement.
//!
//! `publish --amqp-addr <url> --queue <name> --messages <N> [--seed <n>]` declares `<name>`
//! durable (with no arguments, as mq-bridge's consumer declares it) and publishes N persistent,
//! confirmed messages with the AMQP `message_id` set and a body `{"orderId":…,"sku":…}`. About
//! 30 % are duplicates of an earlier original: half with its message_id, half with a new
//! message_id and the same body. Prints on stdout what a message_id-keyed dedup should report.
//! `--recent k` copies only the last k originals; `--delete` instead deletes the queue.

use mq_bridge::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use mq_bridge::lapin::types::FieldTable;
use mq_bridge::lapin::{BasicProperties, Connection, ConnectionProperties};
use std::collections::HashSet;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let addr = arg("--amqp-addr").ok_or_else(|| anyhow::anyhow!("--amqp-addr is required"))?;
    let queue = arg("--queue").ok_or_else(|| anyhow::anyhow!("--queue is required"))?;
    let n: usize = arg("--messages").ok_or_else(|| anyhow::anyhow!("--messages is required"))?.parse()?;
    // `--recent k`: a duplicate copies one of the last k originals (default: any earlier one).
    let recent: usize = arg("--recent").map(|s| s.parse()).transpose()?.unwrap_or(usize::MAX);
    let mut state: u64 = arg("--seed").map(|s| s.parse()).transpose()?.unwrap_or(0x9e37_79b9_7f4a_7c15);
    // xorshift: a reproducible mix without a rand dependency.
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };

    let conn = Connection::connect(&addr, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    if args.iter().any(|a| a == "--delete") {
        // Cleanup for smoke.sh: drop the queue and stop.
        channel.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await?;
        return Ok(());
    }
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    channel.queue_declare(queue.as_str().into(), durable, FieldTable::default()).await?;

    // (message_id, orderId) of every original so far.
    let mut originals: Vec<(String, String)> = Vec::new();
    let (mut id_dups, mut business_dups) = (0, 0);
    let mut doubled: HashSet<String> = HashSet::new();
    let mut confirms = Vec::with_capacity(n);
    for i in 0..n {
        let roll = next() % 100;
        let (message_id, order_id) = if originals.is_empty() || roll >= 30 {
            let pair = (format!("{queue}-m{i}"), format!("{queue}-o{i}"));
            originals.push(pair.clone());
            pair
        } else {
            let window = originals.len().min(recent) as u64;
            let (id, order) = originals[originals.len() - 1 - (next() % window) as usize].clone();
            if roll < 15 {
                id_dups += 1;
                (id, order)
            } else {
                business_dups += 1;
                doubled.insert(order.clone());
                (format!("{queue}-m{i}"), order)
            }
        };
        let body = format!(r#"{{"orderId":"{order_id}","sku":"{order_id}"}}"#);
        let properties = BasicProperties::default()
            .with_message_id(message_id.into())
            .with_delivery_mode(2);
        let confirm = channel
            .basic_publish("".into(), queue.as_str().into(), BasicPublishOptions::default(), body.as_bytes(), properties)
            .await?;
        confirms.push(confirm);
    }
    for confirm in confirms {
        confirm.await?;
    }
    conn.close(0, "done".into()).await?;
    println!(
        "{}",
        serde_json::json!({
            "published": n,
            "originals": originals.len(),
            "same_message_id_dups": id_dups,
            "new_message_id_dups": business_dups,
            "expect_handled": originals.len() + business_dups,
            "expect_duplicates_dropped": id_dups,
            "expect_doubled_order_ids": doubled.len(),
        })
    );
    Ok(())
}
