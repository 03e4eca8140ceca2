use super::*;
use crate::store::{InstanceRecord, MemberRecord, OwnershipTerm, SecretBytes};

fn member(name: &str) -> MemberRecord {
    MemberRecord {
        member: name.into(),
        process_id: format!("{name}-p"),
        epoch: 1,
        runtime_address: String::new(),
        capacity: 256,
        served_by: String::new(),
        leaving: false,
        expires_at_ms: 100_000,
        updated_at_ms: 0,
    }
}

pub(super) fn pool(members: &[&str], placed: &[(&str, &str)]) -> View {
    let mut v = View {
        now_ms: 10_000,
        ..View::default()
    };
    for m in members {
        v.members.insert((*m).into(), member(m));
    }
    for (route, owner) in placed {
        v.instances.insert(
            (*route).into(),
            InstanceRecord {
                route: (*route).into(),
                namespace: "ns".into(),
                name: (*route).into(),
                uid: format!("uid-{route}"),
                generation: 1,
                material: SecretBytes::default(),
                registered_at_ms: 0,
                withdrawn: false,
                last_term: OwnershipTerm::new(0),
                withdrawn_reason: None,
                displaced: None,
                checkpointed: false,
                fence_holder: None,
            },
        );
        v.assignments.insert(
            (*route).into(),
            Assignment {
                route: (*route).into(),
                member: (*owner).into(),
                process_id: format!("{owner}-p"),
                term: OwnershipTerm::new(1),
                phase: AssignmentPhase::Active,
                generation: 1,
                placed_term: OwnershipTerm::new(1),
                coordinator_term: crate::store::CoordinatorTerm::new(1),
                updated_at_ms: 0,
            },
        );
    }
    v
}

pub(crate) fn op(kind: OperationKind, target: &str, max_parallel: i64) -> Operation {
    Operation {
        id: "op".into(),
        kind,
        target: target.into(),
        phase: OperationPhase::Running,
        message: String::new(),
        attempts: 0,
        moves: 0,
        deadline_at_ms: Some(60_000),
        max_parallel,
        requested_by: "admin".into(),
        cancel_requested: false,
        created_at_ms: 0,
        updated_at_ms: 0,
    }
}

fn moves(batches: &[Vec<FencedWrite>]) -> Vec<(String, String, u64)> {
    batches
        .iter()
        .flatten()
        .filter_map(|w| match w {
            FencedWrite::Assign {
                expected_term: Some(_),
                next,
            } => Some((next.route.clone(), next.member.clone(), next.term.get())),
            _ => None,
        })
        .collect()
}

