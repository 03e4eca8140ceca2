//! The Pod condition [`CONDITION`] (`supervision.openshell.ai/Supervised`): what each Pod of a
//! labelled namespace says of its supervision, as the coordinator sees it. `True` only while a
//! live owner serves the workload at its current term and has identified its process; `False`
//! with the reason otherwise (recovering, not placed, workload not identified, finished,
//! admitted without supervision). Pure over the index and the pool view; the writer patches it
//! onto the Pods whose condition changed.
//!
//! It is not a readiness gate: a recovery in progress sets it `False` for a moment and never
//! takes the Pod out of its Services (the kubelet's `Ready` alone decides that). Users see it
//! with `kubectl get pods -o custom-columns=…` or wait on it with `kubectl wait
//! --for=condition=supervision.openshell.ai/Supervised`.

use std::collections::BTreeMap;

use proto::common::v1::InstancePhase;

use super::index::{Index, Pod};
use crate::pool::View;
use crate::store::{AssignmentPhase, InstanceRecord};

/// The condition type.
pub const CONDITION: &str = "supervision.openshell.ai/Supervised";

/// One Pod's condition, without its transition time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Supervised {
    pub status: bool,
    pub reason: &'static str,
    pub message: String,
}

impl Supervised {
    fn no(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: false,
            reason,
            message: message.into(),
        }
    }

    /// Whether `other` is the same condition for the Pod's readers (the message may move
    /// with every term: a new term is a new message, not a new condition).
    pub fn same_as(&self, other: &Self) -> bool {
        self.status == other.status && self.reason == other.reason
    }
}

/// How long an owner may serve an instance without an identified workload process before the
/// pool counts its Pod unsupervised: a workload that talks to its socket connects moments
/// after it starts, and in a Pod the sidecar finds a silent one in the PID namespace.
pub const UNIDENTIFIED_GRACE_MS: i64 = 30_000;

/// The reason code the pool counts such a Pod under: served, but with no workload process
/// identified nothing can stop or vouch for the workload.
pub const NOT_IDENTIFIED: &str = "workload_not_identified";

/// The reason codes of the Pods the pool counts unsupervised: those of labelled namespaces the
/// webhook admitted without supervision, and those an owner has served for
/// [`UNIDENTIFIED_GRACE_MS`] without an identified workload process.
pub fn unsupervised_reasons<'a>(index: &'a Index, view: &View) -> Vec<&'a str> {
    let mut reasons: Vec<&str> = index.unsupervised_labelled().map(|p| p.reason.as_str()).collect();
    let served_unidentified = view.instances.values().filter(|i| {
        !i.withdrawn
            && index.has_pod(&i.uid)
            && !index.finished().contains(&i.uid)
            && index.is_labelled(&i.namespace)
            && view.current_assignment(&i.route).is_some_and(|a| {
                a.phase == AssignmentPhase::Active
                    && view.now_ms.saturating_sub(a.updated_at_ms) >= UNIDENTIFIED_GRACE_MS
                    && of_instance(view, Some(i)).reason == "WorkloadNotIdentified"
            })
    });
    reasons.extend(served_unidentified.map(|_| NOT_IDENTIFIED));
    reasons
}

/// The condition every Pod the index knows of should carry, by UID.
pub fn desired(index: &Index, view: &View) -> BTreeMap<String, (Pod, Supervised)> {
    let by_uid: BTreeMap<&str, &InstanceRecord> = view
        .instances
        .values()
        .filter(|i| !i.uid.is_empty())
        .map(|i| (i.uid.as_str(), i))
        .collect();
    let mut out = BTreeMap::new();
    for pod in index.pods() {
        let condition = if index.finished().contains(&pod.uid) {
            Supervised::no("Finished", "the Pod finished: nothing is left to supervise")
        } else {
            of_instance(view, by_uid.get(pod.uid.as_str()).copied())
        };
        out.insert(pod.uid.clone(), (pod.clone(), condition));
    }
    for pod in index.unsupervised_labelled() {
        let condition = Supervised::no(
            "NotSupervised",
            format!("admitted without supervision ({}): {}", pod.reason, pod.message),
        );
        out.insert(pod.pod.uid.clone(), (pod.pod.clone(), condition));
    }
    out
}

