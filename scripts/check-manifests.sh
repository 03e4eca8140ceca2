#!/usr/bin/env bash
# Render every kustomization (manifests/, kustomize/base, kustomize/overlays/*) with
# `kubectl kustomize`, validate every rendered resource offline against the Kubernetes
# OpenAPI schemas (PyPI package kubernetes-validate, strict mode, Kubernetes 1.28 and 1.37),
# and check the install's own rules (restricted Pods, probes on declared ports, webhook
# registration, RBAC without wildcards and with secrets restricted by name, the SupervisorPool
# and SupervisorPoolOperation CRDs (namespaced, status subresource, the default printer columns
# exactly as listed in POOL_CRDS, every printer column on a declared field, the gateway may apply
# it), every gRPC URL
# https://, every TLS file variable pointing into the component's mounted TLS Secret, those
# Secrets written by kustomize/pool-certs.sh and — where the cert-manager component is used —
# by a Certificate with the Service's names, and every env variable of the gateway, supervisor
# and webhook containers one their binaries read — names found in <crate>/src (for the
# gateway container poolctl's too; for every container plumbing's, whose argument groups the
# binaries flatten) — plus the ones each needs in a cluster). Then runs
# scripts/check-pool-certs.sh (the certificate script against a fake kubectl).
#
# Needs kubectl (with its built-in kustomize) and python3. Installs kubernetes-validate from
# PyPI into the repository's .local/check-manifests-venv on first use (nothing outside the
# checkout), unless python3 already imports it.
# Custom resources without a built-in schema (cert-manager's Certificate and Issuer, the
# Prometheus Operator's PodMonitor and PrometheusRule) are skipped by the schema validation,
# with a note.
#
# Exit status: 0 when everything passes, 1 otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KV_VERSION="${KUBERNETES_VALIDATE_VERSION:-1.37.0}"
K8S_VERSIONS="${CHECK_MANIFESTS_K8S_VERSIONS:-1.28.0 1.37.0}"
VENV="${CHECK_MANIFESTS_VENV:-$ROOT/.local/check-manifests-venv}"

die() { echo "check-manifests: $*" >&2; exit 1; }

command -v kubectl >/dev/null 2>&1 || die "kubectl not found (it provides 'kubectl kustomize')"
command -v python3 >/dev/null 2>&1 || die "python3 not found"

# --- Python with kubernetes-validate -------------------------------------------------------
PYTHON=""
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import kubernetes_validate, yaml' 2>/dev/null; then
  PYTHON="$VENV/bin/python"
elif python3 -c 'import kubernetes_validate, yaml' 2>/dev/null; then
  PYTHON="python3"
else
  echo "check-manifests: installing kubernetes-validate==$KV_VERSION from PyPI" >&2
  python3 -m venv "$VENV" >/dev/null 2>&1 \
    || die "cannot make a Python venv in $VENV (Debian: apt-get install python3-venv), or install kubernetes-validate==$KV_VERSION yourself"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "kubernetes-validate==$KV_VERSION" \
    || die "pip install kubernetes-validate failed"
  PYTHON="$VENV/bin/python"
  "$PYTHON" -c 'import kubernetes_validate, yaml' || die "kubernetes-validate is not importable after install"
fi

# --- Render ----------------------------------------------------------------------------------
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

