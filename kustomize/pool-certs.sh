#!/usr/bin/env bash
# Provision the pool's TLS certificates WITHOUT cert-manager. Needs only openssl and kubectl
# (with access to the cluster, after the install is applied).
#
#   kustomize/pool-certs.sh               # first install, and again to renew the certificates
#   kustomize/pool-certs.sh --new-ca      # CA rotation 1/3: add a new CA to the trust bundle
#   kustomize/pool-certs.sh --promote-ca  # CA rotation 2/3: sign with the new CA
#   kustomize/pool-certs.sh --drop-old-ca # CA rotation 3/3: trust only the current CA
#   kustomize/pool-certs.sh --dry-run     # write the files to ./pool-certs-out, touch nothing
#   kustomize/pool-certs.sh --rotate-kek  # KEK rotation 1/2: new key-encryption key, old as previous
#   kustomize/pool-certs.sh --drop-previous-kek # KEK rotation 2/2: once the keys are re-sealed
#
# What it does:
#  1. Keeps one CA in Secret openshell-ca (EC P-256, 10 years): reused on every run; created
#     on the first (adopting the CA of Secret openshell-webhook-ca, written by the former
#     webhook-cert.sh, if that exists, so the webhook's caBundle stays valid).
#  2. Issues three serving certificates (EC P-256, default 1 year) signed by it, each for its
#     Service's names <svc>, <svc>.<ns>, <svc>.<ns>.svc, <svc>.<ns>.svc.cluster.local:
#       openshell-gateway    -> Secret openshell-gateway-tls     (gateway gRPC, 8443)
#       openshell-supervisor -> Secret openshell-supervisor-tls  (supervisor runtime, 7443)
#       openshell-webhook    -> Secret openshell-webhook-tls     (admission webhook, 443)
#     Each Secret is of type kubernetes.io/tls with tls.crt, tls.key and ca.crt (the trust
#     bundle). The Pods mount them and re-read the files when they change (the kubelet
#     refreshes Secret volumes within about a minute): no restart needed.
#  3. Sets the trust bundle as caBundle of the MutatingWebhookConfiguration.
#  4. Creates Secret openshell-gateway-kek (key `kek`: 32 random bytes, base64), the key that
#     seals the gateway's signing keys in its database — once: an existing one is never
#     replaced (its key opens the stored signing keys). --rotate-kek and --drop-previous-kek
#     touch only this Secret (see kustomize/README.md, "Key-encryption key").
#
# The trust bundle is the signing CA plus, during a rotation, the staged or the previous CA.
# The gateway delivers its Secret's ca.crt to every sidecar (ca.crt in each namespace's
# openshell-supervision-token), which takes a delivery round plus a kubelet sync. Rotate the
# CA in three runs, waiting a few minutes between them so every client has the bundle before
# a certificate it needs it for is served:
#   --new-ca      stage a new CA: trusted everywhere, not signing yet;
#   --promote-ca  the staged CA signs the new certificates; the old one stays trusted;
#   --drop-old-ca the old CA is no longer trusted.
#
# Secrets are created or replaced whole (no last-applied annotation, so no copy of a key in
# metadata); keys are never printed.
#
# Environment: NAMESPACE (openshell-supervision), WEBHOOK_CONFIG (openshell-supervision),
# DAYS (365), KUBECTL (kubectl), OUT (./pool-certs-out, --dry-run only).
set -euo pipefail

NAMESPACE="${NAMESPACE:-openshell-supervision}"
WEBHOOK_CONFIG="${WEBHOOK_CONFIG:-openshell-supervision}"
DAYS="${DAYS:-365}"
KUBECTL="${KUBECTL:-kubectl}"
CA_SECRET="openshell-ca"
LEGACY_CA_SECRET="openshell-webhook-ca"
# service:secret
LEAVES=(
  "openshell-gateway:openshell-gateway-tls"
  "openshell-supervisor:openshell-supervisor-tls"
  "openshell-webhook:openshell-webhook-tls"
)

action=renew
dry_run=0
for arg in "$@"; do
  case "$arg" in
    --new-ca | --promote-ca | --drop-old-ca)
      [ "$action" = renew ] || { echo "give at most one of --new-ca, --promote-ca, --drop-old-ca" >&2; exit 2; }
      action="${arg#--}"
      ;;
    --rotate-kek | --drop-previous-kek)
      [ "$action" = renew ] || { echo "give at most one of --new-ca, --promote-ca, --drop-old-ca, --rotate-kek, --drop-previous-kek" >&2; exit 2; }
      action="${arg#--}"
      ;;
    --dry-run) dry_run=1 ;;
    -h | --help) sed -n '2,45p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
case "$DAYS" in '' | *[!0-9]*) echo "DAYS must be a number of days: $DAYS" >&2; exit 2 ;; esac

