//! What users see of the pool in `kubectl get events`: the coordinator compares two
//! consecutive pool views and names what changed, on the object concerned (the workload's Pod
//! for an instance, the supervisor Pod for a member). Pure; the writer publishes them.
//!
//! Two recovery failures are told apart: [`REASON_RECOVERY_FAILED`] is the coordinator's
//! recover operation that missed its deadline (the instance stays desired), and
//! [`REASON_SUPERVISOR_RECOVERY_FAILED`] is the sidecar stopping the workload at its recovery
//! deadline because no supervisor took it over (the instance is withdrawn; the report may
//! reach any replica and comes here through the store).

use super::index::Unsupervised;
use crate::pool::View;
use crate::room;
use crate::store::{AssignmentPhase, InstanceRecord, OperationKind, OperationPhase, OwnershipTerm, WithdrawnReason};

pub const REASON_PLACED: &str = "InstancePlaced";
pub const REASON_RECOVERED: &str = "InstanceRecovered";
/// The coordinator's recover operation failed (its deadline passed).
pub const REASON_RECOVERY_FAILED: &str = "RecoveryFailed";
/// The sidecar stopped the workload at its recovery deadline: no supervisor took it over.
pub const REASON_SUPERVISOR_RECOVERY_FAILED: &str = "SupervisorRecoveryFailed";
/// No member can take the instance (placement's reason in the note).
pub const REASON_UNPLACEABLE: &str = "InstanceUnplaceable";
pub const REASON_MEMBER_JOINED: &str = "MemberJoined";
pub const REASON_MEMBER_LOST: &str = "MemberLost";
pub const REASON_MEMBER_LEFT: &str = "MemberLeft";
/// The same Pod registered the next generation: its workload's container restarted.
pub const REASON_WORKLOAD_RESTARTED: &str = "WorkloadRestarted";
/// The workload's Pod finished: its instance left the pool.
pub const REASON_WORKLOAD_FINISHED: &str = "WorkloadFinished";
/// The webhook admitted the Pod without supervision (the note says why).
pub const REASON_NOT_SUPERVISED: &str = "NotSupervised";

/// The object an event is about: always a Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Regarding {
    pub namespace: String,
    pub name: String,
    /// Workload Pods: from their registration. Supervisor Pods: filled in by the writer from
    /// the watch of the install namespace's supervisor Pods.
    pub uid: Option<String>,
}

/// One event to record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    pub regarding: Regarding,
    /// The member an instance event involves (its supervisor Pod): Kubernetes' `related`.
    /// Repeats of an event count as one series only for the same regarding, reason and
    /// related object, so a recovery by another member is a new Event with its own note.
    pub related: Option<Regarding>,
    pub warning: bool,
    pub reason: &'static str,
    pub action: &'static str,
    pub note: String,
}

/// The events between `before` and `after`. Members are Pods of `install_namespace` named
/// by their member name.
pub fn diff(before: &View, after: &View, install_namespace: &str) -> Vec<Notice> {
    let mut notices = Vec::new();
    members(before, after, install_namespace, &mut notices);
    assignments(before, after, install_namespace, &mut notices);
    failed_recoveries(before, after, &mut notices);
    stopped_at_the_deadline(before, after, install_namespace, &mut notices);
    unplaceable(before, after, &mut notices);
    restarted(before, after, &mut notices);
    for notice in &mut notices {
        bound_note(&mut notice.note);
    }
    notices
}

/// The API server refuses an Event whose note is longer than this (events.k8s.io/v1).
pub const MAX_NOTE_BYTES: usize = 1024;

/// Cut `note` to [`MAX_NOTE_BYTES`] at a character boundary, marking the cut (a placement
/// reason lists every member, and a pool may have many).
pub(super) fn bound_note(note: &mut String) {
    if note.len() > MAX_NOTE_BYTES {
        *note = plumbing::text::bounded(note, MAX_NOTE_BYTES);
    }
}

/// The workload Pod of `instance`, with the UID it registered with.
fn workload_pod(instance: &InstanceRecord) -> Regarding {
    Regarding {
        namespace: instance.namespace.clone(),
        name: instance.name.clone(),
        uid: Some(instance.uid.clone()).filter(|u| !u.is_empty()),
    }
}

