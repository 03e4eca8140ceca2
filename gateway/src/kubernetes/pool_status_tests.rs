//! Unit tests of [`super::desired`] over plain pool views (also the fixtures other modules' tests build views with).

use super::*;
use crate::store::{
    Assignment, AssignmentPhase, InstanceRecord, MemberRecord, Operation, OwnershipTerm, ReportPhase, SecretBytes,
};

fn member(name: &str, expires_at_ms: i64) -> MemberRecord {
    MemberRecord {
        member: name.into(),
        process_id: format!("{name}-p"),
        epoch: 1,
        runtime_address: String::new(),
        capacity: 4,
        served_by: String::new(),
        leaving: false,
        expires_at_ms,
        updated_at_ms: 0,
    }
}

/// Members `a` and `b` (capacity 4), `r1`, `r2` on `a` and `r3` on `b`, all reported
/// active.
pub(crate) fn view() -> View {
    let mut v = View {
        now_ms: 1_700_000_000_500,
        ..View::default()
    };
    for m in ["a", "b"] {
        v.members.insert(m.into(), member(m, v.now_ms + 10_000));
    }
    for (route, owner) in [("r1", "a"), ("r2", "a"), ("r3", "b")] {
        v.instances.insert(
            route.into(),
            InstanceRecord {
                route: route.into(),
                namespace: "ns".into(),
                name: route.into(),
                uid: format!("uid-{route}"),
                generation: 1,
                material: SecretBytes::default(),
                registered_at_ms: 0,
                withdrawn: false,
                last_term: OwnershipTerm::new(1),
                withdrawn_reason: None,
                displaced: None,
                checkpointed: false,
                fence_holder: None,
            },
        );
        v.assignments.insert(
            route.into(),
            Assignment {
                route: route.into(),
                member: owner.into(),
                process_id: format!("{owner}-p"),
                term: OwnershipTerm::new(1),
                phase: AssignmentPhase::Active,
                generation: 1,
                placed_term: OwnershipTerm::new(1),
                coordinator_term: crate::store::CoordinatorTerm::new(1),
                updated_at_ms: 0,
            },
        );
        report(&mut v, route, ReportPhase::Active);
    }
    v
}

fn report(v: &mut View, route: &str, phase: ReportPhase) {
    let a = v.assignments[route].clone();
    let report = crate::pool::tests::report(route, a.term, &a.member, &a.process_id, phase);
    v.reports.insert(route.into(), report);
}

/// A running operation `op-1`, nothing moved yet.
pub(crate) fn running(kind: OperationKind, target: &str) -> Operation {
    Operation {
        id: "op-1".into(),
        kind,
        target: target.into(),
        phase: OperationPhase::Running,
        message: "running".into(),
        attempts: 0,
        moves: 0,
        deadline_at_ms: None,
        max_parallel: 1,
        requested_by: "admin".into(),
        cancel_requested: false,
        created_at_ms: 0,
        updated_at_ms: 0,
    }
}

pub(crate) fn lease() -> Lease {
    Lease {
        holder: "openshell-gateway-0/4f2a".into(),
        term: crate::store::CoordinatorTerm::new(3),
        expires_at_ms: 0,
    }
}

fn get<'s>(status: &'s PoolStatus, type_: &str) -> &'s Condition {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .unwrap_or_else(|| panic!("no {type_} condition"))
}

fn state(status: &PoolStatus, type_: &str) -> (String, String) {
    let c = get(status, type_);
    (c.status.clone(), c.reason.clone())
}

#[test]
fn a_healthy_pool_is_ready_with_its_coordinator_members_and_counts() {
    let status = desired(&view(), Some(&lease()), UnsupervisedPods::default(), &[], None);
    assert_eq!(
        status.coordinator,
        Some(CoordinatorStatus {
            replica: "openshell-gateway-0".into(),
            term: 3
        }),
        "the replica, not the holder's process key"
    );
    assert_eq!(
        (status.ready_members.as_str(), status.ready_instances.as_str()),
        ("2/2", "3/3")
    );
    assert_eq!(
        status.members,
        [
            MemberStatus {
                name: "a".into(),
                state: "active".into(),
                instances: 2,
                capacity: 4
            },
            MemberStatus {
                name: "b".into(),
                state: "active".into(),
                instances: 1,
                capacity: 4
            }
        ]
    );
    assert_eq!((status.instances.total, status.instances.active), (3, 3));
    assert_eq!(state(&status, READY), ("True".into(), "PoolReady".into()));
    assert_eq!(state(&status, COORDINATOR_ELECTED), ("True".into(), "LeaseHeld".into()));
    assert_eq!(state(&status, DEGRADED), ("False".into(), "AsExpected".into()));
    // Whole seconds of the database clock, as the API server keeps them.
    let json = serde_json::to_value(&status).unwrap();
    assert_eq!(json["conditions"][0]["lastTransitionTime"], "2023-11-14T22:13:20Z");
    assert_eq!(json["readyMembers"], "2/2");
    assert_eq!(json["instances"]["active"], 3);
    assert_eq!(json["coordinator"]["replica"], "openshell-gateway-0");
    // The same pool later: nothing changed but the time of the read, so nothing to write
    // (until the heartbeat is due).
    let mut later = view();
    later.now_ms += 5_000;
    assert!(!differs(
        &status,
        &desired(&later, Some(&lease()), UnsupervisedPods::default(), &[], Some(&status))
    ));
}

