//! gRPC contracts of shared supervision, generated from `proto/openshell/supervisor/**` with
//! tonic and prost (servers and clients).
//!
//! One versioned package per relationship:
//!
//! | Rust module | protobuf package | between |
//! |---|---|---|
//! | [`common::v1`] | `openshell.supervisor.common.v1` | shared vocabulary (instances, workload identity, route directory, phases) |
//! | [`host::v1`] | `openshell.supervisor.host.v1` | pool member ⇄ gateway host stream |
//! | [`runtime::v1`] | `openshell.supervisor.runtime.v1` | sidecar ⇄ owning member (fencing, recovery, relay) |
//! | [`recovery::v1`] | `openshell.supervisor.recovery.v1` | member → gateway grants and activation, trust bundle |
//! | [`registry::v1`] | `openshell.supervisor.registry.v1` | sidecar → gateway instance registry |
//! | [`pool::v1`] | `openshell.supervisor.pool.v1` | operator → gateway pool API |
//!
//! The `.proto` comments are the specification: who sends what, when, what the receiver must
//! do, units and bounds. They are copied into the generated items' rustdoc. Conventions shared
//! by all packages (time units, authentication, refusals) are in `common.proto`'s file
//! comment.
//!
//! Besides the generated code this crate holds the few constants and helpers every side needs
//! so that nobody re-derives them: message size bounds ([`MAX_MESSAGE_BYTES`] and friends),
//! the timing contract ([`timing`]), bearer-token metadata helpers
//! ([`bearer_token`]), the receipt MAC input ([`recovery::v1::Receipt::mac_input`]) and the
//! file descriptor set for gRPC reflection ([`FILE_DESCRIPTOR_SET`]), and the standard health
//! and reflection services every gRPC port serves ([`standard`]).

pub mod egress;
pub mod kubernetes;
pub mod registration;
pub mod standard;
pub mod timing;
pub mod trust;

use std::fmt;

/// Generated code: rustdoc comes from the .proto files, lints are not ours to fix.
macro_rules! generated {
    ($(#[$meta:meta])* $name:ident, $file:literal) => {
        $(#[$meta])*
        pub mod $name {
            /// Version 1 of the package. Breaking changes get a new `v2` package next to it.
            #[allow(
                clippy::all,
                clippy::pedantic,
                clippy::nursery,
                clippy::unwrap_used,
                clippy::expect_used,
                missing_docs,
                rustdoc::broken_intra_doc_links,
                rustdoc::bare_urls,
                rustdoc::invalid_html_tags
            )]
            pub mod v1 {
                include!(concat!(env!("OUT_DIR"), "/", $file));
            }
        }
    };
}

generated!(
    /// `openshell.supervisor.common.v1`: messages and enums shared by every package:
    /// [`InstanceRef`](common::v1::InstanceRef), [`WorkloadIdentity`](common::v1::WorkloadIdentity),
    /// [`RouteDirectoryEntry`](common::v1::RouteDirectoryEntry) and
    /// [`InstancePhase`](common::v1::InstancePhase).
    common,
    "openshell.supervisor.common.v1.rs"
);
generated!(
    /// `openshell.supervisor.host.v1`: the member ⇄ gateway host stream
    /// (`SupervisorHost.Attach`): hello, snapshots, acks, heartbeats, status reports, leaving.
    /// Server: `host::v1::supervisor_host_server`; client: `host::v1::supervisor_host_client`.
    host,
    "openshell.supervisor.host.v1.rs"
);
generated!(
    /// `openshell.supervisor.runtime.v1`: the sidecar ⇄ member runtime stream
    /// (`SupervisorRuntime.Connect`): attach, redirect, recovery hello, grant presentation,
    /// receipt, activation confirm, relinquish, release and the relayed workload traffic.
    /// Server: `runtime::v1::supervisor_runtime_server`; client:
    /// `runtime::v1::supervisor_runtime_client`.
    runtime,
    "openshell.supervisor.runtime.v1.rs"
);
generated!(
    /// `openshell.supervisor.recovery.v1`: the gateway's single-use grant and activation RPCs
    /// and its trust bundle (`SupervisorRecovery`). Home of [`Receipt`](recovery::v1::Receipt),
    /// which `runtime.v1` carries. Server: `recovery::v1::supervisor_recovery_server`; client:
    /// `recovery::v1::supervisor_recovery_client`.
    recovery,
    "openshell.supervisor.recovery.v1.rs"
);
generated!(
    /// `openshell.supervisor.registry.v1`: the instance registry the sidecar registers its
    /// instance with (`InstanceRegistry`). Server: `registry::v1::instance_registry_server`;
    /// client: `registry::v1::instance_registry_client`.
    registry,
    "openshell.supervisor.registry.v1.rs"
);
generated!(
    /// `openshell.supervisor.pool.v1`: the operator API (`SupervisorPool`): pool status,
    /// drain and rebalance operations. Server: `pool::v1::supervisor_pool_server`; client:
    /// `pool::v1::supervisor_pool_client`.
    pool,
    "openshell.supervisor.pool.v1.rs"
);