/// The condition of a supervised Pod whose instance (of its UID) is `instance`.
fn of_instance(view: &View, instance: Option<&InstanceRecord>) -> Supervised {
    let Some(instance) = instance else {
        return Supervised::no("NotRegistered", "its sidecar has not registered the workload yet");
    };
    if instance.withdrawn {
        return Supervised::no(
            "Withdrawn",
            "the instance was withdrawn (its sidecar stopped the workload, or it deregistered)",
        );
    }
    let Some(a) = view.current_assignment(&instance.route) else {
        return Supervised::no("NotPlaced", "no member has taken the instance yet");
    };
    if !view.is_live(&a.member, &a.process_id) {
        return Supervised::no(
            "Recovering",
            format!("its owner {} is gone; another member takes it over", a.member),
        );
    }
    if a.phase != AssignmentPhase::Active {
        return Supervised::no(
            "Moving",
            format!("member {} takes the instance over (term {})", a.member, a.term),
        );
    }
    let Some(report) = view.reports.get(&instance.route).filter(|r| r.term == a.term) else {
        return Supervised::no(
            "Starting",
            format!("member {} is taking the instance (term {})", a.member, a.term),
        );
    };
    match report.phase.wire() {
        Some(InstancePhase::Active) if report.workload_pid > 0 => Supervised {
            status: true,
            reason: "Supervised",
            message: format!(
                "member {} serves the workload (pid {}) at term {}",
                a.member, report.workload_pid, a.term
            ),
        },
        Some(InstancePhase::Active) => Supervised::no(
            "WorkloadNotIdentified",
            format!(
                "member {} serves the instance, but no workload process has connected to the sidecar's socket",
                a.member
            ),
        ),
        Some(InstancePhase::Starting) => Supervised::no(
            "Starting",
            format!("member {} is taking the instance (term {})", a.member, a.term),
        ),
        Some(InstancePhase::Recovering) => Supervised::no(
            "Recovering",
            format!("member {} re-establishes the sidecar's stream", a.member),
        ),
        Some(other) => Supervised::no(
            "NotActive",
            format!("member {} reports the instance {}", a.member, other.as_str_name()),
        ),
        None => Supervised::no(
            "NotActive",
            format!("member {} does not host the instance at term {}", a.member, a.term),
        ),
    }
}

