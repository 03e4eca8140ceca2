//! The Pod's dialer: under egress redirection, the one process of the Pod whose connections
//! leave it as they are (the network rules exempt its UID; every other process's TCP
//! connection is redirected to the sidecar, which decides it). It runs as a UID of its own, so
//! no workload process can act as it, and opens connections for the sidecar only: the sidecar
//! asks over a Unix socket in a volume no workload container mounts, and receives the
//! connected socket itself (`SCM_RIGHTS`), which keeps its owner — the dialer's UID — for the
//! network rules while the sidecar reads and writes it. Nothing is relayed through the dialer.
//!
//! The protocol, one exchange per connection: the request `"<ip>:<port> <milliseconds>\n"`
//! (at most [`MAX_REQUEST_BYTES`]); the answer `"ok\n"` with the connected socket, or
//! `"err <reason>\n"` without one.
//!
//! [`Dialer`] is the client (the sidecar, and its gRPC channels through [`Dialer::connector`]);
//! [`serve`] the dialer's side.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
    recvmsg, sendmsg,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Interest};
use tokio::net::{TcpStream, UnixListener, UnixStream};
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// Longest request line.
pub const MAX_REQUEST_BYTES: usize = 96;
/// Longest answer.
const MAX_ANSWER_BYTES: usize = 512;
/// The longest connect the dialer attempts, whatever the request asks.
pub const MAX_CONNECT: Duration = Duration::from_secs(30);
/// For a request to arrive once a client connected.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Requests served at once; more wait in the listen backlog.
pub const MAX_IN_FLIGHT: usize = 256;

/// A connection the dialer refused or could not open.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the dialer at {socket} is unreachable: {source}")]
    Unreachable {
        socket: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the dialer cannot connect to {address}: {reason}")]
    Refused { address: SocketAddr, reason: String },
    #[error("the dialer did not answer for {address} within {limit:?}")]
    Timeout { address: SocketAddr, limit: Duration },
    #[error("the dialer's answer for {address} is malformed")]
    Malformed { address: SocketAddr },
}

impl From<Error> for io::Error {
    fn from(err: Error) -> Self {
        let kind = match &err {
            Error::Timeout { .. } => io::ErrorKind::TimedOut,
            Error::Refused { .. } => io::ErrorKind::ConnectionRefused,
            Error::Unreachable { .. } | Error::Malformed { .. } => io::ErrorKind::Other,
        };
        io::Error::new(kind, err)
    }
}

/// The client: where the dialer listens.
#[derive(Clone, Debug)]
pub struct Dialer {
    socket: PathBuf,
    /// Connects this client may have in flight at once ([`Dialer::bounded`]).
    in_flight: Option<std::sync::Arc<tokio::sync::Semaphore>>,
}

/// Two clients of the same dialer are the same, whatever their bounds.
impl PartialEq for Dialer {
    fn eq(&self, other: &Self) -> bool {
        self.socket == other.socket
    }
}

impl Eq for Dialer {}

