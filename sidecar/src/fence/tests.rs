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
fn the_holder_is_the_process_that_activated_the_term_while_it_holds_it() {
    let mut h = Harness::new();
    assert_eq!(h.fence.holder(), None, "nothing activated");
    h.activate(2, "m1");
    assert_eq!(h.fence.holder(), Some(&presenter("m1")));
    h.fence.relinquish(2, Role::Owner).unwrap();
    assert_eq!(h.fence.holder(), None, "relinquished: nobody holds it");
    h.present(&grant(3, "m2", "g3"), "m2").unwrap();
    assert_eq!(h.fence.holder(), None, "a receipted term is not held yet");
    assert_eq!(h.confirm(&proof(3, "m2", "g3"), "m2").unwrap(), 3);
    assert_eq!(h.fence.holder(), Some(&presenter("m2")));
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
