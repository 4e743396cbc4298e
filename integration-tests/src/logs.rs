//! What a test logged: every event at debug level and above, as the application's log
//! would show it.

use std::io::Write;
use std::sync::{Arc, Mutex, MutexGuard};

use tracing::subscriber::DefaultGuard;

/// The log lines of the calling thread, kept from [`CapturedLogs::start`] until dropped. A
/// `#[tokio::test]` runs its tasks (a served app's too) on its one thread, so this is what
/// the test's code logged.
pub struct CapturedLogs {
    text: Sink,
    _installed: DefaultGuard,
}

/// Where the subscriber writes: one buffer shared by every writer it makes.
#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl Sink {
    fn buffer(&self) -> MutexGuard<'_, Vec<u8>> {
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Write for Sink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buffer().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl CapturedLogs {
    /// Starts capturing this thread's logs.
    pub fn start() -> Self {
        let text = Sink::default();
        let writer = text.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        CapturedLogs {
            text,
            _installed: tracing::subscriber::set_default(subscriber),
        }
    }

    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.text.buffer()).into_owned()
    }

    /// The lines logged so far at `level` (`ERROR`, `WARN`, …) that contain `needle`.
    pub fn lines(&self, level: &str, needle: &str) -> Vec<String> {
        self.text()
            .lines()
            .filter(|line| line.contains(level) && line.contains(needle))
            .map(str::to_owned)
            .collect()
    }
}
