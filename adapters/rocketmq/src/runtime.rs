//! The RocketMQ client's own runtime, built and shut down in one place.

use std::sync::Arc;

use rocketmq_client_rust::{ClientRuntime, ClientRuntimeConfig, TelemetryHandle};
use rocketmq_runtime::{RuntimeConfig, RuntimeOwner};

use crate::error::Error;

/// The runtime `rocketmq-client-rust` 1.0 needs before any producer or consumer: a
/// [`RuntimeOwner`] (its own Tokio runtime and blocking lanes) and the [`ClientRuntime`]
/// built on it, with the client's telemetry off.
///
/// A convenience for programs that have no client runtime yet (the tests and examples use
/// it); if you already build one, keep yours. Call [`shutdown`](Self::shutdown) after
/// shutting down the producers and consumers built on it; dropping it without that stops
/// the owner's threads in the background without waiting.
pub struct OwnedClientRuntime {
    owner: Option<RuntimeOwner>,
    client: Arc<ClientRuntime>,
}

impl OwnedClientRuntime {
    /// Builds the runtime; `name` prefixes its thread names.
    pub fn new(name: &str) -> Result<Self, Error> {
        let owner = RuntimeOwner::plan(RuntimeConfig {
            thread_name: name.to_owned(),
            ..RuntimeConfig::default()
        })
        .map_err(|violation| Error::Runtime(violation.to_string().into()))?
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
