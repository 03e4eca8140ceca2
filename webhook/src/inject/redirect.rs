//! Egress redirection: what the injection adds to a Pod of a namespace that turned it on
//! ([`super::EGRESS_MODE_LABEL`]), and whether it holds for this Pod.
//!
//! Two containers besides the sidecar: [`EGRESS_INIT_NAME`] installs the Pod's network rules
//! (`egress install-rules`, the only container with `NET_ADMIN`, which is why the namespace
//! must allow Pod Security level `privileged`) and exits before any other container starts;
//! [`DIALER_NAME`] (`egress dialer`, its own UID) opens the connections the sidecar decided,
//! the only ones the rules let out. The rules hold against a workload process as long as it
//! cannot become the dialer's UID: [`assess`] says when a container could, and when the Pod
//! cannot be redirected at all (it is then refused: [`super::Refusal::NotRedirected`]).

use serde_json::{Map, Value, json};

use super::{
    DIALER_DIR, DIALER_NAME, DIALER_SOCKET, DIALER_VOLUME, EGRESS_INIT_NAME, InjectConfig, Redirection, env_value,
};

/// The init container that installs the network rules.
pub(super) fn init_container(config: &InjectConfig, port: u16, dialer_uid: i64) -> Value {
    json!({
        "name": EGRESS_INIT_NAME,
        "image": config.sidecar_image,
        "imagePullPolicy": config.image_pull_policy,
        "command": ["/usr/local/bin/egress", "install-rules"],
        "env": [
            env_value("OPENSHELL_EGRESS_DIALER_UID", &dialer_uid.to_string()),
            env_value("OPENSHELL_EGRESS_REDIRECT_PORT", &port.to_string()),
            env_value("OPENSHELL_LOG_FORMAT", "json"),
        ],
        "resources": {
            "requests": { "cpu": "10m", "memory": "16Mi" },
            "limits": { "memory": "64Mi" },
        },
        // Root for nft's netlink calls, with NET_ADMIN and nothing else; it exits at once.
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": false,
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "capabilities": { "drop": ["ALL"], "add": ["NET_ADMIN"] },
            "seccompProfile": { "type": "RuntimeDefault" },
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
    })
}

/// The dialer, as a native sidecar (`native`) or a container.
pub(super) fn dialer(config: &InjectConfig, dialer_uid: i64, native: bool) -> Value {
    let mut dialer = json!({
        "name": DIALER_NAME,
        "image": config.sidecar_image,
        "imagePullPolicy": config.image_pull_policy,
        "command": ["/usr/local/bin/egress", "dialer"],
        "env": [
            env_value("OPENSHELL_EGRESS_DIALER", DIALER_SOCKET),
            env_value("OPENSHELL_LOG_FORMAT", "json"),
        ],
        "resources": {
            "requests": { "cpu": "5m", "memory": "8Mi" },
            "limits": { "memory": "32Mi" },
        },
        "securityContext": {
            "runAsUser": dialer_uid,
            "runAsGroup": dialer_uid,
            "runAsNonRoot": true,
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "capabilities": { "drop": ["ALL"] },
            "seccompProfile": { "type": "RuntimeDefault" },
        },
        "volumeMounts": [{ "name": DIALER_VOLUME, "mountPath": DIALER_DIR }],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    });
    if let (true, Some(map)) = (native, dialer.as_object_mut()) {
        map.insert("restartPolicy".into(), Value::from("Always"));
    }
    dialer
}

/// The dialer's socket volume.
pub(super) fn volume() -> Value {
    json!({ "name": DIALER_VOLUME, "emptyDir": { "medium": "Memory", "sizeLimit": "1Mi" } })
}

/// What the sidecar gets under redirection: its listener and the dialer.
pub(super) fn sidecar_env(redirection: Redirection) -> [Value; 2] {
    [
        env_value(
            "OPENSHELL_EGRESS_REDIRECT_LISTEN",
            &format!("127.0.0.1:{}", redirection.port),
        ),
        env_value("OPENSHELL_EGRESS_DIALER", DIALER_SOCKET),
    ]
}

pub(super) fn sidecar_mount() -> Value {
    json!({ "name": DIALER_VOLUME, "mountPath": DIALER_DIR })
}