command -v openssl >/dev/null || { echo "openssl is required" >&2; exit 1; }
start_dir="$PWD"
umask 077
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"

b64() { base64 | tr -d '\n'; }
unb64() { base64 -d; }
kc() { "$KUBECTL" --namespace "$NAMESPACE" "$@"; }

secret_exists() { kc get secret "$1" >/dev/null 2>&1; }

# secret_key SECRET KEY FILE: write the decoded key to FILE (empty when absent).
secret_key() {
  local escaped="${2//./\\.}"
  kc get secret "$1" -o "jsonpath={.data.${escaped}}" | unb64 > "$3"
}

# secret_json NAME TYPE KEY=FILE...: the Secret as JSON.
secret_json() {
  local name="$1" type="$2" sep="" pair
  shift 2
  printf '{"apiVersion":"v1","kind":"Secret","type":"%s",' "$type"
  printf '"metadata":{"name":"%s","namespace":"%s",' "$name" "$NAMESPACE"
  printf '"labels":{"app.kubernetes.io/part-of":"openshell-supervision","app.kubernetes.io/managed-by":"pool-certs.sh"}},'
  printf '"data":{'
  for pair in "$@"; do
    printf '%s"%s":"%s"' "$sep" "${pair%%=*}" "$(b64 < "${pair#*=}")"
    sep=","
  done
  printf '}}'
}

# put_secret NAME TYPE KEY=FILE...: create the Secret, or replace it whole if it exists.
put_secret() {
  if secret_exists "$1"; then
    secret_json "$@" | kc replace -f -
  else
    secret_json "$@" | kc create -f -
  fi
}

# --- The gateway's key-encryption key ------------------------------------------------------
KEK_SECRET="openshell-gateway-kek"
new_kek() { head -c 32 /dev/urandom | base64 > "$1"; }
case "$action" in
  rotate-kek | drop-previous-kek)
    [ "$dry_run" -eq 0 ] || { echo "--$action changes the cluster: no --dry-run" >&2; exit 2; }
    secret_exists "$KEK_SECRET" || { echo "no Secret $KEK_SECRET yet: run without arguments first" >&2; exit 1; }
    secret_key "$KEK_SECRET" kek kek.old
    secret_key "$KEK_SECRET" previous previous.old
    [ -s kek.old ] || { echo "Secret $KEK_SECRET has no key kek" >&2; exit 1; }
    if [ "$action" = rotate-kek ]; then
      [ ! -s previous.old ] || { echo "a KEK rotation is under way: finish it with --drop-previous-kek first" >&2; exit 1; }
      new_kek kek.new
      put_secret "$KEK_SECRET" Opaque kek=kek.new previous=kek.old
      echo "new key-encryption key in Secret $KEK_SECRET, the old one as previous: restart the gateways" \
        "(kubectl rollout restart deployment/openshell-gateway), wait until the coordinator re-sealed the" \
        "signing keys, then run --drop-previous-kek" >&2
    else
      [ -s previous.old ] || { echo "no previous key-encryption key in Secret $KEK_SECRET; nothing to drop" >&2; exit 0; }
      put_secret "$KEK_SECRET" Opaque kek=kek.old
      echo "dropped the previous key-encryption key from Secret $KEK_SECRET" >&2
    fi
    exit 0
    ;;
esac

new_ca() { # key cert
  openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
    -keyout "$1" -out "$2" -days 3650 -subj "/CN=openshell-ca $(date -u +%Y%m%dT%H%M%SZ)" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}

# --- The CA state: signing CA (ca.crt/ca.key), staged CA (next.*), previous CAs ------------
: > next.crt
: > next.key
: > previous.crt
if [ "$dry_run" -eq 0 ] && secret_exists "$CA_SECRET"; then
  secret_key "$CA_SECRET" tls.crt ca.crt
  secret_key "$CA_SECRET" tls.key ca.key
  secret_key "$CA_SECRET" next.crt next.crt
  secret_key "$CA_SECRET" next.key next.key
  secret_key "$CA_SECRET" previous.crt previous.crt
  [ -s ca.crt ] && [ -s ca.key ] || { echo "Secret $CA_SECRET has no tls.crt/tls.key" >&2; exit 1; }
elif [ "$dry_run" -eq 0 ] && secret_exists "$LEGACY_CA_SECRET"; then
  echo "adopting the CA of Secret $LEGACY_CA_SECRET (you may delete that Secret afterwards)" >&2
  secret_key "$LEGACY_CA_SECRET" tls.crt ca.crt
  secret_key "$LEGACY_CA_SECRET" tls.key ca.key
  [ -s ca.crt ] && [ -s ca.key ] || { echo "Secret $LEGACY_CA_SECRET has no tls.crt/tls.key" >&2; exit 1; }
