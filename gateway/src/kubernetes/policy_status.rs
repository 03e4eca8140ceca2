//! The `SandboxPolicy` objects' status: for each policy, the revision the gateway derives from
//! it, how many supervised Pods run it, how many of them have that revision loaded in their
//! sidecar (and how many each other revision), and the Pods whose sidecar refused an install
//! and why; and for each credential whether the pool holds its value, and why not. Pure: a function of the [`Egress`] index and the pool view's instances and
//! reports (each owner relays its sidecar's answer, `host.v1 InstanceStatus.egress_policy`);
//! [`super::policy_writer`] applies it.

use std::collections::BTreeMap;

use serde::Serialize;

use super::egress::Egress;
use crate::pool::View;

/// At most this many refusing Pods are listed in one policy's status (all are counted).
pub const MAX_FAILED: usize = 16;

/// `.status` of a `SandboxPolicy`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyStatus {
    /// The revision owners install now (`metadata.generation` and the creation time).
    pub revision: i64,
    /// Registered Pods that run this policy.
    pub pods: u32,
    /// Of them, those whose sidecar enforces `revision`.
    pub loaded: u32,
    /// Pods by the revision of this policy their sidecar enforces, newest first (a Pod whose
    /// sidecar answered nothing yet is in none).
    pub revisions: Vec<Loaded>,
    /// Pods whose sidecar refused the last install, counted.
    pub failed: u32,
    /// The first [`MAX_FAILED`] of them, by name, with the sidecar's reason.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<Failure>,
    /// Each credential: whether the pool holds its value, and why not (never the value).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub credentials: Vec<CredentialState>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CredentialState {
    pub name: String,
    pub held: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Loaded {
    pub revision: i64,
    pub pods: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Failure {
    pub pod: String,
    pub reason: String,
}

/// The status of every existing policy, by namespace and name; empty until the policies and
/// the Pods are listed (a status counted from half the Pods would be wrong).
pub fn desired(egress: &Egress, view: &View) -> BTreeMap<(String, String), PolicyStatus> {
    if !egress.listed() {
        return BTreeMap::new();
    }
    let mut out: BTreeMap<(String, String), PolicyStatus> = egress
        .policies()
        .map(|(key, policy)| {
            let credentials = policy
                .credentials
                .iter()
                .map(|binding| {
                    let reason = egress.value_of(&key.0, binding).err();
                    CredentialState {
                        name: binding.name.clone(),
                        held: reason.is_none(),
                        reason,
                    }
                })
                .collect();
            let status = PolicyStatus {
                revision: i64::try_from(policy.revision).unwrap_or(i64::MAX),
                credentials,
                ..PolicyStatus::default()
            };
            (key.clone(), status)
        })
        .collect();
    let mut by_revision: BTreeMap<(String, String), BTreeMap<i64, u32>> = BTreeMap::new();
    for (route, instance) in view.instances.iter() {
        if instance.withdrawn {
            continue;
        }
        let Some((namespace, name)) = egress.chosen(&instance.uid) else {
            continue;
        };
        let key = (namespace.to_owned(), name.to_owned());
        let Some(status) = out.get_mut(&key) else {
            continue;
        };
        status.pods += 1;
        let Some(answer) = view.reports.get(route).and_then(|r| r.policy.as_ref()) else {
            continue;
        };
        if !answer.error.is_empty() {
            status.failed += 1;
            if status.failures.len() < MAX_FAILED {
                status.failures.push(Failure {
                    pod: instance.name.clone(),
                    reason: answer.error.clone(),
                });
            }
        }
        if answer.name == name {
            *by_revision.entry(key).or_default().entry(answer.revision).or_default() += 1;
        }
    }
    for (key, counts) in by_revision {
        if let Some(status) = out.get_mut(&key) {
            status.loaded = counts.get(&status.revision).copied().unwrap_or(0);
            status.revisions = counts
                .into_iter()
                .rev()
                .map(|(revision, pods)| Loaded { revision, pods })
                .collect();
        }
    }
    for status in out.values_mut() {
        status.failures.sort_by(|a, b| a.pod.cmp(&b.pod));
    }
    out
}

#[cfg(test)]
mod tests {
    use kube::api::DynamicObject;

    use super::*;
    use crate::kubernetes::egress::{Choice, policy_of};
    use crate::kubernetes::pool_status::tests::view;
    use crate::store::LoadedPolicy;

    fn policy(name: &str, generation: i64) -> (String, std::sync::Arc<proto::runtime::v1::EgressPolicy>) {
        let object: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "supervision.openshell.ai/v1alpha1", "kind": "SandboxPolicy",
            "metadata": {"name": name, "namespace": "ns", "generation": generation,
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"rules": []},
        }))
        .expect("an object");
        policy_of(&object).expect("a policy")
    }

    fn answered(v: &mut View, route: &str, name: &str, revision: u64, error: &str) {
        let mut report = v.reports[route].clone();
        report.policy = Some(LoadedPolicy {
            name: name.into(),
            revision: i64::try_from(revision).expect("small"),
            error: error.into(),
        });
        v.reports.insert(route.into(), report);
    }

    /// r1 and r2 run `default` (r1 at the current revision, r2 at the one before), r3 names
    /// `models`, whose install its sidecar refused; no status before both lists.
    #[test]
    fn each_policy_counts_its_pods_by_the_revision_their_sidecars_enforce() {
        let mut egress = Egress::default();
        let mut v = view();
        assert!(desired(&egress, &v).is_empty(), "nothing listed yet");
        let (_, old) = policy("default", 1);
        let (ns, default) = policy("default", 2);
        let (_, models) = policy("models", 1);
        egress.reset_policies([(ns.clone(), default.clone()), (ns, models.clone())]);
        egress.reset_pods(["r1", "r2", "r3"].map(|r| Choice {
            uid: format!("uid-{r}"),
            namespace: "ns".into(),
            policy: (r == "r3").then(|| "models".to_owned()),
        }));
        let status = desired(&egress, &v);
        let of = |name: &str| status[&("ns".to_owned(), name.to_owned())].clone();
        assert_eq!(
            (of("default").pods, of("default").loaded),
            (2, 0),
            "nothing answered yet"
        );
        assert!(of("default").revisions.is_empty());

        answered(&mut v, "r1", "default", default.revision, "");
        answered(&mut v, "r2", "default", old.revision, "");
        answered(&mut v, "r3", "<none>", 1, "the policy's rule 0 names no port");
        let status = desired(&egress, &v);
        let of = |name: &str| status[&("ns".to_owned(), name.to_owned())].clone();
        let current = i64::try_from(default.revision).expect("small");
        assert_eq!(of("default").revision, current);
        assert_eq!(
            (of("default").pods, of("default").loaded, of("default").failed),
            (1 + 1, 1, 0)
        );
        assert_eq!(
            of("default").revisions,
            [
                Loaded {
                    revision: current,
                    pods: 1
                },
                Loaded {
                    revision: current - 1,
                    pods: 1
                }
            ]
        );
        let models = of("models");
        assert_eq!((models.pods, models.loaded, models.failed), (1, 0, 1));
        assert_eq!(
            models.failures,
            [Failure {
                pod: "r3".into(),
                reason: "the policy's rule 0 names no port".into()
            }]
        );

        // A withdrawn instance is no Pod of the policy.
        let mut r2 = v.instances["r2"].clone();
        r2.withdrawn = true;
        v.instances.insert("r2".into(), r2);
        let default = desired(&egress, &v)[&("ns".to_owned(), "default".to_owned())].clone();
        assert_eq!((default.pods, default.loaded, default.revisions.len()), (1, 1, 1));
    }
}

