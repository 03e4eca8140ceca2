#!/usr/bin/env bash
# Fails when a production crate (what the images and poolctl are built from) depends on test
# support (the testkit crate: fault proxies, throwaway CAs) other than as a dev-dependency, on
# the host target.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
status=0
for crate in proto plumbing gateway poolctl supervisor sidecar webhook; do
  tree=$(cargo tree --locked --offline -q -e normal,build -p "$crate" --prefix none) \
    || { echo "check-deps: cargo tree -p $crate failed" >&2; exit 1; }
  if grep -q '^testkit ' <<<"$tree"; then
    echo "check-deps: $crate depends on testkit outside its tests" >&2
    status=1
  fi
done
[ "$status" = 0 ] && echo "check-deps: OK (no production crate depends on testkit)"
exit "$status"
