//! The credential placeholders of every `SandboxPolicy`, as the webhook sets them in workload
//! containers: a credential with an `env` gives every workload container of a Pod that runs the
//! policy the variable `env=openshell-placeholder-<name>`. Followed by a watch of the policies
//! (which hold no secret: the webhook may list and watch them, nothing else), kept as plain
//! data and read at admission without waiting on the API.
//!
//! A Pod runs the policy its annotation [`POLICY_ANNOTATION`] names, else its namespace's
//! policy [`DEFAULT_POLICY`]; the gateway decides the same way.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use futures::StreamExt as _;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, ResourceExt as _};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

pub use proto::kubernetes::{DEFAULT_POLICY, POLICY_ANNOTATION};

/// One variable a policy's credential asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placeholder {
    pub env: String,
    pub value: String,
}

/// What is known of a policy at admission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The policies have not been listed yet (the webhook just started, or cannot reach the
    /// API server).
    NotListed,
    /// The variables the policy asks for (none when it does not exist).
    Listed(Vec<Placeholder>),
}

#[derive(Debug, Default)]
struct Known {
    listed: bool,
    by_policy: HashMap<(String, String), Vec<Placeholder>>,
}

/// The placeholders by policy, shared by the watch (writer) and the injectors (readers).
#[derive(Debug, Clone, Default)]
pub struct Policies(Arc<RwLock<Known>>);

impl Policies {
    /// The variables of the policy `name` of `namespace`.
    pub fn lookup(&self, namespace: &str, name: &str) -> Lookup {
        let known = self.0.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !known.listed {
            return Lookup::NotListed;
        }
        let key = (namespace.to_owned(), name.to_owned());
        Lookup::Listed(known.by_policy.get(&key).cloned().unwrap_or_default())
    }

    fn change(&self, f: impl FnOnce(&mut Known)) {
        f(&mut self.0.write().unwrap_or_else(|poisoned| poisoned.into_inner()));
    }

    pub fn apply(&self, object: &DynamicObject) {
        if let Some((key, placeholders)) = placeholders_of(object) {
            self.change(|known| {
                known.by_policy.insert(key, placeholders);
            });
        }
    }

    pub fn delete(&self, object: &DynamicObject) {
        if let (Some(namespace), Some(name)) = (object.namespace(), object.metadata.name.clone()) {
            self.change(|known| {
                known.by_policy.remove(&(namespace, name));
            });
        }
    }

    pub fn reset<'a>(&self, all: impl IntoIterator<Item = &'a DynamicObject>) {
        let by_policy = all.into_iter().filter_map(placeholders_of).collect();
        self.change(|known| {
            known.by_policy = by_policy;
            known.listed = true;
        });
    }
}

#[derive(Deserialize)]
struct Spec {
    #[serde(default)]
    credentials: Vec<Credential>,
}

#[derive(Deserialize)]
struct Credential {
    name: String,
    #[serde(default)]
    env: String,
}

fn placeholders_of(object: &DynamicObject) -> Option<((String, String), Vec<Placeholder>)> {
    let key = (object.namespace()?, object.metadata.name.clone()?);
    let spec = Spec::deserialize(object.data.get("spec")?).ok()?;
    let placeholders = spec
        .credentials
        .into_iter()
        .filter(|c| !c.env.is_empty())
        .map(|c| Placeholder {
            value: proto::egress::placeholder(&c.name),
            env: c.env,
        })
        .collect();
    Some((key, placeholders))
}

/// The `SandboxPolicy` resource.
fn resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("supervision.openshell.ai", "v1alpha1", "SandboxPolicy"),
        "sandboxpolicies",
    )
}

/// Follows every namespace's policies into `policies` until `shutdown` (kube-runtime's watcher:
/// re-list on expiry, backoff on errors).
pub async fn follow(client: Client, policies: Policies, shutdown: CancellationToken) {
    let api = Api::<DynamicObject>::all_with(client, &resource());
    let mut events = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff());
    let mut listing = Vec::new();
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return,
            event = events.next() => event,
        };
        match event {
            None => return,
            Some(Err(err)) => tracing::warn!(error = %err, "watching SandboxPolicies"),
            Some(Ok(watcher::Event::Apply(object))) => policies.apply(&object),
            Some(Ok(watcher::Event::Delete(object))) => policies.delete(&object),
            Some(Ok(watcher::Event::Init)) => listing.clear(),
            Some(Ok(watcher::Event::InitApply(object))) => listing.push(object),
            Some(Ok(watcher::Event::InitDone)) => policies.reset(listing.drain(..).as_slice()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(namespace: &str, name: &str, credentials: serde_json::Value) -> DynamicObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "supervision.openshell.ai/v1alpha1", "kind": "SandboxPolicy",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"credentials": credentials},
        }))
        .expect("an object")
    }

    #[test]
    fn a_policys_credentials_with_an_env_become_placeholders() {
        let policies = Policies::default();
        assert_eq!(policies.lookup("team-a", "default"), Lookup::NotListed);
        let default = policy(
            "team-a",
            "default",
            serde_json::json!([
                {"name": "models", "env": "MODELS_API_KEY", "secretKeyRef": {"name": "s", "key": "k"}},
                {"name": "quiet", "secretKeyRef": {"name": "s", "key": "k"}},
            ]),
        );
        policies.reset([&default]);
        assert_eq!(
            policies.lookup("team-a", "default"),
            Lookup::Listed(vec![Placeholder {
                env: "MODELS_API_KEY".into(),
                value: "openshell-placeholder-models".into()
            }])
        );
        assert_eq!(policies.lookup("team-b", "default"), Lookup::Listed(Vec::new()));
        policies.delete(&default);
        assert_eq!(policies.lookup("team-a", "default"), Lookup::Listed(Vec::new()));
    }
}
