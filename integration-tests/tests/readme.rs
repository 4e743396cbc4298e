//! The README's code that is meant to be copied: it must be the code that is built and run.

use std::path::Path;

fn read(path: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::read_to_string(root.join(path)).unwrap_or_else(|error| panic!("{path}: {error}"))
}

/// The first Rust block of the README after `marker`.
fn rust_block_after(readme: &str, marker: &str) -> String {
    let after_marker = &readme[readme
        .find(marker)
        .unwrap_or_else(|| panic!("the marker {marker}"))..];
    let block_start = after_marker
        .find("```rust\n")
        .expect("a rust block after the marker")
        + "```rust\n".len();
    let block = &after_marker[block_start..];
    block[..block.find("\n```").expect("the block's end")].to_owned()
}

#[test]
fn the_http_example_in_the_readme_is_the_one_ci_builds() {
    for (marker, file) in [
        ("<!-- http-orders:", "examples/payment-callback/src/orders.rs"),
        (
            "<!-- http-orders-mariadb:",
            "examples/payment-callback/src/orders_mariadb.rs",
        ),
    ] {
        the_readme_shows(marker, file);
    }
}

/// Asserts that the README's Rust block after `marker` is the `README: begin`…`end` part
/// of `file`, in at most 15 lines.
fn the_readme_shows(marker: &str, file: &str) {
    let shown = rust_block_after(&read("README.md"), marker);
    let example = read(file);
    let begin = example.find("// README: begin\n").expect("the begin marker") + "// README: begin\n".len();
    let end = example.find("// README: end").expect("the end marker");
    assert_eq!(
        shown,
        example[begin..end].trim_end(),
        "README's HTTP example ({file}) differs"
    );
    assert!(
        shown.lines().count() <= 15,
        "the README's HTTP example ({file}) is over 15 lines"
    );
}

#[test]
fn the_first_consumer_in_the_readme_is_the_example_ci_builds_and_runs() {
    let shown = rust_block_after(&read("README.md"), "<!-- first-consumer:");

    let example = read("examples/first-consumer/src/main.rs");
    let code = &example[example
        .find("use std::time::Duration;")
        .expect("the example's first use")..];
    assert_eq!(
        shown,
        code.trim_end(),
        "README's first consumer differs from the example"
    );
}
