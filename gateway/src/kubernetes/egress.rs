//! Which egress policy each supervised Pod runs: the `SandboxPolicy` objects of every
//! namespace (`manifests/sandboxpolicy-crd.yaml`) and the Pods' choice among them, as plain
//! data fed by the watches. A Pod runs the policy its annotation [`POLICY_ANNOTATION`] names,
//! else its namespace's policy named [`DEFAULT_POLICY`], else none: [`deny_all`]. A named
//! policy that does not exist is deny-all too, never "no policy".
//!
//! Until both the policies and the Pods have been listed, and for a Pod not seen yet, there is
//! no answer ([`Egress::policy_for`] is `None`): the owner then keeps what its sidecar has
//! installed, so a replica that just started never revokes what a policy allows.
//!
//! A policy's credentials name Secrets of its namespace; [`Egress::wanted_secrets`] lists them
//! for [`super::bound_secrets`], which reads them into [`Egress::apply_secret`], and
//! [`Egress::policy_for`] answers with the values (or why there is none) filled in.
//!
//! Revisions only move forward within a name: an object's revision is its creation second ×
//! 10⁶ + its `metadata.generation`, so an edit (generation + 1) and a policy deleted and made
//! again under the same name (a later creation) both move it forward.

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock};

use kube::ResourceExt;
use kube::api::{ApiResource, DynamicObject};
use proto::egress::{Credential, Document, Mode, Rule};
use proto::runtime::v1::{CredentialBinding, EgressPolicy};
use serde::Deserialize;

use super::pool_status::custom_resource;

pub use proto::kubernetes::{DEFAULT_POLICY, POLICY_ANNOTATION};
/// The name of the policy a Pod runs when none applies: no rules, enforced. Not a valid
/// object name, so no `SandboxPolicy` is ever taken for it.
pub const DENY_ALL: &str = "<none>";
/// Kind of the policy resource.
pub const KIND: &str = "SandboxPolicy";
/// Its plural (the resource name in URLs and RBAC).
pub const PLURAL: &str = "sandboxpolicies";
/// Generations kept apart within one creation second (see the module doc).
const GENERATIONS: u64 = 1_000_000;

/// The policy resource for the dynamic API.
pub fn resource() -> ApiResource {
    custom_resource(KIND, PLURAL)
}

/// The policy of a Pod that has none.
pub fn deny_all() -> Arc<EgressPolicy> {
    static DENY: LazyLock<Arc<EgressPolicy>> = LazyLock::new(|| {
        Arc::new(EgressPolicy {
            name: DENY_ALL.to_owned(),
            revision: 1,
            ..EgressPolicy::default()
        })
    });
    Arc::clone(&DENY)
}

/// A supervised Pod's choice, as the Pod watch reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub uid: String,
    pub namespace: String,
    /// The annotation's value, if any.
    pub policy: Option<String>,
}

/// `.spec` of a `SandboxPolicy` (its schema already held it to these fields).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Spec {
    #[serde(default)]
    enforcement: Mode,
    #[serde(default)]
    rules: Vec<Rule>,
    #[serde(default)]
    credentials: Vec<Credential>,
}

/// A `SandboxPolicy` object as its namespace, name and the revision its owners install.
/// A spec that does not read (only an object the API server did not validate) is a policy
/// without rules: it allows nothing.
pub fn policy_of(object: &DynamicObject) -> Option<(String, Arc<EgressPolicy>)> {
    let namespace = object.namespace()?;
    let name = object.metadata.name.clone()?;
    let created = object
        .metadata
        .creation_timestamp
        .as_ref()
        .map_or(0, |t| u64::try_from(t.0.as_second()).unwrap_or(0));
    let generation = object
        .metadata
        .generation
        .and_then(|g| u64::try_from(g).ok())
        .unwrap_or(1)
        .clamp(1, GENERATIONS - 1);
    let spec = match object.data.get("spec").map(Spec::deserialize) {
        Some(Ok(spec)) => spec,
        unread => {
            let error = match unread {
                Some(Err(err)) => err.to_string(),
                _ => "no spec".to_owned(),
            };
            tracing::warn!(%namespace, %name, %error, "SandboxPolicy unreadable: it allows nothing");
            Spec {
                enforcement: Mode::Enforce,
                rules: Vec::new(),
                credentials: Vec::new(),
            }
        }
    };
    let document = Document {
        name,
        revision: created.saturating_mul(GENERATIONS).saturating_add(generation),
        enforcement: spec.enforcement,
        rules: spec.rules,
        credentials: spec.credentials,
    };
    Some((namespace, Arc::new(EgressPolicy::from(&document))))
}

