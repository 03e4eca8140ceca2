//! The fence: the sidecar's control state for its instance and every decision over it. Pure:
//! no I/O, no clock (the caller passes the verification time), so each rule is unit-tested.
//!
//! State (runtime.proto, service comment): `activated` = the highest activated term, `floor`
//! = the lowest term still accepted (every term below is refused forever), `relinquished`,
//! plus the member process that activated `activated` (`owner`) and the last grant the
//! sidecar receipted (`receipted`), so that a re-presented grant gets the very same receipt.
//! Invariant: `floor >= activated`. Every mutation is persisted by the caller before anything
//! is sent (see `state_file`).

use proto::common::v1::{InstanceRef, WorkloadIdentity};
use proto::recovery::v1::Receipt;
use proto::runtime::v1::{ActivationConfirm, Attached};
use proto::trust::{self, Claims, Expectation, GrantClaims, InstanceClaim, Kind, ProofClaims, TrustBundle};
use serde::{Deserialize, Serialize};

use crate::receipt::{ReceiptKey, sha256};

/// Longest member name or process id the sidecar keeps.
const MAX_NAME_BYTES: usize = 256;

/// A member process presenting control (GrantPresentation.member/process_id).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Presenter {
    pub member: String,
    pub process_id: String,
}

/// The grant the sidecar receipted last.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Receipted {
    pub term: u64,
    pub grant_id: String,
    #[serde(with = "crate::codec::b64")]
    pub grant_digest: Vec<u8>,
    pub presenter: Presenter,
    #[serde(with = "crate::codec::message")]
    pub receipt: Receipt,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Fence {
    pub activated: u64,
    pub floor: u64,
    pub relinquished: bool,
    /// The member process that activated `activated` (from the activation proof).
    pub owner: Option<Presenter>,
    pub receipted: Option<Receipted>,
    /// The last recovery deadline received (Attached / ActivationConfirm), 0 = default.
    pub recovery_deadline_ms: u64,
}

/// The sidecar's own instance.
#[derive(Clone, Copy, Debug)]
pub struct Subject<'a> {
    pub route: &'a str,
    pub instance: &'a InstanceRef,
}

/// How signed grants and proofs are checked.
#[derive(Clone, Copy, Debug)]
pub struct Verifier<'a> {
    pub bundle: &'a TrustBundle,
    pub issuer: &'a str,
    /// Unix milliseconds.
    pub now_ms: i64,
}

/// Who sent a message, as the sidecar's streams know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role<'a> {
    /// The stream of the activated owner (activation confirmed or Attached on it).
    Owner,
    /// A stream on which this member process presented a grant the sidecar receipted.
    Candidate(&'a Presenter),
    /// Anything else.
    Other,
}

/// A grant the sidecar accepted.
#[derive(Clone, Debug, PartialEq)]
pub enum Accepted {
    /// Newly receipted: the caller persists the fence, closes every other stream, then sends.
    Fresh(Receipt),
    /// The grant it already receipted, from the same presenter: the same receipt again.
    Replay(Receipt),
}

impl Accepted {
    pub fn receipt(&self) -> &Receipt {
        match self {
            Accepted::Fresh(r) | Accepted::Replay(r) => r,
        }
    }
}

/// Why a control message was refused. A refusal never changes the fence.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("{0}")]
    Token(#[from] trust::Error),
    #[error("trust bundle unavailable: {0}")]
    Trust(String),
    #[error("it names another route")]
    Route,
    #[error("it names another instance")]
    Instance,
    #[error("term {term} is fenced (floor {floor}, activated {activated})")]
    Fenced { term: u64, floor: u64, activated: u64 },
    #[error("the presenter is not the member process the token names")]
    Presenter,
    #[error("grant {0} was already receipted")]
    Reused(String),
    #[error("no grant is receipted for term {0}")]
    NotReceipted(u64),
    #[error("the proof is for another grant")]
    OtherGrant,
    #[error("the confirmation's term differs from its proof's")]
    Mismatch,
    #[error("the activated term was relinquished")]
    Relinquished,
    #[error("not sent by the activated owner")]
    NotOwner,
    #[error("a field is out of bounds")]
    Bounds,
}

