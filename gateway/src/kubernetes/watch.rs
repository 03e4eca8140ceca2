//! The watches that feed the [`Index`] (through its [`Shared`] handle): labelled namespaces, supervised Pods (and, by a field
//! selector on their phase, those that finished), running Pods admitted without supervision, the gateway's
//! token Secrets, the supervisor Pods and the `SupervisorPoolOperation` objects, all through
//! kube-runtime's watcher (re-list on `410 Expired`, backoff on errors). Pods and Secrets are
//! watched as metadata only (`Api<PartialObjectMeta<_>>` asks for `PartialObjectMetadata`): the index needs their names and UIDs,
//! and neither Pod specs nor Secret data should travel to every replica. Every replica runs
//! them, so a new coordinator starts with a warm index.
//!
//! [`follow`] gathers a watcher's initial list into one [`Change::Reset`]; kube-runtime's
//! reflector does the same buffering but keeps every object in a store for good, which the
//! index (names and UIDs only) does not need.

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use kube::api::DynamicObject;
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::egress::{self, Choice, POLICY_ANNOTATION};
use super::index::{self, Index, LIMIT_ANNOTATION, Shared, parse_limit};
use super::plan::NAMESPACE_SECRET;
use super::pool_operation;

/// Namespaces opt in with this label…
pub const SHARED_LABEL: &str = "supervision.openshell.ai/shared";
/// …set to this value.
pub const SHARED_ENABLED: &str = "enabled";
use proto::kubernetes::NOT_SUPERVISED_KEY;
/// The webhook marks the Pods it injected with this label (value `true`).
pub use proto::kubernetes::SUPERVISED_LABEL;

/// Follow the labelled namespaces until `shutdown`.
pub async fn namespaces(client: Client, shared: Shared, shutdown: CancellationToken) {
    let config = watcher::Config::default().labels(&format!("{SHARED_LABEL}={SHARED_ENABLED}"));
    let events = watcher(Api::<Namespace>::all(client), config).default_backoff();
    let limit = |ns: &Namespace| parse_limit(ns.annotations().get(LIMIT_ANNOTATION).map(String::as_str));
    follow(events, shared, shutdown, "namespaces", |index, event| match event {
        Change::Apply(ns) if is_terminating(&ns) => index.terminate_namespace(&ns.name_any()),
        Change::Apply(ns) => {
            index.set_limit(&ns.name_any(), limit(&ns));
            index.apply_namespace(&ns.name_any());
        }
        Change::Delete(ns) => {
            index.set_limit(&ns.name_any(), None);
            index.delete_namespace(&ns.name_any());
        }
        Change::Reset(all) => {
            index.reset_limits(all.iter().filter_map(|ns| limit(ns).map(|l| (ns.name_any(), l))));
            index.reset_namespaces_with(
                all.iter().map(ResourceExt::name_any),
                all.iter().filter(|ns| is_terminating(ns)).map(ResourceExt::name_any),
            );
        }
    })
    .await;
}

/// A namespace being deleted: deletionTimestamp set, or phase Terminating.
pub fn is_terminating(ns: &Namespace) -> bool {
    ns.metadata.deletion_timestamp.is_some()
        || ns
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|phase| phase == "Terminating")
}

/// Follow the gateway's token Secrets in every namespace until `shutdown`, so that one
/// deleted by hand is rewritten at once. Metadata only (the gateway never reads Secret data
/// back), and only Secrets named [`NAMESPACE_SECRET`] through a `metadata.name` field
/// selector: with it the API server authorizes the cluster-wide list/watch against the
/// ClusterRole's `resourceNames`, so the gateway needs no list/watch on other Secrets.
pub async fn secrets(client: Client, shared: Shared, shutdown: CancellationToken) {
    let config = watcher::Config::default().fields(&format!("metadata.name={NAMESPACE_SECRET}"));
    let events = watcher(Api::<PartialObjectMeta<Secret>>::all(client), config).default_backoff();
    follow(events, shared, shutdown, "secrets", |index, event| match event {
        Change::Apply(secret) => {
            if let Some(namespace) = secret.namespace() {
                index.apply_secret(&namespace);
            }
        }
        Change::Delete(secret) => {
            if let Some(namespace) = secret.namespace() {
                index.delete_secret(&namespace);
            }
        }
        Change::Reset(all) => index.reset_secrets(all.iter().filter_map(ResourceExt::namespace)),
    })
    .await;
}

/// The supervisor Pods carry this label (`app.kubernetes.io/name`)…
pub const SUPERVISOR_POD_LABEL: (&str, &str) = ("app.kubernetes.io/name", "openshell-supervisor");

