//! What this replica knows of the cluster, fed by the watches: the namespaces that opted in
//! (label `supervision.openshell.ai/shared=enabled`), the supervised Pods (those that finished
//! among them) and the running Pods admitted without supervision. Plain data with
//! synchronous `apply`/`delete`/`reset` methods — no Kubernetes types, no I/O — so tests drive
//! it directly. Every replica keeps one behind a [`Shared`] handle (the watches write, the
//! coordinator's writer, the member streams and the quota read); only the coordinator's writer
//! acts on it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use super::egress::Egress;
use super::pool_operation::OperationObject;

/// A supervised Pod, as much of it as the gateway needs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Pod {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// A running Pod of a labelled namespace the webhook admitted without supervision (label
/// [`proto::kubernetes::NOT_SUPERVISED_KEY`]).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Unsupervised {
    pub pod: Pod,
    /// The label's value: the webhook's reason code (`runs_as_root`, …).
    pub reason: String,
    /// The annotation's value: the sentence the admission warning showed (may be empty).
    pub message: String,
}

/// The Pods one watch reports, by UID, and whether its first list completed (before that,
/// an absent Pod proves nothing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pods<T> {
    by_uid: BTreeMap<String, T>,
    synced: bool,
}

impl<T> Default for Pods<T> {
    fn default() -> Self {
        Self {
            by_uid: BTreeMap::new(),
            synced: false,
        }
    }
}

impl<T: PartialEq> Pods<T> {
    /// Whether this changed anything.
    fn apply(&mut self, uid: &str, pod: T) -> bool {
        if self.by_uid.get(uid) == Some(&pod) {
            return false;
        }
        self.by_uid.insert(uid.to_owned(), pod);
        true
    }

    fn delete(&mut self, uid: &str) -> bool {
        self.by_uid.remove(uid).is_some()
    }

    fn reset(&mut self, pods: impl IntoIterator<Item = (String, T)>) {
        self.by_uid = pods.into_iter().collect();
        self.synced = true;
    }

    pub fn contains(&self, uid: &str) -> bool {
        self.by_uid.contains_key(uid)
    }

    pub fn get(&self, uid: &str) -> Option<&T> {
        self.by_uid.get(uid)
    }

    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.by_uid.values()
    }

    pub fn synced(&self) -> bool {
        self.synced
    }
}

/// How many deleted supervisor Pods' UIDs are remembered.
const DEPARTED_MEMBER_PODS: usize = 64;

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Index {
    /// Namespaces labelled now.
    labelled: BTreeSet<String>,
    /// Namespaces seen labelled and then unlabelled (or deleted): their Secret must go.
    unlabelled: BTreeSet<String>,
    /// Labelled namespaces being deleted (deletionTimestamp set, phase Terminating): gone
    /// for every purpose — the API server refuses new objects there, and the namespace
    /// controller removes what is in it.
    terminating: BTreeSet<String>,
    /// Namespaces whose token Secret exists, as the Secret watch last said.
    secrets: BTreeSet<String>,
    /// Namespaces whose token Secret must be written now, whatever the token's age: it was
    /// deleted (by hand, or with the label), or the namespace (re)appeared in the index.
    missing_secrets: BTreeSet<String>,
    /// Per-namespace instance limits set by annotation ([`LIMIT_ANNOTATION`]).
    limits: BTreeMap<String, u32>,
    /// Supervised Pods.
    pods: Pods<Pod>,
    /// Supervised Pods that finished (phase `Succeeded` or `Failed`): their instance is
    /// withdrawn at once.
    finished: Pods<Pod>,
    /// Running Pods admitted without supervision.
    unsupervised: Pods<Unsupervised>,
    /// The supervisor Pods of the install namespace (members are named by their Pod): UID by
    /// name, so member Events name the Pod they are about.
    member_pods: BTreeMap<String, String>,
    /// Supervisor Pods deleted lately (name, UID), newest last: a member's departure is
    /// often noticed after its Pod is gone.
    departed_member_pods: std::collections::VecDeque<(String, String)>,
    /// Whether each watch has completed its first list (before that, an absent Pod proves
    /// nothing).
    namespaces_synced: bool,
    /// The `SupervisorPoolOperation` objects of the install namespace by name. Their changes
    /// do not bump `version`: the operation writer looks every second on its own.
    operation_objects: BTreeMap<String, OperationObject>,
    /// The egress policies and the supervised Pods' choice among them. Their changes do not
    /// bump `version`: they reach the members' snapshots, not the writer.
    egress: Egress,
    /// Bumped on every change, so the writer can tell whether to look again.
    version: u64,
}