impl Fence {
    /// Step 2 of the takeover: verify a presented grant and, if it is acceptable, raise the
    /// floor to its term and issue the receipt. Re-presenting the receipted grant (same bytes,
    /// same presenter) returns the same receipt; every other failure changes nothing.
    pub fn present_grant(
        &mut self,
        verifier: &Verifier<'_>,
        me: &Subject<'_>,
        grant: &str,
        presenter: &Presenter,
        workload: &WorkloadIdentity,
        key: &ReceiptKey,
    ) -> Result<Accepted, Refusal> {
        if presenter.member.len() > MAX_NAME_BYTES || presenter.process_id.len() > MAX_NAME_BYTES {
            return Err(Refusal::Bounds);
        }
        let digest = sha256(grant.as_bytes());
        if let Some(receipted) = &self.receipted
            && receipted.grant_digest == digest
        {
            // Exactly the token verified before: single use, except for its own presenter.
            return if receipted.presenter == *presenter && receipted.term >= self.floor {
                Ok(Accepted::Replay(receipted.receipt.clone()))
            } else {
                Err(Refusal::Presenter)
            };
        }
        let claims: Claims<GrantClaims> = verifier.bundle.verify_at(
            grant,
            &Expectation::kind(Kind::RecoveryGrant, verifier.issuer),
            verifier.now_ms,
        )?;
        let g = &claims.extra;
        if claims.sub != me.route || g.route != me.route {
            return Err(Refusal::Route);
        }
        if !same_instance(&g.instance, me.instance) {
            return Err(Refusal::Instance);
        }
        if g.member != presenter.member || g.process_id != presenter.process_id {
            return Err(Refusal::Presenter);
        }
        if claims.jti.is_empty() || claims.jti.len() > MAX_NAME_BYTES {
            return Err(Refusal::Bounds);
        }
        if g.term < self.floor || g.term <= self.activated {
            return Err(self.fenced(g.term));
        }
        if self.receipted.as_ref().is_some_and(|r| r.grant_id == claims.jti) {
            return Err(Refusal::Reused(claims.jti));
        }
        let mut receipt = Receipt {
            route: me.route.to_owned(),
            instance: Some(me.instance.clone()),
            term: g.term,
            grant_id: claims.jti.clone(),
            grant_digest: digest.clone(),
            fenced_term: self.activated,
            workload: Some(workload.clone()),
            issued_at_ms: verifier.now_ms,
            mac: Vec::new(),
        };
        key.seal(&mut receipt);
        self.floor = g.term;
        self.receipted = Some(Receipted {
            term: g.term,
            grant_id: claims.jti,
            grant_digest: digest,
            presenter: presenter.clone(),
            receipt: receipt.clone(),
        });
        Ok(Accepted::Fresh(receipt))
    }

