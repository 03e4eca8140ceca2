//! The HTTPS admission endpoint and the plain-HTTP health/metrics endpoint.
//!
//! [`run`] takes already-bound listeners (tests bind port 0), the configuration and a
//! [`ShutdownSignal`]. The first shutdown phase ([`ShutdownPhase::Drain`]) fails `/readyz`,
//! keeps serving for `shutdown_delay`, stops accepting, and waits up to `drain_timeout` for
//! in-flight connections; [`ShutdownPhase::Force`] returns at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http_body_util::BodyExt as _;
use plumbing::listener::Listener;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::Config;
use crate::inject::{InjectConfig, Injector, Redirect};
use crate::metrics::Metrics;
use crate::review::{self, FailReason, Outcome, Reviewed};
use crate::tls::{self, CertStore, TlsError};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("listener: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Limits(#[from] plumbing::listener::Error),
    #[error("cannot reach the Kubernetes API to follow the SandboxPolicies (--placeholders): {0}")]
    Kube(#[from] kube::Error),
}

/// Where the server listens. Bind them yourself (port 0 in tests) or with [`Listeners::bind`].
#[derive(Debug)]
pub struct Listeners {
    /// HTTPS, POST /mutate.
    pub webhook: TcpListener,
    /// Plain HTTP, /healthz /readyz /metrics.
    pub health: TcpListener,
}

impl Listeners {
    pub async fn bind(config: &Config) -> std::io::Result<Self> {
        Ok(Self {
            webhook: TcpListener::bind(config.listen).await?,
            health: TcpListener::bind(config.metrics_listen).await?,
        })
    }
}

use plumbing::shutdown::reached;
pub use plumbing::shutdown::{Phase as ShutdownPhase, Signal as ShutdownSignal, Trigger as ShutdownTrigger};

/// A trigger and the signal [`run`] takes.
pub fn shutdown_channel() -> (ShutdownTrigger, ShutdownSignal) {
    plumbing::shutdown::channel()
}

/// Everything a handler needs.
#[derive(Debug)]
pub struct AppState {
    /// `/mutate`: the proxy variables only.
    pub injector: Injector,
    /// `/mutate/redirect`: namespaces that turned egress redirection on.
    pub redirect: Injector,
    /// `/mutate/redirect-blocked`: they did, but their Pod Security level refuses it.
    pub redirect_blocked: Injector,
    pub metrics: Arc<Metrics>,
    pub store: Arc<CertStore>,
    /// The policies' placeholders the injectors read (`--placeholders`).
    pub policies: Option<crate::policies::Policies>,
    bound: AtomicBool,
    draining: AtomicBool,
    max_body_bytes: usize,
    request_timeout: Duration,
}

impl AppState {
    pub fn new(config: &Config, metrics: Arc<Metrics>, store: Arc<CertStore>) -> Self {
        let policies = config.placeholders.then(crate::policies::Policies::default);
        let injector = |inject: InjectConfig| match &policies {
            Some(policies) => Injector::new(inject).with_policies(policies.clone()),
            None => Injector::new(inject),
        };
        Self {
            injector: injector(config.inject_config()),
            redirect: injector(InjectConfig {
                egress_redirect: Redirect::On(config.redirection()),
                ..config.inject_config()
            }),
            redirect_blocked: injector(InjectConfig {
                egress_redirect: Redirect::Blocked,
                ..config.inject_config()
            }),
            policies,
            metrics,
            store,
            bound: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            max_body_bytes: config.max_body_bytes,
            request_timeout: config.request_timeout(),
        }
    }

    /// Why the webhook is not ready, if it is not.
    pub fn not_ready_reason(&self) -> Option<&'static str> {
        if !self.store.is_loaded() {
            Some("no serving certificate loaded")
        } else if !self.bound.load(Ordering::Acquire) {
            Some("webhook listener not serving")
        } else if self.draining.load(Ordering::Acquire) {
            Some("shutting down")
        } else {
            None
        }
    }
}

