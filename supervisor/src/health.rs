//! The plain-HTTP health port (`--health-listen`), the supervisor's counterpart of the
//! gateway's: `/metrics` serves the connection counters of the runtime and health ports
//! (OpenMetrics, `openshell_supervisor_connections_*`); `/healthz` answers 200 while the process serves; `/readyz` answers 200 only while
//! the runtime listener serves sidecars (with TLS: once its certificate is loaded) **and** the
//! member is attached to a gateway replica (a gateway message arrived on the current host
//! stream), and not once it is leaving the pool; 503 with the reason otherwise. In Kubernetes the readiness gate keeps a member out of
//! the supervisor Service until sidecars routed to it can be served. The runtime port's
//! `grpc.health.v1` statuses follow the same [`Readiness::check`] ([`follow_grpc`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use plumbing::tls::CertStore;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use plumbing::listener::{ConnectionMetrics, Listener};
use prometheus_client::registry::Registry;
use proto::standard::HealthStatus;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How often the gRPC health status is re-checked without a signal (a certificate loaded).
const RECHECK_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// What `/readyz` reports, updated by the member as it starts, attaches and leaves.
#[derive(Debug)]
pub struct Readiness {
    runtime_serving: AtomicBool,
    gateway_attached: AtomicBool,
    /// The member's shutdown token: cancelled once it is leaving the pool.
    leaving: CancellationToken,
    /// The runtime port's certificate, when it speaks TLS.
    certificate: Option<Arc<CertStore>>,
    /// Bumped whenever the runtime listener or the gateway attachment changes.
    changed: watch::Sender<()>,
}

impl Readiness {
    /// Not ready: no runtime listener serving, no gateway attached. `leaving` is the member's
    /// shutdown token.
    pub fn new(leaving: CancellationToken) -> Self {
        Self {
            runtime_serving: AtomicBool::new(false),
            gateway_attached: AtomicBool::new(false),
            leaving,
            certificate: None,
            changed: watch::Sender::new(()),
        }
    }

    /// Not ready either until `certificate` (the runtime port's) is loaded.
    pub fn with_certificate(mut self, certificate: Option<Arc<CertStore>>) -> Self {
        self.certificate = certificate;
        self
    }

    pub(crate) fn set_runtime_serving(&self, serving: bool) {
        self.runtime_serving.store(serving, Ordering::Release);
        self.changed.send_replace(());
    }

    pub(crate) fn set_gateway_attached(&self, attached: bool) {
        self.gateway_attached.store(attached, Ordering::Release);
        self.changed.send_replace(());
    }

    /// `Ok` when ready, else why not.
    pub fn check(&self) -> Result<(), &'static str> {
        if self.leaving.is_cancelled() {
            Err("leaving the pool")
        } else if !self.runtime_serving.load(Ordering::Acquire) {
            Err("the runtime listener is not serving")
        } else if self.certificate.as_ref().is_some_and(|c| !c.is_loaded()) {
            Err("no serving certificate loaded yet")
        } else if !self.gateway_attached.load(Ordering::Acquire) {
            Err("not attached to a gateway")
        } else {
            Ok(())
        }
    }
}

/// Keeps the runtime port's gRPC health statuses (the overall one and the runtime service's)
/// in step with [`Readiness::check`]: on every change of the runtime listener or the gateway
/// attachment, on leaving, and every [`RECHECK_INTERVAL`]; NOT_SERVING once `stop`.
pub(crate) async fn follow_grpc(status: HealthStatus, readiness: Arc<Readiness>, stop: CancellationToken) {
    let mut changed = readiness.changed.subscribe();
    let mut recheck = tokio::time::interval(RECHECK_INTERVAL);
    let mut reported = None;
    loop {
        let ready = readiness.check().is_ok();
        if reported != Some(ready) {
            status.set_ready(ready).await;
            reported = Some(ready);
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = readiness.leaving.cancelled(), if ready => {}
            _ = changed.changed() => {}
            _ = recheck.tick() => {}
        }
    }
    status.set_ready(false).await;
}

/// Serves `/healthz`, `/readyz` and `/metrics` on `listener` until `stop`.
pub async fn serve(
    listener: Listener,
    readiness: Arc<Readiness>,
    connections: ConnectionMetrics,
    stop: CancellationToken,
) {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .with_state(Port {
            readiness,
            registry: Arc::new(registry(&connections)),
        });
    plumbing::listener::serve_health(listener, app, stop.cancelled_owned()).await;
}

/// What the port's handlers read.
#[derive(Clone)]
struct Port {
    readiness: Arc<Readiness>,
    registry: Arc<Registry>,
}

/// The member's one registry (built once; the counters it holds are shared).
fn registry(connections: &ConnectionMetrics) -> Registry {
    let mut registry = Registry::with_prefix("openshell_supervisor");
    connections.register(&mut registry);
    registry
}

async fn metrics(State(port): State<Port>) -> Response {
    let mut body = String::with_capacity(4096);
    let encoded = prometheus_client::encoding::text::encode(&mut body, &port.registry).map(|()| body);
    plumbing::listener::openmetrics(encoded).into_response()
}

async fn ready(State(port): State<Port>) -> (StatusCode, String) {
    match port.readiness.check() {
        Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_needs_the_runtime_and_a_gateway_and_not_leaving() {
        let leaving = CancellationToken::new();
        let readiness = Readiness::new(leaving.clone());
        assert_eq!(readiness.check(), Err("the runtime listener is not serving"));
        readiness.set_gateway_attached(true);
        assert_eq!(readiness.check(), Err("the runtime listener is not serving"));
        readiness.set_runtime_serving(true);
        assert_eq!(readiness.check(), Ok(()));
        readiness.set_gateway_attached(false);
        assert_eq!(readiness.check(), Err("not attached to a gateway"));
        readiness.set_gateway_attached(true);
        leaving.cancel();
        assert_eq!(readiness.check(), Err("leaving the pool"));
    }

    #[test]
    fn with_tls_ready_needs_a_loaded_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let store = Arc::new(CertStore::new(cert.clone(), key.clone()));
        let readiness = Readiness::new(CancellationToken::new()).with_certificate(Some(Arc::clone(&store)));
        readiness.set_runtime_serving(true);
        readiness.set_gateway_attached(true);
        // The Secret is not there yet.
        assert!(store.reload().is_err());
        assert_eq!(readiness.check(), Err("no serving certificate loaded yet"));
        let leaf = testkit::pki::Ca::new().leaf(&["localhost"]);
        std::fs::write(&cert, leaf.cert).unwrap();
        std::fs::write(&key, leaf.key).unwrap();
        store.reload().unwrap();
        assert_eq!(readiness.check(), Ok(()));
    }
}
