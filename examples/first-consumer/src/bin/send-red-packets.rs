//! Run with: `cargo run -p first-consumer --bin send-red-packets`
//!
//! Sends 100 red packets for 10 users to the `red-packets` queue, then 30 duplicates of them
//! and one packet whose amount is not a number. Packet ids are new on every run; the dead
//! letters of earlier runs are purged, and queues an earlier oncely declared with other
//! arguments are declared anew.

use first_consumer::{QUEUE, amqp};
use oncely_amqp::{Producer, Topology};

#[tokio::main]
async fn main() -> Result<(), oncely_amqp::Error> {
    let connection = amqp().await?;
    let topology = Topology::new(QUEUE);
    match topology.declare(&connection.create_channel().await?).await {
        Ok(()) => {}
        // Queues an earlier oncely declared with other arguments (RabbitMQ refuses to change
        // them, and closes the channel): they are this demo's own, so it starts afresh. Your
        // own queues need their messages moved first (see `Topology`).
        Err(refused) if !refused.is_retryable() => {
            println!("the demo's queues had other arguments ({refused}); declaring them anew");
            topology.delete(&connection.create_channel().await?).await?;
            topology.declare(&connection.create_channel().await?).await?;
        }
        Err(error) => return Err(error),
    }
    let channel = connection.create_channel().await?;
    // The demo's dead letters are read from its report; the last run's are of no more use.
    channel
        .queue_purge(topology.dead_letter_queue().into(), Default::default())
        .await?;
    let producer = Producer::new(connection);
    let run = oncely::Token::random();
    let packet = |n: usize| {
        format!(
            r#"{{"packetId":"{run}-{n}","user":"user_{}","cents":{}}}"#,
            n % 10,
            100 + n
        )
    };
    for n in 0..100 {
        producer.publish("", QUEUE, packet(n).as_bytes(), None).await?;
    }
    for n in 0..30 {
        producer
            .publish("", QUEUE, packet(n * 3).as_bytes(), None)
            .await?;
    }
    let malformed = format!(r#"{{"packetId":"{run}-x","user":"user_1","cents":"ten"}}"#);
    producer.publish("", QUEUE, malformed.as_bytes(), None).await?;
    println!("sent 100 red packets, 30 duplicates and 1 malformed packet to {QUEUE}");
    Ok(())
}