targets=("manifests" "kustomize/base")
for dir in "$ROOT"/kustomize/overlays/*/; do
  targets+=("kustomize/overlays/$(basename "$dir")")
done

failed=0
rendered=()
for target in "${targets[@]}"; do
  file="$OUT/$(echo "$target" | tr '/' '_').yaml"
  if kubectl kustomize "$ROOT/$target" >"$file" 2>"$file.err"; then
    echo "rendered  $target ($(grep -c '^kind:' "$file") resources)"
    rendered+=("$target=$file")
  else
    echo "FAILED    kubectl kustomize $target:" >&2
    cat "$file.err" >&2
    failed=1
  fi
done

# --- Validate --------------------------------------------------------------------------------
"$PYTHON" - "$ROOT" "$K8S_VERSIONS" "${rendered[@]}" <<'PY' || failed=1
import glob
import os
import re
import sys
import yaml
import kubernetes_validate
from kubernetes_validate.utils import SchemaNotFoundError, InvalidSchemaError, ValidationError

root = sys.argv[1]
versions = sys.argv[2].split()
targets = [arg.split("=", 1) for arg in sys.argv[3:]]
errors = []
skipped = set()
notes = set()

# Which crates' binaries each install container runs (the gateway image also carries poolctl,
# whose settings the gateway container's environment holds), and the variables each must set
# (what the binary needs in a cluster; the webhook's injected sidecar env is checked by
# webhook/tests/patch.rs).
# Every binary also takes argument groups from the shared runtime crate (plumbing: log format,
# gateway endpoints and their trust, connection limits).
CRATES = {"gateway": ("gateway", "poolctl", "plumbing"), "supervisor": ("supervisor", "plumbing"),
          "webhook": ("webhook", "plumbing")}
REQUIRED_ENV = {
    "gateway": {"DATABASE_URL", "OPENSHELL_GATEWAY_KUBERNETES", "OPENSHELL_GATEWAY_REPLICA",
                "OPENSHELL_POD_NAMESPACE", "OPENSHELL_GATEWAY_LISTEN", "OPENSHELL_GATEWAY_HEALTH_LISTEN",
                "OPENSHELL_GATEWAY_TLS_CERT", "OPENSHELL_GATEWAY_TLS_KEY", "OPENSHELL_GATEWAY_TLS_CA",
                "OPENSHELL_GATEWAY_KEY_ENCRYPTION_KEY_FILE"},
    "supervisor": {"OPENSHELL_SUPERVISOR_POOL_MEMBER", "OPENSHELL_GATEWAY_ENDPOINTS",
                   "OPENSHELL_SUPERVISOR_TOKEN_FILE", "OPENSHELL_SUPERVISOR_RUNTIME_LISTEN",
                   "OPENSHELL_SUPERVISOR_POOL_RUNTIME_ADDRESS", "OPENSHELL_SUPERVISOR_HEALTH_LISTEN",
                   "OPENSHELL_SUPERVISOR_TLS_CERT", "OPENSHELL_SUPERVISOR_TLS_KEY", "OPENSHELL_TLS_CA"},
    "webhook": {"OPENSHELL_WEBHOOK_SIDECAR_IMAGE", "OPENSHELL_WEBHOOK_SUPERVISOR_ROUTE",
                "OPENSHELL_WEBHOOK_GATEWAY_ENDPOINTS", "OPENSHELL_WEBHOOK_INSTALL_NAMESPACE",
                "OPENSHELL_WEBHOOK_TLS_CERT", "OPENSHELL_WEBHOOK_TLS_KEY"},
}
# Variables whose value is a gRPC URL (or a comma-separated list of them): https:// only.
GRPC_URL_ENV = {"OPENSHELL_GATEWAY_ENDPOINTS", "OPENSHELL_SUPERVISOR_POOL_RUNTIME_ADDRESS",
                "OPENSHELL_SUPERVISOR_ROUTE", "OPENSHELL_WEBHOOK_SUPERVISOR_ROUTE",
                "OPENSHELL_WEBHOOK_GATEWAY_ENDPOINTS"}
# Each component's TLS Secret (type kubernetes.io/tls: tls.crt, tls.key, ca.crt), and the
# Service its certificate is for.
TLS_SECRET = {"gateway": "openshell-gateway-tls", "supervisor": "openshell-supervisor-tls",
              "webhook": "openshell-webhook-tls"}
TLS_SERVICE = {"openshell-gateway-tls": "openshell-gateway", "openshell-supervisor-tls": "openshell-supervisor",
               "openshell-webhook-tls": "openshell-webhook"}
INSTALL_NAMESPACE = "openshell-supervision"
# A variable naming a TLS file, and the Secret key that file must be.
TLS_FILE_ENV = re.compile(r"^OPENSHELL_(?:[A-Z]+_)?TLS_(CERT|KEY|CA)$")
TLS_FILE_KEY = {"CERT": "tls.crt", "KEY": "tls.key", "CA": "ca.crt"}
ALWAYS_KNOWN_ENV = {"RUST_LOG"}
ENV_NAME = re.compile(r'"((?:OPENSHELL|DATABASE)_[A-Z0-9_]+)"')


def env_names_read_by(crates):
    names = set()
    for crate in crates:
        for path in glob.glob(os.path.join(root, crate, "src", "**", "*.rs"), recursive=True):
            with open(path) as f:
                names |= set(ENV_NAME.findall(f.read()))
    return names


KNOWN_ENV = {container: env_names_read_by(crates) for container, crates in CRATES.items()}

SYSTEM_NAMESPACES = {"kube-system", "kube-public", "kube-node-lease", "openshell-supervision"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}


def err(target, res, msg):
    errors.append(f"{target}: {res.get('kind')}/{res.get('metadata', {}).get('name')}: {msg}")


def service_names(service, namespace=INSTALL_NAMESPACE):
    host = f"{service}.{namespace}.svc"
    return [service, f"{service}.{namespace}", host, f"{host}.cluster.local"]


def pool_certs_secrets():
    """service -> Secret, as kustomize/pool-certs.sh writes them."""
    with open(os.path.join(root, "kustomize", "pool-certs.sh")) as f:
        return dict(re.findall(r'"(openshell-[a-z]+):(openshell-[a-z-]+-tls)"', f.read()))


POOL_CERTS = pool_certs_secrets()
# The gateway's key-encryption key Secret, created once by pool-certs.sh.
KEK_SECRET = "openshell-gateway-kek"
with open(os.path.join(root, "kustomize", "pool-certs.sh")) as f:
    POOL_CERTS_TEXT = f.read()


def secret_file(c, volumes, path):
    """(secretName, key) of the Secret file `path` in container `c`, or None."""
    for m in c.get("volumeMounts") or []:
        secret = (volumes.get(m.get("name")) or {}).get("secret")
        mount = (m.get("mountPath") or "").rstrip("/")
        if not secret or not mount or os.path.dirname(path) != mount:
            continue
        name = os.path.basename(path)
        items = secret.get("items")
        if items is not None:
            keys = [i.get("key") for i in items if i.get("path") == name]
            if not keys:
                return None
            name = keys[0]
        return secret.get("secretName"), name, m, secret
    return None


def check_pod(target, res, spec):
    psc = spec.get("securityContext") or {}
    containers = (spec.get("initContainers") or []) + (spec.get("containers") or [])
    if not containers:
        err(target, res, "no containers")
    for c in containers:
        csc = c.get("securityContext") or {}
        name = c.get("name")
        if not (csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True):
            err(target, res, f"container {name}: runAsNonRoot must be true")
        uid = csc.get("runAsUser", psc.get("runAsUser"))
        if uid == 0:
            err(target, res, f"container {name}: runs as uid 0")
        seccomp = (csc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp != "RuntimeDefault":
            err(target, res, f"container {name}: seccompProfile must be RuntimeDefault")
        if csc.get("allowPrivilegeEscalation") is not False:
            err(target, res, f"container {name}: allowPrivilegeEscalation must be false")
        if csc.get("readOnlyRootFilesystem") is not True:
            err(target, res, f"container {name}: readOnlyRootFilesystem must be true")
        if "ALL" not in ((csc.get("capabilities") or {}).get("drop") or []):
            err(target, res, f"container {name}: capabilities must drop ALL")
        if (csc.get("capabilities") or {}).get("add"):
            err(target, res, f"container {name}: must not add capabilities")
        if csc.get("privileged"):
            err(target, res, f"container {name}: privileged")
        for probe in ("livenessProbe", "readinessProbe"):
            if probe not in c:
                err(target, res, f"container {name}: missing {probe}")
        image = c.get("image", "")
        if ":" not in image.rsplit("/", 1)[-1] and "@" not in image:
            err(target, res, f"container {name}: image {image!r} has no tag")
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            err(target, res, f"{flag} is set")
    volumes = {v.get("name"): v for v in spec.get("volumes") or []}
    for c in containers:
        check_container(target, res, c, volumes)


def check_container(target, res, c, volumes):
    name = c.get("name")
    # Probes name ports the container declares.
    ports = {p.get("name") for p in c.get("ports") or []}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        port = ((c.get(probe) or {}).get("httpGet") or {}).get("port")
        if isinstance(port, str) and port not in ports:
            err(target, res, f"container {name}: {probe} uses port {port!r}, which it does not declare")
    env = {e.get("name"): e for e in c.get("env") or []}
    if name not in CRATES:
        return
    # gRPC inside the install is TLS: every gRPC URL is https://, and no plaintext URL is set.
    for var, e in env.items():
        value = e.get("value") or ""
        if var in GRPC_URL_ENV:
            urls = [u.strip() for u in value.split(",") if u.strip()]
            if not urls:
                err(target, res, f"container {name}: {var} holds no URL")
            for url in urls:
                if not re.fullmatch(r"https://[^/\s,]+(:[0-9]+)?/?", url) and not re.fullmatch(
                        r"https://\$\([A-Z0-9_]+\):[0-9]+", url):
                    err(target, res, f"container {name}: {var}={url}: gRPC URLs must be https://host:port")
        elif "http://" in value:
            err(target, res, f"container {name}: {var}={value}: plaintext URL (in-cluster gRPC is TLS)")
    # Every TLS file is a key of the component's own TLS Secret, mounted read-only, not optional.
    for var, e in env.items():
        kind = TLS_FILE_ENV.match(var)
        if not kind:
            continue
        value = e.get("value") or ""
        found = secret_file(c, volumes, value) if value.startswith("/") else None
        if found is None:
            err(target, res, f"container {name}: {var}={value!r} is not a file of a mounted Secret")
            continue
        secret_name, key, mount, secret = found
        if secret_name != TLS_SECRET[name]:
            err(target, res, f"container {name}: {var} reads Secret {secret_name}, not {TLS_SECRET[name]}")
        if key != TLS_FILE_KEY[kind.group(1)]:
            err(target, res, f"container {name}: {var} reads key {key}, want {TLS_FILE_KEY[kind.group(1)]}")
        if mount.get("readOnly") is not True:
            err(target, res, f"container {name}: the mount of {secret_name} must be readOnly")
        if secret.get("optional"):
            err(target, res, f"container {name}: Secret {secret_name} must not be optional (the Pod waits for its certificate)")
    # Every variable is one the binary reads (or one another variable expands with $(NAME)).
    expanded = set()
    for e in env.values():
        expanded |= set(re.findall(r"\$\(([A-Za-z0-9_]+)\)", e.get("value") or ""))
    known = KNOWN_ENV[name] | ALWAYS_KNOWN_ENV | expanded
    for var in env:
        if var not in known:
            err(target, res, f"container {name}: {var} is not read by the {' or '.join(CRATES[name])} binary")
    for var in sorted(REQUIRED_ENV.get(name, set()) - set(env)):
        err(target, res, f"container {name}: missing {var}")
    if name == "gateway" and (env.get("OPENSHELL_GATEWAY_KUBERNETES") or {}).get("value") != "true":
        err(target, res, "container gateway: OPENSHELL_GATEWAY_KUBERNETES must be \"true\"")
    for var in ("OPENSHELL_GATEWAY_TLS_CERT", "OPENSHELL_SUPERVISOR_TLS_CERT", "OPENSHELL_WEBHOOK_TLS_CERT"):
        if var in env and not var.startswith(f"OPENSHELL_{name.upper()}_"):
            err(target, res, f"container {name}: sets {var}, another component's certificate")
    if name == "supervisor":
        runtime = (env.get("OPENSHELL_SUPERVISOR_POOL_RUNTIME_ADDRESS") or {}).get("value") or ""
        if runtime != "https://$(OPENSHELL_POD_IP):7443":
            err(target, res, "container supervisor: OPENSHELL_SUPERVISOR_POOL_RUNTIME_ADDRESS must be https://$(OPENSHELL_POD_IP):7443")
    if name == "webhook":
        # Sidecars verify members' certificates against this name: it must be in them.
        tls_name = (env.get("OPENSHELL_WEBHOOK_SUPERVISOR_TLS_NAME") or {}).get("value")
        if tls_name is not None and tls_name not in service_names("openshell-supervisor"):
            err(target, res, f"container webhook: OPENSHELL_WEBHOOK_SUPERVISOR_TLS_NAME={tls_name} is not a name of the supervisor certificate")
    if name == "gateway":
        # The key-encryption keys are keys of Secret openshell-gateway-kek (which
        # pool-certs.sh creates), mounted read-only, not optional.
        for var, key in (("OPENSHELL_GATEWAY_KEY_ENCRYPTION_KEY_FILE", "kek"),
                         ("OPENSHELL_GATEWAY_PREVIOUS_KEY_ENCRYPTION_KEY_FILE", "previous")):
            value = (env.get(var) or {}).get("value") or ""
            if var not in env:
                continue
            found = secret_file(c, volumes, value) if value.startswith("/") else None
            if found is None or found[0] != KEK_SECRET or found[1] != key:
                err(target, res, f"container gateway: {var}={value!r} must be key {key} of the mounted Secret {KEK_SECRET}")
                continue
            if found[2].get("readOnly") is not True or found[3].get("optional"):
                err(target, res, f"container gateway: Secret {KEK_SECRET} must be mounted readOnly and not optional")
            if (found[3].get("defaultMode") or 0o644) & 0o007:
                err(target, res, f"container gateway: Secret {KEK_SECRET} must not be world-readable (defaultMode)")
        if KEK_SECRET not in POOL_CERTS_TEXT:
            err(target, res, f"kustomize/pool-certs.sh does not create Secret {KEK_SECRET}")
    if name == "supervisor":
        # The token file is the Pod's own ServiceAccount token for the gateway's audience,
        # projected beside trust.jwks from the openshell-supervisor-token Secret.
        token_file = (env.get("OPENSHELL_SUPERVISOR_TOKEN_FILE") or {}).get("value") or ""
        def projects_token(volume):
            sources = ((volume or {}).get("projected") or {}).get("sources") or []
            token = any((s.get("serviceAccountToken") or {}).get("audience") == "openshell-gateway"
                        and (s.get("serviceAccountToken") or {}).get("path") == os.path.basename(token_file)
                        for s in sources)
            trust = any((s.get("secret") or {}).get("name") == "openshell-supervisor-token" for s in sources)
            return token and trust
        mounts = [m for m in c.get("volumeMounts") or [] if projects_token(volumes.get(m.get("name")))]
        if not any(os.path.dirname(token_file) == m.get("mountPath", "").rstrip("/") for m in mounts):
            err(target, res, "container supervisor: OPENSHELL_SUPERVISOR_TOKEN_FILE must be the Pod's ServiceAccount token (audience openshell-gateway) projected with the openshell-supervisor-token Secret")


def check_webhook(target, res):
    for wh in res.get("webhooks") or []:
        if wh.get("sideEffects") != "None":
            err(target, res, "sideEffects must be None")
        if wh.get("admissionReviewVersions") != ["v1"]:
            err(target, res, "admissionReviewVersions must be [v1]")
        if not (isinstance(wh.get("timeoutSeconds"), int) and wh["timeoutSeconds"] <= 5):
            err(target, res, "timeoutSeconds must be set and <= 5")
        if wh.get("failurePolicy") not in ("Fail", "Ignore"):
            err(target, res, "failurePolicy must be set explicitly")
        ns = wh.get("namespaceSelector") or {}
        if (ns.get("matchLabels") or {}).get("supervision.openshell.ai/shared") != "enabled":
            err(target, res, "namespaceSelector must require supervision.openshell.ai/shared=enabled")
        excluded = set()
        for expr in ns.get("matchExpressions") or []:
            if expr.get("key") == "kubernetes.io/metadata.name" and expr.get("operator") == "NotIn":
                excluded |= set(expr.get("values") or [])
        if not SYSTEM_NAMESPACES <= excluded:
            err(target, res, f"namespaceSelector must exclude {sorted(SYSTEM_NAMESPACES - excluded)}")
        # Opted-out Pods must still reach the webhook, which refuses the ones that would
        # reach a sidecar and leaves the others uninjected.
        if wh.get("objectSelector"):
            err(target, res, "must have no objectSelector: opted-out Pods are reviewed too (the refusals hold for them)")
        if wh.get("reinvocationPolicy") != "Never":
            err(target, res, "reinvocationPolicy must be Never (a Pod arriving with the injected volumes is refused)")
        rules = sorted((tuple(r.get("apiGroups") or []), tuple(r.get("resources") or []),
                        tuple(r.get("operations") or [])) for r in wh.get("rules") or [])
        if rules != [(("",), ("pods",), ("CREATE",)), (("",), ("pods/ephemeralcontainers",), ("UPDATE",))]:
            err(target, res, "must be registered for pods CREATE and pods/ephemeralcontainers UPDATE only")
        svc = (wh.get("clientConfig") or {}).get("service") or {}
        if (svc.get("name"), svc.get("namespace"), svc.get("port")) != ("openshell-webhook", "openshell-supervision", 443):
            err(target, res, "clientConfig.service must be openshell-webhook.openshell-supervision:443")


def check_rbac(target, res):
    for rule in res.get("rules") or []:
        for field in ("apiGroups", "resources", "verbs"):
            if "*" in (rule.get(field) or []):
                err(target, res, f"wildcard in {field}")
        # Secrets: only create may be unrestricted (RBAC cannot restrict it by name).
        if "secrets" in (rule.get("resources") or []):
            if set(rule.get("verbs") or []) - {"create"} and not rule.get("resourceNames"):
                err(target, res, "secrets other than create must be restricted by resourceNames")


def schema_has(schema, json_path):
    """Whether a printer column's JSONPath (.a.b or .a[?(...)].b) names declared properties."""
    node = schema
    for part in re.sub(r"\[\?\(.*?\)\]", "[]", json_path).strip(".").split("."):
        if part.endswith("[]"):
            node = (node.get("properties") or {}).get(part[:-2]) or {}
            node = node.get("items") or {}
            continue
        node = (node.get("properties") or {}).get(part)
        if node is None:
            return False
    return True


# The custom resources: CRD name → the printer columns `kubectl get` shows by default (exactly
# these, in this order; more only with priority 1, `-o wide`), and what the gateway's Role
# must grant on them (resource, verb, name or None).
POOL_CRDS = {
    "supervisorpools.supervision.openshell.ai": (
        ("Ready", "Degraded", "Coordinator", "Members", "Instances", "Age"),
        (("supervisorpools", "create", None), ("supervisorpools", "patch", "openshell"),
         ("supervisorpools/status", "patch", "openshell")),
    ),
    "supervisorpooloperations.supervision.openshell.ai": (
        ("Kind", "Member", "Phase", "Succeeded", "Moves", "Age"),
        (("supervisorpooloperations", "watch", "x"), ("supervisorpooloperations", "patch", "x"),
         ("supervisorpooloperations/status", "patch", "x")),
    ),
}


def check_pool_crd(target, kinds):
    """The SupervisorPool and SupervisorPoolOperation CRDs: namespaced, a status subresource,
    printer columns on declared fields, and the gateway's Role may do what it does with them."""
    crds = {c["metadata"]["name"]: c for c in kinds.get("CustomResourceDefinition", [])}
    roles = [r for r in kinds.get("Role", []) if r["metadata"]["name"] == "openshell-gateway"]
    rules = [rule for r in roles for rule in r.get("rules") or []
             if "supervision.openshell.ai" in (rule.get("apiGroups") or [])]
    def granted(resource, verb, name=None):
        return any(resource in (rule.get("resources") or []) and verb in (rule.get("verbs") or [])
                   and (not rule.get("resourceNames") or name in rule["resourceNames"]) for rule in rules)
    for crd_name, (wanted_columns, grants) in POOL_CRDS.items():
        crd = crds.get(crd_name)
        if crd is None:
            errors.append(f"{target}: missing CustomResourceDefinition {crd_name}")
            continue
        if crd["spec"].get("scope") != "Namespaced":
            err(target, crd, "must be namespaced (in the install namespace)")
        for version in crd["spec"]["versions"]:
            if "status" not in (version.get("subresources") or {}):
                err(target, crd, f"{version['name']}: needs the status subresource")
            schema = version["schema"]["openAPIV3Schema"]
            columns = {c["name"]: c for c in version.get("additionalPrinterColumns") or []}
            for name in wanted_columns:
                if name not in columns:
                    err(target, crd, f"{version['name']}: no printer column {name}")
            default = tuple(c["name"] for c in version.get("additionalPrinterColumns") or []
                            if not c.get("priority"))
            if default != tuple(wanted_columns):
                err(target, crd, f"{version['name']}: default printer columns {default}, want {wanted_columns}")
            for column in columns.values():
                path = column["jsonPath"]
                if not path.startswith(".metadata.") and not schema_has(schema, path):
                    err(target, crd, f"printer column {column['name']}: {path} is not in the schema")
        for resource, verb, name in grants:
            if not granted(resource, verb, name):
                errors.append(f"{target}: Role openshell-gateway lacks {verb} on {resource} {name or ''}".rstrip())


for target, path in targets:
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    kinds = {}
    for res in docs:
        kind = res.get("kind")
        kinds.setdefault(kind, []).append(res)
        group = res.get("apiVersion", "").split("/")[0] if "/" in res.get("apiVersion", "") else ""
        if group.endswith("cert-manager.io"):
            skipped.add(f"{res.get('apiVersion')} {kind} (no built-in schema; needs cert-manager's CRDs)")
        elif group == "monitoring.coreos.com":
            skipped.add(f"{res.get('apiVersion')} {kind} (no built-in schema; needs the Prometheus "
                        "Operator's CRDs; scripts/check-monitoring.sh checks it)")
        else:
            for version in versions:
                try:
                    kubernetes_validate.validate(res, version, strict=True)
                except ValidationError as e:
                    path_ = ".".join(str(p) for p in e.path)
                    err(target, res, f"Kubernetes {version} schema: {path_}: {e.message}")
                except (SchemaNotFoundError, InvalidSchemaError) as e:
                    err(target, res, f"Kubernetes {version}: no schema: {e}")
        if kind in WORKLOADS:
            check_pod(target, res, res["spec"]["template"]["spec"])
        elif kind == "Pod":
            check_pod(target, res, res["spec"])
        elif kind == "MutatingWebhookConfiguration":
            check_webhook(target, res)
        elif kind in ("Role", "ClusterRole"):
            check_rbac(target, res)

    # Install-level rules.
    deployments = {d["metadata"]["name"]: d for d in kinds.get("Deployment", [])}
    for name in ("openshell-gateway", "openshell-supervisor", "openshell-webhook"):
        d = deployments.get(name)
        if d is None:
            errors.append(f"{target}: missing Deployment {name}")
            continue
        if d["spec"].get("replicas") != 2:
            err(target, d, "must run 2 replicas")
        labels = d["spec"]["selector"]["matchLabels"]
        pdbs = [p for p in kinds.get("PodDisruptionBudget", [])
                if p["spec"].get("selector", {}).get("matchLabels") == labels]
        if not pdbs:
            err(target, d, "has no PodDisruptionBudget")
    sup = deployments.get("openshell-supervisor")
    if sup and sup["spec"]["template"]["spec"].get("automountServiceAccountToken") is not False:
        err(target, sup, "supervisors must not mount a ServiceAccount token")
    services = {s["metadata"]["name"]: s for s in kinds.get("Service", [])}
    for name, port in (("openshell-gateway", 8443), ("openshell-supervisor", 7443), ("openshell-webhook", 443)):
        s = services.get(name)
        if s is None or port not in [p.get("port") for p in s["spec"].get("ports", [])]:
            errors.append(f"{target}: Service {name} must expose port {port}")
    if not kinds.get("MutatingWebhookConfiguration"):
        errors.append(f"{target}: missing MutatingWebhookConfiguration")
    check_pool_crd(target, kinds)
    # The TLS Secrets: written by pool-certs.sh, and by cert-manager where its component is used.
    for secret, service in TLS_SERVICE.items():
        if POOL_CERTS.get(service) != secret:
            errors.append(f"{target}: kustomize/pool-certs.sh does not write Secret {secret} for {service}")
    certificates = {c["spec"].get("secretName"): c for c in kinds.get("Certificate", [])}
    if certificates:
        issuers = {i["metadata"]["name"]: i for i in kinds.get("Issuer", [])}
        ca_secrets = {c["spec"].get("secretName") for c in certificates.values() if c["spec"].get("isCA")}
        for secret, service in TLS_SERVICE.items():
            cert = certificates.get(secret)
            if cert is None:
                errors.append(f"{target}: no cert-manager Certificate writes Secret {secret}")
                continue
            missing = set(service_names(service)) - set(cert["spec"].get("dnsNames") or [])
            if missing:
                err(target, cert, f"dnsNames lack {sorted(missing)}")
            if "server auth" not in (cert["spec"].get("usages") or []):
                err(target, cert, "usages must include server auth")
            issuer = issuers.get((cert["spec"].get("issuerRef") or {}).get("name")) or {}
            if ((issuer.get("spec") or {}).get("ca") or {}).get("secretName") not in ca_secrets:
                err(target, cert, "must be issued by the CA Issuer (one CA for the pool)")
        webhook_cert = certificates.get("openshell-webhook-tls")
        for wh in kinds.get("MutatingWebhookConfiguration", []):
            inject = (wh["metadata"].get("annotations") or {}).get("cert-manager.io/inject-ca-from")
            if webhook_cert and inject != f"{INSTALL_NAMESPACE}/{webhook_cert['metadata']['name']}":
                err(target, wh, f"cert-manager.io/inject-ca-from must name Certificate {webhook_cert['metadata']['name']}")
    print(f"validated {target}: {len(docs)} resources against Kubernetes {', '.join(versions)} (strict)")

for note in sorted(notes):
    print(f"note: {note}")
for note in sorted(skipped):
    print(f"note: skipped schema validation of custom resource {note}")
if errors:
    print(f"\n{len(errors)} problem(s):", file=sys.stderr)
    for e in errors:
        print(f"  - {e}", file=sys.stderr)
    sys.exit(1)
PY

# --- The certificate script (without cert-manager), against a fake kubectl ---------------------
bash "$ROOT/scripts/check-pool-certs.sh" || failed=1

if [ "$failed" -ne 0 ]; then
  echo "check-manifests: FAILED" >&2
  exit 1
fi
echo "check-manifests: OK"