/// The keys a policy names of one Secret, and their values: never in `Debug`.
#[derive(Default, Clone, PartialEq, Eq)]
pub struct SecretData(pub BTreeMap<String, Vec<u8>>);

impl std::fmt::Debug for SecretData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

/// A Secret as last read: its data, or why it could not be read (safe to show).
pub type Read = Result<SecretData, String>;

/// The policies and the Pods' choices, and whether each was listed.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Egress {
    /// The Secrets the policies bind, by namespace and name, as last read.
    secrets: BTreeMap<(String, String), Read>,
    /// By namespace and name.
    policies: BTreeMap<(String, String), Arc<EgressPolicy>>,
    policies_listed: bool,
    /// By Pod UID.
    choices: BTreeMap<String, Choice>,
    choices_listed: bool,
    version: u64,
}

// A policy holds no floating-point field: equality is total.
impl Eq for Egress {}

impl Egress {
    /// Moves with every change of what [`Egress::policy_for`] answers.
    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn apply_policy(&mut self, namespace: String, policy: Arc<EgressPolicy>) {
        let key = (namespace, policy.name.clone());
        if self.policies.get(&key) != Some(&policy) {
            self.policies.insert(key, policy);
            self.version += 1;
        }
    }

    pub fn delete_policy(&mut self, namespace: &str, name: &str) {
        if self.policies.remove(&(namespace.to_owned(), name.to_owned())).is_some() {
            self.version += 1;
        }
    }

    pub fn reset_policies(&mut self, all: impl IntoIterator<Item = (String, Arc<EgressPolicy>)>) {
        self.policies = all.into_iter().map(|(ns, p)| ((ns, p.name.clone()), p)).collect();
        self.policies_listed = true;
        self.version += 1;
    }

    pub fn apply_pod(&mut self, choice: Choice) {
        if self.choices.get(&choice.uid) != Some(&choice) {
            self.choices.insert(choice.uid.clone(), choice);
            self.version += 1;
        }
    }

    pub fn delete_pod(&mut self, uid: &str) {
        if self.choices.remove(uid).is_some() {
            self.version += 1;
        }
    }

    pub fn reset_pods(&mut self, all: impl IntoIterator<Item = Choice>) {
        self.choices = all.into_iter().map(|c| (c.uid.clone(), c)).collect();
        self.choices_listed = true;
        self.version += 1;
    }

    /// Whether both the policies and the Pods have been listed.
    pub fn listed(&self) -> bool {
        self.policies_listed && self.choices_listed
    }

    /// The policy the Pod with `uid` runs, with its credentials' values; `None` before both
    /// lists and for a Pod not seen.
    pub fn policy_for(&self, uid: &str) -> Option<Arc<EgressPolicy>> {
        let (namespace, name) = self.chosen(uid)?;
        let Some(policy) = self.policies.get(&(namespace.to_owned(), name.to_owned())) else {
            return Some(deny_all());
        };
        if policy.credentials.is_empty() {
            return Some(Arc::clone(policy));
        }
        let mut filled = policy.as_ref().clone();
        for binding in &mut filled.credentials {
            match self.value_of(namespace, binding) {
                Ok(value) => binding.value.clone_from(value),
                Err(error) => binding.error = error,
            }
        }
        Some(Arc::new(filled))
    }

    /// The value of `binding` of a policy of `namespace`, or why there is none (safe to show).
    pub fn value_of(&self, namespace: &str, binding: &CredentialBinding) -> Result<&Vec<u8>, String> {
        let secret = format!("Secret {namespace}/{}", binding.secret);
        match self.secrets.get(&(namespace.to_owned(), binding.secret.clone())) {
            Some(Ok(data)) => data
                .0
                .get(&binding.key)
                .ok_or_else(|| format!("{secret} has no key {:?} fit for a header", binding.key)),
            Some(Err(error)) => Err(error.clone()),
            None => Err(format!("{secret} has not been read yet")),
        }
    }

