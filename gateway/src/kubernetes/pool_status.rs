//! The `SupervisorPool` custom resource's status (`supervision.openshell.ai/v1alpha1`, one
//! object named [`POOL_NAME`] in the install namespace; the CRD is
//! `manifests/supervisorpool-crd.yaml`): what `kubectl get supervisorpool` shows. Pure: a
//! function of the pool view and the lease this replica holds; [`super::pool_writer`] applies
//! it.

use std::collections::BTreeMap;

use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};

use crate::operations;
use crate::pool::View;
use crate::room;
use crate::store::builds::Build;
use crate::store::{Lease, Operation, OperationKind, OperationPhase};
use crate::summary;
use proto::common::v1::InstancePhase;
use proto::pool::v1::MemberState;

/// API group of the custom resources.
pub const GROUP: &str = "supervision.openshell.ai";
/// Their version.
pub const VERSION: &str = "v1alpha1";

/// A custom resource of this API group and version, for the dynamic API.
pub fn custom_resource(kind: &str, plural: &str) -> kube::api::ApiResource {
    kube::api::ApiResource {
        group: GROUP.to_owned(),
        version: VERSION.to_owned(),
        api_version: format!("{GROUP}/{VERSION}"),
        kind: kind.to_owned(),
        plural: plural.to_owned(),
    }
}
/// Kind of the pool resource.
pub const KIND: &str = "SupervisorPool";
/// Its plural (the resource name in URLs and RBAC).
pub const PLURAL: &str = "supervisorpools";
/// The one pool object of an install.
pub const POOL_NAME: &str = "openshell";

/// A coordinator rewrites the status at least this often, even when nothing changed, so a
/// fresh `observedAt` proves one is at work.
pub const HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(10);
/// A replica that has not read the store for this long looks whether anyone still does.
pub const UNKNOWN_AFTER: std::time::Duration = std::time::Duration::from_secs(20);
/// It marks the status `Unknown` once it has seen the same `observedAt` for this long: half
/// again a heartbeat, in which a working coordinator would have written a new one.
pub const UNCHANGED_FOR: std::time::Duration = std::time::Duration::from_secs(15);
/// The reason of the conditions then.
pub const STORE_UNREACHABLE: &str = "StoreUnreachable";

/// Condition types.
pub const READY: &str = "Ready";
pub const COORDINATOR_ELECTED: &str = "CoordinatorElected";
pub const DEGRADED: &str = "Degraded";

/// `.status` of the `SupervisorPool`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PoolStatus {
    /// When the coordinator last read the pool from the store for this status (RFC 3339,
    /// database clock): the time of the last good read, refreshed at least every
    /// [`HEARTBEAT`] while a coordinator writes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub observed_at: Option<String>,
    pub coordinator: Option<CoordinatorStatus>,
    /// Members that take instances / live members, e.g. `2/2`.
    pub ready_members: String,
    /// Active instances / desired instances, e.g. `5/5`.
    pub ready_instances: String,
    pub members: Vec<MemberStatus>,
    pub instances: InstanceCounts,
    /// Running Pods of labelled namespaces admitted without supervision.
    pub unsupervised_pods: UnsupervisedPods,
    /// Drains and rebalances running (and drains that keep their member out).
    pub operations: Vec<OperationStatus>,
    /// The builds that run, counted by part and version.
    pub builds: Vec<BuildCount>,
    /// What runs outside the compatibility policy ([`crate::skew`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub build_warnings: Vec<String>,
    pub conditions: Vec<Condition>,
}

/// How many live parts of one kind run one build.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildCount {
    /// `gateway`, `member` or `sidecar`.
    pub component: String,
    pub version: String,
    pub count: u32,
}

impl BuildCount {
    /// `builds` counted by component and version, in that order.
    pub fn count(builds: &[Build]) -> Vec<BuildCount> {
        let mut counts: BTreeMap<(&str, &str), u32> = BTreeMap::new();
        for build in builds {
            *counts
                .entry((build.component.as_str(), build.version.as_str()))
                .or_default() += 1;
        }
        counts
            .into_iter()
            .map(|((component, version), count)| BuildCount {
                component: component.to_owned(),
                version: version.to_owned(),
                count,
            })
            .collect()
    }
}

/// A condition in the standard shape (`metav1.Condition`), so `kubectl wait
/// --for=condition=Ready` works.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
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
    pub term: u64,
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

/// Running Pods of labelled namespaces that the webhook admitted without supervision.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[serde(default)]
pub struct UnsupervisedPods {
    pub total: u32,
    /// By the webhook's reason code (`runs_as_root`, …). Left out when empty: server-side
    /// apply turns a map emptied of the keys it owned into `null`, which the schema refuses.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub by_reason: BTreeMap<String, u32>,
}

