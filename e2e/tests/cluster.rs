//! The whole user flow on a real cluster, as `kustomize/README.md` walks it: install with
//! `kubectl apply -k`, certificates with `kustomize/pool-certs.sh`, label a namespace, run
//! counting agents (a Deployment and a StatefulSet) that get injected and supervised, show
//! that a Pod of another namespace cannot act for them, that a `SandboxPolicy` decides an
//! agent's egress through its sidecar (and that a held tunnel outlives its owner's Pod), then
//! show that no workload container reaches its sidecar's token, fence or memory, that a root
//! Pod is admitted unsupervised with a warning and a Job's instance leaves the pool when it
//! finishes, then
//! take the pool through failures and maintenance — a supervisor Pod force-deleted, a member
//! process SIGKILLed on the node, the coordinator's Pod deleted, a drain with `poolctl` (while
//! the drained member's credential tries to take the grants reserved for the other), a
//! drain declared as a `SupervisorPoolOperation` (its dry run, and a running one cancelled by
//! deleting the object), a rollout restart of the members — checking after each that no agent restarted, kept its PID
//! and kept counting; then Pod replacement, scaling, the namespace label and the token Secret,
//! a recovery that misses its deadline, an unplaceable instance, and an uninstall that leaves
//! nothing behind. Prints a measurement table at the end.
//!
//! Runs only with `OPENSHELL_E2E_CLUSTER=1` (`scripts/test-cluster` sets it after loading the
//! images): it installs into and uninstalls from the cluster of `KUBECONFIG`. Environment:
//! `OPENSHELL_E2E_OVERLAY` (default `kustomize/overlays/test`), `OPENSHELL_E2E_AGENT_IMAGE`
//! (default `localhost/openshell/agent:dev`), `OPENSHELL_E2E_NODE_LOCAL=1` when the node's
//! processes are on this machine (the SIGKILL step), `OPENSHELL_E2E_LOGS` (where the logs go
//! when a step fails), `OPENSHELL_E2E_ONLY=egress,drain` (only the steps whose names contain
//! one of these, besides the install, the first agents and the uninstall).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "cluster/upgrade.rs"]
mod upgrade;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use e2e::agent_log;
use e2e::cluster::{
    Error, INSTALL_GUIDE, Kubectl, Pool, Status, check, condition_of, dump_logs, events, guide_command, poll,
    table_row, wait_for,
};
use serde_json::Value;

const SECRET: &str = "openshell-supervision-token";
const LABEL: &str = "supervision.openshell.ai/shared=enabled";
const MINUTE: Duration = Duration::from_secs(60);
/// How often a measured step looks at the pool.
const FINE: Duration = Duration::from_millis(200);
/// The Pod whose workload never talks to the socket (it neither counts nor reports): it runs
/// beside the agents from the Pod-shape step on, checked for its process but not its counter.
const SILENT: &str = "silent";

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The agent container, under the restricted Pod Security profile.
fn agent_container(image: &str) -> String {
    format!(
        r#"      containers:
        - name: agent
          image: {image}
          imagePullPolicy: Never
          command: ["/usr/local/bin/agent", "--interval-ms", "100"]
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

/// A Pod of `namespace` (no sidecar) that runs `probe` against the instance `route`/`uid` with
/// its own projected ServiceAccount token and its namespace's CA.
fn probe_pod(namespace: &str, image: &str, route: &str, uid: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: probe
  namespace: {namespace}
  labels:
    supervision.openshell.ai/inject: disabled
spec:
  restartPolicy: Never
  securityContext:
    runAsNonRoot: true
    runAsUser: 65532
    seccompProfile:
      type: RuntimeDefault
  containers:
    - name: probe
      image: {image}
      imagePullPolicy: Never
      command: ["/usr/local/bin/probe", "registry", "--route", "{route}", "--uid", "{uid}"]
      env:
        - name: OPENSHELL_GATEWAY_ENDPOINTS
          value: https://openshell-gateway.openshell-supervision.svc:8443
        - name: OPENSHELL_SUPERVISION_DIR
          value: /var/run/openshell/supervision
        - name: OPENSHELL_POD_NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
      securityContext:
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: ["ALL"]
      volumeMounts:
        - name: credentials
          mountPath: /var/run/openshell/supervision
          readOnly: true
  volumes:
    - name: credentials
      projected:
        defaultMode: 0444
        sources:
          - secret:
              name: {SECRET}
              items:
                - key: ca.crt
                  path: ca.crt
          - serviceAccountToken:
              audience: openshell-gateway
              expirationSeconds: 600
              path: token
"#
    )
}

/// A Pod of `namespace` (unlabelled: no webhook) that runs `probe grant` with the credential
/// in the Secret `thief` (a supervisor member's token and the pool's CA).
fn thief_pod(namespace: &str, image: &str, args: &[String]) -> String {
    let args = serde_json::to_string(args).unwrap_or_default();
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: thief
  namespace: {namespace}
  labels:
    supervision.openshell.ai/supervised: "true"
spec:
  restartPolicy: Never
  automountServiceAccountToken: false
  securityContext:
    runAsNonRoot: true
    runAsUser: 65532
    seccompProfile:
      type: RuntimeDefault
  containers:
    - name: thief
      image: {image}
      imagePullPolicy: Never
      command: ["/usr/local/bin/probe", "grant"]
      args: {args}
      env:
        - name: OPENSHELL_GATEWAY_ENDPOINTS
          value: https://openshell-gateway.openshell-supervision.svc:8443
        - name: OPENSHELL_SUPERVISION_DIR
          value: /var/run/thief
      securityContext:
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: ["ALL"]
      volumeMounts:
        - name: credentials
          mountPath: /var/run/thief
          readOnly: true
  volumes:
    - name: credentials
      secret:
        secretName: thief
        defaultMode: 0444
"#
    )
}

fn workloads(namespace: &str, image: &str) -> String {
    let container = agent_container(image);
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: counter
  namespace: {namespace}
spec:
  replicas: 3
  selector:
    matchLabels: {{app: counter}}
  template:
    metadata:
      labels: {{app: counter}}
    spec:
{container}---
apiVersion: v1
kind: Service
metadata:
  name: ledger
  namespace: {namespace}
spec:
  clusterIP: None
  selector: {{app: ledger}}
  ports: [{{port: 80}}]
---
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: ledger
  namespace: {namespace}
spec:
  serviceName: ledger
  replicas: 2
  selector:
    matchLabels: {{app: ledger}}
  template:
    metadata:
      labels: {{app: ledger}}
    spec:
{container}"#
    )
}

/// A Job whose agent counts through its sidecar for `seconds`, then exits 0.
fn finite_job(namespace: &str, image: &str, seconds: u64) -> String {
    let container = agent_container(image).replace(
        r#""--interval-ms", "100"]"#,
        &format!(r#""--interval-ms", "100", "--for-seconds", "{seconds}"]"#),
    );
    format!(
        r#"apiVersion: batch/v1
kind: Job
metadata:
  name: finite
  namespace: {namespace}
spec:
  backoffLimit: 0
  template:
    spec:
      restartPolicy: Never
{container}"#
    )
}

/// A suspended CronJob whose runs are [`finite_job`]'s (a run is started by hand, as
/// `kubectl create job --from=cronjob/…` does).
fn cron_job(namespace: &str, image: &str, seconds: u64) -> String {
    let job = finite_job(namespace, image, seconds);
    let (_, spec) = job.split_once("spec:\n").expect("the Job's spec");
    let template: String = spec.lines().map(|line| format!("    {line}\n")).collect();
    format!(
        r#"apiVersion: batch/v1
kind: CronJob
metadata:
  name: nightly
  namespace: {namespace}
spec:
  schedule: "0 0 1 1 *"
  suspend: true
  jobTemplate:
    spec:
{template}"#
    )
}

/// A Pod whose container runs as root (it never finds a socket and keeps trying).
fn root_pod(namespace: &str, image: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: as-root
  namespace: {namespace}
spec:
  securityContext:
    runAsUser: 0
  containers:
    - name: app
      image: {image}
      imagePullPolicy: Never
      command: ["/usr/local/bin/agent", "--socket", "/nonexistent/socket", "--interval-ms", "1000"]
"#
    )
}

fn lone_pod(namespace: &str, name: &str, image: &str) -> String {
    let container =
        agent_container(image)
            .replace("\n      ", "\n  ")
            .replacen("      containers:", "  containers:", 1);
    format!("apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {namespace}\nspec:\n{container}")
}

/// Pods of the shapes a real namespace holds beside the counting agent (named by what they
/// test): the container's own UID other than the Pod's; two app containers of one UID (the
/// agent and a silent one); `shareProcessNamespace: false`; `hostPID: true`.
fn shape_pods(namespace: &str, image: &str) -> BTreeMap<&'static str, String> {
    let pod = |name: &str| lone_pod(namespace, name, image);
    let other_uid = pod("other-uid")
        .replacen("spec:\n", "spec:\n  securityContext:\n    runAsUser: 65532\n", 1)
        .replacen("runAsUser: 65532\n        allow", "runAsUser: 65533\n        allow", 1);
    let agent = pod("two-apps");
    let (head, container) = agent.split_once("  containers:\n").expect("a containers list");
    let silent = container
        .replacen("name: agent", "name: helper", 1)
        .replace(r#""--interval-ms", "100"]"#, r#""--interval-ms", "100", "--silent"]"#);
    let two_apps = format!("{head}  containers:\n{container}{silent}");
    let private_pids = pod("private-pids").replacen("spec:\n", "spec:\n  shareProcessNamespace: false\n", 1);
    let host_pids = pod("host-pids").replacen("spec:\n", "spec:\n  hostPID: true\n", 1);
    BTreeMap::from([
        ("other-uid", other_uid),
        ("two-apps", two_apps),
        ("private-pids", private_pids),
        ("host-pids", host_pids),
    ])
}

/// The egress step's upstream (a Pod of its own, not injected) behind three Services, and the
/// namespace's default `SandboxPolicy`: one Service allowed on every method and path, one for
/// GET under /docs/ only, one not at all.
fn egress_fixture(namespace: &str, image: &str) -> String {
    let services: String = ["allowed", "readonly", "denied"]
        .iter()
        .map(|name| {
            format!(
                "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: upstream-{name}\n  namespace: {namespace}\nspec:\n  selector:\n    app: upstream\n  ports:\n    - port: 8080\n      targetPort: 8080\n"
            )
        })
        .collect();
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: upstream
  namespace: {namespace}
  labels:
    app: upstream
    supervision.openshell.ai/inject: disabled
spec:
  securityContext:
    runAsNonRoot: true
    runAsUser: 65532
    seccompProfile:
      type: RuntimeDefault
  containers:
    - name: upstream
      image: {image}
      imagePullPolicy: Never
      command: ["/usr/local/bin/probe", "upstream", "--name", "in-cluster", "--listen", "0.0.0.0:8080"]
      securityContext:
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: ["ALL"]
{services}---
{policy}"#,
        policy = egress_policy(namespace, true),
    )
}

/// The credential of the egress step: the value no workload may hold.
const CREDENTIAL_VALUE: &str = "sk-cluster-test-7f3a9c";

/// The egress step's HTTPS upstream and the credential bound to it: a throwaway CA and a
/// certificate for `upstream-tls.<namespace>.svc.cluster.local` (a Secret the upstream mounts),
/// the credential's Secret, a second upstream container serving HTTPS on 8443 and its Service;
/// and the policy additions (the credential, a rule that binds it and originates TLS trusting
/// the CA). Returns (objects, the policy's `credentials:` block, its rule).
fn credential_fixture(namespace: &str, image: &str) -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let host = format!("upstream-tls.{namespace}.svc.cluster.local");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().expect("key")).expect("a CA");
    let key = KeyPair::generate().expect("key");
    let leaf = CertificateParams::new(vec![host.clone()])
        .expect("params")
        .signed_by(&key, &ca)
        .expect("a certificate");
    let indent = |pem: &str, by: &str| pem.lines().map(|l| format!("{by}{l}\n")).collect::<String>();
    let objects = format!(
        r#"apiVersion: v1
kind: Secret
metadata:
  name: models
  namespace: {namespace}
stringData:
  token: {CREDENTIAL_VALUE}
---
apiVersion: v1
kind: Secret
metadata:
  name: upstream-tls
  namespace: {namespace}
stringData:
  tls.crt: |
{cert}  tls.key: |
{key}---
apiVersion: v1
kind: Pod
metadata:
  name: upstream-tls
  namespace: {namespace}
  labels:
    app: upstream-tls
    supervision.openshell.ai/inject: disabled
spec:
  securityContext:
    runAsNonRoot: true
    runAsUser: 65532
    seccompProfile:
      type: RuntimeDefault
  volumes:
    - name: tls
      secret:
        secretName: upstream-tls
  containers:
    - name: upstream
      image: {image}
      imagePullPolicy: Never
      command: ["/usr/local/bin/probe", "upstream", "--name", "models", "--listen", "0.0.0.0:8443", "--tls-cert", "/tls/tls.crt", "--tls-key", "/tls/tls.key"]
      volumeMounts:
        - name: tls
          mountPath: /tls
          readOnly: true
      securityContext:
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: ["ALL"]
---
apiVersion: v1
kind: Service
metadata:
  name: upstream-tls
  namespace: {namespace}
spec:
  selector:
    app: upstream-tls
  ports:
    - port: 8443
      targetPort: 8443
"#,
        cert = indent(&leaf.pem(), "    "),
        key = indent(&key.serialize_pem(), "    "),
    );
    let credentials = "  credentials:\n    - name: models\n      env: MODELS_API_KEY\n      secretKeyRef: {name: models, key: token}\n".to_owned();
    let rule = format!(
        "    - name: models\n      host: {host}\n      ports: [8443]\n      credential: models\n      originateTls: true\n      caBundle: |\n{}",
        indent(&ca.pem(), "        ")
    );
    (objects, credentials, rule)
}

/// The pool's gateway may read the Secret `models` of `namespace`, and no other.
fn credential_grant(namespace: &str, install: &str) -> String {
    format!(
        r#"apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: openshell-credentials
  namespace: {namespace}
rules:
  - apiGroups: [""]
    resources: ["secrets"]
    resourceNames: ["models"]
    verbs: ["get"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: openshell-credentials
  namespace: {namespace}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: openshell-credentials
subjects:
  - kind: ServiceAccount
    name: openshell-gateway
    namespace: {install}
"#
    )
}

/// The namespace's default policy, with or without the rule for `upstream-allowed`.
fn egress_policy(namespace: &str, with_allowed: bool) -> String {
    egress_policy_for(namespace, namespace, with_allowed)
}

/// `namespace`'s default policy for the upstream's Services in `upstream`.
fn egress_policy_for(namespace: &str, upstream: &str, with_allowed: bool) -> String {
    let allowed = if with_allowed {
        format!(
            "    - name: upstream\n      host: upstream-allowed.{upstream}.svc.cluster.local\n      ports: [8080]\n"
        )
    } else {
        String::new()
    };
    format!(
        r#"apiVersion: supervision.openshell.ai/v1alpha1
kind: SandboxPolicy
metadata:
  name: default
  namespace: {namespace}
spec:
  rules:
{allowed}    - name: docs
      host: upstream-readonly.{upstream}.svc.cluster.local
      ports: [8080]
      methods: [GET]
      pathPrefixes: [/docs/]
"#
    )
}

/// `kubectl` arguments that run `probe egress ARGS` in the agent container of `pod`.
fn probe_egress(namespace: &str, pod: &str, args: Vec<String>) -> Vec<String> {
    let mut all: Vec<String> = [
        "exec",
        "-n",
        namespace,
        pod,
        "-c",
        "agent",
        "--",
        "/usr/local/bin/probe",
        "egress",
    ]
    .iter()
    .map(|a| (*a).to_owned())
    .collect();
    all.extend(args);
    all
}

/// Owned arguments as `kubectl` takes them.
fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// An agent container as seen at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Agent {
    uid: String,
    restarts: u64,
    container_id: String,
    pid: Option<u32>,
}

