//! `probe upstream` and `probe egress`: the two ends of the cluster test's egress step.
//!
//! - `probe upstream --listen 0.0.0.0:8080 --name NAME [--tls-cert F --tls-key F]`: an HTTP
//!   (or HTTPS) server that answers every request with `200` and the body
//!   `upstream=NAME method=M path=P auth=<its Authorization header, or ->`, one request per
//!   connection; a connection that sends nothing is held open. `GET /bytes/N` is answered
//!   with N bytes (at most 1 GiB) paced at about [`PACE_BYTES_PER_S`], a download long
//!   enough to be in flight through a handoff.
//! - `probe egress`, inside a workload container: asks the proxy its `HTTP_PROXY` names for
//!   each `--get URL` (plain HTTP, absolute form) and each `--connect HOST:PORT` (a tunnel,
//!   then a request through it), and prints one line each,
//!   `probe egress target=<…> status=<code|error> body=<first line of the body>`; each
//!   `--header "Name: value"` is sent with every `--get`. With
//!   `--hold HOST:PORT [--count N]` it opens N tunnels (`probe egress holding=<…> count=N`)
//!   and waits for a line on its standard input, then asks for `/held` through each
//!   (`probe egress held=<…> ok=<answered> of=N first_failure=<…|none>`) — or, if a tunnel
//!   closes first, `probe egress held=<…> closed`. With `--download N` one more tunnel downloads
//!   `/bytes/N` meanwhile, and the held line ends with ` download=<received>/N`.
//! - What a process that ignores the proxy variables does (egress redirection): `--direct URL`
//!   sends the plain-HTTP request straight to the URL's host (`target=direct:<URL>`);
//!   `--raw HOST:PORT` connects straight and sends bytes that are no HTTP or TLS
//!   (`target=raw:<…> status=closed|answered|error`; a reset is `closed`); `--udp HOST:PORT` sends a datagram
//!   (`target=udp:<…> status=sent|refused`); `--kill-sidecar` first SIGKILLs the Pod's sidecar
//!   (`probe egress killed=<pid>`), which runs as the workload's UID.

use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

/// How long any one exchange may take.
const EXCHANGE: Duration = Duration::from_secs(10);
/// Largest response read.
const MAX_RESPONSE: u64 = 64 * 1024;
/// Largest `/bytes/N` served.
const MAX_DOWNLOAD: u64 = 1 << 30;
/// How fast `/bytes/N` is sent.
pub const PACE_BYTES_PER_S: u64 = 8 << 20;
/// How long a download may take at most.
const DOWNLOAD_LIMIT: Duration = Duration::from_secs(600);

#[derive(Debug, clap::Args)]
pub struct UpstreamArgs {
    #[arg(long, default_value = "0.0.0.0:8080")]
    listen: std::net::SocketAddr,
    /// Named in every answer, so a client can tell which upstream it reached.
    #[arg(long)]
    name: String,
    /// Serve HTTPS with this PEM certificate (chain)…
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// …and this PEM key.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct EgressArgs {
    /// A plain-HTTP URL asked of the proxy.
    #[arg(long)]
    get: Vec<String>,
    /// A header line sent with every `--get`.
    #[arg(long)]
    header: Vec<String>,
    /// A HOST:PORT tunnelled to through the proxy (CONNECT), then asked for `/tunnel`.
    #[arg(long)]
    connect: Vec<String>,
    /// A HOST:PORT tunnelled to and held until a line on stdin or the tunnel's end.
    #[arg(long)]
    hold: Option<String>,
    /// How many tunnels `--hold` opens.
    #[arg(long, default_value_t = 1)]
    count: usize,
    /// With `--hold`: also download this many bytes (`/bytes/N`) through one more tunnel.
    #[arg(long)]
    download: Option<u64>,
    /// A plain-HTTP URL asked of its host directly, ignoring the proxy variables.
    #[arg(long)]
    direct: Vec<String>,
    /// A HOST:PORT connected to directly, sent bytes of no known protocol.
    #[arg(long)]
    raw: Vec<String>,
    /// A HOST:PORT sent a UDP datagram.
    #[arg(long)]
    udp: Vec<String>,
    /// SIGKILL the Pod's sidecar first.
    #[arg(long)]
    kill_sidecar: bool,
    /// Ask the Pod's dialer, reached through `/proc/<pid>/root` of the dialer or the sidecar,
    /// to open a connection to this HOST:PORT (`probe egress dialer=unreachable|reached …`).
    #[arg(long)]
    through_dialer: Option<String>,
}

