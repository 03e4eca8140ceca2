//! One pool member process: binds and serves the runtime listener (sidecar streams), attaches
//! to the gateway and hosts sessions until it leaves or is superseded.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use plumbing::tls::CertStore;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::attachment::{Attachment, AttachmentError, Identity, LEAVE_BOUND};
use crate::config::{Config, ConfigError};
use crate::gateway::Gateway;
use crate::health::{self, Readiness};
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
    #[error("cannot listen for health checks on {address} (OPENSHELL_SUPERVISOR_HEALTH_LISTEN): {source}")]
    HealthListen { address: String, source: std::io::Error },
    #[error("TLS of the runtime port (OPENSHELL_SUPERVISOR_TLS_CERT, OPENSHELL_SUPERVISOR_TLS_KEY): {0}")]
    Tls(#[from] plumbing::tls::TlsError),
    #[error(transparent)]
    Attachment(#[from] AttachmentError),
    #[error(transparent)]
    Reflection(#[from] proto::standard::ReflectionError),
}

/// The member's sockets, bound before it starts: the runtime listener (sidecar streams) and,
/// when configured, the health port.
#[derive(Debug)]
pub struct Listeners {
    pub runtime: TcpListener,
    pub health: Option<TcpListener>,
}

impl Listeners {
    /// Binds `--runtime-listen` and `--health-listen` (when set).
    pub async fn bind(config: &Config) -> Result<Self, Error> {
        let runtime = TcpListener::bind(config.runtime_listen)
            .await
            .map_err(|source| Error::Listen {
                address: config.runtime_listen.to_string(),
                source,
            })?;
        let health = match config.health_listen {
            Some(address) => Some(TcpListener::bind(address).await.map_err(|source| Error::HealthListen {
                address: address.to_string(),
                source,
            })?),
            None => None,
        };
        Ok(Self { runtime, health })
    }

    /// The bound health address, if any.
    pub fn health_addr(&self) -> Option<SocketAddr> {
        self.health.as_ref().and_then(|l| l.local_addr().ok())
    }
}

/// Runs a member until it has left the pool. The first cancellation of `shutdown` is the
/// graceful shutdown: the member announces Leaving and keeps hosting until the gateway's
/// snapshot omits its instances or [`LEAVE_BOUND`](crate::LEAVE_BOUND) passes. Exiting never
/// stops a workload. Errors: invalid configuration (naming the setting), a port that cannot be
/// bound, or a hello refused as invalid. Superseded or refused because another process holds
/// the member name, it keeps attaching again (with backoff) and hosting.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), Error> {
    config.validate()?;
    let listeners = Listeners::bind(&config).await?;
    run_on(config, listeners, shutdown).await
}

/// [`run`] on listeners the caller has bound.
pub async fn run_on(config: Config, listeners: Listeners, shutdown: CancellationToken) -> Result<(), Error> {
    config.validate()?;
    let Listeners {
        runtime: listener,
        health,
    } = listeners;
    let listen_error = |source| Error::Listen {
        address: config.runtime_listen.to_string(),
        source,
    };
    let bound = listener.local_addr().map_err(listen_error)?;
    let stop_runtime = CancellationToken::new();
    // Early returns below stop whatever was started already.
    let _stop_runtime_on_return = stop_runtime.clone().drop_guard();
    let certificate = match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => {
            let stop = stop_runtime.clone().cancelled_owned();
            Some(CertStore::load_and_watch(cert.clone(), key.clone(), stop).await)
        }
        _ => None,
    };
    let tls = match &certificate {
        Some(store) => Some(plumbing::tls::server_config(Arc::clone(store), &[b"h2"])?),
        None => None,
    };
    let readiness = Arc::new(Readiness::new(shutdown.clone()).with_certificate(certificate));
    let limits = config.connections.limits().map_err(ConfigError::from)?;
    let connections = plumbing::listener::ConnectionMetrics::default();
    let listener =
        plumbing::listener::Listener::new(listener, limits.clone(), connections.listener("runtime")).with_tls(tls);
    let stop_health = CancellationToken::new();
    let _stop_health_on_return = stop_health.clone().drop_guard();
    if let Some(health) = health {
        let address = health.local_addr().map_or_else(|_| "?".to_owned(), |a| a.to_string());
        tracing::info!(%address, "health port serving /healthz, /readyz and /metrics");
        let health = plumbing::listener::Listener::new(health, limits, connections.listener("health"));
        tokio::spawn(health::serve(
            health,
            Arc::clone(&readiness),
            connections,
            stop_health.clone(),
        ));
    }
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
    let gateway = Arc::new(Gateway::new(
        endpoints.clone(),
        config.token_file.clone(),
        config.gateway_tls(),
    ));
    let me = Me {
        member: identity.member.clone(),
        process_id: identity.process_id.clone(),
    };
    let (table_tx, table) = watch::channel(Arc::new(RouteTable::default()));
    let trust = TrustStore::new(config.trust_bundle_file(), Arc::clone(&gateway));
    let runtime = crate::runtime::serve(
        listener,
        me.clone(),
        trust,
        table.clone(),
        Arc::clone(&readiness),
        stop_runtime.clone(),
    )
    .await?;
    tokio::spawn(runtime.instrument(span.clone()));
    readiness.set_runtime_serving(true);

    let shared = Arc::new(Shared {
        me,
        gateway,
        table,
        policy: crate::policy::follow(
            config.egress_policy.clone(),
            config.egress_secrets.clone(),
            crate::policy::first(&config).await?,
            stop_runtime.clone(),
        ),
    });
    let mut sessions = SessionSet::new(shared, identity.capacity, table_tx);
    let attachment = Attachment::new(
        identity,
        endpoints,
        config.token_file.clone(),
        config.gateway_tls(),
        shutdown,
        Arc::clone(&readiness),
    );
    let result = attachment.run(&mut sessions).instrument(span.clone()).await;
    // Workloads keep running, except those already being stopped: their stop completes.
    let exit_by = Instant::now() + LEAVE_BOUND;
    for task in sessions.abandon() {
        let _bounded = tokio::time::timeout_at(exit_by, task).await;
    }
    stop_runtime.cancel();
    readiness.set_runtime_serving(false);
    stop_health.cancel();
    span.in_scope(|| match &result {
        Ok(()) => tracing::info!("member left the pool"),
        Err(err) => tracing::error!(error = %err, "member exiting"),
    });
    Ok(result?)
}