/// One row of the measurement table.
struct Measured {
    scenario: &'static str,
    seconds: f64,
    gap_ms: u64,
    restarts: u64,
    /// Answers an agent got that were not `ok` (a refusal, a request lost with its owner).
    refused: u64,
}

/// Where a measured step starts from.
struct Baseline {
    agents: BTreeMap<String, Agent>,
    names: BTreeSet<String>,
    /// The member owning most of the test's instances.
    busiest: String,
    status: Status,
    from_ms: u64,
    t0: Instant,
}

struct Flow {
    kubectl: Kubectl,
    pool: Pool,
    install: String,
    /// The overlay installed now (a path `kubectl apply -k` takes).
    overlay: String,
    namespace: String,
    image: String,
    /// `OPENSHELL_E2E_ONLY`: run only the steps whose names contain one of these words.
    only: Option<String>,
    measured: Vec<Measured>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_user_flow_on_a_real_cluster() {
    if std::env::var("OPENSHELL_E2E_CLUSTER").as_deref() != Ok("1") {
        eprintln!("skipped: OPENSHELL_E2E_CLUSTER is not 1 (scripts/test-cluster runs this test)");
        return;
    }
    let mut flow = Flow::new(this_build_overlay(), std::env::var("OPENSHELL_E2E_ONLY").ok());
    let started = Instant::now();
    flow.step("install", Flow::install).await;
    flow.step("label a namespace and run agents", Flow::supervise).await;
    flow.step("another namespace's Pod acts for ours", Flow::cross_namespace)
        .await;
    flow.step("a workload reaches for its sidecar", Flow::sidecar_unreachable)
        .await;
    flow.step("Pod shapes: a root Pod, a Job that finishes", Flow::pod_shapes)
        .await;
    flow.step(
        "Pod shapes: UIDs, two containers, a private or the host's PID namespace, a CronJob",
        Flow::more_pod_shapes,
    )
    .await;
    flow.step("egress: a SandboxPolicy decides, through a handoff", Flow::egress)
        .await;
    flow.step(
        "egress redirection: a process that ignores the proxy",
        Flow::egress_redirected,
    )
    .await;
    flow.step("supervisor Pod force-deleted", Flow::supervisor_pod_deleted)
        .await;
    if node_local() {
        flow.step("supervisor process SIGKILLed on the node", Flow::supervisor_killed)
            .await;
    } else {
        eprintln!("skipped the SIGKILL step: the node's processes are not on this machine");
    }
    flow.step("coordinator gateway Pod deleted", Flow::coordinator_deleted)
        .await;
    if node_local() {
        flow.step(
            "database unreachable: the pool says Unknown",
            Flow::database_unreachable,
        )
        .await;
    }
    flow.step(
        "database Pod replaced with its data, then the gateways restarted",
        Flow::database_replaced,
    )
    .await;
    flow.step("poolctl drain", Flow::drain).await;
    flow.step(
        "SupervisorPoolOperation: dry run, drain, deletion cancels",
        Flow::declared_drain,
    )
    .await;
    flow.step("rollout restart of the supervisors", Flow::rollout).await;
    flow.step("StatefulSet Pod replaced", Flow::pod_replaced).await;
    flow.step("Deployment scaled down and up", Flow::scaled).await;
    flow.step("namespace label and token Secret", Flow::label_and_secret)
        .await;
    flow.step(
        "no member: missed deadline, unplaceable, supervised again",
        Flow::no_member,
    )
    .await;
    flow.step("uninstall", Flow::uninstall).await;
    flow.print_table(started.elapsed());
}

/// The overlay of this build's images (`OPENSHELL_E2E_OVERLAY`, default `kustomize/overlays/test`).
fn this_build_overlay() -> String {
    Flow::root_arg(&env_or("OPENSHELL_E2E_OVERLAY", "kustomize/overlays/test"))
}

impl Flow {
    fn new(overlay: String, only: Option<String>) -> Flow {
        let kubectl = Kubectl;
        let install = "openshell-supervision".to_owned();
        Flow {
            pool: Pool {
                kubectl: kubectl.clone(),
                namespace: install.clone(),
            },
            kubectl,
            install,
            overlay,
            namespace: format!("openshell-e2e-{}", std::process::id()),
            image: env_or("OPENSHELL_E2E_AGENT_IMAGE", "localhost/openshell/agent:dev"),
            only,
            measured: Vec::new(),
        }
    }

