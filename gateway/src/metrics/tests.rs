use super::*;
use std::collections::BTreeMap;

use crate::pool::View;
use crate::store::{
    Assignment, AssignmentPhase, InstanceRecord, MemberRecord, Operation, OperationKind, OperationPhase, OwnershipTerm,
    Report, ReportPhase, SecretBytes,
};

fn instance(route: &str) -> InstanceRecord {
    InstanceRecord {
        route: route.into(),
        namespace: "ns".into(),
        name: route.into(),
        uid: format!("{route}-uid"),
        generation: 1,
        material: SecretBytes::default(),
        registered_at_ms: 0,
        withdrawn: false,
        last_term: OwnershipTerm::new(1),
        withdrawn_reason: None,
        displaced: None,
        checkpointed: false,
        fence_holder: None,
    }
}

fn member(name: &str, capacity: i64, leaving: bool) -> MemberRecord {
    MemberRecord {
        member: name.into(),
        process_id: format!("{name}-p"),
        epoch: 1,
        runtime_address: String::new(),
        capacity,
        served_by: String::new(),
        leaving,
        expires_at_ms: 20_000,
        updated_at_ms: 0,
    }
}

fn assignment(route: &str, member: &str, term: u64) -> Assignment {
    Assignment {
        route: route.into(),
        member: member.into(),
        process_id: format!("{member}-p"),
        term: OwnershipTerm::new(term),
        phase: AssignmentPhase::Reserved,
        generation: 1,
        placed_term: OwnershipTerm::new(1),
        coordinator_term: crate::store::CoordinatorTerm::new(1),
        updated_at_ms: 0,
    }
}

fn report(route: &str, member: &str, term: u64, phase: ReportPhase) -> Report {
    Report {
        route: route.into(),
        term: OwnershipTerm::new(term),
        member: member.into(),
        process_id: format!("{member}-p"),
        phase,
        message: String::new(),
        workload_pid: 0,
        progress: Some(0),
        reported_by: String::new(),
        updated_at_ms: 0,
        policy: None,
    }
}

fn operation(id: &str, kind: OperationKind, target: &str, phase: OperationPhase) -> Operation {
    Operation {
        id: id.into(),
        kind,
        target: target.into(),
        phase,
        message: String::new(),
        attempts: 2,
        moves: 2,
        deadline_at_ms: None,
        max_parallel: 1,
        requested_by: "operator".into(),
        cancel_requested: false,
        created_at_ms: 0,
        updated_at_ms: 7_500,
    }
}

/// Members a (serving, capacity 1000: counted as 256), b (draining), c (leaving), d (gone);
/// instances: r1 active on a, r2 on b reported at an older term, r3 unplaced, r4 withdrawn.
fn view() -> View {
    let mut v = View {
        now_ms: 10_000,
        ..View::default()
    };
    for route in ["r1", "r2", "r3", "r4"] {
        v.instances.insert(route.into(), instance(route));
    }
    if let Some(r4) = v.instances.get_mut("r4") {
        r4.withdrawn = true;
    }
    for m in [member("a", 1000, false), member("b", 2, false), member("c", 2, true)] {
        v.members.insert(m.member.clone(), m);
    }
    v.members.insert(
        "d".into(),
        MemberRecord {
            expires_at_ms: 1,
            ..member("d", 2, false)
        },
    );
    for (route, m, term) in [("r1", "a", 1), ("r2", "b", 2), ("r4", "a", 1)] {
        v.assignments.insert(route.into(), assignment(route, m, term));
    }
    v.reports.insert("r1".into(), report("r1", "a", 1, ReportPhase::Active));
    v.reports.insert("r2".into(), report("r2", "b", 1, ReportPhase::Active));
    v.operations = vec![
        operation("op-1", OperationKind::Drain, "b", OperationPhase::Running),
        operation("op-2", OperationKind::Drain, "a", OperationPhase::Succeeded),
        operation("op-3", OperationKind::Recover, "r2", OperationPhase::Running),
    ]
    .into();
    v
}

#[test]
fn the_coordinators_figures_of_a_view() {
    let f = Figures::of(&view());
    let by = |m: &BTreeMap<pool::StateLabels, i64>, state| m.get(&pool::StateLabels { state }).copied();
    assert_eq!(
        (
            by(&f.members, "serving"),
            by(&f.members, "drained"),
            by(&f.members, "leaving")
        ),
        (None, Some(2), Some(1)),
        "a is held out by its succeeded drain, b by the running one, c leaves, d is gone: {f:?}"
    );
    let m = |name: &str| pool::MemberLabels { member: name.into() };
    assert_eq!(f.member_capacity.get(&m("a")), Some(&256), "at most 256 per member");
    assert_eq!(f.member_capacity.get(&m("d")), None, "gone members are not listed");
    assert_eq!(
        (f.member_instances.get(&m("a")), f.member_instances.get(&m("b"))),
        (Some(&1), Some(&1)),
        "withdrawn instances do not count"
    );
    let phase = |phase| f.instances.get(&pool::PhaseLabels { phase }).copied();
    assert_eq!(
        (
            phase(pool::Phase::active),
            phase(pool::Phase::pending),
            phase(pool::Phase::unplaced)
        ),
        (Some(1), Some(1), Some(1)),
        "r2's report is of an older term: pending at the new one"
    );
    let open = |kind, phase| f.operations.get(&pool::OpenLabels { kind, phase }).copied();
    assert_eq!(open("drain", "running"), Some(1));
    assert_eq!(open("recover", "running"), Some(1));
    assert_eq!(open("drain", "succeeded"), None, "finished operations are not open");
    let drain = pool::OperationLabels {
        id: "op-1".into(),
        kind: "drain",
        target: "b".into(),
    };
    assert_eq!(f.moves_remaining.get(&drain), Some(&1));
    assert_eq!(f.moves_done.get(&drain), Some(&2));
    assert_eq!(f.last_progress.get(&drain), Some(&7));
    assert_eq!(f.moves_done.len(), 1, "recoveries have no move progress");
}

