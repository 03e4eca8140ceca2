//! The pure Pod mutation: decides whether a Pod gets the supervision injection and builds the
//! RFC 6902 JSON Patch for it.
//!
//! Everything here works on the **raw** Pod JSON ([`serde_json::Value`]) as the API server sent
//! it, never on typed structs, so fields this crate does not know (newer API fields, alpha
//! fields) cannot be lost by a decode/encode round trip: the patch only ever *adds* at paths it
//! has checked. Missing arrays and maps are created with one `add` carrying the whole new value
//! (an `add` to `/spec/volumes/-` on a Pod without `spec.volumes` is refused by the API server
//! with `doc is missing path`), and existing ones are appended to.

use std::borrow::Cow;
use std::fmt;

use serde::Serialize;
use serde_json::{Map, Value, json};

/// Name of the injected sidecar container.
pub const SIDECAR_NAME: &str = "openshell-sidecar";
/// Annotation recording the injection (version and what was injected).
pub const INJECTED_ANNOTATION: &str = "supervision.openshell.ai/injected";
/// Per-Pod override of the sidecar mode: `native` or `container`.
pub const SIDECAR_MODE_ANNOTATION: &str = "supervision.openshell.ai/sidecar-mode";
/// Per-Pod opt-out label (`supervision.openshell.ai/inject=disabled`).
pub const INJECT_LABEL: &str = "supervision.openshell.ai/inject";
/// Value of [`INJECT_LABEL`] that opts a Pod out.
pub const INJECT_DISABLED: &str = "disabled";
/// The token/trust Secret the gateway keeps in every labelled namespace.
pub const TOKEN_SECRET: &str = "openshell-supervision-token";
/// Name of the Pod volume holding [`TOKEN_SECRET`].
pub const TOKEN_VOLUME: &str = "openshell-supervision-token";
/// Where the sidecar sees the token Secret (read-only).
pub const SUPERVISION_DIR: &str = "/var/run/openshell/supervision";
/// The sidecar's local endpoint for the workload.
pub const SIDECAR_ADDR: &str = "127.0.0.1:7071";
/// Namespaces that are never mutated, whatever the webhook's selectors say.
pub const SYSTEM_NAMESPACES: [&str; 3] = ["kube-system", "kube-public", "kube-node-lease"];

/// How the sidecar is added to the Pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SidecarMode {
    /// Kubernetes native sidecar (≥ 1.29): an init container with `restartPolicy: Always`,
    /// placed before the Pod's own init containers.
    Native,
    /// A regular container appended to `spec.containers` (clusters older than 1.29).
    Container,
}

impl SidecarMode {
    /// The annotation / metric label spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SidecarMode::Native => "native",
            SidecarMode::Container => "container",
        }
    }

    fn parse(value: &str) -> Option<Self> {
        match value.trim() {
            "native" => Some(SidecarMode::Native),
            "container" => Some(SidecarMode::Container),
            _ => None,
        }
    }
}

impl fmt::Display for SidecarMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Resource requests/limits of the sidecar (Kubernetes quantity strings).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SidecarResources {
    pub cpu_request: String,
    pub memory_request: String,
    pub cpu_limit: Option<String>,
    pub memory_limit: String,
}

impl Default for SidecarResources {
    fn default() -> Self {
        Self {
            cpu_request: "10m".into(),
            memory_request: "32Mi".into(),
            cpu_limit: Some("500m".into()),
            memory_limit: "128Mi".into(),
        }
    }
}

/// What to inject and where not to.
#[derive(Clone, Debug)]
pub struct InjectConfig {
    pub sidecar_image: String,
    pub image_pull_policy: String,
    pub default_mode: SidecarMode,
    pub supervisor_route: String,
    pub gateway_endpoint: String,
    pub install_namespace: String,
    pub resources: SidecarResources,
    /// `runAsUser` for the sidecar. `None` leaves it to the Pod's `securityContext.runAsUser`
    /// (so the sidecar runs as the workload's user and may signal it) or to the image's
    /// numeric `USER`.
    pub run_as_user: Option<i64>,
    /// Recorded in the annotation.
    pub version: String,
}