    /// Run one step; on failure dump the components' logs and fail with the step's name.
    async fn step<'a, F, Fut>(&'a mut self, name: &str, body: F)
    where
        F: FnOnce(&'a mut Flow) -> Fut,
        Fut: Future<Output = Result<(), Error>> + 'a,
    {
        // OPENSHELL_E2E_ONLY=a,b: only the steps whose names contain one of these, with the
        // install, the first agents and the uninstall they need (while working on a step).
        let needed = ["install", "label a namespace and run agents", "uninstall"];
        if let Some(only) = &self.only
            && !needed.contains(&name)
            && !only.split(',').any(|part| !part.is_empty() && name.contains(part))
        {
            eprintln!("== step: {name} (skipped: OPENSHELL_E2E_ONLY)");
            return;
        }
        eprintln!("== step: {name}");
        let started = Instant::now();
        let kubectl = self.kubectl.clone();
        let namespaces = [self.install.clone(), self.namespace.clone()];
        let overlay = self.overlay.clone();
        if let Err(err) = body(self).await {
            let dir = PathBuf::from(env_or("OPENSHELL_E2E_LOGS", "target/cluster-logs"));
            let namespaces: Vec<&str> = namespaces.iter().map(String::as_str).collect();
            dump_logs(&kubectl, &namespaces, &dir).await;
            // Leave a long-lived cluster as it was found (kube-node goes down anyway).
            let _ = kubectl
                .run(&["delete", "namespace", namespaces[1], "--wait=false"])
                .await;
            let _ = kubectl.run(&["delete", "-k", &overlay, "--wait=false"]).await;
            panic!(
                "step `{name}` failed after {:.1} s: {err}",
                started.elapsed().as_secs_f64()
            );
        }
        eprintln!("   ok ({:.1} s)", started.elapsed().as_secs_f64());
    }

    fn root_arg(path: &str) -> String {
        repo_root().join(path).display().to_string()
    }

    async fn install(&mut self) -> Result<(), Error> {
        // The install guide's commands as written (docs/install.md; INSTALL_GUIDE), with this
        // test's overlay.
        let overlay = self.overlay.clone();
        let namespace = self.namespace.clone();
        for command in &INSTALL_GUIDE[..3] {
            self.run_guide(command, &overlay, &namespace).await?;
        }
        for deployment in [
            "openshell-postgres",
            "openshell-gateway",
            "openshell-supervisor",
            "openshell-webhook",
        ] {
            self.rollout_status(deployment, "180s").await?;
        }
        // The coordinator has written the install's Secrets and members are attached.
        let pool = self.pool.clone();
        wait_for("a coordinator and two active members", 2 * MINUTE, || async {
            let status = pool.status().await.ok()?;
            let active = status.members.iter().filter(|m| m.state == "active").count();
            (status.coordinator.is_some() && active == 2).then_some(())
        })
        .await?;
        // The SupervisorPool object the coordinator keeps: `kubectl wait` for Ready works, and
        // `kubectl get supervisorpool` shows the pool healthy with both members.
        let (kubectl, install) = (&self.kubectl, self.install.as_str());
        wait_for("the SupervisorPool object", MINUTE, || async {
            kubectl
                .run(&["get", "supervisorpool/openshell", "-n", install])
                .await
                .ok()
                .map(drop)
        })
        .await?;
        self.kubectl
            .run(&[
                "wait",
                "--for=condition=Ready",
                "supervisorpool/openshell",
                "-n",
                install,
                "--timeout=60s",
            ])
            .await?;
        wait_for(
            "kubectl get supervisorpool: ready, not degraded, two members",
            MINUTE,
            || async {
                let table = kubectl.run(&["get", "supervisorpool", "-n", install]).await.ok()?;
                let row = table_row(&table, "openshell")?;
                let column = |name: &str| row.get(name).map(String::as_str);
                (column("READY") == Some("True")
                    && column("DEGRADED") == Some("False")
                    && column("MEMBERS") == Some("2/2"))
                .then_some(())
            },
        )
        .await
    }

    /// One of the install guide's commands ([`INSTALL_GUIDE`]): kubectl, or a script of the
    /// repository (run with the install namespace in `NAMESPACE`, from a scratch directory).
    async fn run_guide(&self, template: &str, overlay: &str, namespace: &str) -> Result<(), Error> {
        let words = guide_command(template, overlay, namespace);
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        if let ["kubectl", args @ ..] = words.as_slice() {
            return self.kubectl.run(args).await.map(drop);
        }
        let [script, args @ ..] = words.as_slice() else {
            return Err(Error::Check(format!("an empty install command: {template:?}")));
        };
        let out = tokio::process::Command::new(Self::root_arg(script))
            .args(args)
            .env("NAMESPACE", &self.install)
            .current_dir(std::env::temp_dir())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(MINUTE, out)
            .await
            .map_err(|_| Error::Check(format!("{script} did not finish within a minute")))??;
        check(out.status.success(), || {
            format!("{script} failed: {}", String::from_utf8_lossy(&out.stderr))
        })
    }

    async fn rollout_status(&self, deployment: &str, timeout: &str) -> Result<(), Error> {
        let target = format!("deployment/{deployment}");
        let timeout = format!("--timeout={timeout}");
        self.kubectl
            .run(&["rollout", "status", &target, "-n", &self.install, &timeout])
            .await
            .map(drop)
    }

    async fn supervise(&mut self) -> Result<(), Error> {
        let ns = self.namespace.clone();
        // The install guide's last two commands (docs/install.md; INSTALL_GUIDE).
        for command in &INSTALL_GUIDE[3..] {
            self.run_guide(command, "", &ns).await?;
        }
        self.secret_present(true).await?;
        self.kubectl.apply(&workloads(&ns, &self.image)).await?;
        for target in ["deployment/counter", "statefulset/ledger"] {
            self.kubectl
                .run(&["rollout", "status", target, "-n", &ns, "--timeout=180s"])
                .await?;
        }
        let pods = self.agent_pods().await?;
        check(pods.len() == 5, || format!("5 agent Pods, found {pods:?}"))?;
        for name in pods.keys() {
            let pod = self.kubectl.json(&["get", "pod", name, "-n", &ns]).await?;
            let sidecar = pod
                .pointer("/spec/initContainers")
                .and_then(Value::as_array)
                .and_then(|c| c.iter().find(|c| c["name"] == "openshell-sidecar"));
            check(
                sidecar.and_then(|s| s.get("restartPolicy")) == Some(&Value::from("Always")),
                || format!("{name}: the sidecar is injected as a native sidecar: {pod}"),
            )?;
            check(
                pod.pointer("/metadata/labels/supervision.openshell.ai~1supervised") == Some(&Value::from("true")),
                || format!("{name}: the supervised label is set"),
            )?;
        }
        self.all_settled(&pods.keys().cloned().collect(), 2 * MINUTE).await?;
        for name in pods.keys() {
            self.event(name, "InstancePlaced").await?;
        }
        // The workload connects after its instance was activated (a native sidecar starts
        // first): its PID still reaches the status.
        let pool = self.pool.clone();
        wait_for("every workload's PID in the status", MINUTE, || async {
            let status = pool.status().await.ok()?;
            let mine = status.of(&ns);
            (mine.len() == 5 && mine.iter().all(|i| i.workload_pid != 0)).then_some(())
        })
        .await
    }

    /// The agent Pods of the test namespace: name → agent container state.
    /// A lone Pod `name` in `ns` whose workload never talks to the socket, applied and
    /// supervised as its container's main process: its PID.
    async fn silent_supervised(&self, ns: &str, name: &str) -> Result<u32, Error> {
        let silent = lone_pod(ns, name, &self.image)
            .replace(r#""--interval-ms", "100"]"#, r#""--interval-ms", "100", "--silent"]"#);
        self.kubectl.apply(&silent).await?;
        let pool = self.pool.clone();
        wait_for(
            &format!("the silent workload {name} supervised with its PID"),
            2 * MINUTE,
            || async {
                let status = pool.status().await.ok()?;
                let silent = status.of(ns).into_iter().find(|i| i.name == name)?;
                (silent.settled() && silent.workload_pid != 0).then_some(silent.workload_pid)
            },
        )
        .await
    }

    async fn agent_pods(&self) -> Result<BTreeMap<String, Agent>, Error> {
        let list = self.kubectl.json(&["get", "pods", "-n", &self.namespace]).await?;
        let mut out = BTreeMap::new();
        for pod in list["items"].as_array().into_iter().flatten() {
            if pod.pointer("/metadata/deletionTimestamp").is_some() {
                continue;
            }
            let name = pod
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let Some(agent) = pod
                .pointer("/status/containerStatuses")
                .and_then(Value::as_array)
                .and_then(|s| s.iter().find(|c| c["name"] == "agent"))
            else {
                continue;
            };
            let log = self
                .kubectl
                .run(&["logs", "-n", &self.namespace, name, "-c", "agent"])
                .await?;
            out.insert(
                name.to_owned(),
                Agent {
                    uid: pod
                        .pointer("/metadata/uid")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned(),
                    restarts: agent["restartCount"].as_u64().unwrap_or(0),
                    container_id: agent["containerID"].as_str().unwrap_or_default().to_owned(),
                    pid: agent_log::parse(&log).pid,
                },
            );
        }
        Ok(out)
    }

    /// Every Pod of `names` has a settled instance; returns the status.
    async fn all_settled(&self, names: &BTreeSet<String>, limit: Duration) -> Result<Status, Error> {
        let pool = self.pool.clone();
        let ns = self.namespace.clone();
        poll("every agent's instance active under an owner", limit, FINE, || async {
            let status = pool.status().await.ok()?;
            let settled: BTreeSet<String> = status
                .of(&ns)
                .into_iter()
                .filter(|i| i.settled())
                .map(|i| i.name.clone())
                .collect();
            names.is_subset(&settled).then_some(status)
        })
        .await
    }

    async fn event(&self, pod: &str, reason: &str) -> Result<Value, Error> {
        self.event_in(&self.namespace, pod, reason).await
    }

    /// The first `reason` Event on the object `name` of `namespace`, once there is one.
    /// Job `job`'s Pod supervised with its PID while it runs, then, once the Job succeeded, a
    /// `WorkloadFinished` Event and its instance out of the pool: the Pod's name.
    async fn job_supervised_until_it_finishes(&self, ns: &str, job: &str) -> Result<String, Error> {
        let prefix = format!("{job}-");
        let pod = wait_for(
            &format!("Job {job}'s Pod supervised with its PID"),
            2 * MINUTE,
            || async {
                let status = self.pool.status().await.ok()?;
                let i = status.of(ns).into_iter().find(|i| i.name.starts_with(&prefix))?;
                (i.settled() && i.workload_pid != 0).then(|| i.name.clone())
            },
        )
        .await?;
        eprintln!("   {pod}: supervised; waiting for the Job to finish");
        wait_for(&format!("Job {job} complete"), 2 * MINUTE, || async {
            let found = self.kubectl.json(&["get", "job", job, "-n", ns]).await.ok()?;
            (found.pointer("/status/succeeded") == Some(&Value::from(1))).then_some(())
        })
        .await?;
        self.event_in(ns, &pod, "WorkloadFinished").await?;
        let status = self.pool.status().await?;
        check(!status.of(ns).iter().any(|i| i.name == pod), || {
            format!("the finished Pod's instance left the pool: {:?}", status.of(ns))
        })?;
        Ok(pod)
    }

    /// Pod `name` of `namespace` once it runs.
    async fn running_pod(&self, namespace: &str, name: &str) -> Result<Value, Error> {
        wait_for(&format!("Pod {name} running"), 2 * MINUTE, || async {
            let pod = self.kubectl.json(&["get", "pod", name, "-n", namespace]).await.ok()?;
            (pod.pointer("/status/phase") == Some(&Value::from("Running"))).then_some(pod)
        })
        .await
    }

    async fn event_in(&self, namespace: &str, name: &str, reason: &str) -> Result<Value, Error> {
        let what = format!("a {reason} Event on {name}");
        wait_for(&what, MINUTE, || async {
            events(&self.kubectl, namespace, name, reason)
                .await
                .ok()?
                .first()
                .cloned()
        })
        .await
    }

    /// The agents kept running through a step that began with `before`: same container, no
    /// restart, same PID, and counters that kept counting. Returns the longest gap between
    /// accepted reports in the window and the restarts seen.
    /// The agents and the pool before a measured step, all settled; the clock starts here.
    async fn baseline(&self) -> Result<Baseline, Error> {
        let agents = self.agent_pods().await?;
        let names: BTreeSet<String> = agents.keys().cloned().collect();
        let status = self.all_settled(&names, MINUTE).await?;
        let mut load: BTreeMap<&str, usize> = BTreeMap::new();
        for instance in status.of(&self.namespace) {
            *load.entry(instance.owner.as_str()).or_default() += 1;
        }
        let busiest = load
            .into_iter()
            .max_by_key(|(_, n)| *n)
            .map(|(m, _)| m.to_owned())
            .ok_or_else(|| Error::Check("no instance has an owner".into()))?;
        Ok(Baseline {
            agents,
            names,
            busiest,
            status,
            from_ms: now_ms(),
            t0: Instant::now(),
        })
    }

    /// The agents kept running through the step that began at `base`: same container, no
    /// restart, same PID, counters that kept counting and no answer from a fenced owner.
    /// Records the step's time with the longest gap between accepted reports in it.
    async fn survived(&mut self, scenario: &'static str, seconds: f64, base: &Baseline) -> Result<(), Error> {
        let after = self.agent_pods().await?;
        let mut restarts = 0;
        let mut gap = 0;
        let mut refused = 0;
        for (name, was) in &base.agents {
            let Some(now) = after.get(name) else {
                return Err(Error::Check(format!("agent Pod {name} is gone")));
            };
            restarts += now.restarts.saturating_sub(was.restarts);
            check(now == was, || {
                format!("agent {name} restarted or changed: before {was:?}, after {now:?}")
            })?;
            if name == SILENT {
                continue; // same process; it has no counter
            }
            let ns = self.namespace.clone();
            let kubectl = self.kubectl.clone();
            let since = now_ms();
            let observed = wait_for(&format!("{name} counting again after the step"), MINUTE, || async {
                let log = kubectl.run(&["logs", "-n", &ns, name, "-c", "agent"]).await.ok()?;
                let observed = agent_log::parse(&log);
                (observed.last_at_ms() > since).then_some(observed)
            })
            .await?;
            check(observed.continuous(), || {
                format!("agent {name}'s counter went backwards")
            })?;
            check(observed.dual_owner_violations() == 0, || {
                format!("agent {name} was answered by a fenced owner")
            })?;
            gap = gap.max(observed.max_gap_ms(base.from_ms, observed.last_at_ms()));
            refused += observed.refused_between(base.from_ms, observed.last_at_ms());
        }
        eprintln!(
            "   measured: {scenario}: {seconds:.2} s, longest counter gap {gap} ms, restarts {restarts}, \
             answers refused {refused}"
        );
        self.measured.push(Measured {
            scenario,
            seconds,
            gap_ms: gap,
            restarts,
            refused,
        });
        Ok(())
    }

    /// [`Self::survived`] a step where no member died: a planned move, the coordinator or the
    /// database replaced. No agent's request may fail in it (in a member's crash, one in
    /// flight to it may: the sidecar fails it rather than replay it).
    async fn survived_untouched(&mut self, scenario: &'static str, seconds: f64, base: &Baseline) -> Result<(), Error> {
        self.survived(scenario, seconds, base).await?;
        let refused = self.measured.last().map_or(0, |m| m.refused);
        check(refused == 0, || {
            format!("{scenario}: {refused} agent requests were refused or lost (see the agents' logs)")
        })
    }

    /// Wait until every agent is settled on a member other than `gone`; seconds since `t0`.
    async fn settled_away_from(&self, names: &BTreeSet<String>, gone: &str, t0: Instant) -> Result<f64, Error> {
        let pool = self.pool.clone();
        let ns = self.namespace.clone();
        poll(
            &format!("every instance active off {gone}"),
            2 * MINUTE,
            FINE,
            || async {
                let status = pool.status().await.ok()?;
                let mine = status.of(&ns);
                let ok = names
                    .iter()
                    .all(|n| mine.iter().any(|i| &i.name == n && i.settled() && i.owner != gone));
                ok.then(|| t0.elapsed().as_secs_f64())
            },
        )
        .await
    }

    async fn member_active(&self, member: &str, limit: Duration) -> Result<(), Error> {
        let pool = self.pool.clone();
        wait_for(&format!("member {member} active"), limit, || async {
            let status = pool.status().await.ok()?;
            status
                .members
                .iter()
                .any(|m| m.name == member && m.state == "active")
                .then_some(())
        })
        .await
    }

    async fn supervisor_pod_deleted(&mut self) -> Result<(), Error> {
        let base = self.baseline().await?;
        let victim = base.busiest.clone();
        let moved: Vec<String> = base
            .status
            .of(&self.namespace)
            .iter()
            .filter(|i| i.owner == victim)
            .map(|i| i.name.clone())
            .collect();
        let args = [
            "delete",
            "pod",
            &victim,
            "-n",
            &self.install,
            "--grace-period=0",
            "--force",
        ];
        self.kubectl.run(&args).await?;
        let seconds = self.settled_away_from(&base.names, &victim, base.t0).await?;
        for name in &moved {
            self.event(name, "InstanceRecovered").await?;
        }
        self.survived(
            "supervisor Pod force-deleted → its instances active elsewhere",
            seconds,
            &base,
        )
        .await?;
        self.rollout_status("openshell-supervisor", "120s").await
    }

    async fn supervisor_killed(&mut self) -> Result<(), Error> {
        let base = self.baseline().await?;
        let victim = base.busiest.clone();
        let pid = supervisor_process(&victim)
            .await
            .ok_or_else(|| Error::Check(format!("no supervisor process of member {victim} on this node")))?;
        let t0 = Instant::now();
        signal(pid, nix::sys::signal::Signal::SIGKILL)?;
        let seconds = self.settled_away_from(&base.names, &victim, t0).await?;
        self.survived(
            "supervisor process SIGKILLed → its instances active elsewhere",
            seconds,
            &base,
        )
        .await?;
        // The kubelet restarts the container: the same member name, a new process, which
        // must be admitted again (its dead predecessor's stream must not refuse it).
        self.member_active(&victim, 2 * MINUTE).await?;
        self.rollout_status("openshell-supervisor", "120s").await
    }

    async fn coordinator_deleted(&mut self) -> Result<(), Error> {
        let base = self.baseline().await?;
        let old = base
            .status
            .coordinator
            .clone()
            .ok_or_else(|| Error::Check("no coordinator".into()))?;
        let args = [
            "delete",
            "pod",
            old.replica(),
            "-n",
            &self.install,
            "--grace-period=0",
            "--force",
        ];
        self.kubectl.run(&args).await?;
        let pool = self.pool.clone();
        let (elected, term) = poll("a new coordinator at a higher term", 2 * MINUTE, FINE, || async {
            let now = pool.status().await.ok()?.coordinator?;
            (now.term > old.term && now.replica() != old.replica()).then(|| (base.t0.elapsed().as_secs_f64(), now.term))
        })
        .await?;
        self.all_settled(&base.names, MINUTE).await?;
        // The first fenced write of the new term, as the database recorded it (dev overlay:
        // PostgreSQL runs in the install namespace; same clock as this machine's).
        let query = format!("select started_at_ms from coordinator_terms where term = {term}");
        let first_write = match self.sql(&query).await {
            Ok(out) => out.trim().parse::<u64>().ok(),
            Err(err) => {
                eprintln!("   (cannot read the term's first fenced write: {err})");
                None
            }
        };
        if let Some(at_ms) = first_write {
            let seconds = at_ms.saturating_sub(base.from_ms) as f64 / 1000.0;
            self.survived_untouched(
                "coordinator Pod force-deleted → first fenced write of the next term",
                seconds,
                &base,
            )
            .await?;
        } else {
            self.survived_untouched(
                "coordinator Pod force-deleted → new coordinator (term + 1)",
                elected,
                &base,
            )
            .await?;
        }
        self.rollout_status("openshell-gateway", "120s").await
    }

    /// The rows of `query` as the database of the dev overlay answers it (`psql -At`: one line
    /// a row, columns separated by `|`).
    async fn sql(&self, query: &str) -> Result<String, Error> {
        let args = [
            "exec",
            "-n",
            &self.install,
            "deploy/openshell-postgres",
            "--",
            "psql",
            "-U",
            "openshell",
            "-d",
            "openshell",
            "-At",
            "-c",
            query,
        ];
        self.kubectl.run(&args).await
    }

    async fn drain(&mut self) -> Result<(), Error> {
        // The dry run first: every instance of the member planned, nothing recorded. Right
        // after the database step the members may still be attaching again (their records
        // lapsed during the outage), and a dry run then rightly says the drain would not
        // finish (exit 4): ask again until the pool can take it.
        let started = Instant::now();
        let base = loop {
            let base = self.baseline().await?;
            let member = base.busiest.clone();
            let held = base.status.instances.iter().filter(|i| i.owner == member).count();
            let args = [
                "drain",
                member.as_str(),
                "--max-parallel",
                "2",
                "--dry-run",
                "-o",
                "json",
            ];
            let planned = match self.pool.poolctl(&args).await {
                Ok(planned) => planned,
                Err(err) => err.to_string(),
            };
            let plan: Value = serde_json::from_str(&planned).unwrap_or_default();
            if plan["completes"] == true && plan["moves"].as_array().map(Vec::len) == Some(held) {
                break base;
            }
            check(started.elapsed() < MINUTE, || {
                format!("the dry run plans all {held} instances of {member}: {planned}")
            })?;
            tokio::time::sleep(FINE).await;
        };
        let member = base.busiest.clone();
        let thief = self.grant_thief(&base, &member).await?;
        // On a node of this machine the other member is paused while the drain reserves its
        // terms, so the thief asks for them before their rightful member can.
        let paused = match (node_local(), base.status.members.iter().find(|m| m.name != member)) {
            (true, Some(other)) => supervisor_process(&other.name).await,
            _ => None,
        };
        if let Some(pid) = paused {
            signal(pid, nix::sys::signal::Signal::SIGSTOP)?;
            let started = self.pool.poolctl(&["drain", &member, "--max-parallel", "2"]).await;
            let reserved = match started {
                Ok(_) => self.thief_saw_reservations(&base, &member, &thief).await,
                Err(err) => Err(err),
            };
            signal(pid, nix::sys::signal::Signal::SIGCONT)?;
            reserved?;
        }
        let out = self
            .pool
            .poolctl(&["drain", &member, "--max-parallel", "2", "--wait"])
            .await?;
        let seconds = base.t0.elapsed().as_secs_f64();
        let after = self.pool.status().await?;
        check(after.instances.iter().all(|i| i.owner != member), || {
            format!("nothing left on {member} after the drain: {after:?}")
        })?;
        self.all_settled(&base.names, MINUTE).await?;
        self.grant_thief_refused(&thief).await?;
        self.survived_untouched("poolctl drain of a member (max-parallel 2)", seconds, &base)
            .await?;
        // Return the member to service.
        let id = operation_id(&out)?;
        self.pool.poolctl(&["cancel", id]).await?;
        self.member_active(&member, MINUTE).await?;
        self.one_build_everywhere().await
    }

    /// Every gateway replica, member and sidecar reports the build of this run's images (the
    /// release with its commit), and nothing is outside the compatibility policy.
    async fn one_build_everywhere(&self) -> Result<(), Error> {
        let status = self.pool.status().await?;
        let versions: BTreeSet<&str> = status.builds.iter().map(|b| b.version.as_str()).collect();
        let components: BTreeSet<&str> = status.builds.iter().map(|b| b.component.as_str()).collect();
        check(
            components == ["gateway", "member", "sidecar"].into_iter().collect()
                && versions.len() == 1
                && versions.iter().all(|v| v.contains('+')),
            || {
                format!(
                    "every part reports the one build of this run, with its commit: {:?}",
                    status.builds
                )
            },
        )?;
        check(status.build_warnings.is_empty(), || {
            format!("no build outside the policy: {:?}", status.build_warnings)
        })?;
        println!(
            "builds: {} parts, all {}",
            status.builds.len(),
            versions.iter().next().copied().unwrap_or_default()
        );
        Ok(())
    }

    /// Before the drain of `member`: a Pod of an unlabelled namespace gets a token of the
    /// supervisor ServiceAccount bound to `member`'s Pod (what a compromised member holds) and
    /// the pool's CA, and asks for the grant of every next term of `member`'s instances —
    /// which the drain reserves for the other member — naming the other member's process id
    /// (every member reads it in its route directory), as itself and as the other member.
    /// Returns the thief's namespace once it is asking.
    async fn grant_thief(&self, base: &Baseline, member: &str) -> Result<String, Error> {
        let others: Vec<&e2e::cluster::Member> = base.status.members.iter().filter(|m| m.name != member).collect();
        let Some(other) = others.first() else {
            return Err(Error::Check(format!(
                "a member besides {member}: {:?}",
                base.status.members
            )));
        };
        let pod = self.kubectl.json(&["get", "pod", member, "-n", &self.install]).await?;
        let account = pod
            .pointer("/spec/serviceAccountName")
            .and_then(Value::as_str)
            .unwrap_or("openshell-supervisor")
            .to_owned();
        let token = self
            .kubectl
            .run(&[
                "create",
                "token",
                &account,
                "-n",
                &self.install,
                "--audience",
                "openshell-gateway",
                "--bound-object-kind",
                "Pod",
                "--bound-object-name",
                member,
                "--duration",
                "10m",
            ])
            .await?;
        let ca = self
            .kubectl
            .json(&["get", "secret", SECRET, "-n", &self.namespace])
            .await?
            .pointer("/data/ca.crt")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let namespace = format!("{}-thief", self.namespace);
        self.kubectl.run(&["create", "namespace", &namespace]).await?;
        // stdin, not the command line: the token is a credential.
        let secret = format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: thief\n  namespace: {namespace}\ndata:\n  ca.crt: {ca}\nstringData:\n  token: {}\n",
            token.trim()
        );
        self.kubectl.apply(&secret).await?;
        let mut args: Vec<String> = vec!["--member".into(), member.into(), "--as".into(), other.name.clone()];
        for m in &base.status.members {
            args.extend(["--process".into(), m.process_id.clone()]);
        }
        for i in base.status.instances.iter().filter(|i| i.owner == member) {
            args.extend(["--route".into(), format!("{}={}", i.route, i.term)]);
        }
        let manifest = thief_pod(&namespace, &self.image, &args);
        let kubectl = self.kubectl.clone();
        wait_for("the thief Pod created", MINUTE, || async {
            kubectl.apply(&manifest).await.ok()
        })
        .await?;
        wait_for("the thief asking", MINUTE, || async {
            let log = kubectl.run(&["logs", "thief", "-n", &namespace]).await.ok()?;
            log.contains("probe grant: started").then_some(())
        })
        .await?;
        Ok(namespace)
    }

    /// With the drain started and the other member paused: waits until the pool shows a term
    /// of `member`'s instances reserved, then for two more of the thief's rounds.
    async fn thief_saw_reservations(&self, base: &Baseline, member: &str, namespace: &str) -> Result<(), Error> {
        let pool = self.pool.clone();
        poll(
            "a term of the drained member's instances reserved",
            MINUTE,
            FINE,
            || async {
                let now = pool.status().await.ok()?;
                now.instances
                    .iter()
                    .any(|i| {
                        i.reserved
                            && base
                                .status
                                .instances
                                .iter()
                                .any(|b| b.route == i.route && b.owner == member && i.term > b.term)
                    })
                    .then_some(())
            },
        )
        .await?;
        let kubectl = self.kubectl.clone();
        let rounds = || async {
            let log = kubectl.run(&["logs", "thief", "-n", namespace]).await.ok()?;
            Some(log.lines().filter(|l| l.starts_with("probe grant: round ")).count())
        };
        let seen: usize = rounds().await.unwrap_or(0);
        wait_for("two more rounds of the thief", MINUTE, || async {
            rounds().await.filter(|n| *n >= seen + 2).map(|_| ())
        })
        .await
    }

    /// After the drain: the thief got no grant (every answer a refusal), and asked enough.
    async fn grant_thief_refused(&self, namespace: &str) -> Result<(), Error> {
        let kubectl = self.kubectl.clone();
        let done = wait_for("the thief Pod finished", 2 * MINUTE, || async {
            let pod = kubectl.json(&["get", "pod", "thief", "-n", namespace]).await.ok()?;
            let phase = pod.pointer("/status/phase").and_then(Value::as_str)?.to_owned();
            matches!(phase.as_str(), "Succeeded" | "Failed").then_some(phase)
        })
        .await?;
        let log = self.kubectl.run(&["logs", "thief", "-n", namespace]).await?;
        let answers: Vec<&str> = log.lines().filter(|l| l.starts_with("probe call=")).collect();
        eprintln!("   thief ({done}):\n      {}", answers.join("\n      "));
        let asked: u64 = answers
            .iter()
            .filter_map(|a| a.rsplit_once("count=").and_then(|(_, n)| n.parse::<u64>().ok()))
            .sum();
        check(done == "Succeeded" && asked > 0, || {
            format!("the thief asked for grants: {done}, log:\n{log}")
        })?;
        check(!answers.iter().any(|a| a.contains("code=Ok ")), || {
            format!("no grant goes to a member it was not reserved for:\n{log}")
        })?;
        // Refused as the member it is (the credential was accepted), not as a stranger.
        check(
            !answers
                .iter()
                .any(|a| a.contains("claim=self") && a.contains("code=Unauthenticated")),
            || format!("the thief's credential is a member's, accepted as such:\n{log}"),
        )?;
        self.kubectl
            .run(&["delete", "namespace", namespace, "--wait=false"])
            .await?;
        Ok(())
    }

    /// The GitOps door to the same operations: a `SupervisorPoolOperation` dry run (moves
    /// listed, nothing recorded or moved), a drain applied with `kubectl apply` (Succeeded,
    /// nothing left on the member, no agent restarted), and a running drain cancelled by
    /// deleting its object. That drain is of the other member while the first stays drained:
    /// with two members it has nowhere to move anything, so it is Running (waiting) until
    /// cancelled, whatever the timing; a third, with a 3 s deadline, fails, and `kubectl wait`
    /// for `Succeeded` does not return for it. Deleting the first object puts its member back.
    async fn declared_drain(&mut self) -> Result<(), Error> {
        let base = self.baseline().await?;
        // A finished Job Pod (of the Pod-shapes step, when it ran) is no instance to move.
        let shapes = format!("{}-shapes", self.namespace);
        let finished = self
            .kubectl
            .run(&[
                "get",
                "pods",
                "-n",
                &shapes,
                "--field-selector=status.phase=Succeeded",
                "-o",
                "name",
            ])
            .await
            .unwrap_or_default();
        check(base.status.of(&shapes).is_empty(), || {
            format!(
                "no instance of the finished Pods {finished:?} is in the pool: {:?}",
                base.status
            )
        })?;
        let member = base.busiest.clone();
        let owned = |status: &Status, m: &str| -> BTreeSet<String> {
            status
                .instances
                .iter()
                .filter(|i| i.owner == m)
                .map(|i| i.route.clone())
                .collect()
        };
        let held = owned(&base.status, &member);
        let requested_by = |name: &str| format!("SupervisorPoolOperation {}/{name}", self.install);

        // The dry run: every instance of the member planned away from it, nothing recorded.
        self.kubectl
            .apply(&pool_operation(&self.install, "plan-drain", &member, true))
            .await?;
        let planned = self.pool_operation_status("plan-drain", "Planned").await?;
        // Ended, and not succeeded: a dry run did nothing.
        check(
            condition_of(&planned, "Complete").is_some_and(|(s, _)| s == "True")
                && condition_of(&planned, "Succeeded") == Some(("False".into(), "Planned".into())),
            || format!("a dry run is Complete=True, Succeeded=False (Planned): {planned}"),
        )?;
        let moves = planned["planned"].as_array().cloned().unwrap_or_default();
        let routes: BTreeSet<String> = moves
            .iter()
            .filter_map(|m| m["instance"].as_str().map(str::to_owned))
            .collect();
        check(
            routes == held
                && moves
                    .iter()
                    .all(|m| m["from"] == member.as_str() && m["to"] != member.as_str()),
            || format!("the dry run plans all of {member}'s instances {held:?} away: {planned}"),
        )?;
        let now = self.pool.status().await?;
        check(owned(&now, &member) == held, || {
            format!("a dry run moved nothing: {now:?}")
        })?;
        check(
            !now.operations
                .iter()
                .any(|o| o.requested_by == requested_by("plan-drain")),
            || format!("a dry run records no operation: {:?}", now.operations),
        )?;
        self.kubectl
            .run(&["delete", "spoolop", "plan-drain", "-n", &self.install, "--timeout=60s"])
            .await?;

        // Specs no coordinator would take are refused by `kubectl apply` itself (the CRD's
        // schema), and nothing is created.
        self.refused_at_apply(&member).await?;

        // The drain, applied; `kubectl wait --for=condition=Succeeded`, as the docs say.
        self.kubectl
            .apply(&pool_operation(&self.install, "drain-member", &member, false))
            .await?;
        self.kubectl
            .run(&[
                "wait",
                "--for=condition=Succeeded",
                "spoolop/drain-member",
                "-n",
                &self.install,
                "--timeout=120s",
            ])
            .await?;
        let done = self.pool_operation_status("drain-member", "Succeeded").await?;
        check(
            condition_of(&done, "Succeeded") == Some(("True".into(), "Succeeded".into()))
                && condition_of(&done, "Complete").is_some_and(|(s, _)| s == "True"),
            || format!("a succeeded drain is Succeeded=True, Complete=True: {done}"),
        )?;
        let seconds = base.t0.elapsed().as_secs_f64();
        let after = self.pool.status().await?;
        check(owned(&after, &member).is_empty(), || {
            format!("nothing left on {member}: {after:?}")
        })?;
        let total = held.len().to_string();
        check(done["moves"] == format!("{total}/{total}").as_str(), || {
            format!("{total} moves done: {done}")
        })?;
        let uid = self
            .kubectl
            .json(&["get", "spoolop", "drain-member", "-n", &self.install])
            .await?
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        check(done["operationId"] == uid.as_str(), || {
            format!("the operation id is the object's UID {uid}: {done}")
        })?;
        for reason in ["Started", "Succeeded"] {
            self.event_in(&self.install, "drain-member", reason).await?;
        }
        let listed = self.kubectl.run(&["get", "spoolop", "-n", &self.install]).await?;
        eprintln!("{listed}");
        let row = table_row(&listed, "drain-member").unwrap_or_default();
        check(
            row.get("PHASE").map(String::as_str) == Some("Succeeded")
                && row.get("SUCCEEDED").map(String::as_str) == Some("True"),
            || format!("kubectl get spoolop shows drain-member Succeeded, SUCCEEDED True: {listed}"),
        )?;
        self.all_settled(&base.names, MINUTE).await?;
        self.survived_untouched("SupervisorPoolOperation drain applied (max-parallel 2)", seconds, &base)
            .await?;

        // A running drain, deleted: its durable operation is cancelled and the object goes.
        let other = after
            .members
            .iter()
            .find(|m| m.name != member && m.state == "active")
            .map(|m| m.name.clone())
            .ok_or_else(|| Error::Check(format!("no active member besides {member}: {after:?}")))?;
        self.kubectl
            .apply(&pool_operation(&self.install, "drain-other", &other, false))
            .await?;
        let running = self.pool_operation_status("drain-other", "Running").await?;
        check(
            condition_of(&running, "Succeeded") == Some(("Unknown".into(), "Running".into()))
                && condition_of(&running, "Complete").is_some_and(|(s, _)| s == "False"),
            || format!("a running drain is Succeeded=Unknown (Running), Complete=False: {running}"),
        )?;
        let id = running["operationId"].as_str().unwrap_or_default().to_owned();
        let object = self
            .kubectl
            .json(&["get", "spoolop", "drain-other", "-n", &self.install])
            .await?;
        check(
            object.pointer("/metadata/finalizers/0") == Some(&Value::from("supervision.openshell.ai/operation")),
            || format!("a started operation's object carries the finalizer: {object}"),
        )?;
        self.kubectl
            .run(&["delete", "spoolop", "drain-other", "-n", &self.install, "--timeout=60s"])
            .await?;
        let pool = self.pool.clone();
        wait_for(&format!("operation {id} cancelled"), MINUTE, || async {
            let status = pool.status().await.ok()?;
            status
                .operations
                .iter()
                .any(|o| o.id == id && o.phase == "cancelled")
                .then_some(())
        })
        .await?;
        self.event_in(&self.install, "drain-other", "Cancelled").await?;
        let left = self.pool.status().await?;
        check(left.of(&self.namespace).iter().all(|i| i.owner == other), || {
            format!("the cancelled drain moved nothing: {left:?}")
        })?;

        // A drain that fails (nowhere to move, its deadline passes): `kubectl wait` for
        // `Complete` returns, for `Succeeded` it does not — a script that waits as the docs say
        // never takes a failure for success.
        let mut late: Value = serde_json::from_str(&pool_operation(&self.install, "drain-late", &other, false))
            .map_err(|e| Error::Check(e.to_string()))?;
        late["spec"]["timeoutSeconds"] = 3.into();
        self.kubectl.apply(&late.to_string()).await?;
        let wait = |condition: &'static str, timeout: &'static str| {
            let install = self.install.clone();
            let kubectl = self.kubectl.clone();
            async move {
                kubectl
                    .run(&["wait", condition, "spoolop/drain-late", "-n", &install, timeout])
                    .await
            }
        };
        wait("--for=condition=Complete", "--timeout=120s").await?;
        check(wait("--for=condition=Succeeded", "--timeout=5s").await.is_err(), || {
            "kubectl wait --for=condition=Succeeded returns for a failed drain".to_owned()
        })?;
        let failed = self.pool_operation_status("drain-late", "Failed").await?;
        check(
            condition_of(&failed, "Succeeded").is_some_and(|(s, r)| s == "False" && r == "Failed"),
            || format!("a failed drain is Succeeded=False (Failed): {failed}"),
        )?;
        self.event_in(&self.install, "drain-late", "Failed").await?;
        self.kubectl
            .run(&["delete", "spoolop", "drain-late", "-n", &self.install, "--timeout=60s"])
            .await?;

        // Deleting the succeeded drain's object puts the member back in service.
        self.kubectl
            .run(&[
                "delete",
                "spoolop",
                "drain-member",
                "-n",
                &self.install,
                "--timeout=60s",
            ])
            .await?;
        if !finished.trim().is_empty() {
            eprintln!("   drained beside a finished Job Pod: {}", finished.trim());
        }
        self.kubectl
            .run(&["delete", "namespace", &shapes, "--ignore-not-found", "--wait=false"])
            .await?;
        self.member_active(&member, MINUTE).await
    }

    /// `kubectl apply` refuses a `SupervisorPoolOperation` the coordinator would refuse
    /// whatever the pool — maxParallel above 8, timeoutSeconds above 86400, an unknown kind, a
    /// rebalance naming a member, a drain naming none — with the field or rule in its error,
    /// and no object is left.
    async fn refused_at_apply(&self, member: &str) -> Result<(), Error> {
        let cases = [
            (
                serde_json::json!({ "kind": "Drain", "member": member, "maxParallel": 9 }),
                "maxParallel",
            ),
            (
                serde_json::json!({ "kind": "Drain", "member": member, "timeoutSeconds": 86_401 }),
                "timeoutSeconds",
            ),
            (serde_json::json!({ "kind": "Evict", "member": member }), "spec.kind"),
            (
                serde_json::json!({ "kind": "Rebalance", "member": member }),
                "a rebalance takes no member",
            ),
            (
                serde_json::json!({ "kind": "Drain" }),
                "a drain names the member to drain",
            ),
        ];
        for (spec, field) in cases {
            let object = serde_json::json!({
                "apiVersion": "supervision.openshell.ai/v1alpha1",
                "kind": "SupervisorPoolOperation",
                "metadata": { "name": "refused", "namespace": self.install },
                "spec": spec,
            });
            match self.kubectl.apply(&object.to_string()).await {
                Err(Error::Failed { stderr, .. }) if stderr.contains(field) => {}
                other => {
                    return Err(Error::Check(format!(
                        "kubectl apply of {spec} is refused naming {field}: {other:?}"
                    )));
                }
            }
        }
        let left = self
            .kubectl
            .run(&[
                "get",
                "spoolop",
                "refused",
                "-n",
                &self.install,
                "--ignore-not-found",
                "-o",
                "name",
            ])
            .await?;
        check(left.trim().is_empty(), || {
            format!("a refused spec leaves no object: {left}")
        })
    }

    /// The status of the `SupervisorPoolOperation` `name` once its phase is `phase`.
    async fn pool_operation_status(&self, name: &str, phase: &str) -> Result<Value, Error> {
        wait_for(
            &format!("SupervisorPoolOperation {name} {phase}"),
            2 * MINUTE,
            || async {
                let object = self
                    .kubectl
                    .json(&["get", "spoolop", name, "-n", &self.install])
                    .await
                    .ok()?;
                let status = object.get("status")?;
                (status["phase"] == phase).then(|| status.clone())
            },
        )
        .await
    }

    async fn rollout(&mut self) -> Result<(), Error> {
        let base = self.baseline().await?;
        let old_members: BTreeSet<&str> = base.status.members.iter().map(|m| m.name.as_str()).collect();
        // MemberLost Events from earlier steps (a member SIGKILLed before): none may be added
        // or updated by the rollout.
        let mut lost_before = BTreeMap::new();
        for member in &old_members {
            lost_before.insert(*member, self.member_lost(member).await?);
        }
        let args = [
            "rollout",
            "restart",
            "deployment/openshell-supervisor",
            "-n",
            &self.install,
        ];
        self.kubectl.run(&args).await?;
        self.rollout_status("openshell-supervisor", "300s").await?;
        // The old Pods are gone once the rollout is complete; their workloads moved first.
        let status = self.all_settled(&base.names, MINUTE).await?;
        let seconds = base.t0.elapsed().as_secs_f64();
        for instance in status.of(&self.namespace) {
            check(!old_members.contains(instance.owner.as_str()), || {
                format!(
                    "{} is still owned by {}, a member of before the rollout",
                    instance.name, instance.owner
                )
            })?;
        }
        self.survived_untouched("rollout restart of every supervisor (total)", seconds, &base)
            .await?;
        // Each old member left on purpose: a Normal MemberLeft on its Pod (with the Pod's UID,
        // so `kubectl describe pod` shows it), never a MemberLost warning.
        for member in old_members {
            let left = wait_for(&format!("a MemberLeft Event on {member}"), MINUTE, || async {
                events(&self.kubectl, &self.install, member, "MemberLeft")
                    .await
                    .ok()?
                    .first()
                    .cloned()
            })
            .await?;
            check(
                left.pointer("/involvedObject/uid")
                    .and_then(Value::as_str)
                    .is_some_and(|u| !u.is_empty()),
                || format!("the MemberLeft Event on {member} names the Pod's UID: {left}"),
            )?;
            let lost = self.member_lost(member).await?;
            check(Some(&lost) == lost_before.get(member), || {
                format!("{member} left on purpose, yet it was reported lost: {lost:?}")
            })?;
        }
        Ok(())
    }

    /// The MemberLost Events on `member`'s Pod: name → resourceVersion (a repeat updates the
    /// Event's series, which changes its resourceVersion).
    async fn member_lost(&self, member: &str) -> Result<BTreeMap<String, String>, Error> {
        let found = events(&self.kubectl, &self.install, member, "MemberLost").await?;
        let field = |e: &Value, p: &str| e.pointer(p).and_then(Value::as_str).unwrap_or_default().to_owned();
        Ok(found
            .iter()
            .map(|e| (field(e, "/metadata/name"), field(e, "/metadata/resourceVersion")))
            .collect())
    }

    async fn pod_replaced(&mut self) -> Result<(), Error> {
        let ns = self.namespace.clone();
        let old = self
            .agent_pods()
            .await?
            .remove("ledger-0")
            .ok_or_else(|| Error::Check("no ledger-0".into()))?;
        self.kubectl.run(&["delete", "pod", "ledger-0", "-n", &ns]).await?;
        let kubectl = self.kubectl.clone();
        let uid = wait_for("ledger-0 back with a new UID", 2 * MINUTE, || async {
            let pod = kubectl.json(&["get", "pod", "ledger-0", "-n", &ns]).await.ok()?;
            let uid = pod.pointer("/metadata/uid")?.as_str()?.to_owned();
            (uid != old.uid).then_some(uid)
        })
        .await?;
        self.kubectl
            .run(&["rollout", "status", "statefulset/ledger", "-n", &ns, "--timeout=120s"])
            .await?;
        let pool = self.pool.clone();
        wait_for("ledger-0's new instance active under an owner", 2 * MINUTE, || async {
            let status = pool.status().await.ok()?;
            status
                .of(&ns)
                .iter()
                .any(|i| i.name == "ledger-0" && i.uid == uid && i.settled())
                .then_some(())
        })
        .await?;
        Ok(())
    }

    /// Σ instances over the members and the settled instances of the test namespace.
    async fn counted(&self) -> Result<(u32, usize), Error> {
        let status = self.pool.status().await?;
        let held = status.members.iter().map(|m| m.instances).sum();
        Ok((held, status.of(&self.namespace).len()))
    }

    async fn scaled(&mut self) -> Result<(), Error> {
        let ns = self.namespace.clone();
        let (held, listed) = self.counted().await?;
        self.kubectl
            .run(&["scale", "deployment/counter", "--replicas=1", "-n", &ns])
            .await?;
        let this = &*self;
        wait_for(
            &format!(
                "capacity given back after scaling down (members hold {} instances)",
                held - 2
            ),
            2 * MINUTE,
            || async {
                let now = this.counted().await.ok()?;
                (now == (held - 2, listed - 2)).then_some(())
            },
        )
        .await?;
        self.kubectl
            .run(&["scale", "deployment/counter", "--replicas=3", "-n", &ns])
            .await?;
        self.kubectl
            .run(&["rollout", "status", "deployment/counter", "-n", &ns, "--timeout=120s"])
            .await?;
        let names = self.agent_pods().await?.keys().cloned().collect();
        self.all_settled(&names, 2 * MINUTE).await?;
        let this = &*self;
        wait_for(
            &format!("members hold exactly the {held} instances again"),
            MINUTE,
            || async {
                let now = this.counted().await.ok()?;
                (now == (held, listed)).then_some(())
            },
        )
        .await
    }

    async fn secret_present(&self, present: bool) -> Result<(), Error> {
        self.secret_present_in(&self.namespace, present).await
    }

    /// The gateway's Secret in `namespace` holds the trust bundle and the CA, and no token:
    /// each Pod authenticates with its own ServiceAccount token.
    async fn secret_present_in(&self, namespace: &str, present: bool) -> Result<(), Error> {
        let what = if present {
            "the namespace's trust Secret"
        } else {
            "the trust Secret removed"
        };
        wait_for(what, MINUTE, || async {
            let secret = self.kubectl.json(&["get", "secret", SECRET, "-n", namespace]).await;
            match secret {
                Ok(secret) => {
                    let data = secret.get("data")?;
                    let complete = ["trust.jwks", "ca.crt"].iter().all(|k| data.get(k).is_some());
                    (present && complete && data.get("token").is_none()).then_some(())
                }
                Err(_) => (!present).then_some(()),
            }
        })
        .await
    }

    /// A Pod of another labelled namespace, with its own ServiceAccount token, tries to
    /// register, withdraw and report for one of ours: every call is refused with
    /// PERMISSION_DENIED and our workloads never notice.
    async fn cross_namespace(&mut self) -> Result<(), Error> {
        let base = self.baseline().await?;
        let other = format!("{}-b", self.namespace);
        self.kubectl.run(&["create", "namespace", &other]).await?;
        let victim = base
            .names
            .iter()
            .next()
            .cloned()
            .ok_or_else(|| Error::Check("no agent".into()))?;
        let pod = self
            .kubectl
            .json(&["get", "pod", &victim, "-n", &self.namespace])
            .await?;
        let uid = pod
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let manifest = probe_pod(&other, &self.image, &format!("{}/{victim}", self.namespace), &uid);
        // The probe projects a gateway-audience token of its own, which the webhook refuses in
        // a labelled namespace; it sees Pods only at creation, so the probe is created before
        // the label and waits in ContainerCreating for the namespace's Secret, which the
        // gateway writes once the label is there. The namespace's default ServiceAccount
        // appears a moment after the namespace.
        let kubectl = self.kubectl.clone();
        wait_for("the probe Pod created", MINUTE, || async {
            kubectl.apply(&manifest).await.ok()
        })
        .await?;
        self.kubectl.run(&["label", "namespace", &other, LABEL]).await?;
        self.secret_present_in(&other, true).await?;
        // Created now, the same Pod is refused, naming its token volume.
        let refused = self
            .kubectl
            .apply(&manifest.replacen("name: probe\n", "name: probe-refused\n", 1))
            .await;
        check(
            matches!(&refused, Err(Error::Failed { stderr, .. })
                if stderr.contains("refused") && stderr.contains("\"credentials\"")),
            || format!("a Pod projecting a gateway-audience token is refused in a labelled namespace: {refused:?}"),
        )?;
        let done = wait_for("the probe Pod finished", 2 * MINUTE, || async {
            let pod = kubectl.json(&["get", "pod", "probe", "-n", &other]).await.ok()?;
            let phase = pod.pointer("/status/phase").and_then(Value::as_str)?.to_owned();
            matches!(phase.as_str(), "Succeeded" | "Failed").then_some(phase)
        })
        .await?;
        let log = self.kubectl.run(&["logs", "probe", "-n", &other]).await?;
        let answers: Vec<&str> = log.lines().filter(|l| l.starts_with("probe call=")).collect();
        eprintln!("   probe ({done}):\n      {}", answers.join("\n      "));
        check(done == "Succeeded" && answers.len() == 6, || {
            format!("the probe made its six calls: {done}, log:\n{log}")
        })?;
        check(answers.iter().all(|a| a.ends_with("code=PermissionDenied")), || {
            format!("every call of another namespace's Pod is refused with PermissionDenied:\n{log}")
        })?;
        let status = self.pool.status().await?;
        let route = format!("{}/{victim}", self.namespace);
        check(
            status
                .of(&self.namespace)
                .iter()
                .any(|i| i.route == route && i.workload_pid != 0),
            || format!("{route} is still supervised: {status:?}"),
        )?;
        self.kubectl
            .run(&["delete", "namespace", &other, "--wait=false"])
            .await?;
        let seconds = base.t0.elapsed().as_secs_f64();
        self.survived_untouched("cross-namespace probe", seconds, &base).await
    }

    /// From inside a workload container (`kubectl exec` into the agent, the workload's UID,
    /// the Pod's shared PID namespace), `probe sidecar` tries every path to the sidecar's
    /// token, fence state, environment and memory: each is refused by the kernel, while the
    /// same read of the agent's own environment (the control) succeeds. The Pod spec mounts
    /// the sidecar's volumes in the sidecar only, and the sidecar says it was non-dumpable
    /// from exec (its image installs it execute-only).
    async fn sidecar_unreachable(&mut self) -> Result<(), Error> {
        let base = self.baseline().await?;
        for pod in &base.names {
            let out = self
                .kubectl
                .run(&[
                    "exec",
                    "-n",
                    &self.namespace,
                    pod,
                    "-c",
                    "agent",
                    "--",
                    "/usr/local/bin/probe",
                    "sidecar",
                ])
                .await?;
            let attempts: Vec<&str> = out.lines().filter(|l| l.starts_with("probe path=")).collect();
            eprintln!("   {pod}: {} attempts", attempts.len());
            check(out.lines().any(|l| l.starts_with("probe sidecar pid=")), || {
                format!("the probe found the sidecar of {pod}:\n{out}")
            })?;
            check(attempts.len() >= 15, || {
                format!("every path was tried in {pod}:\n{out}")
            })?;
            let reached: Vec<&&str> = attempts
                .iter()
                .filter(|l| {
                    let own = l.starts_with("probe path=own:");
                    !(l.contains(" result=refused ") || own && l.contains(" result=absent "))
                })
                .collect();
            check(reached.is_empty(), || {
                format!("the workload of {pod} reached its sidecar: {reached:?}\n{out}")
            })?;
            check(
                out.lines()
                    .any(|l| l.starts_with("probe control=agent") && l.ends_with("environ=reached")),
                || format!("the control read of the agent's own environment succeeded in {pod}:\n{out}"),
            )?;
            let spec = self.kubectl.json(&["get", "pod", "-n", &self.namespace, pod]).await?;
            for container in spec
                .pointer("/spec/containers")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let mounts: Vec<&str> = container["volumeMounts"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|m| m["name"].as_str())
                    .collect();
                check(
                    !mounts.iter().any(|m| *m == SECRET || *m == "openshell-sidecar-state"),
                    || {
                        format!(
                            "{pod}: container {} mounts a sidecar volume: {mounts:?}",
                            container["name"]
                        )
                    },
                )?;
            }
            let log = self
                .kubectl
                .run(&["logs", "-n", &self.namespace, pod, "-c", "openshell-sidecar"])
                .await?;
            check(log.contains("non-dumpable from exec"), || {
                format!("the sidecar of {pod} was non-dumpable from exec:\n{log}")
            })?;
        }
        let seconds = base.t0.elapsed().as_secs_f64();
        self.survived_untouched("workload probes its sidecar", seconds, &base)
            .await
    }

