//! Run with: `cargo run -p rocketmq-points --bin send-payments -- [ORDERS]` (default 1000).
//!
//! Sends ORDERS payment-success messages (KEYS = the order id) to `rocketmq_points_payments`,
//! then duplicates the way production does: 30 % more copies, half of them producer
//! re-sends (the same `UNIQ_KEY`, as the client's own send retry makes), half payment
//! callbacks retried by the payment provider (a new id, the same order), plus two poison
//! messages: one without KEYS and one reusing an order id with another amount.

use oncely_rocketmq::rocketmq_model::common::message::message_client_id_setter::MessageClientIDSetter;
use oncely_rocketmq::rocketmq_model::common::message::message_single::Message;
use rocketmq_points::{TOPIC, payment_body, start_producer};

fn payment(n: usize) -> Message {
    Message::builder()
        .topic(TOPIC)
        .key(format!("order_{n}"))
        .body_slice(&payment_body(n))
        .build_unchecked()
}

#[tokio::main]
async fn main() -> Result<(), oncely_rocketmq::Error> {
    let orders: usize = std::env::args()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000);
    let (runtime, mut producer) = start_producer("rocketmq_points_publisher").await?;

    let mut sent = Vec::with_capacity(orders);
    for n in 0..orders {
        let mut message = payment(n);
        MessageClientIDSetter::set_uniq_id(&mut message);
        producer.send(message.clone()).await?;
        sent.push(message);
    }
    let copies = orders * 3 / 10;
    for copy in 0..copies {
        let n = (copy * 7919) % orders;
        let message = if copy % 2 == 0 {
            sent[n].clone()
        } else {
            payment(n)
        };
        producer.send(message).await?;
    }
    let keyless = Message::builder()
        .topic(TOPIC)
        .body_slice(br#"{"orderId":"order_x","userId":"user_1","amount":5}"#)
        .build_unchecked();
    producer.send(keyless).await?;
    let reused = Message::builder()
        .topic(TOPIC)
        .key("order_0")
        .body_slice(br#"{"orderId":"order_0","userId":"user_0","amount":99999}"#)
        .build_unchecked();
    producer.send(reused).await?;
    println!(
        "sent {} messages to {TOPIC}: {orders} payments, {copies} duplicates, 2 poison",
        orders + copies + 2
    );

    producer.shutdown().await;
    runtime.shutdown().await;
    Ok(())
}
