//! `scenarios egress`: the sidecar's egress proxy beside a direct connection and the peers a
//! platform team would otherwise deploy (tinyproxy and Squid, when installed), all on loopback
//! against the same upstream: throughput of one large download over CONNECT, new-connection
//! latency (connect, CONNECT and its decision, one round trip), many tunnels open at once, and
//! the proxy's CPU per GiB and RSS. The sidecar is a real one in a local pool, deciding from the
//! policy its owner installed. Every path is up for the whole run and the new-connection
//! samples alternate between them, so the paths are timed under the same conditions.
//!
//! HAProxy (when installed) is not a peer but a reference: a TCP relay bound to the upstream
//! (splice on, no CONNECT, no decision), what relaying alone costs on this machine.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub mod edit;

use crate::local::{self, Config, LocalPool};
use crate::scale::{cpu_ticks, percentile, rss_kib, ticks_as_seconds};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Pool(#[from] local::Error),
    #[error("{0}")]
    Bench(String),
}

#[derive(Debug, Clone)]
pub struct Settings {
    pub root: PathBuf,
    /// Bytes of the download.
    pub bytes: u64,
    /// New connections timed, one after another.
    pub samples: usize,
    /// Tunnels open at once.
    pub connections: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub path: String,
    pub throughput_mib_s: f64,
    /// CPU of the proxy (its processes) per GiB carried.
    pub cpu_s_per_gib: Option<f64>,
    pub connect_ms_p50: f64,
    pub connect_ms_p99: f64,
    /// Tunnels that were open at once (of `Settings::connections`).
    pub open: usize,
    pub rss_idle_mib: Option<f64>,
    pub rss_open_mib: Option<f64>,
}

#[derive(Clone)]
enum Via {
    Direct,
    Proxy(SocketAddr),
    /// Opened by the Pod's dialer (egress redirection) and handed over.
    Dialer(plumbing::dialer::Dialer),
}

/// One way to the upstream being measured.
struct Path {
    name: &'static str,
    via: Via,
    /// The proxy's process (its CPU and RSS are measured).
    pid: Option<u32>,
    upstream: SocketAddr,
}

/// What keeps the paths up while they are measured.
#[derive(Default)]
struct Running {
    pool: Option<LocalPool>,
    peers: Vec<tokio::process::Child>,
    dialer: Option<tokio_util::sync::CancellationToken>,
}

impl Running {
    async fn stop(mut self) {
        if let Some(dialer) = self.dialer.take() {
            dialer.cancel();
        }
        for mut peer in self.peers.drain(..) {
            let _ = peer.kill().await;
        }
        if let Some(pool) = self.pool.take() {
            pool.stop().await;
        }
    }
}

/// Runs every path there is (direct, the Pod's dialer, the sidecar, then the peers found on
/// `PATH`), all started before any is measured. The downloads and the new-connection samples
/// go round the paths in turn, so a pause of the machine falls on all of them alike rather
/// than on whichever path was being timed; the open tunnels are measured one path after
/// another.
pub async fn run(settings: &Settings) -> Result<Vec<Row>, Error> {
    std::fs::create_dir_all(&settings.root)?;
    let mut running = Running::default();
    let paths = start(settings, &mut running).await;
    let rows = match paths {
        Ok(paths) => measure(&paths, settings).await,
        Err(err) => Err(err),
    };
    running.stop().await;
    rows
}