    /// Step 3: the candidate confirms activation. The proof must name this instance, the
    /// receipted grant and term (== floor), and the presenter of the confirming stream.
    /// Returns the activated term.
    pub fn confirm_activation(
        &mut self,
        verifier: &Verifier<'_>,
        me: &Subject<'_>,
        confirm: &ActivationConfirm,
        stream_presenter: Option<&Presenter>,
    ) -> Result<u64, Refusal> {
        let claims: Claims<ProofClaims> = verifier.bundle.verify_at(
            &confirm.proof,
            &Expectation::kind(Kind::ActivationProof, verifier.issuer),
            verifier.now_ms,
        )?;
        let p = &claims.extra;
        if claims.sub != me.route || p.route != me.route {
            return Err(Refusal::Route);
        }
        if !same_instance(&p.instance, me.instance) {
            return Err(Refusal::Instance);
        }
        if p.term != confirm.term {
            return Err(Refusal::Mismatch);
        }
        let receipted = self.receipted.as_ref().ok_or(Refusal::NotReceipted(p.term))?;
        if p.term != self.floor || receipted.term != p.term {
            return Err(self.fenced(p.term));
        }
        if p.grant_id != receipted.grant_id {
            return Err(Refusal::OtherGrant);
        }
        let prover = Presenter {
            member: p.member.clone(),
            process_id: p.process_id.clone(),
        };
        if prover != receipted.presenter || stream_presenter != Some(&prover) {
            return Err(Refusal::Presenter);
        }
        self.activated = p.term;
        self.relinquished = false;
        self.owner = Some(prover);
        self.recovery_deadline_ms = confirm.recovery_deadline_ms;
        Ok(p.term)
    }

    /// An existing owner resumes (answer to Attach/RecoveryHello): only for the activated,
    /// not relinquished term, with no higher grant receipted, from the process that activated it.
    pub fn accept_attached(&mut self, attached: &Attached) -> Result<(), Refusal> {
        if self.relinquished {
            return Err(Refusal::Relinquished);
        }
        if attached.term == 0 || attached.term != self.activated || self.floor != self.activated {
            return Err(self.fenced(attached.term));
        }
        if let Some(owner) = &self.owner
            && (owner.member != attached.member || owner.process_id != attached.process_id)
        {
            return Err(Refusal::NotOwner);
        }
        self.recovery_deadline_ms = attached.recovery_deadline_ms;
        Ok(())
    }

    /// Relinquish: only on the activated owner's stream, for the activated term.
    pub fn relinquish(&mut self, term: u64, role: Role<'_>) -> Result<(), Refusal> {
        if role != Role::Owner {
            return Err(Refusal::NotOwner);
        }
        if self.relinquished {
            return Err(Refusal::Relinquished);
        }
        if term == 0 || term != self.activated || self.floor != self.activated {
            return Err(self.fenced(term));
        }
        self.relinquished = true;
        Ok(())
    }

    /// Release: from the activated owner's stream for the activated term, or from the stream
    /// of the candidate whose grant is receipted, for that grant's term.
    pub fn accepts_release(&self, term: u64, role: Role<'_>) -> bool {
        match role {
            Role::Owner => term != 0 && term == self.activated && self.floor == self.activated && !self.relinquished,
            Role::Candidate(presenter) => self
                .receipted
                .as_ref()
                .is_some_and(|r| r.presenter == *presenter && r.term == term && term == self.floor),
            Role::Other => false,
        }
    }

    /// Whether a Redirect to an owner at `term` is worth following: never below the fence,
    /// and the activated term only while it is not relinquished.
    pub fn follows_redirect(&self, term: u64) -> bool {
        term != 0 && term >= self.floor && (term > self.activated || (term == self.activated && !self.relinquished))
    }

    /// The member process that activated the fence's term, while it holds it (not once it
    /// relinquished it): whom a registry that lost the route may give it back to.
    pub fn holder(&self) -> Option<&Presenter> {
        self.owner.as_ref().filter(|_| self.activated > 0 && !self.relinquished)
    }

    /// The highest receipted term not (yet) activated, 0 if none.
    pub fn pending_term(&self) -> u64 {
        if self.floor > self.activated { self.floor } else { 0 }
    }

    fn fenced(&self, term: u64) -> Refusal {
        Refusal::Fenced {
            term,
            floor: self.floor,
            activated: self.activated,
        }
    }
}

fn same_instance(claim: &InstanceClaim, instance: &InstanceRef) -> bool {
    claim.namespace == instance.namespace
        && claim.name == instance.name
        && claim.uid == instance.uid
        && u64::try_from(claim.generation).is_ok_and(|g| g == instance.generation && g != 0)
}

#[cfg(test)]
mod tests;
