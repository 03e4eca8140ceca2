//! Test fixtures shared by the unit tests: one instance, one signing key, signed grants and
//! activation proofs (`fence` and `engine` tests).

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ed25519_dalek::{Signer, SigningKey};
use proto::common::v1::{InstanceRef, WorkloadIdentity};
use proto::runtime::v1::ActivationConfirm;
use proto::trust::TrustBundle;
use serde_json::{Value, json};

use crate::fence::Presenter;

pub(crate) const NOW_MS: i64 = 1_700_000_000_000;
pub(crate) const ISS: &str = proto::trust::DEFAULT_ISSUER;
pub(crate) const ROUTE: &str = "team-a/agent";

pub(crate) fn instance() -> InstanceRef {
    InstanceRef {
        namespace: "team-a".into(),
        name: "agent".into(),
        uid: "u-1".into(),
        generation: 7,
    }
}

pub(crate) fn key(seed: u8) -> SigningKey {
    SigningKey::from_bytes(&[seed; 32])
}

pub(crate) fn bundle() -> TrustBundle {
    let mut b = TrustBundle::new(ISS);
    b.keys.insert("k1".into(), key(1).verifying_key());
    b
}

pub(crate) fn sign(typ: &str, claims: &Value, signer: &SigningKey) -> String {
    let b64 = |v: &Value| URL_SAFE_NO_PAD.encode(v.to_string());
    let input = format!(
        "{}.{}",
        b64(&json!({"alg": "EdDSA", "kid": "k1", "typ": typ})),
        b64(claims)
    );
    format!(
        "{input}.{}",
        URL_SAFE_NO_PAD.encode(signer.sign(input.as_bytes()).to_bytes())
    )
}

pub(crate) fn instance_claim() -> Value {
    json!({"namespace": "team-a", "name": "agent", "uid": "u-1", "generation": 7})
}

pub(crate) fn grant_claims(term: u64, member: &str, jti: &str) -> Value {
    let now = NOW_MS / 1000;
    json!({"iss": ISS, "aud": "openshell-sidecar", "sub": ROUTE, "route": ROUTE,
        "instance": instance_claim(), "term": term, "member": member,
        "process_id": format!("{member}-p"), "iat": now, "exp": now + 30, "jti": jti})
}

pub(crate) fn grant(term: u64, member: &str, jti: &str) -> String {
    sign(proto::trust::GRANT_TYP, &grant_claims(term, member, jti), &key(1))
}

pub(crate) fn proof(term: u64, member: &str, grant_id: &str) -> ActivationConfirm {
    let now = NOW_MS / 1000;
    let claims = json!({"iss": ISS, "aud": "openshell-sidecar", "sub": ROUTE, "route": ROUTE,
        "instance": instance_claim(), "term": term, "member": member,
        "process_id": format!("{member}-p"), "grant_id": grant_id, "iat": now, "exp": now + 60,
        "jti": format!("proof-{grant_id}")});
    ActivationConfirm {
        term,
        proof: sign(proto::trust::PROOF_TYP, &claims, &key(1)),
        activated_at_ms: NOW_MS,
        recovery_deadline_ms: 20_000,
    }
}

pub(crate) fn presenter(member: &str) -> Presenter {
    Presenter {
        member: member.into(),
        process_id: format!("{member}-p"),
    }
}

pub(crate) fn workload() -> WorkloadIdentity {
    WorkloadIdentity {
        pid: 42,
        start_time_ticks: 1234,
        exe_digest: vec![5; 32],
    }
}