async fn start(settings: &Settings, running: &mut Running) -> Result<Vec<Path>, Error> {
    let upstream = upstream_on(std::net::Ipv4Addr::LOCALHOST.into()).await?;
    let mut paths = vec![Path {
        name: "direct",
        via: Via::Direct,
        pid: None,
        upstream,
    }];

    // What egress redirection adds to a connection: the dialer opens it and hands it over. It
    // refuses loopback, so this upstream listens on the host's own address.
    match own_address() {
        Some(ip) => {
            let far = upstream_on(ip).await?;
            let socket = settings.root.join("dialer.sock");
            let shutdown = tokio_util::sync::CancellationToken::new();
            tokio::spawn(plumbing::dialer::serve(
                plumbing::dialer::bind(&socket)?,
                shutdown.clone(),
            ));
            running.dialer = Some(shutdown);
            paths.push(Path {
                name: "direct, opened by the Pod's dialer",
                via: Via::Dialer(plumbing::dialer::Dialer::new(&socket)),
                pid: None,
                upstream: far,
            });
        }
        None => eprintln!("egress: this host has no address but loopback; the dialer's row is skipped"),
    }

    let policy = settings.root.join("policy.yaml");
    let document = format!(
        "name: bench\nrevision: 1\nrules:\n  - name: upstream\n    host: 127.0.0.1\n    ports: [{}]\n",
        upstream.port()
    );
    std::fs::write(&policy, document)?;
    let pool = running.pool.insert(
        LocalPool::start(Config {
            root: settings.root.join("pool"),
            database_url: None,
            gateways: 1,
            members: 1,
            sandboxes: 1,
            lease_length_ms: 5000,
            plaintext: false,
            agent_interval_ms: 1000,
            members_on_standby: false,
            cuttable_links: false,
            policy: Some(policy),
            secrets: None,
        })
        .await?,
    );
    let Some((proxy, pid)) = pool
        .sandboxes
        .first()
        .and_then(|s| Some((s.egress.clone()?, s.sidecar.pid()?)))
    else {
        return Err(Error::Bench("the sandbox has no egress proxy".into()));
    };
    let proxy: SocketAddr = proxy.parse().map_err(|_| Error::Bench(format!("bad proxy {proxy}")))?;
    ready(&Via::Proxy(proxy), upstream, Duration::from_secs(60)).await?;
    paths.push(Path {
        name: "sidecar",
        via: Via::Proxy(proxy),
        pid: Some(pid),
        upstream,
    });

    for peer in [Peer::Tinyproxy, Peer::Squid, Peer::Haproxy] {
        match peer.start(settings, upstream).await {
            Ok(Some((child, proxy))) => {
                let (via, upstream) = peer.way(proxy, upstream);
                paths.push(Path {
                    name: peer.name(),
                    via,
                    pid: child.id(),
                    upstream,
                });
                running.peers.push(child);
            }
            Ok(None) => eprintln!("egress: {} is not installed; skipped", peer.name()),
            Err(err) => eprintln!("egress: {} did not start: {err}; skipped", peer.name()),
        }
    }
    Ok(paths)
}

/// Downloads timed per path, round the paths; the row shows the median.
const DOWNLOADS: usize = 3;

async fn measure(paths: &[Path], settings: &Settings) -> Result<Vec<Row>, Error> {
    eprintln!("egress: {DOWNLOADS} downloads per path, round the paths ...");
    let mut downloads = vec![Vec::with_capacity(DOWNLOADS); paths.len()];
    for _ in 0..DOWNLOADS {
        for (path, taken) in paths.iter().zip(downloads.iter_mut()) {
            taken.push(download(path, settings.bytes).await?);
        }
    }
    eprintln!(
        "egress: {} new connections per path, round the paths ...",
        settings.samples
    );
    let mut samples = vec![Vec::with_capacity(settings.samples); paths.len()];
    for _ in 0..settings.samples {
        for (path, taken) in paths.iter().zip(samples.iter_mut()) {
            let t0 = Instant::now();
            let mut stream = open(&path.via, path.upstream).await?;
            ping(&mut stream).await?;
            taken.push(t0.elapsed().as_secs_f64() * 1000.0);
        }
    }
    let mut rows = Vec::with_capacity(paths.len());
    for ((path, downloaded), mut taken) in paths.iter().zip(downloads).zip(samples) {
        eprintln!("egress: {}: {} tunnels at once ...", path.name, settings.connections);
        let (open, rss_idle_mib, rss_open_mib) = tunnels(path, settings.connections).await;
        let mut mib_s: Vec<f64> = downloaded.iter().map(|d| d.mib_s).collect();
        mib_s.sort_by(f64::total_cmp);
        let mut cpu: Vec<f64> = downloaded.iter().filter_map(|d| d.cpu_s_per_gib).collect();
        cpu.sort_by(f64::total_cmp);
        taken.sort_by(f64::total_cmp);
        rows.push(Row {
            path: path.name.to_owned(),
            throughput_mib_s: percentile(&mib_s, 0.50),
            cpu_s_per_gib: (!cpu.is_empty()).then(|| percentile(&cpu, 0.50)),
            connect_ms_p50: percentile(&taken, 0.50),
            connect_ms_p99: percentile(&taken, 0.99),
            open,
            rss_idle_mib,
            rss_open_mib,
        });
    }
    Ok(rows)
}

