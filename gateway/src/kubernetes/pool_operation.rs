//! The `SupervisorPoolOperation` custom resource (`supervision.openshell.ai/v1alpha1`,
//! namespaced in the install namespace; the CRD is `manifests/supervisorpooloperation-crd.yaml`)
//! as plain data: what the watch keeps of each object ([`OperationObject`], made from the API
//! object by [`object_of`]) and the status the coordinator writes ([`OperationStatus`]). A
//! declarative door to the same durable drain or rebalance `poolctl` starts; the decisions are
//! in [`super::operation_reconcile`].

use kube::ResourceExt;
use kube::api::{ApiResource, DynamicObject};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::pool_status::{Condition, GROUP, VERSION, custom_resource};

/// Kind of the operation resource.
pub const KIND: &str = "SupervisorPoolOperation";
/// Its plural (the resource name in URLs and RBAC).
pub const PLURAL: &str = "supervisorpooloperations";
/// The coordinator's finalizer: set when it starts the operation, removed once the
/// cancellation is recorded (or the operation had already ended), so deleting the object
/// always cancels a running operation.
pub const FINALIZER: &str = "supervision.openshell.ai/operation";
/// At most this many planned or refused moves are listed in a dry run's status (the rest are
/// counted in its message): the object stays far below the API server's size limit.
pub const MAX_LISTED_MOVES: usize = 256;
/// Longest spec string kept from an object (a member name is a DNS subdomain, ≤ 253 bytes):
/// a longer one is cut here and refused by the validation without being echoed.
pub const MAX_SPEC_TEXT: usize = 254;

/// The operation resource for the dynamic API.
pub fn resource() -> ApiResource {
    custom_resource(KIND, PLURAL)
}

/// `.spec`, as written by the user (validated by the reconcile, not here).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Spec {
    /// `Drain` or `Rebalance` (any case).
    pub kind: String,
    /// The member to drain (a drain only).
    pub member: String,
    /// `None`: the default (as `poolctl`).
    pub max_parallel: Option<i64>,
    /// Plan only: the moves in the status, nothing recorded.
    pub dry_run: bool,
    /// `None`: the default operation time-out.
    pub timeout_seconds: Option<i64>,
}

/// What the index keeps of one object.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OperationObject {
    pub name: String,
    pub uid: String,
    pub generation: i64,
    pub resource_version: String,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    pub finalizers: Vec<String>,
    pub spec: Spec,
    /// `.status` as last seen (`None`: never written, or not in our shape).
    pub status: Option<OperationStatus>,
}

impl OperationObject {
    /// Whether the coordinator's finalizer is on the object.
    pub fn finalized(&self) -> bool {
        self.finalizers.iter().any(|f| f == FINALIZER)
    }
}

/// `.status` of a `SupervisorPoolOperation`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct OperationStatus {
    /// `Pending`, `Running`, `Succeeded`, `Failed`, `Cancelled`, or `Planned` (a dry run).
    pub phase: String,
    /// The durable operation (`poolctl status`, `poolctl cancel`): the object's UID, or the
    /// equivalent operation that was already open when the object appeared.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub operation_id: String,
    pub moves_done: i64,
    /// Moves done plus the moves still planned.
    pub moves_total: i64,
    /// `movesDone/movesTotal`, for the printer column.
    pub moves: String,
    pub message: String,
    pub observed_generation: i64,
    /// A dry run's moves (at most [`MAX_LISTED_MOVES`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub planned: Vec<PlannedMove>,
    /// A dry run's instances that could not move, with the reason.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<RefusedMove>,
    pub conditions: Vec<Condition>,
}

/// One planned move of a dry run.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PlannedMove {
    /// The instance's route.
    pub instance: String,
    pub from: String,
    pub to: String,
}

/// An instance a dry run could not move.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RefusedMove {
    pub instance: String,
    pub from: String,
    pub reason: String,
}

