#!/usr/bin/env bash
# Build (and optionally push or load into kind) the images of an install from the repository's
# Dockerfile, one target per binary, and print how to point a kustomize overlay at them.
#
#   scripts/build-images.sh [--registry PREFIX] [--tag TAG] [--push] [--kind-load CLUSTER]
#                           [-- EXTRA BUILD ARGS]
#
#   --registry PREFIX   image name prefix (default: openshell), e.g. ghcr.io/acme/openshell
#                       gives ghcr.io/acme/openshell/gateway:TAG
#   --tag TAG           image tag (default: the workspace version in Cargo.toml)
#   --push              push every image after building it
#   --kind-load NAME    `kind load docker-image` every image into the kind cluster NAME
#
# Images: gateway, supervisor, sidecar, webhook (the install) and agent (a sample workload for
# trying it out). The first target compiles the workspace; the others reuse that build stage
# from the build cache. The engine is docker unless CONTAINER_ENGINE names another one with a
# docker-compatible CLI (podman). Exit status: non-zero on the first failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENGINE="${CONTAINER_ENGINE:-docker}"
PREFIX="openshell"
TAG=""
PUSH=0
KIND_CLUSTER=""
EXTRA=()

die() { echo "build-images: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --registry) [ $# -ge 2 ] || die "--registry needs a value"; PREFIX="${2%/}"; shift 2 ;;
    --tag) [ $# -ge 2 ] || die "--tag needs a value"; TAG="$2"; shift 2 ;;
    --push) PUSH=1; shift ;;
    --kind-load) [ $# -ge 2 ] || die "--kind-load needs a cluster name"; KIND_CLUSTER="$2"; shift 2 ;;
    -h|--help) sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done

# The commit the binaries say in --version (plumbing::build), when this is a git checkout.
COMMIT="$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || true)"

if [ -z "$TAG" ]; then
  TAG="$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -n1)"
  [ -n "$TAG" ] || die "cannot read the workspace version from Cargo.toml; pass --tag"
fi
[[ "$TAG" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || die "invalid tag: $TAG"
command -v "$ENGINE" >/dev/null 2>&1 || die "$ENGINE not found (set CONTAINER_ENGINE)"
if [ -n "$KIND_CLUSTER" ]; then
  command -v kind >/dev/null 2>&1 || die "kind not found"
fi

TARGETS=(gateway supervisor sidecar webhook agent)
for target in "${TARGETS[@]}"; do
  image="$PREFIX/$target:$TAG"
  echo "== $image" >&2
  "$ENGINE" build --target "$target" --tag "$image" --build-arg "OPENSHELL_BUILD_COMMIT=$COMMIT" \
    ${EXTRA[@]+"${EXTRA[@]}"} "$ROOT"
  if [ "$PUSH" -eq 1 ]; then
    "$ENGINE" push "$image"
  fi
  if [ -n "$KIND_CLUSTER" ]; then
    kind load docker-image --name "$KIND_CLUSTER" "$image"
  fi
done

cat <<MSG

Built ${PREFIX}/{gateway,supervisor,sidecar,webhook,agent}:${TAG}.
Point your overlay at them (run inside the overlay's directory, with the kustomize CLI):

  kustomize edit set image openshell/gateway=${PREFIX}/gateway:${TAG}
  kustomize edit set image openshell/supervisor=${PREFIX}/supervisor:${TAG}
  kustomize edit set image openshell/webhook=${PREFIX}/webhook:${TAG}
  kustomize edit add patch --kind Deployment --name openshell-webhook --patch '{"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"openshell-webhook"},"spec":{"template":{"spec":{"containers":[{"name":"webhook","env":[{"name":"OPENSHELL_WEBHOOK_SIDECAR_IMAGE","value":"${PREFIX}/sidecar:${TAG}"}]}]}}}}'

(The sidecar image is an env value of the webhook, which kustomize's images: does not
rewrite; the patch sets it.) Sample workload: ${PREFIX}/agent:${TAG}.
MSG
