//! The sidecar as the Pod's way out: an HTTP/1.1 forward proxy on a loopback port that the
//! workload's HTTP clients use through `HTTP_PROXY`/`HTTPS_PROXY`. A tunnel (`CONNECT
//! host:port`, what clients do for `https://`) is decided on its host and port; a plain
//! `http://` request also on its method and path. Names are resolved here and every address
//! is checked against the [`Floor`] before it is dialed, and the checked address is the one
//! dialed. A refusal is an HTTP 403 with a JSON body naming the destination, the policy
//! revision and the rule that would be needed — never a hang or a bare reset. An installed
//! revision that no longer allows an open tunnel closes it at once.
//!
//! This is the thin driver: the decisions are [`Policy::decide`] and [`Floor::refuses`].

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request as HttpRequest, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::decision::{self, Counted, Open};
use super::floor::Floor;
use super::policy::{Policy, Request, Target, Verdict};
use super::{origin, placeholder};

type Body = BoxBody<Bytes, hyper::Error>;

/// The revision in force (`None`: nothing installed yet, every destination is denied).
pub type Installed = watch::Receiver<Option<Arc<Policy>>>;

/// Bounds on what one workload can make the proxy hold.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Open client connections (tunnels included); more are answered 503 and closed.
    pub max_connections: usize,
    /// Request line and headers, bytes.
    pub max_header_bytes: usize,
    /// For a request's headers to arrive.
    pub header_timeout: Duration,
    /// For a name to resolve.
    pub resolve_timeout: Duration,
    /// For one upstream address to accept.
    pub connect_timeout: Duration,
    /// For a plain-HTTP upstream's response headers.
    pub response_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_header_bytes: 64 * 1024,
            header_timeout: Duration::from_secs(10),
            resolve_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(60),
        }
    }
}

/// What the proxy decides with.
#[derive(Clone)]
pub struct Egress {
    pub installed: Installed,
    pub floor: Arc<Floor>,
    pub limits: Limits,
    /// Where denials are kept for the workload to read.
    pub recent: Arc<super::Recent>,
    /// Under egress redirection, the Pod's dialer opens every upstream connection (only its
    /// connections leave the Pod); otherwise this process dials.
    pub dialer: Option<plumbing::dialer::Dialer>,
    /// Where every decision is recorded for the audit trail.
    pub audit: super::audit::Recorder,
}

/// Serves `listener` until `shutdown`; then every connection and tunnel is closed.
pub async fn serve(listener: TcpListener, egress: Egress, shutdown: CancellationToken) {
    let max = egress.limits.max_connections;
    accept_each(listener, max, shutdown.clone(), move |stream, permit| {
        let egress = egress.clone();
        let shutdown = shutdown.clone();
        async move {
            match permit {
                Some(permit) => connection(stream, egress, Arc::new(permit), shutdown).await,
                None => refuse_busy(stream).await,
            }
        }
    })
    .await;
}