#[test]
fn without_a_lease_it_is_not_ready_and_says_so() {
    let status = desired(&view(), None, UnsupervisedPods::default(), &[], None);
    assert_eq!(status.coordinator, None);
    assert_eq!(state(&status, READY), ("False".into(), "NoCoordinator".into()));
    assert_eq!(
        state(&status, COORDINATOR_ELECTED),
        ("False".into(), "NoCoordinator".into())
    );
}

#[test]
fn a_lost_member_degrades_the_pool_and_transitions_keep_their_time() {
    let before = desired(&view(), Some(&lease()), UnsupervisedPods::default(), &[], None);
    let mut v = view();
    v.now_ms += 5_000;
    v.members.get_mut("b").unwrap().expires_at_ms = 0;
    let status = desired(&v, Some(&lease()), UnsupervisedPods::default(), &[], Some(&before));
    assert_eq!(state(&status, DEGRADED), ("True".into(), "MembersLost".into()));
    assert!(
        get(&status, DEGRADED).message.contains('b'),
        "{:?}",
        get(&status, DEGRADED)
    );
    assert_eq!(status.ready_members, "1/1", "a gone member is not live");
    assert_eq!(status.members[1].state, "gone", "listed while it holds instances");
    assert_eq!((status.instances.active, status.instances.recovering), (2, 1));
    assert_eq!(status.ready_instances, "2/3");
    // Degraded flipped: a new transition time; Ready did not: its time stays.
    assert_ne!(
        get(&status, DEGRADED).last_transition_time,
        get(&before, DEGRADED).last_transition_time
    );
    assert_eq!(
        get(&status, READY).last_transition_time,
        get(&before, READY).last_transition_time
    );
    // Recovered elsewhere and its record cleaned up: gone from the list.
    let a = v.assignments.get_mut("r3").unwrap();
    a.member = "a".into();
    a.process_id = "a-p".into();
    a.term = OwnershipTerm::new(2);
    report(&mut v, "r3", ReportPhase::Active);
    let status = desired(&v, Some(&lease()), UnsupervisedPods::default(), &[], Some(&status));
    assert_eq!(status.members.len(), 1);
    assert_eq!(state(&status, DEGRADED), ("False".into(), "AsExpected".into()));
}

#[test]
fn unplaceable_instances_make_it_unready_with_placements_reason() {
    let mut v = view();
    for m in v.members.values_mut() {
        m.capacity = 1;
    }
    // a holds two with capacity one; a new instance fits nowhere.
    let r4 = InstanceRecord {
        route: "r4".into(),
        ..v.instances["r1"].clone()
    };
    v.instances.insert("r4".into(), r4);
    let status = desired(&v, Some(&lease()), UnsupervisedPods::default(), &[], None);
    assert_eq!(state(&status, READY), ("False".into(), "InstancesUnplaced".into()));
    assert!(
        get(&status, READY).message.contains("at capacity"),
        "{:?}",
        get(&status, READY)
    );
    assert_eq!(state(&status, DEGRADED), ("True".into(), "InstancesUnplaced".into()));
    assert_eq!(status.instances.unplaced, 1);
}

