//! The instance registry (`registry.v1.InstanceRegistry`), served by every
//! replica: a sidecar registers its instance (the desired set is durable in
//! the store), deregisters it when the workload ends, and reports a missed
//! recovery deadline. Each call acts only on the caller's own route and
//! workload ([`InstanceCaller`]); a namespace's registered instances are
//! limited by its quota.

use std::sync::Arc;

use proto::common::v1::{InstanceRef, RouteDirectoryEntry};
use proto::registry::v1::instance_registry_server::InstanceRegistry;
use proto::registry::v1::{
    DeregisterRequest, DeregisterResponse, RecoveryFailedRequest, RecoveryFailedResponse, RegisterRequest,
    RegisterResponse,
};
use proto::timing::INSTANCE_TOKEN_LIFETIME;
use proto::trust::{self, InstanceTokenClaims, Kind};
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::auth::InstanceCaller;
use crate::input::check_route;
use crate::registration::{Binding, Material};
use crate::replica::Replica;
use crate::store::{Checkpoint, OwnershipTerm, Registered, Registration, Resume, SecretBytes, builds};

#[derive(Clone)]
pub struct Registry {
    replica: Arc<Replica>,
}

impl Registry {
    pub fn new(replica: Arc<Replica>) -> Self {
        Self { replica }
    }

    /// Authenticate, and check that the call is about the caller's own route and workload.
    async fn authorize<T: Sync>(
        &self,
        request: &Request<T>,
        route: &str,
        instance: Option<&InstanceRef>,
    ) -> Result<(InstanceCaller, InstanceRef), Status> {
        let caller = self.replica.keys.instance(request).await?;
        let instance = instance.ok_or_else(|| Status::invalid_argument("the request names no instance"))?;
        if let Err(denied) = caller.owns(route, instance) {
            self.replica.metrics.call_denied();
            return Err(denied);
        }
        Ok((caller, instance.clone()))
    }