impl Dialer {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            in_flight: None,
        }
    }

    /// At most `max` connects of this client (and its clones) in flight at once, so that the
    /// workload's connections, which an unanswering destination holds for the whole connect
    /// time-out, leave the dialer's other [`MAX_IN_FLIGHT`] slots to the sidecar's own.
    pub fn bounded(self, max: usize) -> Self {
        Self {
            in_flight: Some(std::sync::Arc::new(tokio::sync::Semaphore::new(max))),
            ..self
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// A TCP connection to `address`, opened by the dialer, within `limit`.
    pub async fn connect(&self, address: SocketAddr, limit: Duration) -> Result<TcpStream, Error> {
        let exchange = async {
            let _permit = match &self.in_flight {
                Some(in_flight) => Some(in_flight.acquire().await.map_err(|_| Error::Refused {
                    address,
                    reason: "the client is closed".into(),
                })?),
                None => None,
            };
            let unreachable = |source| Error::Unreachable {
                socket: self.socket.clone(),
                source,
            };
            let mut stream = UnixStream::connect(&self.socket).await.map_err(unreachable)?;
            let request = format!("{address} {}\n", limit.as_millis());
            stream.write_all(request.as_bytes()).await.map_err(unreachable)?;
            let (answer, fd) = stream
                .async_io(Interest::READABLE, || receive(stream.as_fd()))
                .await
                .map_err(unreachable)?;
            let answer = String::from_utf8_lossy(&answer);
            match (answer.strip_suffix('\n'), fd) {
                (Some("ok"), Some(fd)) => {
                    let stream = std::net::TcpStream::from(fd);
                    stream.set_nonblocking(true).map_err(unreachable)?;
                    TcpStream::from_std(stream).map_err(unreachable)
                }
                (Some(answer), None) if answer.starts_with("err ") => Err(Error::Refused {
                    address,
                    reason: answer["err ".len()..].to_owned(),
                }),
                _ => Err(Error::Malformed { address }),
            }
        };
        // The dialer bounds its own connect by `limit`; this bounds the whole exchange.
        timeout(limit + Duration::from_secs(1), exchange)
            .await
            .map_err(|_| Error::Timeout { address, limit })?
    }

    /// For a tonic `Endpoint::connect_with_connector`: resolves the URI's host and connects
    /// through the dialer (tonic adds TLS on top).
    pub fn connector(&self, limit: Duration) -> Connector {
        Connector {
            dialer: self.clone(),
            limit,
        }
    }
}

/// Reads the answer and at most one descriptor.
fn receive(socket: BorrowedFd<'_>) -> io::Result<(Vec<u8>, Option<OwnedFd>)> {
    let mut buffer = vec![0u8; MAX_ANSWER_BYTES];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let received = recvmsg(
        socket,
        &mut [IoSliceMut::new(&mut buffer)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fd = None;
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = message {
            for owned in fds {
                fd.get_or_insert(owned);
            }
        }
    }
    if received.bytes == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the dialer closed without an answer",
        ));
    }
    buffer.truncate(received.bytes);
    Ok((buffer, fd))
}

/// Sends `answer` with the descriptor `fd`.
fn send_with(socket: BorrowedFd<'_>, answer: &[u8], fd: BorrowedFd<'_>) -> io::Result<usize> {
    let fds = [fd];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    control.push(SendAncillaryMessage::ScmRights(&fds));
    Ok(sendmsg(
        socket,
        &[IoSlice::new(answer)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?)
}

/// See [`Dialer::connector`].
#[derive(Clone, Debug)]
pub struct Connector {
    dialer: Dialer,
    limit: Duration,
}

impl tower_service::Service<http::Uri> for Connector {
    type Response = hyper_util::rt::TokioIo<TcpStream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn std::future::Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let dialer = self.dialer.clone();
        let limit = self.limit;
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the URI names no host"))?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let port = uri
                .port_u16()
                .unwrap_or(if uri.scheme_str() == Some("https") { 443 } else { 80 });
            let addresses: Vec<SocketAddr> = timeout(limit, tokio::net::lookup_host((host, port)))
                .await
                .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, format!("resolving {host} timed out")))??
                .take(8)
                .collect();
            let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{host} resolves to nothing"));
            for address in addresses {
                match dialer.connect(address, limit).await {
                    Ok(stream) => {
                        let _ = stream.set_nodelay(true);
                        return Ok(hyper_util::rt::TokioIo::new(stream));
                    }
                    Err(err) => last = err.into(),
                }
            }
            Err(last)
        })
    }
}

/// Why a request is refused before any connect.
fn parse_request(line: &str) -> Result<(SocketAddr, Duration), String> {
    let (address, millis) = line
        .trim_end_matches('\n')
        .split_once(' ')
        .ok_or("expected \"<ip>:<port> <milliseconds>\"")?;
    let address: SocketAddr = address.parse().map_err(|_| "not an ip:port".to_owned())?;
    let millis: u64 = millis.parse().map_err(|_| "not a number of milliseconds".to_owned())?;
    if let Some(why) = never_dialed(address.ip()) {
        return Err(format!(
            "{} is {why}: the dialer opens connections that leave the Pod only",
            address.ip()
        ));
    }
    if address.port() == 0 {
        return Err("port 0".into());
    }
    Ok((address, Duration::from_millis(millis).min(MAX_CONNECT)))
}

/// Addresses that do not leave the Pod (the sidecar decides what else it may reach).
fn never_dialed(ip: IpAddr) -> Option<&'static str> {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    if ip.is_loopback() {
        Some("loopback")
    } else if ip.is_unspecified() {
        Some("unspecified")
    } else if ip.is_multicast() {
        Some("multicast")
    } else {
        None
    }
}

