//! The writes to the Kubernetes API, behind a small trait ([`Cluster`]): the real client
//! ([`Kube`], tested against a mock API server answering with captured responses and on the
//! real cluster), and [`Absent`] for a replica without Kubernetes. The pool tests implement it
//! with a stand-in that reads what the writers intend off a channel.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Namespace, ObjectReference, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{ApiResource, DeleteParams, DynamicObject, ObjectMeta, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client};
use plumbing::tls::CA_FILE;
use proto::trust::{TOKEN_FILE, TRUST_BUNDLE_FILE};

use super::egress;
use super::index::Pod;
use super::notice::{Notice, Regarding};
use super::operation_reconcile::OperationNotice;
use super::policy_status::PolicyStatus;
use super::pool_operation::{self, OperationStatus};
use super::pool_status::{self, PoolStatus};
use super::supervised::{self, Supervised};
use crate::tokens::Delivered;

/// Field manager of the gateway's server-side applies.
pub const FIELD_MANAGER: &str = "supervision-gateway";
/// `reportingController` of the gateway's Events.
pub const REPORTING_CONTROLLER: &str = "supervision.openshell.ai/gateway";
/// Label on every object the gateway writes.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "supervision-gateway");
/// Bound on every API call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// A repeat within this long of the last is counted in the Event's series (as kube-runtime's
/// recorder does); later, it is a new Event.
pub const SERIES_TTL: Duration = Duration::from_secs(6 * 60);
/// Events [`Cluster::publish_distinct`] remembers at most (more are each published anew).
pub const MAX_SERIES: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    #[error("Kubernetes API call timed out after {0:?}")]
    Timeout(Duration),
    /// The namespace is being deleted: the API server forbids new objects in it (403,
    /// cause `NamespaceTerminating`). Not worth a retry: the namespace is going away.
    #[error("namespace {0} is being terminated")]
    NamespaceTerminating(String),
}

/// Whether `status` is the API server's refusal to create anything in a terminating
/// namespace (NamespaceLifecycle admission: 403 Forbidden, cause `NamespaceTerminating`,
/// "unable to create new content in namespace … because it is being terminated").
pub fn is_namespace_terminating(status: &kube::core::Status) -> bool {
    status.code == 403
        && (status
            .details
            .as_ref()
            .is_some_and(|d| d.causes.iter().any(|c| c.reason == "NamespaceTerminating"))
            || status.message.contains("because it is being terminated"))
}

