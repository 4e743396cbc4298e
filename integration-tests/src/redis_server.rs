//! Redis servers of a test's own, on free loopback ports, that the test may kill, restart
//! or cluster without disturbing the machine's shared Redis.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free loopback port")
        .port()
}

/// A `redis-server` child process with no persistence: a restart loses every key, like a
/// crash of a cache-only Redis. Killed when dropped.
#[derive(Debug)]
pub struct ScratchRedis {
    port: u16,
    child: Child,
    tls: bool,
}

impl ScratchRedis {
    /// Starts a server on a free port and waits until it answers.
    pub fn start() -> Self {
        Self::start_with(false, &[])
    }

    /// Starts a server that speaks TLS only, with the test CA's certificate, and asks for a
    /// client certificate (`services.sh tls` makes them).
    pub fn start_tls() -> Self {
        Self::start_with(true, &[])
    }

    fn start_with(tls: bool, extra: &[&str]) -> Self {
        let port = free_port();
        ScratchRedis {
            port,
            child: spawn(port, tls, extra),
            tls,
        }
    }

    /// `redis://127.0.0.1:PORT`, or `rediss://` for a TLS server.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// Kills the server with SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on the same port, empty, and waits until it answers.
    pub fn restart(&mut self) {
        self.kill();
        self.child = spawn(self.port, self.tls, &[]);
    }
}

impl Drop for ScratchRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The arguments of a TLS-only server on `port` with the test certificates.
fn tls_args(port: u16) -> Vec<String> {
    let dir = crate::tls::tls_dir();
    let file = |name: &str| dir.join(name).to_string_lossy().into_owned();
    [
        "--port",
        "0",
        "--tls-port",
        &port.to_string(),
        "--tls-cert-file",
        &file("server.pem"),
        "--tls-key-file",
        &file("server.key"),
        "--tls-ca-cert-file",
        &file("ca.pem"),
        "--tls-auth-clients",
        "yes",
        "--tls-cluster",
        "yes",
    ]
    .map(String::from)
    .to_vec()
}

/// `redis-cli`'s arguments for a TLS server: the test CA and client certificate.
fn cli_tls_args() -> Vec<String> {
    let dir = crate::tls::tls_dir();
    let file = |name: &str| dir.join(name).to_string_lossy().into_owned();
    vec![
        "--tls".into(),
        "--cacert".into(),
        file("ca.pem"),
        "--cert".into(),
        file("client.pem"),
        "--key".into(),
        file("client.key"),
    ]
}

fn spawn(port: u16, tls: bool, extra: &[&str]) -> Child {
    let listen = match tls {
        true => tls_args(port),
        false => vec!["--port".into(), port.to_string()],
    };
    let child = Command::new("redis-server")
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(listen)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server on PATH (integration-tests/services.sh installs it)");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "redis-server on port {port} did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// A three-master Redis Cluster of a test's own (no replicas), torn down when dropped.
#[derive(Debug)]
pub struct ScratchRedisCluster {
    nodes: Vec<ScratchRedis>,
    dir: PathBuf,
    tls: bool,
}

impl ScratchRedisCluster {
    /// Starts three cluster-enabled servers, joins them with `redis-cli --cluster create`,
    /// and waits until every node reports `cluster_state:ok`.
    pub fn start() -> Self {
        Self::start_with(false)
    }

    /// The same with every node speaking TLS only, clients and cluster bus alike, asking
    /// for a client certificate (`services.sh tls` makes the certificates).
    pub fn start_tls() -> Self {
        Self::start_with(true)
    }

    fn start_with(tls: bool) -> Self {
        let dir = std::env::temp_dir().join(format!("oncely-cluster-{}", oncely::Token::random()));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        let dir_arg = dir.to_string_lossy().into_owned();
        let nodes: Vec<ScratchRedis> = (0..3)
            .map(|_| {
                let port = free_port();
                let config_file = format!("nodes-{port}.conf");
                let extra = [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &config_file,
                    "--dir",
                    &dir_arg,
                ];
                ScratchRedis {
                    port,
                    child: spawn(port, tls, &extra),
                    tls,
                }
            })
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port))
            .collect();
        let cli_tls = if tls { cli_tls_args() } else { Vec::new() };
        let created = Command::new("redis-cli")
            .args(&cli_tls)
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli on PATH (integration-tests/services.sh installs it)");
        assert!(created.success(), "redis-cli --cluster create failed");
        let cluster = ScratchRedisCluster { nodes, dir, tls };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !cluster.is_ok() {
            assert!(
                Instant::now() < deadline,
                "the cluster did not reach cluster_state:ok"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        cluster
    }

    /// The nodes' URLs, to seed a cluster client.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(ScratchRedis::url).collect()
    }

    fn is_ok(&self) -> bool {
        self.nodes.iter().all(|node| {
            let cli_tls = if self.tls { cli_tls_args() } else { Vec::new() };
            Command::new("redis-cli")
                .args(&cli_tls)
                .args(["-p", &node.port.to_string(), "cluster", "info"])
                .output()
                .is_ok_and(|output| String::from_utf8_lossy(&output.stdout).contains("cluster_state:ok"))
        })
    }
}

impl Drop for ScratchRedisCluster {
    fn drop(&mut self) {
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
