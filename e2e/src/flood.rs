//! The hostile-load probe, as a measurement: a local pool over TLS and a webhook process, then
//! the same figures without and under a flood of idle TCP connections and of TLS connections
//! that never send a request (from other loopback sources than the clients, re-opened a second
//! after the server closes them): admission request latency on fresh TLS connections,
//! `poolctl status` latency, and the success rate of fresh handshakes to every gateway and
//! member port within the clients' 1 s connect time-out.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;

use crate::local::{self, Config, LocalPool};
use crate::process::Process;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Pool(#[from] local::Error),
    #[error(transparent)]
    Process(#[from] crate::process::Error),
    #[error(transparent)]
    Tls(#[from] plumbing::tls::TlsError),
    #[error("TLS client: {0}")]
    Client(#[from] rustls::Error),
    #[error("the webhook did not become ready within {0:?}")]
    WebhookNotReady(Duration),
    #[error("the local pool runs without TLS")]
    Plaintext,
    #[error("store: {0}")]
    Store(#[from] gateway::store::Error),
    #[error("the drain under the flood: {0}")]
    Drain(#[from] crate::scenarios::Error),
}

/// What to flood with and how much to measure.
#[derive(Clone, Debug)]
pub struct Setup {
    pub root: PathBuf,
    /// Idle TCP connections per port.
    pub idle: usize,
    /// Request-less TLS connections per port.
    pub silent: usize,
    /// Measurement rounds per phase (a review and a handshake to every port; `poolctl
    /// status` every fifth).
    pub samples: usize,
    /// Shortest measurement per phase (long enough for the flood to meet the time-outs).
    pub lasting: Duration,
}

/// One phase's figures.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Figures {
    pub phase: String,
    pub admission_p50_ms: f64,
    pub admission_p99_ms: f64,
    pub admission_failed: usize,
    pub reviews: usize,
    pub status_p50_ms: f64,
    pub status_max_ms: f64,
    pub status_failed: usize,
    pub handshakes: usize,
    pub handshakes_ok: usize,
    pub status_runs: usize,
    /// A drain of two sessions (`max_parallel` 2) during the phase: request → succeeded.
    pub drain_seconds: Option<f64>,
    /// The longest counter gap any agent saw during that drain.
    pub drain_gap_ms: Option<u64>,
}

/// A small AdmissionReview (Pod CREATE in a namespace the webhook injects into).
const REVIEW: &str = r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"4b8a3f42-0000-4000-8000-000000000001","kind":{"group":"","version":"v1","kind":"Pod"},"resource":{"group":"","version":"v1","resource":"pods"},"namespace":"team-a","operation":"CREATE","object":{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p","namespace":"team-a"},"spec":{"containers":[{"name":"app","image":"busybox"}]}}}}"#;

/// Pause between two measurement rounds.
const ROUND_PAUSE: Duration = Duration::from_millis(50);

/// The webhook's bound on one review (the API server's default webhook time-out).
const REVIEW_BOUND: Duration = Duration::from_secs(10);

/// Runs the probe; returns the figures without and with the flood, and the webhook's
/// connection counters after it.
pub async fn run(setup: &Setup) -> Result<(Vec<Figures>, String), Error> {
    let pool = LocalPool::start(Config {
        root: setup.root.clone(),
        database_url: None,
        gateways: 2,
        members: 2,
        // Four, so that the drain under the flood moves two sessions (as the drain scenario).
        sandboxes: 4,
        lease_length_ms: 5000,
        plaintext: false,
        agent_interval_ms: crate::local::AGENT_INTERVAL_MS,
        members_on_standby: false,
        cuttable_links: false,
        policy: None,
        secrets: None,
    })
    .await?;
    let outcome = measure(&pool, setup).await;
    pool.stop().await;
    outcome
}

async fn measure(pool: &LocalPool, setup: &Setup) -> Result<(Vec<Figures>, String), Error> {
    let tls = pool.tls.as_ref().ok_or(Error::Plaintext)?;
    let (webhook, metrics, process) = start_webhook(pool).await?;
    let connector = connector(&tls.ca).await?;
    let mut ports: Vec<SocketAddr> = Vec::new();
    for url in pool
        .endpoints()
        .iter()
        .chain(pool.members.iter().map(|m| &m.runtime_address))
    {
        if let Some(address) = url.strip_prefix("https://").and_then(|a| a.parse().ok()) {
            ports.push(address);
        }
    }
    let probe = Probe {
        connector,
        webhook,
        ports: ports.clone(),
        poolctl: Poolctl::new(pool),
    };
    let mut figures = vec![probe.figures("no flood", setup.samples, Duration::ZERO).await];

    let stop = CancellationToken::new();
    let targets: Vec<SocketAddr> = ports.iter().copied().chain([webhook]).collect();
    for target in &targets {
        for _ in 0..setup.idle {
            tokio::spawn(idle_tcp(*target, stop.clone()));
        }
        for _ in 0..setup.silent {
            tokio::spawn(silent_tls(*target, probe.connector.clone(), stop.clone()));
        }
    }
    // Let every flood connection reach its listener (and the old loop's pending slots fill).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut flooded = probe.figures("under flood", setup.samples, setup.lasting).await;
    // A planned move while the flood goes on: the members' and gateways' ports are full of
    // hostile connections, the handoffs must still go through.
    let store = gateway::store::Store::open(pool.database_url(), &gateway::store::Options::default()).await?;
    let drain = crate::scenarios::planned(pool, &store, crate::scenarios::Planned::Drain).await;
    store.close().await;
    let drain = drain?;
    flooded.drain_seconds = Some(drain.seconds);
    flooded.drain_gap_ms = Some(drain.max_counter_gap_ms);
    figures.push(flooded);
    stop.cancel();
    let counters = crate::local::http_get(&metrics.to_string(), "/metrics", Duration::from_secs(5))
        .await
        .map(|body| {
            body.lines()
                .filter(|l| l.starts_with("openshell_webhook_connections") && !l.starts_with('#'))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_else(|| "no /metrics within 5 s".to_owned());
    process.stop(Duration::from_secs(5)).await;
    Ok((figures, counters))
}

/// Start a webhook process with the pool's TLS files; answers once it is ready: its HTTPS
/// address, its health port (`/metrics`) and the process.
pub async fn start_webhook(pool: &LocalPool) -> Result<(SocketAddr, SocketAddr, Process), Error> {
    let tls = pool.tls.as_ref().ok_or(Error::Plaintext)?;
    let listen: SocketAddr = ([127, 0, 0, 1], local::free_port()?).into();
    let metrics: SocketAddr = ([127, 0, 0, 1], local::free_port()?).into();
    let args: Vec<String> = vec![
        "--listen".into(),
        listen.to_string(),
        "--metrics-listen".into(),
        metrics.to_string(),
        "--tls-cert".into(),
        tls.cert.display().to_string(),
        "--tls-key".into(),
        tls.key.display().to_string(),
        "--log-format".into(),
        "text".into(),
    ];
    let program = local::binary_dir().join("webhook");
    let log = pool.logs().join("webhook.log");
    let process = Process::spawn("webhook", &program, &args, &[], log)?;
    let limit = Duration::from_secs(30);
    let deadline = Instant::now() + limit;
    while !crate::local::http_get(&metrics.to_string(), "/readyz", Duration::from_secs(5))
        .await
        .is_some_and(|b| b.starts_with("ready"))
    {
        if Instant::now() > deadline {
            return Err(Error::WebhookNotReady(limit));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok((listen, metrics, process))
}

async fn connector(ca: &std::path::Path) -> Result<TlsConnector, Error> {
    let pem = plumbing::tls::read_ca(ca).await?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(&pem).flatten() {
        roots.add(cert)?;
    }
    let config = rustls::ClientConfig::builder_with_provider(plumbing::tls::provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}

/// `poolctl status` against the pool's gateways.
struct Poolctl {
    program: PathBuf,
    args: Vec<String>,
}

impl Poolctl {
    fn new(pool: &LocalPool) -> Self {
        let mut args = Vec::new();
        for endpoint in pool.endpoints() {
            args.extend(["--gateway".to_owned(), endpoint]);
        }
        let token = pool.credentials().join("operator").join(proto::trust::TOKEN_FILE);
        args.extend(["--token-file".to_owned(), token.display().to_string()]);
        if let Some(tls) = &pool.tls {
            args.extend(["--tls-ca".to_owned(), tls.ca.display().to_string()]);
        }
        args.push("status".to_owned());
        Self {
            program: local::binary_dir().join("poolctl"),
            args,
        }
    }

    /// How long one `poolctl status` took, if it succeeded.
    async fn status(&self) -> Option<Duration> {
        let started = Instant::now();
        let output = tokio::process::Command::new(&self.program)
            .args(&self.args)
            .kill_on_drop(true)
            .output();
        let output = tokio::time::timeout(Duration::from_secs(30), output).await.ok()?.ok()?;
        output.status.success().then(|| started.elapsed())
    }
}

struct Probe {
    connector: TlsConnector,
    webhook: SocketAddr,
    ports: Vec<SocketAddr>,
    poolctl: Poolctl,
}

impl Probe {
    /// At least `samples` rounds (a review and a handshake to every port; `poolctl status`
    /// every fifth) and at least `lasting`.
    async fn figures(&self, phase: &str, samples: usize, lasting: Duration) -> Figures {
        let mut admission = Vec::new();
        let mut status = Vec::new();
        let mut figures = Figures {
            phase: phase.to_owned(),
            ..Figures::default()
        };
        let started = Instant::now();
        let mut round = 0;
        while round < samples || started.elapsed() < lasting {
            match tokio::time::timeout(REVIEW_BOUND, self.review()).await {
                Ok(Ok(took)) => admission.push(took),
                _ => figures.admission_failed += 1,
            }
            for port in &self.ports {
                figures.handshakes += 1;
                if self.handshake(*port).await {
                    figures.handshakes_ok += 1;
                }
            }
            if round % 5 == 0 {
                match self.poolctl.status().await {
                    Some(took) => status.push(took),
                    None => figures.status_failed += 1,
                }
            }
            round += 1;
            figures.reviews = round;
            // Paced like a steady trickle of Pod creations.
            tokio::time::sleep(ROUND_PAUSE).await;
        }
        figures.admission_p50_ms = percentile(&mut admission, 0.50);
        figures.admission_p99_ms = percentile(&mut admission, 0.99);
        figures.status_runs = status.len() + figures.status_failed;
        figures.status_p50_ms = percentile(&mut status, 0.50);
        figures.status_max_ms = percentile(&mut status, 1.0);
        figures
    }

    /// One review on a fresh TLS connection, as the API server makes it after an idle close.
    async fn review(&self) -> std::io::Result<Duration> {
        let started = Instant::now();
        let tcp = TcpStream::connect(self.webhook).await?;
        let name = ServerName::try_from("localhost").map_err(std::io::Error::other)?;
        let mut tls = self.connector.connect(name, tcp).await?;
        let head = format!(
            "POST /mutate HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            REVIEW.len()
        );
        tls.write_all(head.as_bytes()).await?;
        tls.write_all(REVIEW.as_bytes()).await?;
        let mut answer = Vec::new();
        tls.read_to_end(&mut answer).await?;
        if answer.starts_with(b"HTTP/1.1 200") {
            Ok(started.elapsed())
        } else {
            Err(std::io::Error::other("not answered 200"))
        }
    }

    /// A fresh TCP connect and TLS handshake within the clients' connect time-out.
    async fn handshake(&self, port: SocketAddr) -> bool {
        let attempt = async {
            let tcp = TcpStream::connect(port).await.ok()?;
            let name = ServerName::try_from("localhost").ok()?;
            self.connector.connect(name, tcp).await.ok()
        };
        matches!(
            tokio::time::timeout(proto::timing::CONNECT_TIMEOUT, attempt).await,
            Ok(Some(_))
        )
    }
}

/// The `q` quantile of `samples` in milliseconds (0 when empty).
fn percentile(samples: &mut [Duration], q: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    samples.sort();
    let rank = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len());
    samples[rank - 1].as_secs_f64() * 1000.0
}

/// Pause between a flood connection's close and its next one.
const REOPEN_AFTER: Duration = Duration::from_secs(1);

async fn connect_from(source: [u8; 4], target: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind((source, 0).into())?;
    socket.connect(target).await
}

/// Waits until the peer closes `stream` (or `stop`).
async fn until_closed(stream: &mut (impl tokio::io::AsyncRead + Unpin), stop: &CancellationToken) {
    let mut buf = [0u8; 512];
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            read = stream.read(&mut buf) => if matches!(read, Ok(0) | Err(_)) { return },
        }
    }
}

/// One idle TCP connection from 127.0.0.2, re-opened after the server closes it.
async fn idle_tcp(target: SocketAddr, stop: CancellationToken) {
    while !stop.is_cancelled() {
        if let Ok(mut tcp) = connect_from([127, 0, 0, 2], target).await {
            until_closed(&mut tcp, &stop).await;
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(REOPEN_AFTER) => {}
        }
    }
}

/// One TLS connection from 127.0.0.3 that never sends a request, re-opened after it is closed.
async fn silent_tls(target: SocketAddr, connector: TlsConnector, stop: CancellationToken) {
    while !stop.is_cancelled() {
        if let (Ok(tcp), Ok(name)) = (
            connect_from([127, 0, 0, 3], target).await,
            ServerName::try_from("localhost"),
        ) && let Ok(mut tls) = connector.connect(name, tcp).await
        {
            until_closed(&mut tls, &stop).await;
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(REOPEN_AFTER) => {}
        }
    }
}

/// The figures as a Markdown table.
pub fn table(figures: &[Figures]) -> String {
    let mut out = String::from(
        "| phase | admission p50 / p99 (fresh TLS) | failed / reviews | poolctl status p50 / max | failed / runs | fresh handshakes ≤ 1 s | drain of 2: seconds / counter gap |\n|---|---|---|---|---|---|---|\n",
    );
    for f in figures {
        out.push_str(&format!(
            "| {} | {:.1} / {:.1} ms | {} / {} | {:.0} / {:.0} ms | {} / {} | {} / {} | {} |\n",
            f.phase,
            f.admission_p50_ms,
            f.admission_p99_ms,
            f.admission_failed,
            f.reviews,
            f.status_p50_ms,
            f.status_max_ms,
            f.status_failed,
            f.status_runs,
            f.handshakes_ok,
            f.handshakes,
            match (f.drain_seconds, f.drain_gap_ms) {
                (Some(s), Some(g)) => format!("{s:.2} s / {g} ms"),
                _ => "—".to_owned(),
            }
        ));
    }
    out
}
