//! The peer: mq-bridge 1.3's deduplication route (`bench-peers/mq-bridge`, a crate of its
//! own so that its dependency tree stays out of the workspace's build), run as a process of
//! its own on a queue the bench filled. `make bench` builds it and names its binary in
//! `MQ_BRIDGE_PEER`; without it, the peer's rows are left out.

use std::path::PathBuf;
use std::process::Command;

use integration_tests::amqp::amqp_addr;
use integration_tests::postgres::database_url;
use serde::Deserialize;

use super::services::Services;

/// The variable that names the peer's binary.
const BINARY: &str = "MQ_BRIDGE_PEER";

/// The peer's binary, or why it cannot run.
pub(super) fn binary() -> Result<PathBuf, String> {
    let path = std::env::var_os(BINARY)
        .map(PathBuf::from)
        .ok_or_else(|| format!("{BINARY} is not set (`make bench` builds the peer and sets it)"))?;
    match path.is_file() {
        true => Ok(path),
        false => Err(format!("{BINARY}={} is not a file", path.display())),
    }
}

/// The line the peer prints once every message is settled.
#[derive(Deserialize)]
struct Drained {
    seen: usize,
    seconds: f64,
}

/// Drains `messages` from `queue` through the peer at `prefetch`, its rows in the bench's
/// schema; its rate, from its first delivery to its last ack.
pub(super) async fn drain(services: &Services, queue: &str, prefetch: u16, messages: usize) -> f64 {
    let binary = binary().expect("the peer's binary");
    // Without TLS, as the bench's own connections: sqlx would use it where the server
    // offers it.
    let url = database_url();
    let url = match url.contains("sslmode=") {
        true => url,
        false if url.contains('?') => format!("{url}&sslmode=disable"),
        false => format!("{url}?sslmode=disable"),
    };
    let mut command = Command::new(binary);
    command.args([
        "--amqp-addr",
        &amqp_addr(),
        "--queue",
        queue,
        "--database-url",
        &url,
    ]);
    command.args(["--schema", services.schema.name()]);
    command.args([
        "--messages",
        &messages.to_string(),
        "--prefetch",
        &prefetch.to_string(),
    ]);
    let output = tokio::task::spawn_blocking(move || command.output())
        .await
        .expect("the peer's task")
        .expect("the peer runs");
    assert!(
        output.status.success(),
        "the peer failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let drained: Drained = serde_json::from_slice(&output.stdout).expect("the peer's line");
    assert_eq!(drained.seen, messages, "the peer saw every message");
    messages as f64 / drained.seconds
}
