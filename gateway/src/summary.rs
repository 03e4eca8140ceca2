//! The pool as the operator API shows it, worked out from a pool view: the status answer,
//! one operation, and a dry run's plan. Pure; shared by the operator API ([`crate::operator`]
//! and its status stream) and the Kubernetes objects that show the same (the
//! `SupervisorPool` status, the `SupervisorPoolOperation` dry runs).

use std::collections::BTreeMap;

use proto::pool::v1::{
    Build, Coordinator, GetSupervisorPoolStatusResponse, InstanceSummary, Member, MemberState, OperationPlan,
    PlannedMove, RefusedMove,
};

use crate::operations;
use crate::pool::{View, instance_ref};
use crate::store::{self, AssignmentPhase, LeaseView, OperationKind, OperationPhase, OwnershipTerm};

/// Build the status answer from a view, the lease row and the builds the pool runs
/// ([`store::Store::builds`]). Pure.
pub fn status(
    view: &View,
    lease: Option<&LeaseView>,
    builds: &[store::builds::Build],
    served_by: &str,
) -> GetSupervisorPoolStatusResponse {
    let member_builds: BTreeMap<&str, &str> = builds
        .iter()
        .filter(|b| b.component == store::builds::Component::Member)
        .map(|b| (b.name.as_str(), b.version.as_str()))
        .collect();
    let drains: BTreeMap<&str, OperationPhase> = view
        .operations
        .iter()
        .filter(|op| op.kind == OperationKind::Drain && !op.cancel_requested)
        .filter(|op| !op.phase.is_finished() || op.phase == OperationPhase::Succeeded)
        .map(|op| (op.target.as_str(), op.phase))
        .collect();
    let members = view
        .members
        .values()
        .map(|m| Member {
            name: m.member.clone(),
            process_id: m.process_id.clone(),
            state: if !view.member_is_live(m) {
                MemberState::Gone
            } else if m.leaving {
                MemberState::Leaving
            } else if let Some(phase) = drains.get(m.member.as_str()) {
                if *phase == OperationPhase::Succeeded {
                    MemberState::Drained
                } else {
                    MemberState::Draining
                }
            } else {
                MemberState::Active
            } as i32,
            instance_count: u32::try_from(
                view.assignments
                    .values()
                    .filter(|a| a.member == m.member && view.holds_desired(a))
                    .count(),
            )
            .unwrap_or(u32::MAX),
            capacity: u32::try_from(m.capacity).unwrap_or(0),
            last_heartbeat_at_ms: m.updated_at_ms,
            runtime_address: m.runtime_address.clone(),
            served_by: m.served_by.clone(),
            connection_epoch: u64::try_from(m.epoch).unwrap_or(0),
            build_version: member_builds
                .get(m.member.as_str())
                .map(|v| (*v).to_owned())
                .unwrap_or_default(),
            expires_at_ms: m.expires_at_ms,
        })
        .collect();
    let instances = view
        .instances
        .values()
        .filter(|i| !i.withdrawn)
        .map(|i| {
            let a = view.current_assignment(&i.route);
            let r = view
                .reports
                .get(&i.route)
                .filter(|r| a.is_some_and(|a| a.term == r.term));
            InstanceSummary {
                route: i.route.clone(),
                instance: Some(instance_ref(i)),
                owner_member: a.map(|a| a.member.clone()).unwrap_or_default(),
                owner_process_id: a.map(|a| a.process_id.clone()).unwrap_or_default(),
                // No current assignment: term 0 on the wire.
                term: a.map_or(OwnershipTerm::ZERO, |a| a.term).get(),
                reserved: a.is_some_and(|a| a.phase == AssignmentPhase::Reserved),
                phase: r.and_then(|r| r.phase.wire()).unwrap_or_default() as i32,
                last_report_at_ms: r.map_or(0, |r| r.updated_at_ms),
                message: crate::returned::unreachable_owner(view, &i.route)
                    .or_else(|| r.map(|r| r.message.clone()))
                    .unwrap_or_default(),
                workload_pid: r.map_or(0, |r| u32::try_from(r.workload_pid).unwrap_or(0)),
                progress: r.and_then(|r| r.progress).map_or(0, |p| u64::try_from(p).unwrap_or(0)),
            }
        })
        .collect();
    let operations = view.operations.iter().map(operation).collect();
    GetSupervisorPoolStatusResponse {
        coordinator: lease.filter(|l| l.is_live()).map(|l| Coordinator {
            holder: l.holder.clone(),
            term: l.term.get(),
            expires_at_ms: l.expires_at_ms,
        }),
        members,
        instances,
        operations,
        observed_at_ms: view.now_ms,
        served_by: served_by.to_owned(),
        builds: builds
            .iter()
            .map(|b| Build {
                component: b.component.as_str().to_owned(),
                name: b.name.clone(),
                version: b.version.clone(),
            })
            .collect(),
        build_warnings: crate::skew::warnings(builds),
    }
}

/// One operation as the operator API shows it.
pub fn operation(op: &store::Operation) -> proto::pool::v1::Operation {
    use proto::pool::v1::{OperationKind as K, OperationPhase as P};
    proto::pool::v1::Operation {
        id: op.id.clone(),
        kind: match op.kind {
            OperationKind::Assign => K::Assign,
            OperationKind::Recover => K::Recover,
            OperationKind::Drain => K::Drain,
            OperationKind::Rebalance => K::Rebalance,
        } as i32,
        target: op.target.clone(),
        phase: match op.phase {
            OperationPhase::Pending => P::Pending,
            OperationPhase::Running => P::Running,
            OperationPhase::Succeeded => P::Succeeded,
            OperationPhase::Failed => P::Failed,
            OperationPhase::Cancelled => P::Cancelled,
        } as i32,
        message: op.message.clone(),
        attempts: u32::try_from(op.attempts).unwrap_or(u32::MAX),
        moves: u32::try_from(op.moves).unwrap_or(u32::MAX),
        deadline_at_ms: op.deadline_at_ms.unwrap_or(0),
        max_parallel: u32::try_from(op.max_parallel).unwrap_or(1),
        requested_by: op.requested_by.clone(),
        created_at_ms: op.created_at_ms,
        updated_at_ms: op.updated_at_ms,
    }
}

/// The dry-run answer for `op` over `view`. Pure.
pub fn plan(view: &View, op: &store::Operation, served_by: &str) -> OperationPlan {
    let preview = operations::preview(view, op);
    OperationPlan {
        moves: preview
            .moves
            .into_iter()
            .map(|m| PlannedMove {
                route: m.route,
                from_member: m.from,
                to_member: m.to,
                term: m.term.get(),
                wave: m.wave,
            })
            .collect(),
        refused: preview
            .refused
            .into_iter()
            .map(|r| RefusedMove {
                route: r.route,
                from_member: r.from,
                reason: r.reason,
            })
            .collect(),
        completes: preview.completes,
        message: preview.message,
        observed_at_ms: view.now_ms,
        served_by: served_by.to_owned(),
        existing_operation_id: operations::equivalent(view, op.kind, &op.target)
            .map(|o| o.id.clone())
            .unwrap_or_default(),
    }
}