impl UnsupervisedPods {
    /// Count the reasons of such Pods.
    pub fn count<'a>(reasons: impl IntoIterator<Item = &'a str>) -> Self {
        let mut pods = Self::default();
        for reason in reasons {
            pods.total += 1;
            *pods.by_reason.entry(reason.to_owned()).or_default() += 1;
        }
        pods
    }
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

/// The status the pool object should have, `unsupervised` the running Pods admitted without
/// supervision (from the index), `builds` what the live parts run (from the store).
/// `previous` is the status last applied: a condition whose status did not change keeps its
/// `lastTransitionTime`. Pure.
pub fn desired(
    view: &View,
    lease: Option<&Lease>,
    unsupervised: UnsupervisedPods,
    builds: &[Build],
    previous: Option<&PoolStatus>,
) -> PoolStatus {
    let summary = summary::status(view, None, &[], "");
    let unplaced = room::unplaced(view);
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
        term: l.term.get(),
    });
    let mut conditions = vec![
        elected(coordinator.as_ref()),
        ready(coordinator.as_ref(), taking, live, &counts, unplaced),
        degraded(&members, &counts, unplaced, &unsupervised),
    ];
    stamp(&mut conditions, previous.map_or(&[], |p| &p.conditions), view.now_ms);
    PoolStatus {
        observed_at: Some(transition_time(view.now_ms)),
        coordinator,
        ready_members: format!("{taking}/{live}"),
        ready_instances: format!("{}/{}", counts.active, counts.total),
        members,
        instances: counts,
        unsupervised_pods: unsupervised,
        operations: operations_of(view),
        builds: BuildCount::count(builds),
        build_warnings: crate::skew::warnings(builds),
        conditions,
    }
}

/// Whether `next` says something `applied` does not, besides the time it was read.
pub fn differs(applied: &PoolStatus, next: &PoolStatus) -> bool {
    let mut a = applied.clone();
    a.observed_at.clone_from(&next.observed_at);
    &a != next
}

/// What a replica that cannot read the store writes over the status `current` when it has
/// seen the same `observedAt` for `unchanged_for` (on its own monotonic clock, so that no
/// clock skew between replicas and the database counts) and that is at least
/// [`UNCHANGED_FOR`]: `Ready`, `CoordinatorElected` and `Degraded` become `Unknown` (reason
/// [`STORE_UNREACHABLE`], `now_ms` their transition time) and the rest stays as last read,
/// `observedAt` saying when. `None` when the status is fresh, or already says so.
pub fn unreadable(
    current: &PoolStatus,
    unchanged_for: std::time::Duration,
    now_ms: i64,
    replica: &str,
) -> Option<PoolStatus> {
    if unchanged_for < UNCHANGED_FOR {
        return None;
    }
    let ready = current.conditions.iter().find(|c| c.type_ == READY);
    if ready.is_some_and(|c| c.status == "Unknown" && c.reason == STORE_UNREACHABLE) {
        return None;
    }
    let since = current.observed_at.as_deref().unwrap_or("never");
    let message = format!(
        "no gateway replica has read the pool's store since {since} ({replica} cannot reach it); the rest of this status is from then"
    );
    let at = transition_time(now_ms);
    let mut status = current.clone();
    status.conditions = [READY, COORDINATOR_ELECTED, DEGRADED]
        .into_iter()
        .map(|type_| Condition {
            last_transition_time: at.clone(),
            ..unknown(type_, STORE_UNREACHABLE, message.clone())
        })
        .collect();
    Some(status)
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

/// A condition whose status is `Unknown` (not decided yet).
pub fn unknown(type_: &str, reason: &str, message: String) -> Condition {
    Condition {
        status: "Unknown".to_owned(),
        ..condition(type_, false, reason, message)
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
    unplaced: &BTreeMap<String, String>,
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
    unplaced: &BTreeMap<String, String>,
    unsupervised: &UnsupervisedPods,
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
    if unsupervised.total > 0 {
        let reasons: Vec<String> = unsupervised
            .by_reason
            .iter()
            .take(8)
            .map(|(reason, n)| format!("{reason}: {n}"))
            .collect();
        return condition(
            DEGRADED,
            true,
            "PodsNotSupervised",
            format!(
                "{} running Pods of labelled namespaces are not supervised ({}); their NotSupervised Events say why",
                unsupervised.total,
                reasons.join(", ")
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
#[path = "pool_status_tests.rs"]
pub(crate) mod tests;
