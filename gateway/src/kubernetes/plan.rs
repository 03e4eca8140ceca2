//! The coordinator's decisions about the cluster, as plain data: which token Secrets to
//! write or remove, and which instances lost their Pod. Pure over the index, the pool view
//! and what was delivered; the writer carries them out.

use std::path::PathBuf;
use std::time::Duration;

use proto::timing::UNSEEN_POD_GRACE;

use super::index::Index;
use crate::credentials::Target;
use crate::pool::View;

/// Secret of every labelled namespace, mounted read-only by the injected sidecars.
pub use proto::kubernetes::TOKEN_SECRET as NAMESPACE_SECRET;
/// Secret of the install namespace mounted by the supervisor Pods.
pub const SUPERVISOR_SECRET: &str = "openshell-supervisor-token";
/// Secret of the install namespace holding an operator (platform admin) token.
pub const OPERATOR_SECRET: &str = "openshell-operator-token";
/// Namespaces the gateway never writes into, whatever their labels say.
pub use proto::kubernetes::SYSTEM_NAMESPACES;

/// One intended write.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Write {
    /// Write Secret `name` in `namespace` with a fresh token for `target`.
    Secret {
        namespace: String,
        name: &'static str,
        target: Target,
    },
    /// Remove the token Secret of a namespace that is no longer labelled.
    RemoveSecret { namespace: String },
    /// The instance's Pod is gone, or finished: it is no longer desired.
    Withdraw { route: String, uid: String, cause: Cause },
}

/// Why an instance is withdrawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    /// The Pod watch has not had its Pod for [`Scope::unseen_pod_grace`].
    PodGone,
    /// Its Pod finished (phase `Succeeded` or `Failed`): the workload ended and will not run
    /// again, so there is nothing to recover.
    PodFinished,
}

/// What the writer has delivered so far: per target, whether it is due again.
pub trait Due {
    fn is_due(&self, target: &Target) -> bool;
}

impl<F: Fn(&Target) -> bool> Due for F {
    fn is_due(&self, target: &Target) -> bool {
        self(target)
    }
}

/// Where the pool runs.
#[derive(Debug, Clone)]
pub struct Scope {
    pub install_namespace: String,
    /// How long a registered instance may be missing from the Pod watch
    /// ([`UNSEEN_POD_GRACE`] by default).
    pub unseen_pod_grace: Duration,
    /// CA bundle delivered as `ca.crt` in every token Secret.
    pub ca_file: Option<PathBuf>,
}

impl Scope {
    pub fn new(install_namespace: impl Into<String>) -> Self {
        Self {
            install_namespace: install_namespace.into(),
            unseen_pod_grace: UNSEEN_POD_GRACE,
            ca_file: None,
        }
    }
}

impl Scope {
    /// Whether sidecars of `namespace` may get a token.
    pub fn admits(&self, namespace: &str) -> bool {
        namespace != self.install_namespace && !SYSTEM_NAMESPACES.contains(&namespace)
    }
}

/// The writes that bring the cluster in line with `index` and `view`.
pub fn plan(scope: &Scope, index: &Index, view: &View, due: &impl Due) -> Vec<Write> {
    let mut writes = Vec::new();
    let install = &scope.install_namespace;
    for (target, name) in [
        (Target::Supervisor, SUPERVISOR_SECRET),
        (Target::Operator, OPERATOR_SECRET),
    ] {
        if due.is_due(&target) {
            writes.push(Write::Secret {
                namespace: install.clone(),
                name,
                target,
            });
        }
    }
    // A terminating namespace is never in `labelled` nor `unlabelled`: it is gone. A Secret
    // deleted by hand, or a namespace labelled again after its Secret went with the label,
    // gets its Secret now, not when the last token would have been renewed.
    for namespace in index.labelled().iter().filter(|ns| scope.admits(ns)) {
        let target = Target::Namespace(namespace.clone());
        if due.is_due(&target) || index.needs_secret(namespace) {
            writes.push(Write::Secret {
                namespace: namespace.clone(),
                name: NAMESPACE_SECRET,
                target,
            });
        }
    }
    for namespace in index.unlabelled().iter().filter(|ns| scope.admits(ns)) {
        writes.push(Write::RemoveSecret {
            namespace: namespace.clone(),
        });
    }
    writes.extend(orphans(index, view, scope.unseen_pod_grace));
    writes.extend(finished(index, view));
    writes
}

