//! The pure Pod mutation: decides whether a Pod gets the supervision injection and builds the
//! RFC 6902 JSON Patch for it.
//!
//! Everything here works on the **raw** Pod JSON ([`serde_json::Value`]) as the API server sent
//! it, never on typed structs, so fields this crate does not know (newer API fields, alpha
//! fields) cannot be lost by a decode/encode round trip: the patch only ever *adds* at paths it
//! has checked. Missing arrays and maps are created with one `add` carrying the whole new value
//! (an `add` to `/spec/volumes/-` on a Pod without `spec.volumes` is refused by the API server
//! with `doc is missing path`), and existing ones are appended to. The patch is written as
//! JSON text by [`PatchWriter`], copying the constant parts serialized once at start.

use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::patch::{Fragment, PatchWriter};
pub use crate::patch::{JsonPatch, escape_pointer_token};

mod config;
mod redirect;
pub mod refuse;
pub mod shape;

pub use config::*;
use refuse::{ContainerList, ContainerView, PodView, Refusal, VolumeView};
use shape::Unsupervised;
pub use shape::{NOT_SUPERVISED_ANNOTATION, NOT_SUPERVISED_LABEL};

/// Why a Pod was left alone (metric label `reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkipReason {
    NotCreate,
    NotPod,
    SystemNamespace,
    InstallNamespace,
    OptedOut,
    HostNetwork,
    ForgedMarker,
    MountConflict,
    EphemeralContainers,
    ProcessNamespaceOff,
    RunsAsRoot,
    UidMismatch,
}

impl SkipReason {
    /// Every reason (each metric label starts at 0).
    pub const ALL: [Self; 12] = [
        SkipReason::NotCreate,
        SkipReason::NotPod,
        SkipReason::SystemNamespace,
        SkipReason::InstallNamespace,
        SkipReason::OptedOut,
        SkipReason::HostNetwork,
        SkipReason::ForgedMarker,
        SkipReason::MountConflict,
        SkipReason::EphemeralContainers,
        SkipReason::ProcessNamespaceOff,
        SkipReason::RunsAsRoot,
        SkipReason::UidMismatch,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::NotCreate => "not_create",
            SkipReason::NotPod => "not_pod",
            SkipReason::SystemNamespace => "system_namespace",
            SkipReason::InstallNamespace => "install_namespace",
            SkipReason::OptedOut => "opted_out",
            SkipReason::HostNetwork => "host_network",
            SkipReason::ForgedMarker => "forged_marker",
            SkipReason::MountConflict => "mount_conflict",
            SkipReason::EphemeralContainers => "ephemeral_containers",
            SkipReason::ProcessNamespaceOff => "process_namespace_off",
            SkipReason::RunsAsRoot => "runs_as_root",
            SkipReason::UidMismatch => "uid_mismatch",
        }
    }
}

/// A decided injection.
#[derive(Clone, Debug, PartialEq)]
pub struct Injection {
    /// The RFC 6902 patch (only `add` operations), as JSON text.
    pub patch: JsonPatch,
    pub mode: SidecarMode,
    /// Returned to the client as admission warnings.
    pub warnings: Vec<String>,
}

/// A Pod of a labelled namespace admitted as it is, without supervision ([`shape`]): the
/// patch adds only the annotation [`NOT_SUPERVISED_ANNOTATION`] with `message`, which is also
/// the admission warning.
#[derive(Clone, Debug, PartialEq)]
pub struct NotSupervised {
    pub reason: SkipReason,
    pub message: String,
    pub patch: JsonPatch,
}

/// The outcome of [`Injector::mutate_pod`].
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    Inject(Injection),
    Skip(SkipReason),
    /// Left unsupervised, and the Pod says why.
    NotSupervised(NotSupervised),
    /// Refused: the Pod would reach the sidecar's volumes or memory ([`refuse`]).
    Refuse(Refusal),
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

/// The injection, with the JSON it adds built once.
#[derive(Clone, Debug)]
pub struct Injector {
    config: InjectConfig,
    /// The sidecar container per mode (native, container) and egress proxy (off, on).
    sidecars: [[Fragment; 2]; 2],
    volumes: Vec<Fragment>,
    workload_env: Vec<Fragment>,
    workload_mount: Fragment,
    /// `workload_env`'s values, for callers that read them as a slice.
    workload_env_values: Vec<Value>,
    volume_values: Vec<Value>,
    /// Under egress redirection, what it adds.
    redirected: Option<Redirected>,
    /// The credential placeholders of the namespaces' policies, when the webhook follows
    /// them (`--placeholders`).
    policies: Option<crate::policies::Policies>,
}