/// Map an API error in `namespace` to [`Error`], telling a terminating namespace apart.
fn in_namespace(namespace: &str, err: Error) -> Error {
    match err {
        Error::Api(kube::Error::Api(status)) if is_namespace_terminating(&status) => {
            Error::NamespaceTerminating(namespace.to_owned())
        }
        other => other,
    }
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
    /// Record an Event that its note tells apart from others of the same object and reason
    /// (one per denied destination): repeats of the same note become its series.
    fn publish_distinct(&self, notice: &Notice) -> impl Future<Output = Result<(), Error>> + Send;
    /// Server-side apply the status of the `SupervisorPool` `name` in `namespace`, creating
    /// the object (spec empty) when it does not exist.
    fn apply_pool_status(
        &self,
        namespace: &str,
        name: &str,
        status: &PoolStatus,
    ) -> impl Future<Output = Result<(), Error>> + Send;
    /// Server-side apply the status of the `SandboxPolicy` `name` in `namespace`; one that
    /// no longer exists counts as done.
    fn apply_policy_status(
        &self,
        namespace: &str,
        name: &str,
        status: &PolicyStatus,
    ) -> impl Future<Output = Result<(), Error>> + Send;
    /// Set the finalizers of the `SupervisorPoolOperation` `name`, only if it is still at
    /// `resource_version` (409 otherwise). One already gone counts as done.
    fn set_operation_finalizers(
        &self,
        namespace: &str,
        name: &str,
        resource_version: &str,
        finalizers: &[String],
    ) -> impl Future<Output = Result<(), Error>> + Send;
    /// Server-side apply the status of the `SupervisorPoolOperation` `name`.
    fn apply_operation_status(
        &self,
        namespace: &str,
        name: &str,
        status: &OperationStatus,
    ) -> impl Future<Output = Result<(), Error>> + Send;
    /// Record an Event on a `SupervisorPoolOperation` of `namespace`.
    fn publish_operation(
        &self,
        namespace: &str,
        notice: &OperationNotice,
    ) -> impl Future<Output = Result<(), Error>> + Send;
    /// The status of the `SupervisorPool` `name` with its `resourceVersion`; `None` when the
    /// object does not exist or has no status this version can read.
    fn read_pool_status(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Option<(String, PoolStatus)>, Error>> + Send;
    /// Replace that status, only if the object is still at `resource_version`: `false` when
    /// it changed meanwhile (409), and nothing was written.
    fn replace_pool_status(
        &self,
        namespace: &str,
        name: &str,
        resource_version: &str,
        status: &PoolStatus,
    ) -> impl Future<Output = Result<bool, Error>> + Send;
    /// Set the [`supervised::CONDITION`] of `pod` (only if it still has its UID; a Pod gone
    /// or recreated counts as done), `since` its `lastTransitionTime`.
    fn set_supervised(
        &self,
        pod: &Pod,
        condition: &Supervised,
        since: &str,
    ) -> impl Future<Output = Result<(), Error>> + Send;
}

/// The `SupervisorPool` resource for the dynamic API.
pub fn pool_resource() -> ApiResource {
    ApiResource {
        group: pool_status::GROUP.to_owned(),
        version: pool_status::VERSION.to_owned(),
        api_version: format!("{}/{}", pool_status::GROUP, pool_status::VERSION),
        kind: pool_status::KIND.to_owned(),
        plural: pool_status::PLURAL.to_owned(),
    }
}

/// The `SupervisorPool` object as the gateway applies it: its name and label, an empty spec,
/// and `status` when given (the status subresource's apply body).
pub fn pool_object(namespace: &str, name: &str, status: Option<&PoolStatus>) -> serde_json::Value {
    let mut object = serde_json::json!({
        "apiVersion": format!("{}/{}", pool_status::GROUP, pool_status::VERSION),
        "kind": pool_status::KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": { MANAGED_BY.0: MANAGED_BY.1 },
        },
    });
    match status {
        Some(status) => object["status"] = serde_json::to_value(status).unwrap_or_default(),
        None => object["spec"] = serde_json::json!({}),
    }
    object
}

