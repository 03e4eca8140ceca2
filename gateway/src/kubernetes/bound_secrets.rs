//! The Secrets the egress policies bind (`SandboxPolicy.spec.credentials[].secretKeyRef`),
//! read by name: never listed or watched, so the gateway needs `get` on exactly those Secrets,
//! which each namespace grants it with a Role of its own (docs/egress.md, "Credentials"); the
//! install grants it none. Every replica reads them (each builds the snapshots of its own
//! members): as soon as a policy names one not read yet, and every [`REFRESH`] so that a
//! rotated value reaches the sidecars. Only the keys a policy names are kept, checked by
//! [`proto::egress::credential_value`]. A read that fails for a passing reason (a timeout, the
//! API server unavailable) keeps what was read before; forbidden or not found replaces it.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::Shared;
use super::egress::SecretData;

/// How often every bound Secret is read again.
pub const REFRESH: Duration = Duration::from_secs(30);
/// Longest wait for one read.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a Secret's values are not available; `lasting` when it replaces what was read before.
struct Unread {
    lasting: bool,
    reason: String,
}

/// Reads the bound Secrets into the index until `shutdown`.
pub async fn follow(client: Client, shared: Shared, shutdown: CancellationToken) {
    let mut changes = shared.egress_changes();
    let mut refresh_at = Instant::now();
    loop {
        let wanted = shared.with(|index| index.egress().wanted_secrets());
        let due = Instant::now() >= refresh_at;
        if due || !shared.with(|index| index.egress().has_read(&wanted)) {
            for ((namespace, name), keys) in &wanted {
                let read = read(&client, namespace, name, keys).await;
                shared.with(|index| {
                    let egress = index.egress_mut();
                    match read {
                        Ok(data) => egress.apply_secret(namespace.clone(), name.clone(), Ok(data)),
                        Err(unread) => {
                            let one = BTreeMap::from([((namespace.clone(), name.clone()), Vec::new())]);
                            if unread.lasting || !egress.has_read(&one) {
                                egress.apply_secret(namespace.clone(), name.clone(), Err(unread.reason));
                            }
                        }
                    }
                    egress.retain_secrets(&wanted);
                });
            }
            if due {
                refresh_at = Instant::now() + REFRESH;
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep_until(refresh_at) => {}
            changed = changes.changed() => if changed.is_err() { return },
        }
    }
}

/// The `keys` of Secret `namespace/name`, each checked, or why not.
async fn read(client: &Client, namespace: &str, name: &str, keys: &[String]) -> Result<SecretData, Unread> {
    let secret = format!("Secret {namespace}/{name}");
    if name == proto::kubernetes::TOKEN_SECRET {
        // The pool may read it in every namespace: no namespace granted it as a credential.
        return Err(Unread {
            lasting: true,
            reason: format!("{secret} is the pool's own and cannot be bound as a credential"),
        });
    }
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let fetched = match tokio::time::timeout(READ_TIMEOUT, api.get(name)).await {
        Ok(Ok(fetched)) => fetched,
        Ok(Err(kube::Error::Api(status))) if status.code == 403 => {
            return Err(Unread {
                lasting: true,
                reason: format!(
                    "the pool may not read {secret}: grant the gateway's ServiceAccount `get` on it (docs/egress.md, Credentials)"
                ),
            });
        }
        Ok(Err(kube::Error::Api(status))) if status.code == 404 => {
            return Err(Unread {
                lasting: true,
                reason: format!("{secret} does not exist"),
            });
        }
        Ok(Err(err)) => {
            warn!(%namespace, secret = name, error = %err, "cannot read a Secret an egress policy binds; what was read before stays");
            return Err(Unread {
                lasting: false,
                reason: format!("cannot read {secret}: {err}"),
            });
        }
        Err(_) => {
            return Err(Unread {
                lasting: false,
                reason: format!("reading {secret} took longer than {READ_TIMEOUT:?}"),
            });
        }
    };
    let data = fetched.data.unwrap_or_default();
    let mut values = BTreeMap::new();
    for key in keys {
        // A key that is missing or unfit is left out: the binding then says so.
        if let Some(value) = data.get(key) {
            match proto::egress::credential_value(&value.0) {
                Ok(value) => {
                    values.insert(key.clone(), value);
                }
                Err(why) => warn!(%namespace, secret = name, key, %why, "a bound Secret's value is unfit for a header"),
            }
        }
    }
    Ok(SecretData(values))
}