/// What egress redirection adds to a Pod ([`redirect`]), built once.
#[derive(Clone, Debug)]
struct Redirected {
    redirection: Redirection,
    volume: Fragment,
    sidecar_env: [Fragment; 2],
    sidecar_mount: Fragment,
}

#[derive(Serialize)]
struct InjectedRecord<'a> {
    version: &'a str,
    mode: &'static str,
    sidecar: &'a str,
    image: &'a str,
    volumes: Vec<&'static str>,
    /// Workload containers that got at least one env var.
    env: Vec<&'a str>,
    /// Workload containers that got the socket mount.
    mounts: Vec<&'a str>,
    /// Where the sidecar's egress proxy listens, or why it does not (absent: turned off in
    /// the webhook's configuration).
    #[serde(skip_serializing_if = "Option::is_none")]
    egress: Option<String>,
    /// Under egress redirection (asked for by the namespace): where the Pod's connections go
    /// and who opens them, or why they are not redirected.
    #[serde(skip_serializing_if = "Option::is_none")]
    redirect: Option<String>,
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
    list.and_then(Value::as_array)
        .is_some_and(|items| has_named_in(items, name))
}

/// `Some(array)` if present as an array, `None` if absent or null, an error otherwise.
/// (`path` names the field in the error; it is built only then.)
fn array_or_absent<P: Into<String>>(
    value: Option<&Value>,
    path: impl FnOnce() -> P,
) -> Result<Option<&Vec<Value>>, InjectError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => Ok(Some(items)),
        Some(_) => Err(InjectError::WrongType(path().into(), "an array")),
    }
}

/// `Some(map)` if present as an object, `None` if absent or null, an error otherwise.
fn object_or_absent<P: Into<String>>(
    value: Option<&Value>,
    path: impl FnOnce() -> P,
) -> Result<Option<&Map<String, Value>>, InjectError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(map)) => Ok(Some(map)),
        Some(_) => Err(InjectError::WrongType(path().into(), "an object")),
    }
}

/// `map[key]` as a flag: absent or null is `false`, anything but a boolean an error.
fn flag<P: Into<String>>(
    map: Option<&Map<String, Value>>,
    key: &str,
    path: impl FnOnce() -> P,
) -> Result<bool, InjectError> {
    match map.and_then(|m| m.get(key)) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(set)) => Ok(*set),
        Some(_) => Err(InjectError::WrongType(format!("{}.{key}", path().into()), "a boolean")),
    }
}

/// `windowsOptions.hostProcess` of the security context at `path`.
fn host_process(security: Option<&Map<String, Value>>, path: &str) -> Result<bool, InjectError> {
    let options = object_or_absent(security.and_then(|s| s.get("windowsOptions")), || {
        format!("{path}.windowsOptions")
    })?;
    flag(options, "hostProcess", || format!("{path}.windowsOptions"))
}

/// Which part of a Pod the refusal rules read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scope {
    /// A Pod CREATE: its volumes, host namespaces and every container.
    Pod,
    /// A `pods/ephemeralcontainers` update: the ephemeral containers (nothing else of the
    /// spec changes there, and it was read at creation).
    EphemeralContainers,
}

/// What [`refuse::check`] reads of one container (`list[index]`).
fn container_view(list: ContainerList, index: usize, container: &Value) -> Result<ContainerView<'_>, InjectError> {
    let at = || format!("{}[{index}]", list.field());
    let Some(container) = container.as_object() else {
        return Err(InjectError::WrongType(at(), "an object"));
    };
    let mut volumes = Vec::new();
    for key in ["volumeMounts", "volumeDevices"] {
        let items = array_or_absent(container.get(key), || format!("{}.{key}", at()))?;
        volumes.extend(
            items
                .into_iter()
                .flatten()
                .filter_map(|item| item.get("name").and_then(Value::as_str)),
        );
    }
    let security_path = format!("{}.securityContext", at());
    let security = object_or_absent(container.get("securityContext"), || security_path.as_str())?;
    let capabilities = object_or_absent(security.and_then(|s| s.get("capabilities")), || {
        format!("{security_path}.capabilities")
    })?;
    let added = array_or_absent(capabilities.and_then(|c| c.get("add")), || {
        format!("{security_path}.capabilities.add")
    })?;
    let added_capabilities = added
        .into_iter()
        .flatten()
        .map(|capability| {
            capability
                .as_str()
                .ok_or_else(|| InjectError::WrongType(format!("{security_path}.capabilities.add[]"), "a string"))
        })
        .collect::<Result<_, _>>()?;
    Ok(ContainerView {
        list: Some(list),
        index,
        name: container.get("name").and_then(Value::as_str).unwrap_or(""),
        volumes,
        privileged: flag(security, "privileged", || security_path.as_str())?,
        host_process: host_process(security, &security_path)?,
        added_capabilities,
    })
}