/// The index's view of an object; `None` for one without name or UID.
pub fn object_of(object: &DynamicObject) -> Option<OperationObject> {
    let spec = object.data.get("spec").unwrap_or(&Value::Null);
    let text = |key: &str| -> String {
        spec.get(key)
            .and_then(Value::as_str)
            .map(|s| plumbing::text::prefix(s, MAX_SPEC_TEXT).to_owned())
            .unwrap_or_default()
    };
    Some(OperationObject {
        name: object.metadata.name.clone()?,
        uid: object.uid()?,
        generation: object.metadata.generation.unwrap_or(0),
        resource_version: object.resource_version().unwrap_or_default(),
        deleting: object.metadata.deletion_timestamp.is_some(),
        finalizers: object.finalizers().to_vec(),
        spec: Spec {
            kind: text("kind"),
            member: text("member"),
            max_parallel: spec.get("maxParallel").and_then(Value::as_i64),
            dry_run: spec.get("dryRun").and_then(Value::as_bool).unwrap_or(false),
            timeout_seconds: spec.get("timeoutSeconds").and_then(Value::as_i64),
        },
        status: object
            .data
            .get("status")
            .and_then(|s| serde_json::from_value(s.clone()).ok()),
    })
}

/// The status subresource's apply body for object `name`.
pub fn status_body(namespace: &str, name: &str, status: &OperationStatus) -> Value {
    serde_json::json!({
        "apiVersion": format!("{GROUP}/{VERSION}"),
        "kind": KIND,
        "metadata": { "name": name, "namespace": namespace },
        "status": status,
    })
}

/// The merge patch setting the object's finalizers to `finalizers`, valid only at
/// `resource_version` (a concurrent change makes it fail with 409 and the next round looks
/// again).
pub fn finalizers_patch(resource_version: &str, finalizers: &[String]) -> Value {
    serde_json::json!({
        "metadata": { "resourceVersion": resource_version, "finalizers": finalizers },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_is_read_defensively() {
        let object: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "supervision.openshell.ai/v1alpha1",
            "kind": KIND,
            "metadata": {
                "name": "drain-a", "namespace": "ns", "uid": "u-1", "generation": 2,
                "resourceVersion": "7", "finalizers": [FINALIZER],
                "deletionTimestamp": "2025-01-01T00:00:00Z",
            },
            "spec": { "kind": "Drain", "member": "m".repeat(10_000), "maxParallel": "two", "dryRun": true },
            "status": { "phase": "Running", "operationId": "u-1", "unknown": 1 },
        }))
        .unwrap_or_else(|err| panic!("{err}"));
        let Some(seen) = object_of(&object) else {
            panic!("a named object with a UID is kept")
        };
        assert_eq!(
            (seen.name.as_str(), seen.uid.as_str(), seen.generation),
            ("drain-a", "u-1", 2)
        );
        assert!(seen.deleting && seen.finalized());
        assert_eq!(seen.spec.member.len(), MAX_SPEC_TEXT, "a huge member name is cut");
        assert_eq!(seen.spec.max_parallel, None, "a non-number is no maxParallel");
        assert!(seen.spec.dry_run);
        assert_eq!(seen.status.map(|s| s.phase), Some("Running".to_owned()));
        let nameless: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "supervision.openshell.ai/v1alpha1", "kind": KIND, "metadata": { "uid": "u" },
        }))
        .unwrap_or_else(|err| panic!("{err}"));
        assert!(object_of(&nameless).is_none());
    }

    #[test]
    fn every_status_field_written_is_declared_in_the_crd() {
        const CRD: &str = include_str!("../../../manifests/supervisorpooloperation-crd.yaml");
        let status = OperationStatus {
            phase: "Planned".into(),
            operation_id: "u-1".into(),
            planned: vec![PlannedMove::default()],
            refused: vec![RefusedMove::default()],
            conditions: vec![Condition::default()],
            ..OperationStatus::default()
        };
        let body = status_body("ns", "drain-a", &status);
        let undeclared = super::super::pool_status::tests::undeclared(CRD, &body["status"]);
        assert!(undeclared.is_empty(), "not in the CRD schema: {undeclared:?}");
    }
}