/// Namespace annotation overriding the gateway's per-namespace instance limit.
pub const LIMIT_ANNOTATION: &str = "supervision.openshell.ai/max-instances";

/// The limit an annotation value sets: a decimal count, else none (the default applies).
pub fn parse_limit(value: Option<&str>) -> Option<u32> {
    value.and_then(|v| v.trim().parse::<u32>().ok())
}

impl Index {
    /// An operation object was added or changed.
    pub fn apply_operation_object(&mut self, object: OperationObject) {
        self.operation_objects.insert(object.name.clone(), object);
    }

    /// An operation object is gone.
    pub fn delete_operation_object(&mut self, name: &str) {
        self.operation_objects.remove(name);
    }

    /// A (re)list: exactly these operation objects exist.
    pub fn reset_operation_objects(&mut self, objects: impl IntoIterator<Item = OperationObject>) {
        self.operation_objects = objects.into_iter().map(|o| (o.name.clone(), o)).collect();
    }

    /// The operation objects, by name.
    pub fn operation_objects(&self) -> Vec<OperationObject> {
        self.operation_objects.values().cloned().collect()
    }

    /// Set (or clear) the instance limit of `namespace`; no writer wake-up needed.
    pub fn set_limit(&mut self, namespace: &str, limit: Option<u32>) {
        match limit {
            Some(limit) => self.limits.insert(namespace.to_owned(), limit),
            None => self.limits.remove(namespace),
        };
    }

    /// A (re)list: exactly these namespaces have an annotated limit.
    pub fn reset_limits(&mut self, limits: impl IntoIterator<Item = (String, u32)>) {
        self.limits = limits.into_iter().collect();
    }

    /// The annotated instance limit of `namespace`, if any.
    pub fn limit(&self, namespace: &str) -> Option<u32> {
        self.limits.get(namespace).copied()
    }

    /// Whether `namespace` is labelled now (and not being deleted).
    pub fn is_labelled(&self, namespace: &str) -> bool {
        self.labelled.contains(namespace)
    }

    pub fn apply_namespace(&mut self, name: &str) {
        if self.terminating.contains(name) {
            return;
        }
        if self.labelled.insert(name.to_owned()) {
            // Newly (re)labelled: its Secret may be long gone (removed with the label).
            self.missing_secrets.insert(name.to_owned());
            self.version += 1;
        }
        self.unlabelled.remove(name);
    }

    /// The namespace is being deleted: treated as gone at once, with nothing to remove (its
    /// deletion takes the Secret with it; the API server forbids writes there meanwhile).
    pub fn terminate_namespace(&mut self, name: &str) {
        let was_labelled = self.labelled.remove(name);
        let was_unlabelled = self.unlabelled.remove(name);
        if self.terminating.insert(name.to_owned()) || was_labelled || was_unlabelled {
            self.version += 1;
        }
    }

    /// The namespace lost the label or was deleted (a label-selector watch reports both as
    /// a deletion).
    pub fn delete_namespace(&mut self, name: &str) {
        if self.terminating.remove(name) {
            // Deleted at last: nothing was left to do for it.
            self.version += 1;
            return;
        }
        if self.labelled.remove(name) {
            self.unlabelled.insert(name.to_owned());
            self.version += 1;
        }
    }

    /// A (re)list of the labelled namespaces: the watch restarted, so anything not in it
    /// was unlabelled meanwhile.
    pub fn reset_namespaces(&mut self, names: impl IntoIterator<Item = String>) {
        self.reset_namespaces_with(names, []);
    }

    /// A (re)list of the labelled namespaces, `terminating` among them being deleted.
    pub fn reset_namespaces_with(
        &mut self,
        names: impl IntoIterator<Item = String>,
        terminating: impl IntoIterator<Item = String>,
    ) {
        let terminating: BTreeSet<String> = terminating.into_iter().collect();
        let names: BTreeSet<String> = names.into_iter().filter(|n| !terminating.contains(n)).collect();
        for name in &terminating {
            self.labelled.remove(name);
            self.unlabelled.remove(name);
        }
        self.terminating = terminating;
        for gone in self.labelled.difference(&names) {
            self.unlabelled.insert(gone.clone());
        }
        for name in names.difference(&self.labelled) {
            self.missing_secrets.insert(name.clone());
        }
        for name in &names {
            self.unlabelled.remove(name);
        }
        self.labelled = names;
        self.namespaces_synced = true;
        self.version += 1;
    }

    fn bump(&mut self, changed: bool) {
        if changed {
            self.version += 1;
        }
    }

    pub fn apply_pod(&mut self, pod: Pod) {
        let changed = self.pods.apply(&pod.uid.clone(), pod);
        self.bump(changed);
    }