/// What [`refuse::check`] reads of one declared volume.
fn volume_view(index: usize, volume: &Value) -> Result<VolumeView<'_>, InjectError> {
    let sources = array_or_absent(volume.pointer("/projected/sources"), || {
        format!("spec.volumes[{index}].projected.sources")
    })?;
    Ok(VolumeView {
        index,
        name: volume.get("name").and_then(Value::as_str).unwrap_or(""),
        token_audiences: sources
            .into_iter()
            .flatten()
            .filter_map(|source| source.pointer("/serviceAccountToken/audience").and_then(Value::as_str))
            .collect(),
    })
}

/// What [`refuse::check`] reads of the Pod spec in `scope`.
fn pod_view(spec: &Map<String, Value>, scope: Scope) -> Result<PodView<'_>, InjectError> {
    let mut view = PodView::default();
    let lists: &[ContainerList] = match scope {
        Scope::Pod => {
            view.host_pid = flag(Some(spec), "hostPID", || "spec")?;
            let security = object_or_absent(spec.get("securityContext"), || "spec.securityContext")?;
            view.host_process = host_process(security, "spec.securityContext")?;
            let volumes = array_or_absent(spec.get("volumes"), || "spec.volumes")?;
            for (index, volume) in volumes.into_iter().flatten().enumerate() {
                view.volumes.push(volume_view(index, volume)?);
            }
            &[
                ContainerList::Containers,
                ContainerList::InitContainers,
                ContainerList::EphemeralContainers,
            ]
        }
        Scope::EphemeralContainers => &[ContainerList::EphemeralContainers],
    };
    for &list in lists {
        let containers = array_or_absent(spec.get(list.key()), || list.field())?;
        for (index, container) in containers.into_iter().flatten().enumerate() {
            view.containers.push(container_view(list, index, container)?);
        }
    }
    Ok(view)
}

/// The first container (app or init) that declares `port` as a container port.
fn port_holder(spec: &Map<String, Value>, port: u16) -> Option<String> {
    ["containers", "initContainers"]
        .iter()
        .filter_map(|list| spec.get(*list).and_then(Value::as_array))
        .flatten()
        .find(|container| {
            container.get("ports").and_then(Value::as_array).is_some_and(|ports| {
                ports
                    .iter()
                    .any(|p| p.get("containerPort").and_then(Value::as_u64) == Some(u64::from(port)))
            })
        })
        .map(|container| container.get("name").and_then(Value::as_str).unwrap_or("").to_owned())
}

/// The same directory, ignoring trailing slashes (`/a/b/` and `/a/b`).
fn same_dir(a: &str, b: &str) -> bool {
    a.trim_end_matches('/') == b.trim_end_matches('/')
}

/// Sets `key` in the map at `path` (creating the map with one `add` when it is missing).
/// Nothing is emitted when the map already holds exactly `value`.
fn put_key(patch: &mut PatchWriter, path: &str, existing: Option<&Map<String, Value>>, key: &str, value: &str) {
    match existing {
        Some(map) if map.get(key).and_then(Value::as_str) == Some(value) => {}
        Some(_) => patch.add_value(format_args!("{path}/{}", escape_pointer_token(key)), &value),
        None => patch.add_value(
            format_args!("{path}"),
            &std::collections::BTreeMap::from([(key, value)]),
        ),
    }
}