/// Follow the supervisor Pods of the install namespace (their UIDs go into member Events)
/// until `shutdown`.
pub async fn member_pods(client: Client, namespace: String, shared: Shared, shutdown: CancellationToken) {
    let (key, value) = SUPERVISOR_POD_LABEL;
    let config = watcher::Config::default().labels(&format!("{key}={value}"));
    let events = watcher(Api::<PartialObjectMeta<Pod>>::namespaced(client, &namespace), config).default_backoff();
    let named = |pod: &PartialObjectMeta<Pod>| Some((pod.metadata.name.clone()?, pod.uid()?));
    follow(
        events,
        shared,
        shutdown,
        "supervisor pods",
        move |index, event| match event {
            Change::Apply(pod) => {
                if let Some((name, uid)) = named(&pod) {
                    index.apply_member_pod(&name, &uid);
                }
            }
            Change::Delete(pod) => {
                if let Some(name) = pod.metadata.name.as_deref() {
                    index.delete_member_pod(name);
                }
            }
            Change::Reset(all) => index.reset_member_pods(all.iter().filter_map(named)),
        },
    )
    .await;
}

/// Follow the `SupervisorPoolOperation` objects of the install namespace until `shutdown`.
pub async fn operation_objects(client: Client, namespace: String, shared: Shared, shutdown: CancellationToken) {
    let api = Api::<DynamicObject>::namespaced_with(client, &namespace, &pool_operation::resource());
    let events = watcher(api, watcher::Config::default()).default_backoff();
    follow(
        events,
        shared,
        shutdown,
        "supervisor pool operations",
        |index, event| match event {
            Change::Apply(object) => {
                if let Some(object) = pool_operation::object_of(&object) {
                    index.apply_operation_object(object);
                }
            }
            Change::Delete(object) => {
                if let Some(name) = object.metadata.name.as_deref() {
                    index.delete_operation_object(name);
                }
            }
            Change::Reset(all) => index.reset_operation_objects(all.iter().filter_map(pool_operation::object_of)),
        },
    )
    .await;
}

/// Follow the supervised Pods of every namespace (their metadata, with the egress policy each
/// names) until `shutdown`.
pub async fn pods(client: Client, shared: Shared, shutdown: CancellationToken) {
    let events = pod_metadata(client, &format!("{SUPERVISED_LABEL}=true"), None);
    let into = PodSet {
        of: pod_of,
        apply: Index::apply_pod,
        delete: Index::delete_pod,
        reset: |index, pods| index.reset_pods(pods),
    };
    let choices = PodSet {
        of: choice_of,
        apply: |index, choice| index.egress_mut().apply_pod(choice),
        delete: |index, uid| index.egress_mut().delete_pod(uid),
        reset: |index, choices| index.egress_mut().reset_pods(choices),
    };
    follow(events, shared, shutdown, "pods", move |index, event| {
        choices.change_by_ref(index, &event);
        into.change(index, event);
    })
    .await;
}

/// Follow the `SandboxPolicy` objects of every namespace until `shutdown`.
pub async fn policies(client: Client, shared: Shared, shutdown: CancellationToken) {
    let api = Api::<DynamicObject>::all_with(client, &egress::resource());
    let events = watcher(api, watcher::Config::default()).default_backoff();
    follow(
        events,
        shared,
        shutdown,
        "sandbox policies",
        |index, event| match event {
            Change::Apply(object) => {
                if let Some((namespace, policy)) = egress::policy_of(&object) {
                    index.egress_mut().apply_policy(namespace, policy);
                }
            }
            Change::Delete(object) => {
                if let (Some(namespace), Some(name)) = (object.namespace(), object.metadata.name.as_deref()) {
                    index.egress_mut().delete_policy(&namespace, name);
                }
            }
            Change::Reset(all) => index
                .egress_mut()
                .reset_policies(all.iter().filter_map(egress::policy_of)),
        },
    )
    .await;
}

/// The phases of a Pod whose containers all ended and will not run again, as a field
/// selector (field selectors have no `in`: every other phase excluded).
pub const FINISHED_PHASES: &str = "status.phase!=Pending,status.phase!=Running,status.phase!=Unknown";
/// The phases of a Pod that still runs or will.
pub const LIVE_PHASES: &str = "status.phase!=Succeeded,status.phase!=Failed";

/// Follow the supervised Pods that finished (a Job's, a CronJob's, any whose containers all
/// ended under `restartPolicy: Never` or `OnFailure`) until `shutdown`.
pub async fn finished_pods(client: Client, shared: Shared, shutdown: CancellationToken) {
    let events = pod_metadata(client, &format!("{SUPERVISED_LABEL}=true"), Some(FINISHED_PHASES));
    let into = PodSet {
        of: pod_of,
        apply: Index::apply_finished,
        delete: Index::delete_finished,
        reset: |index, pods| index.reset_finished(pods),
    };
    follow(events, shared, shutdown, "finished pods", move |index, event| {
        into.change(index, event)
    })
    .await;
}

/// Follow the running Pods the webhook admitted without supervision until `shutdown`.
pub async fn unsupervised_pods(client: Client, shared: Shared, shutdown: CancellationToken) {
    let events = pod_metadata(client, NOT_SUPERVISED_KEY, Some(LIVE_PHASES));
    let into = PodSet {
        of: unsupervised_of,
        apply: Index::apply_unsupervised,
        delete: Index::delete_unsupervised,
        reset: |index, pods| index.reset_unsupervised(pods),
    };
    follow(events, shared, shutdown, "unsupervised pods", move |index, event| {
        into.change(index, event)
    })
    .await;
}

