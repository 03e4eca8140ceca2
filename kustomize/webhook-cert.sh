#!/usr/bin/env bash
# Provision the webhook's serving certificate WITHOUT cert-manager. Needs only openssl and
# kubectl (with access to the cluster).
#
#   kustomize/webhook-cert.sh            # first install, and again to renew the serving cert
#   kustomize/webhook-cert.sh --new-ca   # also replace the CA (rotates the caBundle)
#   kustomize/webhook-cert.sh --dry-run  # write the files to ./webhook-cert-out, touch nothing
#
# What it does:
#  1. Reuses the CA in Secret openshell-webhook-ca (or creates one: 10 years, EC P-256).
#  2. Issues a serving certificate for openshell-webhook.openshell-supervision.svc
#     (default 1 year) signed by that CA.
#  3. Applies Secret openshell-webhook-tls (tls.crt, tls.key, ca.crt). The webhook Pods
#     mount it and reload it on change (the kubelet refreshes Secret volumes within ~1 min);
#     no restart needed.
#  4. Sets the CA as caBundle of the MutatingWebhookConfiguration openshell-supervision.
#     With --new-ca the old CA is kept in the bundle next to the new one, so the API server
#     trusts both the old and the new serving certificate while the Secret propagates; run
#     the script once more later (without --new-ca) to drop the old CA.
#
# Environment: NAMESPACE (openshell-supervision), SERVICE (openshell-webhook),
# WEBHOOK_CONFIG (openshell-supervision), DAYS (365), KUBECTL (kubectl).
set -euo pipefail

NAMESPACE="${NAMESPACE:-openshell-supervision}"
SERVICE="${SERVICE:-openshell-webhook}"
WEBHOOK_CONFIG="${WEBHOOK_CONFIG:-openshell-supervision}"
DAYS="${DAYS:-365}"
KUBECTL="${KUBECTL:-kubectl}"
TLS_SECRET="openshell-webhook-tls"
CA_SECRET="openshell-webhook-ca"

new_ca=0
dry_run=0
for arg in "$@"; do
  case "$arg" in
    --new-ca) new_ca=1 ;;
    --dry-run) dry_run=1 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

command -v openssl >/dev/null || { echo "openssl is required" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"

b64() { base64 | tr -d '\n'; }
unb64() { base64 -d; }

old_ca=""
if [ "$dry_run" -eq 0 ] && "$KUBECTL" -n "$NAMESPACE" get secret "$CA_SECRET" >/dev/null 2>&1; then
  "$KUBECTL" -n "$NAMESPACE" get secret "$CA_SECRET" -o jsonpath='{.data.tls\.crt}' | unb64 > ca.crt
  "$KUBECTL" -n "$NAMESPACE" get secret "$CA_SECRET" -o jsonpath='{.data.tls\.key}' | unb64 > ca.key
  if [ "$new_ca" -eq 1 ]; then
    cp ca.crt old-ca.crt
    old_ca="old-ca.crt"
    rm ca.crt ca.key
  fi
fi

if [ ! -s ca.crt ]; then
  echo "creating a new CA" >&2
  openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
    -keyout ca.key -out ca.crt -days 3650 -subj "/CN=openshell-webhook-ca" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi

host="${SERVICE}.${NAMESPACE}.svc"
cat > server.ext <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:${SERVICE},DNS:${SERVICE}.${NAMESPACE},DNS:${host},DNS:${host}.cluster.local
EXT
openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
  -keyout tls.key -out tls.csr -subj "/CN=${host}" 2>/dev/null
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
  -out tls.crt -days "$DAYS" -extfile server.ext 2>/dev/null
openssl verify -CAfile ca.crt tls.crt >/dev/null

bundle="ca.crt"
if [ -n "$old_ca" ]; then
  cat ca.crt "$old_ca" > bundle.crt
  bundle="bundle.crt"
fi

secret_yaml() { # name, files...
  local name="$1"; shift
  "$KUBECTL" create secret generic "$name" --namespace "$NAMESPACE" --type kubernetes.io/tls \
    "$@" --dry-run=client -o yaml
}

if [ "$dry_run" -eq 1 ]; then
  out="${OLDPWD}/webhook-cert-out"
  mkdir -p "$out"
  cp ca.crt ca.key tls.crt tls.key "$out/"
  cp "$bundle" "$out/caBundle.pem"
  echo "dry run: wrote $out (ca.crt ca.key tls.crt tls.key caBundle.pem); nothing applied" >&2
  exit 0
fi

secret_yaml "$CA_SECRET" --from-file=tls.crt=ca.crt --from-file=tls.key=ca.key | "$KUBECTL" apply -f -
secret_yaml "$TLS_SECRET" --from-file=tls.crt=tls.crt --from-file=tls.key=tls.key --from-file=ca.crt=ca.crt \
  | "$KUBECTL" apply -f -

count="$("$KUBECTL" get mutatingwebhookconfiguration "$WEBHOOK_CONFIG" -o jsonpath='{range .webhooks[*]}x{end}')"
patch="["
for ((i = 0; i < ${#count}; i++)); do
  [ "$i" -gt 0 ] && patch+=","
  patch+="{\"op\":\"add\",\"path\":\"/webhooks/${i}/clientConfig/caBundle\",\"value\":\"$(b64 < "$bundle")\"}"
done
patch+="]"
"$KUBECTL" patch mutatingwebhookconfiguration "$WEBHOOK_CONFIG" --type=json -p "$patch"
echo "serving certificate for ${host} valid ${DAYS} days; caBundle of ${WEBHOOK_CONFIG} updated" >&2