/// The HTTPS routes.
pub fn webhook_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route(
            "/mutate",
            post(|state, body| mutate_handler(state, body, |s| &s.injector)),
        )
        .route(
            "/mutate/redirect",
            post(|state, body| mutate_handler(state, body, |s| &s.redirect)),
        )
        .route(
            "/mutate/redirect-blocked",
            post(|state, body| mutate_handler(state, body, |s| &s.redirect_blocked)),
        )
        .with_state(state)
}

/// The plain-HTTP routes.
pub fn health_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    match state.not_ready_reason() {
        None => (StatusCode::OK, "ready\n").into_response(),
        Some(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {reason}\n")).into_response(),
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    plumbing::listener::openmetrics(state.metrics.encode()).into_response()
}

/// Read at most `limit` bytes of `body` within `timeout`.
async fn read_body(body: Body, limit: usize, timeout: Duration) -> Result<Vec<u8>, Reviewed> {
    let mut body = body;
    let mut buf = Vec::new();
    let read = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|err| {
                review::failure(
                    review::scan_uid(&buf).unwrap_or_default(),
                    FailReason::BodyRead,
                    format!("cannot read the request body: {err}"),
                )
            })?;
            if let Ok(data) = frame.into_data() {
                if buf.len() + data.len() > limit {
                    let take = limit - buf.len();
                    buf.extend_from_slice(&data[..take]);
                    return Err(review::failure(
                        review::scan_uid(&buf).unwrap_or_default(),
                        FailReason::BodyTooLarge,
                        format!("request body exceeds the limit of {limit} bytes"),
                    ));
                }
                buf.extend_from_slice(&data);
            }
        }
        Ok(())
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(())) => Ok(buf),
        Ok(Err(failed)) => Err(failed),
        Err(_) => Err(review::failure(
            review::scan_uid(&buf).unwrap_or_default(),
            FailReason::BodyRead,
            format!("the request body was not received within {} ms", timeout.as_millis()),
        )),
    }
}

async fn mutate_handler(
    State(state): State<Arc<AppState>>,
    body: Body,
    injector: impl Fn(&AppState) -> &Injector,
) -> Response {
    let started = Instant::now();
    state.metrics.requests.inc();
    let reviewed = match read_body(body, state.max_body_bytes, state.request_timeout).await {
        Ok(bytes) => review::mutate_bytes(&bytes, injector(&state)),
        Err(failed) => failed,
    };
    let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
    state.metrics.record(reviewed.outcome, elapsed_ms);
    log_review(&reviewed, elapsed_ms);
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        reviewed.to_json(),
    )
        .into_response()
}

fn log_review(reviewed: &Reviewed, elapsed_ms: f64) {
    let uid = reviewed.response.uid.as_str();
    let namespace = reviewed.namespace.as_str();
    let name = reviewed.name.as_str();
    let dry_run = reviewed.dry_run;
    let (reason, verdict) = match reviewed.outcome {
        Outcome::Injected(mode) => {
            return tracing::debug!(
                uid,
                namespace,
                pod = name,
                dry_run,
                mode = mode.as_str(),
                elapsed_ms,
                "injected supervision sidecar"
            );
        }
        Outcome::Skipped(reason) => {
            return tracing::debug!(
                uid,
                namespace,
                pod = name,
                dry_run,
                reason = reason.as_str(),
                elapsed_ms,
                "admitted without injection"
            );
        }
        Outcome::Refused(reason) => (reason.as_str(), "Pod refused"),
        Outcome::Failed(reason) => (reason.as_str(), "review failed"),
    };
    tracing::warn!(
        uid,
        namespace,
        pod = name,
        dry_run,
        reason,
        elapsed_ms,
        message = reviewed.message.as_deref().unwrap_or(""),
        "{verdict}"
    );
}

