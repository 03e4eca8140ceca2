#!/usr/bin/env bash
# Tests kustomize/pool-certs.sh against a fake kubectl (Secrets and the webhook configuration
# kept as files; every call logged): the CA, the three serving certificates and their Secrets,
# the caBundle patch, renewal, the three-step CA rotation, adopting the former
# webhook-cert.sh CA, --dry-run, the gateway's key-encryption key Secret (created once, never
# replaced; rotated in two steps), and that no private key or KEK is ever printed or passed on
# a command line. Needs bash, openssl and python3; no cluster. Run by scripts/check-manifests.sh.
#
# Exit status: 0 when everything passes, 1 otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SCRIPT="$ROOT/kustomize/pool-certs.sh"
T="$(mktemp -d)"
trap 'rm -rf "$T"' EXIT

command -v openssl >/dev/null 2>&1 || { echo "check-pool-certs: openssl not found" >&2; exit 1; }
# The interpreter itself, not a version-manager shim (the fake kubectl runs dozens of times).
PY="$(python3 -c 'import sys; print(sys.executable)')"

# --- A fake kubectl ----------------------------------------------------------------------------
{ echo "#!$PY -S"; cat; } > "$T/kubectl" <<'PY'
"""Just the kubectl calls pool-certs.sh makes, on files in $FAKE_KUBE."""
import json, os, re, sys

state = os.environ["FAKE_KUBE"]
with open(os.path.join(state, "calls.log"), "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\n")
args = sys.argv[1:]
namespace = "default"
rest = []
i = 0
while i < len(args):
    if args[i] in ("-n", "--namespace"):
        namespace = args[i + 1]
        i += 2
    else:
        rest.append(args[i])
        i += 1


def path(kind, name):
    return os.path.join(state, f"{kind}.{namespace if kind == 'secret' else '_'}.{name}.json")


def load(kind, name):
    try:
        with open(path(kind, name)) as f:
            return json.load(f)
    except FileNotFoundError:
        sys.stderr.write(f'Error from server (NotFound): {kind}s "{name}" not found\n')
        sys.exit(1)


