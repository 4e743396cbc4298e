//! A TCP proxy in front of a real RabbitMQ: it reads the AMQP methods the client sends (to
//! tell a `basic.reject` from a `basic.nack` on the wire) and can hold back what the broker
//! sends (to make its publisher confirms late), while both sides talk the real protocol.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// One method frame a client sent: its class and method ids and, for `basic.reject` and
/// `basic.nack`, whether it asked for the message to be requeued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Method {
    /// The class id (60: basic).
    pub class: u16,
    /// The method id within the class (80: ack, 90: reject, 120: nack).
    pub method: u16,
    /// For `basic.reject` and `basic.nack`: the requeue flag.
    pub requeue: Option<bool>,
}

impl Method {
    /// True for `basic.reject`.
    pub fn is_reject(&self) -> bool {
        (self.class, self.method) == (60, 90)
    }

    /// True for `basic.nack`.
    pub fn is_nack(&self) -> bool {
        (self.class, self.method) == (60, 120)
    }
}

/// The proxy: accepts connections on a loopback port of its own and relays each to the
/// broker at `upstream` (`host:port`).
pub struct AmqpTap {
    port: u16,
    sent: Arc<Mutex<Vec<Method>>>,
    /// How long the broker's bytes are held back, in milliseconds.
    delay_ms: Arc<AtomicU64>,
    accepting: tokio::task::JoinHandle<()>,
}

impl AmqpTap {
    /// Starts the proxy in front of `upstream`.
    pub async fn start(upstream: &str) -> AmqpTap {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let sent = Arc::new(Mutex::new(Vec::new()));
        let delay_ms = Arc::new(AtomicU64::new(0));
        let accepting = {
            let (sent, delay_ms, upstream) = (sent.clone(), delay_ms.clone(), upstream.to_owned());
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let Ok(broker) = TcpStream::connect(&upstream).await else {
                        continue;
                    };
                    relay(client, broker, sent.clone(), delay_ms.clone());
                }
            })
        };
        AmqpTap {
            port,
            sent,
            delay_ms,
            accepting,
        }
    }

    /// The AMQP address of the proxy, with `address`'s credentials and virtual host.
    pub fn address_for(&self, address: &str) -> String {
        let (scheme, rest) = address.split_once("://").unwrap();
        let (credentials, rest) = rest.rsplit_once('@').map_or(("", rest), |(c, r)| (c, r));
        let path = rest.split_once('/').map_or("", |(_, path)| path);
        let at = if credentials.is_empty() { "" } else { "@" };
        format!("{scheme}://{credentials}{at}127.0.0.1:{}/{path}", self.port)
    }

    /// Every method the clients sent so far, in order.
    pub fn sent(&self) -> Vec<Method> {
        self.sent.lock().unwrap().clone()
    }

    /// Holds back everything the broker sends from now on by `delay` (zero: none).
    pub fn delay_answers(&self, delay: Duration) {
        self.delay_ms.store(
            u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            Ordering::SeqCst,
        );
    }
}

impl Drop for AmqpTap {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

/// Relays one connection: the client's bytes as they come (reading their methods), the
/// broker's after the delay in force when they arrived.
fn relay(client: TcpStream, broker: TcpStream, sent: Arc<Mutex<Vec<Method>>>, delay_ms: Arc<AtomicU64>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut broker_read, mut broker_write) = broker.into_split();
    tokio::spawn(async move {
        let mut frames = FrameReader::default();
        let mut buffer = vec![0; 64 * 1024];
        while let Ok(read) = client_read.read(&mut buffer).await {
            if read == 0 || broker_write.write_all(&buffer[..read]).await.is_err() {
                break;
            }
            let methods = frames.push(&buffer[..read]);
            sent.lock().unwrap().extend(methods);
        }
        let _ = broker_write.shutdown().await;
    });
    let (held, mut due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    tokio::spawn(async move {
        let mut buffer = vec![0; 64 * 1024];
        while let Ok(read) = broker_read.read(&mut buffer).await {
            let delay = Duration::from_millis(delay_ms.load(Ordering::SeqCst));
            if read == 0
                || held
                    .send((Instant::now() + delay, buffer[..read].to_vec()))
                    .is_err()
            {
                break;
            }
        }
    });
    tokio::spawn(async move {
        while let Some((at, bytes)) = due.recv().await {
            tokio::time::sleep_until(at.into()).await;
            if client_write.write_all(&bytes).await.is_err() {
                break;
            }
        }
        let _ = client_write.shutdown().await;
    });
}

/// Cuts a client's byte stream into AMQP frames and reads their methods.
#[derive(Default)]
struct FrameReader {
    pending: Vec<u8>,
    /// The 8-byte protocol header that opens the stream has been skipped.
    started: bool,
}

impl FrameReader {
    fn push(&mut self, bytes: &[u8]) -> Vec<Method> {
        self.pending.extend_from_slice(bytes);
        if !self.started {
            if self.pending.len() < 8 {
                return Vec::new();
            }
            self.pending.drain(..8);
            self.started = true;
        }
        let mut methods = Vec::new();
        // A frame: type (1), channel (2), size (4), payload (size), end marker (1).
        while self.pending.len() >= 7 {
            let size = u32::from_be_bytes(self.pending[3..7].try_into().unwrap()) as usize;
            if self.pending.len() < 7 + size + 1 {
                break;
            }
            let frame: Vec<u8> = self.pending.drain(..7 + size + 1).collect();
            let payload = &frame[7..7 + size];
            if frame[0] == 1 && payload.len() >= 4 {
                let class = u16::from_be_bytes([payload[0], payload[1]]);
                let method = u16::from_be_bytes([payload[2], payload[3]]);
                // reject: delivery-tag (8), then requeue as bit 0; nack: bit 0 multiple, bit 1 requeue.
                let bits = payload.get(12).copied().unwrap_or(0);
                let requeue = match (class, method) {
                    (60, 90) => Some(bits & 1 == 1),
                    (60, 120) => Some(bits & 2 == 2),
                    _ => None,
                };
                methods.push(Method {
                    class,
                    method,
                    requeue,
                });
            }
        }
        methods
    }
}