else
  [ "$action" = renew ] || { echo "no CA yet: run without --$action first" >&2; exit 1; }
  echo "creating a new CA" >&2
  new_ca ca.key ca.crt
fi

case "$action" in
  new-ca)
    [ ! -s next.crt ] || { echo "a new CA is already staged: run with --promote-ca" >&2; exit 1; }
    echo "staging a new CA: trusted from now on, signing after --promote-ca" >&2
    new_ca next.key next.crt
    ;;
  promote-ca)
    [ -s next.crt ] && [ -s next.key ] || { echo "no staged CA: run with --new-ca first" >&2; exit 1; }
    echo "promoting the staged CA; the old CA stays trusted until --drop-old-ca" >&2
    cat ca.crt >> previous.crt
    mv next.crt ca.crt
    mv next.key ca.key
    : > next.crt
    : > next.key
    ;;
  drop-old-ca)
    [ -s previous.crt ] || echo "no previous CA in the bundle; nothing to drop" >&2
    : > previous.crt
    ;;
esac
openssl x509 -in ca.crt -noout -checkend 0 >/dev/null \
  || { echo "the signing CA has expired: rotate it (--new-ca, then --promote-ca)" >&2; exit 1; }
cat ca.crt next.crt previous.crt > bundle.crt

# --- Serving certificates ----------------------------------------------------------------------
for leaf in "${LEAVES[@]}"; do
  service="${leaf%%:*}"
  host="${service}.${NAMESPACE}.svc"
  cat > "${service}.ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:${service},DNS:${service}.${NAMESPACE},DNS:${host},DNS:${host}.cluster.local
EXT
  openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
    -keyout "${service}.key" -out "${service}.csr" -subj "/CN=${host}" 2>/dev/null
  openssl x509 -req -in "${service}.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
    -out "${service}.crt" -days "$DAYS" -extfile "${service}.ext" 2>/dev/null
  openssl verify -CAfile bundle.crt "${service}.crt" >/dev/null
done

if [ "$dry_run" -eq 1 ]; then
  out="${OUT:-$start_dir/pool-certs-out}"
  mkdir -p "$out"
  cp ca.crt ca.key "$out/"
  cp bundle.crt "$out/caBundle.pem"
  for leaf in "${LEAVES[@]}"; do
    service="${leaf%%:*}"
    cp "${service}.crt" "${service}.key" "$out/"
  done
  echo "dry run: wrote $out (ca.crt ca.key caBundle.pem and <service>.crt/.key for" \
    "openshell-gateway, openshell-supervisor, openshell-webhook); nothing applied" >&2
  exit 0
fi

ca_files=(tls.crt=ca.crt tls.key=ca.key ca.crt=bundle.crt)
[ -s next.crt ] && ca_files+=(next.crt=next.crt next.key=next.key)
[ -s previous.crt ] && ca_files+=(previous.crt=previous.crt)
put_secret "$CA_SECRET" kubernetes.io/tls "${ca_files[@]}"
for leaf in "${LEAVES[@]}"; do
  service="${leaf%%:*}"
  put_secret "${leaf#*:}" kubernetes.io/tls "tls.crt=${service}.crt" "tls.key=${service}.key" ca.crt=bundle.crt
done

# Once: a KEK that exists opens the stored signing keys and is never replaced here.
if secret_exists "$KEK_SECRET"; then
  echo "Secret $KEK_SECRET exists: kept" >&2
else
  new_kek kek.new
  put_secret "$KEK_SECRET" Opaque kek=kek.new
  echo "created the gateway's key-encryption key in Secret $KEK_SECRET" >&2
fi

count="$("$KUBECTL" get mutatingwebhookconfiguration "$WEBHOOK_CONFIG" -o jsonpath='{range .webhooks[*]}x{end}')"
[ -n "$count" ] || { echo "MutatingWebhookConfiguration $WEBHOOK_CONFIG has no webhooks" >&2; exit 1; }
bundle_b64="$(b64 < bundle.crt)"
patch="["
for ((i = 0; i < ${#count}; i++)); do
  [ "$i" -gt 0 ] && patch+=","
  patch+="{\"op\":\"add\",\"path\":\"/webhooks/${i}/clientConfig/caBundle\",\"value\":\"${bundle_b64}\"}"
done
patch+="]"
"$KUBECTL" patch mutatingwebhookconfiguration "$WEBHOOK_CONFIG" --type=json -p "$patch"
cas="$(grep -c 'BEGIN CERTIFICATE' bundle.crt)"
echo "certificates for openshell-gateway, openshell-supervisor and openshell-webhook in ${NAMESPACE}" \
  "valid ${DAYS} days; trust bundle of ${cas} CA(s) in their ca.crt and the caBundle of ${WEBHOOK_CONFIG}" >&2