/// Desired instances whose Pod finished: withdrawn at once (a finished Pod is proof enough,
/// no grace and no completed list needed).
fn finished(index: &Index, view: &View) -> Vec<Write> {
    view.instances
        .values()
        .filter(|i| !i.withdrawn && !i.uid.is_empty() && index.finished().contains(&i.uid))
        .map(|i| Write::Withdraw {
            route: i.route.clone(),
            uid: i.uid.clone(),
            cause: Cause::PodFinished,
        })
        .collect()
}

/// Desired instances whose Pod the (synced) Pod watch does not have, registered long enough
/// ago that the watch would have shown it.
fn orphans(index: &Index, view: &View, grace: Duration) -> Vec<Write> {
    if !index.pods_synced() || view.now_ms == 0 {
        return Vec::new();
    }
    let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
    view.instances
        .values()
        .filter(|i| !i.withdrawn && !i.uid.is_empty() && !index.has_pod(&i.uid))
        .filter(|i| !index.finished().contains(&i.uid))
        .filter(|i| view.now_ms.saturating_sub(i.registered_at_ms) >= grace_ms)
        .map(|i| Write::Withdraw {
            route: i.route.clone(),
            uid: i.uid.clone(),
            cause: Cause::PodGone,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubernetes::index::Pod;
    use crate::store::{InstanceRecord, OwnershipTerm, SecretBytes};

    fn scope() -> Scope {
        Scope::new("shared-supervision")
    }

    fn nothing_due(_: &Target) -> bool {
        false
    }

    fn all_due(_: &Target) -> bool {
        true
    }

    fn instance(route: &str, uid: &str, registered_at_ms: i64) -> InstanceRecord {
        InstanceRecord {
            route: route.into(),
            namespace: "team-a".into(),
            name: format!("agent-{route}"),
            uid: uid.into(),
            generation: 1,
            material: SecretBytes::default(),
            registered_at_ms,
            withdrawn: false,
            last_term: OwnershipTerm::new(0),
            withdrawn_reason: None,
            displaced: None,
            checkpointed: false,
            fence_holder: None,
        }
    }

    #[test]
    fn due_targets_get_their_secret_and_system_namespaces_never_do() {
        let mut index = Index::default();
        for ns in ["team-a", "kube-system", "shared-supervision"] {
            index.apply_namespace(ns);
        }
        let writes = plan(&scope(), &index, &View::default(), &all_due);
        assert_eq!(
            writes,
            [
                Write::Secret {
                    namespace: "shared-supervision".into(),
                    name: SUPERVISOR_SECRET,
                    target: Target::Supervisor
                },
                Write::Secret {
                    namespace: "shared-supervision".into(),
                    name: OPERATOR_SECRET,
                    target: Target::Operator
                },
                Write::Secret {
                    namespace: "team-a".into(),
                    name: NAMESPACE_SECRET,
                    target: Target::Namespace("team-a".into())
                },
            ]
        );
        // Once written, nothing is due until the token needs renewing.
        index.secret_written("team-a");
        assert!(plan(&scope(), &index, &View::default(), &nothing_due).is_empty());
    }

    #[test]
    fn a_terminating_namespace_gets_no_writes_at_all() {
        let mut index = Index::default();
        index.apply_namespace("team-a");
        index.apply_namespace("team-b");
        index.terminate_namespace("team-b");
        let writes = plan(&scope(), &index, &View::default(), &all_due);
        assert!(
            writes
                .iter()
                .all(|w| !matches!(w, Write::Secret { namespace, .. } | Write::RemoveSecret { namespace } if namespace == "team-b")),
            "{writes:?}"
        );
        assert!(
            writes
                .iter()
                .any(|w| matches!(w, Write::Secret { namespace, .. } if namespace == "team-a"))
        );
    }

    #[test]
    fn a_missing_secret_is_written_although_its_token_is_not_due() {
        let mut index = Index::default();
        index.apply_namespace("team-a");
        index.secret_written("team-a");
        assert!(plan(&scope(), &index, &View::default(), &nothing_due).is_empty());
        index.delete_secret("team-a");
        assert_eq!(
            plan(&scope(), &index, &View::default(), &nothing_due),
            [Write::Secret {
                namespace: "team-a".into(),
                name: NAMESPACE_SECRET,
                target: Target::Namespace("team-a".into())
            }]
        );
    }

    #[test]
    fn an_unlabelled_namespace_loses_its_secret() {
        let mut index = Index::default();
        index.apply_namespace("team-b");
        index.delete_namespace("team-b");
        let writes = plan(&scope(), &index, &View::default(), &nothing_due);
        assert_eq!(
            writes,
            [Write::RemoveSecret {
                namespace: "team-b".into()
            }]
        );
    }

    #[test]
    fn instances_without_a_pod_are_withdrawn_after_the_grace_only_once_synced() {
        let grace = i64::try_from(UNSEEN_POD_GRACE.as_millis()).unwrap_or(0);
        let mut view = View {
            now_ms: 100_000,
            ..View::default()
        };
        view.instances
            .insert("old".into(), instance("old", "uid-old", 100_000 - grace));
        view.instances
            .insert("new".into(), instance("new", "uid-new", 100_000 - 1));
        view.instances.insert("seen".into(), instance("seen", "uid-seen", 0));
        let mut gone = instance("gone", "uid-gone", 0);
        gone.withdrawn = true;
        view.instances.insert("gone".into(), gone);

        let mut index = Index::default();
        index.apply_pod(Pod {
            namespace: "team-a".into(),
            name: "agent-seen".into(),
            uid: "uid-seen".into(),
        });
        assert!(
            plan(&scope(), &index, &view, &nothing_due).is_empty(),
            "nothing is withdrawn before the first list completed"
        );
        let seen: Vec<Pod> = index.pods().cloned().collect();
        index.reset_pods(seen);
        assert_eq!(
            plan(&scope(), &index, &view, &nothing_due),
            [Write::Withdraw {
                route: "old".into(),
                uid: "uid-old".into(),
                cause: Cause::PodGone,
            }]
        );
    }

    #[test]
    fn an_instance_whose_pod_finished_is_withdrawn_at_once() {
        let mut view = View {
            now_ms: 1_000,
            ..View::default()
        };
        // Registered a moment ago, well within the grace of an unseen Pod.
        view.instances.insert("job".into(), instance("job", "uid-job", 900));
        view.instances.insert("live".into(), instance("live", "uid-live", 900));
        let mut index = Index::default();
        let job = Pod {
            namespace: "team-a".into(),
            name: "agent-job".into(),
            uid: "uid-job".into(),
        };
        index.apply_pod(job.clone());
        index.apply_pod(Pod {
            namespace: "team-a".into(),
            name: "agent-live".into(),
            uid: "uid-live".into(),
        });
        assert!(plan(&scope(), &index, &view, &nothing_due).is_empty());
        // Before any list completed: a finished Pod is proof enough.
        index.apply_finished(job);
        let finished = [Write::Withdraw {
            route: "job".into(),
            uid: "uid-job".into(),
            cause: Cause::PodFinished,
        }];
        assert_eq!(plan(&scope(), &index, &view, &nothing_due), finished);
        // Deleted later, long after: still withdrawn as finished, never twice.
        index.delete_pod("uid-job");
        index.reset_pods(index.pods().cloned().collect::<Vec<_>>());
        view.now_ms = 1_000_000;
        assert_eq!(plan(&scope(), &index, &view, &nothing_due), finished);
        if let Some(job) = view.instances.get_mut("job") {
            job.withdrawn = true;
        }
        assert!(plan(&scope(), &index, &view, &nothing_due).is_empty());
    }
}