    pub fn delete_pod(&mut self, uid: &str) {
        let changed = self.pods.delete(uid);
        self.bump(changed);
    }

    pub fn reset_pods(&mut self, pods: impl IntoIterator<Item = Pod>) {
        self.pods.reset(pods.into_iter().map(|p| (p.uid.clone(), p)));
        self.bump(true);
    }

    /// A supervised Pod finished (or is listed finished).
    pub fn apply_finished(&mut self, pod: Pod) {
        let changed = self.finished.apply(&pod.uid.clone(), pod);
        self.bump(changed);
    }

    /// A finished Pod was deleted.
    pub fn delete_finished(&mut self, uid: &str) {
        let changed = self.finished.delete(uid);
        self.bump(changed);
    }

    pub fn reset_finished(&mut self, pods: impl IntoIterator<Item = Pod>) {
        self.finished.reset(pods.into_iter().map(|p| (p.uid.clone(), p)));
        self.bump(true);
    }

    /// A running Pod admitted without supervision (created or changed).
    pub fn apply_unsupervised(&mut self, pod: Unsupervised) {
        let changed = self.unsupervised.apply(&pod.pod.uid.clone(), pod);
        self.bump(changed);
    }

    /// Such a Pod was deleted or finished.
    pub fn delete_unsupervised(&mut self, uid: &str) {
        let changed = self.unsupervised.delete(uid);
        self.bump(changed);
    }

    pub fn reset_unsupervised(&mut self, pods: impl IntoIterator<Item = Unsupervised>) {
        self.unsupervised
            .reset(pods.into_iter().map(|p| (p.pod.uid.clone(), p)));
        self.bump(true);
    }

    /// A supervisor Pod of the install namespace (created or changed).
    pub fn apply_member_pod(&mut self, name: &str, uid: &str) {
        self.member_pods.insert(name.to_owned(), uid.to_owned());
    }

    /// A supervisor Pod was deleted: its UID is kept a while for the Events about it.
    pub fn delete_member_pod(&mut self, name: &str) {
        if let Some(uid) = self.member_pods.remove(name) {
            self.departed_member_pods.push_back((name.to_owned(), uid));
            while self.departed_member_pods.len() > DEPARTED_MEMBER_PODS {
                self.departed_member_pods.pop_front();
            }
        }
    }

    /// A (re)list of the supervisor Pods (name, UID).
    pub fn reset_member_pods(&mut self, pods: impl IntoIterator<Item = (String, String)>) {
        let pods: BTreeMap<String, String> = pods.into_iter().collect();
        let gone: Vec<String> = self
            .member_pods
            .keys()
            .filter(|n| !pods.contains_key(*n))
            .cloned()
            .collect();
        for name in gone {
            self.delete_member_pod(&name);
        }
        self.member_pods = pods;
    }

    /// The UID of supervisor Pod `name`, live or deleted lately.
    pub fn member_pod_uid(&self, name: &str) -> Option<&str> {
        self.member_pods.get(name).map(String::as_str).or_else(|| {
            self.departed_member_pods
                .iter()
                .rev()
                .find(|(n, _)| n == name)
                .map(|(_, uid)| uid.as_str())
        })
    }

    /// The Secret of `namespace` was removed: stop asking for it.
    pub fn forget_unlabelled(&mut self, namespace: &str) {
        self.unlabelled.remove(namespace);
    }

    /// The Secret watch saw the token Secret of `namespace` (created or changed).
    pub fn apply_secret(&mut self, namespace: &str) {
        if self.secrets.insert(namespace.to_owned()) {
            self.version += 1;
        }
    }

    /// The token Secret of `namespace` was deleted (by hand, or by the writer on unlabel).
    pub fn delete_secret(&mut self, namespace: &str) {
        self.secrets.remove(namespace);
        if self.missing_secrets.insert(namespace.to_owned()) {
            self.version += 1;
        }
    }

    /// A (re)list of the token Secrets: a labelled namespace without one needs it now.
    pub fn reset_secrets(&mut self, namespaces: impl IntoIterator<Item = String>) {
        self.secrets = namespaces.into_iter().collect();
        for name in self.labelled.difference(&self.secrets) {
            self.missing_secrets.insert(name.clone());
        }
        self.version += 1;
    }

    /// The writer is writing the token Secret of `namespace`: returns whether it was needed.
    pub fn secret_written(&mut self, namespace: &str) -> bool {
        self.missing_secrets.remove(namespace)
    }

    /// The token Secret of `namespace` is needed (again): a write of it failed.
    pub fn need_secret(&mut self, namespace: &str) {
        if self.missing_secrets.insert(namespace.to_owned()) {
            self.version += 1;
        }
    }

