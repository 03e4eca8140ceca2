//! The writes to the Kubernetes API, behind a small trait so the writer can be tested by
//! reading what it intends off a channel ([`Recording`]) and the real client
//! ([`Kube`]) against a mock API server answering with captured responses.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Namespace, ObjectReference, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, ObjectMeta, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client};
use proto::tls::CA_FILE;
use proto::trust::{TOKEN_FILE, TRUST_BUNDLE_FILE};
use tokio::sync::mpsc;

use super::notice::{Notice, Regarding};
use crate::tokens::Delivered;

/// Field manager of the gateway's server-side applies.
pub const FIELD_MANAGER: &str = "supervision-gateway";
/// `reportingController` of the gateway's Events.
pub const REPORTING_CONTROLLER: &str = "supervision.openshell.ai/gateway";
/// Label on every object the gateway writes.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "supervision-gateway");
/// Bound on every API call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    #[error("Kubernetes API call timed out after {0:?}")]
    Timeout(Duration),
}

/// What the writer does to the cluster.
pub trait Cluster: Send + Sync + 'static {
    /// Create or replace the token Secret `name` in `namespace`.
    fn apply_secret(
        &self,
        namespace: &str,
        name: &str,
        delivered: &Delivered,
    ) -> impl Future<Output = Result<(), Error>> + Send;
    /// Delete the Secret; one that does not exist counts as deleted.
    fn delete_secret(&self, namespace: &str, name: &str) -> impl Future<Output = Result<(), Error>> + Send;
    /// Record an Event (repeats of the same event become a series).
    fn publish(&self, notice: &Notice) -> impl Future<Output = Result<(), Error>> + Send;
}

/// The Secret as the gateway writes it: the token, the trust bundle and (when configured) the
/// CA bundle under the file names the sidecar and the supervisor read from the mount. `owner`
/// (the install's Namespace) makes the garbage collector remove the Secret when the install
/// is deleted, whichever namespace it is in.
pub fn secret(namespace: &str, name: &str, delivered: &Delivered, owner: Option<&OwnerReference>) -> Secret {
    let mut data = BTreeMap::from([
        (TOKEN_FILE.to_owned(), ByteString(delivered.token.as_bytes().to_vec())),
        (
            TRUST_BUNDLE_FILE.to_owned(),
            ByteString(delivered.trust_jwks.as_bytes().to_vec()),
        ),
    ]);
    if let Some(ca) = &delivered.ca_pem {
        data.insert(CA_FILE.to_owned(), ByteString(ca.as_bytes().to_vec()));
    }
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([(MANAGED_BY.0.to_owned(), MANAGED_BY.1.to_owned())])),
            owner_references: owner.map(|o| vec![o.clone()]),
            ..ObjectMeta::default()
        },
        type_: Some("Opaque".to_owned()),
        data: Some(data),
        ..Secret::default()
    }
}

/// The owner reference to the install's Namespace `namespace` (a cluster-scoped owner, which
/// dependents in any namespace may name).
pub fn namespace_owner(namespace: &Namespace) -> Option<OwnerReference> {
    Some(OwnerReference {
        api_version: "v1".to_owned(),
        kind: "Namespace".to_owned(),
        name: namespace.metadata.name.clone()?,
        uid: namespace.metadata.uid.clone()?,
        ..OwnerReference::default()
    })
}

/// A reference to the Pod `pod`.
pub fn reference(pod: &Regarding) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".to_owned()),
        kind: Some("Pod".to_owned()),
        namespace: Some(pod.namespace.clone()),
        name: Some(pod.name.clone()),
        uid: pod.uid.clone(),
        ..ObjectReference::default()
    }
}

/// The real API, through kube-rs. Events go through kube-runtime's [`Recorder`]
/// (events.k8s.io/v1, client-go naming, series for repeats).
#[derive(Clone)]
pub struct Kube {
    client: Client,
    recorder: Recorder,
    owner: Option<OwnerReference>,
}

impl Kube {
    /// `instance` is this replica's name (its Pod name): the Events' `reportingInstance`.
    pub fn new(client: Client, instance: &str) -> Self {
        let reporter = Reporter {
            controller: REPORTING_CONTROLLER.to_owned(),
            instance: Some(instance.to_owned()),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            owner: None,
        }
    }

