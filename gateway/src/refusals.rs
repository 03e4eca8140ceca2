//! Refused calls in the log, bounded per source. Every call of the gRPC port that ends
//! `UNAUTHENTICATED` or `PERMISSION_DENIED` is seen here, in one place ([`Logged`] wraps each
//! service): the first [`LOG_PER_SOURCE`] refusals of a source (the peer's IP address) in each
//! [`INTERVAL`] are logged at WARN, at most [`LOG_PER_INTERVAL`] of all sources together; the
//! rest are counted (`openshell_gateway_refusal_lines_suppressed_total`) and reported by the
//! source's next logged line (`suppressed`), or by a summary line once its interval passed
//! and another refusal comes. A client that is refused 650 times a second writes a line every
//! two seconds, not 650.
//!
//! No line holds a credential: the refusal's message never quotes the token (`auth`), and
//! the call's bearer token is cut out of it here all the same.
//!
//! [`Logged`] also opens the call's span (`rpc`, with the method, the peer, and the `route`,
//! `member` and `term` the handler learns: [`record`]), so every line a call writes, on any
//! replica, says whose it was.
//!
//! A hand-written window rather than `governor`: the suppressed count of each source has to
//! be kept and reported anyway, which is the whole per-source map; governor (not in
//! Cargo.lock) would only answer "allowed or not" on top of it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use tonic::codegen::{BoxFuture, Service, http};
use tonic::server::NamedService;
use tonic::transport::server::TcpConnectInfo;
use tonic::{Code, Status};
use tracing::field::Empty;
use tracing::{Instrument, Span, info_span, warn};

/// The window refusals are counted in.
pub const INTERVAL: Duration = Duration::from_secs(10);
/// Refusals of one source logged in one window.
pub const LOG_PER_SOURCE: u32 = 5;
/// Refusals of all sources logged in one window.
pub const LOG_PER_INTERVAL: u32 = 100;
/// Sources tracked at once; beyond it, the ones whose window passed are reported and
/// dropped, and if that is not enough, new sources share one entry.
pub const MAX_SOURCES: usize = 4096;

/// Where refusals come from: the peer's IP address (not its port: one client opens many
/// connections), or `None` when the transport does not say.
pub type Source = Option<IpAddr>;

/// What to do with one refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Log it, saying how many of this source's refusals were not logged before it.
    Log { suppressed: u64 },
    /// Count it only.
    Suppress,
}

#[derive(Debug, Clone, Copy)]
struct Window {
    started: Instant,
    logged: u32,
    /// Refusals not logged since this source's last logged line.
    suppressed: u64,
}

/// The per-source windows. Pure: the caller gives the time.
#[derive(Debug)]
pub struct Limiter {
    sources: HashMap<Source, Window>,
    overflow: Window,
    global: Window,
}

impl Limiter {
    pub fn new(now: Instant) -> Self {
        let window = Window {
            started: now,
            logged: 0,
            suppressed: 0,
        };
        Self {
            sources: HashMap::new(),
            overflow: window,
            global: window,
        }
    }

    /// Decide on one refusal of `source` at `now`; `ended` receives the suppressed counts of
    /// sources whose window passed and that are forgotten to make room (to be reported).
    pub fn admit(&mut self, source: Source, now: Instant, ended: &mut Vec<(Source, u64)>) -> Verdict {
        if self.sources.len() >= MAX_SOURCES && !self.sources.contains_key(&source) {
            self.sweep(now, ended);
        }
        if now.duration_since(self.global.started) >= INTERVAL {
            self.global = Window {
                started: now,
                logged: 0,
                suppressed: 0,
            };
        }
        let room = self.sources.len() < MAX_SOURCES;
        let window = match room {
            true => self.sources.entry(source).or_insert(Window {
                started: now,
                logged: 0,
                suppressed: 0,
            }),
            false => &mut self.overflow,
        };
        if now.duration_since(window.started) >= INTERVAL {
            window.started = now;
            window.logged = 0;
        }
        if window.logged >= LOG_PER_SOURCE || self.global.logged >= LOG_PER_INTERVAL {
            window.suppressed += 1;
            return Verdict::Suppress;
        }
        window.logged += 1;
        self.global.logged += 1;
        Verdict::Log {
            suppressed: std::mem::take(&mut window.suppressed),
        }
    }