    /// The instance token of a registered workload: bound to its route and Pod UID.
    fn instance_token(&self, caller: &InstanceCaller, uid: &str) -> Result<crate::tokens::Minted, Status> {
        let claims = InstanceTokenClaims {
            namespace: caller.namespace.clone(),
            name: caller.name.clone(),
            uid: Some(uid.to_owned()),
        };
        self.replica
            .keys
            .keyring()
            .mint(
                Kind::Instance,
                &trust::instance_subject(&caller.route),
                INSTANCE_TOKEN_LIFETIME,
                &claims,
            )
            .map_err(|err| Status::unavailable(format!("cannot sign the instance token: {err}")))
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
        let (caller, instance) = self
            .authorize(&request, &request.get_ref().route, request.get_ref().instance.as_ref())
            .await?;
        let request = request.into_inner();
        check_route(&request.route)?;
        check_instance(&instance)?;
        let mut resume = resume(&instance, &request)?;
        let fence = beyond_a_dead_reservation(
            &self.replica.view.borrow(),
            &request.route,
            resume.fence,
            resume.holder.as_ref(),
        );
        if fence != resume.fence {
            // Not the holder's term: that number was reserved again for another.
            (resume.fence, resume.holder) = (fence, None);
        }
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
        // Minted first: an answer that cannot carry its token (no signing key yet, at the
        // pool's very start) must store nothing either.
        let token = self.instance_token(&caller, &instance.uid)?;
        let limit = self.replica.quota.limit(&instance.namespace)?;
        let store = &self.replica.store;
        let mut registered = store.register_resuming(&registration, Some(limit), &resume).await;
        // The same Pod asking for the generation after its withdrawn one: its workload's
        // container restarted, and the new process is supervised from scratch.
        // A lost deregistration leaves the row desired: the next generation is asked for all
        // the same.
        if let Ok(Registered::Withdrawn { generation } | Registered::Desired { generation }) = registered
            && i64::try_from(instance.generation).is_ok_and(|asked| asked > generation)
        {
            registered = store
                .revive_instance_within(&registration, generation, Some(limit))
                .await;
            if let Ok(Registered::Desired { generation }) = registered {
                info!(route = %request.route, generation, "a restarted workload registered again");
            }
        }
        let generation = match registered {
            Ok(Registered::OverQuota { registered, limit }) => {
                warn!(namespace = %instance.namespace, registered, limit, route = %request.route,
                      "registration refused: the namespace's instance quota is used up");
                return Err(Status::resource_exhausted(format!(
                    "namespace {} has {registered} registered instances, its limit is {limit}; \
                     nothing was stored",
                    instance.namespace
                )));
            }
            Ok(Registered::Desired { generation }) => generation,
            Ok(Registered::Withdrawn { generation }) => {
                return Err(Status::failed_precondition(format!(
                    "this instance (generation {generation}) was withdrawn; register generation {} for a new workload process",
                    generation + 1
                )));
            }
            Ok(Registered::Replaced) => {
                return Err(Status::failed_precondition(
                    "a newer workload (another Pod UID) registered this route; this one cannot come back",
                ));
            }
            Err(err) => return Err(Status::unavailable(format!("cannot record the instance: {err}"))),
        };
        self.replica.wake.notify_one();
        let sidecar = builds::sanitized(&request.build_version);
        info!(route = %request.route, generation, %sidecar, "instance registered");
        // The sidecar's build, for the status: bounded, never a reason to refuse.
        let build = store.record_build(builds::Component::Sidecar, &request.route, sidecar);
        if !matches!(tokio::time::timeout(builds::RECORD_TIMEOUT, build).await, Ok(Ok(()))) {
            tracing::debug!(route = %request.route, "the sidecar's build was not recorded");
        }

        // A route new to the pool, in a pool that will place one more: answered from the
        // published view at once (nothing to say about its owner yet). Otherwise from a view
        // read after the registration: the published one may predate a member that just
        // attached, or hold the assignment of a workload this one replaced.
        let published = self.replica.view.borrow().clone();
        let view = if published.read_at.is_some()
            && !published.instances.contains_key(&request.route)
            && crate::room::takes_one_more(&published)
        {
            published
        } else {
            self.replica
                .fresh_view()
                .await
                .map_err(|err| Status::unavailable(format!("cannot read the pool: {err}")))?
        };
        let assignment = view.current_assignment(&request.route);
        if assignment.is_none()
            && let Some(reason) = crate::room::unplaced(&view).get(&request.route)
        {
            // Said now, with the pool's reason (the coordinator's plan over the same view).
            return Err(Status::resource_exhausted(format!(
                "no pool member can take the instance: {reason}"
            )));
        }
        let owner = assignment.map(|a| RouteDirectoryEntry {
            route: a.route.clone(),
            member: a.member.clone(),
            process_id: a.process_id.clone(),
            runtime_address: view
                .live_member(&a.member)
                .map(|m| m.runtime_address.clone())
                .unwrap_or_default(),
            term: a.term.get(),
        });
        Ok(Response::new(RegisterResponse {
            instance: Some(InstanceRef {
                generation: u64::try_from(generation).unwrap_or(0),
                ..instance
            }),
            term: owner.as_ref().map_or(0, |o| o.term),
            owner,
            recovery_deadline_ms: self.replica.recovery_deadline_ms,
            instance_token: token.token,
            instance_token_expires_at_ms: token.expires_at_ms,
        }))
    }

    async fn deregister(&self, request: Request<DeregisterRequest>) -> Result<Response<DeregisterResponse>, Status> {
        let (_, instance) = self
            .authorize(&request, &request.get_ref().route, request.get_ref().instance.as_ref())
            .await?;
        let request = request.into_inner();
        check_route(&request.route)?;
        let withdrawn = self
            .replica
            .store
            .withdraw_instance(&request.route, &instance.uid, generation_of(&instance))
            .await
            .map_err(|err| Status::unavailable(format!("cannot withdraw the instance: {err}")))?;
        // A withdrawal carrying another workload's uid (an older Pod of the same name) is a
        // no-op: the store withdraws only the registered uid.
        if withdrawn {
            info!(route = %request.route, reason = %plumbing::text::bounded(&request.reason, 256), "instance withdrawn");
            self.replica.wake.notify_one();
        }
        Ok(Response::new(DeregisterResponse {}))
    }