    /// Make the install's Namespace `install` the owner of every Secret written. When it
    /// cannot be read, the Secrets have no owner (and an uninstall leaves them behind).
    pub async fn owned_by(mut self, install: &str) -> Self {
        let api: Api<Namespace> = Api::all(self.client.clone());
        match bounded(api.get(install)).await {
            Ok(namespace) => self.owner = namespace_owner(&namespace),
            Err(err) => tracing::warn!(namespace = install, error = %err,
                "cannot read the install namespace: token Secrets get no owner and outlive an uninstall"),
        }
        self
    }
}

async fn bounded<T>(call: impl Future<Output = Result<T, kube::Error>>) -> Result<T, Error> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(result) => result.map_err(Error::Api),
        Err(_) => Err(Error::Timeout(CALL_TIMEOUT)),
    }
}

impl Cluster for Kube {
    async fn apply_secret(&self, namespace: &str, name: &str, delivered: &Delivered) -> Result<(), Error> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let body = secret(namespace, name, delivered, self.owner.as_ref());
        bounded(api.patch(name, &params, &Patch::Apply(&body))).await?;
        Ok(())
    }

    async fn delete_secret(&self, namespace: &str, name: &str) -> Result<(), Error> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        match bounded(api.delete(name, &DeleteParams::default())).await {
            Ok(_) => Ok(()),
            Err(Error::Api(kube::Error::Api(status))) if status.code == 404 => Ok(()),
            Err(err) => Err(err),
        }
    }

    async fn publish(&self, notice: &Notice) -> Result<(), Error> {
        let event = Event {
            type_: if notice.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: notice.reason.to_owned(),
            note: Some(notice.note.clone()),
            action: notice.action.to_owned(),
            secondary: notice.related.as_ref().map(reference),
        };
        bounded(self.recorder.publish(&event, &reference(&notice.regarding))).await
    }
}

/// One call the writer made, as [`Recording`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    ApplySecret {
        namespace: String,
        name: String,
        delivered: Delivered,
    },
    DeleteSecret {
        namespace: String,
        name: String,
    },
    Publish(Notice),
}

/// A cluster that only reports each call on a channel (tests read the intended writes off
/// it; no API mock needed).
#[derive(Clone)]
pub struct Recording {
    calls: mpsc::UnboundedSender<Call>,
}

impl Recording {
    pub fn new() -> (Self, mpsc::UnboundedReceiver<Call>) {
        let (calls, rx) = mpsc::unbounded_channel();
        (Self { calls }, rx)
    }

    fn send(&self, call: Call) {
        // The test dropped its receiver: nothing to report to.
        let _ = self.calls.send(call);
    }
}

impl Cluster for Recording {
    async fn apply_secret(&self, namespace: &str, name: &str, delivered: &Delivered) -> Result<(), Error> {
        self.send(Call::ApplySecret {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            delivered: delivered.clone(),
        });
        Ok(())
    }

    async fn delete_secret(&self, namespace: &str, name: &str) -> Result<(), Error> {
        self.send(Call::DeleteSecret {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        });
        Ok(())
    }

    async fn publish(&self, notice: &Notice) -> Result<(), Error> {
        self.send(Call::Publish(notice.clone()));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_secrets_are_owned_by_the_install_namespace() {
        let install = Namespace {
            metadata: ObjectMeta {
                name: Some("openshell-supervision".into()),
                uid: Some("9f0c".into()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        let owner = namespace_owner(&install);
        let delivered = Delivered {
            token: "t".into(),
            expires_at_ms: 0,
            trust_jwks: "{}".into(),
            ca_pem: None,
        };
        let written = secret("team-a", "openshell-supervision-token", &delivered, owner.as_ref());
        let owners = written.metadata.owner_references.unwrap_or_default();
        assert_eq!(owners.len(), 1);
        assert_eq!(
            (owners[0].kind.as_str(), owners[0].name.as_str(), owners[0].uid.as_str()),
            ("Namespace", "openshell-supervision", "9f0c")
        );
        assert_eq!(
            owners[0].block_owner_deletion, None,
            "no delete permission on namespaces is needed"
        );
        let unowned = secret("team-a", "openshell-supervision-token", &delivered, None);
        assert!(unowned.metadata.owner_references.is_none());
        let nameless = Namespace::default();
        assert!(namespace_owner(&nameless).is_none());
    }
}
