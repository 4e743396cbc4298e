//! RabbitMQ adapter for [oncely](oncely), on `lapin`.
//!
//! Not built yet: this crate reserves the name and the place in the workspace. It will turn
//! each lapin delivery into an [`oncely::Delivery`], run it through an [`oncely::Route`], and
//! map the [`oncely::Outcome`] to ack, delayed retry or dead letter
//! ([`oncely::Outcome::action`]).

pub use oncely;