#[test]
fn a_running_drain_shows_its_progress_and_a_drained_member_its_state() {
    let mut v = view();
    let drain = running(OperationKind::Drain, "a");
    v.operations.push(drain.clone());
    let status = desired(&v, Some(&lease()), UnsupervisedPods::default(), &[], None);
    assert_eq!(status.operations.len(), 1);
    let op = &status.operations[0];
    assert_eq!(
        (op.kind.as_str(), op.phase.as_str(), op.moves_done, op.moves_total),
        ("drain", "running", 0, 2)
    );
    assert_eq!(status.members[0].state, "draining");
    assert_eq!(status.ready_members, "1/2");
    assert_eq!(state(&status, READY).0, "True", "one member still takes instances");
    // Succeeded: the member stays out, and the drain stays listed; b alone takes work.
    v.operations[0] = Operation {
        phase: OperationPhase::Succeeded,
        moves: 2,
        ..drain
    };
    let status = desired(&v, Some(&lease()), UnsupervisedPods::default(), &[], None);
    assert_eq!(
        (status.operations[0].moves_done, status.operations[0].moves_total),
        (2, 2)
    );
    assert_eq!(status.members[0].state, "drained");
    // Every member out: not ready.
    v.members.get_mut("b").unwrap().leaving = true;
    let status = desired(&v, Some(&lease()), UnsupervisedPods::default(), &[], None);
    assert_eq!(state(&status, READY), ("False".into(), "NoMemberTakesInstances".into()));
}

/// Every key the status carries is declared in the CRD's schema (the API server would
/// silently prune an undeclared one).
#[test]
fn every_field_written_is_declared_in_the_crd() {
    const CRD: &str = include_str!("../../../manifests/supervisorpool-crd.yaml");
    let mut v = view();
    v.operations.push(running(OperationKind::Rebalance, ""));
    // A build of every part, one of them outside the policy, so that every field is written.
    use crate::store::builds::{Build, Component};
    let builds = [
        (Component::Gateway, "0.2.0"),
        (Component::Member, "0.2.0"),
        (Component::Sidecar, "0.3.0"),
    ]
    .map(|(component, version)| Build {
        component,
        name: component.as_str().into(),
        version: version.into(),
    });
    let status = desired(&v, Some(&lease()), UnsupervisedPods::default(), &builds, None);
    assert!(!status.operations.is_empty() && !status.members.is_empty());
    assert!(!status.builds.is_empty() && !status.build_warnings.is_empty());
    let undeclared = undeclared(CRD, &serde_json::to_value(&status).unwrap());
    assert!(undeclared.is_empty(), "not in the CRD schema: {undeclared:?}");
}

