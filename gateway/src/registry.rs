//! The instance registry (`registry.v1.InstanceRegistry`), served by every
//! replica: a sidecar registers its instance (the desired set is durable in
//! the store), deregisters it when the workload ends, and reports a missed
//! recovery deadline. Authenticated with the namespace's instance token.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use proto::common::v1::{InstanceRef, RouteDirectoryEntry};
use proto::registry::v1::instance_registry_server::InstanceRegistry;
use proto::registry::v1::{
    DeregisterRequest, DeregisterResponse, RecoveryFailedRequest, RecoveryFailedResponse, RegisterRequest,
    RegisterResponse,
};
use proto::trust::Kind;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::auth::token_namespace;
use crate::placement::{self, Decision};
use crate::registration::{Binding, Material};
use crate::replica::Replica;
use crate::store::{Registered, Registration, SecretBytes};

#[derive(Clone)]
pub struct Registry {
    replica: Arc<Replica>,
}

impl Registry {
    pub fn new(replica: Arc<Replica>) -> Self {
        Self { replica }
    }

    /// Authenticate and check that the token's namespace owns `instance`.
    async fn authorize<T: Sync>(
        &self,
        request: &Request<T>,
        instance: Option<&InstanceRef>,
    ) -> Result<InstanceRef, Status> {
        let principal = self.replica.keys.verify_request(Kind::Instance, request).await?;
        let namespace = token_namespace(&principal)?;
        let instance = instance.ok_or_else(|| Status::invalid_argument("the request names no instance"))?;
        if instance.namespace != namespace {
            return Err(Status::permission_denied("the token is for another namespace"));
        }
        Ok(instance.clone())
    }
}

/// Routes are printable ASCII without whitespace, bounded.
pub fn check_route(route: &str) -> Result<(), Status> {
    let ok = !route.is_empty() && route.len() <= proto::MAX_ROUTE_BYTES && route.bytes().all(|b| b.is_ascii_graphic());
    if ok {
        Ok(())
    } else {
        Err(Status::invalid_argument(
            "the route is empty, too long or not printable ASCII",
        ))
    }
}

fn check_instance(instance: &InstanceRef) -> Result<(), Status> {
    let bounded = |s: &str, max: usize| !s.is_empty() && s.len() <= max;
    if bounded(&instance.namespace, 63) && bounded(&instance.name, 253) && bounded(&instance.uid, 64) {
        Ok(())
    } else {
        Err(Status::invalid_argument(
            "the instance needs a namespace (<= 63), name (<= 253) and uid (<= 64)",
        ))
    }
}

#[tonic::async_trait]
impl InstanceRegistry for Registry {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<RegisterResponse>, Status> {
        let instance = self.authorize(&request, request.get_ref().instance.as_ref()).await?;
        let request = request.into_inner();
        check_route(&request.route)?;
        check_instance(&instance)?;
        let binding = Binding {
            route: &request.route,
            namespace: &instance.namespace,
            name: &instance.name,
            uid: &instance.uid,
        };
        Material::decode(&request.registration_material, &binding)
            .map_err(|err| Status::invalid_argument(err.to_string()))?;
        let registration = Registration {
            route: request.route.clone(),
            namespace: instance.namespace.clone(),
            name: instance.name.clone(),
            uid: instance.uid.clone(),
            material: SecretBytes(request.registration_material),
        };
        let store = &self.replica.store;
        let generation = match store.register_instance(&registration).await {
            Ok(Registered::Desired { generation }) => generation,
            Ok(Registered::Withdrawn { .. }) => {
                return Err(Status::failed_precondition(
                    "this instance was withdrawn; start a new workload",
                ));
            }
            Ok(Registered::Replaced) => {
                return Err(Status::failed_precondition(
                    "a newer workload (another Pod UID) registered this route; this one cannot come back",
                ));
            }
            Err(err) => return Err(Status::unavailable(format!("cannot record the instance: {err}"))),
        };
        self.replica.wake.notify_one();
        info!(route = %request.route, generation, "instance registered");

