//! A TCP proxy that loses the answer to a commit, for either SQL server.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How a server's commit looks on the wire.
#[derive(Clone, Copy, Debug)]
pub struct CommitOnTheWire {
    /// Bytes in the client's packet that commits.
    pub sent: &'static [u8],
    /// Bytes in the server's answer once the commit is durable; `None`: the server's first
    /// answer after the commit was sent, after which the proxy waits 300 ms, so that a
    /// commit sent with other statements in one packet has run too.
    pub answered: Option<&'static [u8]>,
}

/// A TCP proxy in front of a SQL server that can lose the answer to a commit:
/// once [armed](CommitAnswerThief::arm), the next connection whose client sends a `COMMIT`
/// gets cut off as soon as the server's answer says `COMMIT` — the server committed, the
/// client never hears it, as when a network path or the client's host fails at that moment.
#[derive(Debug)]
pub struct CommitAnswerThief {
    port: u16,
    armed: Arc<AtomicBool>,
    stolen: Arc<AtomicUsize>,
}

impl CommitAnswerThief {
    /// Starts the proxy in front of `server` (`host:port`) on a free loopback port, on the
    /// current runtime.
    pub async fn relaying(server: String, commit: CommitOnTheWire) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a free port");
        let port = listener.local_addr().expect("the port").port();
        let (armed, stolen) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
        let thief = CommitAnswerThief {
            port,
            armed: armed.clone(),
            stolen: stolen.clone(),
        };
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(&server)
                    .await
                    .expect("the SQL server");
                tokio::spawn(relay(client, server, commit, armed.clone(), stolen.clone()));
            }
        });
        thief
    }

    /// The loopback port the proxy listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The next `COMMIT` sent through the proxy loses its answer.
    pub fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// How many commit answers were lost so far.
    pub fn stolen(&self) -> usize {
        self.stolen.load(Ordering::SeqCst)
    }
}

/// Copies bytes both ways; see [`CommitAnswerThief`].
async fn relay(
    client: TcpStream,
    server: TcpStream,
    commit: CommitOnTheWire,
    armed: Arc<AtomicBool>,
    stolen: Arc<AtomicUsize>,
) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let marked = Arc::new(AtomicBool::new(false));
    let to_server = {
        let marked = marked.clone();
        async move {
            let mut buffer = vec![0; 64 * 1024];
            loop {
                let read = match client_read.read(&mut buffer).await {
                    Ok(0) | Err(_) => return,
                    Ok(read) => read,
                };
                let chunk = &buffer[..read];
                if contains(chunk, commit.sent) && armed.swap(false, Ordering::SeqCst) {
                    marked.store(true, Ordering::SeqCst);
                }
                if server_write.write_all(chunk).await.is_err() {
                    return;
                }
            }
        }
    };
    let to_client = async move {
        let mut buffer = vec![0; 64 * 1024];
        loop {
            let read = match server_read.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(read) => read,
            };
            let chunk = &buffer[..read];
            if marked.load(Ordering::SeqCst) {
                let committed = match commit.answered {
                    Some(answer) => contains(chunk, answer),
                    None => {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        true
                    }
                };
                if committed {
                    stolen.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            }
            if client_write.write_all(chunk).await.is_err() {
                return;
            }
        }
    };
    // Whichever direction ends first ends both: the client sees its connection close.
    tokio::select! {
        () = to_server => {}
        () = to_client => {}
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle)
}