    /// Forget the sources whose window passed, handing over those with refusals not logged.
    pub fn sweep(&mut self, now: Instant, ended: &mut Vec<(Source, u64)>) {
        self.sources.retain(|source, window| {
            let live = now.duration_since(window.started) < INTERVAL;
            if !live && window.suppressed > 0 {
                ended.push((*source, window.suppressed));
            }
            live
        });
    }
}

/// The refusal log of one replica.
#[derive(Debug)]
pub struct Refusals {
    limiter: Mutex<Limiter>,
    last_sweep: Mutex<Instant>,
    suppressed: Counter,
}

impl Refusals {
    /// Counting suppressed lines in `suppressed`.
    pub fn new(suppressed: Counter) -> Self {
        let now = Instant::now();
        Self {
            limiter: Mutex::new(Limiter::new(now)),
            last_sweep: Mutex::new(now),
            suppressed,
        }
    }

    /// One refused call of `rpc` from `source`, answered with `status`; `token` is the bearer
    /// token the call carried (cut out of anything logged).
    pub fn refused(&self, source: Source, rpc: &str, status: &Status, token: Option<&str>) {
        let now = Instant::now();
        let mut ended = Vec::new();
        let verdict = {
            let mut limiter = self.limiter.lock().unwrap_or_else(|p| p.into_inner());
            let mut last_sweep = self.last_sweep.lock().unwrap_or_else(|p| p.into_inner());
            if now.duration_since(*last_sweep) >= INTERVAL {
                *last_sweep = now;
                limiter.sweep(now, &mut ended);
            }
            limiter.admit(source, now, &mut ended)
        };
        for (source, count) in ended {
            warn!(peer = %shown(source), suppressed = count, "refused calls not logged (rate limit)");
        }
        match verdict {
            Verdict::Suppress => {
                self.suppressed.inc();
            }
            Verdict::Log { suppressed } => {
                let message = redact(status.message(), token);
                warn!(peer = %shown(source), rpc = %plumbing::text::bounded(rpc, 200), code = ?status.code(),
                      message = %plumbing::text::bounded(&message, 300), suppressed, "call refused");
            }
        }
    }
}

fn shown(source: Source) -> String {
    source.map_or_else(|| "unknown".to_owned(), |ip| ip.to_string())
}

/// `message` without `token` in it.
pub fn redact(message: &str, token: Option<&str>) -> String {
    match token.filter(|t| !t.is_empty()) {
        Some(token) => message.replace(token, "<redacted>"),
        None => message.to_owned(),
    }
}

/// Whether an answer is a refusal this log is about.
pub fn is_refusal(code: Code) -> bool {
    matches!(code, Code::Unauthenticated | Code::PermissionDenied)
}

/// A gRPC service whose refusals go to [`Refusals`].
#[derive(Debug, Clone)]
pub struct Logged<S> {
    inner: S,
    refusals: Arc<Refusals>,
}

impl<S> Logged<S> {
    pub fn new(inner: S, refusals: Arc<Refusals>) -> Self {
        Self { inner, refusals }
    }
}

impl<S: NamedService> NamedService for Logged<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B, RB> Service<http::Request<B>> for Logged<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    RB: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let source = request
            .extensions()
            .get::<TcpConnectInfo>()
            .and_then(|info| info.remote_addr)
            .map(|addr| addr.ip());
        let token = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|t| t.trim().to_owned());
        let rpc = request.uri().path().to_owned();
        let refusals = self.refusals.clone();
        let span = info_span!("rpc", rpc = %rpc, peer = ?source, route = Empty, member = Empty, term = Empty);
        let answer = span.in_scope(|| self.inner.call(request));
        Box::pin(
            async move {
                let response = answer.await?;
                if let Some(status) = Status::from_header_map(response.headers())
                    && is_refusal(status.code())
                {
                    refusals.refused(source, &rpc, &status, token.as_deref());
                }
                Ok(response)
            }
            .instrument(span),
        )
    }
}

