//! Connections the workload did not send to the proxy. Under egress redirection the Pod's
//! network rules (`egress install-rules`) send every TCP connection of the workload's
//! processes here, whatever address they dialed; this listener decides each one from the same
//! revision and floor as the proxy:
//!
//! - the address dialed, when a rule names it (an IP rule): a tunnel at once;
//! - else a plain-HTTP request: each request by its `Host` header, method and path, answered
//!   like a proxy request (a refusal is the same 403 with its JSON body);
//! - else a TLS connection: by the name its ClientHello asks for (SNI);
//! - anything else (another protocol, a ClientHello without a name): refused, the connection
//!   closed.
//!
//! A name is resolved here and the sidecar connects to what it resolves to, never to the
//! address the workload dialed: a forged `Host` or SNI reaches only the servers of the name it
//! claims, which the policy allowed. Every decision is logged and every refusal kept for
//! `{"op":"policy"}`, as for the proxy.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::sync::Arc;
use std::time::Duration;

use hyper::Request as HttpRequest;
use hyper::body::Incoming;
use hyper::header;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::policy::Target;
use super::proxy::{self, Asked, Egress};

/// The largest ClientHello read to find its name.
const MAX_CLIENT_HELLO: usize = 16 * 1024;

/// Where a redirected connection was going: the address the workload dialed.
pub type Original = Arc<dyn Fn(&TcpStream) -> io::Result<SocketAddr> + Send + Sync>;

/// The address a redirected connection was dialed to (netfilter's `SO_ORIGINAL_DST`).
pub fn original_destination(stream: &TcpStream) -> io::Result<SocketAddr> {
    use nix::sys::socket::{getsockopt, sockopt};
    let local = stream.local_addr()?;
    if local.is_ipv4() {
        let address = getsockopt(stream, sockopt::OriginalDst)?;
        Ok(SocketAddr::V4(SocketAddrV4::new(
            Ipv4Addr::from(u32::from_be(address.sin_addr.s_addr)),
            u16::from_be(address.sin_port),
        )))
    } else {
        let address = getsockopt(stream, sockopt::Ip6tOriginalDst)?;
        Ok(SocketAddr::V6(SocketAddrV6::new(
            Ipv6Addr::from(address.sin6_addr.s6_addr),
            u16::from_be(address.sin6_port),
            0,
            0,
        )))
    }
}

/// Serves `listener` until `shutdown`, asking `original` where each connection was going.
pub async fn serve(listener: TcpListener, egress: Egress, original: Original, shutdown: CancellationToken) {
    let max = egress.limits.max_connections;
    proxy::accept_each(listener, max, shutdown.clone(), move |stream, permit| {
        let egress = egress.clone();
        let shutdown = shutdown.clone();
        let dialed = original(&stream);
        async move {
            // Beyond the cap the connection is closed at once: a redirected client expects no
            // proxy answer.
            let Some(permit) = permit else { return };
            match dialed {
                Ok(dialed) => connection(stream, dialed, egress, permit, shutdown).await,
                Err(err) => {
                    debug!(error = %err, "egress redirect: a connection without an original destination is closed")
                }
            }
        }
    })
    .await;
}

/// What the workload sent first.
enum First {
    /// A request line: plain HTTP.
    Http,
    /// A TLS record.
    Tls,
    /// Something else, or nothing within the header time-out.
    Other,
}

async fn first(stream: &TcpStream, limit: Duration) -> First {
    let mut head = [0u8; 8];
    match timeout(limit, stream.peek(&mut head)).await {
        Ok(Ok(n)) if n > 0 => classify(&head[..n]),
        _ => First::Other,
    }
}

fn classify(head: &[u8]) -> First {
    if head[0] == 0x16 {
        return First::Tls;
    }
    // A method token (RFC 9110: upper-case letters for every method in use) and a space.
    let token = head.iter().take_while(|b| b.is_ascii_uppercase()).count();
    if token > 0 && (token == head.len() || head[token] == b' ') {
        First::Http
    } else {
        First::Other
    }
}

async fn connection(
    client: TcpStream,
    dialed: SocketAddr,
    egress: Egress,
    permit: OwnedSemaphorePermit,
    shutdown: CancellationToken,
) {
    let _ = client.set_nodelay(true);
    let tunnels = shutdown.child_token();
    let by_address = Asked {
        target: Target::Address(dialed.ip()),
        port: dialed.port(),
        http: None,
    };
    let policy = egress.installed.borrow().clone();
    if let Ok(allowed) = proxy::decide(&by_address, policy.as_deref(), &egress).await {
        return carry(client, Vec::new(), by_address, allowed, &egress, tunnels).await;
    }
    match first(&client, egress.limits.header_timeout).await {
        First::Http => {
            let rewrite = move |request| absolute(request, dialed);
            proxy::http_connection(client, egress, Arc::new(permit), shutdown, rewrite).await;
        }
        First::Tls => {
            let (sent, name) = client_hello(&client, egress.limits.header_timeout).await;
            let asked = match name.as_deref().and_then(Target::parse) {
                Some(target) => Asked {
                    target,
                    port: dialed.port(),
                    http: None,
                },
                None => {
                    return refuse(
                        &by_address,
                        &egress,
                        "a TLS connection that names no server (SNI) is decided by its address, which no rule allows",
                    );
                }
            };
            let policy = egress.installed.borrow().clone();
            match proxy::decide(&asked, policy.as_deref(), &egress).await {
                Ok(allowed) => carry(client, sent, asked, allowed, &egress, tunnels).await,
                Err(denied) => refuse(&asked, &egress, &denied.reason),
            }
        }
        First::Other => refuse(
            &by_address,
            &egress,
            "no rule allows this address, and the connection is neither plain HTTP nor TLS with a server name",
        ),
    }
}

