//! Refusals through the real server (TLS `/mutate`, `/metrics`): a Pod that would reach the
//! supervision sidecar's token, fence state or memory is answered `allowed: false` (403) with a
//! message naming the container or volume and why, and counted by reason; an ordinary Pod is
//! still injected.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use base64::Engine as _;
use common::{POD_FIXTURES, Running, TlsClient, fixture, metric, self_signed, start, wait_until};
use serde_json::{Value, json};
use webhook::config::Config;

const WAIT: Duration = Duration::from_secs(15);
const TOKEN_VOLUME: &str = "openshell-supervision-token";
const STATE_VOLUME: &str = "openshell-sidecar-state";
const SOCKET_VOLUME: &str = "openshell-sidecar";

/// A ready webhook and one keep-alive TLS connection to it.
struct Served {
    server: Running,
    client: TlsClient,
    _dir: tempfile::TempDir,
}

async fn serve(tweak: impl FnOnce(&mut Config)) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, _) = self_signed("refuse");
    std::fs::write(dir.path().join("tls.crt"), cert).unwrap();
    std::fs::write(dir.path().join("tls.key"), key).unwrap();
    let server = start(dir.path().join("tls.crt"), dir.path().join("tls.key"), tweak).await;
    let client = wait_until("the webhook serves TLS", WAIT, || async {
        TlsClient::connect(server.webhook).await.ok()
    })
    .await;
    Served {
        server,
        client,
        _dir: dir,
    }
}

impl Served {
    /// POST one AdmissionReview; its `response`.
    async fn review(&mut self, review: &Value) -> Value {
        self.review_at("/mutate", review).await
    }

    /// POST one AdmissionReview to `path`; its `response`.
    async fn review_at(&mut self, path: &str, review: &Value) -> Value {
        let (status, body) = self
            .client
            .post(path, serde_json::to_vec(review).unwrap())
            .await
            .unwrap();
        assert_eq!(status, 200);
        let out: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(out["response"]["uid"], review["request"]["uid"]);
        out["response"].clone()
    }

    /// POST `review` and check it is refused for `reason` with a message holding `needles`.
    async fn refused(&mut self, review: &Value, reason: &str, needles: &[&str]) {
        let response = self.review(review).await;
        assert_refused(&response, needles);
        let counted = format!("openshell_webhook_admission_refused_total{{reason=\"{reason}\"}}");
        assert!(
            metric(self.server.health, &counted).await.is_some_and(|n| n >= 1.0),
            "{counted} counted"
        );
    }