/// The keys of `value` that the CRD text `crd` declares nowhere (the API server prunes
/// them).
pub(crate) fn undeclared(crd: &str, value: &serde_json::Value) -> Vec<String> {
    fn keys(value: &serde_json::Value, out: &mut std::collections::BTreeSet<String>) {
        match value {
            serde_json::Value::Object(map) => {
                for (key, inner) in map {
                    out.insert(key.clone());
                    keys(inner, out);
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|i| keys(i, out)),
            _ => {}
        }
    }
    let mut written = std::collections::BTreeSet::new();
    keys(value, &mut written);
    let declared: std::collections::BTreeSet<&str> = crd.lines().filter_map(|l| l.trim().strip_suffix(':')).collect();
    written.into_iter().filter(|k| !declared.contains(k.as_str())).collect()
}

#[test]
fn failed_instances_degrade_the_pool() {
    let mut v = view();
    report(&mut v, "r2", ReportPhase::Failed);
    report(&mut v, "r3", ReportPhase::Starting);
    let status = desired(&v, Some(&lease()), UnsupervisedPods::default(), &[], None);
    assert_eq!(
        (
            status.instances.active,
            status.instances.failed,
            status.instances.starting
        ),
        (1, 1, 1)
    );
    assert_eq!(state(&status, DEGRADED), ("True".into(), "InstancesNotActive".into()));
}

/// The `openAPIV3Schema` of the CRD text `crd` at `path`: property names, `[]` for an array's
/// items.
pub(crate) fn schema_at(crd: &str, path: &[&str]) -> serde_yaml_ng::Value {
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(crd).unwrap_or_else(|err| panic!("the CRD parses: {err}"));
    let mut node = &doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    for part in path {
        node = if *part == "[]" {
            &node["items"]
        } else {
            &node["properties"][*part]
        };
        assert!(!node.is_null(), "no {path:?} in the CRD schema");
    }
    node.clone()
}

/// A schema node's `enum`, as strings.
pub(crate) fn enum_of(node: &serde_yaml_ng::Value) -> Vec<String> {
    node["enum"]
        .as_sequence()
        .map(|values| values.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

/// The bounds the descriptions of the CRD text `crd` state ("1 to 8", "at most 256") that
/// their schema node does not enforce (`minimum`/`maximum`, or `maxItems`/`maxLength` for "at
/// most"): what `kubectl apply` would let through although the text says otherwise.
pub(crate) fn unenforced_bounds(crd: &str) -> Vec<String> {
    fn numbers_around(text: &str, word: &str) -> Vec<(Option<i64>, i64)> {
        let number = |s: &str| s.parse::<i64>().ok();
        let mut found = Vec::new();
        for (i, _) in text.match_indices(word) {
            let before = text[..i].rsplit(|c: char| !c.is_ascii_digit()).next().and_then(number);
            let after = text[i + word.len()..]
                .split(|c: char| !c.is_ascii_digit())
                .next()
                .and_then(number);
            if let Some(after) = after {
                found.push((before, after));
            }
        }
        found
    }
    fn walk(node: &serde_yaml_ng::Value, at: &str, out: &mut Vec<String>) {
        let Some(map) = node.as_mapping() else { return };
        if let Some(text) = node["description"].as_str() {
            let int = |key: &str| node[key].as_i64();
            for (low, high) in numbers_around(text, " to ") {
                if let Some(low) = low
                    && (int("minimum"), int("maximum")) != (Some(low), Some(high))
                {
                    out.push(format!("{at}: says {low} to {high}"));
                }
            }
            for (_, most) in numbers_around(text, "at most ") {
                if ![int("maximum"), int("maxItems"), int("maxLength")].contains(&Some(most)) {
                    out.push(format!("{at}: says at most {most}"));
                }
            }
        }
        for (key, inner) in map {
            walk(inner, &format!("{at}.{}", key.as_str().unwrap_or("?")), out);
        }
    }
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(crd).unwrap_or_else(|err| panic!("the CRD parses: {err}"));
    let mut out = Vec::new();
    walk(&doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "", &mut out);
    out
}

#[test]
fn the_pool_crd_enforces_what_its_text_states_and_declares_what_is_written() {
    const CRD: &str = include_str!("../../../manifests/supervisorpool-crd.yaml");
    let unenforced = unenforced_bounds(CRD);
    assert!(unenforced.is_empty(), "stated, not enforced: {unenforced:?}");
    let operation = |field| schema_at(CRD, &["status", "operations", "[]", field]);
    assert_eq!(
        operation("maxParallel")["maximum"].as_i64(),
        Some(i64::from(proto::MAX_MAX_PARALLEL))
    );
    assert_eq!(
        enum_of(&operation("kind")),
        [OperationKind::Drain, OperationKind::Rebalance].map(|k| k.as_str().to_owned())
    );
    // Every phase an operation can be in: the ones listed are in the enum, and the enum has
    // no phase never listed.
    let mut listed = std::collections::BTreeSet::new();
    for phase in [
        OperationPhase::Pending,
        OperationPhase::Running,
        OperationPhase::Succeeded,
        OperationPhase::Failed,
        OperationPhase::Cancelled,
    ] {
        let mut v = view();
        v.operations.push(Operation {
            phase,
            ..running(OperationKind::Drain, "a")
        });
        listed.extend(
            desired(&v, Some(&lease()), UnsupervisedPods::default(), &[], None)
                .operations
                .into_iter()
                .map(|o| o.phase),
        );
    }
    let declared: std::collections::BTreeSet<String> = enum_of(&operation("phase")).into_iter().collect();
    assert_eq!(listed, declared);
    // Every member state the status can name is in the enum.
    let states = enum_of(&schema_at(CRD, &["status", "members", "[]", "state"]));
    for state in (0..16).filter_map(|n| MemberState::try_from(n).ok()) {
        let name = state_name(state.as_str_name(), "MEMBER_STATE_");
        assert!(states.contains(&name), "member state {name} not in {states:?}");
    }
}

#[test]
fn running_pods_admitted_without_supervision_degrade_the_pool() {
    let status = desired(&view(), Some(&lease()), UnsupervisedPods::default(), &[], None);
    assert_eq!(state(&status, DEGRADED), ("False".into(), "AsExpected".into()));
    let unsupervised = UnsupervisedPods::count(["runs_as_root", "uid_mismatch", "runs_as_root"]);
    let status = desired(&view(), Some(&lease()), unsupervised, &[], Some(&status));
    assert_eq!(state(&status, DEGRADED), ("True".into(), "PodsNotSupervised".into()));
    assert_eq!(state(&status, READY).0, "True", "the pool itself serves");
    assert_eq!(status.unsupervised_pods.total, 3);
    assert_eq!(status.unsupervised_pods.by_reason["runs_as_root"], 2);
    let degraded = status.conditions.iter().find(|c| c.type_ == DEGRADED).unwrap();
    assert!(
        degraded.message.contains("runs_as_root: 2, uid_mismatch: 1"),
        "{}",
        degraded.message
    );
}

#[test]
fn a_status_nobody_refreshed_is_marked_unknown_once_and_a_fresh_one_never() {
    let status = desired(&view(), Some(&lease()), UnsupervisedPods::default(), &[], None);
    let observed = status.observed_at.clone().expect("the status says when it was read");
    let now_ms = view().now_ms;
    let short = UNCHANGED_FOR - std::time::Duration::from_secs(1);
    assert_eq!(unreadable(&status, short, now_ms, "gw-1"), None, "fresh");
    let marked = unreadable(&status, UNCHANGED_FOR, now_ms, "gw-1").expect("stale");
    for type_ in [READY, COORDINATOR_ELECTED, DEGRADED] {
        assert_eq!(state(&marked, type_), ("Unknown".into(), STORE_UNREACHABLE.into()));
    }
    let ready = get(&marked, READY);
    assert!(
        ready.message.contains(&observed) && ready.message.contains("gw-1"),
        "{}",
        ready.message
    );
    assert_eq!(
        marked.observed_at, status.observed_at,
        "the time of the last good read stays"
    );
    assert_eq!(marked.members, status.members);
    assert_eq!(
        unreadable(&marked, 10 * UNCHANGED_FOR, now_ms, "gw-2"),
        None,
        "already said"
    );
    // Only what it says counts as a change, not when it was read.
    let later = PoolStatus {
        observed_at: Some("2030-01-01T00:00:00Z".into()),
        ..status.clone()
    };
    assert!(!differs(&status, &later));
    assert!(differs(&status, &marked));
}

/// Server-side apply turns a map emptied of every key the gateway owned into `null`, which the
/// CRD refuses (seen on the real cluster once the last unsupervised Pod went): an empty count
/// by reason is left out.
#[test]
fn an_empty_count_by_reason_is_left_out_of_the_status() {
    let json = serde_json::to_value(UnsupervisedPods::default()).unwrap();
    assert_eq!(json, serde_json::json!({ "total": 0 }));
    let json = serde_json::to_value(UnsupervisedPods::count(["runs_as_root"])).unwrap();
    assert_eq!(json["byReason"]["runs_as_root"], 1);
    let back: UnsupervisedPods = serde_json::from_value(serde_json::json!({ "total": 0 })).unwrap();
    assert_eq!(back, UnsupervisedPods::default());
}

#[test]
fn the_builds_that_run_are_counted_and_what_is_outside_the_policy_said() {
    use crate::store::builds::{Build, Component};
    let build = |component, name: &str, version: &str| Build {
        component,
        name: name.into(),
        version: version.into(),
    };
    let builds = [
        build(Component::Gateway, "gw-0", "0.2.0+aaaa"),
        build(Component::Gateway, "gw-1", "0.2.0+aaaa"),
        build(Component::Member, "m-0", "0.2.0+aaaa"),
        build(Component::Sidecar, "ns/a", "0.1.0+bbbb"),
        build(Component::Sidecar, "ns/b", "0.1.0+bbbb"),
        build(Component::Sidecar, "ns/c", "0.3.0"),
    ];
    let status = desired(&view(), Some(&lease()), UnsupervisedPods::default(), &builds, None);
    let counted: Vec<(&str, &str, u32)> = status
        .builds
        .iter()
        .map(|b| (b.component.as_str(), b.version.as_str(), b.count))
        .collect();
    assert_eq!(
        counted,
        vec![
            ("gateway", "0.2.0+aaaa", 2),
            ("member", "0.2.0+aaaa", 1),
            ("sidecar", "0.1.0+bbbb", 2),
            ("sidecar", "0.3.0", 1),
        ]
    );
    assert_eq!(status.build_warnings.len(), 1, "{:?}", status.build_warnings);
    assert!(
        status.build_warnings[0].contains("newer than the pool"),
        "{:?}",
        status.build_warnings
    );
    let written = serde_json::to_value(&status).unwrap();
    assert_eq!(written["builds"][0]["count"], 2);
    assert!(written["buildWarnings"].is_array());
    let quiet = desired(&view(), Some(&lease()), UnsupervisedPods::default(), &builds[..5], None);
    let written = serde_json::to_value(&quiet).unwrap();
    assert!(
        written.get("buildWarnings").is_none(),
        "no warnings, no field: {written}"
    );
}