/// Connects to what `allowed` resolved and carries the connection as a tunnel.
async fn carry(
    client: TcpStream,
    sent: Vec<u8>,
    asked: Asked,
    allowed: proxy::Allowed,
    egress: &Egress,
    tunnels: CancellationToken,
) {
    let policy = egress.installed.borrow().clone();
    let upstream = match proxy::dial(&allowed.addresses, egress).await {
        Ok(upstream) => upstream,
        Err(reason) => {
            super::decision::report(
                &egress.audit,
                &asked,
                policy.as_deref(),
                "unreachable",
                allowed.rule.as_deref(),
                &reason,
            );
            return;
        }
    };
    let verdict = if allowed.rule.is_some() { "allow" } else { "audit" };
    let open = super::decision::Open::new(
        &egress.audit,
        &asked,
        policy.as_deref(),
        verdict,
        allowed.rule.as_deref(),
        "redirected",
    );
    proxy::hold(client, &sent, upstream, asked, egress.installed.clone(), tunnels, open).await;
}

/// Logs and keeps the refusal; the connection closes when it is dropped.
fn refuse(asked: &Asked, egress: &Egress, reason: &str) {
    let policy = egress.installed.borrow().clone();
    super::decision::report(&egress.audit, asked, policy.as_deref(), "deny", None, reason);
    egress.recent.record(proxy::denial(asked, policy.as_deref(), reason));
}

/// An origin-form request of a redirected connection in the absolute form the proxy decides:
/// the host its `Host` header names (else the address dialed), on the port dialed.
fn absolute(mut request: HttpRequest<Incoming>, dialed: SocketAddr) -> HttpRequest<Incoming> {
    if request.uri().authority().is_some() {
        return request;
    }
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.parse::<hyper::http::uri::Authority>().ok())
        .map(|a| a.host().to_owned());
    let host = match host {
        Some(host) => host,
        None => match dialed.ip() {
            std::net::IpAddr::V4(ip) => ip.to_string(),
            std::net::IpAddr::V6(ip) => format!("[{ip}]"),
        },
    };
    let path = request.uri().path_and_query().map_or("/", |p| p.as_str());
    if let Ok(uri) = format!("http://{host}:{}{path}", dialed.port()).parse() {
        *request.uri_mut() = uri;
    }
    request
}

