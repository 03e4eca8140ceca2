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
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
mod tests {
    use super::*;
    use crate::testkit::*;
    use serde_json::json;

    fn me(instance: &InstanceRef) -> Subject<'_> {
        Subject { route: ROUTE, instance }
    }

    struct Harness {
        fence: Fence,
        bundle: TrustBundle,
        instance: InstanceRef,
        key: ReceiptKey,
        now_ms: i64,
    }

    impl Harness {
        fn new() -> Self {
            Self {
                fence: Fence::default(),
                bundle: bundle(),
                instance: instance(),
                key: ReceiptKey::from_bytes([3; 32]),
                now_ms: NOW_MS,
            }
        }

        fn present(&mut self, grant: &str, member: &str) -> Result<Accepted, Refusal> {
            let v = Verifier {
                bundle: &self.bundle,
                issuer: ISS,
                now_ms: self.now_ms,
            };
            self.fence.present_grant(
                &v,
                &me(&self.instance),
                grant,
                &presenter(member),
                &workload(),
                &self.key,
            )
        }

        fn confirm(&mut self, confirm: &ActivationConfirm, stream: &str) -> Result<u64, Refusal> {
            let v = Verifier {
                bundle: &self.bundle,
                issuer: ISS,
                now_ms: self.now_ms,
            };
            let p = presenter(stream);
            self.fence
                .confirm_activation(&v, &me(&self.instance), confirm, Some(&p))
        }

        /// Grant → receipt → proof for `term` by `member`.
        fn activate(&mut self, term: u64, member: &str) {
            let jti = format!("g{term}");
            self.present(&grant(term, member, &jti), member).unwrap();
            assert_eq!(self.confirm(&proof(term, member, &jti), member).unwrap(), term);
        }

        /// Presents a grant that must be refused, and checks the fence did not change.
        fn refuse(&mut self, grant: &str, member: &str) -> Refusal {
            let before = self.fence.clone();
            let err = self.present(grant, member).expect_err("must be refused");
            assert_eq!(self.fence, before);
            err
        }
    }

    #[test]
    fn first_placement_receipt_binds_the_grant_and_verifies() {
        let mut h = Harness::new();
        let token = grant(1, "m1", "g1");
        let Accepted::Fresh(receipt) = h.present(&token, "m1").unwrap() else {
            panic!("fresh")
        };
        assert_eq!(
            (receipt.term, receipt.fenced_term, receipt.grant_id.as_str()),
            (1, 0, "g1")
        );
        assert_eq!(receipt.grant_digest, sha256(token.as_bytes()));
        assert_eq!(receipt.workload, Some(workload()));
        assert_eq!(receipt.issued_at_ms, NOW_MS);
        assert!(h.key.verifies(&receipt));
        assert_eq!((h.fence.floor, h.fence.activated), (1, 0));
        assert_eq!(h.fence.pending_term(), 1);
        assert_eq!(h.confirm(&proof(1, "m1", "g1"), "m1").unwrap(), 1);
        assert_eq!((h.fence.floor, h.fence.activated), (1, 1));
        assert_eq!(h.fence.owner, Some(presenter("m1")));
        assert_eq!(h.fence.recovery_deadline_ms, 20_000);
    }

    #[test]
    fn term_ordering_accepts_only_higher_terms() {
        let mut h = Harness::new();
        h.activate(3, "m1");
        let e = h.refuse(&grant(3, "m2", "x3"), "m2");
        assert!(matches!(e, Refusal::Fenced { term: 3, .. }), "{e}");
        let e = h.refuse(&grant(2, "m2", "x2"), "m2");
        assert!(matches!(e, Refusal::Fenced { term: 2, .. }), "{e}");
        let Accepted::Fresh(r) = h.present(&grant(5, "m2", "g5"), "m2").unwrap() else {
            panic!("fresh")
        };
        assert_eq!((r.term, r.fenced_term), (5, 3));
        assert_eq!((h.fence.floor, h.fence.activated), (5, 3));
        // A lower, not yet receipted term is below the floor now.
        let e = h.refuse(&grant(4, "m3", "g4"), "m3");
        assert!(matches!(e, Refusal::Fenced { term: 4, floor: 5, .. }), "{e}");
    }

    #[test]
    fn replayed_grant_same_presenter_gets_the_same_receipt_others_nothing() {
        let mut h = Harness::new();
        let token = grant(1, "m1", "g1");
        let first = h.present(&token, "m1").unwrap();
        let again = h.present(&token, "m1").unwrap();
        assert_eq!(again, Accepted::Replay(first.receipt().clone()));
        let e = h.refuse(&token, "m2");
        assert!(matches!(e, Refusal::Presenter), "{e}");
        // After activation the receipted grant can still be re-presented by its presenter
        // (a lost confirm), but it does not move the fence.
        h.confirm(&proof(1, "m1", "g1"), "m1").unwrap();
        assert!(matches!(h.present(&token, "m1").unwrap(), Accepted::Replay(_)));
        assert_eq!((h.fence.floor, h.fence.activated), (1, 1));
    }

    #[test]
    fn reused_jti_with_other_bytes_is_refused() {
        let mut h = Harness::new();
        h.present(&grant(1, "m1", "g1"), "m1").unwrap();
        // Same jti, same term, re-signed (different bytes through another iat): single use.
        let mut claims = grant_claims(1, "m1", "g1");
        claims["iat"] = json!(NOW_MS / 1000 - 1);
        claims["exp"] = json!(NOW_MS / 1000 + 29);
        let other = sign(proto::trust::GRANT_TYP, &claims, &key(1));
        let e = h.refuse(&other, "m1");
        assert!(matches!(e, Refusal::Reused(_)), "{e}");
    }

    #[test]
    fn grant_for_another_instance_or_route_is_refused() {
        let mut h = Harness::new();
        for (field, value) in [
            ("uid", json!("u-2")),
            ("generation", json!(6)),
            ("name", json!("other")),
        ] {
            let mut claims = grant_claims(1, "m1", "g1");
            claims["instance"][field] = value;
            let token = sign(proto::trust::GRANT_TYP, &claims, &key(1));
            let e = h.refuse(&token, "m1");
            assert!(matches!(e, Refusal::Instance), "{field}: {e}");
        }
        let mut claims = grant_claims(1, "m1", "g1");
        claims["route"] = json!("team-a/other");
        claims["sub"] = json!("team-a/other");
        let token = sign(proto::trust::GRANT_TYP, &claims, &key(1));
        assert!(matches!(h.refuse(&token, "m1"), Refusal::Route));
    }

    #[test]
    fn grant_presented_by_another_process_is_refused() {
        let mut h = Harness::new();
        let e = h.refuse(&grant(1, "m1", "g1"), "m2");
        assert!(matches!(e, Refusal::Presenter), "{e}");
    }

    #[test]
    fn expired_grant_is_refused_within_the_skew_only() {
        let mut h = Harness::new();
        let token = grant(1, "m1", "g1");
        let skew_ms = i64::try_from(proto::timing::MAX_CLOCK_SKEW.as_millis()).unwrap();
        h.now_ms = NOW_MS + 30_000 + skew_ms;
        let e = h.refuse(&token, "m1");
        assert!(matches!(e, Refusal::Token(trust::Error::Expired)), "{e}");
        h.now_ms = NOW_MS + 30_000 + skew_ms - 1_000;
        assert!(h.present(&token, "m1").is_ok());
    }

    #[test]
    fn forged_signature_and_wrong_kind_are_refused() {
        let mut h = Harness::new();
        let forged = sign(proto::trust::GRANT_TYP, &grant_claims(1, "m1", "g1"), &key(2));
        let e = h.refuse(&forged, "m1");
        assert!(matches!(e, Refusal::Token(trust::Error::Signature)), "{e}");
        // An activation proof is not a grant, even when correctly signed.
        let wrong_typ = sign(proto::trust::PROOF_TYP, &grant_claims(1, "m1", "g1"), &key(1));
        let e = h.refuse(&wrong_typ, "m1");
        assert!(matches!(e, Refusal::Token(trust::Error::Type { .. })), "{e}");
    }

    #[test]
    fn activation_of_a_stale_term_or_other_grant_is_refused() {
        let mut h = Harness::new();
        h.present(&grant(1, "m1", "g1"), "m1").unwrap();
        h.present(&grant(2, "m2", "g2"), "m2").unwrap();
        let before = h.fence.clone();
        // The superseded candidate's (valid) proof for term 1.
        assert!(matches!(
            h.confirm(&proof(1, "m1", "g1"), "m1"),
            Err(Refusal::Fenced { term: 1, .. })
        ));
        // A proof for term 2 but for another grant.
        assert!(matches!(
            h.confirm(&proof(2, "m2", "gX"), "m2"),
            Err(Refusal::OtherGrant)
        ));
        // The right proof on another presenter's stream.
        assert!(matches!(
            h.confirm(&proof(2, "m2", "g2"), "m1"),
            Err(Refusal::Presenter)
        ));
        // A confirmation whose term differs from its proof.
        let mut lying = proof(2, "m2", "g2");
        lying.term = 3;
        assert!(matches!(h.confirm(&lying, "m2"), Err(Refusal::Mismatch)));
        assert_eq!(h.fence, before);
        assert_eq!(h.confirm(&proof(2, "m2", "g2"), "m2").unwrap(), 2);
    }

    #[test]
    fn confirm_without_receipt_is_refused() {
        let mut h = Harness::new();
        assert!(matches!(
            h.confirm(&proof(1, "m1", "g1"), "m1"),
            Err(Refusal::NotReceipted(1))
        ));
        assert_eq!(h.fence, Fence::default());
    }

    #[test]
    fn attached_only_for_the_activated_owner() {
        let mut h = Harness::new();
        let attached = |term, member: &str| Attached {
            route: ROUTE.into(),
            term,
            member: member.into(),
            process_id: format!("{member}-p"),
            recovery_deadline_ms: 5_000,
        };
        assert!(h.fence.accept_attached(&attached(0, "m1")).is_err());
        h.activate(2, "m1");
        assert!(matches!(
            h.fence.accept_attached(&attached(1, "m1")),
            Err(Refusal::Fenced { .. })
        ));
        assert!(matches!(
            h.fence.accept_attached(&attached(2, "m9")),
            Err(Refusal::NotOwner)
        ));
        h.fence.accept_attached(&attached(2, "m1")).unwrap();
        assert_eq!(h.fence.recovery_deadline_ms, 5_000);
        // A higher grant receipted: the old owner can no longer resume.
        h.present(&grant(3, "m2", "g3"), "m2").unwrap();
        assert!(matches!(
            h.fence.accept_attached(&attached(2, "m1")),
            Err(Refusal::Fenced { .. })
        ));
    }

    #[test]
    fn relinquish_only_of_the_activated_term_by_its_owner() {
        let mut h = Harness::new();
        assert!(h.fence.relinquish(0, Role::Owner).is_err(), "nothing activated");
        h.activate(2, "m1");
        let before = h.fence.clone();
        assert!(matches!(
            h.fence.relinquish(1, Role::Owner),
            Err(Refusal::Fenced { .. })
        ));
        assert!(matches!(h.fence.relinquish(2, Role::Other), Err(Refusal::NotOwner)));
        assert_eq!(h.fence, before);
        h.fence.relinquish(2, Role::Owner).unwrap();
        assert!(h.fence.relinquished);
        // Only a higher term ends it: the same term is refused, and so is re-attaching.
        assert!(!h.fence.follows_redirect(2));
        assert!(h.fence.follows_redirect(3));
        let e = h.refuse(&grant(2, "m1", "g2b"), "m1");
        assert!(matches!(e, Refusal::Fenced { .. }), "{e}");
        h.activate(3, "m2");
        assert!(!h.fence.relinquished);
    }

    #[test]
    fn release_from_owner_or_receipted_candidate_only() {
        let mut h = Harness::new();
        let m1 = presenter("m1");
        let m2 = presenter("m2");
        assert!(!h.fence.accepts_release(0, Role::Owner));
        h.activate(1, "m1");
        assert!(h.fence.accepts_release(1, Role::Owner));
        assert!(!h.fence.accepts_release(0, Role::Owner));
        assert!(!h.fence.accepts_release(1, Role::Other));
        h.present(&grant(2, "m2", "g2"), "m2").unwrap();
        // The old owner is fenced by the receipt; the candidate may release for its term.
        assert!(!h.fence.accepts_release(1, Role::Owner));
        assert!(!h.fence.accepts_release(1, Role::Candidate(&m1)));
        assert!(!h.fence.accepts_release(1, Role::Candidate(&m2)));
        assert!(h.fence.accepts_release(2, Role::Candidate(&m2)));
        assert!(!h.fence.accepts_release(2, Role::Candidate(&m1)));
    }

    #[test]
    fn redirects_below_the_fence_are_ignored() {
        let mut h = Harness::new();
        assert!(!h.fence.follows_redirect(0));
        assert!(h.fence.follows_redirect(1));
        h.activate(4, "m1");
        assert!(!h.fence.follows_redirect(3));
        assert!(h.fence.follows_redirect(4));
        h.present(&grant(6, "m2", "g6"), "m2").unwrap();
        assert!(!h.fence.follows_redirect(4), "below the floor");
        assert!(h.fence.follows_redirect(6));
    }

    #[test]
    fn fence_round_trips_through_json() {
        let mut h = Harness::new();
        h.activate(1, "m1");
        h.present(&grant(2, "m2", "g2"), "m2").unwrap();
        let json = serde_json::to_string(&h.fence).unwrap();
        let back: Fence = serde_json::from_str(&json).unwrap();
        assert_eq!(back, h.fence);
        assert!(h.key.verifies(&back.receipted.unwrap().receipt));
    }
}
