//! The operator API (`pool.v1.SupervisorPool`): pool status, and drain and
//! rebalance operations (recorded here by any replica, run by the coordinator:
//! see `operations`) and their dry runs (planned over a fresh read, never recorded).
//! Authenticated with an operator token carrying the platform-admin role. The status stream
//! (`WatchSupervisorPool`) is in `watch`.

mod watch;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use proto::timing::{DEFAULT_OPERATION_TIMEOUT, MAX_OPERATION_TIMEOUT};
use tracing::info;

use proto::pool::v1::supervisor_pool_server::SupervisorPool;
use proto::pool::v1::{
    CancelSupervisorPoolOperationRequest, CancelSupervisorPoolOperationResponse, Coordinator,
    GetSupervisorPoolStatusRequest, GetSupervisorPoolStatusResponse, InstanceSummary, Member, MemberState,
    OperationPlan, PlannedMove, RefusedMove, StartSupervisorPoolOperationRequest, StartSupervisorPoolOperationResponse,
    WatchSupervisorPoolRequest,
};
use proto::trust::{Claims, Kind, OperatorClaims};
use tonic::{Request, Response, Status};

use crate::auth::bearer;
use crate::operations;
use crate::pool::{View, instance_ref};
use crate::replica::Replica;
use crate::store::{self, AssignmentPhase, LeaseView, OperationKind, OperationPhase};
use crate::tokens::PLATFORM_ADMIN;

#[derive(Clone)]
pub struct Operator {
    replica: Arc<Replica>,
    feed: Arc<watch::Feed>,
}

impl Operator {
    /// The operator API of `replica`; starts its status feed (within a runtime).
    pub fn new(replica: Arc<Replica>) -> Self {
        let feed = Arc::new(watch::Feed::start(replica.clone()));
        Self { replica, feed }
    }

    /// An operator token with the platform-admin role; returns who asks.
    async fn authorize<T>(&self, request: &Request<T>) -> Result<String, Status> {
        let claims: Claims<OperatorClaims> = self
            .replica
            .keys
            .verify_claims(Kind::Operator, bearer(request)?)
            .await
            .map_err(|err| Status::unauthenticated(format!("operator token refused: {err}")))?;
        if !claims.extra.roles.iter().any(|r| r == PLATFORM_ADMIN) {
            return Err(Status::permission_denied(format!(
                "the operator API needs the {PLATFORM_ADMIN} role"
            )));
        }
        Ok(claims.sub)
    }
}

/// Build the status answer from a view and the lease row. Pure.
pub fn status(view: &View, lease: Option<&LeaseView>, served_by: &str) -> GetSupervisorPoolStatusResponse {
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
            build_version: String::new(),
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
                term: a.map_or(0, |a| u64::try_from(a.term).unwrap_or(0)),
                reserved: a.is_some_and(|a| a.phase == AssignmentPhase::Reserved),
                phase: r.and_then(|r| r.phase.wire()).unwrap_or_default() as i32,
                last_report_at_ms: r.map_or(0, |r| r.updated_at_ms),
                message: r.map(|r| r.message.clone()).unwrap_or_default(),
                workload_pid: r.map_or(0, |r| u32::try_from(r.workload_pid).unwrap_or(0)),
                progress: r.map_or(0, |r| u64::try_from(r.progress).unwrap_or(0)),
            }
        })
        .collect();
    let operations = view.operations.iter().map(operation).collect();
    GetSupervisorPoolStatusResponse {
        coordinator: lease.filter(|l| l.is_live()).map(|l| Coordinator {
            holder: l.holder.clone(),
            term: u64::try_from(l.term).unwrap_or(0),
            expires_at_ms: l.expires_at_ms,
        }),
        members,
        instances,
        operations,
        observed_at_ms: view.now_ms,
        served_by: served_by.to_owned(),
    }
}

