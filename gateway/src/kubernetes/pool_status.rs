//! The `SupervisorPool` custom resource's status (`supervision.openshell.ai/v1alpha1`, one
//! object named [`POOL_NAME`] in the install namespace; the CRD is
//! `manifests/supervisorpool-crd.yaml`): what `kubectl get supervisorpool` shows. Pure: a
//! function of the pool view and the lease this replica holds; [`super::pool_writer`] applies
//! it.

use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};

use crate::coordinator;
use crate::operations;
use crate::operator;
use crate::pool::View;
use crate::store::{Lease, Operation, OperationKind, OperationPhase};
use proto::common::v1::InstancePhase;
use proto::pool::v1::MemberState;

/// API group of the custom resources.
pub const GROUP: &str = "supervision.openshell.ai";
/// Their version.
pub const VERSION: &str = "v1alpha1";
/// Kind of the pool resource.
pub const KIND: &str = "SupervisorPool";
/// Its plural (the resource name in URLs and RBAC).
pub const PLURAL: &str = "supervisorpools";
/// The one pool object of an install.
pub const POOL_NAME: &str = "openshell";

/// Condition types.
pub const READY: &str = "Ready";
pub const COORDINATOR_ELECTED: &str = "CoordinatorElected";
pub const DEGRADED: &str = "Degraded";

/// `.status` of the `SupervisorPool`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolStatus {
    pub coordinator: Option<CoordinatorStatus>,
    /// Members that take instances / live members, e.g. `2/2`.
    pub ready_members: String,
    /// Active instances / desired instances, e.g. `5/5`.
    pub ready_instances: String,
    pub members: Vec<MemberStatus>,
    pub instances: InstanceCounts,
    /// Drains and rebalances running (and drains that keep their member out).
    pub operations: Vec<OperationStatus>,
    pub conditions: Vec<Condition>,
}