/// The Secret as the gateway writes it: the token (operator only), the trust bundle and the
/// CA bundle (empty when none is configured) under the file names the sidecar and the
/// supervisor read from the mount. `owner`
/// (the install's Namespace) makes the garbage collector remove the Secret when the install
/// is deleted, whichever namespace it is in.
pub fn secret(namespace: &str, name: &str, delivered: &Delivered, owner: Option<&OwnerReference>) -> Secret {
    let mut data = BTreeMap::from([(
        TRUST_BUNDLE_FILE.to_owned(),
        ByteString(delivered.trust_jwks.as_bytes().to_vec()),
    )]);
    if let Some(token) = &delivered.token {
        data.insert(TOKEN_FILE.to_owned(), ByteString(token.as_bytes().to_vec()));
    }
    // Always present (empty without a CA: a plaintext pool): the sidecar's projected volume
    // names the key.
    let ca = delivered.ca_pem.as_deref().unwrap_or_default();
    data.insert(CA_FILE.to_owned(), ByteString(ca.as_bytes().to_vec()));
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
/// (events.k8s.io/v1, client-go naming, series for repeats), which tells repeats apart by
/// object and reason only and keeps the first note; [`Cluster::publish_distinct`] keeps its own
/// series by note.
#[derive(Clone)]
pub struct Kube {
    client: Client,
    recorder: Recorder,
    owner: Option<OwnerReference>,
    instance: String,
    series: std::sync::Arc<std::sync::Mutex<HashMap<SeriesKey, Series>>>,
}

/// An Event of [`Cluster::publish_distinct`]: namespace, object name, reason, note.
type SeriesKey = (String, String, &'static str, String);

/// The Event a note was last published as: its name, its count, when.
#[derive(Clone)]
struct Series {
    name: String,
    count: i32,
    at: std::time::Instant,
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
            instance: instance.to_owned(),
            series: std::sync::Arc::default(),
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

impl Kube {
    fn remember(&self, key: SeriesKey, last: Series) {
        let mut series = self.series.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if series.len() < MAX_SERIES || series.contains_key(&key) {
            series.insert(key, last);
        }
    }
}

fn event_type(warning: bool) -> EventType {
    if warning { EventType::Warning } else { EventType::Normal }
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
        bounded(api.patch(name, &params, &Patch::Apply(&body)))
            .await
            .map_err(|err| in_namespace(namespace, err))?;
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
            type_: event_type(notice.warning),
            reason: notice.reason.to_owned(),
            note: Some(notice.note.clone()),
            action: notice.action.to_owned(),
            secondary: notice.related.as_ref().map(reference),
        };
        bounded(self.recorder.publish(&event, &reference(&notice.regarding)))
            .await
            .map_err(|err| in_namespace(&notice.regarding.namespace, err))
    }

    async fn publish_distinct(&self, notice: &Notice) -> Result<(), Error> {
        use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
        use k8s_openapi::jiff::Timestamp;

        let namespace = notice.regarding.namespace.clone();
        let key: SeriesKey = (
            namespace.clone(),
            notice.regarding.name.clone(),
            notice.reason,
            notice.note.clone(),
        );
        let cached = {
            let mut series = self.series.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            series.retain(|_, s| s.at.elapsed() < SERIES_TTL);
            series.get(&key).cloned()
        };
        let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), &namespace);
        let now = MicroTime(Timestamp::now());
        if let Some(last) = cached {
            let count = last.count.saturating_add(1);
            let patch = serde_json::json!({
                "series": EventSeries { count, last_observed_time: now.clone() },
            });
            match bounded(api.patch(&last.name, &PatchParams::default(), &Patch::Merge(&patch))).await {
                Ok(_) => {
                    self.remember(
                        key,
                        Series {
                            count,
                            at: std::time::Instant::now(),
                            ..last
                        },
                    );
                    return Ok(());
                }
                // Gone (expired by the API server): published anew below.
                Err(Error::Api(kube::Error::Api(status))) if status.code == 404 => {}
                Err(err) => return Err(in_namespace(&namespace, err)),
            }
        }
        let name = format!("{}.{:x}", notice.regarding.name, Timestamp::now().as_nanosecond());
        let event = K8sEvent {
            action: Some(notice.action.to_owned()),
            reason: Some(notice.reason.to_owned()),
            note: Some(notice.note.clone()),
            event_time: Some(now),
            regarding: Some(reference(&notice.regarding)),
            related: notice.related.as_ref().map(reference),
            reporting_controller: Some(REPORTING_CONTROLLER.to_owned()),
            reporting_instance: Some(self.instance.clone()),
            type_: Some(if notice.warning { "Warning" } else { "Normal" }.to_owned()),
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(namespace.clone()),
                ..ObjectMeta::default()
            },
            ..K8sEvent::default()
        };
        bounded(api.create(&kube::api::PostParams::default(), &event))
            .await
            .map_err(|err| in_namespace(&namespace, err))?;
        self.remember(
            key,
            Series {
                name,
                count: 1,
                at: std::time::Instant::now(),
            },
        );
        Ok(())
    }

    async fn set_operation_finalizers(
        &self,
        namespace: &str,
        name: &str,
        resource_version: &str,
        finalizers: &[String],
    ) -> Result<(), Error> {
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), namespace, &pool_operation::resource());
        let patch = pool_operation::finalizers_patch(resource_version, finalizers);
        match bounded(api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))).await {
            Err(Error::Api(kube::Error::Api(status))) if status.code == 404 => Ok(()),
            other => other.map(|_| ()),
        }
    }

    async fn apply_policy_status(&self, namespace: &str, name: &str, status: &PolicyStatus) -> Result<(), Error> {
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), namespace, &egress::resource());
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let body = serde_json::json!({
            "apiVersion": egress::resource().api_version,
            "kind": egress::KIND,
            "metadata": { "name": name, "namespace": namespace },
            "status": status,
        });
        match bounded(api.patch_status(name, &params, &Patch::Apply(&body))).await {
            Err(Error::Api(kube::Error::Api(refused))) if refused.code == 404 => Ok(()),
            other => other.map(|_| ()),
        }
    }

    async fn apply_operation_status(&self, namespace: &str, name: &str, status: &OperationStatus) -> Result<(), Error> {
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), namespace, &pool_operation::resource());
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let body = pool_operation::status_body(namespace, name, status);
        bounded(api.patch_status(name, &params, &Patch::Apply(&body))).await?;
        Ok(())
    }

    async fn publish_operation(&self, namespace: &str, notice: &OperationNotice) -> Result<(), Error> {
        let event = Event {
            type_: event_type(notice.warning),
            reason: notice.reason.to_owned(),
            note: Some(notice.note.clone()),
            action: "Operate".to_owned(),
            secondary: None,
        };
        let regarding = ObjectReference {
            api_version: Some(format!("{}/{}", pool_status::GROUP, pool_status::VERSION)),
            kind: Some(pool_operation::KIND.to_owned()),
            namespace: Some(namespace.to_owned()),
            name: Some(notice.name.clone()),
            uid: Some(notice.uid.clone()),
            ..ObjectReference::default()
        };
        bounded(self.recorder.publish(&event, &regarding)).await
    }

    async fn read_pool_status(&self, namespace: &str, name: &str) -> Result<Option<(String, PoolStatus)>, Error> {
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), namespace, &pool_resource());
        let Some(object) = bounded(api.get_opt(name)).await? else {
            return Ok(None);
        };
        let version = object.metadata.resource_version.clone().unwrap_or_default();
        // A status this version cannot read is left alone (marking it would blank the rest).
        let status = object
            .data
            .get("status")
            .and_then(|s| serde_json::from_value(s.clone()).ok());
        Ok(status.map(|status| (version, status)))
    }

    async fn replace_pool_status(
        &self,
        namespace: &str,
        name: &str,
        resource_version: &str,
        status: &PoolStatus,
    ) -> Result<bool, Error> {
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), namespace, &pool_resource());
        let patch = serde_json::json!({
            "metadata": { "resourceVersion": resource_version },
            "status": status,
        });
        match bounded(api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))).await {
            Ok(_) => Ok(true),
            Err(Error::Api(kube::Error::Api(refused))) if refused.code == 409 || refused.code == 404 => Ok(false),
            Err(err) => Err(err),
        }
    }

    async fn set_supervised(&self, pod: &Pod, condition: &Supervised, since: &str) -> Result<(), Error> {
        let api: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(self.client.clone(), &pod.namespace);
        let patch = supervised::patch(pod, condition, since);
        match bounded(api.patch_status(&pod.name, &PatchParams::default(), &Patch::Strategic(&patch))).await {
            // Gone, or recreated under its name (the UID precondition, 409, or 422 for a UID
            // that is not the object's): nothing to say.
            Err(Error::Api(kube::Error::Api(status)))
                if status.code == 404 || status.code == 409 || status.code == 422 && status.message.contains("uid") =>
            {
                Ok(())
            }
            other => other.map(|_| ()),
        }
    }

    async fn apply_pool_status(&self, namespace: &str, name: &str, status: &PoolStatus) -> Result<(), Error> {
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), namespace, &pool_resource());
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let body = pool_object(namespace, name, Some(status));
        match bounded(api.patch_status(name, &params, &Patch::Apply(&body))).await {
            // Not there yet (first coordinator of the install, or deleted by hand): create it,
            // then its status (an apply of the status subresource never creates).
            Err(Error::Api(kube::Error::Api(refused))) if refused.code == 404 => {
                let object = pool_object(namespace, name, None);
                bounded(api.patch(name, &params, &Patch::Apply(&object))).await?;
                bounded(api.patch_status(name, &params, &Patch::Apply(&body))).await?;
                Ok(())
            }
            other => other.map(|_| ()),
        }
    }
}

