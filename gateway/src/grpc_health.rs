//! The `grpc.health.v1.Health` statuses of the gRPC port (served with reflection by
//! `proto::standard`, without a credential): the overall status (`""`) and each service of the
//! port follow [`Health::check`], the readiness `/readyz` reports; [`COORDINATOR_SERVICE`] is
//! SERVING only while this replica holds the coordinator lease. Re-checked when the lease
//! changes, when the pool view changes while not ready, and every [`RECHECK_INTERVAL`]; all
//! NOT_SERVING once the replica shuts down.

use std::time::Duration;

use proto::standard::HealthStatus;
use tokio_util::sync::CancellationToken;

use crate::health::Health;

/// The service name whose status tells whether this replica is the coordinator.
pub const COORDINATOR_SERVICE: &str = "openshell.coordinator";

/// How often readiness is re-checked without a signal (a store that stopped answering).
pub const RECHECK_INTERVAL: Duration = Duration::from_secs(1);

/// Keep `status` in step with `health` until the replica shuts down or `stop`.
pub async fn follow(status: HealthStatus, health: Health, stop: CancellationToken) {
    let shutdown = health.replica.shutdown.clone();
    let (mut view, mut lease) = (health.replica.view.clone(), health.lease.clone());
    let mut recheck = tokio::time::interval(RECHECK_INTERVAL);
    let mut reported: Option<(bool, bool)> = None;
    loop {
        let now = (health.check().await.is_ok(), health.is_coordinator());
        if reported != Some(now) {
            tracing::debug!(ready = now.0, coordinator = now.1, "gRPC health status");
            status.set_ready(now.0).await;
            status.set(COORDINATOR_SERVICE, now.1).await;
            reported = Some(now);
        }
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = stop.cancelled() => break,
            changed = lease.changed() => if changed.is_err() { break },
            changed = view.changed(), if !now.0 => if changed.is_err() { break },
            _ = recheck.tick() => {}
        }
    }
    status.set_ready(false).await;
    status.set(COORDINATOR_SERVICE, false).await;
}