    async fn report_recovery_failed(
        &self,
        request: Request<RecoveryFailedRequest>,
    ) -> Result<Response<RecoveryFailedResponse>, Status> {
        let (_, instance) = self
            .authorize(&request, &request.get_ref().route, request.get_ref().instance.as_ref())
            .await?;
        let request = request.into_inner();
        check_route(&request.route)?;
        // 0: the sidecar never activated a term. Above the store's range: refused, not dropped.
        let fence_term = OwnershipTerm::from_wire(request.fence_term)
            .map_err(|err| Status::invalid_argument(format!("fence_term: {err}")))?;
        let fence_term = Some(fence_term).filter(|t| *t > OwnershipTerm::ZERO);
        // Only the workload registered under the route now may report for it: a replaced
        // one (an older Pod of the same name) changes nothing.
        let current = self
            .replica
            .store
            .instance(&request.route)
            .await
            .map_err(|err| Status::unavailable(format!("cannot read the instance: {err}")))?;
        match current {
            None => {
                return Err(Status::not_found(
                    "the registry does not know this instance (its store was emptied or restored without it, \
                     and the sidecar has not registered again since): nothing was recorded",
                ));
            }
            Some(c) if c.uid != instance.uid => {
                return Err(Status::failed_precondition(
                    "another workload (Pod UID) is registered under this route",
                ));
            }
            Some(_) => {}
        }
        warn!(
            route = %request.route,
            fence_term = request.fence_term,
            attempts = request.attempts,
            reason = %plumbing::text::bounded(&request.reason, 512),
            "SupervisorRecoveryFailed: the sidecar missed its recovery deadline and stopped the workload"
        );
        // Withdrawn with the reason: the coordinator's Kubernetes writer, on whichever
        // replica holds the lease, records the Event on the Pod from the pool view. A
        // repeated report (a lost answer) changes nothing.
        let withdrawn = self
            .replica
            .store
            .report_recovery_failed(&request.route, &instance.uid, generation_of(&instance), fence_term)
            .await
            .map_err(|err| Status::unavailable(format!("cannot withdraw the instance: {err}")))?;
        if withdrawn {
            self.replica.metrics.recovery_failed_reported();
            self.replica.wake.notify_one();
        }
        Ok(Response::new(RecoveryFailedResponse {}))
    }
}

/// The highest generation and fence term a sidecar may claim: far above any a pool reaches
/// (one handoff a millisecond for 8,000 years), far below where the next term or generation
/// would overflow. A claim is the caller's own route's only, but a claim near `i64::MAX`
/// would leave the route no next term.
const MAX_CLAIMED: u64 = 1 << 48;

/// Where the sidecar says its instance stands, checked: bounded claims, a workload identity
/// as the contract shapes it (a 32-byte digest, or none).
fn resume(instance: &InstanceRef, request: &RegisterRequest) -> Result<Resume, Status> {
    if instance.generation > MAX_CLAIMED || request.fence_term > MAX_CLAIMED {
        return Err(Status::invalid_argument(format!(
            "generation and fence_term are at most {MAX_CLAIMED}"
        )));
    }
    let workload = request.workload.as_ref().map(Checkpoint::from_wire).unwrap_or_default();
    if !matches!(workload.exe_digest.len(), 0 | 32) {
        return Err(Status::invalid_argument("workload.exe_digest is 32 bytes or empty"));
    }
    let holder = match (request.fence_member.as_str(), request.fence_process_id.as_str()) {
        ("", "") => None,
        (member, process_id)
            if request.fence_term > 0
                && [member, process_id]
                    .iter()
                    .all(|s| !s.is_empty() && s.len() <= MAX_HOLDER_BYTES) =>
        {
            Some((member.to_owned(), process_id.to_owned()))
        }
        _ => {
            return Err(Status::invalid_argument(format!(
                "fence_member and fence_process_id are both set (at most {MAX_HOLDER_BYTES} bytes each, with a \
                 fence_term) or both empty"
            )));
        }
    };
    Ok(Resume {
        generation: i64::try_from(instance.generation).unwrap_or(0),
        fence: OwnershipTerm::from_wire(request.fence_term)
            .map_err(|err| Status::invalid_argument(format!("fence_term: {err}")))?,
        workload,
        holder,
    })
}