/// No cluster: a replica without Kubernetes (local mode) runs with `None` of an integration of
/// this type, so none of these calls is ever made.
#[derive(Debug, Clone, Copy)]
pub enum Absent {}

impl Cluster for Absent {
    async fn apply_secret(&self, _: &str, _: &str, _: &Delivered) -> Result<(), Error> {
        match *self {}
    }

    async fn delete_secret(&self, _: &str, _: &str) -> Result<(), Error> {
        match *self {}
    }

    async fn publish(&self, _: &Notice) -> Result<(), Error> {
        match *self {}
    }

    async fn publish_distinct(&self, _: &Notice) -> Result<(), Error> {
        match *self {}
    }

    async fn apply_pool_status(&self, _: &str, _: &str, _: &PoolStatus) -> Result<(), Error> {
        match *self {}
    }

    async fn apply_policy_status(&self, _: &str, _: &str, _: &PolicyStatus) -> Result<(), Error> {
        match *self {}
    }

    async fn read_pool_status(&self, _: &str, _: &str) -> Result<Option<(String, PoolStatus)>, Error> {
        match *self {}
    }

    async fn replace_pool_status(&self, _: &str, _: &str, _: &str, _: &PoolStatus) -> Result<bool, Error> {
        match *self {}
    }

    async fn set_operation_finalizers(&self, _: &str, _: &str, _: &str, _: &[String]) -> Result<(), Error> {
        match *self {}
    }