#[derive(Clone)]
struct Download {
    mib_s: f64,
    /// The proxy's CPU for it, per GiB.
    cpu_s_per_gib: Option<f64>,
}

/// One download of `bytes` through `path`.
async fn download(path: &Path, bytes: u64) -> Result<Download, Error> {
    let cpu_before = path.pid.and_then(tree_cpu_ticks);
    let started = Instant::now();
    let mut stream = open(&path.via, path.upstream).await?;
    stream.write_all(format!("SEND {bytes}\n").as_bytes()).await?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut left = bytes;
    while left > 0 {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Err(Error::Bench(format!(
                "{}: the download ended {left} bytes short",
                path.name
            )));
        }
        left = left.saturating_sub(n as u64);
    }
    let seconds = started.elapsed().as_secs_f64();
    drop(stream);
    let gib = bytes as f64 / f64::from(1u32 << 30);
    let cpu_s_per_gib = match (cpu_before, path.pid.and_then(tree_cpu_ticks)) {
        (Some(before), Some(after)) => Some(ticks_as_seconds(after.saturating_sub(before)) / gib),
        _ => None,
    };
    Ok(Download {
        mib_s: bytes as f64 / f64::from(1u32 << 20) / seconds,
        cpu_s_per_gib,
    })
}

/// `connections` tunnels opened in batches and held: how many opened, and the proxy's RSS
/// before and with them open.
async fn tunnels(path: &Path, connections: usize) -> (usize, Option<f64>, Option<f64>) {
    let rss = || path.pid.and_then(tree_rss_kib).map(|k| k as f64 / 1024.0);
    let idle = rss();
    let mut held = Vec::with_capacity(connections);
    for batch in (0..connections).collect::<Vec<_>>().chunks(100) {
        held.extend(open_many(batch.len(), &path.via, path.upstream).await);
    }
    (held.len(), idle, rss())
}

/// `n` tunnels opened at once; those that answered their ping.
async fn open_many(n: usize, via: &Via, upstream: SocketAddr) -> Vec<TcpStream> {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let via = via.clone();
        tasks.spawn(async move {
            let mut stream = open(&via, upstream).await.ok()?;
            ping(&mut stream).await.ok()?;
            Some(stream)
        });
    }
    let mut open = Vec::with_capacity(n);
    while let Some(joined) = tasks.join_next().await {
        if let Ok(Some(stream)) = joined {
            open.push(stream);
        }
    }
    open
}

async fn ping(stream: &mut TcpStream) -> Result<(), Error> {
    stream.write_all(b"PING\n").await?;
    let mut byte = [0u8; 1];
    stream.read_exact(&mut byte).await?;
    Ok(())
}

/// A connection to the upstream, through `via`.
async fn open(via: &Via, upstream: SocketAddr) -> Result<TcpStream, Error> {
    let limit = Duration::from_secs(10);
    let proxy = match via {
        Via::Direct => upstream,
        Via::Proxy(proxy) => *proxy,
        Via::Dialer(dialer) => {
            let stream = dialer
                .connect(upstream, limit)
                .await
                .map_err(|err| Error::Bench(err.to_string()))?;
            stream.set_nodelay(true)?;
            return Ok(stream);
        }
    };
    if let Via::Proxy(_) = via {
        let (status, stream) = connect(proxy, upstream, limit).await?;
        if status != 200 {
            return Err(Error::Bench(format!("CONNECT refused: {status}")));
        }
        return Ok(stream);
    }
    let stream = tokio::time::timeout(limit, TcpStream::connect(proxy))
        .await
        .map_err(|_| Error::Bench(format!("connecting to {proxy} timed out")))??;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// `CONNECT target` through `proxy`: the status of the answer, and the stream (a tunnel when
/// the status is 200). Each step within `limit`.
pub(crate) async fn connect(proxy: SocketAddr, target: SocketAddr, limit: Duration) -> Result<(u16, TcpStream), Error> {
    let mut stream = tokio::time::timeout(limit, TcpStream::connect(proxy))
        .await
        .map_err(|_| Error::Bench(format!("connecting to {proxy} timed out")))??;
    stream.set_nodelay(true)?;
    let request = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    // The upstreams here send nothing before they are spoken to, so whatever is read before
    // the head ends is the head.
    let mut head = Vec::with_capacity(256);
    let mut buf = [0u8; 512];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(limit, stream.read(&mut buf))
            .await
            .map_err(|_| Error::Bench("the proxy did not answer CONNECT".into()))??;
        if n == 0 || head.len() > 8192 {
            return Err(Error::Bench("the proxy closed before answering CONNECT".into()));
        }
        head.extend_from_slice(&buf[..n]);
    }
    let status = String::from_utf8_lossy(&head)
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    Ok((status, stream))
}