    /// The Secrets the policies bind, by namespace and name, with the keys they name.
    pub fn wanted_secrets(&self) -> BTreeMap<(String, String), Vec<String>> {
        let mut wanted: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
        for ((namespace, _), policy) in &self.policies {
            for binding in &policy.credentials {
                let keys = wanted.entry((namespace.clone(), binding.secret.clone())).or_default();
                if !keys.contains(&binding.key) {
                    keys.push(binding.key.clone());
                }
            }
        }
        wanted
    }

    /// A Secret as just read; one no policy binds any more is forgotten.
    pub fn apply_secret(&mut self, namespace: String, name: String, read: Read) {
        let key = (namespace, name);
        if self.secrets.get(&key) != Some(&read) {
            self.secrets.insert(key, read);
            self.version += 1;
        }
    }

    /// Forgets the Secrets no policy binds.
    pub fn retain_secrets(&mut self, wanted: &BTreeMap<(String, String), Vec<String>>) {
        let before = self.secrets.len();
        self.secrets.retain(|key, _| wanted.contains_key(key));
        if self.secrets.len() != before {
            self.version += 1;
        }
    }

    /// Whether every Secret in `wanted` has been read at least once.
    pub fn has_read(&self, wanted: &BTreeMap<(String, String), Vec<String>>) -> bool {
        wanted.keys().all(|key| self.secrets.contains_key(key))
    }

    /// The namespace and name of the policy the Pod with `uid` chose (one that may not
    /// exist); `None` before both lists and for a Pod not seen.
    pub fn chosen(&self, uid: &str) -> Option<(&str, &str)> {
        if !self.listed() {
            return None;
        }
        let choice = self.choices.get(uid)?;
        Some((&choice.namespace, choice.policy.as_deref().unwrap_or(DEFAULT_POLICY)))
    }