    async fn apply_operation_status(&self, _: &str, _: &str, _: &OperationStatus) -> Result<(), Error> {
        match *self {}
    }

    async fn publish_operation(&self, _: &str, _: &OperationNotice) -> Result<(), Error> {
        match *self {}
    }

    async fn set_supervised(&self, _: &Pod, _: &Supervised, _: &str) -> Result<(), Error> {
        match *self {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(json: &str) -> kube::core::Status {
        serde_json::from_str(json).unwrap_or_else(|err| panic!("{err}: {json}"))
    }

    #[test]
    fn a_terminating_namespace_is_told_apart_from_other_refusals() {
        // What the NamespaceLifecycle admission plugin answers to a create in a namespace
        // being deleted.
        let terminating = status(
            r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
            "message":"secrets \"openshell-supervision-token\" is forbidden: unable to create new content in namespace team-a because it is being terminated",
            "reason":"Forbidden","details":{"name":"openshell-supervision-token","kind":"secrets",
            "causes":[{"reason":"NamespaceTerminating","message":"namespace team-a is being terminated","field":"metadata.namespace"}]},
            "code":403}"#,
        );
        assert!(is_namespace_terminating(&terminating));
        let without_causes = kube::core::Status {
            details: None,
            ..terminating.clone()
        };
        assert!(is_namespace_terminating(&without_causes), "the message alone tells");
        // An RBAC refusal (captured, tests/kube_api.rs) is not one.
        let rbac = status(
            r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
            "message":"secrets is forbidden: User \"system:serviceaccount:team-a:nobody\" cannot create resource \"secrets\" in API group \"\" in the namespace \"team-a\"",
            "reason":"Forbidden","details":{"kind":"secrets"},"code":403}"#,
        );
        assert!(!is_namespace_terminating(&rbac));
        let err = in_namespace("team-a", Error::Api(kube::Error::Api(Box::new(terminating))));
        assert!(matches!(err, Error::NamespaceTerminating(ns) if ns == "team-a"));
    }

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
            token: Some("t".into()),
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
