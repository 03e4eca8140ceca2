//! The gateway: every replica serves member streams, grants, activation and
//! the operator API; one replica at a time holds the coordinator lease and is
//! the only one that places, recovers, runs operations and rotates tokens.
//!
//! Modules: [`store`] (durable state and the coordinator lease), [`election`]
//! (campaigning for the lease), [`status`] (the printed pool status),
//! [`config`] (command line and environment).

pub mod config;
pub mod election;
pub mod placement;
pub mod status;
pub mod store;
pub mod tokens;

use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::info;

pub use config::Settings;

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
}

/// Run one gateway replica until `shutdown` is cancelled: open the store,
/// campaign for the coordinator lease, and print the pool status every
/// `status_interval` (when set).
pub async fn run(settings: Settings, shutdown: CancellationToken) -> Result<(), Error> {
    let url = settings.database_url()?;
    let store = store::Store::open(&url, &settings.store_options()).await?;
    let holder = election::holder_id(&settings.replica);
    info!(replica = %settings.replica, holder = %holder, backend = %store.backend(), database = %store::redact_url(&url), "gateway started");

    let (lease_tx, lease_rx) = watch::channel(None);
    let timing = election::Timing::from_lease_length(Duration::from_millis(settings.lease_length_ms));
    let election = tokio::spawn(election::run(
        store.clone(),
        holder.clone(),
        timing,
        lease_tx,
        shutdown.clone(),
    ));

    if settings.status_interval_ms > 0 {
        let interval = Duration::from_millis(settings.status_interval_ms);
        status::print_every(&store, &holder, &lease_rx, interval, &shutdown).await;
    } else {
        shutdown.cancelled().await;
    }
    // The election releases the lease on its way out.
    let _ = election.await;
    store.close().await;
    Ok(())
}
