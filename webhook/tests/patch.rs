//! The patch against every captured AdmissionReview fixture, applied with a real JSON Patch
//! implementation and checked as a typed Kubernetes Pod.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use common::{POD_FIXTURES, fixture, fixture_bytes, fixtures_dir};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};
use webhook::inject::refuse::RefuseReason;
use webhook::inject::{
    DIALER_NAME, DIALER_UIDS, DIALER_VOLUME, EGRESS_INIT_NAME, INJECT_LABEL, INJECTED_ANNOTATION, InjectConfig,
    Injector, NOT_SUPERVISED_ANNOTATION, NOT_SUPERVISED_LABEL, Redirect, Redirection, SIDECAR_MODE_ANNOTATION,
    SIDECAR_NAME, SIDECAR_SOCKET, SOCKET_DIR, SOCKET_VOLUME, STATE_DIR, STATE_VOLUME, SUPERVISED_LABEL,
    SUPERVISION_DIR, SidecarMode, SkipReason, TOKEN_SECRET, TOKEN_VOLUME,
};
use webhook::review::{FailReason, Outcome, mutate, mutate_bytes};

fn injector() -> Injector {
    Injector::new(InjectConfig::default())
}

fn injector_mode(mode: SidecarMode) -> Injector {
    Injector::new(InjectConfig {
        default_mode: mode,
        ..InjectConfig::default()
    })
}

/// The decoded JSON Patch of a response (None when no patch).
fn patch_of(reviewed: &webhook::Reviewed) -> Option<Value> {
    let patch = reviewed.response.patch.as_ref()?;
    assert_eq!(reviewed.response.patch_type, Some("JSONPatch"));
    Some(serde_json::from_slice(&STANDARD.decode(patch).unwrap()).unwrap())
}

fn apply(object: &Value, patch: &Value) -> Result<Value, json_patch::PatchError> {
    let ops: json_patch::Patch = serde_json::from_value(patch.clone()).unwrap();
    let mut doc = object.clone();
    json_patch::patch(&mut doc, &ops)?;
    Ok(doc)
}

