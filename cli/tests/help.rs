//! `--help` shows an example for every subcommand and the exit codes; completions print.

mod common;

use common::{assert_code, oncely};

#[tokio::test]
async fn every_subcommand_has_an_example_and_completions_print() {
    let top = oncely(&["--help"]).await;
    assert_code(&top, 0);
    let text = String::from_utf8_lossy(&top.stdout);
    assert!(text.contains("Exit codes:") && text.contains("4  busy"), "{text}");
    for command in [
        &["inspect"][..],
        &["stuck"],
        &["release"],
        &["mark-done"],
        &["stats"],
        &["purge"],
        &["dlq"],
        &["dlq", "list"],
        &["dlq", "show"],
        &["dlq", "replay"],
        &["dlq", "purge"],
        &["completions"],
    ] {
        let help = oncely(&[command, &["--help"]].concat()).await;
        assert_code(&help, 0);
        let text = String::from_utf8_lossy(&help.stdout);
        assert!(text.contains("Example:\n  oncely "), "{command:?}: {text}");
    }
    let completions = oncely(&["completions", "bash"]).await;
    assert_code(&completions, 0);
    assert!(String::from_utf8_lossy(&completions.stdout).contains("oncely"));
}