    /// Whether the token Secret of `namespace` must be written now, due or not.
    pub fn needs_secret(&self, namespace: &str) -> bool {
        self.missing_secrets.contains(namespace)
    }

    pub fn labelled(&self) -> &BTreeSet<String> {
        &self.labelled
    }

    pub fn unlabelled(&self) -> &BTreeSet<String> {
        &self.unlabelled
    }

    pub fn is_terminating(&self, namespace: &str) -> bool {
        self.terminating.contains(namespace)
    }

    pub fn namespaces_synced(&self) -> bool {
        self.namespaces_synced
    }

    pub fn pods_synced(&self) -> bool {
        self.pods.synced()
    }

    pub fn has_pod(&self, uid: &str) -> bool {
        self.pods.contains(uid)
    }

    pub fn pods(&self) -> impl Iterator<Item = &Pod> {
        self.pods.values()
    }

    /// Supervised Pods that finished.
    pub fn finished(&self) -> &Pods<Pod> {
        &self.finished
    }

    /// Running Pods admitted without supervision (any namespace: the label is anyone's to set).
    pub fn unsupervised(&self) -> &Pods<Unsupervised> {
        &self.unsupervised
    }

    /// Those of labelled namespaces: the only ones the pool counts, tells about and marks.
    pub fn unsupervised_labelled(&self) -> impl Iterator<Item = &Unsupervised> {
        self.unsupervised
            .values()
            .filter(|p| self.is_labelled(&p.pod.namespace))
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn egress(&self) -> &Egress {
        &self.egress
    }

    pub fn egress_mut(&mut self) -> &mut Egress {
        &mut self.egress
    }
}

/// Shared between the watches (writers) and the coordinator's writer and the member streams
/// (readers).
#[derive(Debug, Clone)]
pub struct Shared {
    index: Arc<Mutex<Index>>,
    /// Wakes the writer after a change.
    pub changed: Arc<Notify>,
    /// The egress version ([`Egress::version`]) after every change of it: the member
    /// streams send new snapshots.
    egress: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Default for Shared {
    fn default() -> Self {
        Self {
            index: Arc::default(),
            changed: Arc::default(),
            egress: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }
}

impl Shared {
    /// Run `f` on the index (never held across an await).
    pub fn with<T>(&self, f: impl FnOnce(&mut Index) -> T) -> T {
        let mut guard = self.index.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (before, egress_before) = (guard.version(), guard.egress().version());
        let out = f(&mut guard);
        let changed = guard.version() != before;
        let egress = guard.egress().version();
        drop(guard);
        if changed {
            self.changed.notify_one();
        }
        if egress != egress_before {
            self.egress.send_replace(egress);
        }
        out
    }

    /// Changes whenever a Pod's egress policy may have.
    pub fn egress_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.egress.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(uid: &str) -> Pod {
        Pod {
            namespace: "team-a".into(),
            name: format!("agent-{uid}"),
            uid: uid.into(),
        }
    }

    #[test]
    fn a_namespace_that_loses_its_label_is_remembered_until_its_secret_is_gone() {
        let mut index = Index::default();
        index.apply_namespace("team-a");
        index.apply_namespace("team-b");
        index.delete_namespace("team-b");
        assert_eq!(index.labelled().iter().collect::<Vec<_>>(), ["team-a"]);
        assert_eq!(index.unlabelled().iter().collect::<Vec<_>>(), ["team-b"]);
        index.forget_unlabelled("team-b");
        assert!(index.unlabelled().is_empty());
    }

    #[test]
    fn relabelling_cancels_the_removal() {
        let mut index = Index::default();
        index.apply_namespace("team-b");
        index.delete_namespace("team-b");
        index.apply_namespace("team-b");
        assert!(index.unlabelled().is_empty());
        assert!(index.labelled().contains("team-b"));
    }

    #[test]
    fn a_relist_unlabels_what_it_no_longer_contains() {
        let mut index = Index::default();
        index.apply_namespace("team-a");
        index.apply_namespace("team-b");
        assert!(!index.namespaces_synced());
        index.reset_namespaces(["team-a".to_owned(), "team-c".to_owned()]);
        assert!(index.namespaces_synced());
        assert_eq!(index.labelled().iter().collect::<Vec<_>>(), ["team-a", "team-c"]);
        assert_eq!(index.unlabelled().iter().collect::<Vec<_>>(), ["team-b"]);
    }

    #[test]
    fn a_terminating_namespace_is_gone_with_nothing_to_remove() {
        let mut index = Index::default();
        index.apply_namespace("team-a");
        index.apply_namespace("team-b");
        index.terminate_namespace("team-a");
        assert_eq!(index.labelled().iter().collect::<Vec<_>>(), ["team-b"]);
        assert!(index.unlabelled().is_empty(), "its deletion takes the Secret along");
        // Further updates of the terminating namespace do not bring it back.
        index.apply_namespace("team-a");
        assert!(!index.labelled().contains("team-a"));
        index.delete_namespace("team-a");
        assert!(index.unlabelled().is_empty() && !index.is_terminating("team-a"));
        // A relist that shows one terminating.
        index.reset_namespaces_with(["team-b".to_owned(), "team-c".to_owned()], ["team-b".to_owned()]);
        assert_eq!(index.labelled().iter().collect::<Vec<_>>(), ["team-c"]);
        assert!(index.unlabelled().is_empty() && index.is_terminating("team-b"));
    }

    #[test]
    fn a_deleted_or_relabelled_namespace_secret_is_needed_at_once() {
        let mut index = Index::default();
        index.apply_namespace("team-a");
        assert!(index.needs_secret("team-a"), "a new namespace");
        index.secret_written("team-a");
        index.apply_secret("team-a");
        assert!(!index.needs_secret("team-a"));
        // Deleted by hand.
        index.delete_secret("team-a");
        assert!(index.needs_secret("team-a"));
        index.secret_written("team-a");
        // Unlabelled (the writer removes the Secret), then labelled again.
        index.delete_namespace("team-a");
        index.forget_unlabelled("team-a");
        index.apply_namespace("team-a");
        assert!(index.needs_secret("team-a"));
        index.secret_written("team-a");
        // A relist of the Secrets without team-a's.
        index.reset_secrets([]);
        assert!(index.needs_secret("team-a"));
    }

    #[test]
    fn supervisor_pod_uids_outlive_their_pods_for_a_while() {
        let mut index = Index::default();
        index.reset_member_pods([("supervisor-0".to_owned(), "uid-0".to_owned())]);
        index.apply_member_pod("supervisor-1", "uid-1");
        assert_eq!(index.member_pod_uid("supervisor-1"), Some("uid-1"));
        index.delete_member_pod("supervisor-1");
        index.reset_member_pods([]);
        assert_eq!(index.member_pod_uid("supervisor-1"), Some("uid-1"));
        assert_eq!(index.member_pod_uid("supervisor-0"), Some("uid-0"));
        for i in 0..DEPARTED_MEMBER_PODS {
            index.apply_member_pod(&format!("p-{i}"), "u");
            index.delete_member_pod(&format!("p-{i}"));
        }
        assert_eq!(index.member_pod_uid("supervisor-0"), None, "bounded");
    }

    #[test]
    fn a_namespace_never_labelled_is_not_removed() {
        let mut index = Index::default();
        index.delete_namespace("team-z");
        assert!(index.unlabelled().is_empty());
        assert_eq!(index.version(), 0);
    }

    #[test]
    fn pods_are_keyed_by_uid_and_changes_bump_the_version() {
        let mut index = Index::default();
        index.apply_pod(pod("1"));
        let v = index.version();
        index.apply_pod(pod("1"));
        assert_eq!(index.version(), v, "the same Pod again changes nothing");
        index.apply_pod(pod("2"));
        index.delete_pod("1");
        assert!(!index.has_pod("1"));
        assert!(index.has_pod("2"));
        index.reset_pods([pod("3")]);
        assert!(index.pods_synced());
        assert_eq!(index.pods().map(|p| p.uid.as_str()).collect::<Vec<_>>(), ["3"]);
    }

    #[test]
    fn finished_and_unsupervised_pods_are_kept_apart_and_bump_the_version() {
        let mut index = Index::default();
        let v = index.version();
        index.apply_finished(pod("1"));
        assert!(index.finished().contains("1"));
        assert!(!index.has_pod("1"), "the supervised watch reports its own Pods");
        assert!(index.version() > v);
        let unsupervised = Unsupervised {
            pod: pod("2"),
            reason: "runs_as_root".into(),
            message: "container \"app\" runs as root".into(),
        };
        index.apply_unsupervised(unsupervised.clone());
        let v = index.version();
        index.apply_unsupervised(unsupervised);
        assert_eq!(index.version(), v, "the same Pod again changes nothing");
        index.delete_unsupervised("2");
        assert!(index.unsupervised().values().next().is_none());
        index.delete_finished("1");
        assert!(!index.finished().contains("1"));
        assert!(!index.finished().synced());
        index.reset_finished([]);
        assert!(index.finished().synced());
    }
}