impl Default for InjectConfig {
    fn default() -> Self {
        Self {
            sidecar_image: "openshell/sidecar:0.1.0".into(),
            image_pull_policy: "IfNotPresent".into(),
            default_mode: SidecarMode::Native,
            supervisor_route: "https://openshell-supervisor.openshell-supervision.svc:7443".into(),
            gateway_endpoint: "https://openshell-gateway.openshell-supervision.svc:8443".into(),
            install_namespace: "openshell-supervision".into(),
            resources: SidecarResources::default(),
            run_as_user: None,
            version: env!("CARGO_PKG_VERSION").into(),
        }
    }
}

/// Why a Pod was left alone (metric label `reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkipReason {
    NotCreate,
    NotPod,
    SystemNamespace,
    InstallNamespace,
    OptedOut,
    HostNetwork,
    HostPid,
    AlreadyInjected,
    VolumeConflict,
}

impl SkipReason {
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::NotCreate => "not_create",
            SkipReason::NotPod => "not_pod",
            SkipReason::SystemNamespace => "system_namespace",
            SkipReason::InstallNamespace => "install_namespace",
            SkipReason::OptedOut => "opted_out",
            SkipReason::HostNetwork => "host_network",
            SkipReason::HostPid => "host_pid",
            SkipReason::AlreadyInjected => "already_injected",
            SkipReason::VolumeConflict => "volume_conflict",
        }
    }
}

/// One RFC 6902 operation. The webhook only ever emits `add`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PatchOp {
    pub op: &'static str,
    pub path: String,
    pub value: Value,
}

impl PatchOp {
    fn add(path: String, value: Value) -> Self {
        Self { op: "add", path, value }
    }
}

/// A decided injection.
#[derive(Clone, Debug, PartialEq)]
pub struct Injection {
    pub patch: Vec<PatchOp>,
    pub mode: SidecarMode,
    /// Returned to the client as admission warnings.
    pub warnings: Vec<String>,
}

/// The outcome of [`Injector::mutate_pod`].
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    Inject(Injection),
    Skip(SkipReason),
}

/// The Pod JSON has a shape the API server would never send; nothing is patched.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InjectError {
    #[error("the Pod has no `spec` object")]
    MissingSpec,
    #[error("the Pod has no `spec.containers` array")]
    MissingContainers,
    #[error("`{0}` is present but is not {1}")]
    WrongType(String, &'static str),
}

/// Escape one JSON Pointer reference token (RFC 6901): `~` becomes `~0`, then `/` becomes
/// `~1`. The order matters: the other order would turn `/` into `~01`.
pub fn escape_pointer_token(token: &str) -> Cow<'_, str> {
    if token.contains(['~', '/']) {
        Cow::Owned(token.replace('~', "~0").replace('/', "~1"))
    } else {
        Cow::Borrowed(token)
    }
}

/// The injection, with the JSON it adds built once.
#[derive(Clone, Debug)]
pub struct Injector {
    config: InjectConfig,
    sidecar_native: Value,
    sidecar_container: Value,
    volume: Value,
    workload_env: Vec<Value>,
}

#[derive(Serialize)]
struct InjectedRecord<'a> {
    version: &'a str,
    mode: &'static str,
    sidecar: &'a str,
    image: &'a str,
    volume: &'a str,
    env: Vec<&'a str>,
}

fn env_value(name: &str, value: &str) -> Value {
    json!({ "name": name, "value": value })
}

fn env_field(name: &str, field_path: &str) -> Value {
    json!({ "name": name, "valueFrom": { "fieldRef": { "apiVersion": "v1", "fieldPath": field_path } } })
}

fn string_at<'a>(map: Option<&'a Value>, key: &str) -> Option<&'a str> {
    map.and_then(Value::as_object)
        .and_then(|m| m.get(key))
        .and_then(Value::as_str)
}

fn has_named(list: Option<&Value>, name: &str) -> bool {
    list.and_then(Value::as_array).is_some_and(|items| {
        items
            .iter()
            .any(|item| item.get("name").and_then(Value::as_str) == Some(name))
    })
}

/// `Some(array)` if present as an array, `None` if absent or null, an error otherwise.
fn array_or_absent<'a>(value: Option<&'a Value>, path: &str) -> Result<Option<&'a Vec<Value>>, InjectError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => Ok(Some(items)),
        Some(_) => Err(InjectError::WrongType(path.to_string(), "an array")),
    }
}