/// The longest member name or process id a sidecar may name as its fence's holder.
const MAX_HOLDER_BYTES: usize = 256;

/// The term the registration records as used on `route` for a sidecar whose fence activated
/// `fence` (with `holder`, when it names one): the fence itself, or the term above it when the
/// store shows the route reserved at exactly that term for another process. That reservation
/// is not the sidecar's term — the sidecar activated its own at that number with a member
/// whose reservation the store lost, and the number was reserved again — so the sidecar never
/// takes it; recorded as used, it is recovered above. Reserved for the very process the sidecar
/// names, it is the sidecar's own term whose activation is not written yet (or was lost:
/// `forgotten`, `Lost::Activation`).
fn beyond_a_dead_reservation(
    view: &crate::pool::View,
    route: &str,
    fence: OwnershipTerm,
    holder: Option<&(String, String)>,
) -> OwnershipTerm {
    match view.current_assignment(route) {
        Some(a)
            if fence > OwnershipTerm::ZERO
                && a.term == fence
                && a.phase == crate::store::AssignmentPhase::Reserved
                && holder.is_none_or(|(member, process_id)| *member != a.member || *process_id != a.process_id) =>
        {
            fence.next()
        }
        _ => fence,
    }
}

/// The generation a sidecar names (0, from a sidecar that does not know it yet: any).
fn generation_of(instance: &InstanceRef) -> Option<i64> {
    i64::try_from(instance.generation).ok().filter(|g| *g > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::AssignmentPhase;

    #[test]
    fn a_fence_holder_is_a_bounded_member_and_process_named_with_a_fence_or_none() {
        let instance = InstanceRef::default();
        let named = |fence_term: u64, member: &str, process_id: &str| RegisterRequest {
            fence_term,
            fence_member: member.into(),
            fence_process_id: process_id.into(),
            ..RegisterRequest::default()
        };
        let holder = |r: &RegisterRequest| resume(&instance, r).map(|r| r.holder);
        assert_eq!(
            holder(&named(5, "m1", "p1")).unwrap(),
            Some(("m1".to_owned(), "p1".to_owned()))
        );
        assert_eq!(
            holder(&named(5, "", "")).unwrap(),
            None,
            "a sidecar of an earlier build"
        );
        assert_eq!(holder(&named(0, "", "")).unwrap(), None);
        let long = "m".repeat(MAX_HOLDER_BYTES + 1);
        for refused in [
            named(0, "m1", "p1"),
            named(5, "m1", ""),
            named(5, "", "p1"),
            named(5, &long, "p1"),
        ] {
            let err = holder(&refused).unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{refused:?}");
        }
    }

    #[test]
    fn a_reservation_at_the_sidecars_activated_term_is_recorded_as_used() {
        // ns/a is m1's at term 3.
        let mut v = crate::pool::tests::view();
        let term = OwnershipTerm::new;
        assert_eq!(
            beyond_a_dead_reservation(&v, "ns/a", term(3), None),
            term(3),
            "active: the sidecar's own"
        );
        v.assignments.get_mut("ns/a").unwrap().phase = AssignmentPhase::Reserved;
        assert_eq!(
            beyond_a_dead_reservation(&v, "ns/a", term(3), None),
            term(4),
            "reserved again at its number"
        );
        assert_eq!(
            beyond_a_dead_reservation(&v, "ns/a", term(2), None),
            term(2),
            "a takeover above the fence"
        );
        assert_eq!(beyond_a_dead_reservation(&v, "ns/a", term(0), None), term(0));
        assert_eq!(beyond_a_dead_reservation(&v, "ns/none", term(3), None), term(3));
        let named = |member: &str| Some((member.to_owned(), format!("{member}-p")));
        assert_eq!(
            beyond_a_dead_reservation(&v, "ns/a", term(3), named("m1").as_ref()),
            term(3),
            "reserved for the process the sidecar names: its own term, not yet activated in the store"
        );
        assert_eq!(
            beyond_a_dead_reservation(&v, "ns/a", term(3), named("m2").as_ref()),
            term(4),
            "reserved for another"
        );
    }
}