/// Whether redirection holds for the Pod `spec`: `Err` with the reason when it cannot be set
/// up (the Pod is refused), else the warnings for containers it may not hold against (its
/// init containers included).
pub(super) fn assess(spec: &Map<String, Value>, port: u16, dialer_uid: i64) -> Result<Vec<String>, String> {
    if let Some(holder) = super::port_holder(spec, port) {
        return Err(format!(
            "container {holder:?} declares port {port}, where the sidecar's redirect listener goes; use another port"
        ));
    }
    let pod = spec.get("securityContext");
    let field = |container: &Value, key: &str| {
        container
            .get("securityContext")
            .and_then(|c| c.get(key))
            .or_else(|| pod.and_then(|p| p.get(key)))
            .cloned()
    };
    let mut warnings = Vec::new();
    let containers = ["initContainers", "containers"]
        .iter()
        .filter_map(|list| spec.get(*list).and_then(Value::as_array))
        .flatten();
    for container in containers {
        let name = container.get("name").and_then(Value::as_str).unwrap_or("");
        let uid = field(container, "runAsUser").and_then(|v| v.as_i64());
        if uid == Some(dialer_uid) {
            return Err(format!(
                "container {name:?} runs as UID {dialer_uid}, the egress dialer's, whose connections leave the Pod undecided; run it as another UID"
            ));
        }
        let no_escalation = container
            .get("securityContext")
            .and_then(|c| c.get("allowPrivilegeEscalation"))
            .and_then(Value::as_bool)
            == Some(false);
        let non_root =
            uid.is_some_and(|uid| uid != 0) || field(container, "runAsNonRoot").and_then(|v| v.as_bool()) == Some(true);
        let mut missing = Vec::new();
        if !no_escalation {
            missing.push("allowPrivilegeEscalation: false");
        }
        if !non_root {
            missing.push("runAsNonRoot: true (or a non-zero runAsUser)");
        }
        if !missing.is_empty() {
            warnings.push(format!(
                "egress redirection may not hold against container {name:?}: without {} a process in it could take the dialer's UID (a setuid or file-capability executable, or root's CAP_SETUID) and leave the Pod undecided",
                missing.join(" and ")
            ));
        }
    }
    Ok(warnings)
}

/// Why a `kubectl debug` container of the injected `pod` would leave it undecided: it runs as
/// the UID of the Pod's dialer.
pub(super) fn debug_as_dialer(pod: &Value) -> Option<String> {
    let containers = |list: &str| {
        pod.pointer(&format!("/spec/{list}"))
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
    };
    let uid = |c: &Value| c.pointer("/securityContext/runAsUser").and_then(Value::as_i64);
    let dialer_uid = containers("initContainers")
        .chain(containers("containers"))
        .find(|c| c.get("name").and_then(Value::as_str) == Some(DIALER_NAME))
        .and_then(uid)?;
    let debug = containers("ephemeralContainers").find(|c| uid(c) == Some(dialer_uid))?;
    let name = debug.get("name").and_then(Value::as_str).unwrap_or("");
    Some(format!(
        "ephemeral container {name:?} runs as UID {dialer_uid}, the egress dialer's; run it as another UID"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn a_hardened_pod_is_redirected_without_warnings() {
        let pod = spec(json!({
            "securityContext": { "runAsUser": 1000, "runAsNonRoot": true },
            "containers": [{ "name": "app", "securityContext": { "allowPrivilegeEscalation": false } }],
        }));
        assert_eq!(assess(&pod, 15002, 15999), Ok(vec![]));
    }

    #[test]
    fn a_container_that_could_take_the_dialers_uid_is_warned_about() {
        let pod = spec(json!({ "containers": [{ "name": "app" }] }));
        let warnings = assess(&pod, 15002, 15999).expect("redirected");
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("\"app\""), "{warnings:?}");
        assert!(
            warnings[0].contains("allowPrivilegeEscalation: false and runAsNonRoot"),
            "{warnings:?}"
        );
    }

    #[test]
    fn an_init_container_is_assessed_too() {
        let pod = spec(json!({
            "securityContext": { "runAsNonRoot": true },
            "initContainers": [{ "name": "setup", "securityContext": { "runAsUser": 15999 } }],
            "containers": [{ "name": "app", "securityContext": { "allowPrivilegeEscalation": false } }],
        }));
        let reason = assess(&pod, 15002, 15999).expect_err("refused");
        assert!(reason.contains("\"setup\""), "{reason}");
    }

    #[test]
    fn a_container_running_as_the_dialer_or_holding_the_port_is_not_redirected() {
        let as_dialer = spec(json!({ "containers": [{ "name": "app", "securityContext": { "runAsUser": 15999 } }] }));
        let reason = assess(&as_dialer, 15002, 15999).expect_err("not redirected");
        assert!(reason.contains("UID 15999"), "{reason}");
        let port = spec(json!({ "containers": [{ "name": "app", "ports": [{ "containerPort": 15002 }] }] }));
        let reason = assess(&port, 15002, 15999).expect_err("not redirected");
        assert!(reason.contains("port 15002"), "{reason}");
    }
}