impl Injector {
    pub fn new(config: InjectConfig) -> Self {
        let gateway_endpoints = config
            .gateway_endpoints
            .iter()
            .map(|e| e.trim())
            .filter(|e| !e.is_empty())
            .collect::<Vec<_>>()
            .join(",");
        // Exactly what the sidecar binary reads (sidecar/src/config.rs). The CA that verifies
        // the pool's certificates is `ca.crt` in the token Secret (OPENSHELL_SUPERVISION_DIR),
        // which the sidecar uses when OPENSHELL_TLS_CA is unset.
        let mut env = vec![
            env_value("OPENSHELL_SUPERVISOR_ROUTE", &config.supervisor_route),
            env_value("OPENSHELL_GATEWAY_ENDPOINTS", &gateway_endpoints),
        ];
        if let Some(name) = &config.supervisor_tls_name {
            env.push(env_value("OPENSHELL_SUPERVISOR_TLS_NAME", name));
        }
        env.extend([
            env_field("OPENSHELL_POD_NAME", "metadata.name"),
            env_field("OPENSHELL_POD_NAMESPACE", "metadata.namespace"),
            env_field("OPENSHELL_POD_UID", "metadata.uid"),
            env_value("OPENSHELL_SUPERVISION_DIR", SUPERVISION_DIR),
            env_value("OPENSHELL_SIDECAR_SOCKET", SIDECAR_SOCKET),
            env_value("OPENSHELL_SIDECAR_STATE_DIR", STATE_DIR),
            env_value("OPENSHELL_LOG_FORMAT", "json"),
            // The webhook shares the Pod's PID namespace: a workload that never connects to
            // the socket is identified as its container's main process.
            env_value("OPENSHELL_WORKLOAD_FROM_PID_NAMESPACE", "true"),
        ]);
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
                { "name": TOKEN_VOLUME, "mountPath": SUPERVISION_DIR, "readOnly": true },
                { "name": SOCKET_VOLUME, "mountPath": SOCKET_DIR },
                { "name": STATE_VOLUME, "mountPath": STATE_DIR },
            ],
            "terminationMessagePolicy": "FallbackToLogsOnError",
        });
        let mut sidecar_native = sidecar_container.clone();
        if let Some(map) = sidecar_native.as_object_mut() {
            map.insert("restartPolicy".into(), Value::from("Always"));
        }
        let with_proxy = |sidecar: &Value| {
            let mut sidecar = sidecar.clone();
            if let (Some(port), Some(env)) = (config.egress_port, sidecar["env"].as_array_mut()) {
                env.push(env_value("OPENSHELL_EGRESS_LISTEN", &format!("127.0.0.1:{port}")));
            }
            Fragment::new(sidecar)
        };
        let sidecars = [
            [with_proxy(&sidecar_native), Fragment::new(sidecar_native)],
            [with_proxy(&sidecar_container), Fragment::new(sidecar_container)],
        ];

        let volumes = vec![
            // World-readable inside the Pod: the sidecar runs as the workload's user (or the
            // image's), which is unknown here and not in the Secret volume's group unless the
            // Pod sets fsGroup. Only the sidecar mounts it.
            json!({
                "name": TOKEN_VOLUME,
                "projected": {
                    "defaultMode": 0o444,
                    "sources": [
                        { "secret": { "name": TOKEN_SECRET, "items": [
                            { "key": "trust.jwks", "path": "trust.jwks" },
                            { "key": "ca.crt", "path": "ca.crt" },
                        ] } },
                        { "serviceAccountToken": {
                            "audience": config.token_audience,
                            "expirationSeconds": config.token_expiration_seconds,
                            "path": "token",
                        } },
                    ],
                },
            }),
            json!({
                "name": SOCKET_VOLUME,
                "emptyDir": { "medium": "Memory", "sizeLimit": SOCKET_VOLUME_SIZE },
            }),
            json!({
                "name": STATE_VOLUME,
                "emptyDir": { "sizeLimit": STATE_VOLUME_SIZE },
            }),
        ];
        let mut workload_env = vec![
            env_value("OPENSHELL_SUPERVISOR_ROUTE", &config.supervisor_route),
            env_value("OPENSHELL_SIDECAR_SOCKET", SIDECAR_SOCKET),
        ];
        if let Some(port) = config.egress_port {
            let proxy = format!("http://127.0.0.1:{port}");
            workload_env.extend(PROXY_VARIABLES.iter().map(|name| env_value(name, &proxy)));
            workload_env.extend(
                NO_PROXY_VARIABLES
                    .iter()
                    .map(|name| env_value(name, "localhost,127.0.0.1,::1")),
            );
        }
        let workload_mount = json!({ "name": SOCKET_VOLUME, "mountPath": SOCKET_DIR });
        let redirected = match config.egress_redirect {
            Redirect::On(redirection) => Some(Redirected {
                redirection,
                volume: Fragment::new(redirect::volume()),
                sidecar_env: redirect::sidecar_env(redirection).map(Fragment::new),
                sidecar_mount: Fragment::new(redirect::sidecar_mount()),
            }),
            Redirect::Off | Redirect::Blocked => None,
        };
        Self {
            redirected,
            config,
            sidecars,
            volumes: volumes.iter().cloned().map(Fragment::new).collect(),
            workload_env: workload_env.iter().cloned().map(Fragment::new).collect(),
            workload_mount: Fragment::new(workload_mount),
            workload_env_values: workload_env,
            volume_values: volumes,
            policies: None,
        }
    }

    /// Sets the credential placeholders of the policies each Pod runs in its workload
    /// containers, from `policies`.
    #[must_use]
    pub fn with_policies(mut self, policies: crate::policies::Policies) -> Self {
        self.policies = Some(policies);
        self
    }

    pub fn config(&self) -> &InjectConfig {
        &self.config
    }

    /// The sidecar container this injector adds in `mode` (with its egress proxy when the
    /// configuration has one).
    pub fn sidecar(&self, mode: SidecarMode) -> &Value {
        self.sidecar_fragment(mode, true).value()
    }

    /// The sidecar in `mode`, with the egress proxy (if configured) or without it.
    fn sidecar_fragment(&self, mode: SidecarMode, proxy: bool) -> &Fragment {
        let by_proxy = match mode {
            SidecarMode::Native => &self.sidecars[0],
            SidecarMode::Container => &self.sidecars[1],
        };
        &by_proxy[usize::from(!proxy)]
    }

    /// The volumes this injector adds (token Secret, socket and state `emptyDir`s), each
    /// unless the Pod already has it.
    pub fn volumes(&self) -> &[Value] {
        &self.volume_values
    }

    /// The env vars added to each workload container (unless it sets the same name).
    pub fn workload_env(&self) -> &[Value] {
        &self.workload_env_values
    }

    /// The socket volume mount added to each workload container.
    pub fn workload_mount(&self) -> &Value {
        self.workload_mount.value()
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

    /// The rule of [`refuse`] the Pod's `spec` breaks in `scope`, if any.
    fn refusal(&self, pod: &Value, scope: Scope) -> Result<Option<Refusal>, InjectError> {
        let Some(Value::Object(spec)) = pod.get("spec") else {
            return Err(InjectError::MissingSpec);
        };
        Ok(refuse::check(&pod_view(spec, scope)?, &self.config.token_audience).err())
    }

    /// Decide about a `pods/ephemeralcontainers` update (the raw `request.object`: the whole
    /// Pod with its ephemeral containers) in `namespace`: refused when an ephemeral container
    /// breaks a rule of [`refuse`]; nothing is ever injected.
    pub fn check_ephemeral_containers(&self, pod: &Value, namespace: &str) -> Result<Decision, InjectError> {
        if let Some(reason) = self.namespace_excluded(namespace) {
            return Ok(Decision::Skip(reason));
        }
        if let Some(refusal) = self.refusal(pod, Scope::EphemeralContainers)? {
            return Ok(Decision::Refuse(refusal));
        }
        // Under redirection a debug container as the dialer's UID would leave the Pod unchecked.
        if let (Redirect::On(_), Some(reason)) = (self.config.egress_redirect, redirect::debug_as_dialer(pod)) {
            return Ok(Decision::Refuse(Refusal::NotRedirected { reason }));
        }
        Ok(Decision::Skip(SkipReason::EphemeralContainers))
    }

    /// Decide about one Pod (the raw `request.object`) in `namespace` and build its patch.
    /// The rules of [`refuse`] come first: neither the opt-out label nor any other reason to
    /// leave a Pod alone lets one past them. Where the namespace turned egress redirection on,
    /// a Pod that would run without it (opted out, or a shape the sidecar cannot supervise) is
    /// refused with the reason: there, an unsupervised Pod would be an unchecked way out.
    pub fn mutate_pod(&self, pod: &Value, namespace: &str) -> Result<Decision, InjectError> {
        let decision = self.decide_pod(pod, namespace)?;
        if !matches!(self.config.egress_redirect, Redirect::On(_)) {
            return Ok(decision);
        }
        let not_redirected = |reason: String| Decision::Refuse(Refusal::NotRedirected { reason });
        Ok(match decision {
            Decision::NotSupervised(unsupervised) => not_redirected(unsupervised.message),
            Decision::Skip(SkipReason::OptedOut) => not_redirected(format!(
                "it opts out of supervision ({INJECT_LABEL}={INJECT_DISABLED}); remove the label"
            )),
            decision => decision,
        })
    }

    fn decide_pod(&self, pod: &Value, namespace: &str) -> Result<Decision, InjectError> {
        if let Some(reason) = self.namespace_excluded(namespace) {
            return Ok(Decision::Skip(reason));
        }
        let metadata = pod.get("metadata");
        if metadata.is_some_and(|m| !m.is_object() && !m.is_null()) {
            return Err(InjectError::WrongType("metadata".into(), "an object"));
        }
        if let Some(refusal) = self.refusal(pod, Scope::Pod)? {
            return Ok(Decision::Refuse(refusal));
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
        let containers = match spec.get("containers") {
            Some(Value::Array(containers)) => containers,
            Some(Value::Null) | None => return Err(InjectError::MissingContainers),
            Some(_) => {
                return Err(InjectError::WrongType("spec.containers".into(), "an array"));
            }
        };
        let init_containers = array_or_absent(spec.get("initContainers"), || "spec.initContainers")?;
        let volumes = array_or_absent(spec.get("volumes"), || "spec.volumes")?;
        let annotation_map = object_or_absent(annotations, || "metadata.annotations")?;
        let label_map = object_or_absent(labels, || "metadata.labels")?;

        // A Pod this webhook injected carries the sidecar's volumes and is refused above (a
        // copy of one must drop them): one that only carries the injection record or a
        // container of the sidecar's name looks supervised and is not.
        let ours = [SIDECAR_NAME, DIALER_NAME, EGRESS_INIT_NAME];
        if annotation_map.is_some_and(|m| m.contains_key(INJECTED_ANNOTATION))
            || ours
                .iter()
                .any(|name| has_named(spec.get("containers"), name) || has_named(spec.get("initContainers"), name))
        {
            let unsupervised = Unsupervised {
                reason: SkipReason::ForgedMarker,
                message: format!(
                    "the Pod carries the annotation {INJECTED_ANNOTATION} or a container named {SIDECAR_NAME}, {DIALER_NAME} or {EGRESS_INIT_NAME} without the sidecar the webhook injects; remove the annotation and rename the container to supervise it"
                ),
            };
            return Ok(not_supervised(metadata, label_map, annotation_map, unsupervised));
        }

        let fit = match shape::assess(spec, self.config.run_as_user) {
            Ok(fit) => fit,
            Err(unsupervised) => return Ok(not_supervised(metadata, label_map, annotation_map, unsupervised)),
        };

        // No volume of the Pod has one of our names (refused above): all are added.
        let mut new_volumes: Vec<&str> = self.volumes.iter().map(Fragment::json).collect();

        let mut warnings = fit.warnings.clone();
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

        // The egress proxy, on the loopback port the Pod's containers share — unless one of
        // them declares that port itself (a proxy there would not be ours).
        let egress = self.config.egress_port.map(|port| match port_holder(spec, port) {
            Some(holder) => {
                let reason = format!(
                    "container {holder:?} declares port {port}, where the sidecar's egress proxy listens: the Pod runs supervised without the proxy (no HTTP_PROXY is set)"
                );
                warnings.push(reason.clone());
                Err(reason)
            }
            None => Ok(format!("127.0.0.1:{port}")),
        });

        // Egress redirection, when the namespace asked for it and it can hold for this Pod.
        let (redirected, redirect_record) = match (self.config.egress_redirect, &self.redirected) {
            (Redirect::On(_), Some(redirected)) => {
                let port = redirected.redirection.port;
                let uid = redirected.redirection.dialer_uid_for_pod();
                match redirect::assess(spec, port, uid) {
                    Ok(weak) => {
                        warnings.extend(weak);
                        let record = format!("127.0.0.1:{port} (dialer UID {uid})");
                        let init = Fragment::new(redirect::init_container(&self.config, port, uid));
                        let dialer = Fragment::new(redirect::dialer(&self.config, uid, mode == SidecarMode::Native));
                        (Some((redirected, init, dialer)), Some(record))
                    }
                    Err(reason) => return Ok(Decision::Refuse(Refusal::NotRedirected { reason })),
                }
            }
            (Redirect::Blocked, _) => {
                let reason = format!(
                    "the namespace asks for egress redirection ({EGRESS_MODE_LABEL}=redirect) but enforces Pod Security level baseline or restricted, which refuses the NET_ADMIN of its init container: egress goes through the proxy variables only; label the namespace pod-security.kubernetes.io/enforce=privileged to redirect"
                );
                warnings.push(reason.clone());
                (None, Some(format!("off: {reason}")))
            }
            _ => (None, None),
        };

        let mut patch = PatchWriter::with_capacity(4096);

        // 1. The sidecar (under redirection after the rules' init container and the dialer).
        let sidecar = self.sidecar_fragment(mode, matches!(egress, Some(Ok(_)))).json();
        let sidecar_at = match (mode, &redirected) {
            (SidecarMode::Native, None) => {
                match init_containers {
                    // Before the Pod's own init containers, so it runs while they run.
                    Some(_) => patch.add_json(format_args!("/spec/initContainers/0"), sidecar),
                    None => patch.add_array(format_args!("/spec/initContainers"), [sidecar]),
                }
                "/spec/initContainers/0".to_owned()
            }
            (SidecarMode::Native, Some((_, init, dialer))) => {
                let ours = [init.json(), dialer.json(), sidecar];
                match init_containers {
                    Some(_) => {
                        for container in ours.iter().rev() {
                            patch.add_json(format_args!("/spec/initContainers/0"), container);
                        }
                    }
                    None => patch.add_array(format_args!("/spec/initContainers"), ours),
                }
                "/spec/initContainers/2".to_owned()
            }
            // After the workload's containers, so the Pod's default container is unchanged.
            (SidecarMode::Container, redirected) => {
                patch.add_json(format_args!("/spec/containers/-"), sidecar);
                if let Some((_, init, dialer)) = redirected {
                    patch.add_json(format_args!("/spec/containers/-"), dialer.json());
                    match init_containers {
                        Some(_) => patch.add_json(format_args!("/spec/initContainers/0"), init.json()),
                        None => patch.add_array(format_args!("/spec/initContainers"), [init.json()]),
                    }
                }
                format!("/spec/containers/{}", containers.len())
            }
        };
        let redirected = redirected.map(|(r, _, _)| r);
        if let Some(r) = redirected {
            let env: Vec<&str> = r.sidecar_env.iter().map(Fragment::json).collect();
            patch.push_all(format_args!("{sidecar_at}/env"), true, &env);
            patch.push_all(
                format_args!("{sidecar_at}/volumeMounts"),
                true,
                &[r.sidecar_mount.json()],
            );
        }
        if let Some(uid) = fit.sidecar_uid {
            // The workload's UID, which the sidecar needs to follow it (shape::assess).
            patch.add_value(format_args!("{sidecar_at}/securityContext/runAsUser"), &uid);
        }
        // Whether the kubelet starts the workload again after its process ended, so that the
        // sidecar supervises the next one (absent: Always, the sidecar's default).
        if let Some(policy) = spec
            .get("restartPolicy")
            .and_then(Value::as_str)
            .filter(|p| matches!(*p, "OnFailure" | "Never"))
        {
            patch.add_value(
                format_args!("{sidecar_at}/env/-"),
                &json!({ "name": "OPENSHELL_WORKLOAD_RESTART_POLICY", "value": policy }),
            );
        }

        // 2. On every workload container: the supervisor route and the socket path (never
        //    overriding a variable the container sets), and the socket directory; the proxy
        //    variables when the proxy runs and the Pod did not opt out.
        let opted_out = string_at(annotations, EGRESS_PROXY_ANNOTATION) == Some("disabled");
        let no_proxy = opted_out || !matches!(egress, Some(Ok(_)));
        //    And the placeholders of the credentials of the policy the Pod runs.
        let placeholders: Vec<Fragment> = match &self.policies {
            None => Vec::new(),
            Some(policies) => {
                let policy = string_at(annotations, crate::policies::POLICY_ANNOTATION)
                    .unwrap_or(crate::policies::DEFAULT_POLICY);
                match policies.lookup(namespace, policy) {
                    crate::policies::Lookup::Listed(placeholders) => placeholders
                        .into_iter()
                        .filter(|p| {
                            let ours = self.workload_env_values.iter().any(|v| v["name"] == p.env.as_str());
                            if ours {
                                warnings.push(format!(
                                    "policy {policy:?} names {} for a credential placeholder, a variable the sidecar's injection sets: not set",
                                    p.env
                                ));
                            }
                            !ours
                        })
                        .map(|p| Fragment::new(env_value(&p.env, &p.value)))
                        .collect(),
                    crate::policies::Lookup::NotListed => {
                        warnings.push(format!(
                            "the webhook has not listed the SandboxPolicies yet: the credential placeholders of policy {policy:?} are not set in this Pod's environment (they are listed by {{\"op\":\"policy\"}} on the sidecar socket)"
                        ));
                        Vec::new()
                    }
                }
            }
        };
        let mut env_containers = Vec::with_capacity(containers.len());
        let mut mount_containers = Vec::with_capacity(containers.len());
        let mut missing = Vec::with_capacity(self.workload_env.len());
        for (index, container) in containers.iter().enumerate() {
            let Some(container) = container.as_object() else {
                return Err(InjectError::WrongType(format!("spec.containers[{index}]"), "an object"));
            };
            let name = container.get("name").and_then(Value::as_str).unwrap_or("");

            let env = array_or_absent(container.get("env"), || format!("spec.containers[{index}].env"))?;
            missing.clear();
            missing.extend(
                self.workload_env
                    .iter()
                    .chain(&placeholders)
                    .filter(|var| {
                        let var_name = var.value().get("name").and_then(Value::as_str).unwrap_or("");
                        let proxy = PROXY_VARIABLES.contains(&var_name) || NO_PROXY_VARIABLES.contains(&var_name);
                        !(proxy && no_proxy) && env.is_none_or(|existing| !has_named_in(existing, var_name))
                    })
                    .map(Fragment::json),
            );
            for placeholder in &placeholders {
                let var_name = placeholder.value().get("name").and_then(Value::as_str).unwrap_or("");
                if env.is_some_and(|existing| has_named_in(existing, var_name)) {
                    warnings.push(format!(
                        "container {name:?} sets {var_name} itself: the credential placeholder was not set there"
                    ));
                }
            }
            if !missing.is_empty() {
                env_containers.push(name);
            }
            patch.push_all(format_args!("/spec/containers/{index}/env"), env.is_some(), &missing);

            let mounts = array_or_absent(container.get("volumeMounts"), || {
                format!("spec.containers[{index}].volumeMounts")
            })?;
            let mut add_mount = true;
            for mount in mounts.into_iter().flatten() {
                if mount.get("name").and_then(Value::as_str) == Some(SOCKET_VOLUME) {
                    // Already mounted: the volume we add satisfies it.
                    add_mount = false;
                } else if mount
                    .get("mountPath")
                    .and_then(Value::as_str)
                    .is_some_and(|path| same_dir(path, SOCKET_DIR))
                {
                    // Something else at the socket's path: a second mount there is invalid.
                    let message = format!(
                        "container {name:?} mounts another volume at {SOCKET_DIR}, where the sidecar's socket goes; move it to supervise the Pod"
                    );
                    let unsupervised = Unsupervised {
                        reason: SkipReason::MountConflict,
                        message,
                    };
                    return Ok(not_supervised(metadata, label_map, annotation_map, unsupervised));
                }
            }
            if add_mount {
                mount_containers.push(name);
                patch.push_all(
                    format_args!("/spec/containers/{index}/volumeMounts"),
                    mounts.is_some(),
                    &[self.workload_mount.json()],
                );
            }
        }

        // 3. The volumes.
        if let Some(r) = redirected {
            new_volumes.push(r.volume.json());
        }
        patch.push_all(format_args!("/spec/volumes"), volumes.is_some(), &new_volumes);

        // 4. A shared process namespace so the sidecar can see and stop the workload.
        if spec.get("shareProcessNamespace").and_then(Value::as_bool) != Some(true) {
            patch.add_json(format_args!("/spec/shareProcessNamespace"), "true");
        }

        // 5. The supervised label (the gateway follows Pods by it) and the record of what was
        //    injected. Each missing map is created exactly once.
        let record = InjectedRecord {
            version: &self.config.version,
            mode: mode.as_str(),
            sidecar: SIDECAR_NAME,
            image: &self.config.sidecar_image,
            volumes: [TOKEN_VOLUME, SOCKET_VOLUME, STATE_VOLUME]
                .into_iter()
                .chain(redirected.map(|_| DIALER_VOLUME))
                .collect(),
            env: env_containers,
            mounts: mount_containers,
            egress: egress.map(|egress| match egress {
                Ok(listen) if opted_out => format!("{listen} (the Pod opted out of the proxy variables)"),
                Ok(listen) => listen,
                Err(reason) => format!("off: {reason}"),
            }),
            redirect: redirect_record,
        };
        let record = serde_json::to_string(&record).unwrap_or_default();
        match metadata {
            Some(Value::Object(_)) => {
                put_key(
                    &mut patch,
                    "/metadata/labels",
                    label_map,
                    SUPERVISED_LABEL,
                    SUPERVISED_VALUE,
                );
                put_key(
                    &mut patch,
                    "/metadata/annotations",
                    annotation_map,
                    INJECTED_ANNOTATION,
                    &record,
                );
            }
            _ => patch.add_value(
                format_args!("/metadata"),
                &json!({
                    "labels": { SUPERVISED_LABEL: SUPERVISED_VALUE },
                    "annotations": { INJECTED_ANNOTATION: record },
                }),
            ),
        }

        Ok(Decision::Inject(Injection {
            patch: patch.finish(),
            mode,
            warnings,
        }))
    }
}

/// The decision for a Pod the sidecar cannot supervise: only the label with the reason code
/// (the gateway follows such Pods by it) and the annotation that says why.
fn not_supervised(
    metadata: Option<&Value>,
    labels: Option<&Map<String, Value>>,
    annotations: Option<&Map<String, Value>>,
    unsupervised: Unsupervised,
) -> Decision {
    let Unsupervised { reason, message } = unsupervised;
    let mut patch = PatchWriter::with_capacity(512);
    match metadata {
        Some(Value::Object(_)) => {
            put_key(
                &mut patch,
                "/metadata/labels",
                labels,
                NOT_SUPERVISED_LABEL,
                reason.as_str(),
            );
            put_key(
                &mut patch,
                "/metadata/annotations",
                annotations,
                NOT_SUPERVISED_ANNOTATION,
                &message,
            );
        }
        _ => patch.add_value(
            format_args!("/metadata"),
            &json!({
                "labels": { NOT_SUPERVISED_LABEL: reason.as_str() },
                "annotations": { NOT_SUPERVISED_ANNOTATION: message },
            }),
        ),
    }
    Decision::NotSupervised(NotSupervised {
        reason,
        message,
        patch: patch.finish(),
    })
}

fn has_named_in(items: &[Value], name: &str) -> bool {
    items
        .iter()
        .any(|item| item.get("name").and_then(Value::as_str) == Some(name))
}

#[cfg(test)]
mod tests;
