//! The plain-HTTP health port: `/healthz` (the process serves), `/readyz`
//! (it has read the pool from the store recently; the gRPC port's `grpc.health.v1` status
//! follows the same [`Health::check`]), `/metrics` (Prometheus).
//! It serves from the start: until the store is open (the database may not
//! be reachable yet) `/healthz` answers 200 and `/readyz` 503.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use proto::listener::{ConnectionMetrics, Listener};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use proto::tls::CertStore;

use crate::pool::REFRESH_INTERVAL;
use crate::replica::{Counters, Replica};
use crate::store::Lease;

/// What the health port reports on once the store is open.
#[derive(Clone)]
pub struct Health {
    pub replica: Arc<Replica>,
    pub lease: watch::Receiver<Option<Lease>>,
    /// The gRPC port's certificate, when it speaks TLS.
    pub certificate: Option<Arc<CertStore>>,
}

/// `None` while the gateway waits for the database.
pub type Readiness = watch::Receiver<Option<Health>>;

const WAITING: &str = "waiting for the database\n";

/// What the port's handlers read.
#[derive(Clone)]
struct Port {
    health: Readiness,
    connections: ConnectionMetrics,
}

/// Serve until `shutdown`, reporting on whatever `health` holds and on the connections of
/// every listener in `connections`.
pub async fn serve(listener: Listener, health: Readiness, connections: ConnectionMetrics, shutdown: CancellationToken) {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .with_state(Port { health, connections });
    proto::listener::serve_health(listener, app, shutdown.cancelled_owned()).await;
}

/// Ready once the store is open, the pool view is fresh and, with TLS, a certificate is
/// loaded; 503 with the reason otherwise.
async fn ready(State(port): State<Port>) -> impl IntoResponse {
    let Some(health) = port.health.borrow().clone() else {
        return (StatusCode::SERVICE_UNAVAILABLE, WAITING.to_owned());
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

async fn metrics(State(port): State<Port>) -> impl IntoResponse {
    let Some(health) = port.health.borrow().clone() else {
        return (StatusCode::SERVICE_UNAVAILABLE, WAITING).into_response();
    };
    let mut registry = Registry::with_prefix("openshell_gateway");
    port.connections.register(&mut registry);
    let view = health.replica.view.borrow().clone();
    let gauge = |registry: &mut Registry, name: &str, help: &str, value: i64| {
        let g: Gauge = Gauge::default();
        g.set(value);
        registry.register(name, help, g);
    };
    let coordinator = health.lease.borrow().as_ref().map_or(0, |l| l.term);
    gauge(
        &mut registry,
        "coordinator_term",
        "Coordinator term this replica holds (0: standby)",
        coordinator,
    );
    let live = view.members.values().filter(|m| view.member_is_live(m)).count();
    gauge(
        &mut registry,
        "members_live",
        "Pool members with a live membership record",
        live as i64,
    );
    gauge(
        &mut registry,
        "instances_desired",
        "Desired instances",
        view.desired().len() as i64,
    );
    gauge(
        &mut registry,
        "assignments",
        "Assigned instances",
        view.assignments.len() as i64,
    );
    let streams = health.replica.sessions(|s| s.len());
    gauge(
        &mut registry,
        "member_streams",
        "Member streams this replica serves",
        streams as i64,
    );
    let c = &health.replica.counters;
    for (name, counter) in [
        ("dropped_acks_never_sent", &c.acks_never_sent),
        ("dropped_acks_regressed", &c.acks_regressed),
        ("dropped_reports_oversized", &c.oversized_reports),
    ] {
        let value = i64::try_from(Counters::get(counter)).unwrap_or(i64::MAX);
        gauge(&mut registry, name, "Member messages dropped since start", value);
    }
    gauge(
        &mut registry,
        "denied_calls",
        "Calls refused since start: a credential used for another instance or member",
        i64::try_from(Counters::get(&c.denied)).unwrap_or(i64::MAX),
    );
    let mut body = String::new();
    match encode(&mut body, &registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}