fn operation(op: &store::Operation) -> proto::pool::v1::Operation {
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

impl Operator {
    /// Plan the requested operation over a fresh read of the pool; records nothing.
    async fn dry_run(
        &self,
        request: &StartSupervisorPoolOperationRequest,
        requested_by: &str,
    ) -> Result<StartSupervisorPoolOperationResponse, Status> {
        let view = self
            .replica
            .fresh_view()
            .await
            .map_err(|err| Status::unavailable(format!("cannot read the pool: {err}")))?;
        let op = request_to_operation(request, requested_by, &view)?;
        let served_by = self.replica.name.clone();
        // Wave after wave over the whole pool: off the runtime's threads.
        let plan = tokio::task::spawn_blocking(move || plan(&view, &op, &served_by))
            .await
            .map_err(|err| Status::internal(format!("planning failed: {err}")))?;
        info!(kind = ?request.kind(), target = %request.target, %requested_by, moves = plan.moves.len(),
              completes = plan.completes, "operation planned (dry run)");
        Ok(StartSupervisorPoolOperationResponse {
            operation: None,
            created: false,
            plan: Some(plan),
        })
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
                term: u64::try_from(m.term).unwrap_or(0),
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

#[tonic::async_trait]
impl SupervisorPool for Operator {
    type WatchSupervisorPoolStream = watch::WatchStream;

    async fn list_audit(
        &self,
        request: Request<proto::pool::v1::ListAuditRequest>,
    ) -> Result<Response<proto::pool::v1::ListAuditResponse>, Status> {
        self.authorize(&request).await?;
        let request = request.into_inner();
        for part in [&request.namespace, &request.name] {
            plumbing::validate::route(&format!("{part}/x"))
                .map_err(|_| Status::invalid_argument(format!("{part:?} is no valid name")))?;
        }
        if request.limit > crate::audit::MAX_LIST {
            return Err(Status::invalid_argument(format!(
                "limit above {}",
                crate::audit::MAX_LIST
            )));
        }
        let limit = if request.limit == 0 { 100 } else { request.limit };
        let after = i64::try_from(request.after_sequence).unwrap_or(i64::MAX);
        let rows = self
            .replica
            .store
            .list_audit(
                &request.namespace,
                &request.name,
                after,
                request.since_ms,
                i64::from(limit),
            )
            .await
            .map_err(|err| Status::unavailable(format!("cannot read the audit trail: {err}")))?;
        Ok(Response::new(proto::pool::v1::ListAuditResponse {
            entries: rows.into_iter().map(crate::audit::entry).collect(),
        }))
    }

    async fn watch_supervisor_pool(
        &self,
        request: Request<WatchSupervisorPoolRequest>,
    ) -> Result<Response<Self::WatchSupervisorPoolStream>, Status> {
        let watcher = self.authorize(&request).await?;
        let stream = self.feed.watch()?;
        info!(%watcher, "pool watch opened");
        Ok(Response::new(stream))
    }

    async fn get_supervisor_pool_status(
        &self,
        request: Request<GetSupervisorPoolStatusRequest>,
    ) -> Result<Response<GetSupervisorPoolStatusResponse>, Status> {
        self.authorize(&request).await?;
        let store = &self.replica.store;
        let unavailable = |err: &dyn std::fmt::Display| Status::unavailable(format!("cannot read the pool: {err}"));
        let view = self.replica.fresh_view().await.map_err(|e| unavailable(&e))?;
        let lease = store.read_lease().await.map_err(|e| unavailable(&e))?;
        Ok(Response::new(status(&view, lease.as_ref(), &self.replica.name)))
    }

    async fn start_supervisor_pool_operation(
        &self,
        request: Request<StartSupervisorPoolOperationRequest>,
    ) -> Result<Response<StartSupervisorPoolOperationResponse>, Status> {
        let requested_by = self.authorize(&request).await?;
        let request = request.into_inner();
        if request.dry_run {
            return self.dry_run(&request, &requested_by).await.map(Response::new);
        }
        // A view read after the request, as for the status and the dry run: the published one
        // may be a refresh behind (a member that attached a moment ago would be "no pool member").
        let view = self
            .replica
            .fresh_view()
            .await
            .map_err(|err| Status::unavailable(format!("cannot read the pool: {err}")))?;
        let op = request_to_operation(&request, &requested_by, &view)?;
        let (operation, created) = self
            .replica
            .store
            .request_operation(&op)
            .await
            .map_err(|err| Status::unavailable(format!("cannot record the operation: {err}")))?;
        if created {
            info!(id = %operation.id, kind = ?operation.kind, target = %operation.target, %requested_by,
                  max_parallel = operation.max_parallel, "operation requested");
            self.replica.wake.notify_one();
        }
        Ok(Response::new(StartSupervisorPoolOperationResponse {
            operation: Some(self::operation(&operation)),
            created,
            plan: None,
        }))
    }

    async fn cancel_supervisor_pool_operation(
        &self,
        request: Request<CancelSupervisorPoolOperationRequest>,
    ) -> Result<Response<CancelSupervisorPoolOperationResponse>, Status> {
        let requested_by = self.authorize(&request).await?;
        let id = request.into_inner().id;
        if id.is_empty() || id.len() > 64 {
            return Err(Status::invalid_argument("the operation id is empty or too long"));
        }
        let store = &self.replica.store;
        let unavailable = |err: store::Error| Status::unavailable(format!("cannot cancel: {err}"));
        let op = store
            .request_cancel(&id)
            .await
            .map_err(unavailable)?
            .ok_or_else(|| Status::not_found(format!("no operation {id}")))?;
        if !op.cancel_requested {
            return Err(Status::failed_precondition(format!(
                "operation {id} already finished ({:?}); only open operations and succeeded drains can be cancelled",
                op.phase
            )));
        }
        info!(%id, %requested_by, "operation cancellation requested");
        self.replica.wake.notify_one();
        // The coordinator applies it within a round or two; answer with what it wrote.
        let mut view = self.replica.view.clone();
        let applied = tokio::time::timeout(CANCEL_WAIT, async {
            loop {
                if let Ok(Some(now)) = store.operation(&id).await
                    && now.phase == OperationPhase::Cancelled
                {
                    return now;
                }
                if view.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        })
        .await
        .unwrap_or(op);
        Ok(Response::new(CancelSupervisorPoolOperationResponse {
            operation: Some(operation(&applied)),
        }))
    }
}

/// How long a cancellation waits for the coordinator to apply it before answering with the
/// operation as recorded (its phase still open, `cancel_requested` set).
pub const CANCEL_WAIT: Duration = Duration::from_secs(3);

/// Validate a start request into the operation to record. Pure.
/// Longest member name (a Pod name: a DNS subdomain); a longer target is refused without
/// being echoed.
const MAX_MEMBER_NAME_BYTES: usize = 253;

pub fn request_to_operation(
    request: &StartSupervisorPoolOperationRequest,
    requested_by: &str,
    view: &View,
) -> Result<store::Operation, Status> {
    use proto::pool::v1::OperationKind as K;
    let max_parallel = request.effective_max_parallel().ok_or_else(|| {
        Status::invalid_argument(format!(
            "max_parallel {} is above {}",
            request.max_parallel,
            proto::MAX_MAX_PARALLEL
        ))
    })?;
    let kind = match K::try_from(request.kind) {
        Ok(K::Drain) => {
            if request.target.is_empty() {
                return Err(Status::invalid_argument("a drain names the member to drain"));
            }
            if request.target.len() > MAX_MEMBER_NAME_BYTES {
                return Err(Status::invalid_argument(format!(
                    "the drain target is not a member name (longer than {MAX_MEMBER_NAME_BYTES} bytes)"
                )));
            }
            if !view.members.contains_key(&request.target) {
                return Err(Status::not_found(format!("no pool member {}", request.target)));
            }
            OperationKind::Drain
        }
        Ok(K::Rebalance) => {
            if !request.target.is_empty() {
                return Err(Status::invalid_argument("a rebalance takes no target"));
            }
            OperationKind::Rebalance
        }
        _ => {
            return Err(Status::invalid_argument(
                "only DRAIN and REBALANCE operations can be started",
            ));
        }
    };
    let timeout = match request.timeout_ms {
        0 => DEFAULT_OPERATION_TIMEOUT,
        ms => Duration::from_millis(ms),
    };
    if timeout > MAX_OPERATION_TIMEOUT {
        return Err(Status::invalid_argument(format!(
            "timeout_ms is above {} ms",
            MAX_OPERATION_TIMEOUT.as_millis()
        )));
    }
    Ok(store::Operation {
        id: uuid::Uuid::new_v4().to_string(),
        kind,
        target: request.target.clone(),
        phase: OperationPhase::Pending,
        message: "requested".into(),
        attempts: 0,
        moves: 0,
        // The store turns the budget into a deadline on the database clock.
        deadline_at_ms: Some(i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX)),
        max_parallel: i64::from(max_parallel),
        requested_by: plumbing::text::prefix(requested_by, 256).to_owned(),
        cancel_requested: false,
        created_at_ms: 0,
        updated_at_ms: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::pool::v1::StartSupervisorPoolOperationRequest;

    #[test]
    fn a_huge_drain_target_is_refused_without_being_echoed() {
        let request = StartSupervisorPoolOperationRequest {
            kind: proto::pool::v1::OperationKind::Drain as i32,
            target: "m".repeat(1 << 20),
            ..Default::default()
        };
        let Err(refused) = request_to_operation(&request, "operator", &crate::pool::View::default()) else {
            panic!("a 1 MiB target must be refused")
        };
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        assert!(refused.message().len() < 256, "{} bytes", refused.message().len());
    }
}
