//! What users see of the pool in `kubectl get events`: the coordinator compares two
//! consecutive pool views and names what changed, on the object concerned (the workload's Pod
//! for an instance, the supervisor Pod for a member). Pure; the writer publishes them.
//!
//! Two recovery failures are told apart: [`REASON_RECOVERY_FAILED`] is the coordinator's
//! recover operation that missed its deadline (the instance stays desired), and
//! [`REASON_SUPERVISOR_RECOVERY_FAILED`] is the sidecar stopping the workload at its recovery
//! deadline because no supervisor took it over (the instance is withdrawn; the report may
//! reach any replica and comes here through the store).

use crate::coordinator;
use crate::pool::View;
use crate::store::{AssignmentPhase, InstanceRecord, OperationKind, OperationPhase, WithdrawnReason};

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
    for notice in &mut notices {
        bound_note(&mut notice.note);
    }
    notices
}

/// The API server refuses an Event whose note is longer than this (events.k8s.io/v1).
pub const MAX_NOTE_BYTES: usize = 1024;

/// Cut `note` to [`MAX_NOTE_BYTES`] at a character boundary, marking the cut (a placement
/// reason lists every member, and a pool may have many).
fn bound_note(note: &mut String) {
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
    fn stopped(i: &InstanceRecord) -> Option<(Option<&str>, Option<i64>)> {
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
        out.push(Notice {
            regarding: workload_pod(instance),
            related: owner.map(|owner| member_pod(install_namespace, owner)),
            warning: true,
            reason: REASON_SUPERVISOR_RECOVERY_FAILED,
            action: "Stop",
            note: format!(
                "instance {}/{}: the workload was stopped because no supervisor took it over before its recovery deadline{last}",
                instance.namespace, instance.name
            ),
        });
    }
}

