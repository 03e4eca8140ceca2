//! `admission.k8s.io/v1` AdmissionReview in, AdmissionReview out: the pure `mutate` entry point.
//!
//! [`mutate_bytes`] never fails and never panics: whatever the input, it returns a well-formed
//! AdmissionReview response that echoes the request UID when one can be found (even in a body
//! that is not valid JSON, by a best-effort scan) and carries a clear message when the input
//! is not something the webhook understands.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde::Serialize;
use serde_json::Value;

use crate::inject::refuse::{Refusal, RefuseReason};
use crate::inject::{Decision, Injector, SidecarMode, SkipReason};

pub const API_VERSION: &str = "admission.k8s.io/v1";
pub const KIND: &str = "AdmissionReview";

/// Why a review could not be answered with a decision (metric label `reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailReason {
    InvalidJson,
    InvalidReview,
    MissingRequest,
    MissingObject,
    InvalidPod,
    BodyTooLarge,
    BodyRead,
}

impl FailReason {
    /// Every reason (each metric label starts at 0).
    pub const ALL: [Self; 7] = [
        FailReason::InvalidJson,
        FailReason::InvalidReview,
        FailReason::MissingRequest,
        FailReason::MissingObject,
        FailReason::InvalidPod,
        FailReason::BodyTooLarge,
        FailReason::BodyRead,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FailReason::InvalidJson => "invalid_json",
            FailReason::InvalidReview => "invalid_review",
            FailReason::MissingRequest => "missing_request",
            FailReason::MissingObject => "missing_object",
            FailReason::InvalidPod => "invalid_pod",
            FailReason::BodyTooLarge => "body_too_large",
            FailReason::BodyRead => "body_read",
        }
    }

    /// The HTTP-like code put in the response `status`.
    pub fn code(self) -> u16 {
        match self {
            FailReason::BodyTooLarge => 413,
            FailReason::BodyRead => 408,
            _ => 400,
        }
    }
}

/// What happened to one review.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Injected(SidecarMode),
    Skipped(SkipReason),
    /// Denied: the Pod would reach the supervision sidecar ([`crate::inject::refuse`]).
    Refused(RefuseReason),
    Failed(FailReason),
}

/// The `status` of a denied review.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Status {
    pub code: u16,
    pub message: String,
}

/// `response` of an AdmissionReview.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionResponse {
    pub uid: String,
    pub allowed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub patch_type: Option<&'static str>,
    /// Base64 of the JSON Patch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub patch: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<Status>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ReviewOut<'a> {
    api_version: &'static str,
    kind: &'static str,
    response: &'a AdmissionResponse,
}

/// The answer to one review plus what the server logs and counts about it.
#[derive(Clone, Debug, PartialEq)]
pub struct Reviewed {
    pub response: AdmissionResponse,
    pub outcome: Outcome,
    pub dry_run: bool,
    pub namespace: String,
    /// `metadata.name`, else `metadata.generateName` (Pods from controllers have no name yet).
    pub name: String,
    /// Failure detail for logs.
    pub message: Option<String>,
}

impl Reviewed {
    /// The full AdmissionReview response body.
    pub fn to_json(&self) -> Vec<u8> {
        review_json(&self.response)
    }
}

