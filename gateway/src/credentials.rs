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
use crate::store::{FencedWrite, Lease, SigningKey};
use crate::tokens::{
    Delivered, Delivery, FileDelivery, Keyring, Minted, NoExtra, OperatorClaims, PLATFORM_ADMIN, Policy, rotate,
};
use proto::trust::InstanceTokenClaims;

/// How often every replica reloads its keyring (well under the rotation's
/// publish-ahead period).
pub const KEYRING_REFRESH: Duration = Duration::from_secs(5);

/// Where local-mode tokens go.
#[derive(Debug, Clone)]
pub struct LocalDelivery {
    /// Directory with `operator/`, `members/<member>/` and
    /// `instances/<namespace>/<name>/`, each holding `token` and `trust.jwks`.
    pub dir: PathBuf,
    /// Members that get a token of their own.
    pub members: Vec<String>,
    /// Instance routes ("<namespace>/<name>") whose sidecars get a bootstrap token.
    pub instances: Vec<String>,
    /// CA bundle delivered as `ca.crt` beside each token.
    pub ca: Option<PathBuf>,
}

/// The coordinator's part when the store lost signing keys (the database was emptied,
/// replaced or restored from an older backup) while this replica still holds the keys it
/// loaded: the missing ones are written back (fenced) before a rotation would create a new
/// one, which no member or sidecar would know until its mounted trust bundle caught up — a
/// minute or more in Kubernetes, past recovery deadlines. A key the rotation deleted comes
/// back only from a replica that loaded it in the seconds before: retired, it is deleted again.
async fn restore_lost_keys(replica: &Replica, lease: &Lease, loaded: &[SigningKey]) {
    let Ok(stored) = replica.store.list_signing_keys().await else {
        return;
    };
    let writes: Vec<FencedWrite> = lost(&stored, loaded).cloned().map(FencedWrite::PutSigningKey).collect();
    if writes.is_empty() {
        return;
    }
    match replica.store.write_fenced(lease, &writes).await {
        Ok(()) => warn!(
            keys = writes.len(),
            "the store had lost signing keys (the database was emptied, replaced or restored from a backup): \
             wrote back the ones this replica had loaded"
        ),
        Err(err) => warn!(error = %err, "cannot restore the signing keys the store lost"),
    }
}

/// The keys of `loaded` the store lost: missing from `stored` and still verifying tokens (a
/// rotation deletes only keys past their retention).
fn lost<'a>(stored: &'a [SigningKey], loaded: &'a [SigningKey]) -> impl Iterator<Item = &'a SigningKey> {
    let now_ms = trust::unix_ms(std::time::SystemTime::now());
    loaded
        .iter()
        .filter(move |k| !stored.iter().any(|s| s.kid == k.kid) && Policy::default().still_needed(k, now_ms))
}

/// Whether `lease` is still held by the database's clock (a fenced check that writes nothing).
pub async fn still_holds(replica: &Replica, lease: &Lease) -> bool {
    replica.store.write_fenced(lease, &[]).await.is_ok()
}

/// Whether every local delivery on disk is what this coordinator publishes now: its trust
/// bundle, and tokens its signing key signed. Anything else (a stale writer's files, a file
/// removed by hand) is delivered again on the next round.
async fn intact(delivery: &LocalDelivery, keyring: &Keyring) -> bool {
    let bundle = keyring.trust_bundle().to_jwks();
    let Some(kid) = keyring.signing_kid().map(str::to_owned) else {
        return true;
    };
    let dirs = delivery_dirs(delivery);
    tokio::task::spawn_blocking(move || {
        dirs.iter().all(|dir| {
            let jwks = std::fs::read_to_string(dir.join(trust::TRUST_BUNDLE_FILE)).unwrap_or_default();
            let token = std::fs::read_to_string(dir.join(trust::TOKEN_FILE)).unwrap_or_default();
            let signed_by = jsonwebtoken::decode_header(token.trim()).ok().and_then(|h| h.kid);
            jwks == bundle && signed_by.as_deref() == Some(kid.as_str())
        })
    })
    .await
    .unwrap_or(false)
}

