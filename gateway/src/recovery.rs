//! The gateway's grant and activation RPCs (`recovery.v1.SupervisorRecovery`),
//! served by every replica. A grant is minted once per reserved term (the
//! store's ledger refuses a second one, even after a lost response); an
//! activation is a compare-and-set on the assignment that also checks the
//! receipt's MAC, its binding to the grant, and the workload checkpoint.
//! Neither is ever retried by the gateway.

use std::sync::Arc;

use proto::common::v1::InstanceRef;
use proto::recovery::v1::supervisor_recovery_server::SupervisorRecovery;
use proto::recovery::v1::{
    ActivateRequest, ActivateResponse, ActivationProof, IssueGrantRequest, IssueGrantResponse, Receipt,
    TrustBundleRequest, TrustBundleResponse,
};
use proto::registration::{Binding, Material};
use proto::timing::MAX_GRANT_LIFETIME;
use proto::trust::{self, GrantClaims, InstanceClaim, Kind, ProofClaims};
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::input::check_route;
use crate::replica::Replica;
use crate::store::{self, Activation, Checkpoint, GrantRecord, InstanceRecord, OwnershipTerm};

/// Longest compact grant accepted back in `Activate`.
const MAX_GRANT_BYTES: usize = 4096;

#[derive(Clone)]
pub struct Recovery {
    replica: Arc<Replica>,
}

impl Recovery {
    pub fn new(replica: Arc<Replica>) -> Self {
        Self { replica }
    }

    /// Count a refusal for acting as another member.
    fn denied<T>(&self, check: Result<T, Status>) -> Result<T, Status> {
        if check.as_ref().is_err_and(|s| s.code() == tonic::Code::PermissionDenied) {
            self.replica.metrics.call_denied();
        }
        check
    }

    /// The registered instance of `route`; a withdrawn one only when
    /// `withdrawn_too` (a reserved candidate still needs its grant to make
    /// the sidecar accept the stop).
    async fn instance(&self, route: &str, withdrawn_too: bool) -> Result<InstanceRecord, Status> {
        match self.replica.store.instance(route).await {
            Ok(Some(instance)) if withdrawn_too || !instance.withdrawn => Ok(instance),
            Ok(_) => Err(Status::not_found("no such instance is registered")),
            Err(err) => Err(unavailable(err)),
        }
    }
}

fn unavailable(err: store::Error) -> Status {
    Status::unavailable(format!("store unavailable: {err}"))
}

/// A store refusal as the caller sees it: what the store records as another member's is
/// PERMISSION_DENIED, a precondition that no longer holds FAILED_PRECONDITION.
fn refused(err: store::Error) -> Status {
    match err {
        store::Error::Conflict { detail, .. } => Status::failed_precondition(detail),
        store::Error::Denied { detail, .. } => Status::permission_denied(detail),
        other => unavailable(other),
    }
}

fn claim(instance: &InstanceRecord) -> InstanceClaim {
    InstanceClaim {
        namespace: instance.namespace.clone(),
        name: instance.name.clone(),
        uid: instance.uid.clone(),
        generation: instance.generation,
    }
}

fn instance_ref(instance: &InstanceRecord) -> InstanceRef {
    crate::pool::instance_ref(instance)
}

/// The receipt names exactly this instance.
fn same_instance(receipt: &Receipt, instance: &InstanceRecord) -> bool {
    receipt.instance.as_ref() == Some(&instance_ref(instance))
}

#[tonic::async_trait]
impl SupervisorRecovery for Recovery {
    async fn issue_grant(&self, request: Request<IssueGrantRequest>) -> Result<Response<IssueGrantResponse>, Status> {
        let caller = self.replica.keys.member(&request).await?;
        let request = request.into_inner();
        check_route(&request.route)?;
        // A member asks for its own grants only.
        self.denied(caller.is(&request.member))?;
        if request.member.is_empty() || request.process_id.is_empty() || request.term == 0 {
            return Err(Status::invalid_argument(
                "a grant needs a term, a member and a process_id",
            ));
        }
        let term = OwnershipTerm::from_wire(request.term).map_err(|err| Status::invalid_argument(err.to_string()))?;
        crate::refusals::record(crate::refusals::About {
            route: Some(&request.route),
            term: Some(request.term),
            ..Default::default()
        });
        let instance = self.instance(&request.route, true).await?;
        // Bound to what the store records, in the transaction that records the grant: the
        // reservation is the caller's member's, for the process the store records as that
        // member's live one (and the one the request names). Not to the request's identifiers:
        // every member reads every owner's process id in its route directory.
        let member = caller.member.clone();
        let claims = GrantClaims {
            route: request.route.clone(),
            instance: claim(&instance),
            term: request.term,
            member: member.clone(),
            process_id: request.process_id.clone(),
        };
        let keyring = self.replica.keys.keyring();
        let minted = keyring
            .mint(Kind::RecoveryGrant, &request.route, MAX_GRANT_LIFETIME, &claims)
            .map_err(|err| Status::unavailable(format!("cannot sign the grant: {err}")))?;
        let record = GrantRecord {
            route: request.route.clone(),
            term,
            jti: minted.jti.clone(),
            member: member.clone(),
            process_id: request.process_id.clone(),
            digest: proto::sha256(minted.token.as_bytes()),
            expires_at_ms: minted.expires_at_ms,
        };
        self.denied(self.replica.store.issue_grant(&record).await.map_err(refused))?;
        info!(route = %request.route, term = term.get(), %member, grant = %minted.jti, "recovery grant issued");
        Ok(Response::new(IssueGrantResponse {
            grant: minted.token,
            grant_id: minted.jti,
            expires_at_ms: minted.expires_at_ms,
            instance: Some(instance_ref(&instance)),
        }))
    }

