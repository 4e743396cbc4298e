//! Running the built `oncely` as an operator would, and reading what it printed; the
//! business table the tests count effects in.

// Each test binary uses its part of these.
#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use integration_tests::postgres::{ScratchSchema, pool, schema_pool};
use serde_json::Value;

/// Runs `oncely` with `arguments` (standard input empty: a prompt is answered with no) on a
/// thread of its own, so that the test's runtime goes on meanwhile.
pub(crate) async fn oncely(arguments: &[impl AsRef<str>]) -> Output {
    oncely_without(arguments, &[]).await
}

/// [`oncely`] with the environment variables `unset` taken out of its environment: as an
/// operator whose shell has no `REDIS_URL` runs it.
pub(crate) async fn oncely_without(arguments: &[impl AsRef<str>], unset: &[&str]) -> Output {
    let arguments: Vec<String> = arguments
        .iter()
        .map(|argument| argument.as_ref().to_owned())
        .collect();
    let unset: Vec<String> = unset.iter().map(|name| name.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let mut command = Command::new(env!("CARGO_BIN_EXE_oncely"));
        for name in unset {
            command.env_remove(name);
        }
        command
            .args(&arguments)
            .stdin(Stdio::null())
            .output()
            .expect("oncely runs")
    })
    .await
    .unwrap()
}

/// Its standard output, as text.
pub(crate) fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `base` followed by `more`, as owned arguments.
pub(crate) fn args(base: &[&str], more: &[&str]) -> Vec<String> {
    base.iter()
        .chain(more)
        .map(|argument| argument.to_string())
        .collect()
}

/// Its exit code.
pub(crate) fn code(output: &Output) -> i32 {
    output.status.code().expect("exited, not killed")
}

/// Its standard output as JSON; panics with both outputs if it is not.
pub(crate) fn json(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|error| {
        panic!(
            "not JSON ({error}): stdout {:?}, stderr {:?}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// Its standard error, as text.
pub(crate) fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Asserts that it exited with `expected`, showing both outputs if not.
pub(crate) fn assert_code(output: &Output, expected: i32) {
    assert_eq!(
        code(output),
        expected,
        "stdout {:?}, stderr {:?}",
        String::from_utf8_lossy(&output.stdout),
        stderr(output)
    );
}

/// A schema of the test's own with an `effects` table that counts every application (no
/// unique index: an effect applied twice shows as two rows), and a pool that searches it.
pub(crate) async fn effects_schema() -> (ScratchSchema, Pool) {
    let schema = ScratchSchema::new(&pool(2)).await;
    schema
        .execute("CREATE TABLE effects (order_id TEXT NOT NULL)")
        .await;
    let pool = schema_pool(schema.name(), 4);
    (schema, pool)
}

/// How many times `key`'s effect was applied.
pub(crate) async fn effects_of(schema: &ScratchSchema, key: &str) -> i64 {
    schema
        .count(&format!("SELECT count(*) FROM effects WHERE order_id = '{key}'"))
        .await
}

/// The reason codes of a `dlq list --json` report, sorted; `-` for a message that is not
/// oncely's.
pub(crate) fn reasons(list: &Value) -> Vec<String> {
    let mut reasons: Vec<String> = list["dead_letters"]
        .as_array()
        .unwrap_or_else(|| panic!("a list: {list}"))
        .iter()
        .map(|letter| letter["reason"].as_str().unwrap_or("-").to_owned())
        .collect();
    reasons.sort();
    reasons
}

/// The address (`127.0.0.1:PORT`) of a server that takes every connection and never says a
/// word: what an overloaded or half-dead store looks like from a client, which a refused
/// port does not show (the connection is open; only the answer never comes). Its thread
/// holds the connections for the rest of the test binary's life.
pub(crate) fn silent_server() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
    let address = listener.local_addr().expect("its address").to_string();
    std::thread::spawn(move || {
        let mut held: Vec<TcpStream> = Vec::new();
        for connection in listener.incoming() {
            held.extend(connection.ok());
        }
    });
    address
}

/// Runs `oncely` with `arguments` against a service that does not answer, and asserts what
/// an operator relies on: exit 1 within `bound` (killed and failed if still running then:
/// a hang), with an error naming `service` at `address` that says it did not answer.
pub(crate) async fn assert_times_out(
    arguments: &[impl AsRef<str>],
    service: &str,
    address: &str,
    bound: Duration,
) {
    let arguments: Vec<String> = arguments
        .iter()
        .map(|argument| argument.as_ref().to_owned())
        .collect();
    let started = Instant::now();
    let output = tokio::task::spawn_blocking(move || {
        let mut child = Command::new(env!("CARGO_BIN_EXE_oncely"))
            .args(&arguments)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("oncely runs");
        while child.try_wait().expect("its status").is_none() {
            if started.elapsed() > bound {
                let _ = child.kill();
                panic!("oncely {arguments:?} still ran after {bound:?}: a hang");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        child.wait_with_output().expect("its output")
    })
    .await
    .unwrap();
    assert_code(&output, 1);
    let error = stderr(&output);
    assert!(
        error.contains(&format!("{service} at "))
            && error.contains(address)
            && error.contains("did not answer within"),
        "{error}"
    );
}