pub async fn upstream(args: UpstreamArgs) -> anyhow::Result<()> {
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(acceptor(cert, key)?),
        _ => None,
    };
    let listener = TcpListener::bind(args.listen).await?;
    println!("probe upstream: listening on {}", args.listen);
    loop {
        let (stream, _) = listener.accept().await?;
        let name = args.name.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            match tls {
                Some(tls) => {
                    if let Ok(Ok(stream)) = timeout(EXCHANGE, tls.accept(stream)).await {
                        answer(stream, &name).await;
                    }
                }
                None => answer(stream, &name).await,
            }
        });
    }
}

fn acceptor(cert: &std::path::Path, key: &std::path::Path) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_file_iter(cert)
        .context("reading the certificate")?
        .collect::<Result<Vec<_>, _>>()
        .context("reading the certificate")?;
    let key = PrivateKeyDer::from_pem_file(key).context("reading the key")?;
    let config = rustls::ServerConfig::builder_with_provider(plumbing::tls::provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    Ok(tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config)))
}

/// Answers the one request on `stream` with what it asked and the Authorization it sent.
async fn answer(mut stream: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin, name: &str) {
    let Ok(head) = read_head(&mut stream).await else { return };
    let mut words = head.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let auth = head
        .lines()
        .find_map(|l| {
            l.split_once(':')
                .filter(|(n, _)| n.eq_ignore_ascii_case("authorization"))
        })
        .map_or("-", |(_, v)| v.trim());
    if let Some(size) = path.strip_prefix("/bytes/").and_then(|n| n.parse::<u64>().ok()) {
        send_paced(&mut stream, size.min(MAX_DOWNLOAD)).await;
        return;
    }
    let body = format!("upstream={name} method={method} path={path} auth={auth}\n");
    let answer = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(answer.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// `size` bytes of `z` as an HTTP answer, in 64 KiB chunks at [`PACE_BYTES_PER_S`].
async fn send_paced(stream: &mut (impl tokio::io::AsyncWrite + Unpin), size: u64) {
    const CHUNK: u64 = 64 * 1024;
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n"
    );
    if stream.write_all(head.as_bytes()).await.is_err() {
        return;
    }
    let chunk = vec![b'z'; CHUNK as usize];
    let mut every = tokio::time::interval(Duration::from_micros(CHUNK * 1_000_000 / PACE_BYTES_PER_S));
    let mut left = size;
    while left > 0 {
        every.tick().await;
        let take = left.min(CHUNK);
        if stream.write_all(&chunk[..take as usize]).await.is_err() {
            return;
        }
        left -= take;
    }
    let _ = stream.shutdown().await;
}

/// Downloads `/bytes/size` from `target` through a tunnel of `proxy`: the body bytes received
/// (each checked to be `z`; a wrong byte ends the count there).
async fn download(proxy: String, target: String, size: u64) -> anyhow::Result<u64> {
    let (mut stream, status, body) = tunnel(&proxy, &target).await?;
    if status != 200 {
        bail!("the download's tunnel was refused: {status} {}", first_line(&body));
    }
    let request = format!("GET /bytes/{size} HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let head = timeout(EXCHANGE, read_head(&mut stream)).await??;
    if status_of(&head)? != 200 {
        bail!("the download was answered {}", first_line(&head));
    }
    let mut received = 0u64;
    let mut buf = vec![0u8; 64 * 1024];
    timeout(DOWNLOAD_LIMIT, async {
        loop {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>(());
            }
            match buf[..n].iter().position(|b| *b != b'z') {
                Some(wrong) => {
                    received += wrong as u64;
                    return Ok(());
                }
                None => received += n as u64,
            }
        }
    })
    .await??;
    Ok(received)
}

pub async fn egress(args: EgressArgs) -> anyhow::Result<()> {
    if args.kill_sidecar {
        let pid = sidecar_pid().context("no sidecar process in the Pod's PID namespace")?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)
            .with_context(|| format!("killing the sidecar ({pid})"))?;
        println!("probe egress killed={pid}");
    }
    for url in &args.direct {
        let line = match direct(url).await {
            Ok((status, body)) => format!("status={status} body={}", first_line(&body)),
            Err(err) => format!("status=error body={}", first_line(&format!("{err:#}"))),
        };
        println!("probe egress target=direct:{url} {line}");
    }
    for target in &args.raw {
        println!("probe egress target=raw:{target} {}", raw(target).await);
    }
    for target in &args.udp {
        println!("probe egress target=udp:{target} {}", udp(target).await);
    }
    if let Some(target) = &args.through_dialer {
        println!("probe egress dialer={}", through_dialer(target).await);
    }
    if args.get.is_empty() && args.connect.is_empty() && args.hold.is_none() {
        // Only what ignores the proxy was asked for.
        return Ok(());
    }
    let proxy = proxy_address()?;
    println!("probe egress proxy={proxy}");
    for url in &args.get {
        let line = match get(&proxy, url, &args.header).await {
            Ok((status, body)) => format!("status={status} body={}", first_line(&body)),
            Err(err) => format!("status=error body={}", first_line(&format!("{err:#}"))),
        };
        println!("probe egress target={url} {line}");
    }
    for target in &args.connect {
        let line = match connect(&proxy, target).await {
            Ok((status, body)) => format!("status={status} body={}", first_line(&body)),
            Err(err) => format!("status=error body={}", first_line(&format!("{err:#}"))),
        };
        println!("probe egress target=connect:{target} {line}");
    }
    if let Some(target) = &args.hold {
        hold(&proxy, target, args.count.clamp(1, 1000), args.download).await?;
    }
    Ok(())
}