/// Desired instances no member can take, when placement's reason for one appears or changes
/// (the same pure planner the coordinator runs, on both views).
fn unplaceable(before: &View, after: &View, out: &mut Vec<Notice>) {
    let was = coordinator::unplaced(before);
    for (route, reason) in coordinator::unplaced(after) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Assignment, MemberRecord, Operation, SecretBytes};

    fn member(name: &str, expires_at_ms: i64, leaving: bool) -> MemberRecord {
        MemberRecord {
            member: name.into(),
            process_id: format!("{name}-p"),
            epoch: 1,
            runtime_address: "127.0.0.1:1".into(),
            capacity: 8,
            served_by: "gw".into(),
            leaving,
            expires_at_ms,
            updated_at_ms: 0,
        }
    }

    fn instance(route: &str) -> InstanceRecord {
        InstanceRecord {
            route: route.into(),
            namespace: "team-a".into(),
            name: "agent-a".into(),
            uid: "944be8f4-4199-442a-af17-50c1bb811f7c".into(),
            generation: 1,
            material: SecretBytes::default(),
            registered_at_ms: 0,
            withdrawn: false,
            last_term: 0,
            withdrawn_reason: None,
        }
    }

    fn assignment(route: &str, member: &str, term: i64, phase: AssignmentPhase) -> Assignment {
        Assignment {
            route: route.into(),
            member: member.into(),
            process_id: format!("{member}-p"),
            term,
            phase,
            generation: 1,
            placed_term: 1,
            coordinator_term: 1,
            updated_at_ms: 0,
        }
    }

    fn view(now_ms: i64) -> View {
        View {
            now_ms,
            ..View::default()
        }
    }

    #[test]
    fn members_joining_and_lost_are_noticed_once() {
        let before = view(1_000);
        let mut after = view(2_000);
        after
            .members
            .insert("supervisor-1".into(), member("supervisor-1", 10_000, false));
        let joined = diff(&before, &after, "shared-supervision");
        assert_eq!(joined.len(), 1);
        assert_eq!(joined[0].reason, REASON_MEMBER_JOINED);
        assert_eq!(joined[0].regarding.namespace, "shared-supervision");
        assert_eq!(joined[0].regarding.name, "supervisor-1");
        assert!(diff(&after, &after, "shared-supervision").is_empty());

        let mut expired = after.clone();
        expired.now_ms = 20_000;
        let lost = diff(&after, &expired, "shared-supervision");
        assert_eq!(lost.len(), 1);
        assert_eq!(lost[0].reason, REASON_MEMBER_LOST);
        assert!(lost[0].warning, "a member that stopped answering is a warning");
    }

    #[test]
    fn a_member_that_leaves_on_purpose_is_not_a_warning() {
        let mut before = view(1_000);
        before.members.insert("m".into(), member("m", 10_000, true));
        let after = view(2_000);
        let lost = diff(&before, &after, "ns");
        assert_eq!(lost.len(), 1);
        assert!(!lost[0].warning);
        assert_eq!(lost[0].reason, REASON_MEMBER_LEFT);
    }

    #[test]
    fn a_member_that_announced_and_left_within_one_refresh_left() {
        // The last view saw it live and not yet leaving; the next one has its record
        // expired and marked leaving (its stream ended after the announcement).
        let mut before = view(1_000);
        before.members.insert("m".into(), member("m", 10_000, false));
        let mut after = view(2_000);
        after.members.insert("m".into(), member("m", 1_500, true));
        let notices = diff(&before, &after, "ns");
        assert_eq!(notices.len(), 1);
        assert_eq!((notices[0].reason, notices[0].warning), (REASON_MEMBER_LEFT, false));
        assert_eq!(notices[0].note, "member m left the pool");
        // Another process of it marked leaving says nothing about this one.
        let mut other = after.clone();
        other.members.get_mut("m").unwrap().process_id = "m-other".into();
        assert_eq!(diff(&before, &other, "ns")[0].reason, REASON_MEMBER_LOST);
    }

    #[test]
    fn first_activation_is_a_placement_and_a_later_term_a_recovery() {
        let mut before = view(1);
        before.instances.insert("r".into(), instance("r"));
        before.assignments.insert(
            "r".into(),
            assignment("r", "supervisor-1", 1, AssignmentPhase::Reserved),
        );
        let mut placed = before.clone();
        placed
            .assignments
            .insert("r".into(), assignment("r", "supervisor-1", 1, AssignmentPhase::Active));
        let notices = diff(&before, &placed, "ns");
        assert_eq!(notices.len(), 1);
        assert_eq!(notices[0].reason, REASON_PLACED);
        assert_eq!(
            notices[0].regarding.uid.as_deref(),
            Some("944be8f4-4199-442a-af17-50c1bb811f7c")
        );
        assert!(
            diff(&placed, &placed, "ns").is_empty(),
            "an unchanged view says nothing"
        );

        let mut recovered = placed.clone();
        recovered
            .assignments
            .insert("r".into(), assignment("r", "supervisor-2", 3, AssignmentPhase::Active));
        let notices = diff(&placed, &recovered, "ns");
        assert_eq!(notices.len(), 1);
        assert_eq!(notices[0].reason, REASON_RECOVERED);
        assert_eq!(
            notices[0].note,
            "instance team-a/agent-a recovered by member supervisor-2 (term 3)"
        );
    }

    #[test]
    fn withdrawn_instances_and_reserved_terms_say_nothing() {
        // m takes what it holds: nothing here is unplaceable either.
        let mut before = view(1);
        before.members.insert("m".into(), member("m", 10_000, false));
        let mut after = before.clone();
        after.now_ms = 2;
        let mut gone = instance("r");
        gone.withdrawn = true;
        after.instances.insert("r".into(), gone);
        after
            .assignments
            .insert("r".into(), assignment("r", "m", 2, AssignmentPhase::Active));
        after.instances.insert("s".into(), instance("s"));
        after
            .assignments
            .insert("s".into(), assignment("s", "m", 2, AssignmentPhase::Reserved));
        assert!(diff(&before, &after, "ns").is_empty());
    }

    #[test]
    fn a_failed_recovery_is_a_warning_on_the_pod() {
        let mut before = view(1);
        before.instances.insert("r".into(), instance("r"));
        let op = Operation {
            id: "op-1".into(),
            kind: OperationKind::Recover,
            target: "r".into(),
            phase: OperationPhase::Running,
            message: String::new(),
            attempts: 1,
            moves: 0,
            deadline_at_ms: Some(60_000),
            max_parallel: 1,
            requested_by: "coordinator".into(),
            cancel_requested: false,
            created_at_ms: 0,
            updated_at_ms: 0,
        };
        before.operations.push(op.clone());
        let mut after = before.clone();
        after.operations[0].phase = OperationPhase::Failed;
        after.operations[0].message = "the recovery deadline passed".into();
        let notices = diff(&before, &after, "ns");
        assert_eq!(notices.len(), 1);
        assert_eq!(notices[0].reason, REASON_RECOVERY_FAILED);
        assert!(notices[0].warning);
        assert!(notices[0].note.ends_with("the recovery deadline passed"));
        assert!(diff(&after, &after, "ns").is_empty());
    }

    fn stopped(mut i: InstanceRecord, owner: Option<&str>, term: Option<i64>) -> InstanceRecord {
        i.withdrawn = true;
        i.withdrawn_reason = Some(WithdrawnReason::RecoveryFailed {
            owner: owner.map(str::to_owned),
            term,
        });
        i
    }

    #[test]
    fn a_workload_stopped_at_its_recovery_deadline_is_a_warning_on_its_pod_once() {
        // Supervisors scaled to zero: r's owner is gone, nobody took it over.
        let mut before = view(1_000);
        before.instances.insert("r".into(), instance("r"));
        before
            .assignments
            .insert("r".into(), assignment("r", "supervisor-0", 3, AssignmentPhase::Active));
        let mut after = before.clone();
        after.now_ms = 2_000;
        after
            .instances
            .insert("r".into(), stopped(instance("r"), Some("supervisor-0"), Some(3)));
        let notices = diff(&before, &after, "shared-supervision");
        assert_eq!(notices.len(), 1, "{notices:?}");
        let n = &notices[0];
        assert_eq!(
            (n.reason, n.warning, n.action),
            (REASON_SUPERVISOR_RECOVERY_FAILED, true, "Stop")
        );
        assert_ne!(
            n.reason, REASON_RECOVERY_FAILED,
            "not the coordinator's recover operation"
        );
        assert_eq!(
            n.regarding,
            Regarding {
                namespace: "team-a".into(),
                name: "agent-a".into(),
                uid: Some("944be8f4-4199-442a-af17-50c1bb811f7c".into()),
            }
        );
        assert_eq!(
            n.related.as_ref().map(|r| (r.namespace.as_str(), r.name.as_str())),
            Some(("shared-supervision", "supervisor-0"))
        );
        assert_eq!(
            n.note,
            "instance team-a/agent-a: the workload was stopped because no supervisor took it over \
             before its recovery deadline (last owner supervisor-0, term 3)"
        );

        // Once: the next views (the assignment dropped, a repeated report) say nothing, nor
        // does a new coordinator whose first view already had it.
        let mut dropped = after.clone();
        dropped.now_ms = 3_000;
        dropped.assignments.clear();
        assert!(diff(&after, &dropped, "shared-supervision").is_empty());
        assert!(diff(&dropped, &dropped, "shared-supervision").is_empty());

        // Registered and stopped between two views, without an owner: still once, with the
        // term the sidecar last activated.
        let mut unseen = view(4_000);
        unseen
            .instances
            .insert("r".into(), stopped(instance("r"), None, Some(4)));
        let notices = diff(&view(3_500), &unseen, "ns");
        assert_eq!(notices.len(), 1, "{notices:?}");
        assert!(
            notices[0].note.ends_with("recovery deadline (last term 4)"),
            "{}",
            notices[0].note
        );
        assert_eq!(notices[0].related, None);

        // Withdrawn for any other reason (deregistered, Pod gone): nothing.
        let mut deregistered = after.clone();
        if let Some(i) = deregistered.instances.get_mut("r") {
            i.withdrawn_reason = None;
        }
        assert!(diff(&before, &deregistered, "ns").is_empty());
    }

    #[test]
    fn an_instance_nobody_can_take_is_a_warning_when_the_reason_appears_or_changes() {
        // No member at all: a new Pod's instance cannot be placed, and the note says why.
        let before = view(1_000);
        let mut none = view(2_000);
        none.instances.insert("r".into(), instance("r"));
        let notices = diff(&before, &none, "ns");
        assert_eq!(notices.len(), 1, "{notices:?}");
        let n = &notices[0];
        assert_eq!((n.reason, n.warning, n.action), (REASON_UNPLACEABLE, true, "Place"));
        assert_eq!(n.regarding.uid.as_deref(), Some("944be8f4-4199-442a-af17-50c1bb811f7c"));
        assert_eq!(n.note, "instance team-a/agent-a cannot be placed: no live pool members");
        let mut later = none.clone();
        later.now_ms = 3_000;
        assert!(
            diff(&none, &later, "ns").is_empty(),
            "the same reason again says nothing"
        );

        // The reason changes: the only member is leaving.
        let mut leaving = later.clone();
        leaving.members.insert("m".into(), member("m", 10_000, true));
        let notices: Vec<Notice> = diff(&later, &leaving, "ns")
            .into_iter()
            .filter(|n| n.reason == REASON_UNPLACEABLE)
            .collect();
        assert_eq!(notices.len(), 1, "{notices:?}");
        assert!(
            notices[0].note.ends_with("all 1 pool members are leaving or drained"),
            "{}",
            notices[0].note
        );

        // And again: the member stays but is full.
        let mut full = leaving.clone();
        full.members.insert(
            "m".into(),
            MemberRecord {
                capacity: 1,
                ..member("m", 10_000, false)
            },
        );
        full.instances.insert("s".into(), instance("s"));
        full.assignments
            .insert("s".into(), assignment("s", "m", 1, AssignmentPhase::Active));
        let notices: Vec<Notice> = diff(&leaving, &full, "ns")
            .into_iter()
            .filter(|n| n.reason == REASON_UNPLACEABLE)
            .collect();
        assert_eq!(notices.len(), 1, "{notices:?}");
        assert!(
            notices[0].note.contains("at capacity (m holds 1 of 1)"),
            "{}",
            notices[0].note
        );

        // Room again: placeable says nothing; placed is the usual InstancePlaced.
        let mut room = full.clone();
        room.members.insert("m".into(), member("m", 10_000, false));
        assert!(diff(&full, &room, "ns").is_empty());
        let mut placed = room.clone();
        placed
            .assignments
            .insert("r".into(), assignment("r", "m", 1, AssignmentPhase::Active));
        let notices = diff(&room, &placed, "ns");
        assert_eq!(notices.len(), 1, "{notices:?}");
        assert_eq!(notices[0].reason, REASON_PLACED);
    }

    #[test]
    fn notes_fit_the_api_limit() {
        // 300 members at capacity: placement's reason names each of them.
        let mut after = view(1_000);
        for i in 0..300 {
            let name = format!("supervisor-{i:03}");
            after.members.insert(
                name.clone(),
                MemberRecord {
                    capacity: 0,
                    ..member(&name, 10_000, false)
                },
            );
        }
        after.instances.insert("r".into(), instance("r"));
        let mut before = after.clone();
        before.instances.clear();
        let notices = diff(&before, &after, "ns");
        assert_eq!(notices.len(), 1, "{notices:?}");
        assert_eq!(notices[0].reason, REASON_UNPLACEABLE);
        assert!(notices[0].note.len() <= MAX_NOTE_BYTES, "{}", notices[0].note.len());
        assert!(
            notices[0]
                .note
                .starts_with("instance team-a/agent-a cannot be placed: all 300 eligible")
        );
        assert!(notices[0].note.ends_with('…'));
    }

    #[test]
    fn supervisors_scaled_to_zero_make_every_instance_unplaceable() {
        let mut before = view(1_000);
        before.members.insert("m".into(), member("m", 10_000, false));
        before.instances.insert("r".into(), instance("r"));
        before
            .assignments
            .insert("r".into(), assignment("r", "m", 1, AssignmentPhase::Active));
        assert!(coordinator::unplaced(&before).is_empty());
        // The member's record expired: its instance has no owner and nobody to go to.
        let mut after = before.clone();
        after.now_ms = 20_000;
        let notices = diff(&before, &after, "ns");
        let reasons: Vec<&str> = notices.iter().map(|n| n.reason).collect();
        assert_eq!(reasons, [REASON_MEMBER_LOST, REASON_UNPLACEABLE]);
        assert_eq!(
            notices[1].note,
            "instance team-a/agent-a cannot be placed: no live pool members"
        );
    }
}