/// The strategic-merge patch of a Pod's status that sets the condition (merged by type with
/// the kubelet's own), `since` its `lastTransitionTime`. The Pod's UID is a precondition: a
/// Pod recreated under the name is not touched (409).
pub fn patch(pod: &Pod, condition: &Supervised, since: &str) -> serde_json::Value {
    serde_json::json!({
        "metadata": { "uid": pod.uid },
        "status": {
            "conditions": [{
                "type": CONDITION,
                "status": if condition.status { "True" } else { "False" },
                "reason": condition.reason,
                "message": plumbing::text::bounded(&condition.message, 1024),
                "lastTransitionTime": since,
            }]
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubernetes::index::Unsupervised;
    use crate::kubernetes::pool_status::tests::view;

    fn pods_of(view: &View) -> Index {
        let mut index = Index::default();
        index.reset_pods(view.instances.values().map(|i| Pod {
            namespace: i.namespace.clone(),
            name: i.name.clone(),
            uid: i.uid.clone(),
        }));
        index
    }

    fn reason_of(view: &View, index: &Index, route: &str) -> (bool, &'static str) {
        let uid = &view.instances[route].uid;
        let (_, c) = &desired(index, view)[uid];
        (c.status, c.reason)
    }

    #[test]
    fn true_only_while_a_live_owner_serves_an_identified_workload() {
        let mut v = view();
        let index = pods_of(&v);
        v.reports.get_mut("r1").unwrap().workload_pid = 42;
        assert_eq!(reason_of(&v, &index, "r1"), (true, "Supervised"));
        v.reports.get_mut("r2").unwrap().workload_pid = 0;
        assert_eq!(reason_of(&v, &index, "r2"), (false, "WorkloadNotIdentified"));
        // The owner of r1 dies: recovering, not supervised, until another member serves it.
        v.members.get_mut("a").unwrap().expires_at_ms = v.now_ms - 60_000;
        assert_eq!(reason_of(&v, &index, "r1"), (false, "Recovering"));
        v.instances.get_mut("r3").unwrap().withdrawn = true;
        assert_eq!(reason_of(&v, &index, "r3"), (false, "Withdrawn"));
    }

    /// A Pod its owner serves without an identified workload cannot be stopped or vouched for:
    /// the pool counts it unsupervised once the grace has passed, only in labelled namespaces,
    /// and never once the workload is identified or the Pod finished.
    #[test]
    fn a_pod_served_without_an_identified_workload_counts_as_unsupervised_after_the_grace() {
        let mut v = view();
        let mut index = pods_of(&v);
        for r in ["r1", "r2", "r3"] {
            v.reports.get_mut(r).unwrap().workload_pid = 42;
            v.assignments.get_mut(r).unwrap().updated_at_ms = v.now_ms - UNIDENTIFIED_GRACE_MS;
        }
        v.reports.get_mut("r2").unwrap().workload_pid = 0;
        assert!(unsupervised_reasons(&index, &v).is_empty(), "not a labelled namespace");
        index.apply_namespace("ns");
        assert_eq!(unsupervised_reasons(&index, &v), vec![NOT_IDENTIFIED]);
        // Within the grace (just activated): not yet.
        v.assignments.get_mut("r2").unwrap().updated_at_ms = v.now_ms - UNIDENTIFIED_GRACE_MS + 1;
        assert!(unsupervised_reasons(&index, &v).is_empty());
        v.assignments.get_mut("r2").unwrap().updated_at_ms = v.now_ms - UNIDENTIFIED_GRACE_MS;
        let served = &v.instances["r2"];
        index.apply_finished(Pod {
            namespace: served.namespace.clone(),
            name: served.name.clone(),
            uid: served.uid.clone(),
        });
        assert!(unsupervised_reasons(&index, &v).is_empty(), "a finished Pod");
    }

    #[test]
    fn finished_unregistered_and_unsupervised_pods_say_why() {
        let v = view();
        let mut index = pods_of(&v);
        let extra = Pod {
            namespace: "team-a".into(),
            name: "new".into(),
            uid: "uid-new".into(),
        };
        index.apply_pod(extra.clone());
        let finished = &v.instances["r1"];
        index.apply_finished(Pod {
            namespace: finished.namespace.clone(),
            name: finished.name.clone(),
            uid: finished.uid.clone(),
        });
        index.apply_unsupervised(Unsupervised {
            pod: Pod {
                uid: "uid-root".into(),
                ..extra.clone()
            },
            reason: "runs_as_root".into(),
            message: "container \"app\" runs as root".into(),
        });
        assert!(
            !desired(&index, &v).contains_key("uid-root"),
            "a label on a Pod of a namespace that is not labelled counts for nothing"
        );
        index.apply_namespace("team-a");
        let all = desired(&index, &v);
        assert_eq!(all["uid-new"].1.reason, "NotRegistered");
        assert_eq!(all[&finished.uid].1.reason, "Finished");
        let (_, root) = &all["uid-root"];
        assert_eq!((root.status, root.reason), (false, "NotSupervised"));
        assert!(root.message.contains("runs as root"));
    }
}
