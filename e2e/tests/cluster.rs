//! On a real cluster with the pool installed (kustomize/README.md): label a namespace, create
//! an agent Pod, see it injected, its token Secret delivered and its instance placed; kill the
//! owning supervisor and see the instance recovered **without the agent restarting**; unlabel
//! and see the Secret go.
//!
//! Runs only where `KUBECONFIG` is set and the install is present; skips cleanly otherwise.
//! `OPENSHELL_E2E_INSTALL_NAMESPACE` (default `openshell-supervision`) names the install,
//! `OPENSHELL_E2E_AGENT_IMAGE` (default `openshell/agent:0.1.0`, the Dockerfile's `agent`
//! target) the workload image.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use e2e::cluster::{Kubectl, events, wait_for};
use serde_json::Value;

const SECRET: &str = "openshell-supervision-token";

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn agent_pod(namespace: &str, image: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: agent
  namespace: {namespace}
  labels:
    app: agent
spec:
  containers:
    - name: agent
      image: {image}
      command: ["/usr/local/bin/agent"]
      securityContext:
        runAsNonRoot: true
        runAsUser: 65532
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: ["ALL"]
        seccompProfile:
          type: RuntimeDefault
"#
    )
}

/// `placed on member X (term N)` / `recovered by member X (term N)` → X.
fn member_of(note: &str) -> Option<String> {
    let rest = note.split("member ").nth(1)?;
    Some(rest.split_whitespace().next()?.to_owned())
}

fn note(event: &Value) -> String {
    event
        .get("message")
        .or_else(|| event.get("note"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_labelled_namespace_gets_injected_pods_that_survive_their_supervisor() {
    if std::env::var_os("KUBECONFIG").is_none() {
        eprintln!("skipped: KUBECONFIG is unset (this test needs a cluster with the pool installed)");
        return;
    }
    let kubectl = Kubectl;
    let install = env_or("OPENSHELL_E2E_INSTALL_NAMESPACE", "openshell-supervision");
    if kubectl
        .run(&["get", "deployment", "openshell-gateway", "-n", &install])
        .await
        .is_err()
    {
        eprintln!("skipped: no openshell-gateway Deployment in {install} (install it as kustomize/README.md says)");
        return;
    }
    for deployment in ["openshell-gateway", "openshell-supervisor", "openshell-webhook"] {
        let target = format!("deployment/{deployment}");
        kubectl
            .run(&["rollout", "status", &target, "-n", &install, "--timeout=50s"])
            .await
            .unwrap();
    }

    let namespace = format!("openshell-e2e-{}", std::process::id());
    kubectl.run(&["create", "namespace", &namespace]).await.unwrap();
    let outcome = scenario(&kubectl, &install, &namespace).await;
    let _ = kubectl.run(&["delete", "namespace", &namespace, "--wait=false"]).await;
    outcome.unwrap();
}

async fn scenario(kubectl: &Kubectl, install: &str, namespace: &str) -> Result<(), e2e::cluster::Error> {
    let minute = Duration::from_secs(60);
    kubectl
        .run(&[
            "label",
            "namespace",
            namespace,
            "supervision.openshell.ai/shared=enabled",
        ])
        .await?;
    // The coordinator writes the namespace's token Secret.
    wait_for("the namespace token Secret", minute, || async {
        let secret = kubectl.json(&["get", "secret", SECRET, "-n", namespace]).await.ok()?;
        let data = secret.get("data")?;
        (data.get("token").is_some() && data.get("trust.jwks").is_some()).then_some(())
    })
    .await?;

    // The webhook injects the Pod.
    let image = env_or("OPENSHELL_E2E_AGENT_IMAGE", "openshell/agent:0.1.0");
    kubectl.apply(&agent_pod(namespace, &image)).await?;
    let pod = kubectl.json(&["get", "pod", "agent", "-n", namespace]).await?;
    let sidecar = pod
        .pointer("/spec/initContainers")
        .and_then(Value::as_array)
        .and_then(|c| c.iter().find(|c| c["name"] == "openshell-sidecar"));
    assert!(sidecar.is_some(), "the sidecar is injected as an init container: {pod}");
    assert_eq!(
        sidecar.and_then(|s| s.get("restartPolicy")),
        Some(&Value::from("Always")),
        "as a native sidecar"
    );
    assert!(
        pod.pointer("/metadata/annotations/supervision.openshell.ai~1injected")
            .is_some(),
        "the injection is recorded"
    );

    // It runs, and its instance is placed.
    kubectl
        .run(&[
            "wait",
            "pod/agent",
            "-n",
            namespace,
            "--for=condition=Ready",
            "--timeout=55s",
        ])
        .await?;
    let placed = wait_for("InstancePlaced on the agent Pod", minute, || async {
        events(kubectl, namespace, "agent", "InstancePlaced")
            .await
            .ok()?
            .first()
            .cloned()
    })
    .await?;
    let owner = member_of(&note(&placed)).expect("the event names the member");
    let started = |pod: &Value| {
        pod.pointer("/status/containerStatuses")
            .and_then(Value::as_array)
            .and_then(|s| s.iter().find(|c| c["name"] == "agent"))
            .map(|c| {
                (
                    c["restartCount"].clone(),
                    c.pointer("/state/running/startedAt").cloned(),
                )
            })
    };
    let before = started(&kubectl.json(&["get", "pod", "agent", "-n", namespace]).await?);

    // Kill the owner: the instance moves, the agent keeps running.
    kubectl
        .run(&["delete", "pod", &owner, "-n", install, "--grace-period=0", "--force"])
        .await?;
    let recovered = wait_for("InstanceRecovered on the agent Pod", minute, || async {
        events(kubectl, namespace, "agent", "InstanceRecovered")
            .await
            .ok()?
            .first()
            .cloned()
    })
    .await?;
    let new_owner = member_of(&note(&recovered)).expect("the event names the member");
    assert_ne!(new_owner, owner, "recovered by another member");
    let after = started(&kubectl.json(&["get", "pod", "agent", "-n", namespace]).await?);
    assert_eq!(before, after, "the agent container did not restart");

    // Unlabelled: the Secret goes.
    kubectl
        .run(&["label", "namespace", namespace, "supervision.openshell.ai/shared-"])
        .await?;
    wait_for("the token Secret removed", minute, || async {
        kubectl
            .run(&["get", "secret", SECRET, "-n", namespace])
            .await
            .is_err()
            .then_some(())
    })
    .await?;
    Ok(())
}
