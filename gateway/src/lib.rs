//! The gateway: every replica serves member streams, the instance registry
//! and the operator API; one replica at a time holds the coordinator lease
//! and is the only one that places, recovers, runs operations and rotates
//! signing keys. See README.md for the module map.

pub mod audit;
pub mod auth;
pub mod config;
pub mod coordinator;
pub mod credentials;
pub mod election;
pub mod forgotten;
pub mod grpc_health;
pub mod health;
pub mod host;
pub mod input;
pub mod kubernetes;
pub mod metrics;
pub mod operations;
pub mod operator;
pub mod placement;
pub mod pool;
pub mod quota;
pub mod recovery;
pub mod refresh;
pub mod refusals;
pub mod registry;
pub mod replica;
pub mod reports;
pub mod returned;
pub mod room;
pub mod server;
pub mod sessions;
pub mod skew;
pub mod status;
pub mod store;
pub mod summary;
pub mod tokens;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::info;

pub use config::Settings;
/// Registration material is a contract with the sidecar: it lives in `proto`.
pub use proto::registration;

/// Why a gateway could not run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Store(#[from] store::Error),
    #[error("cannot create data directory {path}: {source}")]
    DataDir {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot listen on {address}: {source}")]
    Listen {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("signing keys at rest: {0}")]
    KeyEncryption(#[from] store::sealing::Error),
    #[error(
        "a PostgreSQL store needs a key-encryption key: set --key-encryption-key-file \
         (OPENSHELL_GATEWAY_KEY_ENCRYPTION_KEY_FILE) to a file of 32 random bytes in base64, \
         e.g. made by `head -c 32 /dev/urandom | base64`, the same file on every replica"
    )]
    KekRequired,
    #[error("the runtime shut down while {0}")]
    Interrupted(&'static str),
    #[error("cannot watch SIGTERM and SIGINT: {0}")]
    Signals(#[source] std::io::Error),
    #[error(transparent)]
    Kubernetes(#[from] kubernetes::Error),
    #[error(transparent)]
    Tls(#[from] plumbing::tls::TlsError),
    #[error(transparent)]
    Limits(#[from] plumbing::listener::Error),
    #[error("gRPC server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error(transparent)]
    Reflection(#[from] proto::standard::ReflectionError),
}

/// Bind the configured listen address.
pub async fn bind(settings: &Settings) -> Result<TcpListener, Error> {
    TcpListener::bind(&settings.listen)
        .await
        .map_err(|source| Error::Listen {
            address: settings.listen.clone(),
            source,
        })
}

/// Run one gateway replica on `listener` until `shutdown` is cancelled: open
/// the store (retrying while the database cannot be reached), campaign for the coordinator lease, keep the pool view, serve
/// gRPC, and print the pool status every `status_interval` (when set). On
/// shutdown, member streams are told to reconnect elsewhere and a held lease
/// is released.
pub async fn run(settings: Settings, listener: TcpListener, shutdown: CancellationToken) -> Result<(), Error> {
    if !settings.kubernetes {
        return run_with::<kubernetes::Absent>(settings, listener, shutdown, None).await;
    }
    let scope = kubernetes::Scope {
        ca_file: settings.tls_ca.clone(),
        ..kubernetes::Scope::new(settings.install_namespace.clone())
    };
    let (integration, watches) =
        kubernetes::Integration::connect(scope, &settings.replica, &settings.token_audience, &shutdown).await?;
    let outcome = run_with(settings, listener, shutdown, Some(integration)).await;
    for watch in watches {
        watch.abort();
    }
    outcome
}

/// [`run`] with a given Kubernetes integration (tests pass a stand-in), or none.
pub async fn run_with<C: kubernetes::Cluster + Clone>(
    settings: Settings,
    listener: TcpListener,
    shutdown: CancellationToken,
    kubernetes: Option<kubernetes::Integration<C>>,
) -> Result<(), Error> {
    let url = settings.database_url()?;
    let (keks, generated) = {
        let (settings, url) = (settings.clone(), url.clone());
        tokio::task::spawn_blocking(move || settings.load_keks(&url))
            .await
            .map_err(|_| Error::Interrupted("reading the key-encryption key"))??
    };
    if let Some(path) = &generated {
        tracing::warn!(path = %path.display(), kek = %keks.current().id(),
            "generated a key-encryption key for the signing keys beside the database (no --key-encryption-key-file); \
             the database cannot be used without it: keep it, and keep it out of database backups");
    }
    let limits = settings.connections.limits()?;
    let connections = plumbing::listener::ConnectionMetrics::default();
    let metrics = Arc::new(metrics::Metrics::new(&connections));
    // Background work stops with `stop`, after the server drained (and on any
    // early return). The health port serves from the start: not ready while
    // the database is unreachable, but alive.
    let stop = CancellationToken::new();
    let _stop_on_return = stop.clone().drop_guard();
    let (health_tx, health_rx) = watch::channel(health::Stage::Waiting("waiting for the database".to_owned()));
    if let Some(address) = &settings.health_listen {
        let health = TcpListener::bind(address).await.map_err(|source| Error::Listen {
            address: address.clone(),
            source,
        })?;
        let health = plumbing::listener::Listener::new(health, limits.clone(), connections.listener("health"));
        tokio::spawn(health::serve(health, health_rx, metrics.clone(), stop.clone()));
    }
    let Some(store) = open_store(&url, &settings.store_options(), &health_tx, &shutdown).await? else {
        return Ok(());
    };
    let store = store.with_keks(Arc::new(keks));
    match tokens::check_stored_keys(&store).await {
        Ok(_) => {}
        // A KEK that does not open the stored keys is a configuration error: stop.
        Err(tokens::Error::Sealing(err)) => return Err(err.into()),
        Err(err) => tracing::warn!(error = %err, "cannot check the stored signing keys"),
    }
    // Registration materials (receipt keys) an older gateway stored in clear, or sealed with
    // the previous KEK, are sealed with the current one.
    match store.seal_materials().await {
        Ok((sealed, unopened)) => {
            if sealed > 0 {
                info!(
                    sealed,
                    "sealed stored registration materials with the current key-encryption key"
                );
            }
            if !unopened.is_empty() {
                tracing::warn!(instances = unopened.len(), first = %unopened[0],
                    "registration materials that do not open with the configured key-encryption keys: \
                     those instances cannot be activated until they register again");
            }
        }
        Err(err) => tracing::warn!(error = %err, "cannot seal the stored registration materials"),
    }
    let holder = election::holder_id(&settings.replica, &store);
    let address = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    info!(replica = %settings.replica, holder = %holder, %address, backend = %store.backend(),
          database = %store::redact_url(&url), kek = %store.keks().map(|k| k.current().id()).unwrap_or_default(),
          previous_kek = %store.keks().and_then(|k| k.previous()).map(|k| k.id()).unwrap_or_default(),
          "gateway started");

    let accounts = kubernetes.as_ref().map(|integration| auth::Accounts {
        review: integration.review.clone(),
        install_namespace: settings.install_namespace.clone(),
        supervisor_account: settings.supervisor_account.clone(),
    });
    let (view_tx, view_rx) = watch::channel(Arc::new(pool::View::default()));
    let (cut_off_tx, cut_off_rx) = watch::channel(false);
    let replica = Arc::new(replica::Replica {
        name: settings.replica.clone(),
        store: store.clone(),
        view: view_rx,
        wake: Arc::new(Notify::new()),
        sessions: Mutex::default(),
        keys: Arc::new(auth::Keys::new(settings.issuer.clone(), store.clone()).with_accounts(accounts)),
        quota: quota::Quota {
            default_limit: settings.namespace_instance_limit,
            namespaces: kubernetes.as_ref().map(|integration| integration.shared.clone()),
        },
        policies: kubernetes.as_ref().map(|integration| integration.shared.clone()),
        recovery_deadline_ms: settings.recovery_deadline_ms,
        detached_grace: std::time::Duration::from_millis(settings.detached_grace_ms),
        metrics,
        reports: Arc::default(),
        cut_off: cut_off_rx,
        shutdown: shutdown.clone(),
        max_pool_watchers: usize::try_from(settings.max_pool_watchers).unwrap_or(1),
    });
    let (lease_tx, lease_rx) = watch::channel(None);
    let timing = election::Timing::from_lease_length(Duration::from_millis(settings.lease_length_ms));
    let delivery = settings.credentials_dir.clone().map(|dir| credentials::LocalDelivery {
        dir,
        members: settings.members.clone(),
        instances: settings.instances.clone(),
        ca: settings.tls_ca.clone(),
    });

    let mut tasks = vec![
        tokio::spawn(refresh::refresh(
            store.clone(),
            view_tx,
            replica.wake.clone(),
            stop.clone(),
        )),
        tokio::spawn(refresh::follow_writes(
            store.clone(),
            replica.view.clone(),
            replica.wake.clone(),
            stop.clone(),
        )),
        tokio::spawn(refresh::beat(
            store.clone(),
            settings.replica.clone(),
            cut_off_tx,
            stop.clone(),
        )),
        tokio::spawn(refresh::record_build(
            store.clone(),
            settings.replica.clone(),
            stop.clone(),
        )),
        tokio::spawn(reports::run(
            replica.reports.clone(),
            store.clone(),
            replica.metrics.clone(),
            stop.clone(),
        )),
        tokio::spawn(coordinator::run(replica.clone(), lease_rx.clone(), stop.clone())),
        tokio::spawn({
            let streams = replica.clone();
            metrics::follow(
                replica.metrics.clone(),
                replica.view.clone(),
                move || streams.sessions(|s| s.len()),
                lease_rx.clone(),
                stop.clone(),
            )
        }),
        tokio::spawn(credentials::run(
            replica.clone(),
            settings.issuer.clone(),
            lease_rx.clone(),
            delivery,
            stop.clone(),
        )),
    ];
    if let Some(integration) = kubernetes {
        tasks.push(integration.spawn_writer(replica.clone(), lease_rx.clone(), stop.clone()));
    }
    let election = tokio::spawn(election::run(
        store.clone(),
        holder.clone(),
        timing,
        lease_tx,
        shutdown.clone(),
    ));
    if settings.status_interval_ms > 0 {
        let interval = Duration::from_millis(settings.status_interval_ms);
        let (store, holder, lease, stop) = (store.clone(), holder.clone(), lease_rx.clone(), stop.clone());
        tokio::spawn(async move { status::print_every(&store, &holder, &lease, interval, &stop).await });
    }

    // Not loadable yet (a Secret still being issued): not ready, retried by the watch.
    let certificate = match (&settings.tls_cert, &settings.tls_key) {
        (Some(cert), Some(key)) => {
            let stop = stop.clone();
            let stopped = async move { stop.cancelled().await };
            Some(plumbing::tls::CertStore::load_and_watch(cert.clone(), key.clone(), stopped).await)
        }
        _ => None,
    };
    let tls = match &certificate {
        Some(store) => Some(plumbing::tls::server_config(store.clone(), &[b"h2"])?),
        None => None,
    };

    let health = health::Health {
        replica,
        lease: lease_rx.clone(),
        certificate: certificate.clone(),
    };
    health_tx.send_replace(health::Stage::Serving(health.clone()));
    let listener = plumbing::listener::Listener::new(listener, limits, connections.listener("grpc")).with_tls(tls);
    let served = server::serve(listener, health, shutdown.clone()).await;
    // The election releases the lease on its way out.
    let _ = election.await;
    stop.cancel();
    for task in tasks {
        let _ = task.await;
    }
    store.close().await;
    served
}

/// The first and the longest wait between attempts to reach the database.
const OPEN_RETRY_FIRST: Duration = Duration::from_millis(200);
const OPEN_RETRY_MAX: Duration = Duration::from_secs(5);
/// The wait between looks at a schema too new for this build: it changes only when a build
/// migrates or a rollback restores the database, so looking often only fills the log.
const OPEN_RETRY_SCHEMA: Duration = Duration::from_secs(30);

/// Open the store, retrying with jittered exponential backoff while the database cannot be
/// reached (it may start after the gateway), and every [`OPEN_RETRY_SCHEMA`] while its schema
/// is too new for this build (a rollback past a breaking migration, or this build's replica
/// restarted during an upgrade): alive and unready with the reason on `/readyz` meanwhile, so
/// a rollout stalls on it instead of a crash loop, and the replicas still serving stay. A bad
/// URL or a failed migration ends the gateway at once. `None`: shut down meanwhile.
async fn open_store(
    url: &str,
    options: &store::Options,
    stage: &watch::Sender<health::Stage>,
    shutdown: &CancellationToken,
) -> Result<Option<store::Store>, Error> {
    let mut delay = OPEN_RETRY_FIRST;
    for attempt in 1u64.. {
        let opened = tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            opened = store::Store::open(url, options) => opened,
        };
        let err = match opened {
            Ok(store) => return Ok(Some(store)),
            Err(err @ store::Error::Connect { .. }) => err,
            Err(
                err @ store::Error::SchemaTooNew {
                    newest,
                    oldest_reader,
                    ours,
                    ..
                },
            ) => {
                tracing::error!(attempt, retry_in_s = OPEN_RETRY_SCHEMA.as_secs(), error = %err,
                                "this build cannot run on the database's schema; waiting unready");
                // Without the database's address: the health port is plain HTTP.
                stage.send_replace(health::Stage::Waiting(format!(
                    "the database schema is at migration {newest} and needs a build whose newest migration \
                     is at least {oldest_reader}; this build's is {ours}: run the newer build"
                )));
                tokio::select! {
                    () = shutdown.cancelled() => return Ok(None),
                    () = tokio::time::sleep(OPEN_RETRY_SCHEMA) => {}
                }
                continue;
            }
            Err(err) => return Err(err.into()),
        };
        stage.send_replace(health::Stage::Waiting("waiting for the database".to_owned()));
        // Half to all of the delay, so replicas that started together spread out.
        let wait = delay.mul_f64(rand::random_range(0.5..=1.0));
        tracing::warn!(attempt, database = %store::redact_url(url), retry_in_ms = wait.as_millis() as u64,
                       error = %err, "the database is not reachable yet; retrying");
        tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            () = tokio::time::sleep(wait) => {}
        }
        delay = (delay * 2).min(OPEN_RETRY_MAX);
    }
    Ok(None)
}