async fn hold(proxy: &str, target: &str, count: usize, size: Option<u64>) -> anyhow::Result<()> {
    let downloading = size.map(|size| tokio::spawn(download(proxy.to_owned(), target.to_owned(), size)));
    let mut streams = Vec::with_capacity(count);
    for _ in 0..count {
        let (stream, status, body) = tunnel(proxy, target).await?;
        if status != 200 {
            bail!("the tunnel to {target} was refused: {status} {}", first_line(&body));
        }
        streams.push(stream);
    }
    println!("probe egress holding={target} count={count}");
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin());
    let mut line = String::new();
    // The first tunnel to end before the line comes.
    let first_closed = futures::future::select_all(streams.iter_mut().map(|stream| {
        Box::pin(async move {
            let mut byte = [0u8; 1];
            let _ = stream.read(&mut byte).await;
        })
    }));
    tokio::select! {
        _ = tokio::io::AsyncBufReadExt::read_line(&mut stdin, &mut line) => {}
        _ = first_closed => {
            println!("probe egress held={target} closed");
            return Ok(());
        }
    }
    let answers = futures::future::join_all(streams.iter_mut().map(|stream| async move {
        let request = format!("GET /held HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        parse(&read_all(stream).await?)
    }))
    .await;
    let ok = answers
        .iter()
        .filter(|a| {
            a.as_ref()
                .is_ok_and(|(status, body)| *status == 200 && body.contains("path=/held"))
        })
        .count();
    let failure = answers.iter().find_map(|a| match a {
        Ok((200, _)) => None,
        Ok((status, body)) => Some(format!("{status} {}", first_line(body))),
        Err(err) => Some(first_line(&format!("{err:#}"))),
    });
    let downloaded = match (downloading, size) {
        (Some(task), Some(size)) => match task.await {
            Ok(Ok(received)) => format!(" download={received}/{size}"),
            Ok(Err(err)) => format!(" download=error/{size} ({})", first_line(&format!("{err:#}"))),
            Err(err) => format!(" download=error/{size} ({err})"),
        },
        _ => String::new(),
    };
    println!(
        "probe egress held={target} ok={ok} of={count} first_failure={}{downloaded}",
        failure.unwrap_or_else(|| "none".to_owned())
    );
    Ok(())
}

/// The PIDs of the processes named `name` in this PID namespace.
fn pids_named(name: &str) -> Vec<i32> {
    let comm = format!("({name})");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            stat.contains(&comm).then_some(pid)
        })
        .collect()
}

/// The PID of the Pod's sidecar.
fn sidecar_pid() -> Option<i32> {
    pids_named("sidecar").first().copied()
}

/// The dialer's socket through `/proc/<pid>/root` of the dialer and of the sidecar: the
/// first that accepts a connection, and what the dialer answered for `target`.
async fn through_dialer(target: &str) -> String {
    let mut tried = Vec::new();
    for pid in pids_named("egress").into_iter().chain(pids_named("sidecar")) {
        let path = format!("/proc/{pid}/root/var/run/openshell/egress/dialer.sock");
        match tokio::net::UnixStream::connect(&path).await {
            Ok(mut stream) => {
                let _ = stream.write_all(format!("{target} 2000\n").as_bytes()).await;
                let mut answer = vec![0u8; 256];
                let n = timeout(EXCHANGE, stream.read(&mut answer))
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .unwrap_or(0);
                return format!(
                    "reached {path} answer={}",
                    first_line(&String::from_utf8_lossy(&answer[..n]))
                );
            }
            Err(err) => tried.push(format!("{path}: {err}")),
        }
    }
    if tried.is_empty() {
        return "unreachable no dialer or sidecar process seen".to_owned();
    }
    format!("unreachable {}", tried.join("; "))
}

/// `GET` straight to the URL's host, as a client that ignores the proxy variables.
async fn direct(url: &str) -> anyhow::Result<(u16, String)> {
    let rest = url.strip_prefix("http://").context("not an http:// URL")?;
    let (authority, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_owned()), |(a, p)| (a, format!("/{p}")));
    let address = if authority.contains(':') {
        authority.to_owned()
    } else {
        format!("{authority}:80")
    };
    let mut stream = timeout(EXCHANGE, TcpStream::connect(&address)).await??;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let response = read_all(&mut stream).await?;
    parse(&response)
}

