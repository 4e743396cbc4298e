//! The README's code that is meant to be copied: it must be the code that is built and run.

use std::path::Path;

fn read(path: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::read_to_string(root.join(path)).unwrap_or_else(|error| panic!("{path}: {error}"))
}

#[test]
fn the_first_consumer_in_the_readme_is_the_example_ci_builds_and_runs() {
    let readme = read("README.md");
    let marker = "<!-- first-consumer:";
    let after_marker = &readme[readme.find(marker).expect("the first-consumer marker")..];
    let block_start = after_marker
        .find("```rust\n")
        .expect("a rust block after the marker")
        + "```rust\n".len();
    let block = &after_marker[block_start..];
    let shown = &block[..block.find("\n```").expect("the block's end")];

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