/// A condition in the standard shape (`metav1.Condition`), so `kubectl wait
/// --for=condition=Ready` works.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    /// `True` or `False`.
    pub status: String,
    pub reason: String,
    pub message: String,
    /// RFC 3339, whole seconds (database clock).
    pub last_transition_time: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CoordinatorStatus {
    /// The gateway replica (Pod) holding the lease.
    pub replica: String,
    pub term: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MemberStatus {
    pub name: String,
    /// `active`, `draining`, `drained`, `leaving` or `gone`.
    pub state: String,
    pub instances: u32,
    pub capacity: u32,
}

/// Desired instances by what their owner reports at the current term.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceCounts {
    pub total: u32,
    pub active: u32,
    pub starting: u32,
    /// Re-establishing the sidecar stream, or their owner is gone (recovery pending).
    pub recovering: u32,
    /// Failed, stopped or relinquished at the current term.
    pub failed: u32,
    /// Placed, or about to be, with no report at the current term yet.
    pub pending: u32,
    /// No member can take them (placement says why; see the `Degraded` condition).
    pub unplaced: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OperationStatus {
    pub id: String,
    /// `drain` or `rebalance`.
    pub kind: String,
    pub target: String,
    /// `pending`, `running` or `succeeded`.
    pub phase: String,
    pub moves_done: i64,
    /// Moves done plus the moves still planned (the dry-run planning over the current view).
    pub moves_total: i64,
    pub max_parallel: i64,
    pub message: String,
}

/// The status the pool object should have. `previous` is the status last applied: a condition
/// whose status did not change keeps its `lastTransitionTime`. Pure.
pub fn desired(view: &View, lease: Option<&Lease>, previous: Option<&PoolStatus>) -> PoolStatus {
    let summary = operator::status(view, None, "");
    let unplaced = coordinator::unplaced(view);
    let members: Vec<MemberStatus> = summary
        .members
        .iter()
        .map(|m| (m, MemberState::try_from(m.state).unwrap_or_default()))
        // A gone member is listed while it still holds instances (until they are recovered).
        .filter(|(m, state)| *state != MemberState::Gone || m.instance_count > 0)
        .map(|(m, state)| MemberStatus {
            name: m.name.clone(),
            state: state_name(state.as_str_name(), "MEMBER_STATE_"),
            instances: m.instance_count,
            capacity: m.capacity,
        })
        .collect();
    let live = members.iter().filter(|m| m.state != "gone").count();
    let taking = members.iter().filter(|m| m.state == "active").count();
    let mut counts = InstanceCounts::default();
    for i in &summary.instances {
        counts.total += 1;
        let bucket = if i.owner_member.is_empty() {
            if unplaced.contains_key(&i.route) {
                &mut counts.unplaced
            } else {
                &mut counts.pending
            }
        } else if !view.is_live(&i.owner_member, &i.owner_process_id) {
            &mut counts.recovering
        } else {
            match InstancePhase::try_from(i.phase).unwrap_or_default() {
                InstancePhase::Active => &mut counts.active,
                InstancePhase::Starting => &mut counts.starting,
                InstancePhase::Recovering => &mut counts.recovering,
                InstancePhase::Unspecified => &mut counts.pending,
                _ => &mut counts.failed,
            }
        };
        *bucket += 1;
    }
    let coordinator = lease.map(|l| CoordinatorStatus {
        replica: l.holder.split('/').next().unwrap_or_default().to_owned(),
        term: l.term,
    });
    let mut conditions = vec![
        elected(coordinator.as_ref()),
        ready(coordinator.as_ref(), taking, live, &counts, unplaced),
        degraded(&members, &counts, unplaced),
    ];
    stamp(&mut conditions, previous.map_or(&[], |p| &p.conditions), view.now_ms);
    PoolStatus {
        coordinator,
        ready_members: format!("{taking}/{live}"),
        ready_instances: format!("{}/{}", counts.active, counts.total),
        members,
        instances: counts,
        operations: operations_of(view),
        conditions,
    }
}

fn state_name(name: &str, prefix: &str) -> String {
    name.strip_prefix(prefix).unwrap_or(name).to_ascii_lowercase()
}

/// Set each condition's `lastTransitionTime`: kept from `previous` when its status did not
/// change, else `now_ms`.
pub fn stamp(conditions: &mut [Condition], previous: &[Condition], now_ms: i64) {
    let at = transition_time(now_ms);
    for c in conditions {
        c.last_transition_time = previous
            .iter()
            .find(|old| old.type_ == c.type_)
            .filter(|old| old.status == c.status)
            .map_or_else(|| at.clone(), |old| old.last_transition_time.clone());
    }
}

/// Whole seconds (what the API server keeps of a `metav1.Time`).
pub fn transition_time(now_ms: i64) -> String {
    Timestamp::from_second(now_ms.div_euclid(1000))
        .unwrap_or(Timestamp::UNIX_EPOCH)
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

pub fn condition(type_: &str, status: bool, reason: &str, message: String) -> Condition {
    Condition {
        type_: type_.to_owned(),
        status: if status { "True" } else { "False" }.to_owned(),
        reason: reason.to_owned(),
        message,
        last_transition_time: String::new(),
    }
}

fn elected(coordinator: Option<&CoordinatorStatus>) -> Condition {
    match coordinator {
        Some(c) => condition(
            COORDINATOR_ELECTED,
            true,
            "LeaseHeld",
            format!("{} coordinates at term {}", c.replica, c.term),
        ),
        None => condition(
            COORDINATOR_ELECTED,
            false,
            "NoCoordinator",
            "no gateway replica holds the coordinator lease".into(),
        ),
    }
}

fn ready(
    coordinator: Option<&CoordinatorStatus>,
    taking: usize,
    live: usize,
    counts: &InstanceCounts,
    unplaced: &std::collections::BTreeMap<String, String>,
) -> Condition {
    if coordinator.is_none() {
        return condition(
            READY,
            false,
            "NoCoordinator",
            "no coordinator places or recovers instances".into(),
        );
    }
    if taking == 0 {
        let message = if live == 0 {
            "no pool member is attached".to_owned()
        } else {
            format!("none of the {live} live members takes instances (draining, drained or leaving)")
        };
        return condition(READY, false, "NoMemberTakesInstances", message);
    }
    if let Some((route, reason)) = unplaced.iter().next() {
        return condition(
            READY,
            false,
            "InstancesUnplaced",
            format!("{} instances cannot be placed ({route}: {reason})", unplaced.len()),
        );
    }
    condition(
        READY,
        true,
        "PoolReady",
        format!(
            "{taking} of {live} members take instances; {} of {} instances active",
            counts.active, counts.total
        ),
    )
}

fn degraded(
    members: &[MemberStatus],
    counts: &InstanceCounts,
    unplaced: &std::collections::BTreeMap<String, String>,
) -> Condition {
    if let Some((route, reason)) = unplaced.iter().next() {
        return condition(
            DEGRADED,
            true,
            "InstancesUnplaced",
            format!("{} instances cannot be placed ({route}: {reason})", unplaced.len()),
        );
    }
    let lost: Vec<&str> = members
        .iter()
        .filter(|m| m.state == "gone")
        .map(|m| m.name.as_str())
        .collect();
    if !lost.is_empty() {
        return condition(
            DEGRADED,
            true,
            "MembersLost",
            format!(
                "gone members still hold instances (recovery pending): {}",
                lost.join(", ")
            ),
        );
    }
    if counts.failed > 0 || counts.recovering > 0 {
        return condition(
            DEGRADED,
            true,
            "InstancesNotActive",
            format!(
                "{} instances failed and {} recovering at their current term",
                counts.failed, counts.recovering
            ),
        );
    }
    condition(
        DEGRADED,
        false,
        "AsExpected",
        "every placed instance is active or starting".into(),
    )
}

/// Moves done plus, while `op` is open, the moves still planned (the dry-run planning over
/// `view`).
pub fn moves_total(view: &View, op: &Operation) -> i64 {
    let remaining = if op.phase.is_finished() {
        0
    } else {
        i64::try_from(operations::preview(view, op).moves.len()).unwrap_or(i64::MAX)
    };
    op.moves.saturating_add(remaining)
}

/// Drains and rebalances not finished, and succeeded drains that keep their member out, with
/// the moves still planned.
fn operations_of(view: &View) -> Vec<OperationStatus> {
    view.operations
        .iter()
        .filter(|op| matches!(op.kind, OperationKind::Drain | OperationKind::Rebalance))
        .filter(|op| !op.cancel_requested)
        .filter(|op| {
            !op.phase.is_finished() || (op.kind == OperationKind::Drain && op.phase == OperationPhase::Succeeded)
        })
        .map(|op| OperationStatus {
            id: op.id.clone(),
            kind: op.kind.as_str().to_owned(),
            target: op.target.clone(),
            phase: op.phase.as_str().to_owned(),
            moves_done: op.moves,
            moves_total: moves_total(view, op),
            max_parallel: op.max_parallel,
            message: op.message.clone(),
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store::{Assignment, AssignmentPhase, InstanceRecord, MemberRecord, Operation, Report, SecretBytes};

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
                    last_term: 1,
                    withdrawn_reason: None,
                },
            );
            v.assignments.insert(
                route.into(),
                Assignment {
                    route: route.into(),
                    member: owner.into(),
                    process_id: format!("{owner}-p"),
                    term: 1,
                    phase: AssignmentPhase::Active,
                    generation: 1,
                    placed_term: 1,
                    coordinator_term: 1,
                    updated_at_ms: 0,
                },
            );
            report(&mut v, route, "INSTANCE_PHASE_ACTIVE");
        }
        v
    }

    fn report(v: &mut View, route: &str, phase: &str) {
        let a = v.assignments[route].clone();
        v.reports.insert(
            route.into(),
            Report {
                route: route.into(),
                term: a.term,
                member: a.member.clone(),
                process_id: a.process_id.clone(),
                phase: phase.into(),
                message: String::new(),
                workload_pid: 7,
                progress: 0,
                reported_by: "gw".into(),
                updated_at_ms: 0,
            },
        );
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
            term: 3,
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
        let status = desired(&view(), Some(&lease()), None);
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
        // The same pool later: nothing changed, so nothing to write.
        let mut later = view();
        later.now_ms += 5_000;
        assert_eq!(desired(&later, Some(&lease()), Some(&status)), status);
    }

    #[test]
    fn without_a_lease_it_is_not_ready_and_says_so() {
        let status = desired(&view(), None, None);
        assert_eq!(status.coordinator, None);
        assert_eq!(state(&status, READY), ("False".into(), "NoCoordinator".into()));
        assert_eq!(
            state(&status, COORDINATOR_ELECTED),
            ("False".into(), "NoCoordinator".into())
        );
    }

    #[test]
    fn a_lost_member_degrades_the_pool_and_transitions_keep_their_time() {
        let before = desired(&view(), Some(&lease()), None);
        let mut v = view();
        v.now_ms += 5_000;
        v.members.get_mut("b").unwrap().expires_at_ms = 0;
        let status = desired(&v, Some(&lease()), Some(&before));
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
        a.term = 2;
        report(&mut v, "r3", "INSTANCE_PHASE_ACTIVE");
        let status = desired(&v, Some(&lease()), Some(&status));
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
        let status = desired(&v, Some(&lease()), None);
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
        let status = desired(&v, Some(&lease()), None);
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
        let status = desired(&v, Some(&lease()), None);
        assert_eq!(
            (status.operations[0].moves_done, status.operations[0].moves_total),
            (2, 2)
        );
        assert_eq!(status.members[0].state, "drained");
        // Every member out: not ready.
        v.members.get_mut("b").unwrap().leaving = true;
        let status = desired(&v, Some(&lease()), None);
        assert_eq!(state(&status, READY), ("False".into(), "NoMemberTakesInstances".into()));
    }

    /// Every key the status carries is declared in the CRD's schema (the API server would
    /// silently prune an undeclared one).
    #[test]
    fn every_field_written_is_declared_in_the_crd() {
        const CRD: &str = include_str!("../../../manifests/supervisorpool-crd.yaml");
        let mut v = view();
        v.operations.push(running(OperationKind::Rebalance, ""));
        let status = desired(&v, Some(&lease()), None);
        assert!(!status.operations.is_empty() && !status.members.is_empty());
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
        let declared: std::collections::BTreeSet<&str> =
            crd.lines().filter_map(|l| l.trim().strip_suffix(':')).collect();
        written.into_iter().filter(|k| !declared.contains(k.as_str())).collect()
    }

    #[test]
    fn failed_instances_degrade_the_pool() {
        let mut v = view();
        report(&mut v, "r2", "INSTANCE_PHASE_FAILED");
        report(&mut v, "r3", "INSTANCE_PHASE_STARTING");
        let status = desired(&v, Some(&lease()), None);
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
}