fn env_names(container: &Value) -> Vec<String> {
    container["env"]
        .as_array()
        .map(|env| env.iter().map(|v| v["name"].as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// The variables the webhook adds to workload containers.
const WORKLOAD_ENV: [&str; 8] = [
    "OPENSHELL_SUPERVISOR_ROUTE",
    "OPENSHELL_SIDECAR_SOCKET",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "http_proxy",
    "https_proxy",
    "NO_PROXY",
    "no_proxy",
];

fn mount_names(container: &Value) -> Vec<String> {
    container["volumeMounts"]
        .as_array()
        .map(|m| m.iter().map(|v| v["name"].as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// Remove exactly what the webhook adds; the remainder must equal the original Pod.
fn strip_injection(patched: &Value, original: &Value) -> Value {
    let mut pod = patched.clone();
    let spec = pod["spec"].as_object_mut().unwrap();
    for list in ["initContainers", "containers"] {
        if let Some(items) = spec.get_mut(list).and_then(Value::as_array_mut) {
            items.retain(|c| c["name"] != SIDECAR_NAME);
        }
        if original["spec"].get(list).is_none() && spec.get(list).and_then(Value::as_array).is_some_and(Vec::is_empty) {
            spec.remove(list);
        }
    }
    if let Some(containers) = spec.get_mut("containers").and_then(Value::as_array_mut) {
        for (i, c) in containers.iter_mut().enumerate() {
            let before = &original["spec"]["containers"][i];
            let had_env = env_names(before);
            let had_mounts = mount_names(before);
            let obj = c.as_object_mut().unwrap();
            if let Some(env) = obj.get_mut("env").and_then(Value::as_array_mut) {
                env.retain(|v| {
                    let n = v["name"].as_str().unwrap();
                    had_env.iter().any(|h| h == n) || !WORKLOAD_ENV.contains(&n)
                });
            }
            if let Some(mounts) = obj.get_mut("volumeMounts").and_then(Value::as_array_mut) {
                mounts.retain(|m| {
                    let n = m["name"].as_str().unwrap();
                    had_mounts.iter().any(|h| h == n) || n != SOCKET_VOLUME
                });
            }
            for key in ["env", "volumeMounts"] {
                if before.get(key).is_none() {
                    obj.remove(key);
                }
            }
        }
    }
    if let Some(volumes) = spec.get_mut("volumes").and_then(Value::as_array_mut) {
        volumes.retain(|v| ![TOKEN_VOLUME, SOCKET_VOLUME, STATE_VOLUME].contains(&v["name"].as_str().unwrap()));
    }
    if original["spec"].get("volumes").is_none() {
        spec.remove("volumes");
    }
    if original["spec"].get("shareProcessNamespace").is_none() {
        spec.remove("shareProcessNamespace");
    }
    let metadata = pod["metadata"].as_object_mut().unwrap();
    for (map, key) in [("annotations", INJECTED_ANNOTATION), ("labels", SUPERVISED_LABEL)] {
        if let Some(items) = metadata.get_mut(map).and_then(Value::as_object_mut) {
            items.remove(key);
        }
        if original["metadata"].get(map).is_none() {
            metadata.remove(map);
        }
    }
    pod
}

/// Everything the injection promises, checked on the typed Pod.
fn assert_injected(pod: &Pod, mode: SidecarMode, original: &Value) {
    let spec = pod.spec.as_ref().expect("spec");
    let sidecar = match mode {
        SidecarMode::Native => {
            let init = spec.init_containers.as_ref().expect("initContainers");
            let first = &init[0];
            assert_eq!(first.name, SIDECAR_NAME, "the sidecar is the first init container");
            assert_eq!(first.restart_policy.as_deref(), Some("Always"));
            let original_init = original["spec"]["initContainers"].as_array().map(Vec::len).unwrap_or(0);
            assert_eq!(init.len(), original_init + 1);
            assert!(spec.containers.iter().all(|c| c.name != SIDECAR_NAME));
            first
        }
        SidecarMode::Container => {
            let last = spec.containers.last().unwrap();
            assert_eq!(last.name, SIDECAR_NAME, "the sidecar is the last container");
            assert_eq!(last.restart_policy, None);
            assert!(
                spec.init_containers
                    .as_ref()
                    .is_none_or(|i| i.iter().all(|c| c.name != SIDECAR_NAME))
            );
            last
        }
    };
    // Environment: route, gateway, downward-API identity, supervision dir, socket, state.
    let env = sidecar.env.as_ref().unwrap();
    let get = |name: &str| env.iter().find(|e| e.name == name).unwrap_or_else(|| panic!("{name}"));
    assert_eq!(
        get("OPENSHELL_SUPERVISOR_ROUTE").value.as_deref(),
        Some("https://openshell-supervisor.openshell-supervision.svc:7443")
    );
    assert_eq!(
        get("OPENSHELL_GATEWAY_ENDPOINTS").value.as_deref(),
        Some("https://openshell-gateway.openshell-supervision.svc:8443")
    );
    // Members are dialled by Pod IP after a redirect; their certificates name the Service.
    assert_eq!(
        get("OPENSHELL_SUPERVISOR_TLS_NAME").value.as_deref(),
        Some("openshell-supervisor.openshell-supervision.svc")
    );
    // The CA comes from ca.crt in the token Secret (the sidecar's default): not injected.
    assert!(env.iter().all(|e| e.name != "OPENSHELL_TLS_CA"));
    assert_eq!(get("OPENSHELL_SUPERVISION_DIR").value.as_deref(), Some(SUPERVISION_DIR));
    assert_eq!(get("OPENSHELL_SIDECAR_SOCKET").value.as_deref(), Some(SIDECAR_SOCKET));
    assert_eq!(get("OPENSHELL_SIDECAR_STATE_DIR").value.as_deref(), Some(STATE_DIR));
    assert!(SIDECAR_SOCKET.starts_with(&format!("{SOCKET_DIR}/")));
    for (name, field) in [
        ("OPENSHELL_POD_NAME", "metadata.name"),
        ("OPENSHELL_POD_NAMESPACE", "metadata.namespace"),
        ("OPENSHELL_POD_UID", "metadata.uid"),
    ] {
        let field_ref = get(name)
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .unwrap_or_else(|| panic!("{name} is a fieldRef"));
        assert_eq!(field_ref.field_path, field);
    }
    // Read-only token mount backed by the namespace's Secret; socket and state directories.
    let mounts = sidecar.volume_mounts.as_ref().unwrap();
    let mount_of = |name: &str| {
        mounts
            .iter()
            .find(|m| m.name == name)
            .unwrap_or_else(|| panic!("{name}"))
    };
    assert_eq!(mount_of(TOKEN_VOLUME).mount_path, SUPERVISION_DIR);
    assert_eq!(mount_of(TOKEN_VOLUME).read_only, Some(true));
    assert_eq!(mount_of(SOCKET_VOLUME).mount_path, SOCKET_DIR);
    assert_eq!(mount_of(STATE_VOLUME).mount_path, STATE_DIR);
    assert_eq!(mounts.len(), 3);
    let volume_of = |name: &str| {
        spec.volumes
            .iter()
            .flatten()
            .find(|v| v.name == name)
            .unwrap_or_else(|| panic!("volume {name}"))
    };
    let projected = volume_of(TOKEN_VOLUME).projected.as_ref().unwrap();
    let sources = projected.sources.as_ref().unwrap();
    let secret = sources[0].secret.as_ref().unwrap();
    assert_eq!(secret.name, TOKEN_SECRET);
    assert_eq!(secret.optional, None, "the Pod waits for the gateway's Secret");
    let keys: Vec<_> = secret.items.iter().flatten().map(|i| i.key.as_str()).collect();
    assert_eq!(
        keys,
        ["trust.jwks", "ca.crt"],
        "no token from the Secret: the Pod brings its own"
    );
    // The Pod's own ServiceAccount token, for the gateway's audience: it proves which Pod
    // the sidecar is.
    let token = sources[1].service_account_token.as_ref().unwrap();
    assert_eq!(token.audience.as_deref(), Some(proto::trust::KUBERNETES_AUDIENCE));
    assert_eq!(token.path, "token");
    assert_eq!(token.expiration_seconds, Some(3600));
    // Readable by whatever non-root user the sidecar runs as (no fsGroup is assumed).
    assert_eq!(projected.default_mode, Some(0o444));
    let socket = volume_of(SOCKET_VOLUME).empty_dir.as_ref().expect("socket emptyDir");
    assert_eq!(socket.medium.as_deref(), Some("Memory"));
    assert!(socket.size_limit.is_some());
    let state = volume_of(STATE_VOLUME).empty_dir.as_ref().expect("state emptyDir");
    assert!(state.size_limit.is_some());
    // Restricted security context and resources.
    let sc = sidecar.security_context.as_ref().unwrap();
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(
        sc.capabilities.as_ref().unwrap().drop.as_deref(),
        Some(&["ALL".to_string()][..])
    );
    assert_eq!(sc.seccomp_profile.as_ref().unwrap().type_, "RuntimeDefault");
    let resources = sidecar.resources.as_ref().unwrap();
    assert!(resources.requests.as_ref().unwrap().contains_key("memory"));
    assert!(resources.limits.as_ref().unwrap().contains_key("memory"));
    // Shared process namespace.
    assert_eq!(spec.share_process_namespace, Some(true));
    // Workload containers find the supervisor and the sidecar's socket (mounted once; the
    // state directory is the sidecar's alone).
    for c in spec.containers.iter().filter(|c| c.name != SIDECAR_NAME) {
        let env = c.env.as_ref().unwrap();
        for name in WORKLOAD_ENV {
            assert_eq!(
                env.iter().filter(|e| e.name == name).count(),
                1,
                "{name} once in {}",
                c.name
            );
        }
        let socket = env.iter().find(|e| e.name == "OPENSHELL_SIDECAR_SOCKET").unwrap();
        assert_eq!(socket.value.as_deref(), Some(SIDECAR_SOCKET));
        assert!(env.iter().all(|e| e.name != "OPENSHELL_SIDECAR_ADDR"));
        let mounts = c.volume_mounts.as_ref().unwrap();
        let socket_mounts: Vec<_> = mounts.iter().filter(|m| m.name == SOCKET_VOLUME).collect();
        assert_eq!(socket_mounts.len(), 1, "socket mounted once in {}", c.name);
        assert_eq!(socket_mounts[0].mount_path, SOCKET_DIR);
        assert!(mounts.iter().all(|m| m.name != STATE_VOLUME && m.name != TOKEN_VOLUME));
    }
    // Mount paths stay unique per container (the API server rejects duplicates).
    for c in spec.containers.iter().chain(spec.init_containers.iter().flatten()) {
        let mut paths: Vec<&str> = c
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| m.mount_path.as_str())
            .collect();
        let all = paths.len();
        paths.sort_unstable();
        paths.dedup();
        assert_eq!(paths.len(), all, "duplicate mountPath in {}", c.name);
    }
    // The sidecar's env is exactly what the sidecar binary reads, and it parses and validates.
    assert_sidecar_accepts(sidecar, pod);
    // Every volumeMount names an existing volume (the API server rejects the Pod otherwise,
    // see api-errors/patch-produces-invalid-pod.status.json).
    let volume_names: Vec<&str> = spec.volumes.iter().flatten().map(|v| v.name.as_str()).collect();
    for c in spec.containers.iter().chain(spec.init_containers.iter().flatten()) {
        for m in c.volume_mounts.iter().flatten() {
            assert!(volume_names.contains(&m.name.as_str()), "mount {} has a volume", m.name);
        }
    }
    // The supervised label, which the gateway selects Pods by.
    let labels = pod.metadata.labels.as_ref().expect("labels");
    assert_eq!(labels.get(SUPERVISED_LABEL).map(String::as_str), Some("true"));
    // The annotation records version and mode.
    let annotations = pod.metadata.annotations.as_ref().unwrap();
    let record: Value = serde_json::from_str(&annotations[INJECTED_ANNOTATION]).unwrap();
    assert_eq!(record["version"], plumbing::build::version());
    assert_eq!(record["mode"], mode.as_str());
    assert_eq!(record["volumes"], json!([TOKEN_VOLUME, SOCKET_VOLUME, STATE_VOLUME]));
}

/// Resolves the sidecar container's env as the kubelet would (downward API from `pod`, with a
/// UID since admission runs before one is set), then parses it with the sidecar binary's own
/// clap definition, flag by flag, and validates it. Every variable the sidecar requires must be
/// there, and every `OPENSHELL_*` variable injected must be one the sidecar reads.
fn assert_sidecar_accepts(sidecar: &k8s_openapi::api::core::v1::Container, pod: &Pod) {
    use clap::{CommandFactory as _, Parser as _};
    let command = sidecar::Config::command();
    let by_env: std::collections::HashMap<String, &clap::Arg> = command
        .get_arguments()
        .filter_map(|arg| Some((arg.get_env()?.to_str()?.to_owned(), arg)))
        .collect();
    let mut args = vec!["sidecar".to_owned()];
    let mut injected = Vec::new();
    for var in sidecar.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (Some(value), None) => value.clone(),
            (None, Some(from)) => {
                let field = &from.field_ref.as_ref().expect("only fieldRefs are injected").field_path;
                match field.as_str() {
                    "metadata.name" => pod
                        .metadata
                        .name
                        .clone()
                        .or_else(|| pod.metadata.generate_name.as_ref().map(|g| format!("{g}x1y2z")))
                        .unwrap(),
                    "metadata.namespace" => pod.metadata.namespace.clone().unwrap_or_else(|| "team-a".into()),
                    "metadata.uid" => "5f0c1d9e-7c1a-4a57-9a52-3f1b0a4c2d11".into(),
                    other => panic!("unexpected fieldRef {other}"),
                }
            }
            other => panic!("{}: unexpected env source {other:?}", var.name),
        };
        let Some(arg) = by_env.get(&var.name) else {
            panic!("the sidecar does not read {}", var.name);
        };
        args.push(format!("--{}={value}", arg.get_long().expect("a long flag")));
        injected.push(var.name.clone());
    }
    for (env, arg) in &by_env {
        if arg.is_required_set() {
            assert!(
                injected.contains(env),
                "the sidecar requires {env}, which is not injected"
            );
        }
    }
    let config = sidecar::Config::try_parse_from(&args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
    config.validate().unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(
        config.command.is_empty(),
        "in a Pod the workload connects to the socket"
    );
}

fn inject_fixture(name: &str, injector: &Injector) -> (Value, Value, Value) {
    let review = fixture(name);
    let reviewed = mutate(&review, injector);
    assert_eq!(reviewed.response.uid, review["request"]["uid"].as_str().unwrap());
    assert!(reviewed.response.allowed, "{name}: {:?}", reviewed.response.status);
    let patch = patch_of(&reviewed).unwrap_or_else(|| panic!("{name}: no patch"));
    let object = review["request"]["object"].clone();
    let patched = apply(&object, &patch).unwrap_or_else(|e| panic!("{name}: {e}"));
    (object, patch, patched)
}

#[test]
fn every_fixture_is_injected_and_keeps_everything_it_had() {
    for mode in [SidecarMode::Native, SidecarMode::Container] {
        let injector = injector_mode(mode);
        for name in POD_FIXTURES {
            let review = fixture(name);
            let reviewed = mutate(&review, &injector);
            assert_eq!(reviewed.outcome, Outcome::Injected(mode), "{name}");
            let (object, _patch, patched) = inject_fixture(name, &injector);
            let pod: Pod = serde_json::from_value(patched.clone())
                .unwrap_or_else(|e| panic!("{name}: patched Pod does not decode: {e}"));
            assert_injected(&pod, mode, &object);
            // Field by field: removing what was injected gives back the original exactly
            // (unknown fields, managedFields, ownerReferences, generateName, ...).
            assert_eq!(
                strip_injection(&patched, &object),
                object,
                "{name} ({mode}): the patch changed or lost something"
            );
        }
    }
}

#[test]
fn existing_init_containers_run_after_the_native_sidecar() {
    let (object, patch, patched) = inject_fixture("pod-create-with-volumes.json", &injector());
    assert_eq!(patch[0]["path"], "/spec/initContainers/0");
    let init = patched["spec"]["initContainers"].as_array().unwrap();
    assert_eq!(init[0]["name"], SIDECAR_NAME);
    assert_eq!(init[1], object["spec"]["initContainers"][0]);
    // Two workload containers, both got the env; the existing env is intact and first.
    let containers = patched["spec"]["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 2);
    assert_eq!(
        env_names(&containers[0]),
        [["LOG_LEVEL", "POD_NAME", "SETTING"].as_slice(), &WORKLOAD_ENV].concat()
    );
    assert_eq!(
        env_names(&containers[1]),
        [["SIDECAR_MODE"].as_slice(), &WORKLOAD_ENV].concat()
    );
    // Existing mounts are intact and first; the socket directory is appended.
    assert_eq!(
        mount_names(&containers[0]),
        ["work", "config", "kube-api-access-bvwqd", SOCKET_VOLUME]
    );
    assert_eq!(
        mount_names(&containers[1]),
        ["work", "kube-api-access-bvwqd", SOCKET_VOLUME]
    );
    // The Pod's own init container gets neither env nor mount.
    assert_eq!(init[1], object["spec"]["initContainers"][0]);
    // The user's volumes keep their order; ours come last.
    let volumes: Vec<&str> = patched["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        volumes,
        [
            "work",
            "config",
            "kube-api-access-bvwqd",
            TOKEN_VOLUME,
            SOCKET_VOLUME,
            STATE_VOLUME
        ]
    );
}

#[test]
fn missing_volumes_array_is_created_not_appended_to() {
    // The API server's answer to `add /spec/volumes/-` on this very Pod shape:
    let status: Value = serde_json::from_slice(
        &std::fs::read(fixtures_dir().join("api-errors/patch-add-to-missing-volumes.status.json")).unwrap(),
    )
    .unwrap();
    let message = status["body"]["message"].as_str().unwrap();
    assert!(
        message.contains("doc is missing path: \"/spec/volumes/-\""),
        "{message}"
    );

    let name = "pod-create-no-volumes-automount-false.json";
    let review = fixture(name);
    let object = &review["request"]["object"];
    assert!(object["spec"].get("volumes").is_none());

    // The naive patch fails here too, exactly like the API server said...
    let naive = json!([{ "op": "add", "path": "/spec/volumes/-", "value": { "name": "x", "emptyDir": {} } }]);
    let err = apply(object, &naive).unwrap_err();
    assert!(err.to_string().contains("/spec/volumes"), "{err}");

    // ...and ours creates the array with one operation.
    let (_, patch, patched) = inject_fixture(name, &injector());
    let ops = patch.as_array().unwrap();
    let volume_ops: Vec<&Value> = ops
        .iter()
        .filter(|op| op["path"].as_str().unwrap().starts_with("/spec/volumes"))
        .collect();
    assert_eq!(volume_ops.len(), 1);
    assert_eq!(volume_ops[0]["path"], "/spec/volumes");
    assert_eq!(volume_ops[0]["value"].as_array().unwrap().len(), 3);
    assert_eq!(patched["spec"]["volumes"][0]["name"], TOKEN_VOLUME);
    assert_eq!(patched["spec"]["volumes"][1]["name"], SOCKET_VOLUME);
    assert_eq!(patched["spec"]["volumes"][2]["name"], STATE_VOLUME);
    // The container had no env: one add creating it with both variables.
    let env_ops: Vec<&Value> = ops
        .iter()
        .filter(|op| op["path"].as_str().unwrap().starts_with("/spec/containers/0/env"))
        .collect();
    assert_eq!(env_ops.len(), 1);
    assert_eq!(env_ops[0]["path"], "/spec/containers/0/env");
    // No labels, annotations, initContainers or volumeMounts before: each created once, and
    // nothing appended to them.
    for path in [
        "/metadata/labels",
        "/metadata/annotations",
        "/spec/initContainers",
        "/spec/containers/0/volumeMounts",
    ] {
        assert_eq!(ops.iter().filter(|op| op["path"] == path).count(), 1, "{path}");
        let nested = format!("{path}/");
        assert!(
            !ops.iter().any(|op| op["path"].as_str().unwrap().starts_with(&nested)),
            "{path}"
        );
    }
    assert_eq!(patched["metadata"]["labels"], json!({ SUPERVISED_LABEL: "true" }));
    assert_eq!(
        patched["spec"]["containers"][0]["volumeMounts"],
        json!([{ "name": SOCKET_VOLUME, "mountPath": SOCKET_DIR }])
    );
    // automountServiceAccountToken: false is untouched.
    assert_eq!(patched["spec"]["automountServiceAccountToken"], false);
}

#[test]
fn appending_to_existing_arrays_uses_dash_not_replacement() {
    let (_, patch, _) = inject_fixture("pod-create-plain.json", &injector());
    let ops = patch.as_array().unwrap();
    // plain has volumes (kube-api-access) → append; never a wholesale replacement of them.
    assert!(ops.iter().any(|op| op["path"] == "/spec/volumes/-"));
    assert!(!ops.iter().any(|op| op["path"] == "/spec/volumes"));
    // Its container has volumeMounts (the ServiceAccount token) and env is absent.
    assert!(ops.iter().any(|op| op["path"] == "/spec/containers/0/volumeMounts/-"));
    assert!(!ops.iter().any(|op| op["path"] == "/spec/containers/0/volumeMounts"));
    assert!(ops.iter().all(|op| op["op"] == "add"));
}

/// The JSON Patch operations of `review` (which must be injected).
fn ops_of(review: &Value, injector: &Injector) -> Vec<Value> {
    let reviewed = mutate(review, injector);
    assert!(
        matches!(reviewed.outcome, Outcome::Injected(_)),
        "{:?}",
        reviewed.outcome
    );
    patch_of(&reviewed).unwrap().as_array().unwrap().clone()
}

#[test]
fn supervised_label_is_added_under_an_escaped_key_or_as_a_new_map() {
    let injector = injector();
    let escaped = "/metadata/labels/supervision.openshell.ai~1supervised";

    // Existing labels: one add of the escaped key, the others kept.
    let review = fixture("pod-create-kubectl-run.json");
    let ops = ops_of(&review, &injector);
    let label_ops: Vec<&Value> = ops
        .iter()
        .filter(|op| op["path"].as_str().unwrap().starts_with("/metadata/labels"))
        .collect();
    assert_eq!(label_ops.len(), 1);
    assert_eq!(label_ops[0]["path"], escaped);
    assert_eq!(label_ops[0]["value"], "true");
    let patched = apply(&review["request"]["object"], &Value::Array(ops)).unwrap();
    assert_eq!(
        patched["metadata"]["labels"],
        json!({ "run": "via-kubectl-run", SUPERVISED_LABEL: "true" })
    );

    // No labels: the map is created once, holding only ours.
    let review = fixture("pod-create-plain.json");
    let ops = ops_of(&review, &injector);
    let label_ops: Vec<&Value> = ops
        .iter()
        .filter(|op| op["path"].as_str().unwrap().starts_with("/metadata/labels"))
        .collect();
    assert_eq!(label_ops.len(), 1);
    assert_eq!(label_ops[0]["path"], "/metadata/labels");
    assert_eq!(label_ops[0]["value"], json!({ SUPERVISED_LABEL: "true" }));

    // A different value is replaced (the gateway selects on "true"); "true" is left as is.
    let mut review = fixture("pod-create-kubectl-run.json");
    review["request"]["object"]["metadata"]["labels"][SUPERVISED_LABEL] = json!("false");
    let ops = ops_of(&review, &injector);
    let patched = apply(&review["request"]["object"], &Value::Array(ops)).unwrap();
    assert_eq!(patched["metadata"]["labels"][SUPERVISED_LABEL], "true");
    assert_eq!(patched["metadata"]["labels"]["run"], "via-kubectl-run");
    review["request"]["object"]["metadata"]["labels"][SUPERVISED_LABEL] = json!("true");
    let ops = ops_of(&review, &injector);
    assert!(
        !ops.iter()
            .any(|op| op["path"].as_str().unwrap().starts_with("/metadata/labels"))
    );

    // No metadata at all: one add creating it with the label and the annotation.
    let pod = json!({ "spec": { "containers": [ { "name": "app", "image": "x" } ] } });
    let Ok(webhook::inject::Decision::Inject(injection)) = injector.mutate_pod(&pod, "team-a") else {
        panic!("expected an injection");
    };
    let ops = serde_json::to_value(&injection.patch).unwrap();
    let metadata_ops: Vec<&Value> = ops
        .as_array()
        .unwrap()
        .iter()
        .filter(|op| op["path"].as_str().unwrap().starts_with("/metadata"))
        .collect();
    assert_eq!(metadata_ops.len(), 1);
    assert_eq!(metadata_ops[0]["path"], "/metadata");
    let patched = apply(&pod, &ops).unwrap();
    assert_eq!(patched["metadata"]["labels"], json!({ SUPERVISED_LABEL: "true" }));
    assert!(patched["metadata"]["annotations"][INJECTED_ANNOTATION].is_string());

    // Labels of the wrong type are refused, never overwritten.
    let mut review = fixture("pod-create-plain.json");
    review["request"]["object"]["metadata"]["labels"] = json!(["x"]);
    let reviewed = mutate(&review, &injector);
    assert_eq!(reviewed.outcome, Outcome::Failed(FailReason::InvalidPod));
    assert!(
        reviewed
            .response
            .status
            .as_ref()
            .unwrap()
            .message
            .contains("metadata.labels"),
        "{:?}",
        reviewed.response.status
    );
}

/// A volume under one of our names is refused, whatever it holds: before, an `emptyDir` state
/// or socket volume (or a token volume projecting our Secret) was reused by the injection and
/// anything else made it skip the Pod.
#[test]
fn a_volume_under_our_names_is_refused_whatever_it_holds() {
    let injector = injector();
    for volume in [
        json!({ "name": SOCKET_VOLUME, "emptyDir": { "medium": "Memory" } }),
        json!({ "name": SOCKET_VOLUME, "configMap": { "name": "app" } }),
        json!({ "name": STATE_VOLUME, "emptyDir": {} }),
        json!({ "name": STATE_VOLUME, "hostPath": { "path": "/var/lib/state" } }),
        json!({ "name": TOKEN_VOLUME, "projected": { "sources": [{ "secret": { "name": TOKEN_SECRET } }] } }),
        json!({ "name": TOKEN_VOLUME, "projected": { "sources": [{ "secret": { "name": "someone-elses" } }] } }),
    ] {
        let mut review = fixture("pod-create-plain.json");
        review["request"]["object"]["spec"]["volumes"]
            .as_array_mut()
            .unwrap()
            .push(volume.clone());
        let reviewed = mutate(&review, &injector);
        assert_eq!(
            reviewed.outcome,
            Outcome::Refused(RefuseReason::VolumeDeclared),
            "{volume}"
        );
        assert!(!reviewed.response.allowed);
        assert_eq!(reviewed.response.patch, None);
        let message = &reviewed.response.status.as_ref().unwrap().message;
        assert!(message.contains(volume["name"].as_str().unwrap()), "{message}");
    }
}

#[test]
fn the_socket_mount_is_added_once_and_a_foreign_mount_at_its_path_leaves_the_pod_alone() {
    let injector = injector();
    // The second container already mounts the socket volume (which the injection adds): it is
    // not mounted again there, the first container gets it.
    let mut review = fixture("pod-create-with-volumes.json");
    let object = &mut review["request"]["object"];
    object["spec"]["containers"][1]["volumeMounts"]
        .as_array_mut()
        .unwrap()
        .push(json!({ "name": SOCKET_VOLUME, "mountPath": SOCKET_DIR }));
    let ops = ops_of(&review, &injector);
    assert!(ops.iter().any(|op| op["path"] == "/spec/containers/0/volumeMounts/-"));
    assert!(!ops.iter().any(|op| {
        op["path"]
            .as_str()
            .unwrap()
            .starts_with("/spec/containers/1/volumeMounts")
    }));
    let patched = apply(&review["request"]["object"], &Value::Array(ops)).unwrap();
    let pod: Pod = serde_json::from_value(patched.clone()).unwrap();
    assert_injected(&pod, SidecarMode::Native, &review["request"]["object"]);
    let record: Value = serde_json::from_str(
        patched["metadata"]["annotations"][INJECTED_ANNOTATION]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(record["mounts"], json!(["app"]));

    // Another volume mounted at the socket directory (with or without a trailing slash): a
    // second mount there would make the Pod invalid, so the Pod is left unsupervised.
    for path in [SOCKET_DIR.to_string(), format!("{SOCKET_DIR}/")] {
        let mut review = fixture("pod-create-with-volumes.json");
        review["request"]["object"]["spec"]["containers"][1]["volumeMounts"]
            .as_array_mut()
            .unwrap()
            .push(json!({ "name": "work", "mountPath": path }));
        assert_not_supervised(&review, &injector, SkipReason::MountConflict);
    }

    // volumeMounts of the wrong type are an error, not a panic or a blind append.
    let mut review = fixture("pod-create-plain.json");
    review["request"]["object"]["spec"]["containers"][0]["volumeMounts"] = json!({});
    let reviewed = mutate(&review, &injector);
    assert_eq!(reviewed.outcome, Outcome::Failed(FailReason::InvalidPod));
}

#[test]
fn gateway_endpoints_reach_the_sidecar_as_one_comma_separated_variable() {
    let injector = Injector::new(InjectConfig {
        gateway_endpoints: vec!["https://gw-a:8443".into(), " https://gw-b:8443 ".into(), String::new()],
        ..InjectConfig::default()
    });
    let env = injector.sidecar(SidecarMode::Native)["env"].as_array().unwrap().clone();
    let endpoints: Vec<&Value> = env
        .iter()
        .filter(|e| e["name"] == "OPENSHELL_GATEWAY_ENDPOINTS")
        .collect();
    assert_eq!(endpoints.len(), 1);
    assert_eq!(endpoints[0]["value"], "https://gw-a:8443,https://gw-b:8443");
    assert!(!env.iter().any(|e| e["name"] == "OPENSHELL_GATEWAY_ENDPOINT"));
}

/// The webhook sees a Pod once (`reinvocationPolicy: Never`), so a Pod that arrives with our
/// volumes was not injected by it (a copy of an injected Pod: `kubectl debug --copy-to`, an
/// exported manifest applied again): it is refused, never patched a second time.
#[test]
fn patched_pod_fed_back_is_refused_not_patched_again() {
    for mode in [SidecarMode::Native, SidecarMode::Container] {
        let injector = injector_mode(mode);
        for name in POD_FIXTURES {
            let (_, _, patched) = inject_fixture(name, &injector);
            let mut review = fixture(name);
            review["request"]["object"] = patched;
            let again = mutate(&review, &injector);
            assert!(!again.response.allowed);
            assert_eq!(again.outcome, Outcome::Refused(RefuseReason::VolumeDeclared), "{name}");
            assert_eq!(again.response.patch, None, "{name}");
            assert_eq!(again.response.patch_type, None);
        }
    }
}

/// A Pod this webhook injected is refused if fed in again (it declares the sidecar's volumes);
/// the markers alone make a Pod that looks supervised and is not: it says so.
#[test]
fn either_marker_alone_is_a_pod_that_is_not_supervised_and_says_so() {
    let injector = injector();
    // Only the annotation.
    let mut review = fixture("pod-create-plain.json");
    review["request"]["object"]["metadata"]["annotations"] = json!({ INJECTED_ANNOTATION: "x" });
    assert_not_supervised(&review, &injector, SkipReason::ForgedMarker);
    // Only a container with the sidecar's name.
    let mut review = fixture("pod-create-plain.json");
    review["request"]["object"]["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .push(json!({ "name": SIDECAR_NAME, "image": "x" }));
    assert_not_supervised(&review, &injector, SkipReason::ForgedMarker);
}

#[test]
fn dry_run_gets_the_same_patch() {
    let injector = injector();
    let review = fixture("pod-create-dry-run.json");
    assert_eq!(review["request"]["dryRun"], true);
    let dry = mutate(&review, &injector);
    assert!(dry.dry_run);
    let mut wet_review = review.clone();
    wet_review["request"]["dryRun"] = json!(false);
    wet_review["request"]["options"]["dryRun"] = Value::Null;
    let wet = mutate(&wet_review, &injector);
    assert!(!wet.dry_run);
    assert!(dry.response.patch.is_some());
    assert_eq!(dry.response.patch, wet.response.patch);
    assert_eq!(dry.outcome, wet.outcome);
}

#[test]
fn deployment_pod_without_name_is_injected_and_keeps_owner() {
    let (object, _, patched) = inject_fixture("pod-create-from-deployment.json", &injector());
    let reviewed = mutate(&fixture("pod-create-from-deployment.json"), &injector());
    assert_eq!(reviewed.name, "web-7ccf59d768-", "generateName is used for logs");
    assert_eq!(
        patched["metadata"]["ownerReferences"],
        object["metadata"]["ownerReferences"]
    );
    assert_eq!(patched["metadata"]["generateName"], "web-7ccf59d768-");
    assert!(patched["metadata"].get("name").is_none());
}

#[test]
fn mode_annotation_overrides_the_default_per_pod() {
    for (default, wanted) in [
        (SidecarMode::Native, SidecarMode::Container),
        (SidecarMode::Container, SidecarMode::Native),
    ] {
        let injector = injector_mode(default);
        let mut review = fixture("pod-create-with-volumes.json");
        review["request"]["object"]["metadata"]["annotations"][SIDECAR_MODE_ANNOTATION] = json!(wanted.as_str());
        let reviewed = mutate(&review, &injector);
        assert_eq!(reviewed.outcome, Outcome::Injected(wanted));
        let patched = apply(&review["request"]["object"], &patch_of(&reviewed).unwrap()).unwrap();
        let pod: Pod = serde_json::from_value(patched).unwrap();
        assert_injected(&pod, wanted, &review["request"]["object"]);
    }
}

#[test]
fn existing_env_with_our_names_is_not_overridden() {
    let mut review = fixture("pod-create-with-volumes.json");
    review["request"]["object"]["spec"]["containers"][0]["env"]
        .as_array_mut()
        .unwrap()
        .push(json!({ "name": "OPENSHELL_SUPERVISOR_ROUTE", "value": "https://custom:1" }));
    let reviewed = mutate(&review, &injector());
    let patched = apply(&review["request"]["object"], &patch_of(&reviewed).unwrap()).unwrap();
    let env = patched["spec"]["containers"][0]["env"].as_array().unwrap();
    let routes: Vec<&Value> = env
        .iter()
        .filter(|e| e["name"] == "OPENSHELL_SUPERVISOR_ROUTE")
        .collect();
    assert_eq!(routes.len(), 1);
    assert_eq!(routes[0]["value"], "https://custom:1");
    assert!(env.iter().any(|e| e["name"] == "OPENSHELL_SIDECAR_SOCKET"));
}

#[test]
fn annotation_keys_with_slash_and_tilde_survive_and_ours_is_escaped() {
    let mut review = fixture("pod-create-plain.json");
    let odd = json!({
        "example.com/a~b": "1",
        "~": "2",
        "x/y/z": "3",
        "supervision.openshell.ai": "prefix-only, must not be replaced"
    });
    review["request"]["object"]["metadata"]["annotations"] = odd.clone();
    let reviewed = mutate(&review, &injector());
    let patch = patch_of(&reviewed).unwrap();
    let annotation_op = patch
        .as_array()
        .unwrap()
        .iter()
        .find(|op| op["path"].as_str().unwrap().starts_with("/metadata/annotations"))
        .unwrap();
    assert_eq!(
        annotation_op["path"],
        "/metadata/annotations/supervision.openshell.ai~1injected"
    );
    let patched = apply(&review["request"]["object"], &patch).unwrap();
    let annotations = patched["metadata"]["annotations"].as_object().unwrap();
    for (key, value) in odd.as_object().unwrap() {
        assert_eq!(&annotations[key], value, "{key}");
    }
    assert!(annotations.contains_key(INJECTED_ANNOTATION));
    assert_eq!(annotations.len(), 5);
}

/// Admitted, with one warning, and changed only by the label with the reason code and the
/// annotation that says why.
fn assert_not_supervised(review: &Value, injector: &Injector, reason: SkipReason) {
    let reviewed = mutate(review, injector);
    let what = review["request"]["object"]["spec"].to_string();
    assert_eq!(reviewed.outcome, Outcome::Skipped(reason), "{what}");
    assert!(reviewed.response.allowed);
    assert_eq!(reviewed.response.warnings.len(), 1, "{what}");
    let warning = reviewed.response.warnings[0].clone();
    assert!(warning.starts_with("not supervised: "), "{warning}");
    let ops = patch_of(&reviewed).unwrap();
    let object = &review["request"]["object"];
    let patched = apply(object, &ops).unwrap();
    let mut expected = object.clone();
    expected["metadata"]["annotations"][NOT_SUPERVISED_ANNOTATION] =
        json!(warning.trim_start_matches("not supervised: "));
    expected["metadata"]["labels"][NOT_SUPERVISED_LABEL] = json!(reason.as_str());
    assert_eq!(patched, expected, "only the label and the annotation are added: {what}");
}

#[test]
fn pods_the_sidecar_cannot_supervise_are_admitted_unchanged_but_for_the_reason() {
    let injector = injector();
    let base = fixture("pod-create-plain.json");
    let with = |edit: &dyn Fn(&mut Value)| {
        let mut review = base.clone();
        edit(&mut review["request"]["object"]["spec"]);
        review
    };
    let cases: [(Value, SkipReason); 5] = [
        (with(&|spec| spec["hostNetwork"] = json!(true)), SkipReason::HostNetwork),
        (
            with(&|spec| spec["shareProcessNamespace"] = json!(false)),
            SkipReason::ProcessNamespaceOff,
        ),
        (
            with(&|spec| spec["securityContext"] = json!({ "runAsUser": 0 })),
            SkipReason::RunsAsRoot,
        ),
        (
            with(&|spec| spec["containers"][0]["securityContext"] = json!({ "runAsUser": 0 })),
            SkipReason::RunsAsRoot,
        ),
        (
            with(&|spec| {
                let mut second = spec["containers"][0].clone();
                second["name"] = json!("second");
                second["securityContext"] = json!({ "runAsUser": 2000 });
                spec["containers"][0]["securityContext"] = json!({ "runAsUser": 1000 });
                spec["containers"].as_array_mut().unwrap().push(second);
            }),
            SkipReason::UidMismatch,
        ),
    ];
    for (review, reason) in cases {
        assert_not_supervised(&review, &injector, reason);
    }
}

/// `review` (the captured plain Pod, edited by `edit`) injected in `mode`: the patched Pod and
/// its sidecar.
fn injected_sidecar(injector: &Injector, mode: SidecarMode, edit: impl Fn(&mut Value)) -> (Value, Value) {
    let mut review = fixture("pod-create-plain.json");
    review["request"]["object"]["metadata"]["annotations"] = json!({ SIDECAR_MODE_ANNOTATION: mode.as_str() });
    edit(&mut review["request"]["object"]["spec"]);
    let reviewed = mutate(&review, injector);
    assert_eq!(reviewed.outcome, Outcome::Injected(mode));
    let patched = apply(&review["request"]["object"], &patch_of(&reviewed).unwrap()).unwrap();
    let list = match mode {
        SidecarMode::Native => "initContainers",
        SidecarMode::Container => "containers",
    };
    let sidecar = patched["spec"][list]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == SIDECAR_NAME)
        .unwrap()
        .clone();
    (patched, sidecar)
}

#[test]
fn the_sidecar_runs_as_the_workloads_own_uid() {
    let injector = injector();
    for mode in [SidecarMode::Native, SidecarMode::Container] {
        let (_, sidecar) = injected_sidecar(&injector, mode, |spec| {
            spec["containers"][0]["securityContext"] = json!({ "runAsUser": 1000 });
        });
        assert_eq!(sidecar["securityContext"]["runAsUser"], 1000, "{mode:?}");
        assert_eq!(sidecar["securityContext"]["runAsNonRoot"], true);
    }
}

/// A Job's Pod (`restartPolicy: Never` or `OnFailure`) tells its sidecar, which supervises a
/// restarted workload only as the kubelet restarts it; a Pod that restarts always says nothing.
#[test]
fn the_sidecar_is_told_the_pods_restart_policy_unless_always() {
    let injector = injector();
    for mode in [SidecarMode::Native, SidecarMode::Container] {
        for policy in [None, Some("Always"), Some("OnFailure"), Some("Never")] {
            let (patched, sidecar) = injected_sidecar(&injector, mode, |spec| {
                if let Some(policy) = policy {
                    spec["restartPolicy"] = json!(policy);
                }
            });
            let told = sidecar["env"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["name"] == "OPENSHELL_WORKLOAD_RESTART_POLICY")
                .map(|e| e["value"].clone());
            let expected = policy.filter(|p| *p != "Always").map(|p| json!(p));
            assert_eq!(told, expected, "{mode:?} {policy:?}");
            if let Some(policy) = policy {
                assert_eq!(patched["spec"]["restartPolicy"], policy, "never changed");
            }
        }
    }
}

#[test]
fn excluded_pods_are_admitted_untouched() {
    let injector = injector();
    let base = fixture("pod-create-plain.json");
    let with_namespace = |ns: &str| {
        let mut review = base.clone();
        review["request"]["namespace"] = json!(ns);
        review["request"]["object"]["metadata"]["namespace"] = json!(ns);
        review
    };
    let mut cases: Vec<(Value, SkipReason)> = vec![
        (with_namespace("kube-system"), SkipReason::SystemNamespace),
        (with_namespace("kube-public"), SkipReason::SystemNamespace),
        (with_namespace("kube-node-lease"), SkipReason::SystemNamespace),
        (with_namespace("openshell-supervision"), SkipReason::InstallNamespace),
    ];
    let mut opted_out = fixture("pod-create-kubectl-run.json");
    opted_out["request"]["object"]["metadata"]["labels"][INJECT_LABEL] = json!("disabled");
    cases.push((opted_out, SkipReason::OptedOut));
    let mut update = base.clone();
    update["request"]["operation"] = json!("UPDATE");
    cases.push((update, SkipReason::NotCreate));
    let mut not_pod = base.clone();
    not_pod["request"]["kind"] = json!({ "group": "apps", "version": "v1", "kind": "Deployment" });
    cases.push((not_pod, SkipReason::NotPod));
    let mut subresource = base.clone();
    subresource["request"]["subResource"] = json!("status");
    cases.push((subresource, SkipReason::NotPod));
    let mut ephemeral = base.clone();
    ephemeral["request"]["subResource"] = json!("ephemeralcontainers");
    ephemeral["request"]["operation"] = json!("UPDATE");
    cases.push((ephemeral, SkipReason::EphemeralContainers));

    for (review, reason) in cases {
        let reviewed = mutate(&review, &injector);
        assert_eq!(reviewed.outcome, Outcome::Skipped(reason));
        assert!(reviewed.response.allowed);
        assert_eq!(reviewed.response.patch, None);
        assert_eq!(reviewed.response.uid, review["request"]["uid"].as_str().unwrap());
    }

    // hostPID is no reason to skip but one to refuse.
    let mut host_pid = base.clone();
    host_pid["request"]["object"]["spec"]["hostPID"] = json!(true);
    assert_eq!(
        mutate(&host_pid, &injector).outcome,
        Outcome::Refused(RefuseReason::HostPid)
    );

    // A custom install namespace is honoured; the default one is then an ordinary namespace.
    let custom = Injector::new(InjectConfig {
        install_namespace: "supervision-system".into(),
        ..InjectConfig::default()
    });
    assert_eq!(
        mutate(&with_namespace("supervision-system"), &custom).outcome,
        Outcome::Skipped(SkipReason::InstallNamespace)
    );
    assert_eq!(
        mutate(&with_namespace("openshell-supervision"), &custom).outcome,
        Outcome::Injected(SidecarMode::Native)
    );
    // Opt-out needs the exact value.
    let mut other_value = fixture("pod-create-kubectl-run.json");
    other_value["request"]["object"]["metadata"]["labels"][INJECT_LABEL] = json!("enabled");
    assert_eq!(
        mutate(&other_value, &injector).outcome,
        Outcome::Injected(SidecarMode::Native)
    );
}

fn response_json(reviewed: &webhook::Reviewed) -> Value {
    let out: Value = serde_json::from_slice(&reviewed.to_json()).unwrap();
    assert_eq!(out["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(out["kind"], "AdmissionReview");
    out
}

#[test]
fn bad_input_gets_a_clear_answer_with_the_uid() {
    let injector = injector();
    let plain = fixture_bytes("pod-create-plain.json");
    let uid = "df9a6f69-28a7-4a9b-b942-ed00b3ccf379";

    // Invalid JSON (a truncated body): UID found by the best-effort scan.
    let reviewed = mutate_bytes(&plain[..plain.len() / 2], &injector);
    assert_eq!(reviewed.outcome, Outcome::Failed(FailReason::InvalidJson));
    let out = response_json(&reviewed);
    assert_eq!(out["response"]["uid"], uid);
    assert_eq!(out["response"]["allowed"], false);
    assert_eq!(out["response"]["status"]["code"], 400);
    assert!(
        out["response"]["status"]["message"]
            .as_str()
            .unwrap()
            .contains("not valid JSON")
    );

    // Wrong kind of review.
    let mut review = fixture("pod-create-plain.json");
    review["kind"] = json!("TokenReview");
    let reviewed = mutate(&review, &injector);
    assert_eq!(reviewed.outcome, Outcome::Failed(FailReason::InvalidReview));
    let out = response_json(&reviewed);
    assert_eq!(out["response"]["uid"], uid);
    assert!(
        out["response"]["status"]["message"]
            .as_str()
            .unwrap()
            .contains("TokenReview")
    );
    let mut review = fixture("pod-create-plain.json");
    review["apiVersion"] = json!("admission.k8s.io/v1beta1");
    assert_eq!(mutate(&review, &injector).response.uid, uid);

    // Missing request: nothing to echo, still well formed.
    let reviewed = mutate(
        &json!({ "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview" }),
        &injector,
    );
    assert_eq!(reviewed.outcome, Outcome::Failed(FailReason::MissingRequest));
    let out = response_json(&reviewed);
    assert_eq!(out["response"]["uid"], "");
    assert!(
        out["response"]["status"]["message"]
            .as_str()
            .unwrap()
            .contains("no `request`")
    );

    // Request without the Pod object.
    let mut review = fixture("pod-create-plain.json");
    review["request"].as_object_mut().unwrap().remove("object");
    let reviewed = mutate(&review, &injector);
    assert_eq!(reviewed.outcome, Outcome::Failed(FailReason::MissingObject));
    assert_eq!(response_json(&reviewed)["response"]["uid"], uid);

    // A Pod shape the API server would never send.
    let mut review = fixture("pod-create-plain.json");
    review["request"]["object"]["spec"]["volumes"] = json!("nope");
    let reviewed = mutate(&review, &injector);
    assert_eq!(reviewed.outcome, Outcome::Failed(FailReason::InvalidPod));
    let out = response_json(&reviewed);
    assert_eq!(out["response"]["uid"], uid);
    assert!(
        out["response"]["status"]["message"]
            .as_str()
            .unwrap()
            .contains("spec.volumes")
    );
}

#[test]
fn fast_path_answers_like_the_value_path_on_every_fixture() {
    for mode in [SidecarMode::Native, SidecarMode::Container] {
        let injector = injector_mode(mode);
        for name in POD_FIXTURES {
            let bytes = fixture_bytes(name);
            let compact = serde_json::to_vec(&fixture(name)).unwrap();
            let slow = mutate(&fixture(name), &injector);
            assert_eq!(mutate_bytes(&bytes, &injector), slow, "{name}");
            assert_eq!(mutate_bytes(&compact, &injector), slow, "{name}");
        }
    }
    // The parts the refusals read are kept by the fast path too.
    let injector = injector();
    for (pointer, value) in [
        ("/spec/containers/0/securityContext", json!({ "privileged": true })),
        (
            "/spec/containers/0/volumeDevices",
            json!([{ "name": TOKEN_VOLUME, "devicePath": "/d" }]),
        ),
        (
            "/spec/initContainers",
            json!([{ "name": "i", "securityContext": { "capabilities": { "add": ["SYS_PTRACE"] } } }]),
        ),
        (
            "/spec/ephemeralContainers",
            json!([{ "name": "e", "volumeMounts": [{ "name": STATE_VOLUME, "mountPath": "/s" }] }]),
        ),
        (
            "/spec/securityContext",
            json!({ "windowsOptions": { "hostProcess": true } }),
        ),
    ] {
        for sub_resource in [None, Some("ephemeralcontainers")] {
            let mut review = fixture("pod-create-plain.json");
            let (parent, key) = pointer.rsplit_once('/').unwrap();
            review["request"]["object"].pointer_mut(parent).unwrap()[key] = value.clone();
            if let Some(sub_resource) = sub_resource {
                review["request"]["subResource"] = json!(sub_resource);
                review["request"]["operation"] = json!("UPDATE");
            }
            let slow = mutate(&review, &injector);
            let fast = mutate_bytes(&serde_json::to_vec(&review).unwrap(), &injector);
            assert_eq!(fast, slow, "{pointer} {sub_resource:?}");
            if sub_resource.is_none() || pointer == "/spec/ephemeralContainers" {
                assert!(
                    matches!(slow.outcome, Outcome::Refused(_)),
                    "{pointer} {sub_resource:?}"
                );
            }
        }
    }
}

#[test]
fn no_input_makes_it_panic() {
    let injector = injector();
    let mut inputs: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"null".to_vec(),
        b"[]".to_vec(),
        b"\"AdmissionReview\"".to_vec(),
        b"{\"request\": 5}".to_vec(),
        br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":7}}"#.to_vec(),
        vec![0xff, 0xfe, 0x00],
    ];
    // Every truncation point of a real review, and every field replaced by odd values.
    let plain = fixture_bytes("pod-create-with-volumes.json");
    for cut in (0..plain.len()).step_by(97) {
        inputs.push(plain[..cut].to_vec());
    }
    let review = fixture("pod-create-with-volumes.json");
    for pointer in [
        "/request/object/metadata",
        "/request/object/metadata/annotations",
        "/request/object/metadata/labels",
        "/request/object/spec",
        "/request/object/spec/containers",
        "/request/object/spec/containers/0",
        "/request/object/spec/initContainers",
        "/request/namespace",
        "/request/kind",
        "/request/operation",
    ] {
        for odd in [json!(null), json!(1), json!("s"), json!([]), json!({}), json!([1])] {
            let mut changed = review.clone();
            *changed.pointer_mut(pointer).unwrap() = odd;
            inputs.push(serde_json::to_vec(&changed).unwrap());
        }
    }
    for input in inputs {
        let reviewed = mutate_bytes(&input, &injector);
        // The pruned fast path answers exactly like the whole-Value path.
        if let Ok(review) = serde_json::from_slice::<Value>(&input) {
            assert_eq!(
                reviewed,
                mutate(&review, &injector),
                "{}",
                String::from_utf8_lossy(&input)
            );
        }
        let out = response_json(&reviewed);
        assert!(out["response"]["uid"].is_string());
        // Whatever was allowed with a patch must apply to the object it came with.
        if let (Some(patch), Ok(review)) = (patch_of(&reviewed), serde_json::from_slice::<Value>(&input)) {
            apply(&review["request"]["object"], &patch).unwrap();
        }
    }
}

#[test]
fn supervisor_tls_name_reaches_the_sidecar_only_and_only_when_configured() {
    let named = Injector::new(InjectConfig {
        supervisor_tls_name: Some("pool.example.internal".into()),
        ..InjectConfig::default()
    });
    let unnamed = Injector::new(InjectConfig {
        supervisor_tls_name: None,
        ..InjectConfig::default()
    });
    for mode in [SidecarMode::Native, SidecarMode::Container] {
        let env = named.sidecar(mode)["env"].as_array().unwrap().clone();
        let names: Vec<&Value> = env
            .iter()
            .filter(|e| e["name"] == "OPENSHELL_SUPERVISOR_TLS_NAME")
            .collect();
        assert_eq!(names.len(), 1, "{mode}");
        assert_eq!(names[0]["value"], "pool.example.internal");
        let env = unnamed.sidecar(mode)["env"].as_array().unwrap().clone();
        assert!(
            env.iter().all(|e| e["name"] != "OPENSHELL_SUPERVISOR_TLS_NAME"),
            "{mode}"
        );
    }
    // Workload containers get the route and the socket, not the sidecar's TLS settings.
    assert!(
        named
            .workload_env()
            .iter()
            .all(|e| e["name"] != "OPENSHELL_SUPERVISOR_TLS_NAME")
    );
}

#[test]
fn workload_containers_are_pointed_at_the_sidecars_proxy_unless_the_pod_opts_out() {
    let injected = |pod: Value| {
        let Ok(webhook::inject::Decision::Inject(injection)) = injector().mutate_pod(&pod, "team-a") else {
            panic!("expected an injection");
        };
        let patch: Value = serde_json::from_slice(injection.patch.as_bytes()).unwrap();
        apply(&pod, &patch).unwrap()
    };
    let env_of = |pod: &Value, container: usize, name: &str| {
        pod["spec"]["containers"][container]["env"]
            .as_array()
            .and_then(|env| env.iter().find(|v| v["name"] == name))
            .map(|v| v["value"].as_str().unwrap_or_default().to_owned())
    };
    let pod = json!({ "spec": { "containers": [
        { "name": "app" },
        { "name": "own", "env": [ { "name": "HTTPS_PROXY", "value": "http://corp:3128" } ] },
    ] } });
    let patched = injected(pod.clone());
    for name in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
        assert_eq!(
            env_of(&patched, 0, name).as_deref(),
            Some("http://127.0.0.1:15001"),
            "{name}"
        );
    }
    assert_eq!(
        env_of(&patched, 0, "NO_PROXY").as_deref(),
        Some("localhost,127.0.0.1,::1")
    );
    assert_eq!(
        env_of(&patched, 1, "HTTPS_PROXY").as_deref(),
        Some("http://corp:3128"),
        "a container's own variable is never overridden"
    );
    let sidecar = &patched["spec"]["initContainers"][0];
    let listen = sidecar["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "OPENSHELL_EGRESS_LISTEN");
    assert_eq!(listen.map(|v| &v["value"]), Some(&json!("127.0.0.1:15001")));

    let mut opted_out = pod;
    opted_out["metadata"] = json!({ "annotations": { "supervision.openshell.ai/egress-proxy": "disabled" } });
    let patched = injected(opted_out);
    assert_eq!(env_of(&patched, 0, "HTTP_PROXY"), None);
    assert_eq!(env_of(&patched, 0, "NO_PROXY"), None);
    assert!(env_of(&patched, 0, "OPENSHELL_SIDECAR_SOCKET").is_some());
}

/// A container that declares the proxy's port would own the loopback port the sidecar's proxy
/// listens on: pointing the workload's HTTP clients there would send them to the workload's
/// own server. The Pod is supervised without the proxy, and says so.
#[test]
fn a_pod_that_declares_the_proxy_port_runs_without_the_proxy_and_is_told_why() {
    for list in ["containers", "initContainers"] {
        let mut pod =
            json!({ "spec": { "securityContext": { "runAsUser": 1000 }, "containers": [ { "name": "app" } ] } });
        pod["spec"][list] = json!([{ "name": "listener", "ports": [ { "containerPort": 15001 } ] }]);
        if list == "initContainers" {
            pod["spec"]["containers"] = json!([{ "name": "app" }]);
        }
        let Ok(webhook::inject::Decision::Inject(injection)) = injector().mutate_pod(&pod, "team-a") else {
            panic!("{list}: expected an injection");
        };
        assert_eq!(injection.warnings.len(), 1, "{list}: {:?}", injection.warnings);
        assert!(
            injection.warnings[0].contains("\"listener\" declares port 15001"),
            "{list}: {:?}",
            injection.warnings
        );
        let patch: Value = serde_json::from_slice(injection.patch.as_bytes()).unwrap();
        let patched = apply(&pod, &patch).unwrap();
        let all_env: Vec<&Value> = ["containers", "initContainers"]
            .iter()
            .filter_map(|l| patched["spec"][*l].as_array())
            .flatten()
            .filter_map(|c| c["env"].as_array())
            .flatten()
            .collect();
        for name in ["HTTP_PROXY", "https_proxy", "NO_PROXY", "OPENSHELL_EGRESS_LISTEN"] {
            assert!(all_env.iter().all(|v| v["name"] != name), "{list}: {name} set");
        }
        let record: Value = serde_json::from_str(
            patched["metadata"]["annotations"]["supervision.openshell.ai/injected"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert!(
            record["egress"]
                .as_str()
                .unwrap()
                .starts_with("off: container \"listener\""),
            "{list}: {record}"
        );
    }
}

fn injector_redirect(mode: SidecarMode) -> Injector {
    Injector::new(InjectConfig {
        default_mode: mode,
        egress_redirect: Redirect::On(Redirection::default()),
        ..InjectConfig::default()
    })
}

/// Under egress redirection every fixture (with and without init containers of its own, in
/// both modes) gets the rules' init container first, the dialer before the sidecar (native) or
/// after it (container), the dialer's volume mounted in the dialer and the sidecar only, and a
/// sidecar the sidecar binary accepts with its redirect listener and dialer.
#[test]
fn under_redirection_the_rules_run_first_and_only_the_dialer_and_sidecar_share_its_socket() {
    for mode in [SidecarMode::Native, SidecarMode::Container] {
        let injector = injector_redirect(mode);
        for name in POD_FIXTURES {
            let (object, _patch, patched) = inject_fixture(name, &injector);
            let pod: Pod = serde_json::from_value(patched.clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
            let spec = pod.spec.as_ref().unwrap();
            let init = spec.init_containers.as_ref().unwrap();
            assert_eq!(
                init[0].name, EGRESS_INIT_NAME,
                "{name} {mode:?}: the rules before anything else"
            );
            let caps = init[0]
                .security_context
                .as_ref()
                .unwrap()
                .capabilities
                .as_ref()
                .unwrap();
            assert_eq!(caps.add.as_deref(), Some(["NET_ADMIN".to_owned()].as_slice()));
            let (dialer, sidecar) = match mode {
                SidecarMode::Native => {
                    assert_eq!(init[1].name, DIALER_NAME, "{name}");
                    assert_eq!(init[1].restart_policy.as_deref(), Some("Always"));
                    assert_eq!(init[2].name, SIDECAR_NAME, "{name}");
                    (&init[1], &init[2])
                }
                SidecarMode::Container => {
                    let n = spec.containers.len();
                    assert_eq!(spec.containers[n - 1].name, DIALER_NAME, "{name}");
                    assert_eq!(spec.containers[n - 2].name, SIDECAR_NAME, "{name}");
                    (&spec.containers[n - 1], &spec.containers[n - 2])
                }
            };
            // The Pod's own init containers keep their order, after ours.
            let own = object["spec"]["initContainers"].as_array().map_or(0, Vec::len);
            let ours = if mode == SidecarMode::Native { 3 } else { 1 };
            assert_eq!(init.len(), own + ours, "{name} {mode:?}");
            // A dialer UID of its own per Pod, which the rules exempt and the record names.
            let security = dialer.security_context.as_ref().unwrap();
            let uid = security.run_as_user.unwrap();
            assert!(DIALER_UIDS.contains(&uid), "{uid}");
            assert_eq!(security.run_as_group, Some(uid));
            assert_eq!(security.allow_privilege_escalation, Some(false));
            let rules_uid = init[0]
                .env
                .iter()
                .flatten()
                .find(|e| e.name == "OPENSHELL_EGRESS_DIALER_UID");
            assert_eq!(rules_uid.and_then(|e| e.value.clone()), Some(uid.to_string()));
            // Only the dialer and the sidecar mount the dialer's socket.
            let mounting: Vec<&str> = spec
                .containers
                .iter()
                .chain(init.iter())
                .filter(|c| c.volume_mounts.iter().flatten().any(|m| m.name == DIALER_VOLUME))
                .map(|c| c.name.as_str())
                .collect();
            let mut expected = vec![SIDECAR_NAME, DIALER_NAME];
            expected.sort_unstable();
            let mut mounting = mounting;
            mounting.sort_unstable();
            assert_eq!(mounting, expected, "{name} {mode:?}");
            let env: Vec<&str> = sidecar.env.iter().flatten().map(|e| e.name.as_str()).collect();
            assert!(env.contains(&"OPENSHELL_EGRESS_REDIRECT_LISTEN"), "{name}: {env:?}");
            assert!(env.contains(&"OPENSHELL_EGRESS_DIALER"), "{name}: {env:?}");
            assert_sidecar_accepts(sidecar, &pod);
            let record: Value =
                serde_json::from_str(pod.metadata.annotations.as_ref().unwrap()[INJECTED_ANNOTATION].as_str()).unwrap();
            assert_eq!(
                record["redirect"],
                format!("127.0.0.1:15002 (dialer UID {uid})"),
                "{name}"
            );
        }
    }
}

/// A namespace that asks for redirection but enforces a Pod Security level that refuses it
/// gets the proxy only, with a warning and the reason in the record: never a Pod the API
/// server refuses because of us.
#[test]
fn redirection_blocked_by_pod_security_is_the_proxy_with_a_warning() {
    let injector = Injector::new(InjectConfig {
        egress_redirect: Redirect::Blocked,
        ..InjectConfig::default()
    });
    let review = fixture("pod-create-kubectl-run.json");
    let reviewed = mutate(&review, &injector);
    assert!(
        reviewed
            .response
            .warnings
            .iter()
            .any(|w| w.contains("pod-security.kubernetes.io/enforce=privileged"))
    );
    let (_, _, patched) = inject_fixture("pod-create-kubectl-run.json", &injector);
    let names: Vec<&str> = patched["spec"]["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, [SIDECAR_NAME]);
    let record: Value = serde_json::from_str(
        patched["metadata"]["annotations"][INJECTED_ANNOTATION]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert!(record["redirect"].as_str().unwrap().starts_with("off: "), "{record}");
}

/// Where the namespace turned redirection on, a Pod that would run without it is refused with
/// the reason: opted out, a shape the sidecar cannot supervise, a container (init containers
/// too) running as the dialer's UID or declaring the redirect port.
#[test]
fn under_redirection_a_pod_that_would_escape_it_is_refused_with_the_reason() {
    let redirecting = Injector::new(InjectConfig {
        egress_redirect: Redirect::On(Redirection {
            dialer_uid: Some(15999),
            ..Redirection::default()
        }),
        ..InjectConfig::default()
    });
    type Edit = fn(&mut Value);
    let edits: [(&str, Edit); 5] = [
        ("opts out", |pod| {
            pod["metadata"]["labels"][INJECT_LABEL] = json!("disabled");
        }),
        ("runs as root", |pod| {
            pod["spec"]["securityContext"] = json!({ "runAsUser": 0 });
        }),
        ("UID 15999", |pod| {
            pod["spec"]["initContainers"] =
                json!([{ "name": "setup", "image": "x", "securityContext": { "runAsUser": 15999 } }]);
        }),
        ("port 15002", |pod| {
            pod["spec"]["containers"][0]["ports"] = json!([{ "containerPort": 15002 }]);
        }),
        ("hostNetwork", |pod| {
            pod["spec"]["hostNetwork"] = json!(true);
        }),
    ];
    for (what, edit) in edits {
        let mut review = fixture("pod-create-plain.json");
        edit(&mut review["request"]["object"]);
        let reviewed = mutate(&review, &redirecting);
        assert_eq!(
            reviewed.outcome,
            Outcome::Refused(RefuseReason::NotRedirected),
            "{what}"
        );
        assert!(!reviewed.response.allowed, "{what}");
        let message = &reviewed.response.status.as_ref().unwrap().message;
        assert!(
            message.contains("egress redirection is on for this namespace"),
            "{what}: {message}"
        );
        // The same Pod where redirection is off is admitted (unsupervised or skipped).
        assert!(mutate(&review, &injector()).response.allowed, "{what}");
    }
}

#[test]
fn the_credential_placeholders_of_the_pods_policy_are_set_unless_a_container_sets_them() {
    use webhook::policies::Policies;
    let policy = |name: &str, env: &str| -> kube::api::DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "supervision.openshell.ai/v1alpha1", "kind": "SandboxPolicy",
            "metadata": {"name": name, "namespace": "fixture-ns"},
            "spec": {"credentials": [{"name": "models", "env": env, "secretKeyRef": {"name": "s", "key": "k"}}]},
        }))
        .unwrap()
    };
    let policies = Policies::default();
    let injector = injector().with_policies(policies.clone());
    let review = fixture("pod-create-with-volumes.json");

    // Before the policies are listed: admitted, and the warning says what is missing.
    let reviewed = mutate(&review, &injector);
    let patched = apply(&review["request"]["object"], &patch_of(&reviewed).unwrap()).unwrap();
    assert!(!env_names(&patched["spec"]["containers"][0]).contains(&"MODELS_API_KEY".to_owned()));
    assert!(
        reviewed
            .response
            .warnings
            .iter()
            .any(|w| w.contains("not listed the SandboxPolicies")),
        "{:?}",
        reviewed.response.warnings
    );

    // The namespace's default policy, and another the Pod may name.
    policies.reset([&policy("default", "MODELS_API_KEY"), &policy("other", "OTHER_KEY")]);
    let mut review = fixture("pod-create-with-volumes.json");
    review["request"]["object"]["spec"]["containers"][1]["env"] =
        json!([{ "name": "MODELS_API_KEY", "value": "the container's own" }]);
    let reviewed = mutate(&review, &injector);
    let patched = apply(&review["request"]["object"], &patch_of(&reviewed).unwrap()).unwrap();
    let value_in = |container: &Value| {
        container["env"]
            .as_array()
            .and_then(|env| env.iter().find(|e| e["name"] == "MODELS_API_KEY"))
            .map(|e| e["value"].clone())
    };
    assert_eq!(
        value_in(&patched["spec"]["containers"][0]),
        Some(json!("openshell-placeholder-models"))
    );
    assert_eq!(
        value_in(&patched["spec"]["containers"][1]),
        Some(json!("the container's own")),
        "never overridden"
    );
    assert!(
        reviewed
            .response
            .warnings
            .iter()
            .any(|w| w.contains("sets MODELS_API_KEY itself")),
        "{:?}",
        reviewed.response.warnings
    );
    assert_eq!(
        value_in(&patched["spec"]["initContainers"][0]),
        None,
        "workload containers only"
    );

    // A variable the injection sets itself is never a placeholder's.
    policies.reset([&policy("default", "HTTP_PROXY")]);
    let review = fixture("pod-create-with-volumes.json");
    let reviewed = mutate(&review, &injector);
    let patched = apply(&review["request"]["object"], &patch_of(&reviewed).unwrap()).unwrap();
    let proxy = patched["spec"]["containers"][0]["env"]
        .as_array()
        .and_then(|env| env.iter().find(|e| e["name"] == "HTTP_PROXY"))
        .map(|e| e["value"].clone());
    assert_eq!(proxy, Some(json!("http://127.0.0.1:15001")));
    assert!(
        reviewed.response.warnings.iter().any(|w| w.contains("HTTP_PROXY")),
        "{:?}",
        reviewed.response.warnings
    );

    policies.reset([&policy("default", "MODELS_API_KEY"), &policy("other", "OTHER_KEY")]);
    let mut review = fixture("pod-create-with-volumes.json");
    review["request"]["object"]["metadata"]["annotations"]["supervision.openshell.ai/policy"] = json!("other");
    let patched = apply(
        &review["request"]["object"],
        &patch_of(&mutate(&review, &injector)).unwrap(),
    )
    .unwrap();
    let names = env_names(&patched["spec"]["containers"][0]);
    assert!(names.contains(&"OTHER_KEY".to_owned()) && !names.contains(&"MODELS_API_KEY".to_owned()));
}