/// Serve until shutdown. Returns when drained (or forced).
pub async fn run(listeners: Listeners, config: Config, shutdown: ShutdownSignal) -> Result<(), ServerError> {
    let metrics = Arc::new(Metrics::new());
    let store = Arc::new(CertStore::new(config.tls_cert.clone(), config.tls_key.clone()));
    let state = Arc::new(AppState::new(&config, Arc::clone(&metrics), Arc::clone(&store)));
    run_with_state(listeners, config, state, shutdown).await
}

/// [`run`] with a caller-built state (to inspect metrics in tests).
pub async fn run_with_state(
    listeners: Listeners,
    config: Config,
    state: Arc<AppState>,
    shutdown: ShutdownSignal,
) -> Result<(), ServerError> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let tls_config = tls::server_config(Arc::clone(&state.store))?;
    let policies_stop = tokio_util::sync::CancellationToken::new();
    let _stop_policies = policies_stop.clone().drop_guard();
    if let Some(policies) = &state.policies {
        let client = kube::Client::try_default().await?;
        tokio::spawn(crate::policies::follow(client, policies.clone(), policies_stop));
    }
    let limits = config.connections.limits()?;
    let connections = &state.metrics.connections;

    // Health first: it reports "not ready" until the rest is up.
    let health_addr = listeners.health.local_addr()?;
    let health_listener = Listener::new(listeners.health, limits.clone(), connections.listener("health"));
    let mut health_stop = stop_rx.clone();
    let health = tokio::spawn(plumbing::listener::serve_health(
        health_listener,
        health_router(Arc::clone(&state)),
        async move {
            let _ = health_stop.wait_for(|stop| *stop).await;
        },
    ));

    // Initial load (a missing certificate is not fatal: not ready, retried by the watcher).
    tls::record(&state.metrics, state.store.reload_in_background().await);
    let watcher = {
        let metrics = Arc::clone(&state.metrics);
        let mut stop = stop_rx.clone();
        tokio::spawn(Arc::clone(&state.store).watch(
            config.cert_reload_interval(),
            move |logged| tls::record(&metrics, logged),
            async move {
                let _ = stop.wait_for(|stop| *stop).await;
            },
        ))
    };

    let webhook_addr = listeners.webhook.local_addr()?;
    let listener = Listener::new(listeners.webhook, limits, connections.listener("webhook")).with_tls(Some(tls_config));
    state.bound.store(true, Ordering::Release);
    tracing::info!(webhook = %webhook_addr, health = %health_addr, "webhook serving");

    let mut drain_rx = shutdown.clone();
    let mut force_rx = shutdown;
    // Accept until the shutdown delay has passed after a drain request (false) or a second
    // signal (true).
    let stop = async {
        tokio::select! {
            _ = reached(&mut drain_rx, ShutdownPhase::Drain) => {}
            _ = reached(&mut force_rx, ShutdownPhase::Force) => return true,
        }
        state.draining.store(true, Ordering::Release);
        let delay = config.shutdown_delay();
        tracing::info!(delay_ms = delay.as_millis() as u64, "shutdown requested: draining");
        tokio::select! {
            () = tokio::time::sleep(delay) => false,
            _ = reached(&mut force_rx, ShutdownPhase::Force) => true,
        }
    };
    let (forced, drain) = plumbing::listener::serve_http(listener, webhook_router(Arc::clone(&state)), stop).await;

    if !forced {
        tracing::info!(
            open = drain.open(),
            "no longer accepting; waiting for in-flight requests"
        );
        tokio::select! {
            () = drain.finish() => tracing::info!("drained"),
            () = tokio::time::sleep(config.drain_timeout()) => {
                tracing::warn!("drain timeout reached; closing remaining connections");
            }
            _ = reached(&mut force_rx, ShutdownPhase::Force) => {
                tracing::warn!("second signal: stopping now");
            }
        }
    } else {
        tracing::warn!("forced shutdown");
    }

    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(2), watcher).await;
    if !forced {
        let _ = tokio::time::timeout(Duration::from_secs(2), health).await;
    } else {
        health.abort();
    }
    Ok(())
}