/// Which of the index's Pod sets a Pod watch feeds, and what it keeps of a Pod.
struct PodSet<T> {
    of: fn(&PartialObjectMeta<Pod>) -> Option<T>,
    apply: fn(&mut Index, T),
    delete: fn(&mut Index, &str),
    reset: fn(&mut Index, Vec<T>),
}

impl<T> PodSet<T> {
    fn change(&self, index: &mut Index, event: Change<PartialObjectMeta<Pod>>) {
        self.change_by_ref(index, &event);
    }

    fn change_by_ref(&self, index: &mut Index, event: &Change<PartialObjectMeta<Pod>>) {
        match event {
            Change::Apply(pod) => {
                if let Some(pod) = (self.of)(pod) {
                    (self.apply)(index, pod);
                }
            }
            Change::Delete(pod) => {
                if let Some(uid) = pod.uid() {
                    (self.delete)(index, &uid);
                }
            }
            Change::Reset(all) => (self.reset)(index, all.iter().filter_map(self.of).collect()),
        }
    }
}

/// The metadata of the Pods of every namespace matching `labels` (and `fields`).
fn pod_metadata(
    client: Client,
    labels: &str,
    fields: Option<&str>,
) -> impl Stream<Item = Result<watcher::Event<PartialObjectMeta<Pod>>, watcher::Error>> + use<> {
    let mut config = watcher::Config::default().labels(labels);
    if let Some(fields) = fields {
        config = config.fields(fields);
    }
    watcher(Api::<PartialObjectMeta<Pod>>::all(client), config).default_backoff()
}

/// The index's view of a Pod; `None` for one without name, namespace or uid.
pub fn pod_of(pod: &PartialObjectMeta<Pod>) -> Option<index::Pod> {
    Some(index::Pod {
        namespace: pod.namespace()?,
        name: pod.metadata.name.clone()?,
        uid: pod.uid()?,
    })
}

/// Which egress policy a supervised Pod names (its annotation), if any.
pub fn choice_of(pod: &PartialObjectMeta<Pod>) -> Option<Choice> {
    Some(Choice {
        uid: pod.uid()?,
        namespace: pod.namespace()?,
        policy: pod.annotations().get(POLICY_ANNOTATION).cloned(),
    })
}

/// The index's view of a Pod admitted without supervision: its reason code from the label,
/// the sentence from the annotation.
pub fn unsupervised_of(pod: &PartialObjectMeta<Pod>) -> Option<index::Unsupervised> {
    Some(index::Unsupervised {
        pod: pod_of(pod)?,
        reason: pod.labels().get(NOT_SUPERVISED_KEY)?.clone(),
        message: pod.annotations().get(NOT_SUPERVISED_KEY).cloned().unwrap_or_default(),
    })
}

/// A watcher event with the initial list gathered into one reset.
pub enum Change<K> {
    Apply(K),
    Delete(K),
    Reset(Vec<K>),
}

/// Feed `events` into the index: `Init…InitDone` becomes one [`Change::Reset`].
pub async fn follow<K>(
    events: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
    shared: Shared,
    shutdown: CancellationToken,
    what: &'static str,
    apply: impl Fn(&mut Index, Change<K>),
) {
    let mut events = std::pin::pin!(events);
    let mut listing: Option<Vec<K>> = None;
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return,
            event = events.next() => event,
        };
        let change = match event {
            None => return,
            Some(Err(err)) => {
                warn!(watch = what, error = %err, "watch failed; retrying with backoff");
                continue;
            }
            Some(Ok(watcher::Event::Init)) => {
                listing = Some(Vec::new());
                continue;
            }
            Some(Ok(watcher::Event::InitApply(object))) => {
                listing.get_or_insert_with(Vec::new).push(object);
                continue;
            }
            Some(Ok(watcher::Event::InitDone)) => Change::Reset(listing.take().unwrap_or_default()),
            Some(Ok(watcher::Event::Apply(object))) => Change::Apply(object),
            Some(Ok(watcher::Event::Delete(object))) => Change::Delete(object),
        };
        if let Change::Reset(all) = &change {
            debug!(watch = what, objects = all.len(), "listed");
        }
        shared.with(|index| apply(index, change));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn namespace(json: &str) -> Namespace {
        serde_json::from_str(json).unwrap_or_else(|err| panic!("{err}: {json}"))
    }

    #[test]
    fn a_namespace_being_deleted_is_terminating() {
        let active = namespace(r#"{"metadata":{"name":"team-a"},"status":{"phase":"Active"}}"#);
        assert!(!is_terminating(&active));
        let deleting = namespace(
            r#"{"metadata":{"name":"team-a","deletionTimestamp":"2025-01-01T00:00:00Z"},"status":{"phase":"Active"}}"#,
        );
        assert!(is_terminating(&deleting));
        let phase = namespace(r#"{"metadata":{"name":"team-a"},"status":{"phase":"Terminating"}}"#);
        assert!(is_terminating(&phase));
    }
}