/// Every directory local delivery writes.
fn delivery_dirs(delivery: &LocalDelivery) -> Vec<PathBuf> {
    let mut dirs = vec![delivery.dir.join("operator")];
    dirs.extend(delivery.members.iter().map(|m| delivery.dir.join("members").join(m)));
    dirs.extend(
        delivery
            .instances
            .iter()
            .filter(|route| instance_target(route).is_some())
            .map(|route| delivery.dir.join("instances").join(route)),
    );
    dirs
}

/// The CA bundle to deliver, read fresh (it may rotate); `None` without a path.
pub async fn read_ca(path: Option<&Path>) -> Result<Option<String>, plumbing::tls::TlsError> {
    match path {
        Some(path) => {
            let pem = plumbing::tls::read_ca(path).await?;
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
    let mut delivered: Option<Issued> = None;
    let mut delivered_ca: Option<String> = None;
    // The keys this replica last loaded (sealed, as stored): what a store that lost them gets
    // back, so that tokens, grants and the trust bundles already delivered stay valid.
    let mut loaded_keys: Vec<SigningKey> = Vec::new();
    loop {
        let held = lease.borrow_and_update().clone();
        if let Some(held) = &held {
            restore_lost_keys(&replica, held, &loaded_keys).await;
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
        // A store that lost keys does not void the ones this replica holds: they verify and
        // sign on until the coordinator wrote them back.
        let loaded = replica
            .store
            .list_signing_keys()
            .await
            .map(|mut records| {
                let kept: Vec<SigningKey> = lost(&records, &loaded_keys).cloned().collect();
                records.extend(kept);
                records
            })
            .map_err(crate::tokens::Error::from);
        match loaded.and_then(|records| Ok((Keyring::from_records(&issuer, &records, replica.store.keks())?, records)))
        {
            Ok((loaded, records)) => {
                replica.keys.set(loaded);
                loaded_keys = records;
                let keyring = replica.keys.keyring();
                if let (Some(lease), Some(delivery)) = (&held, &delivery) {
                    let now_ms = trust::unix_ms(std::time::SystemTime::now());
                    let ca = match read_ca(delivery.ca.as_deref()).await {
                        Ok(ca) => ca,
                        Err(err) => {
                            warn!(error = %err, "cannot read the CA bundle to deliver; keeping the last one");
                            delivered_ca.clone()
                        }
                    };
                    let due = is_due(delivered.as_ref(), &keyring, now_ms)
                        || ca != delivered_ca
                        || !intact(delivery, &keyring).await;
                    // Only while the lease is still ours by the database: a coordinator that
                    // was paused past its lease and resumed must not overwrite its
                    // successor's delivery with a stale keyring.
                    if due && !still_holds(&replica, lease).await {
                        warn!("no longer the coordinator: tokens not delivered");
                    } else if due {
                        match deliver(&keyring, delivery, ca.as_ref(), now_ms).await {
                            Ok(issued) => {
                                info!(kid = %issued.kid, dir = %delivery.dir.display(), "delivered tokens");
                                delivered = Some(issued);
                                delivered_ca = ca;
                            }
                            Err(err) => warn!(error = %err, "cannot deliver tokens"),
                        }
                    }
                    if let Some(issued) = &delivered {
                        replica.metrics.token_files_delivered(issued.issued_at_ms);
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

/// Who a delivery is for.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    /// Local mode: one pool member (its own token, subject `member:<name>`).
    Member(String),
    /// The local operator (platform admin).
    Operator,
    /// Local mode: one instance's bootstrap token, bound to its route `<namespace>/<name>`.
    Instance { namespace: String, name: String },
    /// Kubernetes: the supervisor Pods' Secret. Trust bundle and CA only: each member
    /// authenticates with its own Pod's ServiceAccount token.
    Supervisor,
    /// Kubernetes: one labelled namespace's Secret. Trust bundle and CA only: each sidecar
    /// authenticates with its own Pod's ServiceAccount token.
    Namespace(String),
}

impl Target {
    /// The target's kind, as the token Secret metrics label it.
    pub fn kind(&self) -> &'static str {
        match self {
            Target::Supervisor => "supervisor",
            Target::Namespace(_) => "namespace",
            Target::Member(_) => "member",
            Target::Operator => "operator",
            Target::Instance { .. } => "instance",
        }
    }
}

/// One delivery: the token minted for it (none for trust-only targets) and when it is due
/// again (from half the token lifetime on, or when another key signs).
#[derive(Debug, Clone)]
pub struct Issued {
    pub token: Option<Minted>,
    pub kid: String,
    pub issued_at_ms: i64,
    pub expires_at_ms: i64,
}

impl Issued {
    pub fn needs_renewal(&self, now_ms: i64) -> bool {
        crate::tokens::needs_renewal(self.issued_at_ms, self.expires_at_ms, now_ms)
    }

    /// What the target gets: the token (if any), the trust bundle and the CA.
    pub fn delivered(&self, keyring: &Keyring, ca: Option<&String>) -> Delivered {
        Delivered::new(self.token.as_ref(), keyring.trust_bundle()).with_ca(ca.cloned())
    }
}

/// Mint what `target` gets, valid for [`SUPERVISOR_TOKEN_LIFETIME`].
pub fn issue(keyring: &Keyring, target: &Target, now_ms: i64) -> Result<Issued, crate::tokens::Error> {
    let lifetime = SUPERVISOR_TOKEN_LIFETIME;
    let token = match target {
        Target::Member(member) => {
            Some(keyring.mint(Kind::Supervisor, &trust::member_subject(member), lifetime, &NoExtra {})?)
        }
        Target::Operator => {
            let roles = OperatorClaims {
                roles: vec![PLATFORM_ADMIN.into()],
            };
            Some(keyring.mint(Kind::Operator, "local-operator", lifetime, &roles)?)
        }
        Target::Instance { namespace, name } => {
            let claims = InstanceTokenClaims {
                namespace: namespace.clone(),
                name: name.clone(),
                uid: None,
            };
            let route = format!("{namespace}/{name}");
            Some(keyring.mint(Kind::Instance, &trust::instance_subject(&route), lifetime, &claims)?)
        }
        Target::Supervisor | Target::Namespace(_) => None,
    };
    let kid = keyring
        .signing_kid()
        .ok_or(crate::tokens::Error::NoSigningKey)?
        .to_owned();
    Ok(match token {
        Some(minted) => Issued {
            kid: minted.kid.clone(),
            issued_at_ms: minted.issued_at_ms,
            expires_at_ms: minted.expires_at_ms,
            token: Some(minted),
        },
        None => Issued {
            token: None,
            kid,
            issued_at_ms: now_ms,
            expires_at_ms: now_ms.saturating_add(i64::try_from(lifetime.as_millis()).unwrap_or(i64::MAX)),
        },
    })
}

/// Whether a delivery made earlier must be replaced: it is due for renewal, or another key
/// signs now.
pub fn is_due(delivered: Option<&Issued>, keyring: &Keyring, now_ms: i64) -> bool {
    delivered.is_none_or(|d| d.needs_renewal(now_ms) || Some(d.kid.as_str()) != keyring.signing_kid())
}

/// The routes of `--instances` entries ("<namespace>/<name>").
pub fn instance_target(route: &str) -> Option<Target> {
    let (namespace, name) = route.split_once('/')?;
    let ok =
        |s: &str| !s.is_empty() && !s.contains('/') && !s.contains("..") && s.bytes().all(|b| b.is_ascii_graphic());
    (ok(namespace) && ok(name)).then(|| Target::Instance {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
    })
}

/// Mint and write every local token; returns the first member's record (or the operator's).
async fn deliver(
    keyring: &Keyring,
    delivery: &LocalDelivery,
    ca: Option<&String>,
    now_ms: i64,
) -> Result<Issued, crate::tokens::Error> {
    let write = |issued: &Issued, dir: PathBuf| {
        let delivered = issued.delivered(keyring, ca);
        async move { FileDelivery::new(dir).deliver(&delivered).await }
    };
    let operator = issue(keyring, &Target::Operator, now_ms)?;
    write(&operator, delivery.dir.join("operator")).await?;
    for member in &delivery.members {
        let issued = issue(keyring, &Target::Member(member.clone()), now_ms)?;
        write(&issued, delivery.dir.join("members").join(member)).await?;
    }
    for route in &delivery.instances {
        let Some(target) = instance_target(route) else {
            warn!(%route, "not an instance route <namespace>/<name>: no token delivered");
            continue;
        };
        let issued = issue(keyring, &target, now_ms)?;
        write(&issued, delivery.dir.join("instances").join(route)).await?;
    }
    Ok(operator)
}