    /// In a labelled namespace of its own: a Pod running as root is admitted unchanged with
    /// the warning, the label and annotation that say why, runs, gets a NotSupervised Event
    /// and is counted by the `SupervisorPool` (Degraded, PodsNotSupervised); a Job's agent is
    /// supervised for real (its PID in the status) until it exits 0, when its instance leaves
    /// the pool at once with a WorkloadFinished Event, and the pool is AsExpected again once
    /// the root Pod is gone, with the finished Job Pod still there (it stays until the
    /// declared drain).
    async fn pod_shapes(&mut self) -> Result<(), Error> {
        let ns = format!("{}-shapes", self.namespace);
        self.kubectl.run(&["create", "namespace", &ns]).await?;
        self.kubectl.run(&["label", "namespace", &ns, LABEL]).await?;
        self.secret_present_in(&ns, true).await?;

        let (_, warned) = self.kubectl.apply_warned(&root_pod(&ns, &self.image)).await?;
        check(
            warned.contains("Warning: not supervised:") && warned.contains("runs as root"),
            || format!("kubectl shows the not-supervised warning for a root Pod: {warned:?}"),
        )?;
        let kubectl = self.kubectl.clone();
        let root = self.running_pod(&ns, "as-root").await?;
        check(
            root.pointer("/metadata/labels/supervision.openshell.ai~1not-supervised")
                == Some(&Value::from("runs_as_root"))
                && root
                    .pointer("/metadata/annotations/supervision.openshell.ai~1not-supervised")
                    .and_then(Value::as_str)
                    .is_some_and(|why| why.contains("runs as root"))
                && root.pointer("/spec/initContainers").is_none()
                && root.pointer("/spec/shareProcessNamespace").is_none(),
            || format!("the root Pod is unchanged but for the label and annotation: {root}"),
        )?;
        self.event_in(&ns, "as-root", "NotSupervised").await?;
        self.pool_degraded("PodsNotSupervised", |status| {
            status.pointer("/unsupervisedPods/byReason/runs_as_root") == Some(&Value::from(1))
        })
        .await?;

        self.kubectl.apply(&finite_job(&ns, &self.image, 30)).await?;
        let supervised = self.job_supervised_until_it_finishes(&ns, "finite").await?;

        // A workload that never talks to the socket: identified as its container's main
        // process, supervised with its PID.
        let pid = self.silent_supervised(&ns, "silent").await?;
        let condition = wait_for("the silent Pod's Supervised condition True", MINUTE, || async {
            let pod = kubectl.json(&["get", "pod", "silent", "-n", &ns]).await.ok()?;
            let conditions = pod.pointer("/status/conditions")?.as_array()?.clone();
            conditions
                .into_iter()
                .find(|c| c["type"] == "supervision.openshell.ai/Supervised" && c["status"] == "True")
        })
        .await?;
        eprintln!("   silent: supervised as PID {pid} ({})", condition["reason"]);
        self.kubectl
            .run(&["delete", "pod", "silent", "-n", &ns, "--grace-period=1", "--wait=true"])
            .await?;
        self.kubectl
            .run(&["delete", "pod", "as-root", "-n", &ns, "--grace-period=1", "--wait=true"])
            .await?;
        self.pool_degraded("AsExpected", |status| {
            status.pointer("/unsupervisedPods/total") == Some(&Value::from(0))
        })
        .await?;
        let left = self.kubectl.run(&["get", "pods", "-n", &ns, "-o", "name"]).await?;
        check(left.trim() == format!("pod/{supervised}"), || {
            format!("the finished Job Pod is still there: {left}")
        })?;
        // The namespace stays, with its finished Job Pod, until the declared drain has shown
        // that a drain moves only live instances.
        Ok(())
    }