#[test]
fn pool_gauges_drop_what_is_gone_and_all_on_stepping_down() {
    let metrics = Metrics::new(&ConnectionMetrics::default());
    let mut v = view();
    metrics.pool.set(&Figures::of(&v));
    let text = metrics.encode().unwrap();
    assert!(
        text.contains("openshell_gateway_member_capacity{member=\"b\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("openshell_gateway_operation_moves_remaining{id=\"op-1\""),
        "{text}"
    );
    // b leaves, the drain finishes.
    v.members.remove("b");
    v.operations.retain(|op| op.id != "op-1");
    metrics.pool.set(&Figures::of(&v));
    let text = metrics.encode().unwrap();
    assert!(!text.contains("member=\"b\""), "{text}");
    assert!(!text.contains("id=\"op-1\""), "{text}");
    assert!(
        text.contains("openshell_gateway_member_capacity{member=\"a\"} 256"),
        "{text}"
    );
    metrics.pool.clear();
    let text = metrics.encode().unwrap();
    assert!(!text.contains("openshell_gateway_member_capacity{"), "{text}");
    assert!(!text.contains("openshell_gateway_instances{"), "{text}");
}

#[test]
fn committed_writes_count_failed_recoveries_and_finished_operations() {
    let metrics = Metrics::new(&ConnectionMetrics::default());
    let failed = "openshell_gateway_recoveries_failed_total{reason=\"deadline_passed\"}";
    assert!(metrics.encode().unwrap().contains(&format!("{failed} 0")));
    let put = |kind, phase| FencedWrite::PutOperation(operation("x", kind, "r", phase));
    metrics.written(&[
        put(OperationKind::Recover, OperationPhase::Running),
        put(OperationKind::Recover, OperationPhase::Failed),
        put(OperationKind::Drain, OperationPhase::Failed),
        put(OperationKind::Drain, OperationPhase::Succeeded),
    ]);
    metrics.recovery_failed_reported();
    metrics.call_denied();
    metrics.dropped("report_oversized");
    metrics.planned(std::time::Duration::from_millis(3));
    let text = metrics.encode().unwrap();
    for line in [
        "openshell_gateway_coordinator_pass_seconds_count 1",
        "openshell_gateway_coordinator_pass_seconds_bucket{le=\"0.004\"} 1",
        &format!("{failed} 1"),
        "openshell_gateway_recoveries_failed_total{reason=\"sidecar_reported\"} 1",
        "openshell_gateway_operations_finished_total{kind=\"recover\",phase=\"failed\"} 1",
        "openshell_gateway_operations_finished_total{kind=\"drain\",phase=\"failed\"} 1",
        "openshell_gateway_operations_finished_total{kind=\"drain\",phase=\"succeeded\"} 1",
        "openshell_gateway_calls_denied_total 1",
        "openshell_gateway_member_messages_dropped_total{reason=\"report_oversized\"} 1",
        "# TYPE openshell_gateway_calls_denied counter",
    ] {
        assert!(text.contains(line), "{line} not in:\n{text}");
    }
}

#[test]
fn the_oldest_delivered_token_secret_per_kind() {
    let metrics = Metrics::new(&ConnectionMetrics::default());
    // The supervisor Pods' Secret, and two namespaces' Secrets issued at different times.
    metrics.token_secrets_delivered([
        ("supervisor", 5_000_000),
        ("namespace", 3_000_000),
        ("namespace", 4_000_000),
    ]);
    let text = metrics.encode().unwrap();
    let series = "openshell_gateway_token_secret_oldest_issued_timestamp_seconds";
    assert!(text.contains(&format!("{series}{{kind=\"namespace\"}} 3000")), "{text}");
    assert!(
        text.contains(&format!("{series}{{kind=\"supervisor\"}} 5000")),
        "{text}"
    );
    assert!(text.contains("openshell_gateway_token_lifetime_seconds 3600"), "{text}");
    metrics.token_secrets_forgotten();
    assert!(!metrics.encode().unwrap().contains(&format!("{series}{{")));
}

#[test]
fn stored_egress_decisions_are_counted_by_a_bounded_set_of_decisions() {
    let metrics = Metrics::new(&ConnectionMetrics::default());
    let series = |decision: &str| format!("openshell_gateway_egress_decisions_total{{decision=\"{decision}\"}}");
    assert!(metrics.encode().unwrap().contains(&format!("{} 0", series("deny"))));
    metrics.egress_decisions_stored(["deny", "allow", "deny", "made-up", "dropped"]);
    let text = metrics.encode().unwrap();
    for (decision, count) in [("deny", 2), ("allow", 1), ("audit", 0), ("dropped", 1), ("other", 1)] {
        assert!(
            text.contains(&format!("{} {count}", series(decision))),
            "{decision}: {text}"
        );
    }
    assert!(!text.contains("made-up"), "a sidecar's words never become a label");
}