fn members(before: &View, after: &View, install_namespace: &str, out: &mut Vec<Notice>) {
    let member_pod = |name: &str| member_pod(install_namespace, name);
    for m in after.members.values() {
        if after.member_is_live(m) && before.live_member(&m.member).is_none() {
            out.push(Notice {
                regarding: member_pod(&m.member),
                related: None,
                warning: false,
                reason: REASON_MEMBER_JOINED,
                action: "Join",
                note: format!("member {} joined the pool (capacity {})", m.member, m.capacity),
            });
        }
    }
    for m in before.members.values() {
        if before.member_is_live(m) && after.live_member(&m.member).is_none() {
            // It announced leaving before, or its stream ended after announcing it (the
            // record stays, expired and marked leaving): often both within one refresh.
            let left = m.leaving
                || after
                    .members
                    .get(&m.member)
                    .is_some_and(|a| a.process_id == m.process_id && a.leaving);
            let notice = if left {
                Notice {
                    regarding: member_pod(&m.member),
                    related: None,
                    warning: false,
                    reason: REASON_MEMBER_LEFT,
                    action: "Leave",
                    note: format!("member {} left the pool", m.member),
                }
            } else {
                Notice {
                    regarding: member_pod(&m.member),
                    related: None,
                    warning: true,
                    reason: REASON_MEMBER_LOST,
                    action: "Leave",
                    note: format!(
                        "member {} stopped answering; its instances move to other members",
                        m.member
                    ),
                }
            };
            out.push(notice);
        }
    }
}

fn member_pod(install_namespace: &str, member: &str) -> Regarding {
    Regarding {
        namespace: install_namespace.to_owned(),
        name: member.to_owned(),
        uid: None,
    }
}

fn assignments(before: &View, after: &View, install_namespace: &str, out: &mut Vec<Notice>) {
    for a in after.assignments.values() {
        if a.phase != AssignmentPhase::Active || after.is_stale(a) {
            continue;
        }
        let seen = before
            .assignments
            .get(&a.route)
            .is_some_and(|b| b.phase == AssignmentPhase::Active && b.term == a.term);
        let Some(instance) = after.instances.get(&a.route).filter(|i| !i.withdrawn) else {
            continue;
        };
        if seen {
            continue;
        }
        let (reason, action, verb) = if a.term <= a.placed_term {
            (REASON_PLACED, "Place", "placed on")
        } else {
            (REASON_RECOVERED, "Recover", "recovered by")
        };
        out.push(Notice {
            regarding: workload_pod(instance),
            related: Some(member_pod(install_namespace, &a.member)),
            warning: false,
            reason,
            action,
            note: format!(
                "instance {}/{} {verb} member {} (term {})",
                instance.namespace, instance.name, a.member, a.term
            ),
        });
    }
}

fn failed_recoveries(before: &View, after: &View, out: &mut Vec<Notice>) {
    for op in &after.operations {
        if op.kind != OperationKind::Recover || op.phase != OperationPhase::Failed {
            continue;
        }
        let already = before
            .operations
            .iter()
            .any(|b| b.id == op.id && b.phase == OperationPhase::Failed);
        let Some(instance) = after.instances.get(&op.target) else {
            continue;
        };
        if already {
            continue;
        }
        out.push(Notice {
            regarding: workload_pod(instance),
            related: None,
            warning: true,
            reason: REASON_RECOVERY_FAILED,
            action: "Recover",
            note: format!(
                "instance {}/{} could not be recovered: {}",
                instance.namespace, instance.name, op.message
            ),
        });
    }
}

