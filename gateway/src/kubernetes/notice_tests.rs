//! Unit tests of [`super::diff`]: which Events a change of the pool view makes.

use super::*;
use crate::store::{Assignment, MemberRecord, Operation, OwnershipTerm, SecretBytes};

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
        last_term: OwnershipTerm::new(0),
        withdrawn_reason: None,
        displaced: None,
        checkpointed: false,
        fence_holder: None,
    }
}

fn assignment(route: &str, member: &str, term: u64, phase: AssignmentPhase) -> Assignment {
    Assignment {
        route: route.into(),
        member: member.into(),
        process_id: format!("{member}-p"),
        term: OwnershipTerm::new(term),
        phase,
        generation: 1,
        placed_term: OwnershipTerm::new(1),
        coordinator_term: crate::store::CoordinatorTerm::new(1),
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

fn stopped(mut i: InstanceRecord, owner: Option<&str>, term: Option<u64>) -> InstanceRecord {
    i.withdrawn = true;
    i.withdrawn_reason = Some(WithdrawnReason::RecoveryFailed {
        owner: owner.map(str::to_owned),
        term: term.map(OwnershipTerm::new),
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

/// The last owner's report in the withdrawn term says whether a workload process had been
/// identified; the sidecar stops one only then, and the Event says which it was.
#[test]
fn a_deadline_missed_with_no_identified_workload_says_nothing_was_stopped() {
    let reported = |pid: i64, term: u64| {
        let mut before = view(1_000);
        before.instances.insert("r".into(), instance("r"));
        before
            .assignments
            .insert("r".into(), assignment("r", "supervisor-0", 3, AssignmentPhase::Active));
        before.reports.insert(
            "r".into(),
            crate::store::Report {
                route: "r".into(),
                term: OwnershipTerm::new(term),
                member: "supervisor-0".into(),
                process_id: "p".into(),
                phase: crate::store::ReportPhase::Active,
                message: String::new(),
                workload_pid: pid,
                progress: Some(0),
                reported_by: "gw".into(),
                updated_at_ms: 0,
                policy: None,
            },
        );
        let mut after = before.clone();
        after.now_ms = 2_000;
        after
            .instances
            .insert("r".into(), stopped(instance("r"), Some("supervisor-0"), Some(3)));
        let notices = diff(&before, &after, "ns");
        assert_eq!(notices.len(), 1, "{notices:?}");
        (notices[0].action, notices[0].note.clone())
    };
    let (action, note) = reported(0, 3);
    assert_eq!(action, "GiveUp");
    assert_eq!(
        note,
        "instance team-a/agent-a: no supervisor took it over before its recovery deadline; no workload \
         process had been identified, so nothing was stopped (last owner supervisor-0, term 3)"
    );
    let (action, note) = reported(41, 3);
    assert_eq!(action, "Stop");
    assert!(note.contains("the workload (PID 41) was stopped"), "{note}");
    // A report of another term says nothing about this one.
    let (action, note) = reported(0, 2);
    assert_eq!(action, "Stop");
    assert!(note.contains(": the workload was stopped because"), "{note}");
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
    assert!(room::unplaced(&before).is_empty());
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

#[test]
fn a_finished_workload_and_an_unsupervised_pod_are_told_on_their_pods() {
    let mut v = view(1_000);
    v.instances.insert("r1".into(), instance("r1"));
    assert!(workloads_finished(["another-uid"], &v).is_empty());
    let told = workloads_finished([instance("r1").uid.as_str()], &v);
    assert_eq!(told.len(), 1);
    let done = &told[0];
    assert_eq!((done.reason, done.warning), (REASON_WORKLOAD_FINISHED, false));
    assert_eq!(done.regarding.name, "agent-a");
    assert!(done.regarding.uid.is_some());
    let pod = Unsupervised {
        pod: crate::kubernetes::index::Pod {
            namespace: "team-a".into(),
            name: "root-app".into(),
            uid: "u-1".into(),
        },
        reason: "runs_as_root".into(),
        message: "x".repeat(4 * MAX_NOTE_BYTES),
    };
    let notice = not_supervised(&pod);
    assert_eq!((notice.reason, notice.warning), (REASON_NOT_SUPERVISED, true));
    assert_eq!(notice.regarding.uid.as_deref(), Some("u-1"));
    assert!(notice.note.contains("runs_as_root"), "{}", notice.note);
    assert!(notice.note.len() <= MAX_NOTE_BYTES, "a long annotation is cut");
}

#[test]
fn the_same_pod_at_a_later_generation_is_a_restart() {
    let mut before = view(1_000);
    let mut withdrawn = instance("r1");
    withdrawn.withdrawn = true;
    before.instances.insert("r1".into(), withdrawn);
    let mut after = view(2_000);
    let mut next = instance("r1");
    next.generation = 2;
    after.instances.insert("r1".into(), next.clone());
    let notices = diff(&before, &after, "openshell-supervision");
    let restarts: Vec<_> = notices
        .iter()
        .filter(|n| n.reason == REASON_WORKLOAD_RESTARTED)
        .collect();
    assert_eq!(restarts.len(), 1, "{notices:?}");
    assert!(restarts[0].note.contains("generation 2"));
    // Another Pod under the name is a new Pod, not a restart; the same view again, nothing.
    let mut other = next.clone();
    other.uid = "another".into();
    other.generation = 3;
    let mut replaced = view(3_000);
    replaced.instances.insert("r1".into(), other);
    assert!(
        diff(&after, &replaced, "i")
            .iter()
            .all(|n| n.reason != REASON_WORKLOAD_RESTARTED)
    );
    assert!(
        diff(&after, &after, "i")
            .iter()
            .all(|n| n.reason != REASON_WORKLOAD_RESTARTED)
    );
}