/// Encoded `FileDescriptorSet` of every package in this crate (including `common.v1`), for
/// gRPC server reflection (e.g. `tonic-reflection`'s `register_encoded_file_descriptor_set`)
/// and for tests that inspect the contracts.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/openshell_supervisor_descriptor.bin"));

/// Fully qualified names of the five services, e.g. for health or reflection registration.
pub const SERVICE_NAMES: [&str; 5] = [
    host::v1::supervisor_host_server::SERVICE_NAME,
    runtime::v1::supervisor_runtime_server::SERVICE_NAME,
    recovery::v1::supervisor_recovery_server::SERVICE_NAME,
    registry::v1::instance_registry_server::SERVICE_NAME,
    pool::v1::supervisor_pool_server::SERVICE_NAME,
];

// ---------------------------------------------------------------------------------------------
// Size bounds
// ---------------------------------------------------------------------------------------------

/// Largest encoded message any side sends or accepts on these services: 4 MiB. Configure every
/// server and client with it, e.g.
/// `SupervisorHostServer::new(svc).max_decoding_message_size(proto::MAX_MESSAGE_BYTES)` (and
/// the same for `max_encoding_message_size`).
///
/// Sized for the largest legitimate message, a host snapshot: up to
/// [`MAX_INSTANCES_PER_MEMBER`] owned instances carrying their launch material
/// ([`MAX_REGISTRATION_MATERIAL_BYTES`] at most each, in practice a few KiB) plus the route
/// directory of the whole pool.
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// Largest encoded `host.v1.StatusReport` (256 KiB); the gateway drops larger reports.
pub const MAX_STATUS_REPORT_BYTES: usize = 256 * 1024;

/// Largest registration material (`registry.v1.RegisterRequest.registration_material`,
/// `host.v1.OwnedInstance.credentials`): 16 KiB.
pub const MAX_REGISTRATION_MATERIAL_BYTES: usize = 16 * 1024;

/// Most instances one member hosts (`host.v1.Hello.capacity` is 1..=this).
pub const MAX_INSTANCES_PER_MEMBER: u32 = 256;

/// Longest route in bytes (printable ASCII, no whitespace).
pub const MAX_ROUTE_BYTES: usize = 256;

/// Longest `host.v1.InstanceStatus.message` in bytes.
pub const MAX_STATUS_MESSAGE_BYTES: usize = 512;

/// Maximum length of an egress policy's name (runtime.v1.EgressPolicy.name): a Kubernetes
/// object name.
pub const MAX_POLICY_NAME_BYTES: usize = 253;

// ---------------------------------------------------------------------------------------------
// Authentication metadata
// ---------------------------------------------------------------------------------------------

/// gRPC metadata key carrying the bearer token on every call.
pub const AUTHORIZATION_METADATA_KEY: &str = "authorization";

/// Formats the `authorization` metadata value for `token` (`Bearer <token>`).
#[must_use]
pub fn bearer_value(token: &str) -> String {
    format!("Bearer {token}")
}

/// Extracts the token from an `authorization` value of the form `Bearer <token>` (scheme
/// case-insensitive, surrounding whitespace ignored). `None` for another scheme or an empty
/// token.
#[must_use]
pub fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Extracts the bearer token from a request's metadata (see [`bearer_token`]). `None` when the
/// entry is missing, not ASCII, or not a bearer token.
#[must_use]
pub fn bearer_token_from_metadata(metadata: &tonic::metadata::MetadataMap) -> Option<&str> {
    let value = metadata.get(AUTHORIZATION_METADATA_KEY)?.to_str().ok()?;
    bearer_token(value)
}

// ---------------------------------------------------------------------------------------------
// Helpers on generated types
// ---------------------------------------------------------------------------------------------

impl fmt::Display for common::v1::InstanceRef {
    /// `namespace/name#generation (uid)`: for logs and events. Contains no secrets.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}#{} ({})", self.namespace, self.name, self.generation, self.uid)
    }
}