/// What a call is about, once its handler knows it: recorded in the call's span (opened by
/// [`Logged`]), so every later line of the call carries it. Outside a call, nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct About<'a> {
    pub route: Option<&'a str>,
    pub member: Option<&'a str>,
    pub term: Option<u64>,
}

/// Records `about` in the current call's span.
pub fn record(about: About<'_>) {
    let span = Span::current();
    if let Some(route) = about.route {
        span.record("route", tracing::field::display(route));
    }
    if let Some(member) = about.member {
        span.record("member", tracing::field::display(member));
    }
    if let Some(term) = about.term {
        span.record("term", term);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_logs_its_first_few_per_window_and_then_says_how_many_it_did_not() {
        let start = Instant::now();
        let mut limiter = Limiter::new(start);
        let mut ended = Vec::new();
        let a: Source = Some("10.0.0.1".parse().unwrap());
        let b: Source = Some("10.0.0.2".parse().unwrap());
        let mut logged = 0;
        for i in 0..650 {
            let at = start + Duration::from_millis(i);
            if matches!(limiter.admit(a, at, &mut ended), Verdict::Log { .. }) {
                logged += 1;
            }
        }
        assert_eq!(logged, LOG_PER_SOURCE, "650 refusals in one window");
        // Another source is not silenced by the first.
        assert_eq!(limiter.admit(b, start, &mut ended), Verdict::Log { suppressed: 0 });
        // The next window's first line tells what was not logged.
        let next = start + INTERVAL + Duration::from_secs(1);
        assert_eq!(
            limiter.admit(a, next, &mut ended),
            Verdict::Log {
                suppressed: 650 - u64::from(LOG_PER_SOURCE)
            }
        );
        assert_eq!(limiter.admit(a, next, &mut ended), Verdict::Log { suppressed: 0 });
        assert!(ended.is_empty());
    }

    #[test]
    fn a_quiet_source_is_reported_by_the_sweep_and_all_sources_share_a_bound() {
        let start = Instant::now();
        let mut limiter = Limiter::new(start);
        let mut ended = Vec::new();
        let a: Source = Some("10.0.0.1".parse().unwrap());
        for _ in 0..LOG_PER_SOURCE + 3 {
            limiter.admit(a, start, &mut ended);
        }
        limiter.sweep(start + INTERVAL, &mut ended);
        assert_eq!(ended, vec![(a, 3)]);

        let mut limiter = Limiter::new(start);
        let logged = (0..1000u32)
            .map(|i| Some(IpAddr::from(i.to_be_bytes())))
            .filter(|s| matches!(limiter.admit(*s, start, &mut ended), Verdict::Log { .. }))
            .count();
        assert_eq!(logged, LOG_PER_INTERVAL as usize);
    }

    /// The lines `run` logs.
    fn logged(run: impl FnOnce()) -> String {
        #[derive(Clone, Default)]
        struct Lines(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Lines {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, run);
        String::from_utf8(lines.0.lock().unwrap().clone()).unwrap()
    }

    /// A service that refuses every call, quoting the token it got (as no real one does).
    #[derive(Clone)]
    struct Refusing;

    impl Service<http::Request<()>> for Refusing {
        type Response = http::Response<tonic::body::Body>;
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<()>) -> Self::Future {
            let token = request
                .headers()
                .get("authorization")
                .unwrap()
                .to_str()
                .unwrap()
                .to_owned();
            std::future::ready(Ok(Status::unauthenticated(format!("refused {token}")).into_http()))
        }
    }

    /// A handler that records what its call is about and logs a line.
    #[derive(Clone)]
    struct Handling;

    impl Service<http::Request<()>> for Handling {
        type Response = http::Response<tonic::body::Body>;
        type Error = std::convert::Infallible;
        type Future = BoxFuture<Self::Response, Self::Error>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<()>) -> Self::Future {
            Box::pin(async {
                tokio::task::yield_now().await;
                record(About {
                    route: Some("team-a/agent-0"),
                    member: Some("supervisor-1"),
                    term: Some(7),
                });
                tracing::info!("granted");
                Ok(http::Response::new(tonic::body::Body::empty()))
            })
        }
    }

    #[test]
    fn every_line_of_a_call_names_its_method_route_member_and_term() {
        let refusals = Arc::new(Refusals::new(Counter::default()));
        let mut service = Logged::new(Handling, refusals);
        let lines = logged(|| {
            let mut request = http::Request::new(());
            *request.uri_mut() = "/recovery.v1.SupervisorRecovery/IssueGrant".parse().unwrap();
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            runtime.block_on(service.call(request)).unwrap();
        });
        let line = lines.lines().find(|l| l.contains("granted")).expect(&lines);
        for field in [
            "rpc{rpc=/recovery.v1.SupervisorRecovery/IssueGrant",
            "route=team-a/agent-0",
            "member=supervisor-1",
            "term=7",
        ] {
            assert!(line.contains(field), "{field} missing from {line}");
        }
    }

    #[test]
    fn a_flood_of_refused_calls_from_one_peer_writes_a_few_lines_and_counts_the_rest() {
        let suppressed = Counter::default();
        let refusals = Arc::new(Refusals::new(suppressed.clone()));
        let mut service = Logged::new(Refusing, refusals);
        let token = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2VjcmV0LXNpZ25hdHVyZQ";
        let lines = logged(|| {
            for _ in 0..650 {
                let mut request = http::Request::new(());
                *request.uri_mut() = "/registry.v1.InstanceRegistry/Register".parse().unwrap();
                request
                    .headers_mut()
                    .insert("authorization", format!("Bearer {token}").parse().unwrap());
                request.extensions_mut().insert(TcpConnectInfo {
                    local_addr: None,
                    remote_addr: Some("10.1.2.3:40000".parse().unwrap()),
                });
                let response = futures::executor::block_on(service.call(request)).unwrap();
                assert_eq!(
                    Status::from_header_map(response.headers()).unwrap().code(),
                    Code::Unauthenticated
                );
            }
        });
        let refused: Vec<&str> = lines.lines().filter(|l| l.contains("call refused")).collect();
        assert_eq!(refused.len(), LOG_PER_SOURCE as usize, "{lines}");
        assert!(
            refused.iter().all(|l| l.contains("WARN") && l.contains("10.1.2.3")),
            "{lines}"
        );
        assert!(!lines.contains(token) && !lines.contains("c2VjcmV0"), "{lines}");
        assert_eq!(suppressed.get(), 650 - u64::from(LOG_PER_SOURCE));
    }

    #[test]
    fn a_credential_used_for_another_route_or_member_is_not_logged_by_the_check_itself() {
        let caller = crate::auth::InstanceCaller {
            route: "team-a/agent".into(),
            namespace: "team-a".into(),
            name: "agent".into(),
            uid: Some("u1".into()),
        };
        let member = crate::auth::MemberCaller {
            member: "m1".into(),
            expires_at_ms: 0,
        };
        let other = proto::common::v1::InstanceRef {
            namespace: "team-b".into(),
            name: "x".into(),
            uid: "u2".into(),
            ..Default::default()
        };
        let lines = logged(|| {
            for _ in 0..650 {
                assert!(caller.owns("team-b/x", &other).is_err());
                assert!(member.is("m2").is_err());
            }
        });
        assert_eq!(lines, "", "the refusal is logged once, rate-limited, by Logged");
    }

    #[test]
    fn the_token_never_reaches_a_line() {
        assert_eq!(
            redact("token abc.def.ghi refused", Some("abc.def.ghi")),
            "token <redacted> refused"
        );
        assert_eq!(redact("refused", Some("")), "refused");
    }
}
