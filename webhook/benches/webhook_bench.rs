//! Load benchmark (not a timed test): `cargo bench -p webhook --bench webhook-bench`.
//!
//! Starts the real `webhook` binary on loopback TLS and, in the same run, a floor server (a
//! minimal hyper + rustls server answering a constant AdmissionReview without parsing, same
//! TLS and HTTP stack). Sends the same open-loop load to each from a concurrent client (N
//! keep-alive HTTP/1.1 connections, requests scheduled at a fixed rate), and reports
//! throughput, latency percentiles (hdrhistogram, measured from each request's *scheduled*
//! send time, so a stalled server cannot hide queueing) and the servers' peak RSS (VmHWM).
//!
//! Settings (environment): BENCH_RATE (req/s, default 1000), BENCH_SECS (default 10),
//! BENCH_CONNS (default 16), BENCH_WARMUP_SECS (default 2), BENCH_FIXTURE (default
//! pod-create-plain.json). Without `--bench` (i.e. under `cargo test --benches`) it runs a
//! 1-second smoke pass at 200 req/s.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use http_body_util::{BodyExt as _, Full};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;

const FLOOR_ENV: &str = "WEBHOOK_BENCH_FLOOR_SERVER";

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The floor: TLS + HTTP/1.1/2 like the webhook, reads the body, answers a constant review.
async fn floor_server(port: u16, cert: String, key: String) {
    let chain = CertificateDer::pem_file_iter(&cert)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(&key).unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind(("127.0.0.1", port)).await.unwrap();
    let constant = Bytes::from_static(
        br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":"00000000-0000-0000-0000-000000000000","allowed":true}}"#,
    );
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).keep_alive(true);
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let builder = builder.clone();
        let constant = constant.clone();
        tokio::spawn(async move {
            let Ok(tls) = acceptor.accept(tcp).await else {
                return;
            };
            let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                let constant = constant.clone();
                async move {
                    let _ = req.into_body().collect().await;
                    Ok::<_, std::convert::Infallible>(
                        hyper::Response::builder()
                            .header("content-type", "application/json")
                            .body(Full::new(constant))
                            .unwrap(),
                    )
                }
            });
            let _ = builder.serve_connection(TokioIo::new(tls), service).await;
        });
    }
}

struct Server {
    name: &'static str,
    child: Child,
    addr: SocketAddr,
}

impl Server {
    fn peak_rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    }
}

impl Server {
    /// utime + stime of the server process, in seconds.
    fn cpu_seconds(&self) -> f64 {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())) else {
            return 0.0;
        };
        // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
        let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let fields: Vec<&str> = after.split_whitespace().collect();
        let ticks: f64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
            + fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
        ticks / 100.0
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Report {
    sent: u64,
    ok: u64,
    errors: u64,
    elapsed: Duration,
    /// From the intended send time when the connection was still busy with the previous
    /// request at that time (coordinated-omission correction), else from the actual send
    /// (so the client's 1 ms timer granularity is not counted as server latency).
    latency_us: Histogram<u64>,
    /// From the actual send time.
    service_us: Histogram<u64>,
    /// Server CPU time spent during the measured slices.
    server_cpu: f64,
}

impl Report {
    fn new() -> Self {
        Self {
            sent: 0,
            ok: 0,
            errors: 0,
            elapsed: Duration::ZERO,
            latency_us: Histogram::new_with_bounds(1, 60_000_000, 3).unwrap(),
            service_us: Histogram::new_with_bounds(1, 60_000_000, 3).unwrap(),
            server_cpu: 0.0,
        }
    }
    fn add(&mut self, other: &Report) {
        self.sent += other.sent;
        self.ok += other.ok;
        self.errors += other.errors;
        self.elapsed += other.elapsed;
        self.server_cpu += other.server_cpu;
        self.latency_us.add(&other.latency_us).unwrap();
        self.service_us.add(&other.service_us).unwrap();
    }
    fn throughput(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64()
    }
    fn ms(h: &Histogram<u64>, q: f64) -> f64 {
        h.value_at_quantile(q) as f64 / 1000.0
    }
}