    async fn activate(&self, request: Request<ActivateRequest>) -> Result<Response<ActivateResponse>, Status> {
        let caller = self.replica.keys.member(&request).await?;
        let request = request.into_inner();
        let receipt = request
            .receipt
            .ok_or_else(|| Status::invalid_argument("activation needs a receipt"))?;
        if request.grant.len() > MAX_GRANT_BYTES {
            return Err(Status::invalid_argument("the grant is too large"));
        }
        check_route(&receipt.route)?;
        crate::refusals::record(crate::refusals::About {
            route: Some(&receipt.route),
            term: Some(receipt.term),
            ..Default::default()
        });
        let digest = proto::sha256(request.grant.as_bytes());
        if receipt.grant_digest != digest {
            return Err(Status::failed_precondition("the receipt is not bound to this grant"));
        }
        // The grant must be ours and name what the receipt names.
        let grant: trust::Claims<GrantClaims> = self
            .replica
            .keys
            .verify_claims(Kind::RecoveryGrant, &request.grant)
            .await
            .map_err(|err| Status::failed_precondition(format!("grant refused: {err}")))?;
        if grant.jti != receipt.grant_id || grant.extra.route != receipt.route || grant.extra.term != receipt.term {
            return Err(Status::failed_precondition("the receipt does not match its grant"));
        }
        // Only the member the grant was issued to completes its activation.
        self.denied(caller.is(&grant.extra.member))?;
        let instance = self.instance(&receipt.route, false).await?;
        if !same_instance(&receipt, &instance) {
            return Err(Status::failed_precondition("the receipt names another instance"));
        }
        let binding = Binding {
            route: &instance.route,
            namespace: &instance.namespace,
            name: &instance.name,
            uid: &instance.uid,
        };
        let receipt_key = Material::decode(&instance.material.0, &binding)
            .and_then(|m| m.receipt_key())
            .map_err(|_| Status::failed_precondition("the instance's registration material is unusable"))?;
        if !receipt.verify_mac(&receipt_key) {
            warn!(route = %receipt.route, term = receipt.term, "receipt MAC does not verify");
            return Err(Status::permission_denied(
                "the receipt did not come from this instance's sidecar",
            ));
        }
        let workload = receipt.workload.clone().unwrap_or_default();
        let checkpoint = Checkpoint::from_wire(&workload);
        let term = OwnershipTerm::from_wire(receipt.term).map_err(|err| Status::invalid_argument(err.to_string()))?;
        // The store checks the reservation and the grant row are the caller's too.
        let activation = Activation {
            route: receipt.route.clone(),
            term,
            member: caller.member.clone(),
            process_id: grant.extra.process_id.clone(),
            jti: grant.jti.clone(),
            digest,
            workload: checkpoint,
        };
        let activated_at_ms = self.denied(self.replica.store.activate(activation).await.map_err(refused))?;
        self.replica.wake.notify_one();
        info!(route = %receipt.route, term = term.get(), member = %grant.extra.member, pid = workload.pid, "term activated");

        let claims = ProofClaims {
            route: receipt.route.clone(),
            instance: claim(&instance),
            term: receipt.term,
            member: grant.extra.member.clone(),
            process_id: grant.extra.process_id.clone(),
            grant_id: grant.jti.clone(),
        };
        let proof = self
            .replica
            .keys
            .keyring()
            .mint(
                Kind::ActivationProof,
                &receipt.route,
                trust::MAX_PROOF_LIFETIME,
                &claims,
            )
            .map_err(|err| Status::unavailable(format!("activated, but cannot sign the proof: {err}")))?;
        Ok(Response::new(ActivateResponse {
            activation: Some(ActivationProof {
                route: receipt.route,
                instance: Some(instance_ref(&instance)),
                term: receipt.term,
                activated_at_ms,
                proof: proof.token,
                grant_id: grant.jti,
            }),
        }))
    }

    async fn trust_bundle(
        &self,
        request: Request<TrustBundleRequest>,
    ) -> Result<Response<TrustBundleResponse>, Status> {
        let keys = &self.replica.keys;
        if keys.member(&request).await.is_err() {
            keys.instance(&request).await?;
        }
        let keyring = keys.keyring();
        Ok(Response::new(TrustBundleResponse {
            jwks_json: keyring.trust_bundle().to_jwks(),
            issuer: keys.issuer().to_owned(),
            refresh_after_ms: 60_000,
        }))
    }
}
