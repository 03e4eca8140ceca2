//! Which Pod shapes the sidecar can truly supervise, decided over the Pod spec alone.
//!
//! The sidecar identifies and stops its workload through the Pod's shared process namespace
//! and `/proc/<pid>/exe`, which the kernel opens only for a process of the same UID: so the
//! workload containers must run as one known non-root UID that the sidecar can run as too. A
//! Pod the sidecar cannot supervise is admitted as it is, never changed, with a warning and
//! the annotation [`NOT_SUPERVISED_ANNOTATION`] saying why ([`Unsupervised`]).

use serde_json::{Map, Value};

use super::SkipReason;

/// The Pod annotation that says why a Pod of a labelled namespace is not supervised.
pub const NOT_SUPERVISED_ANNOTATION: &str = proto::kubernetes::NOT_SUPERVISED_KEY;
/// The Pod label with the reason code, by which the gateway follows such Pods.
pub const NOT_SUPERVISED_LABEL: &str = proto::kubernetes::NOT_SUPERVISED_KEY;
/// The user of the sidecar image this project builds (`USER 65532:65532`): what the sidecar
/// runs as when neither the webhook's configuration nor the Pod names a UID.
pub const SIDECAR_IMAGE_UID: i64 = 65532;

/// A Pod admitted without supervision, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unsupervised {
    pub reason: SkipReason,
    pub message: String,
}

impl Unsupervised {
    fn new(reason: SkipReason, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
        }
    }
}

/// What the injection must set on the sidecar for this Pod, and what the user must be told.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Fit {
    /// The sidecar's `runAsUser` when it would otherwise run as another UID than the workload
    /// (no Pod-level `runAsUser`, the containers' own one other than the image's).
    pub sidecar_uid: Option<i64>,
    /// Admission warnings: what the spec cannot promise (the workload may not be identified
    /// until it connects, or at all), so that a Pod shown not identified later was foretold.
    pub warnings: Vec<String>,
}

fn run_as_user(security_context: Option<&Value>) -> Option<i64> {
    security_context?.get("runAsUser")?.as_i64()
}

