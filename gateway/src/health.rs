//! The plain-HTTP health port: `/healthz` (the process serves), `/readyz`
//! (it has read the pool from the store recently; the gRPC port's `grpc.health.v1` status
//! follows the same [`Health::check`]), `/metrics` (Prometheus: the replica's one registry,
//! [`crate::metrics`]). It serves from the start: until the store is open (the database may
//! not be reachable yet, or its schema may be too new for this build) `/healthz` answers 200,
//! `/readyz` 503 with the reason and `/metrics` the connection counters (the rest at zero).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use plumbing::listener::Listener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use plumbing::tls::CertStore;

use crate::metrics::Metrics;
use crate::pool::REFRESH_INTERVAL;
use crate::replica::Replica;
use crate::store::Lease;

/// What the health port reports on once the store is open.
#[derive(Clone)]
pub struct Health {
    pub replica: Arc<Replica>,
    pub lease: watch::Receiver<Option<Lease>>,
    /// The gRPC port's certificate, when it speaks TLS.
    pub certificate: Option<Arc<CertStore>>,
}

/// Where the replica is: waiting for its store (and why), or serving.
#[derive(Clone)]
pub enum Stage {
    /// The store is not open yet: the reason, for `/readyz`.
    Waiting(String),
    Serving(Health),
}

pub type Readiness = watch::Receiver<Stage>;

/// What the port's handlers read.
#[derive(Clone)]
struct Port {
    health: Readiness,
    metrics: Arc<Metrics>,
}

/// Serve until `shutdown`, reporting on whatever `health` holds and serving `metrics`.
pub async fn serve(listener: Listener, health: Readiness, metrics: Arc<Metrics>, shutdown: CancellationToken) {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(scrape))
        .with_state(Port { health, metrics });
    plumbing::listener::serve_health(listener, app, shutdown.cancelled_owned()).await;
}

/// Ready once the store is open, the pool view is fresh and, with TLS, a certificate is
/// loaded; 503 with the reason otherwise.
async fn ready(State(port): State<Port>) -> impl IntoResponse {
    let health = match port.health.borrow().clone() {
        Stage::Serving(health) => health,
        Stage::Waiting(why) => return (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    };
    match health.check().await {
        Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}

impl Health {
    /// `Ok` when the replica is ready (what `/readyz` and the gRPC health status report), else
    /// why not: with TLS a certificate must be loaded, and the pool view fresh (the store
    /// answered within the last few refresh intervals, and answers now).
    pub async fn check(&self) -> Result<(), &'static str> {
        if self.certificate.as_ref().is_some_and(|c| !c.is_loaded()) {
            return Err("no serving certificate loaded yet");
        }
        let view = self.replica.view.borrow().clone();
        let bound = REFRESH_INTERVAL * 10;
        let stale = match tokio::time::timeout(bound, self.replica.store.now_ms()).await {
            Ok(Ok(now)) => view.now_ms == 0 || now.saturating_sub(view.now_ms) > bound.as_millis() as i64,
            Ok(Err(_)) | Err(_) => true,
        };
        if stale {
            Err("pool view is stale or the store is unreachable")
        } else {
            Ok(())
        }
    }

    /// Whether this replica holds the coordinator lease.
    pub fn is_coordinator(&self) -> bool {
        self.lease.borrow().is_some()
    }
}

async fn scrape(State(port): State<Port>) -> Response {
    plumbing::listener::openmetrics(port.metrics.encode()).into_response()
}
