# syntax=docker/dockerfile:1
#
# Every image of the install from one build of the workspace, one target per binary:
#
#   docker build --target gateway    -t openshell/gateway:0.1.0    .
#   docker build --target supervisor -t openshell/supervisor:0.1.0 .
#   docker build --target sidecar    -t openshell/sidecar:0.1.0    .
#   docker build --target webhook    -t openshell/webhook:0.1.0    .
#   docker build --target agent      -t openshell/agent:0.1.0      .   # sample workload (demo)
#
# (scripts/build-images.sh builds and tags them all.) The `build` stage compiles the whole
# workspace once with `cargo build --release --locked`; the targets share it through the build
# cache, so building all of them compiles once. The build needs nothing outside this
# directory: protoc comes from the protoc-bin-vendored crate, the gateway's migrations are
# embedded from gateway/migrations, and no build script reads above the workspace root.
#
# Runtime: distroless (glibc, libgcc; no shell, no package manager) as the non-root user
# 65532, matching the Deployments' restricted securityContext (runAsNonRoot, read-only root
# filesystem). TLS is rustls everywhere and SQLite is compiled in: no other library is needed.

ARG RUST_VERSION=1.90
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot

FROM rust:${RUST_VERSION}-bookworm AS build
# The commit the binaries name in --version (scripts/build-images.sh passes it); empty: none.
ARG OPENSHELL_BUILD_COMMIT=""
ENV OPENSHELL_BUILD_COMMIT=${OPENSHELL_BUILD_COMMIT}
WORKDIR /src
COPY . .
# The cache mounts keep the registry and the target directory between builds; the binaries
# are copied out of the cached target directory in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked \
 && mkdir -p /out \
 && cp target/release/gateway target/release/poolctl target/release/supervisor target/release/sidecar \
       target/release/webhook target/release/agent target/release/egress /out/

FROM ${RUNTIME_IMAGE} AS runtime
USER 65532:65532

# The gateway image also carries poolctl, the operator CLI:
#   kubectl -n openshell-supervision exec deploy/openshell-gateway -- poolctl status
FROM runtime AS gateway
COPY --from=build /out/gateway /usr/local/bin/gateway
COPY --from=build /out/poolctl /usr/local/bin/poolctl
EXPOSE 8443 9090
ENTRYPOINT ["/usr/local/bin/gateway"]

FROM runtime AS supervisor
COPY --from=build /out/supervisor /usr/local/bin/supervisor
EXPOSE 7443 9090
ENTRYPOINT ["/usr/local/bin/supervisor"]

# nft and the libraries it needs beyond the runtime's glibc, for egress redirection's init
# container (egress install-rules).
FROM debian:bookworm-slim AS nft
RUN apt-get update && apt-get install -y --no-install-recommends nftables \
 && mkdir -p /out/usr/sbin && cp /usr/sbin/nft /out/usr/sbin/nft \
 && ldd /usr/sbin/nft | grep -o '/[^ ]*' | grep -v -E '/(libc|libm|ld-linux[^/]*)\.so' \
    | while read -r lib; do mkdir -p "/out$(dirname "$lib")" && cp -L "$lib" "/out$lib"; done

FROM runtime AS sidecar
# Execute-only (and root's): a process that runs a file it cannot read is non-dumpable from
# execve on, so no workload process of its UID can read its memory or files through /proc
# (sidecar/src/conceal.rs).
COPY --from=build --chown=0:0 --chmod=0111 /out/sidecar /usr/local/bin/sidecar
# Egress redirection: the Pod's network rules (init container) and its dialer.
COPY --from=build /out/egress /usr/local/bin/egress
COPY --from=nft /out/ /
ENTRYPOINT ["/usr/local/bin/sidecar"]

FROM runtime AS webhook
COPY --from=build /out/webhook /usr/local/bin/webhook
EXPOSE 9443 9090
ENTRYPOINT ["/usr/local/bin/webhook"]

# The sample counting workload (e2e/src/bin/agent.rs): reports progress through the sidecar's
# socket (OPENSHELL_SIDECAR_SOCKET, injected by the webhook). For trying an install out.
FROM runtime AS agent
COPY --from=build /out/agent /usr/local/bin/agent
ENTRYPOINT ["/usr/local/bin/agent"]

# Without --target: the gateway.
FROM gateway