/// Accepts on `listener` until `shutdown`, running `each` on every connection as a task with
/// one of `max` permits (`None` beyond the cap, to be refused); then ends every task.
pub(super) async fn accept_each<F, Fut>(listener: TcpListener, max: usize, shutdown: CancellationToken, each: F)
where
    F: Fn(TcpStream, Option<OwnedSemaphorePermit>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let permits = Arc::new(Semaphore::new(max));
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        match accepted {
            Ok((stream, _)) => {
                let permit = permits.clone().try_acquire_owned().ok();
                connections.spawn(each(stream, permit));
            }
            Err(err) => {
                warn!(error = %err, "egress: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    connections.shutdown().await;
}

async fn refuse_busy(mut stream: TcpStream) {
    use tokio::io::AsyncWriteExt;
    let body = json!({"error": "egress proxy busy: too many open connections"}).to_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = timeout(Duration::from_secs(1), stream.write_all(answer.as_bytes())).await;
}

async fn connection(stream: TcpStream, egress: Egress, permit: Arc<OwnedSemaphorePermit>, shutdown: CancellationToken) {
    http_connection(stream, egress, permit, shutdown, |request| request).await;
}

/// Serves one client connection with `rewrite` applied to each request before it is decided
/// (the redirected connections' origin-form requests are given the absolute form here).
pub(super) async fn http_connection(
    stream: TcpStream,
    egress: Egress,
    permit: Arc<OwnedSemaphorePermit>,
    shutdown: CancellationToken,
    rewrite: impl Fn(HttpRequest<Incoming>) -> HttpRequest<Incoming> + Clone + Send + Sync + 'static,
) {
    let _ = stream.set_nodelay(true);
    let limits = egress.limits;
    let tunnels = shutdown.child_token();
    let service = hyper::service::service_fn(move |request| {
        let egress = egress.clone();
        let permit = permit.clone();
        let tunnels = tunnels.clone();
        let request = rewrite(request);
        async move {
            let connect = request.method() == Method::CONNECT;
            let mut response = handle(request, &egress, permit, tunnels).await;
            // A refused tunnel ends the connection: hyper would keep it for a next request that
            // a CONNECT client never sends, and one reading the refusal to its end would wait.
            if connect && !response.status().is_success() {
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            Ok::<_, Infallible>(response)
        }
    });
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(limits.max_header_bytes.max(8192))
        .max_headers(128)
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    tokio::select! {
        () = shutdown.cancelled() => {}
        _ = served => {}
    }
}

/// The destination a refusal or a log line names.
pub(super) struct Asked {
    pub(super) target: Target,
    pub(super) port: u16,
    pub(super) http: Option<(Method, String)>,
}

impl Asked {
    pub(super) fn request(&self) -> Request<'_> {
        Request {
            host: &self.target,
            port: self.port,
            http: self.http.as_ref().map(|(m, p)| (m.as_str(), p.as_str())),
        }
    }

    pub(super) fn destination(&self) -> String {
        format!("{}:{}", self.target, self.port)
    }
}

/// Allowed: the rule (none in an audit-only policy's would-be denial), and the addresses to dial.
pub(super) struct Allowed {
    pub(super) rule: Option<String>,
    pub(super) addresses: Vec<SocketAddr>,
}

pub(super) struct Denied {
    status: StatusCode,
    pub(super) reason: String,
    /// A rule could allow it (the floor: no rule can).
    rule_would_help: bool,
}

async fn handle(
    request: HttpRequest<Incoming>,
    egress: &Egress,
    permit: Arc<OwnedSemaphorePermit>,
    tunnels: CancellationToken,
) -> Response<Body> {
    let head: usize = request
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum();
    if head > egress.limits.max_header_bytes {
        let reason = format!("the request's headers exceed {} bytes", egress.limits.max_header_bytes);
        return refusal(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "bad proxy request",
            &reason,
            None,
            egress,
        );
    }
    let asked = match asked(&request) {
        Ok(asked) => asked,
        Err(reason) => return refusal(StatusCode::BAD_REQUEST, "bad proxy request", &reason, None, egress),
    };
    let policy = egress.installed.borrow().clone();
    let allowed = match decide(&asked, policy.as_deref(), egress).await {
        Ok(allowed) => allowed,
        Err(denied) => {
            decision::report(&egress.audit, &asked, policy.as_deref(), "deny", None, &denied.reason);
            egress.recent.record(denial(&asked, policy.as_deref(), &denied.reason));
            let needed = Some((&asked, denied.rule_would_help));
            return refusal(denied.status, "egress denied", &denied.reason, needed, egress);
        }
    };
    let mut request = request;
    let rule = allowed
        .rule
        .as_deref()
        .and_then(|name| policy.as_deref()?.rule(name))
        .cloned();
    // An allowed request that goes no further: logged with `decision`, answered `status`.
    let fail = |status: StatusCode, error: &str, decision: &str, reason: &str| {
        decision::report(
            &egress.audit,
            &asked,
            policy.as_deref(),
            decision,
            allowed.rule.as_deref(),
            reason,
        );
        refusal(status, error, reason, Some((&asked, false)), egress)
    };
    if request.method() != Method::CONNECT
        && let Some(policy) = policy.as_deref()
    {
        let uri = request.uri().clone();
        match placeholder::substitute(request.headers_mut(), &uri, policy, rule.as_ref(), egress.floor.local) {
            Ok(done) => {
                for credential in done.attempts {
                    let reason = format!(
                        "the placeholder of credential {credential:?}, which this destination's rule does not bind, was sent unchanged"
                    );
                    decision::report(
                        &egress.audit,
                        &asked,
                        Some(policy),
                        "placeholder-attempt",
                        allowed.rule.as_deref(),
                        &reason,
                    );
                }
            }
            Err(not_held) => {
                let status = StatusCode::SERVICE_UNAVAILABLE;
                return fail(status, "credential not held", "credential-missing", &not_held.reason);
            }
        }
    }
    let upstream = match dial(&allowed.addresses, egress).await {
        Ok(upstream) => upstream,
        Err(reason) => return fail(StatusCode::BAD_GATEWAY, "upstream unreachable", "unreachable", &reason),
    };
    let verdict = if allowed.rule.is_some() { "allow" } else { "audit" };
    let open = Open::new(
        &egress.audit,
        &asked,
        policy.as_deref(),
        verdict,
        allowed.rule.as_deref(),
        "",
    );
    if request.method() == Method::CONNECT {
        let installed = egress.installed.clone();
        tokio::spawn(async move {
            let _permit = permit;
            match hyper::upgrade::on(request).await {
                Ok(upgraded) => tunnel(upgraded, upstream, asked, installed, tunnels, open).await,
                Err(err) => warn!(error = %err, "egress tunnel: the client did not upgrade"),
            }
        });
        return Response::new(empty());
    }
    let response_timeout = egress.limits.response_timeout;
    let Some(ca_bundle) = rule.as_ref().and_then(|r| r.originate_tls.as_deref()) else {
        return forward(request, upstream, &asked, response_timeout, open).await;
    };
    let limit = egress.limits.connect_timeout;
    let reason = match timeout(limit, origin::connect(upstream, &asked.target, ca_bundle)).await {
        Ok(Ok(tls)) => return forward(request, tls, &asked, response_timeout, open).await,
        Ok(Err(reason)) => reason,
        Err(_) => format!("no TLS handshake within {limit:?}"),
    };
    fail(StatusCode::BAD_GATEWAY, "upstream TLS failed", "tls-failed", &reason)
}

/// The destination of a proxy request, or why it is none.
fn asked(request: &HttpRequest<Incoming>) -> Result<Asked, String> {
    let uri = request.uri();
    if request.method() == Method::CONNECT {
        let authority = uri.authority().ok_or("CONNECT needs host:port")?;
        let port = authority.port_u16().ok_or("CONNECT needs host:port")?;
        let target = Target::parse(authority.host()).ok_or("CONNECT names no valid host")?;
        if let Some(host) = request.headers().get(header::HOST)
            && !host.as_bytes().eq_ignore_ascii_case(authority.as_str().as_bytes())
        {
            return Err("the Host header differs from the CONNECT target".into());
        }
        return Ok(Asked {
            target,
            port,
            http: None,
        });
    }
    match uri.scheme_str() {
        Some("http") => {}
        Some(_) => return Err("only http:// requests are forwarded; use CONNECT for https://".into()),
        None => return Err("this is a forward proxy: send an absolute http:// URL or CONNECT".into()),
    }
    let authority = uri.authority().ok_or("the URL names no host")?;
    let target = Target::parse(authority.host()).ok_or("the URL names no valid host")?;
    let path = uri.path().to_owned();
    Ok(Asked {
        target,
        port: authority.port_u16().unwrap_or(80),
        http: Some((request.method().clone(), path)),
    })
}

/// The policy, then the floor on every address the destination resolves to.
pub(super) async fn decide(asked: &Asked, policy: Option<&Policy>, egress: &Egress) -> Result<Allowed, Denied> {
    let denied = |reason: String, rule_would_help| Denied {
        status: StatusCode::FORBIDDEN,
        reason,
        rule_would_help,
    };
    if let Target::Name(name) = &asked.target
        && let Some(why) = egress.floor.refuses_name(name)
    {
        return Err(denied(
            format!("{name} is never reachable from a workload: {why}"),
            false,
        ));
    }
    // An address no rule could open (refused even with a rule naming it) is refused as such
    // before any rule is looked at, so the refusal never suggests a rule that would not help.
    if let Target::Address(address) = &asked.target
        && let Some(why) = egress.floor.refuses(SocketAddr::new(*address, asked.port), true)
    {
        return Err(denied(
            format!("{address} is never reachable from a workload: {why}"),
            false,
        ));
    }
    let Some(policy) = policy else {
        return Err(denied(
            "no egress policy is installed: every destination is denied".into(),
            true,
        ));
    };
    let request = asked.request();
    let rule = match policy.decide(&request) {
        Verdict::Allowed { rule } => Some(rule),
        Verdict::Denied { enforced: true, reason } => return Err(denied(reason, true)),
        Verdict::Denied { enforced: false, .. } => None,
    };
    let loopback_rule = policy.names_loopback(&request);
    let resolved = resolve(&asked.target, asked.port, egress.limits.resolve_timeout)
        .await
        .map_err(|reason| Denied {
            status: StatusCode::BAD_GATEWAY,
            reason,
            rule_would_help: false,
        })?;
    let mut refusals = Vec::new();
    let addresses: Vec<SocketAddr> = resolved
        .into_iter()
        .filter(|address| match egress.floor.refuses(*address, loopback_rule) {
            Some(why) => {
                refusals.push(format!("{} ({why})", address.ip()));
                false
            }
            None => true,
        })
        .collect();
    if addresses.is_empty() {
        let reason = format!(
            "{} resolves only to addresses no policy opens: {}",
            asked.target,
            refusals.join(", ")
        );
        return Err(denied(reason, false));
    }
    Ok(Allowed { rule, addresses })
}

async fn resolve(target: &Target, port: u16, limit: Duration) -> Result<Vec<SocketAddr>, String> {
    match target {
        Target::Address(address) => Ok(vec![SocketAddr::new(*address, port)]),
        Target::Name(name) => match timeout(limit, tokio::net::lookup_host((name.as_str(), port))).await {
            Ok(Ok(addresses)) => Ok(addresses.take(16).collect()),
            Ok(Err(err)) => Err(format!("cannot resolve {name}: {err}")),
            Err(_) => Err(format!("resolving {name} took longer than {limit:?}")),
        },
    }
}

/// The first of `addresses` that accepts, each within the connect limit: opened by the Pod's
/// dialer when there is one.
pub(super) async fn dial(addresses: &[SocketAddr], egress: &Egress) -> Result<TcpStream, String> {
    let limit = egress.limits.connect_timeout;
    let mut last = String::from("no address");
    for address in addresses {
        let connected = match &egress.dialer {
            Some(dialer) => dialer.connect(*address, limit).await.map_err(|err| err.to_string()),
            None => match timeout(limit, TcpStream::connect(address)).await {
                Ok(Ok(stream)) => Ok(stream),
                Ok(Err(err)) => Err(format!("{address}: {err}")),
                Err(_) => Err(format!("{address}: no answer within {limit:?}")),
            },
        };
        match connected {
            Ok(stream) => {
                let _ = stream.set_nodelay(true);
                return Ok(stream);
            }
            Err(reason) => last = reason,
        }
    }
    Err(last)
}

/// Carries an upgraded CONNECT as [`hold`] does.
async fn tunnel(
    upgraded: hyper::upgrade::Upgraded,
    mut upstream: TcpStream,
    asked: Asked,
    installed: Installed,
    tunnels: CancellationToken,
    open: Open,
) {
    // The client's own socket again (hyper hands back what it had read past the request), so
    // the bytes go socket to socket in the kernel.
    match upgraded.downcast::<TokioIo<TcpStream>>() {
        Ok(parts) => {
            hold(
                parts.io.into_inner(),
                &parts.read_buf,
                upstream,
                asked,
                installed,
                tunnels,
                open,
            )
            .await
        }
        Err(upgraded) => {
            let (sent, received) = (open.sent.clone(), open.received.clone());
            let carry = async {
                if let Ok((up, down)) = tokio::io::copy_bidirectional(&mut TokioIo::new(upgraded), &mut upstream).await
                {
                    sent.fetch_add(up, Ordering::Relaxed);
                    received.fetch_add(down, Ordering::Relaxed);
                }
            };
            let why = watch_revocation(carry, &asked, installed, tunnels).await;
            open.close(why);
        }
    }
}

/// Copies both ways (after `sent`, what the client sent already) until either side ends,
/// `tunnels` is cancelled, or an installed revision no longer allows the destination; then
/// records it (`open`) with the bytes it carried.
pub(super) async fn hold(
    client: TcpStream,
    sent: &[u8],
    mut upstream: TcpStream,
    asked: Asked,
    installed: Installed,
    tunnels: CancellationToken,
    open: Open,
) {
    let carry = async {
        if !sent.is_empty() {
            if upstream.write_all(sent).await.is_err() {
                return;
            }
            open.sent.fetch_add(sent.len() as u64, Ordering::Relaxed);
        }
        let _ = super::splice::both_ways(&client, &upstream, &open.sent, &open.received).await;
    };
    let why = watch_revocation(carry, &asked, installed, tunnels).await;
    open.close(why);
}

/// Runs `carry` until it ends, `tunnels` is cancelled, or an installed revision no longer
/// allows `asked`; says why when it did not end by itself.
async fn watch_revocation(
    carry: impl std::future::Future<Output = ()>,
    asked: &Asked,
    mut installed: Installed,
    tunnels: CancellationToken,
) -> Option<&'static str> {
    let revoked = async {
        loop {
            if installed.changed().await.is_err() {
                return std::future::pending().await;
            }
            let policy = installed.borrow_and_update().clone();
            let still = policy
                .as_deref()
                .is_some_and(|p| !matches!(p.decide(&asked.request()), Verdict::Denied { enforced: true, .. }));
            if !still {
                return policy;
            }
        }
    };
    tokio::select! {
        () = carry => None,
        () = tunnels.cancelled() => Some("closed: the sidecar is shutting down"),
        policy = revoked => {
            decision::log(asked, policy.as_deref(), "revoke", None, REVOKED);
            Some(REVOKED)
        }
    }
}

const REVOKED: &str = "closed: the installed revision no longer allows this tunnel";

/// Hop-by-hop headers, never passed on (RFC 9110 §7.6.1), and the proxy's own.
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("proxy-connection"),
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in HOP_BY_HOP.iter().chain(named.iter()) {
        headers.remove(name);
    }
}

async fn forward(
    request: HttpRequest<Incoming>,
    upstream: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    asked: &Asked,
    response_timeout: Duration,
    open: Open,
) -> Response<Body> {
    let (mut parts, body) = request.into_parts();
    let body = Counted::new(body, open.sent.clone(), None);
    strip_hop_by_hop(&mut parts.headers);
    let host = match asked.port {
        80 => asked.target.to_string(),
        port => format!("{}:{port}", asked.target),
    };
    if let Ok(host) = HeaderValue::from_str(&host) {
        parts.headers.insert(header::HOST, host);
    }
    let origin = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
    parts.uri = match origin.parse() {
        Ok(uri) => uri,
        Err(_) => return plain(StatusCode::BAD_REQUEST, json!({"error": "bad request target"})),
    };
    let (mut sender, link) = match hyper::client::conn::http1::handshake(TokioIo::new(upstream)).await {
        Ok(handshake) => handshake,
        Err(err) => {
            return plain(
                StatusCode::BAD_GATEWAY,
                json!({"error": "upstream unreachable", "reason": err.to_string()}),
            );
        }
    };
    tokio::spawn(link);
    match timeout(
        response_timeout,
        sender.send_request(HttpRequest::from_parts(parts, body)),
    )
    .await
    {
        Ok(Ok(response)) => {
            let (mut parts, body) = response.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            // Recorded once the answer's body has gone to the workload.
            let received = open.received.clone();
            let body = Counted::new(body, received, Some(Box::new(move || open.close(None))));
            Response::from_parts(parts, body.boxed())
        }
        Ok(Err(err)) => plain(
            StatusCode::BAD_GATEWAY,
            json!({"error": "upstream failed", "destination": asked.destination(), "reason": err.to_string()}),
        ),
        Err(_) => plain(
            StatusCode::GATEWAY_TIMEOUT,
            json!({"error": "upstream did not answer", "destination": asked.destination()}),
        ),
    }
}

/// A JSON refusal naming the destination (when there is one), the policy revision in force
/// and, when a rule could allow it (not the floor), the rule that would be needed.
fn refusal(
    status: StatusCode,
    error: &str,
    reason: &str,
    asked: Option<(&Asked, bool)>,
    egress: &Egress,
) -> Response<Body> {
    let policy = egress.installed.borrow().clone();
    let needed = asked.filter(|(_, needed)| *needed).map(|(asked, _)| {
        let mut rule = json!({"host": asked.target.to_string(), "ports": [asked.port]});
        if let Some((method, path)) = &asked.http {
            rule["methods"] = json!([method.as_str()]);
            rule["pathPrefixes"] = json!([path]);
        }
        rule
    });
    plain(
        status,
        json!({
            "error": error,
            "reason": reason,
            "destination": asked.map(|(asked, _)| asked.destination()),
            "policy": policy.as_ref().map(|p| p.name.clone()),
            "revision": policy.as_ref().map(|p| p.revision),
            "ruleNeeded": needed,
        }),
    )
}

fn plain(status: StatusCode, body: serde_json::Value) -> Response<Body> {
    let mut response = Response::new(full(body.to_string()));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn full(text: String) -> Body {
    Full::new(Bytes::from(text)).map_err(|never| match never {}).boxed()
}

fn empty() -> Body {
    full(String::new())
}

pub(super) fn denial(asked: &Asked, policy: Option<&Policy>, reason: &str) -> super::recent::Denial {
    let (method, path) = asked.http.as_ref().map_or(("", ""), |(m, p)| (m.as_str(), p.as_str()));
    super::recent::Denial {
        at_ms: proto::trust::unix_ms(std::time::SystemTime::now()),
        destination: asked.destination(),
        method: method.to_owned(),
        path: plumbing::text::bounded(path, 256),
        reason: plumbing::text::bounded(reason, 256),
        policy: policy.map(|p| p.name.clone()).unwrap_or_default(),
        revision: policy.map_or(0, |p| p.revision),
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A proxy deciding with `floor` and one rule, `host:port`; stops with the token.
    async fn proxy_with_rule(floor: Floor, host: &str, port: u16, shutdown: &CancellationToken) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("addr");
        let egress = crate::egress::one_rule(host, port, floor, Limits::default());
        tokio::spawn(serve(listener, egress, shutdown.clone()));
        address
    }

    /// The proxy's answer to `request`.
    async fn ask(proxy: SocketAddr, request: &str) -> String {
        let mut stream = TcpStream::connect(proxy).await.expect("connect");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut answer = vec![0u8; 4096];
        let n = timeout(Duration::from_secs(10), stream.read(&mut answer))
            .await
            .expect("answered")
            .expect("read");
        String::from_utf8_lossy(&answer[..n]).into_owned()
    }

    /// A name is resolved and every address checked: a rule naming `localhost` (which a local
    /// sidecar honours) does not open the pool's own endpoint it resolves to.
    #[tokio::test]
    async fn a_name_that_resolves_to_the_floor_is_refused_whatever_the_rule() {
        let upstream = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let endpoint = upstream.local_addr().expect("addr");
        let shutdown = CancellationToken::new();
        let floor = Floor {
            pool_endpoints: vec![endpoint],
            local: true,
            ..Floor::default()
        };
        let port = endpoint.port();
        let proxy = proxy_with_rule(floor, "localhost", port, &shutdown).await;
        let answer = ask(
            proxy,
            &format!("CONNECT localhost:{port} HTTP/1.1\r\nHost: localhost:{port}\r\n\r\n"),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
        assert!(
            answer.contains("resolves only to addresses no policy opens"),
            "{answer}"
        );
        assert!(answer.contains("(the pool's own endpoints)"), "{answer}");
        assert!(answer.contains("\"ruleNeeded\":null"), "no rule can open it: {answer}");
        shutdown.cancel();
    }

    /// An address of the floor that no rule names is refused as the floor, not as "no rule
    /// allows it": the refusal must not suggest a rule that could not open it (seen on the
    /// cluster, where the metadata address was answered with a `ruleNeeded`).
    #[tokio::test]
    async fn a_floor_address_no_rule_names_is_refused_without_a_rule_to_add() {
        let shutdown = CancellationToken::new();
        let proxy = proxy_with_rule(Floor::default(), "api.example.com", 443, &shutdown).await;
        for target in [
            "169.254.169.254:80",
            "127.0.0.1:9",
            "[::1]:9",
            "100.100.100.200:80",
            "metadata.google.internal:80",
            "localhost:9",
        ] {
            let answer = ask(
                proxy,
                &format!("GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\n\r\n"),
            )
            .await;
            assert!(answer.starts_with("HTTP/1.1 403"), "{target}: {answer}");
            assert!(answer.contains("never reachable from a workload"), "{target}: {answer}");
            assert!(answer.contains("\"ruleNeeded\":null"), "{target}: {answer}");
        }
        shutdown.cancel();
    }

    /// A refused CONNECT ends its connection after the answer: a client that reads the refusal
    /// to its end (as the cluster test's probe did) is not left waiting for a tunnel that will
    /// never come (hyper keeps an HTTP/1.1 connection after a non-2xx CONNECT answer otherwise).
    #[tokio::test]
    async fn a_refused_connect_is_answered_and_closed() {
        let shutdown = CancellationToken::new();
        let proxy = proxy_with_rule(Floor::default(), "api.example.com", 443, &shutdown).await;
        for request in [
            "CONNECT other.example.com:443 HTTP/1.1\r\nHost: other.example.com:443\r\n\r\n",
            "CONNECT 169.254.169.254:80 HTTP/1.1\r\nHost: 169.254.169.254:80\r\n\r\n",
            "CONNECT nonsense HTTP/1.1\r\nHost: nonsense\r\n\r\n",
        ] {
            let mut stream = TcpStream::connect(proxy).await.expect("connect");
            stream.write_all(request.as_bytes()).await.expect("write");
            let mut answer = String::new();
            timeout(Duration::from_secs(10), stream.read_to_string(&mut answer))
                .await
                .expect("the refusal ends the connection")
                .expect("read");
            assert!(answer.starts_with("HTTP/1.1 4"), "{request}: {answer}");
            assert!(answer.ends_with('}'), "{request}: the whole body: {answer}");
        }
        shutdown.cancel();
    }

    #[tokio::test]
    async fn connections_beyond_the_cap_are_answered_503_and_closed() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("addr");
        let (_installed, receiver) = watch::channel(None);
        let egress = Egress {
            installed: receiver,
            floor: Arc::new(Floor::default()),
            limits: Limits {
                max_connections: 2,
                ..Limits::default()
            },
            recent: Arc::default(),
            dialer: None,
            audit: super::super::audit::Recorder::default(),
        };
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve(listener, egress, shutdown.clone()));
        // Two open connections, each proven accepted by an answer.
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut stream = TcpStream::connect(address).await.expect("connect");
            stream
                .write_all(b"GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n")
                .await
                .expect("write");
            let mut head = [0u8; 12];
            stream.read_exact(&mut head).await.expect("an answer");
            assert_eq!(&head, b"HTTP/1.1 403", "no policy: denied, the connection kept");
            held.push(stream);
        }
        let mut third = TcpStream::connect(address).await.expect("connect");
        let mut answer = String::new();
        timeout(Duration::from_secs(10), third.read_to_string(&mut answer))
            .await
            .expect("answered at once")
            .expect("read");
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(answer.contains("too many open connections"), "{answer}");
        // One closes: the next one is served again.
        held.pop();
        let served = async {
            loop {
                let mut next = TcpStream::connect(address).await.expect("connect");
                next.write_all(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
                    .await
                    .expect("write");
                let mut head = [0u8; 12];
                if next.read_exact(&mut head).await.is_ok() && &head == b"HTTP/1.1 400" {
                    return;
                }
                tokio::task::yield_now().await;
            }
        };
        timeout(Duration::from_secs(10), served)
            .await
            .expect("a freed slot is used again");
        shutdown.cancel();
        timeout(Duration::from_secs(10), server)
            .await
            .expect("drains")
            .expect("join");
    }
}