    /// Each shape has its outcome: supervised for real (identified PID, Supervised True) when
    /// the sidecar can identify and stop the workload, else admitted unchanged with a warning,
    /// the label, the annotation and a NotSupervised Event; a Pod in the host's PID namespace is
    /// refused with the reason.
    async fn more_pod_shapes(&mut self) -> Result<(), Error> {
        let ns = format!("{}-more-shapes", self.namespace);
        self.kubectl.run(&["create", "namespace", &ns]).await?;
        self.kubectl.run(&["label", "namespace", &ns, LABEL]).await?;
        self.secret_present_in(&ns, true).await?;
        let pods = shape_pods(&ns, &self.image);

        let refused = self.kubectl.apply(&pods["host-pids"]).await;
        check(
            matches!(&refused, Err(Error::Failed { stderr, .. }) if stderr.contains("spec.hostPID is true")),
            || format!("a hostPID Pod is refused with the reason: {refused:?}"),
        )?;
        let (_, warned) = self.kubectl.apply_warned(&pods["private-pids"]).await?;
        check(
            warned.contains("Warning: not supervised:") && warned.contains("shareProcessNamespace: false"),
            || format!("kubectl shows why a Pod with a private PID namespace is not supervised: {warned:?}"),
        )?;
        // The shapes that are supervised run beside the agents from here on, so every later
        // step — an owner force-deleted or SIGKILLed, a failover, drains, a rollout, a missed
        // deadline — checks them as it checks the agents (same process, counting, restarted
        // and supervised again after the deadline).
        let main = self.namespace.clone();
        let supervised = shape_pods(&main, &self.image);
        let (_, warned) = self.kubectl.apply_warned(&supervised["two-apps"]).await?;
        check(warned.contains("2 app containers"), || {
            format!("kubectl warns that two app containers are identified on connection: {warned:?}")
        })?;
        self.kubectl.apply(&supervised["other-uid"]).await?;
        let pid = self.silent_supervised(&main, SILENT).await?;
        eprintln!("   {SILENT}: supervised as PID {pid}");

        let kubectl = self.kubectl.clone();
        let private = self.running_pod(&ns, "private-pids").await?;
        check(
            private.pointer("/metadata/labels/supervision.openshell.ai~1not-supervised")
                == Some(&Value::from("process_namespace_off"))
                && private.pointer("/spec/shareProcessNamespace") == Some(&Value::from(false))
                && private.pointer("/spec/initContainers").is_none(),
            || format!("the private-PID Pod is unchanged but for the label and annotation: {private}"),
        )?;
        self.event_in(&ns, "private-pids", "NotSupervised").await?;

        let pool = self.pool.clone();
        for name in ["other-uid", "two-apps"] {
            let pid = wait_for(&format!("{name} supervised with its PID"), 2 * MINUTE, || async {
                let status = pool.status().await.ok()?;
                let i = status.of(&main).into_iter().find(|i| i.name == name)?;
                (i.settled() && i.workload_pid != 0).then_some(i.workload_pid)
            })
            .await?;
            wait_for(&format!("{name}'s Supervised condition True"), MINUTE, || async {
                let pod = kubectl.json(&["get", "pod", name, "-n", &main]).await.ok()?;
                let conditions = pod.pointer("/status/conditions")?.as_array()?.clone();
                conditions
                    .into_iter()
                    .find(|c| c["type"] == "supervision.openshell.ai/Supervised" && c["status"] == "True")
            })
            .await?;
            eprintln!("   {name}: supervised as PID {pid}");
        }

        // A CronJob's run: supervised while it runs; its finished Pod, kept as the CronJob's
        // history, leaves the pool.
        self.kubectl.apply(&cron_job(&ns, &self.image, 5)).await?;
        self.kubectl
            .run(&["create", "job", "nightly-now", "--from=cronjob/nightly", "-n", &ns])
            .await?;
        let run = self.job_supervised_until_it_finishes(&ns, "nightly-now").await?;
        let kept = self.kubectl.run(&["get", "pod", &run, "-n", &ns, "-o", "name"]).await?;
        check(kept.trim() == format!("pod/{run}"), || {
            format!("the finished run's Pod is kept: {kept}")
        })?;
        self.kubectl.run(&["delete", "namespace", &ns, "--wait=false"]).await?;
        Ok(())
    }

