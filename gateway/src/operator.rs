//! The operator API (`pool.v1.SupervisorPool`): pool status for now; drain
//! and rebalance operations come with the operations issue. Authenticated
//! with an operator token carrying the platform-admin role.

use std::sync::Arc;

use proto::pool::v1::supervisor_pool_server::SupervisorPool;
use proto::pool::v1::{
    CancelSupervisorPoolOperationRequest, CancelSupervisorPoolOperationResponse, Coordinator,
    GetSupervisorPoolStatusRequest, GetSupervisorPoolStatusResponse, InstanceSummary, Member, MemberState,
    StartSupervisorPoolOperationRequest, StartSupervisorPoolOperationResponse,
};
use proto::trust::{Claims, Kind, OperatorClaims};
use tonic::{Request, Response, Status};

use crate::auth::bearer;
use crate::pool::{View, instance_ref};
use crate::replica::Replica;
use crate::store::{self, AssignmentPhase, LeaseView, OperationKind, OperationPhase};
use crate::tokens::PLATFORM_ADMIN;

#[derive(Clone)]
pub struct Operator {
    replica: Arc<Replica>,
}

impl Operator {
    pub fn new(replica: Arc<Replica>) -> Self {
        Self { replica }
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
    let members = view
        .members
        .values()
        .map(|m| Member {
            name: m.member.clone(),
            process_id: m.process_id.clone(),
            state: if !m.is_live(view.now_ms) {
                MemberState::Gone
            } else if m.leaving {
                MemberState::Leaving
            } else {
                MemberState::Active
            } as i32,
            instance_count: u32::try_from(view.assignments.values().filter(|a| a.member == m.member).count())
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
            let a = view.assignments.get(&i.route);
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
                phase: r
                    .and_then(|r| proto::common::v1::InstancePhase::from_str_name(&r.phase))
                    .unwrap_or_default() as i32,
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

#[tonic::async_trait]
impl SupervisorPool for Operator {
    async fn get_supervisor_pool_status(
        &self,
        request: Request<GetSupervisorPoolStatusRequest>,
    ) -> Result<Response<GetSupervisorPoolStatusResponse>, Status> {
        self.authorize(&request).await?;
        let store = &self.replica.store;
        let unavailable = |err: store::Error| Status::unavailable(format!("cannot read the pool: {err}"));
        let view = View::load(store).await.map_err(unavailable)?;
        let lease = store.read_lease().await.map_err(unavailable)?;
        Ok(Response::new(status(&view, lease.as_ref(), &self.replica.name)))
    }

    async fn start_supervisor_pool_operation(
        &self,
        request: Request<StartSupervisorPoolOperationRequest>,
    ) -> Result<Response<StartSupervisorPoolOperationResponse>, Status> {
        self.authorize(&request).await?;
        Err(Status::unimplemented(
            "drain and rebalance operations are not available yet",
        ))
    }

    async fn cancel_supervisor_pool_operation(
        &self,
        request: Request<CancelSupervisorPoolOperationRequest>,
    ) -> Result<Response<CancelSupervisorPoolOperationResponse>, Status> {
        self.authorize(&request).await?;
        Err(Status::unimplemented(
            "drain and rebalance operations are not available yet",
        ))
    }
}