/// Until a CONNECT through `proxy` succeeds (the owner installed the policy).
async fn ready(via: &Via, upstream: SocketAddr, limit: Duration) -> Result<(), Error> {
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(mut stream) = open(via, upstream).await
            && ping(&mut stream).await.is_ok()
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Error::Bench(format!("no tunnel reached {upstream} within {limit:?}")));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `SEND n` streams n bytes and closes; `PING` answers one byte and holds the connection.
/// The address a connection to a private address would leave from (no packet is sent).
fn own_address() -> Option<std::net::IpAddr> {
    let probe = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    probe.connect("10.255.255.1:9").ok()?;
    let ip = probe.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

async fn upstream_on(ip: std::net::IpAddr) -> Result<SocketAddr, Error> {
    let listener = TcpListener::bind((ip, 0)).await?;
    let address = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let _ = stream.set_nodelay(true);
                let mut line = Vec::new();
                let mut byte = [0u8; 1];
                while !line.ends_with(b"\n") && line.len() < 64 {
                    match stream.read(&mut byte).await {
                        Ok(1) => line.push(byte[0]),
                        _ => return,
                    }
                }
                let line = String::from_utf8_lossy(&line).trim().to_owned();
                if let Some(n) = line.strip_prefix("SEND ").and_then(|n| n.parse::<u64>().ok()) {
                    let chunk = vec![0x5au8; 256 * 1024];
                    let mut left = n;
                    while left > 0 {
                        let take = usize::try_from(left.min(chunk.len() as u64)).unwrap_or(chunk.len());
                        if stream.write_all(&chunk[..take]).await.is_err() {
                            return;
                        }
                        left -= take as u64;
                    }
                } else if line == "PING" && stream.write_all(b"P").await.is_ok() {
                    let mut rest = [0u8; 64];
                    while matches!(stream.read(&mut rest).await, Ok(n) if n > 0) {}
                }
            });
        }
    });
    Ok(address)
}

#[derive(Clone, Copy)]
enum Peer {
    Tinyproxy,
    Squid,
    /// Not a forward proxy: a TCP relay (with splice) bound to the upstream, no CONNECT and
    /// no decision, the ceiling of what relaying costs.
    Haproxy,
}