impl Injector {
    pub fn new(config: InjectConfig) -> Self {
        let mut env = vec![
            env_value("OPENSHELL_SUPERVISOR_ROUTE", &config.supervisor_route),
            env_value("OPENSHELL_GATEWAY_ENDPOINT", &config.gateway_endpoint),
            env_field("OPENSHELL_POD_NAME", "metadata.name"),
            env_field("OPENSHELL_POD_NAMESPACE", "metadata.namespace"),
            env_field("OPENSHELL_POD_UID", "metadata.uid"),
            env_value("OPENSHELL_SUPERVISION_DIR", SUPERVISION_DIR),
        ];
        env.push(env_value("OPENSHELL_SIDECAR_ADDR", SIDECAR_ADDR));

        let mut limits = Map::new();
        if let Some(cpu) = &config.resources.cpu_limit {
            limits.insert("cpu".into(), Value::String(cpu.clone()));
        }
        limits.insert("memory".into(), Value::String(config.resources.memory_limit.clone()));

        let mut security = json!({
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "runAsNonRoot": true,
            "capabilities": { "drop": ["ALL"] },
            "seccompProfile": { "type": "RuntimeDefault" },
        });
        if let (Some(uid), Some(map)) = (config.run_as_user, security.as_object_mut()) {
            map.insert("runAsUser".into(), Value::from(uid));
        }

        let sidecar_container = json!({
            "name": SIDECAR_NAME,
            "image": config.sidecar_image,
            "imagePullPolicy": config.image_pull_policy,
            "command": ["/usr/local/bin/sidecar"],
            "env": env,
            "resources": {
                "requests": {
                    "cpu": config.resources.cpu_request,
                    "memory": config.resources.memory_request,
                },
                "limits": limits,
            },
            "securityContext": security,
            "volumeMounts": [
                { "name": TOKEN_VOLUME, "mountPath": SUPERVISION_DIR, "readOnly": true }
            ],
            "terminationMessagePolicy": "FallbackToLogsOnError",
        });
        let mut sidecar_native = sidecar_container.clone();
        if let Some(map) = sidecar_native.as_object_mut() {
            map.insert("restartPolicy".into(), Value::from("Always"));
        }

        let volume = json!({
            "name": TOKEN_VOLUME,
            "secret": { "secretName": TOKEN_SECRET, "defaultMode": 0o440 },
        });
        let workload_env = vec![
            env_value("OPENSHELL_SUPERVISOR_ROUTE", &config.supervisor_route),
            env_value("OPENSHELL_SIDECAR_ADDR", SIDECAR_ADDR),
        ];
        Self {
            config,
            sidecar_native,
            sidecar_container,
            volume,
            workload_env,
        }
    }

    pub fn config(&self) -> &InjectConfig {
        &self.config
    }

    /// The sidecar container this injector adds in `mode`.
    pub fn sidecar(&self, mode: SidecarMode) -> &Value {
        match mode {
            SidecarMode::Native => &self.sidecar_native,
            SidecarMode::Container => &self.sidecar_container,
        }
    }

    /// The token Secret volume this injector adds.
    pub fn volume(&self) -> &Value {
        &self.volume
    }

    /// The env vars added to each workload container (unless it sets the same name).
    pub fn workload_env(&self) -> &[Value] {
        &self.workload_env
    }

    /// Is `namespace` one that must never be mutated?
    pub fn namespace_excluded(&self, namespace: &str) -> Option<SkipReason> {
        if SYSTEM_NAMESPACES.contains(&namespace) {
            Some(SkipReason::SystemNamespace)
        } else if namespace == self.config.install_namespace {
            Some(SkipReason::InstallNamespace)
        } else {
            None
        }
    }

