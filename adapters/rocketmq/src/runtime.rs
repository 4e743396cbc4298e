//! The RocketMQ client's own runtime, built and shut down in one place.

use std::sync::Arc;
use std::time::Duration;

use rocketmq_client_rust::{ClientRuntime, ClientRuntimeConfig, TelemetryHandle};
use rocketmq_runtime::{RuntimeConfig, RuntimeOwner};

use crate::error::Error;

/// Listeners that may run at once on [`OwnedClientRuntime`]'s listener lane.
pub const LISTENER_CONCURRENCY: usize = 16;
/// Listener calls that may wait for the lane on [`OwnedClientRuntime`] before the client
/// refuses more.
pub const LISTENER_QUEUE_DEPTH: usize = 4096;

/// The runtime `rocketmq-client-rust` 1.0 needs before any producer or consumer: a
/// [`RuntimeOwner`] (its own Tokio runtime and blocking lanes) and the [`ClientRuntime`]
/// built on it, with the client's telemetry off.
///
/// The client runs listeners on one blocking lane of the owner. Its default size is made
/// for short file I/O — two per core at once, eight per core waiting — and when the lane is
/// full the client does not wait: it sends the message back for a broker retry (reconsume
/// times + 1, back after 10 s or more). A burst then comes back late, and under sustained
/// load could use up maxReconsumeTimes. A route's stack waits on Redis and PostgreSQL rather
/// than the CPU, so this runtime sizes the lane for that: [`LISTENER_CONCURRENCY`] at once,
/// [`LISTENER_QUEUE_DEPTH`] waiting, 60 s to get a turn; the client's 30 s limit for one call
/// stays. (A call past that limit is also retried by the client while it still runs; the
/// stack answers the second delivery as in flight or a duplicate.)
///
/// A convenience for programs that have no client runtime yet (the tests and examples use
/// it); if you build your own, size that lane the same way. Call
/// [`shutdown`](Self::shutdown) after shutting down the producers and consumers built on it;
/// dropping it without that stops the owner's threads in the background without waiting.
pub struct OwnedClientRuntime {
    owner: Option<RuntimeOwner>,
    client: Arc<ClientRuntime>,
}

impl OwnedClientRuntime {
    /// Builds the runtime; `name` prefixes its thread names.
    pub fn new(name: &str) -> Result<Self, Error> {
        let invalid = |violation: rocketmq_runtime::RuntimeContractViolation| {
            Error::Runtime(violation.to_string().into())
        };
        let mut config = RuntimeConfig {
            thread_name: name.to_owned(),
            ..RuntimeConfig::default()
        }
        .with_max_blocking_threads(4 * LISTENER_CONCURRENCY)
        .map_err(invalid)?;
        let listeners = &mut config.blocking_lane_policies.metadata_io;
        listeners.max_concurrency = LISTENER_CONCURRENCY;
        listeners.max_queue_depth = LISTENER_QUEUE_DEPTH;
        listeners.queue_timeout = Duration::from_secs(60);
        let owner = RuntimeOwner::plan(config)
            .map_err(invalid)?
            .build()
            .map_err(|error| Error::Runtime(Box::new(error)))?;
        let client = ClientRuntime::try_new(
            owner.root_context().component("client"),
            ClientRuntimeConfig::default(),
            TelemetryHandle::noop(),
        )?;
        Ok(OwnedClientRuntime {
            owner: Some(owner),
            client,
        })
    }

    /// The client runtime to build producers and consumers with
    /// (`DefaultMQProducer::builder`, `DefaultMQPushConsumer::builder`).
    pub fn client_runtime(&self) -> Arc<ClientRuntime> {
        Arc::clone(&self.client)
    }

    /// Stops the client runtime's tasks, then the owner's.
    pub async fn shutdown(mut self) {
        let report = self.client.shutdown().await;
        if !report.is_healthy() {
            tracing::warn!(report = %report.to_json(), "RocketMQ client runtime shut down unhealthy");
        }
        if let Some(owner) = self.owner.take() {
            let _ = owner.shutdown_tasks().await;
            let _ = owner.shutdown_background();
        }
    }
}

impl Drop for OwnedClientRuntime {
    fn drop(&mut self) {
        // Dropping a Tokio runtime blocks on its threads, which panics inside async code;
        // shutting it down in the background never blocks.
        if let Some(owner) = self.owner.take() {
            let _ = owner.shutdown_background();
        }
    }
}

impl std::fmt::Debug for OwnedClientRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedClientRuntime").finish_non_exhaustive()
    }
}