    async fn stop(self) {
        self.server.trigger.force();
        tokio::time::timeout(WAIT, self.server.handle)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}

fn assert_refused(response: &Value, needles: &[&str]) {
    let status = &response["status"];
    assert_eq!(response["allowed"], false, "admitted; status {status}");
    assert_eq!(status["code"], 403, "{status}");
    assert!(response.get("patch").is_none(), "{status}");
    let message = response["status"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("openshell supervision webhook: refused: "),
        "{message}"
    );
    for needle in needles {
        assert!(message.contains(needle), "{needle:?} in {message}");
    }
}

fn assert_injected(response: &Value) {
    assert_eq!(response["allowed"], true, "{}", response["status"]);
    assert_eq!(response["patchType"], "JSONPatch", "not injected");
}

/// Admitted, with no patch.
fn assert_untouched(response: &Value) {
    assert_eq!(response["allowed"], true, "{}", response["status"]);
    assert!(response.get("patch").is_none(), "patched");
}

/// The plain Pod CREATE, its `request.object.spec` changed by `edit`.
fn pod_create(edit: impl FnOnce(&mut Value)) -> Value {
    let mut review = fixture("pod-create-plain.json");
    edit(&mut review["request"]["object"]["spec"]);
    review
}

fn push(list: &mut Value, item: Value) {
    match list.as_array_mut() {
        Some(items) => items.push(item),
        None => *list = json!([item]),
    }
}

/// The plain Pod as the webhook injected it, then an `ephemeralcontainers` UPDATE adding
/// `container` (as `kubectl debug` sends it: the whole Pod, old and new).
fn ephemeral_update(container: Value) -> Value {
    let mut review = fixture("pod-create-plain.json");
    let injector = webhook::Injector::new(Config::with_cert_paths("c".into(), "k".into()).unwrap().inject_config());
    let reviewed = webhook::mutate(&review, &injector);
    let patch = base64::engine::general_purpose::STANDARD
        .decode(reviewed.response.patch.unwrap())
        .unwrap();
    let patch: json_patch::Patch = serde_json::from_slice(&patch).unwrap();
    let mut pod = review["request"]["object"].clone();
    json_patch::patch(&mut pod, &patch).unwrap();
    pod["metadata"]["uid"] = json!("6b1c4c3e-1f0e-4d59-9d3c-2a0f3f1e9b11");
    let mut with_debug = pod.clone();
    with_debug["spec"]["ephemeralContainers"] = json!([container]);
    let request = &mut review["request"];
    request["uid"] = json!("0e2f8f3a-9d1b-4c51-8a57-3f4e7a1c2d90");
    request["operation"] = json!("UPDATE");
    request["subResource"] = json!("ephemeralcontainers");
    request["requestSubResource"] = json!("ephemeralcontainers");
    request["options"] = json!({ "kind": "UpdateOptions", "apiVersion": "meta.k8s.io/v1" });
    request["oldObject"] = pod;
    request["object"] = with_debug;
    review
}

/// Class 1: a workload container of any kind that mounts (or attaches as a device) the
/// sidecar's token or state volume without declaring it — the injected volume would satisfy
/// the mount.
#[tokio::test]
async fn a_container_mounting_a_sidecar_volume_is_refused() {
    let mut served = serve(|_| {}).await;
    let cases = [
        (
            pod_create(|spec| {
                push(
                    &mut spec["containers"][0]["volumeMounts"],
                    json!({ "name": TOKEN_VOLUME, "mountPath": "/stolen" }),
                );
            }),
            vec!["\"app\"", "spec.containers[0]", TOKEN_VOLUME],
        ),
        (
            pod_create(|spec| {
                spec["initContainers"] = json!([{ "name": "setup", "image": "busybox",
                    "volumeMounts": [{ "name": STATE_VOLUME, "mountPath": "/state" }] }]);
            }),
            vec!["\"setup\"", "spec.initContainers[0]", STATE_VOLUME],
        ),
        (
            pod_create(|spec| {
                push(
                    &mut spec["containers"],
                    json!({ "name": "second", "image": "busybox",
                        "volumeDevices": [{ "name": TOKEN_VOLUME, "devicePath": "/dev/token" }] }),
                );
            }),
            vec!["\"second\"", "spec.containers[1]", TOKEN_VOLUME],
        ),
        (
            pod_create(|spec| {
                spec["ephemeralContainers"] = json!([{ "name": "debug", "image": "busybox",
                    "volumeMounts": [{ "name": STATE_VOLUME, "mountPath": "/state" }] }]);
            }),
            vec!["\"debug\"", "spec.ephemeralContainers[0]", STATE_VOLUME],
        ),
    ];
    for (review, needles) in cases {
        served.refused(&review, "volume_mounted", &needles).await;
    }
    // The socket volume is the workload's to mount: that Pod is injected.
    let review = pod_create(|spec| {
        push(
            &mut spec["containers"][0]["volumeMounts"],
            json!({ "name": SOCKET_VOLUME, "mountPath": "/var/run/openshell/sidecar" }),
        );
    });
    assert_injected(&served.review(&review).await);
    served.stop().await;
}

/// Class 2: a Pod that declares a volume under an injected volume's name (before, an
/// `emptyDir` state or socket volume was reused and a token volume was skipped).
#[tokio::test]
async fn a_pod_declaring_an_injected_volume_is_refused() {
    let mut served = serve(|_| {}).await;
    for volume in [
        json!({ "name": STATE_VOLUME, "emptyDir": {} }),
        json!({ "name": SOCKET_VOLUME, "emptyDir": { "medium": "Memory" } }),
        json!({ "name": TOKEN_VOLUME, "projected": { "sources": [
            { "secret": { "name": "openshell-supervision-token" } }] } }),
        json!({ "name": TOKEN_VOLUME, "emptyDir": {} }),
    ] {
        let name = volume["name"].as_str().unwrap().to_owned();
        let review = pod_create(|spec| push(&mut spec["volumes"], volume));
        served
            .refused(&review, "volume_declared", &[&format!("\"{name}\""), "spec.volumes[1]"])
            .await;
    }
    served.stop().await;
}

/// Class 3: a Pod that projects a ServiceAccount token for the gateway's audience itself —
/// the audience the webhook is configured with.
#[tokio::test]
async fn a_pod_projecting_a_gateway_token_is_refused() {
    let projected = |audience: &str| {
        pod_create(|spec| {
            push(
                &mut spec["volumes"],
                json!({ "name": "mine", "projected": { "sources": [
                    { "configMap": { "name": "kube-root-ca.crt" } },
                    { "serviceAccountToken": { "audience": audience, "path": "token" } }] } }),
            );
            push(
                &mut spec["containers"][0]["volumeMounts"],
                json!({ "name": "mine", "mountPath": "/var/run/mine" }),
            );
        })
    };
    let mut served = serve(|_| {}).await;
    served
        .refused(
            &projected("openshell-gateway"),
            "gateway_token",
            &["\"mine\"", "\"openshell-gateway\""],
        )
        .await;
    // Another audience (a vault, the API server's) is the workload's business.
    assert_injected(&served.review(&projected("vault")).await);
    served.stop().await;

    // The audience is the configured one.
    let mut served = serve(|config| config.token_audience = "gw.example".into()).await;
    served
        .refused(&projected("gw.example"), "gateway_token", &["\"gw.example\""])
        .await;
    assert_injected(&served.review(&projected("openshell-gateway")).await);
    served.stop().await;
}

/// Class 4: a container that could read the non-dumpable sidecar all the same: privileged,
/// capabilities beyond the Pod Security baseline set (SYS_PTRACE above all, in any spelling
/// the runtimes accept), the host's PID namespace, a Windows HostProcess.
#[tokio::test]
async fn a_pod_that_could_read_the_sidecar_is_refused() {
    let mut served = serve(|_| {}).await;
    let security = |context: Value| pod_create(|spec| spec["containers"][0]["securityContext"] = context);
    served
        .refused(
            &security(json!({ "privileged": true })),
            "privileged",
            &["\"app\"", "spec.containers[0]", "privileged"],
        )
        .await;
    for capability in ["SYS_PTRACE", "CAP_SYS_PTRACE", "sys_ptrace", "SYS_ADMIN", "ALL"] {
        served
            .refused(
                &security(json!({ "capabilities": { "add": ["NET_BIND_SERVICE", capability] } })),
                "capabilities",
                &["\"app\"", &format!("{capability:?}"), "baseline"],
            )
            .await;
    }
    let review = pod_create(|spec| {
        spec["initContainers"] = json!([{ "name": "tracer", "image": "busybox",
            "securityContext": { "capabilities": { "add": ["SYS_PTRACE"] } } }]);
    });
    served
        .refused(&review, "capabilities", &["\"tracer\"", "spec.initContainers[0]"])
        .await;
    served
        .refused(
            &pod_create(|spec| spec["hostPID"] = json!(true)),
            "host_pid",
            &["hostPID"],
        )
        .await;
    let host_process = json!({ "windowsOptions": { "hostProcess": true } });
    served
        .refused(
            &pod_create(|spec| spec["securityContext"] = host_process.clone()),
            "host_process",
            &["hostProcess"],
        )
        .await;
    served
        .refused(&security(host_process), "host_process", &["\"app\"", "hostProcess"])
        .await;

    // Baseline capabilities and an explicit `privileged: false` are fine.
    let review = security(json!({ "privileged": false,
        "capabilities": { "add": ["NET_BIND_SERVICE", "CHOWN", "KILL"], "drop": ["SYS_PTRACE"] } }));
    assert_injected(&served.review(&review).await);
    served.stop().await;
}

/// Ephemeral containers arrive by the `pods/ephemeralcontainers` UPDATE, on a Pod already
/// injected: one that mounts a sidecar volume or could trace the sidecar is refused; a plain
/// debug container is admitted, with no patch.
#[tokio::test]
async fn an_ephemeral_container_reaching_the_sidecar_is_refused() {
    let mut served = serve(|_| {}).await;
    let debug = |extra: Value| {
        let mut container = json!({ "name": "debugger", "image": "busybox", "targetContainerName": "app" });
        if let (Some(container), Some(extra)) = (container.as_object_mut(), extra.as_object()) {
            container.extend(extra.clone());
        }
        ephemeral_update(container)
    };
    served
        .refused(
            &debug(json!({ "volumeMounts": [{ "name": TOKEN_VOLUME, "mountPath": "/t" }] })),
            "volume_mounted",
            &["\"debugger\"", "spec.ephemeralContainers[0]", TOKEN_VOLUME],
        )
        .await;
    served
        .refused(
            &debug(json!({ "securityContext": { "privileged": true } })),
            "privileged",
            &["\"debugger\""],
        )
        .await;
    served
        .refused(
            &debug(json!({ "securityContext": { "capabilities": { "add": ["SYS_PTRACE"] } } })),
            "capabilities",
            &["\"debugger\"", "SYS_PTRACE"],
        )
        .await;

    assert_untouched(&served.review(&debug(json!({}))).await);
    served.stop().await;
}

/// Neither the opt-out label nor a forged injection record lets a Pod past the refusals.
#[tokio::test]
async fn opting_out_is_no_bypass() {
    let mut served = serve(|_| {}).await;
    let stealing = |metadata: Value| {
        let mut review = pod_create(|spec| {
            push(
                &mut spec["containers"][0]["volumeMounts"],
                json!({ "name": TOKEN_VOLUME, "mountPath": "/stolen" }),
            );
            push(
                &mut spec["volumes"],
                json!({ "name": TOKEN_VOLUME, "projected": { "sources": [
                    { "serviceAccountToken": { "audience": "openshell-gateway", "path": "token" } }] } }),
            );
        });
        let object = &mut review["request"]["object"]["metadata"];
        if let (Some(object), Some(metadata)) = (object.as_object_mut(), metadata.as_object()) {
            object.extend(metadata.clone());
        }
        review
    };
    for metadata in [
        json!({ "labels": { "supervision.openshell.ai/inject": "disabled" } }),
        json!({ "annotations": { "supervision.openshell.ai/injected": "{}" } }),
    ] {
        served
            .refused(&stealing(metadata), "volume_declared", &[TOKEN_VOLUME])
            .await;
    }
    // Opted out and harmless: admitted untouched.
    let mut review = fixture("pod-create-plain.json");
    review["request"]["object"]["metadata"]["labels"] = json!({ "supervision.openshell.ai/inject": "disabled" });
    assert_untouched(&served.review(&review).await);
    served.stop().await;
}

/// Every captured Pod is still injected, and nothing counts as refused.
#[tokio::test]
async fn ordinary_pods_are_still_injected() {
    let mut served = serve(|_| {}).await;
    for name in POD_FIXTURES {
        assert_injected(&served.review(&fixture(name)).await);
    }
    for reason in [
        "volume_declared",
        "volume_mounted",
        "gateway_token",
        "privileged",
        "capabilities",
        "host_pid",
        "host_process",
    ] {
        let counted = format!("openshell_webhook_admission_refused_total{{reason=\"{reason}\"}}");
        assert_eq!(metric(served.server.health, &counted).await, Some(0.0), "{counted}");
    }
    served.stop().await;
}

/// The three entries of the webhook configuration: `/mutate/redirect` injects the rules' init
/// container and the dialer, `/mutate/redirect-blocked` the proxy only with a warning; there a
/// `kubectl debug` container running as the Pod's dialer UID is refused, another admitted.
#[tokio::test]
async fn redirect_paths_inject_the_dialer_and_refuse_a_debug_container_as_it() {
    let mut served = serve(|_| {}).await;
    let review = fixture("pod-create-plain.json");
    let injected = served.review_at("/mutate/redirect", &review).await;
    assert_injected(&injected);
    let patch = base64::engine::general_purpose::STANDARD
        .decode(injected["patch"].as_str().unwrap())
        .unwrap();
    let patch: json_patch::Patch = serde_json::from_slice(&patch).unwrap();
    let mut pod = review["request"]["object"].clone();
    json_patch::patch(&mut pod, &patch).unwrap();
    let init = pod["spec"]["initContainers"].as_array().unwrap();
    assert_eq!(init[0]["name"], "openshell-egress-init");
    assert_eq!(init[1]["name"], "openshell-egress-dialer");
    let uid = init[1]["securityContext"]["runAsUser"].as_i64().unwrap();

    let blocked = served.review_at("/mutate/redirect-blocked", &review).await;
    assert_injected(&blocked);
    assert!(
        blocked["warnings"]
            .to_string()
            .contains("pod-security.kubernetes.io/enforce=privileged"),
        "{blocked}"
    );

    // kubectl debug on the redirected Pod.
    let debug = |security: Value| {
        let mut update =
            ephemeral_update(json!({ "name": "debugger", "image": "busybox", "securityContext": security }));
        for key in ["object", "oldObject"] {
            let list = update["request"][key]["spec"]["ephemeralContainers"].clone();
            update["request"][key] = pod.clone();
            update["request"][key]["metadata"]["uid"] = json!("6b1c4c3e-1f0e-4d59-9d3c-2a0f3f1e9b11");
            if key == "object" {
                update["request"][key]["spec"]["ephemeralContainers"] = list;
            }
        }
        update
    };
    let as_dialer = served
        .review_at("/mutate/redirect", &debug(json!({ "runAsUser": uid })))
        .await;
    assert_refused(&as_dialer, &["\"debugger\"", &uid.to_string(), "egress dialer"]);
    assert_untouched(
        &served
            .review_at("/mutate/redirect", &debug(json!({ "runAsUser": 1000 })))
            .await,
    );
    served.stop().await;
}