/// Instances whose sidecar stopped the workload at the recovery deadline since `before`
/// (withdrawn with that reason): once per workload, whichever replica the report reached.
fn stopped_at_the_deadline(before: &View, after: &View, install_namespace: &str, out: &mut Vec<Notice>) {
    fn stopped(i: &InstanceRecord) -> Option<(Option<&str>, Option<OwnershipTerm>)> {
        match &i.withdrawn_reason {
            Some(WithdrawnReason::RecoveryFailed { owner, term }) if i.withdrawn => Some((owner.as_deref(), *term)),
            _ => None,
        }
    }
    for instance in after.instances.values() {
        let Some((owner, term)) = stopped(instance) else {
            continue;
        };
        let already = before
            .instances
            .get(&instance.route)
            .is_some_and(|b| b.uid == instance.uid && b.generation == instance.generation && stopped(b).is_some());
        if already {
            continue;
        }
        let last = match (owner, term) {
            (Some(owner), Some(term)) => format!(" (last owner {owner}, term {term})"),
            (Some(owner), None) => format!(" (last owner {owner})"),
            (None, Some(term)) => format!(" (last term {term})"),
            (None, None) => String::new(),
        };
        // What the last owner reported in that term: whether a workload process was identified
        // (the sidecar stops one only then).
        let identified = term.and_then(|term| {
            [after, before]
                .into_iter()
                .find_map(|view| view.reports.get(&instance.route).filter(|r| r.term == term))
                .map(|report| report.workload_pid)
        });
        let (action, what) = match identified {
            Some(0) => (
                "GiveUp",
                "no supervisor took it over before its recovery deadline; no workload process had been identified, so nothing was stopped".to_owned(),
            ),
            Some(pid) => (
                "Stop",
                format!("the workload (PID {pid}) was stopped because no supervisor took it over before its recovery deadline"),
            ),
            None => (
                "Stop",
                "the workload was stopped because no supervisor took it over before its recovery deadline".to_owned(),
            ),
        };
        out.push(Notice {
            regarding: workload_pod(instance),
            related: owner.map(|owner| member_pod(install_namespace, owner)),
            warning: true,
            reason: REASON_SUPERVISOR_RECOVERY_FAILED,
            action,
            note: format!("instance {}/{}: {what}{last}", instance.namespace, instance.name),
        });
    }
}

/// Instances of the same Pod registered again at a later generation since `before`: the
/// workload's container restarted (after a stop at the recovery deadline, a crash, an OOM
/// kill) and its new process is supervised from scratch.
fn restarted(before: &View, after: &View, out: &mut Vec<Notice>) {
    for instance in after.instances.values().filter(|i| !i.withdrawn) {
        let Some(was) = before.instances.get(&instance.route) else {
            continue;
        };
        if was.uid != instance.uid || was.generation >= instance.generation {
            continue;
        }
        out.push(Notice {
            regarding: workload_pod(instance),
            related: None,
            warning: false,
            reason: REASON_WORKLOAD_RESTARTED,
            action: "Register",
            note: format!(
                "instance {}/{}: the workload's container restarted; its new process is supervised as generation {}",
                instance.namespace, instance.name, instance.generation
            ),
        });
    }
}

/// Desired instances no member can take, when placement's reason for one appears or changes
/// (the same pure planner the coordinator runs, on both views).
fn unplaceable(before: &View, after: &View, out: &mut Vec<Notice>) {
    let was = room::unplaced(before);
    for (route, reason) in room::unplaced(after) {
        if was.get(route) == Some(reason) {
            continue;
        }
        let Some(instance) = after.instances.get(route) else {
            continue;
        };
        out.push(Notice {
            regarding: workload_pod(instance),
            related: None,
            warning: true,
            reason: REASON_UNPLACEABLE,
            action: "Place",
            note: format!(
                "instance {}/{} cannot be placed: {reason}",
                instance.namespace, instance.name
            ),
        });
    }
}

/// The Pods (by UID) that finished, each with an instance in `view`: it left the pool (the
/// plan withdrew it, or its sidecar deregistered it when the workload exited).
pub fn workloads_finished<'a>(uids: impl IntoIterator<Item = &'a str>, view: &View) -> Vec<Notice> {
    let uids: std::collections::BTreeSet<&str> = uids.into_iter().collect();
    view.instances
        .values()
        .filter(|i| uids.contains(i.uid.as_str()))
        .map(|instance| Notice {
            regarding: workload_pod(instance),
            related: None,
            warning: false,
            reason: REASON_WORKLOAD_FINISHED,
            action: "Withdraw",
            note: format!(
                "instance {}/{} left the pool: its Pod finished, so there is nothing left to supervise or recover",
                instance.namespace, instance.name
            ),
        })
        .collect()
}

/// A running Pod of a labelled namespace that the webhook admitted without supervision.
pub fn not_supervised(pod: &Unsupervised) -> Notice {
    let why = if pod.message.is_empty() {
        pod.reason.as_str()
    } else {
        pod.message.as_str()
    };
    let mut note = format!("the Pod runs without shared supervision ({}): {why}", pod.reason);
    bound_note(&mut note);
    Notice {
        regarding: Regarding {
            namespace: pod.pod.namespace.clone(),
            name: pod.pod.name.clone(),
            uid: Some(pod.pod.uid.clone()),
        },
        related: None,
        warning: true,
        reason: REASON_NOT_SUPERVISED,
        action: "Admit",
        note,
    }
}

#[cfg(test)]
#[path = "notice_tests.rs"]
mod tests;