/// Bytes of no known protocol straight to `target`: whether anything answered.
async fn raw(target: &str) -> String {
    let exchange = async {
        let mut stream = TcpStream::connect(target).await?;
        stream.write_all(b"\x00\x01 not http, not tls\r\n\r\n").await?;
        let mut answer = vec![0u8; 1024];
        let n = stream.read(&mut answer).await?;
        anyhow::Ok(String::from_utf8_lossy(&answer[..n]).into_owned())
    };
    match timeout(EXCHANGE, exchange).await {
        Ok(Ok(answer)) if answer.is_empty() => "status=closed body=".to_owned(),
        Ok(Ok(answer)) => format!("status=answered body={}", first_line(&answer)),
        // Closed with what was sent unread: the kernel resets the connection.
        Ok(Err(err))
            if err
                .downcast_ref::<std::io::Error>()
                .is_some_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset) =>
        {
            "status=closed body=reset".to_owned()
        }
        Ok(Err(err)) => format!("status=error body={}", first_line(&format!("{err:#}"))),
        Err(_) => "status=error body=no answer and not closed".to_owned(),
    }
}

/// A UDP datagram to `target` (a packet the Pod's rules reject fails the send itself).
async fn udp(target: &str) -> String {
    let sent = async {
        let socket = tokio::net::UdpSocket::bind("0.0.0.0:0").await?;
        socket.connect(target).await?;
        socket.send(b"probe").await?;
        anyhow::Ok(())
    };
    match sent.await {
        Ok(()) => "status=sent body=".to_owned(),
        Err(err) => format!("status=refused body={}", first_line(&format!("{err:#}"))),
    }
}

/// `host:port` of `HTTP_PROXY` (or `http_proxy`).
fn proxy_address() -> anyhow::Result<String> {
    let url = std::env::var("HTTP_PROXY")
        .or_else(|_| std::env::var("http_proxy"))
        .context("HTTP_PROXY is not set")?;
    let rest = url
        .strip_prefix("http://")
        .context("HTTP_PROXY is not an http:// URL")?;
    Ok(rest.trim_end_matches('/').to_owned())
}

async fn get(proxy: &str, url: &str, headers: &[String]) -> anyhow::Result<(u16, String)> {
    let authority = url
        .strip_prefix("http://")
        .and_then(|rest| rest.split('/').next())
        .context("not an http:// URL")?;
    let mut stream = timeout(EXCHANGE, TcpStream::connect(proxy)).await??;
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    let request = format!("GET {url} HTTP/1.1\r\nHost: {authority}\r\n{extra}Connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let response = read_all(&mut stream).await?;
    parse(&response)
}

async fn connect(proxy: &str, target: &str) -> anyhow::Result<(u16, String)> {
    let (mut stream, status, body) = tunnel(proxy, target).await?;
    if status != 200 {
        return Ok((status, body));
    }
    let request = format!("GET /tunnel HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let response = read_all(&mut stream).await?;
    parse(&response)
}

/// A CONNECT: the stream, the proxy's status and, when it refused, its body.
async fn tunnel(proxy: &str, target: &str) -> anyhow::Result<(TcpStream, u16, String)> {
    let mut stream = timeout(EXCHANGE, TcpStream::connect(proxy)).await??;
    let request = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let head = timeout(EXCHANGE, read_head(&mut stream)).await??;
    let status = status_of(&head)?;
    if status == 200 {
        return Ok((stream, status, String::new()));
    }
    let rest = read_all(&mut stream)
        .await
        .with_context(|| format!("the {status} refusal did not end"))?;
    Ok((stream, status, String::from_utf8_lossy(&rest).into_owned()))
}

/// Up to the end of the head (`\r\n\r\n`), byte by byte so nothing after it is taken.
async fn read_head(stream: &mut (impl tokio::io::AsyncRead + Unpin)) -> anyhow::Result<String> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() > 16 * 1024 || stream.read(&mut byte).await? == 0 {
            bail!("no complete head");
        }
        head.push(byte[0]);
    }
    Ok(String::from_utf8_lossy(&head).into_owned())
}

async fn read_all(stream: &mut TcpStream) -> anyhow::Result<Vec<u8>> {
    let mut response = Vec::new();
    timeout(EXCHANGE, stream.take(MAX_RESPONSE).read_to_end(&mut response)).await??;
    Ok(response)
}

fn status_of(head: &str) -> anyhow::Result<u16> {
    head.split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .context("no status line")
}

fn parse(response: &[u8]) -> anyhow::Result<(u16, String)> {
    let text = String::from_utf8_lossy(response);
    let status = status_of(&text)?;
    let body = text.split_once("\r\n\r\n").map(|(_, body)| body).unwrap_or("");
    Ok((status, body.to_owned()))
}

fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or("").to_owned()
}