/// Reads the client's first flight up to its ClientHello and returns what was read (to be sent
/// on) and the server name it asks for.
async fn client_hello(client: &TcpStream, limit: Duration) -> (Vec<u8>, Option<String>) {
    let mut sent = Vec::with_capacity(2048);
    let mut acceptor = rustls::server::Acceptor::default();
    let reading = async {
        let mut chunk = [0u8; 4096];
        loop {
            if sent.len() >= MAX_CLIENT_HELLO {
                return None;
            }
            if client.readable().await.is_err() {
                return None;
            }
            let n = match client.try_read(&mut chunk) {
                Ok(0) => return None,
                Ok(n) => n,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => continue,
                Err(_) => return None,
            };
            sent.extend_from_slice(&chunk[..n]);
            let mut fed = &chunk[..n];
            while !fed.is_empty() {
                if acceptor.read_tls(&mut fed).is_err() {
                    return None;
                }
            }
            match acceptor.accept() {
                Ok(Some(accepted)) => return accepted.client_hello().server_name().map(str::to_owned),
                Ok(None) => continue,
                Err(_) => return None,
            }
        }
    };
    let name = timeout(limit, reading).await.ok().flatten();
    (sent, name)
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::egress::{Floor, Limits};

    /// A redirect listener whose every connection "was dialed" to `dialed`, deciding with one
    /// rule for `host` on `port`.
    async fn redirect_with_rule(
        dialed: SocketAddr,
        host: &str,
        port: u16,
        shutdown: &CancellationToken,
    ) -> (SocketAddr, Egress) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("addr");
        let floor = Floor {
            local: true,
            ..Floor::default()
        };
        let limits = Limits {
            header_timeout: Duration::from_secs(2),
            ..Limits::default()
        };
        let egress = crate::egress::one_rule(host, port, floor, limits);
        let original: Original = Arc::new(move |_: &TcpStream| Ok(dialed));
        tokio::spawn(serve(listener, egress.clone(), original, shutdown.clone()));
        (address, egress)
    }

    /// An upstream that answers every connection with `upstream` and what it read first.
    async fn upstream() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let n = stream.read(&mut buf).await.unwrap_or(0);
                    let body = format!("upstream read {n} bytes");
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = stream.write_all(answer.as_bytes()).await;
                });
            }
        });
        address
    }

    /// Whether a denial of a destination starting with `prefix` is kept for `{"op":"policy"}`.
    fn kept_denial(egress: &Egress, prefix: &str) -> bool {
        egress.recent.list().iter().any(|d| d.destination.starts_with(prefix))
    }

    async fn exchange(at: SocketAddr, bytes: &[u8]) -> String {
        let mut stream = TcpStream::connect(at).await.expect("connect");
        stream.write_all(bytes).await.expect("write");
        let mut answer = Vec::new();
        let _ = timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
            .await
            .expect("answered or closed");
        String::from_utf8_lossy(&answer).into_owned()
    }

    /// A ClientHello as a real TLS client sends it, naming `name`.
    fn client_hello_for(name: &str) -> Vec<u8> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let server = rustls::pki_types::ServerName::try_from(name.to_owned()).expect("name");
        let mut connection = rustls::ClientConnection::new(Arc::new(config), server).expect("client");
        let mut hello = Vec::new();
        connection.write_tls(&mut hello).expect("hello");
        hello
    }

    /// An upstream, and a redirect listener whose connections were dialed to some address
    /// on its port, with the one rule for `localhost` on that port.
    async fn fixture(shutdown: &CancellationToken) -> (SocketAddr, SocketAddr, Egress) {
        let up = upstream().await;
        let dialed: SocketAddr = format!("10.1.2.3:{}", up.port()).parse().unwrap();
        let (at, egress) = redirect_with_rule(dialed, "localhost", up.port(), shutdown).await;
        (dialed, at, egress)
    }

    #[tokio::test]
    async fn plain_http_is_decided_by_its_host_and_a_refusal_explained() {
        let shutdown = CancellationToken::new();
        let (_, at, egress) = fixture(&shutdown).await;
        let allowed = exchange(at, b"GET /x HTTP/1.1\r\nHost: localhost\r\nconnection: close\r\n\r\n").await;
        assert!(allowed.starts_with("HTTP/1.1 200"), "{allowed}");
        assert!(allowed.contains("upstream read"), "{allowed}");

        let denied = exchange(
            at,
            b"GET /x HTTP/1.1\r\nHost: other.example\r\nconnection: close\r\n\r\n",
        )
        .await;
        assert!(denied.starts_with("HTTP/1.1 403"), "{denied}");
        assert!(
            denied.contains("\"ruleNeeded\":{\"host\":\"other.example\""),
            "{denied}"
        );
        assert!(kept_denial(&egress, "other.example:"));
        shutdown.cancel();
    }

    #[tokio::test]
    async fn tls_is_decided_by_its_server_name_and_sent_on_whole() {
        let shutdown = CancellationToken::new();
        let (_, at, egress) = fixture(&shutdown).await;
        let hello = client_hello_for("localhost");
        let allowed = exchange(at, &hello).await;
        assert!(
            allowed.contains(&format!("upstream read {} bytes", hello.len())),
            "the ClientHello reached the upstream whole: {allowed}"
        );

        let denied = exchange(at, &client_hello_for("other.example")).await;
        assert!(denied.is_empty(), "a refused TLS connection is closed: {denied}");
        assert!(kept_denial(&egress, "other.example:"));
        shutdown.cancel();
    }

    #[tokio::test]
    async fn an_address_no_rule_names_is_closed_whatever_is_sent() {
        let shutdown = CancellationToken::new();
        let (dialed, at, egress) = fixture(&shutdown).await;
        let closed = exchange(at, b"\x00\x01binary protocol").await;
        assert!(closed.is_empty(), "{closed}");
        assert!(kept_denial(&egress, &dialed.to_string()));
        shutdown.cancel();
    }

    #[tokio::test]
    async fn an_address_a_rule_names_is_carried_at_once() {
        let up = upstream().await;
        let shutdown = CancellationToken::new();
        // A rule naming the loopback address itself (honoured locally only).
        let (at, _) = redirect_with_rule(up, "127.0.0.1", up.port(), &shutdown).await;
        let carried = exchange(at, b"\x00\x01binary protocol").await;
        assert!(carried.contains("upstream read 17 bytes"), "{carried}");
        shutdown.cancel();
    }

    #[test]
    fn what_is_sent_first_is_told_apart() {
        assert!(matches!(classify(b"GET / HT"), First::Http));
        assert!(matches!(classify(b"OPTIONS "), First::Http));
        assert!(matches!(classify(b"\x16\x03\x01\x02\x00"), First::Tls));
        assert!(matches!(classify(b"SSH-2.0-"), First::Other));
        assert!(matches!(classify(b"get / "), First::Other));
    }
}
