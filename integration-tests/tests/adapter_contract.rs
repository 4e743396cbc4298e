//! The adapter suite (`oncely::testing::adapter`) on every broker oncely has an adapter for:
//! RabbitMQ 3.10 (plain and over TLS) and 4.0 through the AMQP runner, RocketMQ through the
//! concurrent listener.

use integration_tests::amqp::Broker;
use integration_tests::harness::{AmqpHarness, RocketMqHarness};

mod rabbitmq_3 {
    async fn harness() -> super::AmqpHarness {
        super::AmqpHarness::new(super::Broker::Rabbit3).await
    }
    oncely::adapter_suite!(harness);
}

mod rabbitmq_4 {
    async fn harness() -> super::AmqpHarness {
        super::AmqpHarness::new(super::Broker::Rabbit4).await
    }
    oncely::adapter_suite!(harness);
}

/// The suite over `amqps://`, with a client certificate (`services.sh tls`).
mod rabbitmq_3_tls {
    async fn harness() -> super::AmqpHarness {
        super::AmqpHarness::new(super::Broker::Rabbit3Tls).await
    }
    oncely::adapter_suite!(harness);
}

mod rocketmq {
    async fn harness() -> super::RocketMqHarness {
        super::RocketMqHarness::new().await
    }
    oncely::adapter_suite!(harness);
}