    /// A workload's egress goes through its sidecar's proxy and is decided by its namespace's
    /// `SandboxPolicy`: allowed requests reach the in-cluster upstream, others get the 403 that
    /// names the rule needed, the floor is refused whatever the policy; a tunnel stays open
    /// while its owner's Pod is force-deleted, and an edit revoking its rule closes it; a Pod
    /// naming a policy that does not exist runs deny-all.
    async fn egress(&mut self) -> Result<(), Error> {
        let ns = format!("{}-egress", self.namespace);
        self.kubectl.run(&["create", "namespace", &ns]).await?;
        self.kubectl.run(&["label", "namespace", &ns, LABEL]).await?;
        self.secret_present_in(&ns, true).await?;
        // The default policy also binds a credential to an HTTPS upstream; the namespace has
        // not yet granted the pool its Secret.
        let (credential_objects, credentials, models_rule) = credential_fixture(&ns, &self.image);
        self.kubectl.apply(&credential_objects).await?;
        let bound_policy = egress_policy(&ns, true)
            .replacen("spec:\n", &format!("spec:\n{credentials}"), 1)
            .replacen("  rules:\n", &format!("  rules:\n{models_rule}"), 1);
        self.kubectl.apply(&egress_fixture(&ns, &self.image)).await?;
        self.kubectl.apply(&bound_policy).await?;
        // A rule the sidecar could not read is refused when it is written, not ignored later.
        let misspelt = egress_policy(&ns, true)
            .replace("name: default", "name: misspelt")
            .replace(
                &format!("host: upstream-allowed.{ns}.svc.cluster.local"),
                "host: https://api.example.com/v1",
            );
        let refused = self.kubectl.apply(&misspelt).await;
        check(
            matches!(&refused, Err(Error::Failed { stderr, .. }) if stderr.contains("spec.rules[0].host")),
            || format!("kubectl apply refuses a host that is a URL: {refused:?}"),
        )?;
        let explained = self.kubectl.run(&["explain", "sandboxpolicy.spec.rules"]).await?;
        check(
            explained.contains("pathPrefixes") && explained.contains("ports"),
            || format!("kubectl explain describes the rules: {explained}"),
        )?;
        self.kubectl.apply(&lone_pod(&ns, "egress-agent", &self.image)).await?;
        let missing = lone_pod(&ns, "egress-nameless", &self.image).replacen(
            "  namespace: ",
            "  annotations:\n    supervision.openshell.ai/policy: missing\n  namespace: ",
            1,
        );
        self.kubectl.apply(&missing).await?;
        let host = |service: &str| format!("upstream-{service}.{ns}.svc.cluster.local:8080");
        let (allowed, readonly, denied) = (host("allowed"), host("readonly"), host("denied"));
        let probe = |pod: &str, args: Vec<String>| probe_egress(&ns, pod, args);
        let answers = |out: &str| -> BTreeMap<String, String> {
            out.lines()
                .filter_map(|l| l.strip_prefix("probe egress target="))
                .filter_map(|l| l.split_once(' '))
                .map(|(t, rest)| (t.to_owned(), rest.to_owned()))
                .collect()
        };
        let kubectl = self.kubectl.clone();
        let first = probe("egress-agent", vec!["--get".into(), format!("http://{allowed}/first")]);
        wait_for(
            "the agent's policy loaded (the allowed upstream answers)",
            2 * MINUTE,
            || async {
                let args: Vec<&str> = first.iter().map(String::as_str).collect();
                let out = kubectl.run(&args).await.ok()?;
                out.contains("status=200 body=upstream=in-cluster").then_some(())
            },
        )
        .await?;
        // The credential: refused while the pool may not read its Secret (the install grants
        // it no Secret of a team's namespace), sent once the namespace grants that one Secret.
        let models = format!("http://upstream-tls.{ns}.svc.cluster.local:8443/v1/chat");
        let placeholder = "openshell-placeholder-models";
        let with_placeholder = |url: &str| {
            let header = format!("Authorization: Bearer {placeholder}");
            probe(
                "egress-agent",
                vec!["--header".into(), header, "--get".into(), url.to_owned()],
            )
        };
        let ungranted = self.kubectl.run(&strs(&with_placeholder(&models))).await?;
        check(
            ungranted.contains("status=503") && ungranted.contains("may not read Secret"),
            || format!("without a grant the credential is not held and nothing is sent: {ungranted}"),
        )?;
        self.kubectl.apply(&credential_grant(&ns, &self.install)).await?;
        // The policy's status shows its one Pod (the nameless one runs deny-all) enforcing it.
        let loaded = self.policy_loaded(&ns, None).await?;
        let listed = self.kubectl.run(&["get", "sandboxpolicies", "-n", &ns]).await?;
        check(listed.contains("LOADED") && listed.contains("PODS"), || {
            format!("kubectl get sandboxpolicies shows where the policy is loaded: {listed}")
        })?;

        let service_ip = self
            .kubectl
            .run(&[
                "get",
                "service",
                "upstream-allowed",
                "-n",
                &ns,
                "-o",
                "jsonpath={.spec.clusterIP}",
            ])
            .await?;
        let gets = [
            format!("http://{allowed}/any/path"),
            format!("http://{readonly}/docs/intro"),
            format!("http://{readonly}/admin"),
            format!("http://{denied}/"),
            format!("http://{}:8080/", service_ip.trim()),
            "http://169.254.169.254/latest/meta-data/".to_owned(),
            "http://127.0.0.1:9/".to_owned(),
            "http://openshell-gateway.openshell-supervision.svc:8443/".to_owned(),
        ];
        let mut args: Vec<String> = gets.iter().flat_map(|g| ["--get".to_owned(), g.clone()]).collect();
        args.extend([
            "--connect".to_owned(),
            allowed.clone(),
            "--connect".to_owned(),
            readonly.clone(),
        ]);
        let all = probe("egress-agent", args);
        let out = self.kubectl.run(&strs(&all)).await?;
        let got = answers(&out);
        eprintln!(
            "   {}",
            out.lines()
                .filter(|l| l.starts_with("probe egress target="))
                .collect::<Vec<_>>()
                .join("\n   ")
        );
        let says = |target: &str, status: &str, body: &[&str]| {
            got.get(target).is_some_and(|rest| {
                rest.starts_with(&format!("status={status} ")) && body.iter().all(|b| rest.contains(b))
            })
        };
        let ruled = ["\"policy\":\"default\"", "\"ruleNeeded\":{"];
        // The floor is refused as such: no rule to add would open it.
        let floor = ["never reachable from a workload", "\"ruleNeeded\":null"];
        let expected: Vec<(String, &str, Vec<&str>)> = vec![
            (gets[0].clone(), "200", vec!["path=/any/path"]),
            (gets[1].clone(), "200", vec!["method=GET path=/docs/intro"]),
            (gets[2].clone(), "403", ruled.to_vec()),
            (gets[3].clone(), "403", ruled.to_vec()),
            (gets[4].clone(), "403", ruled.to_vec()),
            (gets[5].clone(), "403", floor.to_vec()),
            (gets[6].clone(), "403", floor.to_vec()),
            (
                gets[7].clone(),
                "403",
                vec!["the pool's own endpoints", "\"ruleNeeded\":null"],
            ),
            (format!("connect:{allowed}"), "200", vec!["path=/tunnel"]),
            (format!("connect:{readonly}"), "403", ruled.to_vec()),
        ];
        for (target, status, body) in &expected {
            check(says(target, status, body), || {
                format!("{target}: expected {status} with {body:?}, got {:?}", got.get(target))
            })?;
        }
        let nameless = probe("egress-nameless", vec!["--get".into(), format!("http://{allowed}/")]);
        let out = self.kubectl.run(&strs(&nameless)).await?;
        check(
            out.contains("status=403") && out.contains("\"policy\":\"<none>\""),
            || format!("a Pod naming a missing policy runs deny-all: {out}"),
        )?;

        // 100 tunnels and a paced download (8 MiB/s) held while the owner's Pod is
        // force-deleted, then while the next owner is drained, then while every member is
        // replaced by a rollout restart: each tunnel still carries a request afterwards, and
        // the download completes.
        let mut hold = probe("egress-agent", vec!["--hold".into(), allowed.clone()]);
        hold.insert(1, "-i".to_owned());
        let many = |download: u64| {
            let mut many = hold.clone();
            many.extend(["--count".to_owned(), "100".to_owned()]);
            many.extend(["--download".to_owned(), download.to_string()]);
            many
        };
        let (during_delete, during_rollout) = (128u64 << 20, 192u64 << 20);
        let mut held = self.kubectl.attach(&strs(&many(during_delete)))?;
        held.line_starting("probe egress holding=", MINUTE).await?;
        let status = self.pool.status().await?;
        let owner = status
            .of(&ns)
            .into_iter()
            .find(|i| i.name == "egress-agent")
            .map(|i| i.owner.clone())
            .ok_or_else(|| Error::Check("the egress agent has no owner".into()))?;
        self.kubectl
            .run(&[
                "delete",
                "pod",
                &owner,
                "-n",
                &self.install,
                "--grace-period=0",
                "--force",
            ])
            .await?;
        let moved = self.settled_elsewhere(&ns, "egress-agent", &owner).await?;
        held.send("go").await?;
        let after = held.line_starting("probe egress held=", MINUTE).await?;
        eprintln!("   owner {owner} force-deleted, now {moved}: {after}");
        held_through(&after, during_delete, "the handoff")?;
        self.rollout_status("openshell-supervisor", "120s").await?;

        // A drain of the new owner, then the member returned to service.
        let mut held = self.kubectl.attach(&strs(&many(during_delete)))?;
        held.line_starting("probe egress holding=", MINUTE).await?;
        let out = self
            .pool
            .poolctl(&["drain", &moved, "--max-parallel", "2", "--wait"])
            .await?;
        let drained_to = self.settled_elsewhere(&ns, "egress-agent", &moved).await?;
        held.send("go").await?;
        let after = held.line_starting("probe egress held=", MINUTE).await?;
        eprintln!("   {moved} drained, now {drained_to}: {after}");
        held_through(&after, during_delete, "the drain")?;
        let id = operation_id(&out)?;
        self.pool.poolctl(&["cancel", id]).await?;
        self.member_active(&moved, MINUTE).await?;

        let mut held = self.kubectl.attach(&strs(&many(during_rollout)))?;
        held.line_starting("probe egress holding=", MINUTE).await?;
        self.kubectl
            .run(&[
                "rollout",
                "restart",
                "deployment/openshell-supervisor",
                "-n",
                &self.install,
            ])
            .await?;
        self.rollout_status("openshell-supervisor", "180s").await?;
        self.settled_elsewhere(&ns, "egress-agent", &drained_to).await?;
        held.send("go").await?;
        let after = held.line_starting("probe egress held=", 2 * MINUTE).await?;
        eprintln!("   rollout restart of the members: {after}");
        held_through(&after, during_rollout, "the rollout")?;

        // Granted (read again within 30 s): the value reaches the bound upstream over TLS the
        // sidecar verified, the placeholder anywhere else goes out as it is, and the value is in
        // no workload's reach.
        let sent = format!("auth=Bearer {CREDENTIAL_VALUE}");
        let bound = with_placeholder(&models);
        let out = wait_for("the granted credential reaches its upstream", 2 * MINUTE, || async {
            let out = kubectl.run(&strs(&bound)).await.ok()?;
            out.contains("status=200 body=upstream=models").then_some(out)
        })
        .await?;
        check(out.contains(&sent), || format!("the placeholder was replaced: {out}"))?;
        let elsewhere = self
            .kubectl
            .run(&strs(&with_placeholder(&format!("http://{allowed}/"))))
            .await?;
        check(
            elsewhere.contains(&format!("auth=Bearer {placeholder}")) && !elsewhere.contains(CREDENTIAL_VALUE),
            || format!("another destination gets the placeholder unchanged: {elsewhere}"),
        )?;
        // A container's environment and mounts come from the Pod's spec.
        let spec = self
            .kubectl
            .run(&["get", "pod", "egress-agent", "-n", &ns, "-o", "yaml"])
            .await?;
        check(
            !spec.contains(CREDENTIAL_VALUE) && !spec.contains("secretName: models"),
            || "the credential is in the workload Pod's spec".to_owned(),
        )?;
        // The policy's status says the pool holds the credential, and never the value.
        wait_for(
            "the SandboxPolicy's status shows the credential held",
            MINUTE,
            || async {
                let policy = kubectl
                    .json(&["get", "sandboxpolicy", "default", "-n", &ns])
                    .await
                    .ok()?;
                let shown = policy["status"]["credentials"].to_string();
                (shown.contains(r#""held":true"#) && !shown.contains(CREDENTIAL_VALUE)).then_some(())
            },
        )
        .await?;
        // The webhook set the placeholder variable (the policy was written before the Pod).
        let agent_env = self
            .kubectl
            .run(&[
                "get",
                "pod",
                "egress-agent",
                "-n",
                &ns,
                "-o",
                "jsonpath={.spec.containers[?(@.name==\"agent\")].env}",
            ])
            .await?;
        check(
            agent_env.contains(r#"{"name":"MODELS_API_KEY","value":"openshell-placeholder-models"}"#),
            || format!("the webhook set the placeholder variable: {agent_env}"),
        )?;
        eprintln!("   credential: 503 before the grant, sent to its upstream only after it");

        // An edit that revokes the rule closes the tunnel it allowed.
        let mut held = self.kubectl.attach(&strs(&hold))?;
        held.line_starting("probe egress holding=", MINUTE).await?;
        let edited = Instant::now();
        self.kubectl.apply(&egress_policy(&ns, false)).await?;
        let closed = held.line_starting("probe egress held=", MINUTE).await?;
        let seconds = edited.elapsed().as_secs_f64();
        eprintln!("   revoking edit applied: {closed} ({seconds:.2} s after kubectl apply)");
        check(closed.ends_with(" closed"), || {
            format!("the revoked tunnel was closed: {closed}")
        })?;
        let out = self.kubectl.run(&strs(&first)).await?;
        check(out.contains("status=403"), || {
            format!("the revoked upstream is refused: {out}")
        })?;
        self.policy_loaded(&ns, Some(loaded)).await?;
        // The audit trail: every decision of the agent's sidecar once, by sequence, through
        // the force-deletion of its owner and the rollout (the 100-tunnel holds among them).
        let pod = format!("{ns}/egress-agent");
        let pool = self.pool.clone();
        let trail = wait_for("the audit trail to hold the revoked tunnel", MINUTE, || async {
            let out = pool.poolctl(&["audit", &pod, "-o", "json"]).await.ok()?;
            let records: Vec<Value> = out.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
            records
                .iter()
                .any(|r| r["reason"].as_str().is_some_and(|why| why.contains("no longer allows")))
                .then_some(records)
        })
        .await?;
        let sequences: Vec<u64> = trail.iter().filter_map(|r| r["sequence"].as_u64()).collect();
        let owners: BTreeSet<&str> = trail.iter().filter_map(|r| r["member"].as_str()).collect();
        let denials = trail.iter().filter(|r| r["decision"] == "deny").count();
        eprintln!(
            "   audit: {} decisions ({denials} denials) stored once each, delivered by {} owners",
            sequences.len(),
            owners.len()
        );
        check(sequences == (1..=sequences.len() as u64).collect::<Vec<_>>(), || {
            format!("every decision once, in order: {sequences:?}")
        })?;
        check(owners.len() >= 2 && denials > 0, || {
            format!("delivered through the owners it had ({owners:?}), denials included")
        })?;
        // The denials, aggregated, as Warning Events on the agent's Pod: one per destination
        // (the step was denied several).
        let kubectl = self.kubectl.clone();
        let denied_events = wait_for("EgressDenied Events for two destinations", MINUTE, || async {
            let found = events(&kubectl, &ns, "egress-agent", "EgressDenied").await.ok()?;
            let notes: BTreeSet<String> = found
                .iter()
                .filter(|e| e["type"] == "Warning")
                .filter_map(|e| e["message"].as_str().or(e["note"].as_str()).map(str::to_owned))
                .collect();
            (notes.len() >= 2).then_some(notes)
        })
        .await?;
        for note in &denied_events {
            eprintln!("   EgressDenied: {note}");
        }
        check(denied_events.iter().all(|n| n.contains("poolctl audit")), || {
            format!("Warnings explaining the denials: {denied_events:?}")
        })?;
        self.measured.push(Measured {
            scenario: "SandboxPolicy edit → revoked tunnel closed",
            seconds,
            gap_ms: 0,
            restarts: 0,
            refused: 0,
        });
        self.kubectl.run(&["delete", "namespace", &ns, "--wait=false"]).await?;
        Ok(())
    }

    /// In a namespace labelled `supervision.openshell.ai/egress=redirect`, a process that
    /// ignores the proxy variables is decided as one that uses them: straight to an allowed
    /// name it gets through, straight to a denied name, a Service IP or the pool's own
    /// gateway it gets the 403, bytes of no known protocol to a Pod IP are closed, UDP is
    /// refused; with its sidecar SIGKILLed it reaches nothing, and once the sidecar is back the
    /// allowed name answers again.
    async fn egress_redirected(&mut self) -> Result<(), Error> {
        let ns = format!("{}-redirect", self.namespace);
        self.kubectl.run(&["create", "namespace", &ns]).await?;
        self.kubectl
            .run(&[
                "label",
                "namespace",
                &ns,
                LABEL,
                "supervision.openshell.ai/egress=redirect",
            ])
            .await?;
        self.secret_present_in(&ns, true).await?;
        // The upstream runs unsupervised in a namespace of its own: here, a Pod that opts out
        // is refused, as an unchecked way out.
        let up = format!("{ns}-up");
        self.kubectl.run(&["create", "namespace", &up]).await?;
        self.kubectl.apply(&egress_fixture(&up, &self.image)).await?;
        self.kubectl.apply(&egress_policy_for(&ns, &up, true)).await?;
        let opted_out = lone_pod(&ns, "opted-out", &self.image).replacen(
            "  namespace: ",
            "  labels:\n    supervision.openshell.ai/inject: disabled\n  namespace: ",
            1,
        );
        let opted_out = self.kubectl.apply(&opted_out).await;
        check(
            matches!(&opted_out, Err(Error::Failed { stderr, .. }) if stderr.contains("egress redirection is on for this namespace")),
            || format!("an opted-out Pod is refused where redirection is on: {opted_out:?}"),
        )?;
        let (_, warnings) = self
            .kubectl
            .apply_warned(&lone_pod(&ns, "redirected", &self.image))
            .await?;
        check(!warnings.contains("redirection may not hold"), || {
            format!("a hardened Pod is redirected without a warning: {warnings}")
        })?;
        let pod = self.kubectl.json(&["get", "pod", "redirected", "-n", &ns]).await?;
        let init: Vec<&str> = pod["spec"]["initContainers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["name"].as_str())
            .collect();
        check(
            init == ["openshell-egress-init", "openshell-egress-dialer", "openshell-sidecar"],
            || format!("the rules, the dialer, then the sidecar: {init:?}"),
        )?;
        let host = |service: &str| format!("upstream-{service}.{up}.svc.cluster.local:8080");
        let (allowed, denied) = (host("allowed"), host("denied"));
        let exec = |args: Vec<String>| probe_egress(&ns, "redirected", args);
        let kubectl = self.kubectl.clone();
        let straight = exec(vec!["--direct".into(), format!("http://{allowed}/direct")]);
        let through = || async {
            let out = kubectl.run(&strs(&straight)).await.ok()?;
            out.contains("status=200 body=upstream=in-cluster").then_some(())
        };
        wait_for(
            "a direct request to the allowed upstream goes through the sidecar",
            2 * MINUTE,
            through,
        )
        .await?;
        let jsonpath = |kind: &'static str, name: &'static str, path: &'static str| {
            let kubectl = self.kubectl.clone();
            let up = up.clone();
            async move {
                let out = kubectl
                    .run(&["get", kind, name, "-n", &up, "-o", &format!("jsonpath={path}")])
                    .await?;
                Ok::<_, Error>(out.trim().to_owned())
            }
        };
        let service_ip = jsonpath("service", "upstream-allowed", "{.spec.clusterIP}").await?;
        let pod_ip = jsonpath("pod", "upstream", "{.status.podIP}").await?;
        let gateway = "http://openshell-gateway.openshell-supervision.svc:8443/".to_owned();
        let directs = [
            format!("http://{allowed}/direct"),
            format!("http://{denied}/"),
            format!("http://{service_ip}:8080/"),
            gateway.clone(),
        ];
        let mut args: Vec<String> = directs
            .iter()
            .flat_map(|d| ["--direct".to_owned(), d.clone()])
            .collect();
        args.extend([
            "--raw".to_owned(),
            format!("{pod_ip}:8080"),
            "--udp".to_owned(),
            format!("{pod_ip}:8080"),
            "--get".to_owned(),
            format!("http://{allowed}/proxied"),
            "--through-dialer".to_owned(),
            format!("{pod_ip}:8080"),
        ]);
        let out = self.kubectl.run(&strs(&exec(args))).await?;
        eprintln!(
            "   {}",
            out.lines()
                .filter(|l| l.starts_with("probe egress target="))
                .collect::<Vec<_>>()
                .join("\n   ")
        );
        let line = |target: &str| {
            out.lines()
                .find_map(|l| l.strip_prefix(&format!("probe egress target={target} ")))
                .unwrap_or("")
                .to_owned()
        };
        let expected: Vec<(String, Vec<&str>)> = vec![
            (format!("direct:{}", directs[0]), vec!["status=200", "path=/direct"]),
            (format!("direct:{}", directs[1]), vec!["status=403", "\"ruleNeeded\":{"]),
            (format!("direct:{}", directs[2]), vec!["status=403", "\"ruleNeeded\":{"]),
            (
                format!("direct:{gateway}"),
                vec!["status=403", "never reachable from a workload"],
            ),
            (format!("raw:{pod_ip}:8080"), vec!["status=closed"]),
            (format!("udp:{pod_ip}:8080"), vec!["status=refused"]),
            (format!("http://{allowed}/proxied"), vec!["status=200", "path=/proxied"]),
        ];
        for (target, parts) in &expected {
            let got = line(target);
            check(parts.iter().all(|p| got.contains(p)), || {
                format!("{target}: expected {parts:?}, got {got:?}")
            })?;
        }
        // The dialer's socket is out of the workload's reach, also through /proc.
        let dialer = out
            .lines()
            .find(|l| l.starts_with("probe egress dialer="))
            .unwrap_or("");
        check(dialer.starts_with("probe egress dialer=unreachable /proc/"), || {
            format!("the workload cannot reach the dialer: {dialer:?}")
        })?;

        // The sidecar killed by the workload (same UID): nothing leaves meanwhile.
        let args = vec![
            "--kill-sidecar".to_owned(),
            "--direct".to_owned(),
            format!("http://{denied}/"),
            "--raw".to_owned(),
            format!("{pod_ip}:8080"),
        ];
        let out = self.kubectl.run(&strs(&exec(args))).await?;
        eprintln!("   {}", out.lines().collect::<Vec<_>>().join("\n   "));
        check(out.contains("probe egress killed="), || {
            format!("the sidecar was killed: {out}")
        })?;
        check(!out.contains("upstream=in-cluster"), || {
            format!("nothing reached the upstream while the sidecar was down: {out}")
        })?;
        check(!out.contains("status=answered"), || format!("no raw answer: {out}"))?;
        wait_for(
            "the sidecar back, the allowed upstream answers a direct request again",
            2 * MINUTE,
            through,
        )
        .await?;
        for namespace in [&ns, &up] {
            self.kubectl
                .run(&["delete", "namespace", namespace, "--wait=false"])
                .await?;
        }
        Ok(())
    }

    /// The owner of `name` in `namespace` once it is settled on a member other than `from`.
    async fn settled_elsewhere(&self, namespace: &str, name: &str, from: &str) -> Result<String, Error> {
        let pool = self.pool.clone();
        let what = format!("{namespace}/{name} active on a member other than {from}");
        wait_for(&what, 2 * MINUTE, || async {
            let status = pool.status().await.ok()?;
            let instance = status.of(namespace).into_iter().find(|i| i.name == name)?;
            (instance.settled() && instance.owner != from).then(|| instance.owner.clone())
        })
        .await
    }

    /// The revision of `namespace`'s `default` SandboxPolicy once its status shows it loaded
    /// by its one Pod's sidecar (and no other revision), newer than `after`.
    async fn policy_loaded(&self, namespace: &str, after: Option<i64>) -> Result<i64, Error> {
        let kubectl = self.kubectl.clone();
        let last = std::sync::Mutex::new(Value::Null);
        let loaded = wait_for(
            "the SandboxPolicy's status shows its revision loaded",
            MINUTE,
            || async {
                let policy = kubectl
                    .json(&["get", "sandboxpolicy", "default", "-n", namespace])
                    .await
                    .ok()?;
                let status = policy.get("status")?.clone();
                *last.lock().unwrap() = status.clone();
                let revision = status["revision"].as_i64()?;
                let only = status["revisions"].as_array().is_some_and(|r| r.len() == 1);
                let holds = status["pods"] == 1
                    && status["loaded"] == 1
                    && status["failed"] == 0
                    && only
                    && after.is_none_or(|a| revision > a);
                holds.then_some(revision)
            },
        )
        .await;
        loaded.map_err(|err| Error::Check(format!("{err}; the last status: {}", last.lock().unwrap())))
    }

    /// The `SupervisorPool` status once its `Degraded` reason is `reason` and `also` holds.
    async fn pool_degraded(&self, reason: &str, also: impl Fn(&Value) -> bool) -> Result<Value, Error> {
        self.pool_condition("Degraded", None, reason, also).await
    }

    /// The `SupervisorPool` status once its condition `type_` has `status` (any when `None`)
    /// and `reason`, and `also` holds.
    async fn pool_condition(
        &self,
        type_: &str,
        status: Option<&str>,
        reason: &str,
        also: impl Fn(&Value) -> bool,
    ) -> Result<Value, Error> {
        let kubectl = self.kubectl.clone();
        let install = self.install.clone();
        let last = std::sync::Mutex::new(Value::Null);
        let what = format!("SupervisorPool {type_} {} {reason}", status.unwrap_or(""));
        let found = wait_for(&what, 2 * MINUTE, || async {
            let pool = kubectl
                .json(&["get", "supervisorpool/openshell", "-n", &install])
                .await
                .ok()?;
            let found = pool.get("status")?.clone();
            *last.lock().unwrap() = found.clone();
            let condition = found["conditions"]
                .as_array()?
                .iter()
                .find(|c| c["type"] == type_)?
                .clone();
            let holds =
                condition["reason"] == reason && status.is_none_or(|s| condition["status"] == s) && also(&found);
            holds.then_some(found)
        })
        .await;
        found.map_err(|err| Error::Check(format!("{err}; the last status: {}", last.lock().unwrap())))
    }

    /// Every PostgreSQL process of the pool's database (the dev overlay's Pod) stopped with
    /// SIGSTOP, so that no gateway can read the store and calls hang as in a partition: the
    /// `SupervisorPool` turns `Unknown` (StoreUnreachable, naming the last good read) instead of
    /// keeping its last `Ready`, the workloads run on untouched, and after SIGCONT the
    /// coordinator's status is back, Ready True.
    async fn database_unreachable(&mut self) -> Result<(), Error> {
        let base = self.baseline().await?;
        let pids = database_processes().await;
        check(!pids.is_empty(), || "the database's processes on this node".into())?;
        for pid in &pids {
            signal(*pid, nix::sys::signal::Signal::SIGSTOP)?;
        }
        // 20 s without a read, then 15 s of the same observedAt.
        let unknown = self
            .pool_condition("Ready", Some("Unknown"), "StoreUnreachable", |_| true)
            .await;
        for pid in &pids {
            signal(*pid, nix::sys::signal::Signal::SIGCONT)?;
        }
        let unknown = unknown?;
        let observed = unknown["observedAt"].as_str().unwrap_or_default().to_owned();
        let ready = unknown["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
            .cloned()
            .unwrap_or_default();
        eprintln!(
            "   {} PostgreSQL processes paused: {}",
            pids.len(),
            ready["message"].as_str().unwrap_or_default()
        );
        check(
            !observed.is_empty() && ready["message"].as_str().is_some_and(|m| m.contains(&observed)),
            || format!("the Unknown status names the last good read: {unknown}"),
        )?;
        self.pool_condition("Ready", Some("True"), "PoolReady", |_| true)
            .await?;
        let seconds = base.t0.elapsed().as_secs_f64();
        self.survived_untouched("database paused", seconds, &base).await
    }

    /// The dev overlay's database keeps its data in an emptyDir: replacing its Pod empties the
    /// store under the running pool, as a restore into an empty database would. Nothing may be
    /// stopped: the gateways migrate the empty database again and write back the signing keys
    /// they hold (so every delivered token and trust bundle stays valid), each sidecar
    /// registers again with its fence and is placed above it. Then the gateways restart on the
    /// rebuilt store, and every agent must still be the same process, counting on.
    async fn database_replaced(&mut self) -> Result<(), Error> {
        let base = self.baseline().await?;
        let keys = "select kid from signing_keys order by kid";
        let kids_before = self.sql(keys).await?;
        let selector = "app.kubernetes.io/name=openshell-postgres";
        self.kubectl
            .run(&["delete", "pod", "-n", &self.install, "-l", selector, "--wait=true"])
            .await?;
        self.rollout_status("openshell-postgres", "120s").await?;
        let status = self.all_settled(&base.names, 2 * MINUTE).await?;
        let seconds = base.t0.elapsed().as_secs_f64();
        let kids_after = self.sql(keys).await?;
        check(kids_after == kids_before, || {
            format!("the signing keys changed with the database: {kids_before:?} -> {kids_after:?}")
        })?;
        let terms: Vec<String> = status
            .of(&self.namespace)
            .into_iter()
            .map(|i| format!("{} at {}", i.name, i.term))
            .collect();
        eprintln!(
            "   every instance active again on the emptied store: {}",
            terms.join(", ")
        );
        self.survived_untouched(
            "database Pod replaced (data lost) → every instance active again",
            seconds,
            &base,
        )
        .await?;
        let base = self.baseline().await?;
        self.kubectl
            .run(&[
                "rollout",
                "restart",
                "deployment/openshell-gateway",
                "-n",
                &self.install,
            ])
            .await?;
        self.rollout_status("openshell-gateway", "180s").await?;
        self.all_settled(&base.names, MINUTE).await?;
        self.pool_condition("Ready", Some("True"), "PoolReady", |_| true)
            .await?;
        let seconds = base.t0.elapsed().as_secs_f64();
        self.survived_untouched("then the gateways restarted → every instance settled", seconds, &base)
            .await
    }

    async fn label_and_secret(&mut self) -> Result<(), Error> {
        let ns = self.namespace.clone();
        let unlabel = "supervision.openshell.ai/shared-";
        self.kubectl.run(&["label", "namespace", &ns, unlabel]).await?;
        self.secret_present(false).await?;
        self.kubectl.run(&["label", "namespace", &ns, LABEL]).await?;
        self.secret_present(true).await?;
        self.kubectl.run(&["delete", "secret", SECRET, "-n", &ns]).await?;
        self.secret_present(true).await
    }

    async fn no_member(&mut self) -> Result<(), Error> {
        let ns = self.namespace.clone();
        // Beside the agents, a workload that never talks to the socket: it too is stopped at
        // the missed deadline and supervised again after its restart, identified anew.
        let pid = self.silent_supervised(&ns, SILENT).await?;
        eprintln!("   {SILENT}: supervised as PID {pid}");
        self.kubectl
            .run(&[
                "scale",
                "deployment/openshell-supervisor",
                "--replicas=0",
                "-n",
                &self.install,
            ])
            .await?;
        // Every sidecar loses its owner; none can be recovered before its deadline.
        let kubectl = self.kubectl.clone();
        wait_for("a SupervisorRecoveryFailed Event", 3 * MINUTE, || async {
            let list = kubectl
                .json(&[
                    "get",
                    "events",
                    "-n",
                    &ns,
                    "--field-selector",
                    "reason=SupervisorRecoveryFailed",
                ])
                .await
                .ok()?;
            list["items"].as_array().is_some_and(|a| !a.is_empty()).then_some(())
        })
        .await?;
        // A new Pod cannot be placed: its Event says why.
        self.kubectl.apply(&lone_pod(&ns, "unplaced", &self.image)).await?;
        let event = wait_for("an InstanceUnplaceable Event on the new Pod", 2 * MINUTE, || async {
            events(&self.kubectl, &ns, "unplaced", "InstanceUnplaceable")
                .await
                .ok()?
                .first()
                .cloned()
        })
        .await?;
        let note = event["message"]
            .as_str()
            .or(event["note"].as_str())
            .unwrap_or_default()
            .to_owned();
        check(!note.is_empty(), || format!("the unplaceable Event says why: {event}"))?;
        self.kubectl
            .run(&[
                "scale",
                "deployment/openshell-supervisor",
                "--replicas=2",
                "-n",
                &self.install,
            ])
            .await?;
        self.rollout_status("openshell-supervisor", "180s").await?;
        let names: BTreeSet<String> = ["unplaced".to_owned()].into();
        self.all_settled(&names, 2 * MINUTE).await?;
        // The stopped workloads' containers restarted: each new process is supervised again,
        // as the next generation of its Pod, with its PID and the Supervised condition.
        let agents: BTreeSet<String> = self.agent_pods().await?.into_keys().collect();
        let pool = self.pool.clone();
        let ns = self.namespace.clone();
        let waiting = std::sync::Mutex::new(String::new());
        let status = wait_for("every stopped workload supervised again", 3 * MINUTE, || async {
            let status = pool.status().await.ok()?;
            let back: BTreeSet<&String> = status
                .of(&ns)
                .into_iter()
                .filter(|i| i.settled() && i.workload_pid != 0)
                .map(|i| &i.name)
                .collect();
            let missing: Vec<String> = agents
                .iter()
                .filter(|a| !back.contains(a))
                .map(|a| {
                    let shown = status.of(&ns).into_iter().find(|i| &i.name == a);
                    shown.map_or(format!("{a}: not in the pool"), |i| {
                        format!("{a}: {} pid {} owner {:?}", i.phase, i.workload_pid, i.owner)
                    })
                })
                .collect();
            *waiting.lock().unwrap() = missing.join("; ");
            missing.is_empty().then_some(status)
        })
        .await
        .map_err(|err| Error::Check(format!("{err}; still waiting for: {}", waiting.lock().unwrap())))?;
        for name in agents.iter().filter(|n| *n != "unplaced") {
            self.event(name, "WorkloadRestarted").await?;
            let pod = self.kubectl.json(&["get", "pod", name, "-n", &ns]).await?;
            let supervised = pod
                .pointer("/status/conditions")
                .and_then(Value::as_array)
                .and_then(|c| c.iter().find(|c| c["type"] == "supervision.openshell.ai/Supervised"))
                .cloned()
                .unwrap_or_default();
            check(supervised["status"] == "True", || {
                format!("{name}: the Supervised condition is True again: {supervised}")
            })?;
        }
        eprintln!(
            "   {} workloads supervised again: {:?}",
            agents.len(),
            status
                .of(&ns)
                .iter()
                .map(|i| (&i.name, i.workload_pid))
                .collect::<Vec<_>>()
        );
        Ok(())
    }

    async fn uninstall(&mut self) -> Result<(), Error> {
        let overlay = self.overlay.clone();
        self.kubectl
            .run(&["delete", "-k", &overlay, "--wait=true", "--timeout=180s"])
            .await?;
        let ns = self.namespace.clone();
        self.kubectl
            .run(&["label", "namespace", &ns, "supervision.openshell.ai/shared-"])
            .await?;
        self.kubectl
            .run(&["delete", "namespace", &ns, "--wait=true", "--timeout=180s"])
            .await?;
        let kubectl = self.kubectl.clone();
        wait_for("nothing of the install left", 2 * MINUTE, || async {
            let mut left = Vec::new();
            for (kind, args) in [
                (
                    "namespace",
                    vec![
                        "get",
                        "namespace",
                        "openshell-supervision",
                        "--ignore-not-found",
                        "-o",
                        "name",
                    ],
                ),
                (
                    "token Secrets",
                    vec![
                        "get",
                        "secrets",
                        "-A",
                        "--field-selector",
                        "metadata.name=openshell-supervision-token",
                        "-o",
                        "name",
                    ],
                ),
                (
                    "cluster roles",
                    vec![
                        "get",
                        "clusterroles,clusterrolebindings",
                        "-l",
                        "app.kubernetes.io/part-of=openshell-supervision",
                        "-o",
                        "name",
                    ],
                ),
                (
                    "webhook configuration",
                    vec![
                        "get",
                        "mutatingwebhookconfigurations",
                        "openshell-supervision",
                        "--ignore-not-found",
                        "-o",
                        "name",
                    ],
                ),
            ] {
                let out = kubectl.run(&args).await.ok()?;
                if !out.trim().is_empty() {
                    left.push(format!("{kind}: {}", out.trim()));
                }
            }
            left.is_empty().then_some(())
        })
        .await
    }

    fn print_table(&self, total: Duration) {
        println!("\ncluster measurements (one run; kube-node v1.28.7 on this machine, release build, TLS):\n");
        println!("| scenario | time | longest agent counter gap | agent restarts | answers refused |");
        println!("|---|---|---|---|---|");
        for m in &self.measured {
            println!(
                "| {} | {:.2} s | {} ms | {} | {} |",
                m.scenario, m.seconds, m.gap_ms, m.restarts, m.refused
            );
        }
        println!("\nthe whole flow took {:.0} s", total.as_secs_f64());
    }
}

/// A `SupervisorPoolOperation` draining `member` (max-parallel 2).
fn pool_operation(namespace: &str, name: &str, member: &str, dry_run: bool) -> String {
    serde_json::json!({
        "apiVersion": "supervision.openshell.ai/v1alpha1",
        "kind": "SupervisorPoolOperation",
        "metadata": { "name": name, "namespace": namespace },
        "spec": { "kind": "Drain", "member": member, "maxParallel": 2, "dryRun": dry_run },
    })
    .to_string()
}

/// `probe egress held=…` said every one of the 100 tunnels answered and the download of
/// `download` bytes completed, through `what`.
fn held_through(after: &str, download: u64, what: &str) -> Result<(), Error> {
    check(
        after.contains(" ok=100 of=100 ") && after.ends_with(&format!(" download={download}/{download}")),
        || format!("every tunnel and the download held through {what}: {after}"),
    )
}

/// The id of the operation `poolctl drain` started or found already running (`started: ID …`,
/// `already running: ID …`).
fn operation_id(out: &str) -> Result<&str, Error> {
    out.lines()
        .find_map(|line| {
            let rest = line
                .strip_prefix("started: ")
                .or_else(|| line.strip_prefix("already running: "))?;
            rest.split_whitespace().next()
        })
        .ok_or_else(|| Error::Check(format!("poolctl printed no operation id: {out}")))
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The host PID of the supervisor process of member `member` (the Pod name), read from
/// /proc on this node.
async fn supervisor_process(member: &str) -> Option<i32> {
    let wanted = format!("OPENSHELL_SUPERVISOR_POOL_MEMBER={member}");
    let mut dir = tokio::fs::read_dir("/proc").await.ok()?;
    while let Ok(Some(entry)) = dir.next_entry().await {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(cmdline) = tokio::fs::read(entry.path().join("cmdline")).await else {
            continue;
        };
        if !cmdline.starts_with(b"/usr/local/bin/supervisor") {
            continue;
        }
        let Ok(environ) = tokio::fs::read(entry.path().join("environ")).await else {
            continue;
        };
        if environ.split(|b| *b == 0).any(|v| v == wanted.as_bytes()) {
            return Some(pid);
        }
    }
    None
}

/// The host PIDs of the cluster's PostgreSQL processes (in a Pod's cgroup, so never a
/// database of this machine's own).
async fn database_processes() -> Vec<i32> {
    let mut found = Vec::new();
    let Ok(mut dir) = tokio::fs::read_dir("/proc").await else {
        return found;
    };
    while let Ok(Some(entry)) = dir.next_entry().await {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(comm) = tokio::fs::read_to_string(entry.path().join("comm")).await else {
            continue;
        };
        if !comm.trim().starts_with("postgres") {
            continue;
        }
        let Ok(cgroup) = tokio::fs::read_to_string(entry.path().join("cgroup")).await else {
            continue;
        };
        if cgroup.contains("kubepods") {
            found.push(pid);
        }
    }
    found
}

fn node_local() -> bool {
    std::env::var("OPENSHELL_E2E_NODE_LOCAL").as_deref() == Ok("1")
}

fn signal(pid: i32, signal: nix::sys::signal::Signal) -> Result<(), Error> {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal)
        .map_err(|e| Error::Check(format!("kill -{signal} {pid}: {e}")))
}
