//! Run with: `cargo run -p amqp-orders --bin publisher -- [ORDERS]` (default 1000).
//!
//! Publishes ORDERS stock-deduction orders to the `amqp-orders` queue, then duplicates the
//! way production does: 30 % more copies, half of them producer retries (the same message
//! id), half re-sent orders (a new id, the same order), plus two poison messages.

use amqp_orders::{QUEUE, amqp, order_body};
use oncely_amqp::{Producer, Topology};

#[tokio::main]
async fn main() -> Result<(), oncely_amqp::Error> {
    let orders: usize = std::env::args()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000);
    let connection = amqp().await?;
    Topology::new(QUEUE)
        .declare(&connection.create_channel().await?)
        .await?;
    let producer = Producer::new(connection);

    let mut ids = Vec::with_capacity(orders);
    for n in 0..orders {
        ids.push(producer.publish("", QUEUE, &order_body(n), None).await?);
    }
    let copies = orders * 3 / 10;
    for copy in 0..copies {
        let n = (copy * 7919) % orders;
        if copy % 2 == 0 {
            producer
                .publish_with_id(&ids[n], "", QUEUE, &order_body(n), None)
                .await?;
        } else {
            producer.publish("", QUEUE, &order_body(n), None).await?;
        }
    }
    producer.publish("", QUEUE, b"<order id=\"1\"/>", None).await?;
    producer
        .publish(
            "",
            QUEUE,
            br#"{"orderId":"order_0","sku":"sku_7","quantity":9}"#,
            None,
        )
        .await?;
    println!(
        "published {} messages: {orders} orders, {copies} duplicates, 2 poison",
        orders + copies + 2
    );
    Ok(())
}