def option(name):
    for j, a in enumerate(rest):
        if a == name:
            return rest[j + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


verb = rest[0]
if verb == "get":
    kind, name = rest[1], rest[2]
    obj = load(kind, name)
    out = option("-o")
    if out is None:
        print(f"{kind}/{name}")
    elif kind == "secret" and (m := re.fullmatch(r"jsonpath=\{\.data\.(.+)\}", out)):
        key = m.group(1).replace("\\.", ".")
        sys.stdout.write(obj.get("data", {}).get(key, ""))
    elif kind == "mutatingwebhookconfiguration" and out == "jsonpath={range .webhooks[*]}x{end}":
        sys.stdout.write("x" * len(obj["webhooks"]))
    else:
        sys.exit(f"fake kubectl: unsupported output {out}")
elif verb in ("create", "replace") and rest[1:] == ["-f", "-"]:
    obj = json.load(sys.stdin)
    assert obj["kind"] == "Secret"
    assert obj["metadata"]["namespace"] == namespace
    name = obj["metadata"]["name"]
    exists = os.path.exists(path("secret", name))
    if verb == "create" and exists:
        sys.exit(f'Error from server (AlreadyExists): secrets "{name}" already exists')
    if verb == "replace" and not exists:
        sys.exit(f'Error from server (NotFound): secrets "{name}" not found')
    with open(path("secret", name), "w") as f:
        json.dump(obj, f)
    print(f"secret/{name} {verb}d")
elif verb == "patch" and rest[1] == "mutatingwebhookconfiguration":
    name = rest[2]
    obj = load("mutatingwebhookconfiguration", name)
    assert option("--type") == "json"
    for op in json.loads(option("-p")):
        m = re.fullmatch(r"/webhooks/(\d+)/clientConfig/caBundle", op["path"])
        assert op["op"] == "add" and m, op
        obj["webhooks"][int(m.group(1))]["clientConfig"]["caBundle"] = op["value"]
    with open(path("mutatingwebhookconfiguration", name), "w") as f:
        json.dump(obj, f)
    print(f"mutatingwebhookconfiguration/{name} patched")
else:
    sys.exit(f"fake kubectl: unsupported call {args}")
PY
chmod +x "$T/kubectl"

failures=0
fail() { echo "  FAIL: $*" >&2; failures=$((failures + 1)); }
pass() { echo "  ok: $*"; }

new_cluster() { # a fresh fake cluster with a webhook configuration of two webhooks
  export FAKE_KUBE="$T/cluster-$1"
  mkdir -p "$FAKE_KUBE"
  echo '{"webhooks":[{"clientConfig":{}},{"clientConfig":{}}]}' \
    > "$FAKE_KUBE/mutatingwebhookconfiguration._.openshell-supervision.json"
}
run() { # args...: run the script (output in $T/out), then dump the cluster; returns its status
  local status=0
  KUBECTL="$T/kubectl" bash "$SCRIPT" "$@" > "$T/out" 2>&1 || status=$?
  dump
  return "$status"
}
dump() { # every Secret key decoded to $T/s/<secret>/<key> (plus _keys: type and sorted keys),
         # every caBundle of the webhook configuration to $T/cabundle-<i>.pem
  rm -rf "$T/s" "$T"/cabundle-*.pem
  "$PY" -S - "$FAKE_KUBE" "$T" <<'PY'
import base64, glob, json, os, sys
state, out = sys.argv[1], sys.argv[2]
for path in glob.glob(os.path.join(state, "secret.openshell-supervision.*.json")):
    name = os.path.basename(path)[len("secret.openshell-supervision."):-len(".json")]
    obj = json.load(open(path))
    os.makedirs(os.path.join(out, "s", name))
    for key, value in obj.get("data", {}).items():
        with open(os.path.join(out, "s", name, key), "wb") as f:
            f.write(base64.b64decode(value))
    with open(os.path.join(out, "s", name, "_keys"), "w") as f:
        f.write(" ".join([obj.get("type", "")] + sorted(obj.get("data", {}))))
config = json.load(open(os.path.join(state, "mutatingwebhookconfiguration._.openshell-supervision.json")))
for i, wh in enumerate(config["webhooks"]):
    with open(os.path.join(out, f"cabundle-{i}.pem"), "wb") as f:
        f.write(base64.b64decode(wh["clientConfig"].get("caBundle", "")))
PY
}
key_of() { # secret key: decoded value on stdout (nothing when absent)
  cat "$T/s/$1/$2" 2>/dev/null || true
}
keys_of() { # secret: its type and sorted data keys
  cat "$T/s/$1/_keys" 2>/dev/null || true
}
ca_bundles() { :; } # dumped by run
cert_count() { grep -c 'BEGIN CERTIFICATE' "$1" || true; }
fingerprint() { openssl x509 -noout -fingerprint -sha256 -in "$1"; }
signed_by() { # cert-file ca-file
  openssl verify -partial_chain -CAfile "$2" "$1" >/dev/null 2>&1
}
no_key_leaked() { # the script's output and every kubectl argument hold no private key
  local what="$1"
  if grep -q 'PRIVATE KEY' "$T/out" "$FAKE_KUBE/calls.log"; then
    fail "$what: a private key was printed or passed as an argument"
    return
  fi
  # Past the PEM header and the ASN.1 prefix every EC key shares: key material.
  local s k b body
  for s in openshell-ca openshell-gateway-tls openshell-supervisor-tls openshell-webhook-tls; do
    for k in tls.key next.key; do
      b="$(key_of "$s" "$k" | base64 | tr -d '\n')"
      [ -n "$b" ] || continue
      # The PEM body's second 64-character line, as printed.
      body="$(key_of "$s" "$k" | sed -n 3p)"
      if grep -qF -e "${b:80:40}" -e "${body:8:40}" "$T/out" "$FAKE_KUBE/calls.log"; then
        fail "$what: $s/$k appears in output or arguments"
      fi
    done
  done
}

echo "pool-certs.sh:"

# 1. First run: CA, three leaves, caBundle.
new_cluster fresh
if run; then pass "first run succeeds"; else fail "first run: $(cat "$T/out")"; fi
key_of openshell-ca tls.crt > "$T/ca1.pem"
[ "$(cert_count "$T/ca1.pem")" = 1 ] || fail "Secret openshell-ca has no CA certificate"
openssl x509 -in "$T/ca1.pem" -noout -text | grep -q 'CA:TRUE' || fail "the CA is not a CA"
for svc in openshell-gateway openshell-supervisor openshell-webhook; do
  secret="$svc-tls"
  [ "$(keys_of "$secret")" = "kubernetes.io/tls ca.crt tls.crt tls.key" ] \
    || fail "$secret: type and keys are $(keys_of "$secret")"
  key_of "$secret" tls.crt > "$T/$svc.crt"
  key_of "$secret" tls.key > "$T/$svc.key"
  key_of "$secret" ca.crt > "$T/$svc.ca"
  cmp -s "$T/$svc.ca" "$T/ca1.pem" || fail "$secret: ca.crt is not the CA"
  signed_by "$T/$svc.crt" "$T/ca1.pem" || fail "$secret: tls.crt is not signed by the CA"
  sans="$(openssl x509 -in "$T/$svc.crt" -noout -ext subjectAltName | tail -n +2 | tr -d ' ')"
  want="DNS:$svc,DNS:$svc.openshell-supervision,DNS:$svc.openshell-supervision.svc,DNS:$svc.openshell-supervision.svc.cluster.local"
  [ "$sans" = "$want" ] || fail "$secret: SANs $sans, want $want"
  openssl x509 -in "$T/$svc.crt" -noout -ext extendedKeyUsage | grep -q 'TLS Web Server Authentication' \
    || fail "$secret: not a server certificate"
  [ "$(openssl pkey -in "$T/$svc.key" -pubout)" = "$(openssl x509 -in "$T/$svc.crt" -noout -pubkey)" ] \
    || fail "$secret: tls.key does not match tls.crt"
done
ca_bundles
for i in 0 1; do
  cmp -s "$T/cabundle-$i.pem" "$T/ca1.pem" || fail "webhook $i: caBundle is not the CA"
done
no_key_leaked "first run"
pass "CA, three serving certificates with the Service names, ca.crt and caBundle"

# 2. Renewal keeps the CA, renews the leaves.
cp "$T/openshell-gateway.crt" "$T/gw-before.crt"
if run; then pass "second run succeeds"; else fail "second run: $(cat "$T/out")"; fi
key_of openshell-ca tls.crt | cmp -s - "$T/ca1.pem" || fail "renewal replaced the CA"
key_of openshell-gateway-tls tls.crt > "$T/gw-after.crt"
[ "$(fingerprint "$T/gw-before.crt")" != "$(fingerprint "$T/gw-after.crt")" ] || fail "renewal kept the old certificate"
signed_by "$T/gw-after.crt" "$T/ca1.pem" || fail "the renewed certificate is not signed by the CA"
[ "$(grep -c '"create"' "$FAKE_KUBE/calls.log")" = 5 ] || fail "expected 5 creates over two runs (4 TLS, 1 KEK)"
[ "$(grep -c '"replace"' "$FAKE_KUBE/calls.log")" = 4 ] || fail "expected the second run to replace the 4 Secrets"
no_key_leaked "renewal"
pass "renewal keeps the CA and the caBundle, issues new certificates, replaces the Secrets"

# 2b. The gateway's key-encryption key: created by the first run, kept by the second.
kek_leaked() { # KEK value: whether it appears in the output or a kubectl argument
  [ -n "$1" ] && grep -qF -e "$1" "$T/out" "$FAKE_KUBE/calls.log"
}
[ "$(keys_of openshell-gateway-kek)" = "Opaque kek" ] || fail "openshell-gateway-kek: type and keys are $(keys_of openshell-gateway-kek)"
kek1="$(key_of openshell-gateway-kek kek)"
[ "$(printf '%s' "$kek1" | base64 -d | wc -c)" = 32 ] || fail "the KEK is not 32 bytes in base64"
[ "$(grep -c 'openshell-gateway-kek' "$FAKE_KUBE/calls.log" | tr -d ' ')" -ge 2 ] || fail "the KEK Secret was not looked up"
run || fail "third run: $(cat "$T/out")"
[ "$(key_of openshell-gateway-kek kek)" = "$kek1" ] || fail "a run without arguments replaced the KEK"
kek_leaked "$kek1" && fail "the KEK appears in output or arguments"
if run --drop-previous-kek; then pass "--drop-previous-kek without a rotation is a no-op"; else fail "--drop-previous-kek: $(cat "$T/out")"; fi
[ "$(key_of openshell-gateway-kek kek)" = "$kek1" ] || fail "--drop-previous-kek without a rotation changed the KEK"
if run --rotate-kek; then pass "--rotate-kek succeeds"; else fail "--rotate-kek: $(cat "$T/out")"; fi
kek2="$(key_of openshell-gateway-kek kek)"
[ "$(keys_of openshell-gateway-kek)" = "Opaque kek previous" ] || fail "--rotate-kek: keys are $(keys_of openshell-gateway-kek)"
[ "$(key_of openshell-gateway-kek previous)" = "$kek1" ] || fail "--rotate-kek: previous is not the old KEK"
[ -n "$kek2" ] && [ "$kek2" != "$kek1" ] || fail "--rotate-kek: no new KEK"
if run --rotate-kek; then fail "a second --rotate-kek succeeded"; else pass "a second --rotate-kek is refused"; fi
[ "$(key_of openshell-gateway-kek previous)" = "$kek1" ] || fail "a refused --rotate-kek changed the Secret"
if run --drop-previous-kek; then pass "--drop-previous-kek succeeds"; else fail "--drop-previous-kek: $(cat "$T/out")"; fi
[ "$(keys_of openshell-gateway-kek)" = "Opaque kek" ] && [ "$(key_of openshell-gateway-kek kek)" = "$kek2" ] \
  || fail "--drop-previous-kek: keys $(keys_of openshell-gateway-kek)"
for k in "$kek1" "$kek2"; do kek_leaked "$k" && fail "a KEK appears in output or arguments"; done
pass "key-encryption key: created once, kept, rotated with the old one as previous, previous dropped"

# 3. CA rotation in three steps.
if run --promote-ca; then fail "--promote-ca without a staged CA succeeded"; else pass "--promote-ca without a staged CA is refused"; fi
if run --new-ca; then pass "--new-ca succeeds"; else fail "--new-ca: $(cat "$T/out")"; fi
key_of openshell-ca next.crt > "$T/ca2.pem"
[ "$(cert_count "$T/ca2.pem")" = 1 ] || fail "--new-ca staged no CA"
key_of openshell-supervisor-tls ca.crt > "$T/bundle.pem"
[ "$(cert_count "$T/bundle.pem")" = 2 ] || fail "--new-ca: the bundle does not hold both CAs"
key_of openshell-supervisor-tls tls.crt > "$T/sup.crt"
signed_by "$T/sup.crt" "$T/ca1.pem" || fail "--new-ca: certificates must still be signed by the current CA"
ca_bundles
cmp -s "$T/cabundle-0.pem" "$T/bundle.pem" || fail "--new-ca: caBundle is not the two-CA bundle"
if run --new-ca; then fail "a second --new-ca succeeded"; else pass "a second --new-ca is refused"; fi
if run --promote-ca; then pass "--promote-ca succeeds"; else fail "--promote-ca: $(cat "$T/out")"; fi
key_of openshell-ca tls.crt | cmp -s - "$T/ca2.pem" || fail "--promote-ca: the staged CA does not sign"
key_of openshell-supervisor-tls tls.crt > "$T/sup.crt"
signed_by "$T/sup.crt" "$T/ca2.pem" || fail "--promote-ca: certificates are not signed by the new CA"
signed_by "$T/sup.crt" "$T/ca1.pem" && fail "--promote-ca: certificates still signed by the old CA"
key_of openshell-gateway-tls ca.crt > "$T/bundle.pem"
[ "$(cert_count "$T/bundle.pem")" = 2 ] || fail "--promote-ca: the old CA must stay trusted"
[ -z "$(key_of openshell-ca next.crt)" ] || fail "--promote-ca: a staged CA is left"
if run --drop-old-ca; then pass "--drop-old-ca succeeds"; else fail "--drop-old-ca: $(cat "$T/out")"; fi
key_of openshell-webhook-tls ca.crt | cmp -s - "$T/ca2.pem" || fail "--drop-old-ca: ca.crt is not the new CA alone"
ca_bundles
cmp -s "$T/cabundle-1.pem" "$T/ca2.pem" || fail "--drop-old-ca: caBundle is not the new CA alone"
[ "$(keys_of openshell-ca)" = "kubernetes.io/tls ca.crt tls.crt tls.key" ] || fail "--drop-old-ca: openshell-ca keys $(keys_of openshell-ca)"
no_key_leaked "rotation"
pass "rotation: staged CA trusted first, then signing with the old one trusted, then dropped"

# 4. Adopting the CA of the former webhook-cert.sh.
new_cluster legacy
openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -keyout "$T/legacy.key" \
  -out "$T/legacy.crt" -days 30 -subj "/CN=openshell-webhook-ca" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
"$PY" - "$FAKE_KUBE/secret.openshell-supervision.openshell-webhook-ca.json" "$T/legacy.crt" "$T/legacy.key" <<'PY'
import base64, json, sys
data = {k: base64.b64encode(open(p, "rb").read()).decode() for k, p in (("tls.crt", sys.argv[2]), ("tls.key", sys.argv[3]))}
json.dump({"kind": "Secret", "type": "kubernetes.io/tls", "data": data}, open(sys.argv[1], "w"))
PY
if run; then pass "run with a legacy CA succeeds"; else fail "legacy: $(cat "$T/out")"; fi
key_of openshell-ca tls.crt | cmp -s - "$T/legacy.crt" || fail "the legacy CA was not adopted"
grep -q 'adopting' "$T/out" || fail "adopting the legacy CA is not reported"
key_of openshell-webhook-tls tls.crt > "$T/wh.crt"
signed_by "$T/wh.crt" "$T/legacy.crt" || fail "the webhook certificate is not signed by the adopted CA"
no_key_leaked "legacy"
pass "the CA of Secret openshell-webhook-ca is adopted (the caBundle stays valid)"

# 5. --dry-run touches no cluster; bad arguments are refused.
new_cluster dry
if OUT="$T/dry-out" run --dry-run; then pass "--dry-run succeeds"; else fail "--dry-run: $(cat "$T/out")"; fi
[ ! -s "$FAKE_KUBE/calls.log" ] || fail "--dry-run called kubectl: $(cat "$FAKE_KUBE/calls.log")"
for f in ca.crt ca.key caBundle.pem openshell-gateway.crt openshell-gateway.key openshell-supervisor.crt \
  openshell-supervisor.key openshell-webhook.crt openshell-webhook.key; do
  [ -s "$T/dry-out/$f" ] || fail "--dry-run did not write $f"
done
signed_by "$T/dry-out/openshell-gateway.crt" "$T/dry-out/caBundle.pem" || fail "--dry-run: certificate not signed by the CA"
[ "$(stat -c %a "$T/dry-out/openshell-gateway.key")" = 600 ] || fail "--dry-run: key file is not private"
status=0
run --bogus || status=$?
[ "$status" = 2 ] || fail "an unknown argument exits $status, want 2"
status=0
run --new-ca --drop-old-ca || status=$?
[ "$status" = 2 ] || fail "two rotation steps at once exit $status, want 2"
pass "--dry-run writes files only; bad arguments are refused"

if [ "$failures" -ne 0 ]; then
  echo "check-pool-certs: $failures failure(s)" >&2
  exit 1
fi
echo "check-pool-certs: OK"