/// Decides whether the sidecar can supervise the Pod `spec` (an object), running as
/// `configured_uid` (the webhook's `--sidecar-run-as-user`) when set.
pub fn assess(spec: &Map<String, Value>, configured_uid: Option<i64>) -> Result<Fit, Unsupervised> {
    if spec.get("hostNetwork").and_then(Value::as_bool) == Some(true) {
        return Err(Unsupervised::new(
            SkipReason::HostNetwork,
            "hostNetwork: true — the sidecar would share the node's network and ports; run the Pod on the Pod network to supervise it",
        ));
    }
    if spec.get("shareProcessNamespace").and_then(Value::as_bool) == Some(false) {
        return Err(Unsupervised::new(
            SkipReason::ProcessNamespaceOff,
            "shareProcessNamespace: false — the sidecar must see the workload's processes; remove the field (or set it true) to supervise the Pod",
        ));
    }
    let pod_uid = run_as_user(spec.get("securityContext"));
    let containers = spec
        .get("containers")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut known: Option<(i64, &str)> = None;
    for container in containers {
        let name = container.get("name").and_then(Value::as_str).unwrap_or("");
        let Some(uid) = run_as_user(container.get("securityContext")).or(pod_uid) else {
            continue;
        };
        if uid == 0 {
            return Err(Unsupervised::new(
                SkipReason::RunsAsRoot,
                format!(
                    "container {name:?} runs as root (runAsUser: 0) — the sidecar runs as non-root and cannot identify or stop a root process; run it as a non-root UID to supervise the Pod"
                ),
            ));
        }
        match known {
            Some((other, other_name)) if other != uid => {
                return Err(Unsupervised::new(
                    SkipReason::UidMismatch,
                    format!(
                        "containers {other_name:?} and {name:?} run as different UIDs ({other} and {uid}) — the sidecar can follow processes of one UID only"
                    ),
                ));
            }
            _ => known = Some((uid, name)),
        }
    }
    let mut warnings = Vec::new();
    if containers.len() > 1 {
        let names: Vec<&str> = containers
            .iter()
            .map(|c| c.get("name").and_then(Value::as_str).unwrap_or(""))
            .collect();
        warnings.push(format!(
            "{} app containers ({}): the sidecar cannot tell which one is the workload until one connects to its socket; until then the Pod is shown not identified (condition Supervised=False, WorkloadNotIdentified) and a missed recovery deadline stops nothing",
            names.len(),
            names.join(", ")
        ));
    }
    if known.is_none() && configured_uid.is_none() {
        warnings.push(
            "no runAsUser is set for the Pod or its containers: if the image runs as root, the non-root sidecar cannot identify or stop the workload and the Pod is shown not identified (condition Supervised=False); set runAsUser and runAsNonRoot: true to be sure it is supervised".to_owned(),
        );
    }
    match (known, configured_uid) {
        (Some((uid, name)), Some(sidecar)) if uid != sidecar => Err(Unsupervised::new(
            SkipReason::UidMismatch,
            format!(
                "container {name:?} runs as UID {uid} and the sidecar as {sidecar} (the webhook's OPENSHELL_WEBHOOK_SIDECAR_RUN_AS_USER) — the sidecar can follow processes of its own UID only"
            ),
        )),
        // Unconfigured, the sidecar runs as the Pod's UID or its image's user: given the
        // containers' own where that differs.
        (Some((uid, _)), None) if uid != pod_uid.unwrap_or(SIDECAR_IMAGE_UID) => Ok(Fit {
            sidecar_uid: Some(uid),
            warnings,
        }),
        _ => Ok(Fit {
            sidecar_uid: None,
            warnings,
        }),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn spec(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    fn reason(value: Value, configured: Option<i64>) -> Option<SkipReason> {
        assess(&spec(value), configured).err().map(|u| u.reason)
    }

    #[test]
    fn every_shape_has_its_outcome() {
        let app = |security: Value| json!({ "name": "app", "securityContext": security });
        let cases = [
            (json!({ "containers": [ { "name": "app" } ] }), None),
            (
                json!({ "hostNetwork": true, "containers": [ { "name": "app" } ] }),
                Some(SkipReason::HostNetwork),
            ),
            (
                json!({ "shareProcessNamespace": false, "containers": [ { "name": "app" } ] }),
                Some(SkipReason::ProcessNamespaceOff),
            ),
            (
                json!({ "shareProcessNamespace": true, "containers": [ { "name": "app" } ] }),
                None,
            ),
            (
                json!({ "securityContext": { "runAsUser": 0 }, "containers": [ { "name": "app" } ] }),
                Some(SkipReason::RunsAsRoot),
            ),
            (
                json!({ "containers": [ app(json!({ "runAsUser": 0 })) ] }),
                Some(SkipReason::RunsAsRoot),
            ),
            // A container's own non-root UID beats the Pod's root (the sidecar gets it too).
            (
                json!({ "securityContext": { "runAsUser": 0 }, "containers": [ app(json!({ "runAsUser": 1000 })) ] }),
                None,
            ),
            (
                json!({ "securityContext": { "runAsUser": 0 }, "containers": [ app(json!({ "runAsUser": 1000 })), { "name": "b" } ] }),
                Some(SkipReason::RunsAsRoot),
            ),
            (
                json!({ "containers": [ app(json!({ "runAsUser": 1000 })), { "name": "b", "securityContext": { "runAsUser": 2000 } } ] }),
                Some(SkipReason::UidMismatch),
            ),
            (
                json!({ "securityContext": { "runAsUser": 1000 }, "containers": [ app(json!({})), { "name": "b" } ] }),
                None,
            ),
        ];
        for (pod, expected) in cases {
            assert_eq!(reason(pod.clone(), None), expected, "{pod}");
        }
        let configured = json!({ "containers": [ app(json!({ "runAsUser": 1000 })) ] });
        assert_eq!(reason(configured.clone(), Some(2000)), Some(SkipReason::UidMismatch));
        assert_eq!(reason(configured, Some(1000)), None);
    }

    #[test]
    fn the_sidecar_takes_the_containers_uid_only_when_nothing_else_names_one() {
        let own = |uid: i64| json!({ "containers": [ { "name": "app", "securityContext": { "runAsUser": uid } } ] });
        assert_eq!(
            assess(&spec(own(1000)), None),
            Ok(Fit {
                sidecar_uid: Some(1000),
                warnings: Vec::new(),
            })
        );
        assert_eq!(assess(&spec(own(SIDECAR_IMAGE_UID)), None), Ok(Fit::default()));
        assert_eq!(assess(&spec(own(1000)), Some(1000)), Ok(Fit::default()));
        let pod_level = json!({ "securityContext": { "runAsUser": 1000 }, "containers": [ { "name": "app" } ] });
        assert_eq!(assess(&spec(pod_level), None), Ok(Fit::default()));
        let root_pod = json!({ "securityContext": { "runAsUser": 0 }, "containers": [ { "name": "app", "securityContext": { "runAsUser": 1000 } } ] });
        assert_eq!(
            assess(&spec(root_pod), None),
            Ok(Fit {
                sidecar_uid: Some(1000),
                warnings: Vec::new(),
            })
        );
        let unknown = json!({ "containers": [ { "name": "app" } ] });
        assert_eq!(assess(&spec(unknown), None).map(|fit| fit.sidecar_uid), Ok(None));
    }

    #[test]
    fn what_the_spec_cannot_promise_is_a_warning() {
        let warnings = |pod: Value, configured: Option<i64>| assess(&spec(pod), configured).map(|fit| fit.warnings);
        // No UID anywhere: the image's USER may be root.
        let unknown = warnings(json!({ "containers": [ { "name": "app" } ] }), None).unwrap_or_default();
        assert!(
            unknown.len() == 1 && unknown[0].contains("runAsUser") && unknown[0].contains("root"),
            "{unknown:?}"
        );
        // A known non-root UID, at Pod level, on the container, or configured: nothing to say.
        let one = json!({ "securityContext": { "runAsUser": 1000 }, "containers": [ { "name": "app" } ] });
        assert_eq!(warnings(one, None), Ok(vec![]));
        let own = json!({ "containers": [ { "name": "app", "securityContext": { "runAsUser": 1000 } } ] });
        assert_eq!(warnings(own, None), Ok(vec![]));
        assert_eq!(
            warnings(json!({ "containers": [ { "name": "app" } ] }), Some(1000)),
            Ok(vec![])
        );
        // Two app containers: identified only once one connects.
        let two = json!({ "securityContext": { "runAsUser": 1000 }, "containers": [ { "name": "web" }, { "name": "worker" } ] });
        let two = warnings(two, None).unwrap_or_default();
        assert!(
            two.len() == 1 && two[0].contains("web, worker") && two[0].contains("connects"),
            "{two:?}"
        );
    }

    #[test]
    fn messages_name_the_container_and_the_way_out() {
        let Err(root) = assess(
            &spec(json!({ "containers": [ { "name": "web", "securityContext": { "runAsUser": 0 } } ] })),
            None,
        ) else {
            panic!("a root container is not supervisable");
        };
        assert!(
            root.message.contains("\"web\"") && root.message.contains("non-root"),
            "{}",
            root.message
        );
    }
}