    /// Decide about one Pod (the raw `request.object`) in `namespace` and build its patch.
    pub fn mutate_pod(&self, pod: &Value, namespace: &str) -> Result<Decision, InjectError> {
        if let Some(reason) = self.namespace_excluded(namespace) {
            return Ok(Decision::Skip(reason));
        }
        let metadata = pod.get("metadata");
        if metadata.is_some_and(|m| !m.is_object() && !m.is_null()) {
            return Err(InjectError::WrongType("metadata".into(), "an object"));
        }
        let labels = metadata.and_then(|m| m.get("labels"));
        let annotations = metadata.and_then(|m| m.get("annotations"));
        if string_at(labels, INJECT_LABEL) == Some(INJECT_DISABLED) {
            return Ok(Decision::Skip(SkipReason::OptedOut));
        }

        let spec = match pod.get("spec") {
            Some(Value::Object(spec)) => spec,
            _ => return Err(InjectError::MissingSpec),
        };
        if spec.get("hostNetwork").and_then(Value::as_bool) == Some(true) {
            return Ok(Decision::Skip(SkipReason::HostNetwork));
        }
        // `shareProcessNamespace` and `hostPID` together are rejected by Pod validation.
        if spec.get("hostPID").and_then(Value::as_bool) == Some(true) {
            return Ok(Decision::Skip(SkipReason::HostPid));
        }

        let containers = match spec.get("containers") {
            Some(Value::Array(containers)) => containers,
            Some(Value::Null) | None => return Err(InjectError::MissingContainers),
            Some(_) => {
                return Err(InjectError::WrongType("spec.containers".into(), "an array"));
            }
        };
        let init_containers = array_or_absent(spec.get("initContainers"), "spec.initContainers")?;
        let volumes = array_or_absent(spec.get("volumes"), "spec.volumes")?;

        let annotation_map = match annotations {
            None | Some(Value::Null) => None,
            Some(Value::Object(map)) => Some(map),
            Some(_) => {
                return Err(InjectError::WrongType("metadata.annotations".into(), "an object"));
            }
        };

        // Idempotency: a Pod that carries our annotation or our container is done.
        if annotation_map.is_some_and(|m| m.contains_key(INJECTED_ANNOTATION))
            || has_named(spec.get("containers"), SIDECAR_NAME)
            || has_named(spec.get("initContainers"), SIDECAR_NAME)
        {
            return Ok(Decision::Skip(SkipReason::AlreadyInjected));
        }

        // A volume with our name: reuse it if it is our Secret, otherwise leave the Pod alone
        // rather than mount someone else's volume into the sidecar.
        let mut add_volume = true;
        if let Some(existing) = volumes.and_then(|vols| {
            vols.iter()
                .find(|v| v.get("name").and_then(Value::as_str) == Some(TOKEN_VOLUME))
        }) {
            if existing.pointer("/secret/secretName").and_then(Value::as_str) == Some(TOKEN_SECRET) {
                add_volume = false;
            } else {
                return Ok(Decision::Skip(SkipReason::VolumeConflict));
            }
        }

        let mut warnings = Vec::new();
        let mode = match string_at(annotations, SIDECAR_MODE_ANNOTATION) {
            None => self.config.default_mode,
            Some(value) => match SidecarMode::parse(value) {
                Some(mode) => mode,
                None => {
                    warnings.push(format!(
                        "{SIDECAR_MODE_ANNOTATION}={value:?} is not `native` or `container`; \
                         using `{}`",
                        self.config.default_mode
                    ));
                    self.config.default_mode
                }
            },
        };

        let mut patch = Vec::with_capacity(containers.len() + 6);

        // 1. The sidecar.
        match mode {
            SidecarMode::Native => match init_containers {
                // Before the Pod's own init containers, so it runs while they run.
                Some(_) => patch.push(PatchOp::add(
                    "/spec/initContainers/0".into(),
                    self.sidecar_native.clone(),
                )),
                None => patch.push(PatchOp::add(
                    "/spec/initContainers".into(),
                    Value::Array(vec![self.sidecar_native.clone()]),
                )),
            },
            // After the workload's containers, so the Pod's default container is unchanged.
            SidecarMode::Container => patch.push(PatchOp::add(
                "/spec/containers/-".into(),
                self.sidecar_container.clone(),
            )),
        }

        // 2. The supervisor route and sidecar address on every workload container.
        let mut env_containers = Vec::with_capacity(containers.len());
        for (index, container) in containers.iter().enumerate() {
            let Some(container) = container.as_object() else {
                return Err(InjectError::WrongType(format!("spec.containers[{index}]"), "an object"));
            };
            let name = container.get("name").and_then(Value::as_str).unwrap_or("");
            let env_path = format!("spec.containers[{index}].env");
            match array_or_absent(container.get("env"), &env_path)? {
                None => {
                    patch.push(PatchOp::add(
                        format!("/spec/containers/{index}/env"),
                        Value::Array(self.workload_env.clone()),
                    ));
                    env_containers.push(name);
                }
                Some(existing) => {
                    let mut added = false;
                    for var in &self.workload_env {
                        let var_name = var.get("name").and_then(Value::as_str).unwrap_or("");
                        if !has_named_in(existing, var_name) {
                            patch.push(PatchOp::add(format!("/spec/containers/{index}/env/-"), var.clone()));
                            added = true;
                        }
                    }
                    if added {
                        env_containers.push(name);
                    }
                }
            }
        }

        // 3. The token Secret volume.
        if add_volume {
            match volumes {
                Some(_) => patch.push(PatchOp::add("/spec/volumes/-".into(), self.volume.clone())),
                None => patch.push(PatchOp::add(
                    "/spec/volumes".into(),
                    Value::Array(vec![self.volume.clone()]),
                )),
            }
        }

        // 4. A shared process namespace so the sidecar can see and stop the workload.
        if spec.get("shareProcessNamespace").and_then(Value::as_bool) != Some(true) {
            patch.push(PatchOp::add("/spec/shareProcessNamespace".into(), Value::Bool(true)));
        }

        // 5. The record of what was injected.
        let record = InjectedRecord {
            version: &self.config.version,
            mode: mode.as_str(),
            sidecar: SIDECAR_NAME,
            image: &self.config.sidecar_image,
            volume: TOKEN_VOLUME,
            env: env_containers,
        };
        let record = Value::String(serde_json::to_string(&record).unwrap_or_default());
        match (metadata, annotation_map) {
            (_, Some(_)) => patch.push(PatchOp::add(
                format!("/metadata/annotations/{}", escape_pointer_token(INJECTED_ANNOTATION)),
                record,
            )),
            (Some(Value::Object(_)), None) => patch.push(PatchOp::add(
                "/metadata/annotations".into(),
                json!({ INJECTED_ANNOTATION: record }),
            )),
            _ => patch.push(PatchOp::add(
                "/metadata".into(),
                json!({ "annotations": { INJECTED_ANNOTATION: record } }),
            )),
        }

        Ok(Decision::Inject(Injection { patch, mode, warnings }))
    }
}