fn ops(batches: &[Vec<FencedWrite>]) -> Vec<Operation> {
    batches
        .iter()
        .flatten()
        .filter_map(|w| match w {
            FencedWrite::PutOperation(op) => Some(op.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_drain_moves_at_most_max_parallel_at_term_plus_one_to_the_least_loaded() {
    let mut v = pool(&["a", "b", "c"], &[("r1", "a"), ("r2", "a"), ("r3", "a"), ("r4", "b")]);
    v.operations.push(op(OperationKind::Drain, "a", 2));
    let batches = plan(&v);
    assert_eq!(
        moves(&batches),
        [("r1".into(), "c".into(), 2), ("r2".into(), "b".into(), 2)],
        "two at a time, each to the least-loaded other member"
    );
    let recorded = ops(&batches);
    assert_eq!(recorded.len(), 1);
    assert_eq!((recorded[0].phase, recorded[0].moves), (OperationPhase::Running, 2));
}

/// A finished Job's Pod keeps its (withdrawn) instance record while the Pod exists: a drain
/// moves only live instances, counts only those, and succeeds with the withdrawn one left.
#[test]
fn a_drain_moves_only_instances_still_desired() {
    let mut v = pool(&["a", "b"], &[("r1", "a"), ("finished", "a")]);
    v.instances.get_mut("finished").unwrap().withdrawn = true;
    v.operations.push(op(OperationKind::Drain, "a", 4));
    let batches = plan(&v);
    assert_eq!(
        moves(&batches),
        [("r1".into(), "b".into(), 2)],
        "the withdrawn one stays"
    );
    // r1 settled on b: drained, though the withdrawn record still names a.
    let a = v.assignments.get_mut("r1").unwrap();
    a.member = "b".into();
    a.process_id = "b-p".into();
    a.term = OwnershipTerm::new(2);
    let done = ops(&plan(&v));
    assert_eq!(done[0].phase, OperationPhase::Succeeded, "{done:?}");
}

#[test]
fn a_drain_waits_for_handoffs_in_flight_then_succeeds_and_keeps_the_member_out() {
    let mut v = pool(&["a", "b"], &[("r1", "a")]);
    v.operations.push(op(OperationKind::Drain, "a", 1));
    // r1 moved to b at term 2, not settled yet: nothing more, not done.
    let a = v.assignments.get_mut("r1").unwrap();
    a.member = "b".into();
    a.process_id = "b-p".into();
    a.term = OwnershipTerm::new(2);
    a.phase = AssignmentPhase::Reserved;
    let batches = plan(&v);
    assert!(moves(&batches).is_empty());
    assert!(ops(&batches).iter().all(|o| o.phase == OperationPhase::Running));
    // Settled: the drain succeeds, and a succeeded drain still excludes its member.
    v.assignments.get_mut("r1").unwrap().phase = AssignmentPhase::Active;
    let done = ops(&plan(&v));
    assert_eq!(done[0].phase, OperationPhase::Succeeded);
    v.operations[0] = done[0].clone();
    assert!(drained(&v).contains("a"));
    assert!(v.candidates(&drained(&v)).iter().any(|c| c.member == "a" && c.excluded));
    // Cancelling it returns the member to service.
    v.operations[0].cancel_requested = true;
    let cancelled = ops(&plan(&v));
    assert_eq!(cancelled[0].phase, OperationPhase::Cancelled);
    v.operations[0] = cancelled[0].clone();
    assert!(drained(&v).is_empty());
}

#[test]
fn unsettled_or_dead_owners_routes_do_not_move() {
    let mut v = pool(&["a", "b"], &[("r1", "a"), ("r2", "a")]);
    v.assignments.get_mut("r1").unwrap().phase = AssignmentPhase::Reserved;
    v.operations.push(op(OperationKind::Drain, "a", 8));
    assert_eq!(moves(&plan(&v)), [("r2".into(), "b".into(), 2)]);
    v.members.get_mut("a").unwrap().expires_at_ms = 0;
    assert!(moves(&plan(&v)).is_empty(), "a gone owner is recovery's business");
}

#[test]
fn a_drain_with_nowhere_to_go_waits_and_fails_at_its_deadline() {
    let mut v = pool(&["a"], &[("r1", "a")]);
    v.operations.push(op(OperationKind::Drain, "a", 1));
    let waiting = ops(&plan(&v));
    assert!(waiting[0].message.starts_with("waiting:"), "{}", waiting[0].message);
    v.now_ms = 70_000;
    let failed = ops(&plan(&v));
    assert_eq!(failed[0].phase, OperationPhase::Failed);
}

#[test]
fn a_pending_cancelled_operation_never_runs() {
    let mut v = pool(&["a", "b"], &[("r1", "a")]);
    let mut pending = op(OperationKind::Drain, "a", 1);
    pending.phase = OperationPhase::Pending;
    pending.cancel_requested = true;
    v.operations.push(pending);
    let batches = plan(&v);
    assert!(moves(&batches).is_empty());
    assert_eq!(ops(&batches)[0].phase, OperationPhase::Cancelled);
}

#[test]
fn a_rebalance_evens_out_counts_and_then_succeeds() {
    let mut v = pool(&["a", "b"], &[("r1", "a"), ("r2", "a"), ("r3", "a"), ("r4", "a")]);
    v.operations.push(op(OperationKind::Rebalance, "", 8));
    let batches = plan(&v);
    assert_eq!(
        moves(&batches),
        [("r1".into(), "b".into(), 2), ("r2".into(), "b".into(), 2)]
    );
    // Once the moves settled, it is balanced and done.
    for (route, _, _) in moves(&batches) {
        let a = v.assignments.get_mut(&route).unwrap();
        a.member = "b".into();
        a.process_id = "b-p".into();
        a.term = OwnershipTerm::new(2);
    }
    let done = ops(&plan(&v));
    assert_eq!(done[0].phase, OperationPhase::Succeeded);
}

#[test]
fn leaving_members_are_emptied_without_an_operation() {
    let mut v = pool(&["a", "b"], &[("r1", "a"), ("r2", "b")]);
    v.members.get_mut("a").unwrap().leaving = true;
    assert_eq!(moves(&plan(&v)), [("r1".into(), "b".into(), 2)]);
}

#[test]
fn ended_operations_are_forgotten_after_their_retention_but_drains_in_force_stay() {
    let hour = 60 * 60 * 1000;
    let mut v = pool(&["a", "b"], &[]);
    v.now_ms = 48 * hour;
    let now = v.now_ms;
    let ended = |id: &str, kind, phase, cancel_requested, hours_ago: i64| Operation {
        id: id.into(),
        phase,
        cancel_requested,
        updated_at_ms: now - hours_ago * hour,
        ..op(kind, "a", 1)
    };
    use OperationKind::{Drain, Rebalance, Recover};
    use OperationPhase::{Cancelled, Failed, Running, Succeeded};
    v.operations = vec![
        ended("recovery-old", Recover, Succeeded, false, 1),
        ended("recovery-new", Recover, Succeeded, false, 0),
        ended("rebalance-old", Rebalance, Succeeded, false, 25),
        ended("rebalance-new", Rebalance, Failed, false, 23),
        ended("drain-in-force", Drain, Succeeded, false, 47),
        ended("drain-cancelled", Drain, Succeeded, true, 47),
        ended("drain-failed", Drain, Cancelled, false, 30),
        ended("running-long", Drain, Running, false, 40),
    ]
    .into();
    let mut forgotten: Vec<String> = expired(&v)
        .into_iter()
        .map(|w| match w {
            FencedWrite::DeleteOperation { id } => id,
            other => panic!("unexpected write {other:?}"),
        })
        .collect();
    forgotten.sort();
    assert_eq!(
        forgotten,
        ["drain-cancelled", "drain-failed", "rebalance-old", "recovery-old"]
    );
    assert!(drained(&v).contains("a"), "the drain in force still holds its member");
}
