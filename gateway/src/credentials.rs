//! Keeps this replica's keyring current, and — on the
//! coordinator only — rotates signing keys (through `write_fenced`) and
//! delivers tokens locally as files members and sidecars re-read (in
//! Kubernetes, `kubernetes::writer` delivers them as Secrets with [`mint`]).

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
    /// CA bundle delivered as `ca.crt` beside each token.
    pub ca: Option<PathBuf>,
}

/// The CA bundle to deliver, read fresh (it may rotate); `None` without a path.
pub async fn read_ca(path: Option<&Path>) -> Result<Option<String>, proto::tls::TlsError> {
    match path {
        Some(path) => {
            let pem = proto::tls::read_ca(path).await?;
            Ok(Some(String::from_utf8_lossy(&pem).into_owned()))
        }
        None => Ok(None),
    }
}

pub async fn run(
    replica: Arc<Replica>,
    issuer: String,
    mut lease: watch::Receiver<Option<Lease>>,
    delivery: Option<LocalDelivery>,
    shutdown: CancellationToken,
) {
    let mut delivered: Option<Minted> = None;
    let mut delivered_ca: Option<String> = None;
    loop {
        let held = lease.borrow_and_update().clone();
        if let Some(held) = &held {
            match replica.store.now_ms().await {
                Ok(now_ms) => match rotate(&replica.store, held, &Policy::default(), now_ms).await {
                    Ok(plan) if !plan.is_empty() => {
                        info!(created = ?plan.created, retired = ?plan.retired, deleted = ?plan.deleted,
                              resealed = ?plan.resealed, "rotated signing keys");
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
                    let ca = match read_ca(delivery.ca.as_deref()).await {
                        Ok(ca) => ca,
                        Err(err) => {
                            warn!(error = %err, "cannot read the CA bundle to deliver; keeping the last one");
                            delivered_ca.clone()
                        }
                    };
                    if is_due(delivered.as_ref(), &keyring, now_ms) || ca != delivered_ca {
                        match deliver(&keyring, delivery, ca.as_ref()).await {
                            Ok(minted) => {
                                info!(kid = %minted.kid, dir = %delivery.dir.display(), "delivered tokens");
                                delivered = Some(minted);
                                delivered_ca = ca;
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

/// Who a delivered token is for.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    /// The pool's members (one token for the pool).
    Supervisor,
    /// The local operator (platform admin).
    Operator,
    /// The sidecars of one namespace.
    Namespace(String),
}

/// Mint the token `target` gets, valid for [`SUPERVISOR_TOKEN_LIFETIME`].
pub fn mint(keyring: &Keyring, target: &Target, pool: &str) -> Result<Minted, crate::tokens::Error> {
    let lifetime = SUPERVISOR_TOKEN_LIFETIME;
    match target {
        Target::Supervisor => keyring.mint(Kind::Supervisor, &trust::pool_subject(pool), lifetime, &NoExtra {}),
        Target::Operator => {
            let roles = OperatorClaims {
                roles: vec![PLATFORM_ADMIN.into()],
            };
            keyring.mint(Kind::Operator, "local-operator", lifetime, &roles)
        }
        Target::Namespace(namespace) => keyring.mint(
            Kind::Instance,
            &trust::namespace_subject(namespace),
            lifetime,
            &NoExtra {},
        ),
    }
}

/// Whether a token delivered earlier must be replaced: it is due for renewal,
/// or another key signs now.
pub fn is_due(delivered: Option<&Minted>, keyring: &Keyring, now_ms: i64) -> bool {
    delivered.is_none_or(|m| m.needs_renewal(now_ms) || Some(m.kid.as_str()) != keyring.signing_kid())
}

/// Mint and write every local token; returns the supervisor token's record.
async fn deliver(
    keyring: &Keyring,
    delivery: &LocalDelivery,
    ca: Option<&String>,
) -> Result<Minted, crate::tokens::Error> {
    let bundle = keyring.trust_bundle();
    let write = |minted: &Minted, dir: PathBuf| {
        let delivered = Delivered::new(minted, bundle).with_ca(ca.cloned());
        async move { FileDelivery::new(dir).deliver(&delivered).await }
    };
    let supervisor = mint(keyring, &Target::Supervisor, &delivery.pool)?;
    write(&supervisor, delivery.dir.join("supervisor")).await?;
    let operator = mint(keyring, &Target::Operator, &delivery.pool)?;
    write(&operator, delivery.dir.join("operator")).await?;
    for namespace in &delivery.namespaces {
        let minted = mint(keyring, &Target::Namespace(namespace.clone()), &delivery.pool)?;
        write(&minted, delivery.dir.join("namespaces").join(namespace)).await?;
    }
    Ok(supervisor)
}