/// Open-loop load: request i is due at start + i/rate; connection i % conns sends it.
async fn load(
    clients: Vec<common::TlsClient>,
    body: Arc<Vec<u8>>,
    expect: &'static str,
    rate: u64,
    duration: Duration,
) -> (Report, Vec<common::TlsClient>) {
    let conns = clients.len();
    let total = (rate as f64 * duration.as_secs_f64()) as u64;
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let start = tokio::time::Instant::now() + Duration::from_millis(20);
    let mut tasks = Vec::new();
    for (k, mut client) in clients.into_iter().enumerate() {
        let body = Arc::clone(&body);
        tasks.push(tokio::spawn(async move {
            let mut report = Report::new();
            let mut previous_done = start;
            let mut i = k as u64;
            while i < total {
                let due = start + interval.mul_f64(i as f64);
                tokio::time::sleep_until(due).await;
                let sent = tokio::time::Instant::now();
                report.sent += 1;
                match client.post("/mutate", body.as_ref().clone()).await {
                    Ok((200, response)) if memchr(&response, expect.as_bytes()) => {
                        let done = tokio::time::Instant::now();
                        let from = if previous_done > due { due } else { sent };
                        let _ = report.latency_us.record((done - from).as_micros().max(1) as u64);
                        let _ = report.service_us.record((done - sent).as_micros().max(1) as u64);
                        report.ok += 1;
                        previous_done = done;
                    }
                    _ => {
                        report.errors += 1;
                        previous_done = tokio::time::Instant::now();
                    }
                }
                i += conns as u64;
            }
            (report, client)
        }));
    }
    let mut report = Report::new();
    let mut clients = Vec::with_capacity(conns);
    for task in tasks {
        let (part, client) = task.await.unwrap();
        report.add(&part);
        clients.push(client);
    }
    report.elapsed = tokio::time::Instant::now() - start;
    (report, clients)
}

/// Does the start of the response contain `needle`? (Both servers put the checked field in
/// the first bytes; scanning only those keeps the client's cost equal for both.)
fn memchr(haystack: &[u8], needle: &[u8]) -> bool {
    haystack[..haystack.len().min(256)]
        .windows(needle.len())
        .any(|w| w == needle)
}

async fn wait_ready(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if common::served_cert(addr).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("server at {addr} did not come up");
}

fn print(name: &str, r: &Report, rss_kib: Option<u64>) {
    println!(
        "{name:<8} sent {:>6}  ok {:>6}  errors {:>3}  throughput {:>8.1} req/s  latency p50 {:>6.3} ms  p99 {:>6.3} ms  p99.9 {:>6.3} ms  max {:>7.3} ms  (service p50 {:>6.3} p99 {:>6.3} ms)  server CPU {:.0} us/req  peak RSS {}",
        r.sent,
        r.ok,
        r.errors,
        r.throughput(),
        Report::ms(&r.latency_us, 0.50),
        Report::ms(&r.latency_us, 0.99),
        Report::ms(&r.latency_us, 0.999),
        r.latency_us.max() as f64 / 1000.0,
        Report::ms(&r.service_us, 0.50),
        Report::ms(&r.service_us, 0.99),
        r.server_cpu * 1e6 / r.ok.max(1) as f64,
        rss_kib.map_or("n/a".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0)),
    );
}