#[cfg(test)]
mod credential_tests {
    use kube::api::DynamicObject;

    use super::*;
    use crate::kubernetes::egress::{SecretData, policy_of};
    use crate::kubernetes::pool_status::tests::view;

    #[test]
    fn each_credential_shows_whether_the_pool_holds_it_and_never_its_value() {
        let object: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "supervision.openshell.ai/v1alpha1", "kind": "SandboxPolicy",
            "metadata": {"name": "default", "namespace": "ns", "generation": 1,
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"credentials": [
                {"name": "models", "secretKeyRef": {"name": "models", "key": "token"}},
                {"name": "search", "secretKeyRef": {"name": "search", "key": "token"}}]},
        }))
        .expect("an object");
        let mut egress = Egress::default();
        egress.reset_policies(policy_of(&object));
        egress.reset_pods([]);
        egress.apply_secret(
            "ns".into(),
            "models".into(),
            Ok(SecretData([("token".to_owned(), b"sk-1".to_vec())].into())),
        );
        egress.apply_secret("ns".into(), "search".into(), Err("the pool may not read it".into()));
        let status = desired(&egress, &view())[&("ns".to_owned(), "default".to_owned())].clone();
        assert_eq!(
            status.credentials,
            [
                CredentialState {
                    name: "models".into(),
                    held: true,
                    reason: None
                },
                CredentialState {
                    name: "search".into(),
                    held: false,
                    reason: Some("the pool may not read it".into())
                }
            ]
        );
        assert!(!serde_json::to_string(&status).expect("json").contains("sk-1"));
    }
}
