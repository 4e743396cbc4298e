//! RocketMQ adapter for [oncely](oncely), on `rocketmq-client-rust`.
//!
//! Not built yet: this crate reserves the name and the place in the workspace. It will wrap
//! a route in `MessageListenerConcurrently` and `MessageListenerOrderly` implementations that
//! turn each `MessageExt` into an [`oncely::Delivery`] and map the [`oncely::Outcome`] to
//! `ConsumeSuccess`, `ReconsumeLater` or a dead-letter topic ([`oncely::Outcome::action`]).

pub use oncely;