/// Serialize `response` as an `admission.k8s.io/v1` AdmissionReview.
pub fn review_json(response: &AdmissionResponse) -> Vec<u8> {
    let out = ReviewOut {
        api_version: API_VERSION,
        kind: KIND,
        response,
    };
    // Serializing plain strings, bools and numbers into a Vec cannot fail; fall back to a
    // minimal hand-written body anyway rather than panic.
    serde_json::to_vec(&out).unwrap_or_else(|_| {
        format!(r#"{{"apiVersion":"{API_VERSION}","kind":"{KIND}","response":{{"uid":"","allowed":false}}}}"#)
            .into_bytes()
    })
}

/// Longest refusal message the webhook answers and logs (bytes); what the request carried is
/// quoted only in part.
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// Longest quote of a request field in a message (bytes).
const MAX_QUOTE_BYTES: usize = 128;
/// Longest namespace or Pod name kept for logs and metrics (a DNS subdomain's bound).
const MAX_NAME_BYTES: usize = 253;
/// Longest `request.uid` echoed (the API server sends a 36-byte UUID).
const MAX_UID_BYTES: usize = 128;

/// HTTP-like status code of a refused Pod: the request is well formed, the policy forbids it.
pub const REFUSED_CODE: u16 = 403;

/// A failed review: `allowed: false` with a status message, UID echoed.
pub fn failure(uid: String, reason: FailReason, message: String) -> Reviewed {
    denied(uid, Outcome::Failed(reason), reason.code(), &message)
}

/// A refused Pod: `allowed: false`, 403, the message `refused: <why>`, UID echoed.
pub fn refused(uid: String, refusal: &Refusal) -> Reviewed {
    denied(
        uid,
        Outcome::Refused(refusal.reason()),
        REFUSED_CODE,
        &format!("refused: {refusal}"),
    )
}

fn denied(uid: String, outcome: Outcome, code: u16, message: &str) -> Reviewed {
    let message = plumbing::text::bounded(message, MAX_MESSAGE_BYTES);
    Reviewed {
        response: AdmissionResponse {
            uid,
            allowed: false,
            patch_type: None,
            patch: None,
            status: Some(Status {
                code,
                message: format!("openshell supervision webhook: {message}"),
            }),
            warnings: Vec::new(),
        },
        outcome,
        dry_run: false,
        namespace: String::new(),
        name: String::new(),
        message: Some(message),
    }
}

/// Best-effort extraction of `request.uid` from a body that is not valid JSON (or is cut off):
/// finds the first `"uid"` key after the `"request"` key and reads its string value.
pub fn scan_uid(body: &[u8]) -> Option<String> {
    const WINDOW: usize = 64 * 1024;
    let body = &body[..body.len().min(WINDOW)];
    let text = String::from_utf8_lossy(body);
    let request = text.find("\"request\"")?;
    let rest = &text[request + "\"request\"".len()..];
    let key = rest.find("\"uid\"")?;
    let rest = rest[key + "\"uid\"".len()..].trim_start();
    let rest = rest.strip_prefix(':')?.trim_start();
    let rest = rest.strip_prefix('"')?;
    let end = rest.find('"')?;
    let uid = &rest[..end];
    let plausible = !uid.is_empty()
        && uid.len() <= 128
        && uid
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.');
    plausible.then(|| uid.to_string())
}

/// Answer a raw request body.
///
/// Fast path: the body is decoded into the pruned view of [`crate::decode`], which keeps
/// exactly the parts of the review [`mutate`] reads and skips the rest without allocating.
/// Anything that does not fit that view (wrong types, duplicate keys) takes the slow path: the
/// whole body as a `Value`. Both paths feed the same [`mutate`], so they answer alike.
pub fn mutate_bytes(body: &[u8], injector: &Injector) -> Reviewed {
    if let Some(review) = crate::decode::pruned(body) {
        return mutate(&review, injector);
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(review) => mutate(&review, injector),
        Err(err) => failure(
            scan_uid(body).unwrap_or_default(),
            FailReason::InvalidJson,
            format!("request body is not valid JSON: {err}"),
        ),
    }
}

fn describe(value: Option<&Value>) -> String {
    let described = match value {
        None => "nothing".into(),
        Some(Value::String(s)) => format!("{s:?}"),
        Some(other) => other.to_string(),
    };
    plumbing::text::bounded(&described, MAX_QUOTE_BYTES)
}

/// Answer a parsed AdmissionReview: the pure core of the webhook.
pub fn mutate(review: &Value, injector: &Injector) -> Reviewed {
    let uid = review
        .pointer("/request/uid")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    if uid.len() > MAX_UID_BYTES {
        return failure(
            String::new(),
            FailReason::InvalidReview,
            format!("the AdmissionReview request's `uid` is longer than {MAX_UID_BYTES} bytes"),
        );
    }

    let api_version = review.get("apiVersion");
    let kind = review.get("kind");
    if api_version.and_then(Value::as_str) != Some(API_VERSION) || kind.and_then(Value::as_str) != Some(KIND) {
        return failure(
            uid,
            FailReason::InvalidReview,
            format!(
                "expected apiVersion {API_VERSION:?} kind {KIND:?}, got apiVersion {} kind {}",
                describe(api_version),
                describe(kind)
            ),
        );
    }
    let Some(request) = review.get("request").and_then(Value::as_object) else {
        return failure(
            uid,
            FailReason::MissingRequest,
            "the AdmissionReview has no `request` object".into(),
        );
    };
    if uid.is_empty() {
        return failure(
            uid,
            FailReason::InvalidReview,
            "the AdmissionReview request has no `uid`".into(),
        );
    }

    let object = request.get("object");
    let metadata = object.and_then(|o| o.get("metadata"));
    let namespace = request
        .get("namespace")
        .and_then(Value::as_str)
        .or_else(|| metadata.and_then(|m| m.get("namespace")).and_then(Value::as_str))
        .unwrap_or("")
        .to_string();
    let name = request
        .get("name")
        .and_then(Value::as_str)
        .or_else(|| metadata.and_then(|m| m.get("name")).and_then(Value::as_str))
        .or_else(|| metadata.and_then(|m| m.get("generateName")).and_then(Value::as_str))
        .unwrap_or("")
        .to_string();
    let dry_run = request.get("dryRun").and_then(Value::as_bool) == Some(true);

    let mut reviewed = Reviewed {
        response: AdmissionResponse {
            uid,
            allowed: true,
            patch_type: None,
            patch: None,
            status: None,
            warnings: Vec::new(),
        },
        outcome: Outcome::Skipped(SkipReason::NotPod),
        dry_run,
        namespace: plumbing::text::bounded(&namespace, MAX_NAME_BYTES),
        name: plumbing::text::bounded(&name, MAX_NAME_BYTES),
        message: None,
    };

    let is_pod = request.get("kind").is_some_and(|k| {
        k.get("group").and_then(Value::as_str).unwrap_or("").is_empty()
            && k.get("kind").and_then(Value::as_str) == Some("Pod")
    });
    // A Pod CREATE is injected; an ephemeral containers update (whatever its operation: the
    // API server sends UPDATE) is only checked; anything else is let through.
    let ephemeral = match request.get("subResource") {
        None | Some(Value::Null) => false,
        Some(Value::String(sub)) if sub == "ephemeralcontainers" => true,
        Some(_) => return reviewed,
    };
    if !is_pod {
        return reviewed;
    }
    if !ephemeral && request.get("operation").and_then(Value::as_str) != Some("CREATE") {
        reviewed.outcome = Outcome::Skipped(SkipReason::NotCreate);
        return reviewed;
    }
    // Excluded namespaces are answered before looking at the object at all.
    if let Some(reason) = injector.namespace_excluded(&reviewed.namespace) {
        reviewed.outcome = Outcome::Skipped(reason);
        return reviewed;
    }
    let Some(object) = object.filter(|o| o.is_object()) else {
        let mut failed = failure(
            reviewed.response.uid,
            FailReason::MissingObject,
            "the AdmissionReview request has no Pod `object`".into(),
        );
        failed.dry_run = dry_run;
        failed.namespace = reviewed.namespace;
        return failed;
    };
    if reviewed.namespace.is_empty() {
        return failure(
            reviewed.response.uid,
            FailReason::InvalidReview,
            "the AdmissionReview request has no namespace".into(),
        );
    }

    let decision = if ephemeral {
        injector.check_ephemeral_containers(object, &reviewed.namespace)
    } else {
        injector.mutate_pod(object, &reviewed.namespace)
    };
    let denied = match decision {
        Ok(Decision::Skip(reason)) => {
            reviewed.outcome = Outcome::Skipped(reason);
            return reviewed;
        }
        Ok(Decision::NotSupervised(unsupervised)) => {
            reviewed.response.patch_type = Some("JSONPatch");
            reviewed.response.patch = Some(STANDARD.encode(unsupervised.patch.as_bytes()));
            reviewed.response.warnings = vec![format!("not supervised: {}", unsupervised.message)];
            reviewed.outcome = Outcome::Skipped(unsupervised.reason);
            return reviewed;
        }
        Ok(Decision::Inject(injection)) => {
            reviewed.response.patch_type = Some("JSONPatch");
            reviewed.response.patch = Some(STANDARD.encode(injection.patch.as_bytes()));
            reviewed.response.warnings = injection.warnings;
            reviewed.outcome = Outcome::Injected(injection.mode);
            return reviewed;
        }
        Ok(Decision::Refuse(refusal)) => refused(reviewed.response.uid, &refusal),
        Err(err) => failure(
            reviewed.response.uid,
            FailReason::InvalidPod,
            format!("cannot inject into this Pod: {err}"),
        ),
    };
    Reviewed {
        dry_run,
        namespace: reviewed.namespace,
        name: reviewed.name,
        ..denied
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_uid_reads_request_uid_not_user_uid() {
        let body = br#"{"kind":"AdmissionReview","request":{"uid":"abc-123","userInfo":{"uid":"nope"}, BROKEN"#;
        assert_eq!(scan_uid(body), Some("abc-123".into()));
        assert_eq!(scan_uid(br#"{"uid":"x"}"#), None);
        assert_eq!(scan_uid(br#"{"request":{"uid":"bad\"quote"}}"#), None);
        assert_eq!(scan_uid(br#"{"request": { "uid" :  "spaced" }"#), Some("spaced".into()));
    }

    /// Whatever a request carries, the answer and the log line stay small: nothing of the
    /// input is copied unbounded.
    #[test]
    fn hostile_fields_are_never_echoed_unbounded() {
        let injector = Injector::new(crate::inject::InjectConfig::default());
        let huge = "v".repeat(2 << 20);
        let cases = [
            serde_json::json!({"apiVersion": huge, "kind": KIND, "request": {"uid": "u-1"}}),
            serde_json::json!({"apiVersion": API_VERSION, "kind": {"nested": huge}, "request": {"uid": "u-1"}}),
            serde_json::json!({"apiVersion": API_VERSION, "kind": KIND, "request": {"uid": huge}}),
            serde_json::json!({"apiVersion": API_VERSION, "kind": KIND, "request": {
                "uid": "u-1", "kind": {"group": "", "kind": "Pod"}, "operation": "CREATE",
                "namespace": huge, "name": huge, "object": {"spec": huge}}}),
        ];
        for review in cases {
            let reviewed = mutate(&review, &injector);
            let answer = reviewed.to_json();
            assert!(answer.len() < 4096, "answer of {} bytes", answer.len());
            let logged =
                reviewed.message.as_deref().unwrap_or("").len() + reviewed.namespace.len() + reviewed.name.len();
            assert!(
                logged <= MAX_MESSAGE_BYTES + 2 * MAX_NAME_BYTES,
                "{logged} bytes logged"
            );
        }
    }
}