/// Serves `listener` (the dialer's socket) until `shutdown`.
pub async fn serve(listener: UnixListener, shutdown: CancellationToken) {
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
    loop {
        let permit = tokio::select! {
            () = shutdown.cancelled() => return,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
        };
        let accepted = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, _)) => {
                tokio::spawn(async move {
                    let _permit = permit;
                    if let Err(err) = exchange(stream).await {
                        debug!(error = %err, "dialer: exchange ended");
                    }
                });
            }
            Err(err) => {
                warn!(error = %err, "dialer: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn exchange(stream: UnixStream) -> io::Result<()> {
    let mut stream = stream;
    let mut line = String::new();
    let mut reader = BufReader::new((&mut stream).take(MAX_REQUEST_BYTES as u64));
    let read = timeout(REQUEST_TIMEOUT, reader.read_line(&mut line))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no request"))??;
    drop(reader);
    let answer = match (read, parse_request(&line)) {
        (0, _) => return Ok(()),
        (_, Err(reason)) => Err(reason),
        (_, Ok((address, limit))) => match timeout(limit, TcpStream::connect(address)).await {
            Ok(Ok(connected)) => Ok(connected),
            Ok(Err(err)) => Err(err.to_string()),
            Err(_) => Err(format!("no answer within {limit:?}")),
        },
    };
    match answer {
        Ok(connected) => {
            stream
                .async_io(Interest::WRITABLE, || {
                    send_with(stream.as_fd(), b"ok\n", connected.as_fd())
                })
                .await?;
            // Our copy closes here; the sidecar holds the connection.
            drop(connected);
        }
        Err(reason) => {
            let reason: String = reason.chars().filter(|c| !c.is_control()).take(400).collect();
            stream.write_all(format!("err {reason}\n").as_bytes()).await?;
        }
    }
    Ok(())
}

/// Binds the dialer's socket at `path` (a stale one is replaced), open to every process that
/// can reach the path: the directory is what keeps workload processes out.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => return Err(err),
    }
    let listener = UnixListener::bind(path)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_outside_the_pod_only() {
        assert!(parse_request("10.0.0.1:443 1000\n").is_ok());
        for refused in [
            "127.0.0.1:443 1000\n",
            "[::1]:443 1000\n",
            "[::ffff:127.0.0.1]:443 1000\n",
            "0.0.0.0:80 1000\n",
            "10.0.0.1:0 1000\n",
            "10.0.0.1 1000\n",
            "example.com:443 1000\n",
            "10.0.0.1:443 soon\n",
        ] {
            assert!(parse_request(refused).is_err(), "{refused:?} is refused");
        }
        let (_, limit) = parse_request("10.0.0.1:443 999999999\n").unwrap();
        assert_eq!(limit, MAX_CONNECT);
    }

    /// An address of this host that is not loopback (what the route to a private address
    /// would leave from), to test a handed-over connection without leaving the machine.
    fn own_address() -> IpAddr {
        let probe = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        probe.connect("10.255.255.1:9").unwrap();
        probe.local_addr().unwrap().ip()
    }

    #[tokio::test]
    async fn hands_over_a_connected_socket_or_says_why_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dialer.sock");
        let shutdown = CancellationToken::new();
        tokio::spawn(serve(bind(&path).unwrap(), shutdown.clone()));
        let dialer = Dialer::new(&path);

        let upstream = tokio::net::TcpListener::bind((own_address(), 0)).await.unwrap();
        let address = upstream.local_addr().unwrap();
        let mut connected = dialer.connect(address, Duration::from_secs(2)).await.unwrap();
        let (mut accepted, peer) = upstream.accept().await.unwrap();
        assert_eq!(
            connected.local_addr().unwrap(),
            peer,
            "the socket handed over is the one connected"
        );
        connected.write_all(b"ping").await.unwrap();
        let mut read = [0u8; 4];
        accepted.read_exact(&mut read).await.unwrap();
        assert_eq!(&read, b"ping");

        let refused = dialer
            .connect("127.0.0.1:9".parse().unwrap(), Duration::from_secs(1))
            .await;
        assert!(
            matches!(&refused, Err(Error::Refused { reason, .. }) if reason.contains("loopback")),
            "{refused:?}"
        );
        drop(upstream);
        let closed = dialer.connect(address, Duration::from_secs(2)).await;
        assert!(matches!(&closed, Err(Error::Refused { .. })), "{closed:?}");

        // A request without its end within the bound is refused, not read on.
        let mut long = UnixStream::connect(&path).await.unwrap();
        long.write_all(&[b'1'; MAX_REQUEST_BYTES]).await.unwrap();
        let mut answer = String::new();
        long.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("err "), "{answer:?}");
        shutdown.cancel();
    }
}
