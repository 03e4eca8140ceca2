//! The operator API (`pool.v1.SupervisorPool`): pool status, and drain and
//! rebalance operations (recorded here by any replica, run by the coordinator:
//! see `operations`) and their dry runs (planned over a fresh read, never recorded).
//! Authenticated with an operator token carrying the platform-admin role. The status stream
//! (`WatchSupervisorPool`) is in `watch`.

mod watch;

use std::sync::Arc;
use std::time::Duration;

use tracing::info;

use proto::pool::v1::supervisor_pool_server::SupervisorPool;
use proto::pool::v1::{
    CancelSupervisorPoolOperationRequest, CancelSupervisorPoolOperationResponse, GetSupervisorPoolStatusRequest,
    GetSupervisorPoolStatusResponse, StartSupervisorPoolOperationRequest, StartSupervisorPoolOperationResponse,
    WatchSupervisorPoolRequest,
};
use proto::trust::{Claims, Kind, OperatorClaims};
use tonic::{Request, Response, Status};

use crate::auth::bearer;
use crate::operations;
use crate::replica::Replica;
use crate::store::{self, OperationPhase};
use crate::summary;
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
        let op = operations::from_request(request, requested_by, &view)?;
        let served_by = self.replica.name.clone();
        // Wave after wave over the whole pool: off the runtime's threads.
        let plan = tokio::task::spawn_blocking(move || summary::plan(&view, &op, &served_by))
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
        // The builds are a part of the answer the pool's state does not depend on.
        let builds = store.builds().await.unwrap_or_default();
        Ok(Response::new(summary::status(
            &view,
            lease.as_ref(),
            &builds,
            &self.replica.name,
        )))
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
        let op = operations::from_request(&request, &requested_by, &view)?;
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
            operation: Some(summary::operation(&operation)),
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
            operation: Some(summary::operation(&applied)),
        }))
    }
}

/// How long a cancellation waits for the coordinator to apply it before answering with the
/// operation as recorded (its phase still open, `cancel_requested` set).
pub const CANCEL_WAIT: Duration = Duration::from_secs(3);
