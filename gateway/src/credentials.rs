//! Keeps this replica's keyring current, and — on the
//! coordinator only — rotates signing keys (through `write_fenced`) and
//! delivers tokens: locally as files members and sidecars re-read; in
//! Kubernetes as Secrets (later).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use proto::timing::SUPERVISOR_TOKEN_LIFETIME;
use proto::trust::{self, Kind};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::replica::Replica;
use crate::store::Lease;
use crate::tokens::{
    Delivered, Delivery, FileDelivery, Keyring, Minted, NoExtra, OperatorClaims, PLATFORM_ADMIN, Policy, rotate,
};

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
            Ok(loaded) => {
                replica.keys.set(loaded);
                let keyring = replica.keys.keyring();
                if let (Some(_), Some(delivery)) = (&held, &delivery) {
                    let now_ms = trust::unix_ms(std::time::SystemTime::now());
                    let due = delivered
                        .as_ref()
                        .is_none_or(|m| m.needs_renewal(now_ms) || Some(m.kid.as_str()) != keyring.signing_kid());
                    if due {
                        match deliver(&keyring, delivery).await {
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
async fn deliver(keyring: &Keyring, delivery: &LocalDelivery) -> Result<Minted, crate::tokens::Error> {
    let bundle = keyring.trust_bundle();
    let lifetime = SUPERVISOR_TOKEN_LIFETIME;
    let supervisor = keyring.mint(
        Kind::Supervisor,
        &trust::pool_subject(&delivery.pool),
        lifetime,
        &NoExtra {},
    )?;
    FileDelivery::new(delivery.dir.join("supervisor"))
        .deliver(&Delivered::new(&supervisor, bundle))
        .await?;
    let roles = OperatorClaims {
        roles: vec![PLATFORM_ADMIN.into()],
    };
    let operator = keyring.mint(Kind::Operator, "local-operator", lifetime, &roles)?;
    FileDelivery::new(delivery.dir.join("operator"))
        .deliver(&Delivered::new(&operator, bundle))
        .await?;
    for namespace in &delivery.namespaces {
        let instance = keyring.mint(
            Kind::Instance,
            &trust::namespace_subject(namespace),
            lifetime,
            &NoExtra {},
        )?;
        let dir = delivery.dir.join("namespaces").join(namespace);
        FileDelivery::new(dir)
            .deliver(&Delivered::new(&instance, bundle))
            .await?;
    }
    Ok(supervisor)
}