        // A fresh read: the cached view may predate a member that just attached.
        let view = crate::pool::View::load(store)
            .await
            .map_err(|err| Status::unavailable(format!("cannot read the pool: {err}")))?;
        let assignment = view.current_assignment(&request.route);
        if assignment.is_none() {
            // Say now, with the pool's reason, when nobody can take it.
            let desired = BTreeSet::from([request.route.clone()]);
            let owners = BTreeMap::new();
            let mut candidates = view.candidates(&BTreeSet::new());
            for c in &mut candidates {
                let held = view
                    .assignments
                    .values()
                    .filter(|a| a.member == c.member && view.holds_desired(a))
                    .count();
                c.capacity = c.capacity.min(placement::MAX_INSTANCES_PER_MEMBER).saturating_sub(held);
            }
            if let Some(Decision::Unplaced { reason, .. }) = placement::plan(&desired, &owners, &candidates).pop() {
                return Err(Status::resource_exhausted(format!(
                    "no pool member can take the instance: {reason}"
                )));
            }
        }
        let owner = assignment.map(|a| RouteDirectoryEntry {
            route: a.route.clone(),
            member: a.member.clone(),
            process_id: a.process_id.clone(),
            runtime_address: view
                .live_member(&a.member)
                .map(|m| m.runtime_address.clone())
                .unwrap_or_default(),
            term: u64::try_from(a.term).unwrap_or(0),
        });
        Ok(Response::new(RegisterResponse {
            instance: Some(InstanceRef {
                generation: u64::try_from(generation).unwrap_or(0),
                ..instance
            }),
            term: owner.as_ref().map_or(0, |o| o.term),
            owner,
            recovery_deadline_ms: self.replica.recovery_deadline_ms,
        }))
    }

    async fn deregister(&self, request: Request<DeregisterRequest>) -> Result<Response<DeregisterResponse>, Status> {
        let instance = self.authorize(&request, request.get_ref().instance.as_ref()).await?;
        let request = request.into_inner();
        check_route(&request.route)?;
        let withdrawn = self
            .replica
            .store
            .withdraw_instance(&request.route, &instance.uid)
            .await
            .map_err(|err| Status::unavailable(format!("cannot withdraw the instance: {err}")))?;
        // A withdrawal carrying another workload's uid (an older Pod of the same name) is a
        // no-op: the store withdraws only the registered uid.
        if withdrawn {
            info!(route = %request.route, reason = %bounded(&request.reason, 256), "instance withdrawn");
            self.replica.wake.notify_one();
        }
        Ok(Response::new(DeregisterResponse {}))
    }

    async fn report_recovery_failed(
        &self,
        request: Request<RecoveryFailedRequest>,
    ) -> Result<Response<RecoveryFailedResponse>, Status> {
        let instance = self.authorize(&request, request.get_ref().instance.as_ref()).await?;
        let request = request.into_inner();
        check_route(&request.route)?;
        // Only the workload registered under the route now may report for it: a replaced
        // one (an older Pod of the same name) changes nothing.
        let current = self
            .replica
            .store
            .instance(&request.route)
            .await
            .map_err(|err| Status::unavailable(format!("cannot read the instance: {err}")))?;
        if current.is_none_or(|c| c.uid != instance.uid) {
            return Err(Status::failed_precondition(
                "another workload (Pod UID) is registered under this route",
            ));
        }
        warn!(
            route = %request.route,
            fence_term = request.fence_term,
            attempts = request.attempts,
            reason = %bounded(&request.reason, 512),
            "SupervisorRecoveryFailed: the sidecar missed its recovery deadline and stopped the workload"
        );
        // Withdrawn with the reason: the coordinator's Kubernetes writer, on whichever
        // replica holds the lease, records the Event on the Pod from the pool view. A
        // repeated report (a lost answer) changes nothing.
        let fence_term = i64::try_from(request.fence_term).ok().filter(|t| *t > 0);
        let withdrawn = self
            .replica
            .store
            .report_recovery_failed(&request.route, &instance.uid, fence_term)
            .await
            .map_err(|err| Status::unavailable(format!("cannot withdraw the instance: {err}")))?;
        if withdrawn {
            self.replica.wake.notify_one();
        }
        Ok(Response::new(RecoveryFailedResponse {}))
    }
}

fn bounded(text: &str, max: usize) -> String {
    text.chars().take(max).collect()
}