    /// Every policy, by namespace and name.
    pub fn policies(&self) -> impl Iterator<Item = (&(String, String), &Arc<EgressPolicy>)> {
        self.policies.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(json: serde_json::Value) -> DynamicObject {
        serde_json::from_value(json).expect("an object")
    }

    fn policy(namespace: &str, name: &str, created: &str, generation: i64, hosts: &[&str]) -> DynamicObject {
        let rules: Vec<_> = hosts
            .iter()
            .map(|h| serde_json::json!({"name": h.replace('.', "-"), "host": h, "ports": [443]}))
            .collect();
        object(serde_json::json!({
            "apiVersion": "supervision.openshell.ai/v1alpha1", "kind": "SandboxPolicy",
            "metadata": {"name": name, "namespace": namespace, "generation": generation,
                         "creationTimestamp": created},
            "spec": {"enforcement": "enforce", "rules": rules},
        }))
    }

    fn pod(uid: &str, namespace: &str, policy: Option<&str>) -> Choice {
        Choice {
            uid: uid.to_owned(),
            namespace: namespace.to_owned(),
            policy: policy.map(str::to_owned),
        }
    }

    #[test]
    fn a_pod_runs_its_annotated_policy_else_the_default_else_deny_all() {
        let mut egress = Egress::default();
        egress.reset_pods([pod("a", "team-a", Some("models")), pod("b", "team-a", None)]);
        assert_eq!(egress.policy_for("a"), None, "no answer before the policies are listed");
        egress.reset_policies(
            [policy_of(&policy(
                "team-a",
                "models",
                "2026-01-01T00:00:00Z",
                1,
                &["api.example.com"],
            ))]
            .into_iter()
            .flatten(),
        );
        let models = egress.policy_for("a").expect("listed");
        assert_eq!(
            (models.name.as_str(), models.rules[0].host.as_str()),
            ("models", "api.example.com")
        );
        assert_eq!(
            egress.policy_for("b").map(|p| p.name.clone()).as_deref(),
            Some(DENY_ALL)
        );
        assert_eq!(
            egress.policy_for("unseen"),
            None,
            "a Pod not seen yet keeps what it has"
        );

        let (ns, default) = policy_of(&policy("team-a", "default", "2026-01-01T00:00:00Z", 1, &[])).expect("valid");
        egress.apply_policy(ns, default);
        assert_eq!(
            egress.policy_for("b").map(|p| p.name.clone()).as_deref(),
            Some("default")
        );
        // Another namespace's policy of the same name is not this namespace's.
        egress.apply_pod(pod("c", "team-b", Some("models")));
        assert_eq!(
            egress.policy_for("c").map(|p| p.name.clone()).as_deref(),
            Some(DENY_ALL)
        );
        egress.delete_policy("team-a", "models");
        assert_eq!(
            egress.policy_for("a").map(|p| p.name.clone()).as_deref(),
            Some(DENY_ALL)
        );
    }

    #[test]
    fn revisions_move_forward_through_edits_and_a_policy_made_again() {
        let revision = |created: &str, generation: i64| {
            policy_of(&policy("ns", "p", created, generation, &["a.example"]))
                .expect("valid")
                .1
                .revision
        };
        let first = revision("2026-01-01T00:00:00Z", 1);
        let edited = revision("2026-01-01T00:00:00Z", 2);
        let made_again = revision("2026-01-01T00:00:01Z", 1);
        assert!(first < edited && edited < made_again, "{first} {edited} {made_again}");
    }

    #[test]
    fn a_pods_policy_carries_its_credentials_values_or_why_not() {
        let mut egress = Egress::default();
        egress.reset_pods([pod("a", "team-a", None)]);
        let bound = object(serde_json::json!({
            "apiVersion": "supervision.openshell.ai/v1alpha1", "kind": "SandboxPolicy",
            "metadata": {"name": "default", "namespace": "team-a", "generation": 1,
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"rules": [{"name": "m", "host": "m.example.com", "ports": [443], "credential": "k"}],
                     "credentials": [{"name": "k", "env": "K", "secretKeyRef": {"name": "models", "key": "token"}},
                                     {"name": "j", "secretKeyRef": {"name": "models", "key": "other"}}]},
        }));
        egress.reset_policies(policy_of(&bound));
        let wanted = egress.wanted_secrets();
        assert_eq!(
            wanted.get(&("team-a".to_owned(), "models".to_owned())),
            Some(&vec!["token".to_owned(), "other".to_owned()])
        );
        assert!(!egress.has_read(&wanted));
        let unread = egress.policy_for("a").expect("listed");
        assert!(unread.credentials[0].value.is_empty() && unread.credentials[0].error.contains("not been read"));

        let data = SecretData([("token".to_owned(), b"sk-1".to_vec())].into());
        assert!(!format!("{data:?}").contains("sk-1"), "values are never in Debug");
        let before = egress.version();
        egress.apply_secret("team-a".into(), "models".into(), Ok(data.clone()));
        assert!(egress.version() > before && egress.has_read(&wanted));
        let filled = egress.policy_for("a").expect("listed");
        assert_eq!(filled.credentials[0].value, b"sk-1");
        assert!(
            filled.credentials[1].error.contains("no key \"other\""),
            "{:?}",
            filled.credentials[1]
        );
        let again = egress.version();
        egress.apply_secret("team-a".into(), "models".into(), Ok(data));
        assert_eq!(egress.version(), again, "the same data again changes nothing");

        egress.apply_secret("team-a".into(), "models".into(), Err("forbidden".into()));
        assert_eq!(
            egress.policy_for("a").expect("listed").credentials[0].error,
            "forbidden"
        );
        egress.delete_policy("team-a", "default");
        egress.retain_secrets(&egress.wanted_secrets());
        assert!(egress.secrets.is_empty(), "a Secret no policy binds is forgotten");
    }

    #[test]
    fn a_change_moves_the_version_and_a_repeat_does_not() {
        let mut egress = Egress::default();
        egress.reset_pods([]);
        let before = egress.version();
        egress.apply_pod(pod("a", "ns", None));
        let after = egress.version();
        egress.apply_pod(pod("a", "ns", None));
        assert!(before < after && after == egress.version());
    }
}
