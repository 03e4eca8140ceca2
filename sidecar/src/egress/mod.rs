//! Egress: the sidecar is the workload's way out. [`policy`] is the installed revision and its
//! decisions, [`floor`] what no revision opens, [`proxy`] the forward proxy that applies both,
//! [`redirect`] the same decisions for connections the Pod's network rules redirect here.
//! The revision comes from the activated owner (`PolicyInstall` on the runtime stream, fenced
//! by the term like every control message) and is kept in the sidecar's persisted state, so
//! decisions go on unchanged while the owner changes.

pub mod audit;
mod decision;
pub mod floor;
pub mod origin;
pub mod placeholder;
pub mod policy;
pub mod proxy;
pub mod recent;
pub mod redirect;
pub mod rules;
mod splice;

use std::net::SocketAddr;
use std::sync::Arc;

pub use floor::Floor;
pub use policy::Policy;
pub use proxy::{Egress, Installed, Limits};
pub use recent::Recent;
use serde_json::{Value, json};

/// What the workload may read of its egress (`{"op":"policy"}` on its socket): where the
/// proxy is, the revision in force, and its recent denials, so an agent can explain a refusal.
#[derive(Clone, Debug)]
pub struct View {
    /// The proxy's address (`None`: the Pod's connections reach the sidecar only by
    /// redirection).
    pub proxy: Option<SocketAddr>,
    /// The redirect listener's address, under egress redirection.
    pub redirect: Option<SocketAddr>,
    pub installed: Installed,
    pub recent: Arc<Recent>,
}

impl View {
    /// The answer to `{"op":"policy"}` (`view` `None`: this sidecar runs no proxy).
    pub fn describe(view: Option<&View>) -> Value {
        let Some(view) = view else {
            return json!({"ok": true, "op": "policy", "proxy": null, "policy": null});
        };
        let policy = view.installed.borrow().clone();
        json!({
            "ok": true,
            "op": "policy",
            "proxy": view.proxy.map(|p| format!("http://{p}")),
            "redirect": view.redirect.map(|r| r.to_string()),
            "policy": policy.as_ref().map(|p| json!({
                "name": p.name,
                "revision": p.revision,
                "enforcement": if p.audit_only { "audit" } else { "enforce" },
                "rules": p.rules.iter().map(|r| &r.name).collect::<Vec<_>>(),
                "credentials": p.credentials.iter().map(|c| json!({
                    "name": c.name,
                    "env": c.env,
                    "placeholder": c.placeholder,
                    "held": c.value.is_some(),
                    "error": Some(&c.error).filter(|e| !e.is_empty() && c.value.is_none()),
                    "boundTo": p.rules.iter()
                        .filter(|r| r.credential.as_deref() == Some(c.name.as_str()))
                        .map(|r| &r.name)
                        .collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            })),
            "recentDenials": view.recent.list(),
        })
    }
}

/// What the proxy and the redirect listener decide with in tests: one rule, `host` on `port`,
/// with `floor` and `limits`, and no dialer.
#[cfg(test)]
pub(crate) fn one_rule(host: &str, port: u16, floor: Floor, limits: Limits) -> Egress {
    let policy = proto::runtime::v1::EgressPolicy {
        name: "p".into(),
        revision: 1,
        rules: vec![proto::runtime::v1::EgressRule {
            name: "only".into(),
            host: host.into(),
            ports: vec![u32::from(port)],
            ..Default::default()
        }],
        ..Default::default()
    };
    let policy = Policy::try_from(&policy).expect("valid");
    // The sender is dropped: the revision never changes.
    let (_installed, installed) = tokio::sync::watch::channel(Some(Arc::new(policy)));
    Egress {
        installed,
        floor: Arc::new(floor),
        limits,
        recent: Arc::default(),
        dialer: None,
        audit: audit::Recorder::default(),
    }
}