fn main() {
    if std::env::var_os(FLOOR_ENV).is_some() {
        let args: Vec<String> = std::env::args().collect();
        let port: u16 = args[1].parse().unwrap();
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(floor_server(port, args[2].clone(), args[3].clone()));
        return;
    }

    let full = std::env::args().any(|a| a == "--bench");
    let rate: u64 = env_or("BENCH_RATE", if full { 1000 } else { 200 });
    let secs: f64 = env_or("BENCH_SECS", if full { 10.0 } else { 1.0 });
    let warmup: f64 = env_or("BENCH_WARMUP_SECS", if full { 2.0 } else { 0.2 });
    let conns: usize = env_or("BENCH_CONNS", 16);
    let fixture: String = env_or("BENCH_FIXTURE", "pod-create-plain.json".to_string());

    let dir = tempfile::tempdir().unwrap();
    let (cert, key, _) = common::self_signed("bench");
    let cert_path = dir.path().join("tls.crt");
    let key_path = dir.path().join("tls.key");
    std::fs::write(&cert_path, cert).unwrap();
    std::fs::write(&key_path, key).unwrap();
    // The API server sends compact JSON; the fixtures are stored pretty-printed.
    let body = Arc::new(serde_json::to_vec(&common::fixture(&fixture)).unwrap());

    let (webhook_port, health_port, floor_port) = (free_port(), free_port(), free_port());
    let webhook = Server {
        name: "webhook",
        child: Command::new(
            std::env::var_os("BENCH_WEBHOOK_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_webhook").into()),
        )
        .args(["--listen", &format!("127.0.0.1:{webhook_port}")])
        .args(["--metrics-listen", &format!("127.0.0.1:{health_port}")])
        .arg("--tls-cert")
        .arg(&cert_path)
        .arg("--tls-key")
        .arg(&key_path)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("starting the webhook binary"),
        addr: SocketAddr::from(([127, 0, 0, 1], webhook_port)),
    };
    let floor = Server {
        name: "floor",
        child: Command::new(std::env::current_exe().unwrap())
            .env(FLOOR_ENV, "1")
            .arg(floor_port.to_string())
            .arg(&cert_path)
            .arg(&key_path)
            .stdout(Stdio::null())
            .spawn()
            .expect("starting the floor server"),
        addr: SocketAddr::from(([127, 0, 0, 1], floor_port)),
    };

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    println!(
        "webhook-bench: {rate} req/s, {secs} s per server in {} interleaved rounds (+{warmup} s warm-up), {conns} TLS keep-alive connections, body {fixture} ({} bytes), {} CPUs",
        env_or::<u32>("BENCH_ROUNDS", if full { 5 } else { 1 }),
        body.len(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let rounds: u32 = env_or("BENCH_ROUNDS", if full { 5 } else { 1 });
    let mut results = [Report::new(), Report::new()];
    runtime.block_on(async {
        let servers = [&floor, &webhook];
        let expects = ["\"allowed\":true", "JSONPatch"];
        let mut pools = Vec::new();
        for (server, expect) in servers.iter().zip(expects) {
            wait_ready(server.addr).await;
            let mut clients = Vec::with_capacity(conns);
            for _ in 0..conns {
                clients.push(common::TlsClient::connect(server.addr).await.unwrap());
            }
            let (_, clients) = load(
                clients,
                Arc::clone(&body),
                expect,
                rate,
                Duration::from_secs_f64(warmup),
            )
            .await;
            pools.push(Some(clients));
        }
        // Interleave the two servers in rounds (alternating which goes first) so background
        // noise on the machine hits both alike.
        let slice = Duration::from_secs_f64(secs / f64::from(rounds));
        for round in 0..rounds {
            let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for index in order {
                let clients = pools[index].take().unwrap();
                let cpu_before = servers[index].cpu_seconds();
                let (mut report, clients) = load(clients, Arc::clone(&body), expects[index], rate, slice).await;
                report.server_cpu = servers[index].cpu_seconds() - cpu_before;
                pools[index] = Some(clients);
                results[index].add(&report);
            }
        }
    });
    for (index, server) in [&floor, &webhook].iter().enumerate() {
        print(server.name, &results[index], server.peak_rss_kib());
    }
    let (floor_r, ours) = (&results[0], &results[1]);
    let p99 = Report::ms(&ours.latency_us, 0.99);
    let p99_ratio = p99 / Report::ms(&floor_r.latency_us, 0.99);
    let tput_ratio = ours.throughput() / floor_r.throughput();
    println!(
        "ratios  webhook/floor: p99 {p99_ratio:.2}x (target <= 1.5x)  throughput {tput_ratio:.3}x  |  webhook p99 {p99:.3} ms (target < 5 ms at 1000 req/s)"
    );
    println!(
        "targets: p99 < 5 ms: {}  p99 within 1.5x floor: {}",
        if p99 < 5.0 { "met" } else { "NOT met" },
        if p99_ratio <= 1.5 { "met" } else { "NOT met" }
    );
    drop(webhook);
    drop(floor);
    if ours.errors > 0 || floor_r.errors > 0 {
        eprintln!("errors during the run");
        std::process::exit(1);
    }
}