impl Peer {
    /// Its program's name (its directory and configuration file).
    fn program(self) -> &'static str {
        match self {
            Peer::Tinyproxy => "tinyproxy",
            Peer::Squid => "squid",
            Peer::Haproxy => "haproxy",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Peer::Haproxy => "haproxy (TCP relay, no CONNECT)",
            _ => self.program(),
        }
    }

    /// How a connection reaches the upstream through the peer listening on `proxy`: a CONNECT,
    /// or (HAProxy, bound to the upstream) a plain connection to the peer.
    fn way(self, proxy: SocketAddr, upstream: SocketAddr) -> (Via, SocketAddr) {
        match self {
            Peer::Haproxy => (Via::Direct, proxy),
            Peer::Tinyproxy | Peer::Squid => (Via::Proxy(proxy), upstream),
        }
    }

    /// The peer on a free loopback port, allowed to CONNECT to the upstream's port; `None`
    /// when it is not installed.
    async fn start(
        self,
        settings: &Settings,
        upstream: SocketAddr,
    ) -> Result<Option<(tokio::process::Child, SocketAddr)>, Error> {
        let binary = match self {
            Peer::Tinyproxy => ["/usr/bin/tinyproxy", "/usr/sbin/tinyproxy"],
            Peer::Squid => ["/usr/sbin/squid", "/usr/bin/squid"],
            Peer::Haproxy => ["/usr/sbin/haproxy", "/usr/bin/haproxy"],
        };
        let Some(binary) = binary.into_iter().find(|b| std::path::Path::new(b).exists()) else {
            return Ok(None);
        };
        let port = local::free_port()?;
        let dir = settings.root.join(self.program());
        std::fs::create_dir_all(&dir)?;
        let conf = dir.join(format!("{}.conf", self.program()));
        let (config, args) = match self {
            Peer::Tinyproxy => (
                format!(
                    "Port {port}\nListen 127.0.0.1\nTimeout 600\nMaxClients {}\nAllow 127.0.0.1\nConnectPort {}\nLogLevel Error\n",
                    settings.connections + 64,
                    upstream.port()
                ),
                vec!["-d".to_owned(), "-c".to_owned(), conf.display().to_string()],
            ),
            Peer::Squid => {
                // Squid drops to its own user: its files must be that user's.
                let _ = std::process::Command::new("chown")
                    .args(["-R", "proxy:proxy"])
                    .arg(&dir)
                    .status();
                (
                    format!(
                        "http_port 127.0.0.1:{port}\nacl local src 127.0.0.1/32\nhttp_access allow local\nhttp_access deny all\n\
                         cache deny all\naccess_log none\ncache_store_log none\ncache_log {d}/cache.log\npid_filename {d}/squid.pid\n\
                         coredump_dir {d}\nmax_filedescriptors {}\nshutdown_lifetime 0 seconds\n",
                        4 * settings.connections + 256,
                        d = dir.display()
                    ),
                    vec!["-N".to_owned(), "-f".to_owned(), conf.display().to_string()],
                )
            }
            Peer::Haproxy => (
                format!(
                    "global\n    maxconn {}\n    nbthread 2\ndefaults\n    mode tcp\n    option splice-auto\n    \
                     timeout connect 5s\n    timeout client 600s\n    timeout server 600s\n\
                     frontend relay\n    bind 127.0.0.1:{port}\n    default_backend upstream\n\
                     backend upstream\n    server upstream {upstream}\n",
                    2 * settings.connections + 64
                ),
                vec!["-db".to_owned(), "-f".to_owned(), conf.display().to_string()],
            ),
        };
        std::fs::write(&conf, config)?;
        let child = tokio::process::Command::new(binary)
            .args(&args)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.join("stderr.log"))?)
            .kill_on_drop(true)
            .spawn()?;
        let proxy: SocketAddr = ([127, 0, 0, 1], port).into();
        let (via, to) = self.way(proxy, upstream);
        ready(&via, to, Duration::from_secs(30)).await?;
        Ok(Some((child, proxy)))
    }
}

/// `pid` and its descendants.
fn tree(pid: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(p) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let ppid = std::fs::read_to_string(format!("/proc/{p}/stat")).ok().and_then(|s| {
                s.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok())
            });
            if let Some(ppid) = ppid {
                parents.push((p, ppid));
            }
        }
    }
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let parent = out[i];
        out.extend(parents.iter().filter(|(_, pp)| *pp == parent).map(|(p, _)| *p));
        i += 1;
    }
    out
}

fn tree_cpu_ticks(pid: u32) -> Option<u64> {
    Some(tree(pid).into_iter().filter_map(cpu_ticks).sum())
}

fn tree_rss_kib(pid: u32) -> Option<u64> {
    Some(tree(pid).into_iter().filter_map(rss_kib).sum())
}

/// The Markdown table of `rows`.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| path | throughput (MiB/s) | proxy CPU per GiB | new connection p50 / p99 (ms) | tunnels open at once | proxy RSS idle / with them open (MiB) |\n\
         |---|---|---|---|---|---|\n",
    );
    let mib = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
    for r in rows {
        out.push_str(&format!(
            "| {} | {:.0} | {} | {:.3} / {:.3} | {} | {} / {} |\n",
            r.path,
            r.throughput_mib_s,
            r.cpu_s_per_gib.map_or("-".to_owned(), |s| format!("{s:.2} s")),
            r.connect_ms_p50,
            r.connect_ms_p99,
            r.open,
            mib(r.rss_idle_mib),
            mib(r.rss_open_mib),
        ));
    }
    out
}
