//! One pool member process: binds and serves the runtime listener (sidecar streams), attaches
//! to the gateway and hosts sessions until it leaves or is superseded.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::config::{Config, ConfigError};
use crate::gateway::Gateway;
use crate::link::{Identity, LEAVE_BOUND, Link, LinkError};
use crate::runtime::route::{Me, RouteTable};
use crate::runtime::trust::TrustStore;
use crate::sessions::SessionSet;
use crate::sessions::session::Shared;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot listen for sidecars on {address} (OPENSHELL_SUPERVISOR_RUNTIME_LISTEN): {source}")]
    Listen { address: String, source: std::io::Error },
    #[error(transparent)]
    Link(#[from] LinkError),
}

/// Runs a member until it has left the pool. The first cancellation of `shutdown` is the
/// graceful shutdown: the member announces Leaving and keeps hosting until the gateway's
/// snapshot omits its instances or [`LEAVE_BOUND`](crate::LEAVE_BOUND) passes. Exiting never
/// stops a workload. Errors: invalid configuration (naming the setting), a refused hello,
/// or another process taking this member's name.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), Error> {
    config.validate()?;
    let listen_error = |source| Error::Listen {
        address: config.runtime_listen.to_string(),
        source,
    };
    let listener = TcpListener::bind(config.runtime_listen).await.map_err(listen_error)?;
    let bound = listener.local_addr().map_err(listen_error)?;
    let identity = Identity {
        member: config.member.clone(),
        process_id: uuid::Uuid::new_v4().to_string(),
        runtime_address: config.runtime_address_for(bound)?,
        capacity: config.capacity,
        started_at_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
    };
    let span = tracing::info_span!("member", member = %identity.member, process_id = %identity.process_id);
    span.in_scope(
        || tracing::info!(runtime_address = %identity.runtime_address, capacity = identity.capacity, "member starting"),
    );

    let endpoints: Vec<String> = config.endpoints().into_iter().map(str::to_owned).collect();
    let gateway = Arc::new(Gateway::new(endpoints.clone(), config.token_file.clone()));
    let me = Me {
        member: identity.member.clone(),
        process_id: identity.process_id.clone(),
    };
    let (table_tx, table) = watch::channel(Arc::new(RouteTable::default()));
    let trust = TrustStore::new(config.trust_bundle_file(), Arc::clone(&gateway));
    let stop_runtime = CancellationToken::new();
    let runtime = crate::runtime::serve(listener, me.clone(), trust, table.clone(), stop_runtime.clone());
    tokio::spawn(runtime.instrument(span.clone()));

    let shared = Arc::new(Shared { me, gateway, table });
    let mut sessions = SessionSet::new(shared, identity.capacity, table_tx);
    let link = Link::new(identity, endpoints, config.token_file.clone(), shutdown);
    let result = link.run(&mut sessions).instrument(span.clone()).await;
    // Workloads keep running, except those already being stopped: their stop completes.
    let exit_by = Instant::now() + LEAVE_BOUND;
    for task in sessions.abandon() {
        let _bounded = tokio::time::timeout_at(exit_by, task).await;
    }
    stop_runtime.cancel();
    span.in_scope(|| match &result {
        Ok(()) => tracing::info!("member left the pool"),
        Err(err) => tracing::error!(%err, "member exiting"),
    });
    Ok(result?)
}