fn has_named_in(items: &[Value], name: &str) -> bool {
    items
        .iter()
        .any(|item| item.get("name").and_then(Value::as_str) == Some(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_order_is_tilde_then_slash() {
        assert_eq!(
            escape_pointer_token("supervision.openshell.ai/injected"),
            "supervision.openshell.ai~1injected"
        );
        // `~` first: `a~/b` must become `a~0~1b`, not `a~01b` (slash first would give that).
        assert_eq!(escape_pointer_token("a~/b"), "a~0~1b");
        assert_eq!(escape_pointer_token("~1"), "~01");
        assert_eq!(escape_pointer_token("plain"), "plain");
    }

    #[test]
    fn bad_mode_annotation_falls_back_with_warning() {
        let injector = Injector::new(InjectConfig::default());
        let pod = json!({
            "metadata": { "annotations": { SIDECAR_MODE_ANNOTATION: "sideways" } },
            "spec": { "containers": [ { "name": "app", "image": "x" } ] }
        });
        let Ok(Decision::Inject(injection)) = injector.mutate_pod(&pod, "team-a") else {
            panic!("expected an injection");
        };
        assert_eq!(injection.mode, SidecarMode::Native);
        assert_eq!(injection.warnings.len(), 1);
        assert!(injection.warnings[0].contains("sideways"));
    }

    #[test]
    fn wrong_types_are_errors_not_panics() {
        let injector = Injector::new(InjectConfig::default());
        for (pod, expected) in [
            (json!({ "metadata": {} }), InjectError::MissingSpec),
            (json!({ "spec": {} }), InjectError::MissingContainers),
            (
                json!({ "spec": { "containers": {} } }),
                InjectError::WrongType("spec.containers".into(), "an array"),
            ),
            (
                json!({ "spec": { "containers": [], "volumes": "x" } }),
                InjectError::WrongType("spec.volumes".into(), "an array"),
            ),
            (
                json!({ "spec": { "containers": [ { "name": "a", "env": 3 } ] } }),
                InjectError::WrongType("spec.containers[0].env".into(), "an array"),
            ),
            (
                json!({ "metadata": 7, "spec": { "containers": [] } }),
                InjectError::WrongType("metadata".into(), "an object"),
            ),
        ] {
            assert_eq!(injector.mutate_pod(&pod, "team-a"), Err(expected));
        }
    }

    #[test]
    fn foreign_volume_with_our_name_is_left_alone() {
        let injector = Injector::new(InjectConfig::default());
        let pod = json!({ "spec": {
            "containers": [ { "name": "app" } ],
            "volumes": [ { "name": TOKEN_VOLUME, "emptyDir": {} } ]
        }});
        assert_eq!(
            injector.mutate_pod(&pod, "team-a"),
            Ok(Decision::Skip(SkipReason::VolumeConflict))
        );
    }
}
