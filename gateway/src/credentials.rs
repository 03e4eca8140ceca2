//! Keeps this replica's keyring and verifier current, and — on the
//! coordinator only — rotates signing keys (through `write_fenced`) and
//! delivers tokens: locally as files members and sidecars re-read; in
//! Kubernetes as Secrets (later).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use proto::timing::SUPERVISOR_TOKEN_LIFETIME;
use proto::trust::{self, Kind};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::replica::Replica;
use crate::store::Lease;
use crate::tokens::{Keyring, Minted, Policy, rotate};

/// How often every replica reloads its keyring (well under the rotation's
/// publish-ahead period).
pub const KEYRING_REFRESH: Duration = Duration::from_secs(5);

/// Where local-mode tokens go.
#[derive(Debug, Clone)]
pub struct LocalDelivery {
    /// Directory with `supervisor/`, `operator/` and `namespaces/<ns>/`,
    /// each holding `token` and `trust.jwks`.
    pub dir: PathBuf,
    /// Pool name in the supervisor token's subject.
    pub pool: String,
    /// Namespaces whose sidecars get an instance token.
    pub namespaces: Vec<String>,
}

pub async fn run(
    replica: Arc<Replica>,
    issuer: String,
    mut lease: watch::Receiver<Option<Lease>>,
    delivery: Option<LocalDelivery>,
    shutdown: CancellationToken,
) {
    let mut delivered: Option<Minted> = None;
    loop {
        let held = lease.borrow_and_update().clone();
        if let Some(held) = &held {
            match replica.store.now_ms().await {
                Ok(now_ms) => match rotate(&replica.store, held, &Policy::default(), now_ms).await {
                    Ok(plan) if !plan.is_empty() => {
                        info!(created = ?plan.created, retired = ?plan.retired, deleted = ?plan.deleted, "rotated signing keys");
                    }
                    Ok(_) => {}
                    Err(err) => warn!(error = %err, "cannot rotate signing keys"),
                },
                Err(err) => warn!(error = %err, "cannot read the database clock"),
            }
        }
        match Keyring::load(&replica.store, &issuer).await {
            Ok(keyring) => {
                replica.verifier.set_bundle(keyring.trust_bundle().clone());
                if let (Some(_), Some(delivery)) = (&held, &delivery) {
                    let now_ms = trust::unix_ms(std::time::SystemTime::now());
                    let due = delivered
                        .as_ref()
                        .is_none_or(|m| m.needs_renewal(now_ms) || Some(m.kid.as_str()) != keyring.signing_kid());
                    if due {
                        match deliver(&keyring, delivery) {
                            Ok(minted) => {
                                info!(kid = %minted.kid, dir = %delivery.dir.display(), "delivered tokens");
                                delivered = Some(minted);
                            }
                            Err(err) => warn!(error = %err, "cannot deliver tokens"),
                        }
                    }
                }
            }
            Err(err) => warn!(error = %err, "cannot load signing keys"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = lease.changed() => {}
            () = tokio::time::sleep(KEYRING_REFRESH) => {}
        }
    }
}

/// Mint and write every local token; returns the supervisor token's record.
fn deliver(keyring: &Keyring, delivery: &LocalDelivery) -> Result<Minted, DeliveryError> {
    let bundle = keyring.trust_bundle().to_jwks();
    let supervisor = keyring.mint(
        Kind::Supervisor,
        &trust::pool_subject(&delivery.pool),
        SUPERVISOR_TOKEN_LIFETIME,
        &trust::NoExtra {},
    )?;
    write_pair(&delivery.dir.join("supervisor"), &supervisor.token, &bundle)?;
    let operator = keyring.mint(
        Kind::Operator,
        "local-operator",
        SUPERVISOR_TOKEN_LIFETIME,
        &trust::OperatorClaims {
            roles: vec!["platform_admin".into()],
        },
    )?;
    write_pair(&delivery.dir.join("operator"), &operator.token, &bundle)?;
    for namespace in &delivery.namespaces {
        let instance = keyring.mint(
            Kind::Instance,
            &trust::namespace_subject(namespace),
            SUPERVISOR_TOKEN_LIFETIME,
            &trust::NoExtra {},
        )?;
        write_pair(
            &delivery.dir.join("namespaces").join(namespace),
            &instance.token,
            &bundle,
        )?;
    }
    Ok(supervisor)
}

#[derive(Debug, thiserror::Error)]
enum DeliveryError {
    #[error(transparent)]
    Mint(#[from] crate::tokens::Error),
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

fn write_pair(dir: &Path, token: &str, bundle: &str) -> Result<(), DeliveryError> {
    write_atomic(dir, trust::TOKEN_FILE, token.as_bytes(), 0o600)?;
    write_atomic(dir, trust::TRUST_BUNDLE_FILE, bundle.as_bytes(), 0o644)
}

/// Replace `dir/name` atomically (temporary file in the same directory, then rename).
fn write_atomic(dir: &Path, name: &str, bytes: &[u8], mode: u32) -> Result<(), DeliveryError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let path = dir.join(name);
    let failed = |source| DeliveryError::Write {
        path: path.display().to_string(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(failed)?;
    let temporary = dir.join(format!(".{name}.{}", uuid::Uuid::new_v4().simple()));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&temporary)
        .map_err(failed)?;
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(failed)?;
    std::fs::rename(&temporary, &path).map_err(failed)
}