impl common::v1::InstancePhase {
    /// Reads a wire value the way the contract requires: unknown values are `Failed`.
    #[must_use]
    pub fn from_wire(value: i32) -> Self {
        match Self::try_from(value) {
            Ok(Self::Unspecified) | Err(_) => Self::Failed,
            Ok(phase) => phase,
        }
    }

    /// True for phases that end a member's session for that term (relinquished, stopped,
    /// failed).
    #[must_use]
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Relinquished | Self::Stopped | Self::Failed)
    }
}

impl fmt::Display for common::v1::InstancePhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str_name())
    }
}

impl recovery::v1::Receipt {
    /// Domain string that starts the MAC input.
    pub const MAC_DOMAIN: &'static str = "openshell.supervisor.recovery.v1.Receipt";

    /// The canonical bytes the receipt's `mac` is computed over:
    /// `mac = HMAC-SHA256(receipt key, receipt.mac_input())`. The `mac` field itself is not
    /// part of it. The encoding is specified on the `Receipt` message in `recovery.proto`:
    /// strings and bytes as a 4-byte big-endian length plus the raw bytes, integers as 8 bytes
    /// big-endian, absent submessages as their defaults.
    #[must_use]
    pub fn mac_input(&self) -> Vec<u8> {
        let instance = self.instance.clone().unwrap_or_default();
        let workload = self.workload.clone().unwrap_or_default();
        let mut out = Vec::with_capacity(256);
        put_bytes(&mut out, Self::MAC_DOMAIN.as_bytes());
        put_bytes(&mut out, self.route.as_bytes());
        put_bytes(&mut out, instance.namespace.as_bytes());
        put_bytes(&mut out, instance.name.as_bytes());
        put_bytes(&mut out, instance.uid.as_bytes());
        out.extend_from_slice(&instance.generation.to_be_bytes());
        out.extend_from_slice(&self.term.to_be_bytes());
        put_bytes(&mut out, self.grant_id.as_bytes());
        put_bytes(&mut out, &self.grant_digest);
        out.extend_from_slice(&self.fenced_term.to_be_bytes());
        out.extend_from_slice(&u64::from(workload.pid).to_be_bytes());
        out.extend_from_slice(&workload.start_time_ticks.to_be_bytes());
        put_bytes(&mut out, &workload.exe_digest);
        out.extend_from_slice(&self.issued_at_ms.to_be_bytes());
        out
    }

    /// `HMAC-SHA256(receipt key, mac_input())`: what the sidecar puts in `mac`.
    #[must_use]
    pub fn compute_mac(&self, receipt_key: &[u8]) -> Vec<u8> {
        use hmac::Mac as _;
        // HMAC takes keys of any length; an empty MAC would never verify anyway.
        let Ok(mut mac) = <hmac::Hmac<sha2::Sha256> as hmac::Mac>::new_from_slice(receipt_key) else {
            return Vec::new();
        };
        mac.update(&self.mac_input());
        mac.finalize().into_bytes().to_vec()
    }

    /// Whether `mac` verifies with `receipt_key` (constant-time comparison).
    #[must_use]
    pub fn verify_mac(&self, receipt_key: &[u8]) -> bool {
        use hmac::Mac as _;
        let Ok(mut mac) = <hmac::Hmac<sha2::Sha256> as hmac::Mac>::new_from_slice(receipt_key) else {
            return false;
        };
        mac.update(&self.mac_input());
        mac.verify_slice(&self.mac).is_ok()
    }
}

/// SHA-256 of `bytes` (grant digests, executable digests).
#[must_use]
pub fn sha256(bytes: &[u8]) -> Vec<u8> {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes).to_vec()
}

/// Appends a length-prefixed byte string. Lengths above `u32::MAX` cannot occur within
/// [`MAX_MESSAGE_BYTES`]; they saturate rather than wrap.
fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(bytes);
}

/// Default `max_parallel` of a pool operation when the request carries 0.
pub const DEFAULT_MAX_PARALLEL: u32 = 1;

/// Largest `max_parallel` of a pool operation.
pub const MAX_MAX_PARALLEL: u32 = 8;

impl pool::v1::StartSupervisorPoolOperationRequest {
    /// The effective `max_parallel`: 0 means [`DEFAULT_MAX_PARALLEL`], 1..=[`MAX_MAX_PARALLEL`]
    /// as given, `None` above (the server answers INVALID_ARGUMENT).
    #[must_use]
    pub fn effective_max_parallel(&self) -> Option<u32> {
        match self.max_parallel {
            0 => Some(DEFAULT_MAX_PARALLEL),
            n if n <= MAX_MAX_PARALLEL => Some(n),
            _ => None,
        }
    }
}
