//! What the injection puts into a Pod, and how: the names, paths and sizes of the injected
//! sidecar, volumes and annotations, the sidecar mode and resources, and [`InjectConfig`].

use std::fmt;

use serde::Serialize;

/// Name of the injected sidecar container.
pub const SIDECAR_NAME: &str = "openshell-sidecar";
/// Annotation recording the injection (version and what was injected).
pub const INJECTED_ANNOTATION: &str = "supervision.openshell.ai/injected";
/// Per-Pod override of the sidecar mode: `native` or `container`.
pub const SIDECAR_MODE_ANNOTATION: &str = "supervision.openshell.ai/sidecar-mode";
/// Per-Pod opt-out of the proxy variables (`supervision.openshell.ai/egress-proxy=disabled`):
/// the sidecar still listens, the Pod's clients are not pointed at it.
pub const EGRESS_PROXY_ANNOTATION: &str = "supervision.openshell.ai/egress-proxy";
/// The proxy variables the workload containers get, in both cases as clients read them.
pub const PROXY_VARIABLES: [&str; 4] = ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"];
/// …and what goes around the proxy: the Pod's own loopback only.
pub const NO_PROXY_VARIABLES: [&str; 2] = ["NO_PROXY", "no_proxy"];
/// Per-Pod opt-out label (`supervision.openshell.ai/inject=disabled`).
pub const INJECT_LABEL: &str = "supervision.openshell.ai/inject";
/// Value of [`INJECT_LABEL`] that opts a Pod out.
pub const INJECT_DISABLED: &str = "disabled";
/// The names the gateway relies on: the label of injected Pods, the trust Secret, the
/// namespaces never mutated.
pub use proto::kubernetes::{SUPERVISED_LABEL, SUPERVISED_VALUE, SYSTEM_NAMESPACES, TOKEN_SECRET};
/// Name of the Pod's projected volume: `trust.jwks` and `ca.crt` from [`TOKEN_SECRET`], and
/// `token`, the Pod's own ServiceAccount token for the gateway's audience (the kubelet
/// renews it), which proves to the gateway which Pod the sidecar is.
pub const TOKEN_VOLUME: &str = "openshell-supervision-token";
/// Where the sidecar sees that volume (read-only): its `OPENSHELL_SUPERVISION_DIR`.
pub const SUPERVISION_DIR: &str = "/var/run/openshell/supervision";
/// Name of the in-memory `emptyDir` holding the sidecar's workload socket; mounted in the
/// sidecar and in every workload container.
pub const SOCKET_VOLUME: &str = "openshell-sidecar";
/// Where [`SOCKET_VOLUME`] is mounted (sidecar and workload containers).
pub const SOCKET_DIR: &str = "/var/run/openshell/sidecar";
/// The sidecar's workload endpoint: a Unix socket in [`SOCKET_DIR`] (`OPENSHELL_SIDECAR_SOCKET`).
pub const SIDECAR_SOCKET: &str = "/var/run/openshell/sidecar/sidecar.sock";
/// Size limit of [`SOCKET_VOLUME`] (it holds one socket).
pub const SOCKET_VOLUME_SIZE: &str = "1Mi";
/// Name of the `emptyDir` holding the sidecar's fence state; mounted in the sidecar only.
pub const STATE_VOLUME: &str = "openshell-sidecar-state";
/// Where [`STATE_VOLUME`] is mounted in the sidecar (`OPENSHELL_SIDECAR_STATE_DIR`).
pub const STATE_DIR: &str = "/var/run/openshell/sidecar-state";
/// Size limit of [`STATE_VOLUME`] (it holds one small JSON file).
pub const STATE_VOLUME_SIZE: &str = "1Mi";
/// Namespace label by which a platform team turns egress redirection on for a labelled
/// namespace (`supervision.openshell.ai/egress=redirect`); the webhook configuration selects
/// such namespaces into `/mutate/redirect`.
pub const EGRESS_MODE_LABEL: &str = "supervision.openshell.ai/egress";
/// Name of the init container that installs the Pod's network rules (`NET_ADMIN`, exits).
pub const EGRESS_INIT_NAME: &str = "openshell-egress-init";
/// Name of the Pod's dialer container (its own UID; the only connections that leave the Pod).
pub const DIALER_NAME: &str = "openshell-egress-dialer";
/// Name of the in-memory `emptyDir` holding the dialer's socket; mounted in the dialer and the
/// sidecar only.
pub const DIALER_VOLUME: &str = "openshell-egress-dialer";
/// Where [`DIALER_VOLUME`] is mounted.
pub const DIALER_DIR: &str = "/var/run/openshell/egress";
/// The dialer's socket (`OPENSHELL_EGRESS_DIALER`).
pub const DIALER_SOCKET: &str = "/var/run/openshell/egress/dialer.sock";

/// Default supervisor route: the pool's Service in the default install namespace, over TLS.
pub const DEFAULT_SUPERVISOR_ROUTE: &str = "https://openshell-supervisor.openshell-supervision.svc:7443";
/// Default gateway endpoint: the gateway's Service in the default install namespace, over TLS.
pub const DEFAULT_GATEWAY_ENDPOINT: &str = "https://openshell-gateway.openshell-supervision.svc:8443";
/// Default name the sidecar verifies supervisor certificates against
/// (`OPENSHELL_SUPERVISOR_TLS_NAME`): the supervisor Service's name, which every member's
/// certificate carries. Sidecars are redirected to members by Pod IP, which no certificate
/// names, so the name is given explicitly.
pub const DEFAULT_SUPERVISOR_TLS_NAME: &str = "openshell-supervisor.openshell-supervision.svc";

/// How the sidecar is added to the Pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SidecarMode {
    /// Kubernetes native sidecar (≥ 1.29): an init container with `restartPolicy: Always`,
    /// placed before the Pod's own init containers.
    Native,
    /// A regular container appended to `spec.containers` (clusters older than 1.29).
    Container,
}

impl SidecarMode {
    /// The annotation / metric label spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SidecarMode::Native => "native",
            SidecarMode::Container => "container",
        }
    }

    pub(super) fn parse(value: &str) -> Option<Self> {
        match value.trim() {
            "native" => Some(SidecarMode::Native),
            "container" => Some(SidecarMode::Container),
            _ => None,
        }
    }
}

impl fmt::Display for SidecarMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Resource requests/limits of the sidecar (Kubernetes quantity strings).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SidecarResources {
    pub cpu_request: String,
    pub memory_request: String,
    pub cpu_limit: Option<String>,
    pub memory_limit: String,
}

impl Default for SidecarResources {
    fn default() -> Self {
        Self {
            cpu_request: "10m".into(),
            memory_request: "32Mi".into(),
            cpu_limit: Some("500m".into()),
            memory_limit: "128Mi".into(),
        }
    }
}

/// What to inject and where not to.
#[derive(Clone, Debug)]
pub struct InjectConfig {
    pub sidecar_image: String,
    pub image_pull_policy: String,
    pub default_mode: SidecarMode,
    /// Supervisor runtime address(es) given to sidecars and workloads (`OPENSHELL_SUPERVISOR_ROUTE`;
    /// the sidecar accepts a comma-separated list).
    pub supervisor_route: String,
    /// Gateway gRPC endpoints given to sidecars (`OPENSHELL_GATEWAY_ENDPOINTS`, joined with `,`).
    pub gateway_endpoints: Vec<String>,
    /// Server name the sidecar verifies supervisor certificates against
    /// (`OPENSHELL_SUPERVISOR_TLS_NAME`); `None` injects nothing.
    pub supervisor_tls_name: Option<String>,
    pub install_namespace: String,
    pub resources: SidecarResources,
    /// `runAsUser` for the sidecar. `None` leaves it to the Pod's `securityContext.runAsUser`
    /// (so the sidecar runs as the workload's user and may signal it) or to the image's
    /// numeric `USER`.
    pub run_as_user: Option<i64>,
    /// Loopback port of the sidecar's egress proxy (`OPENSHELL_EGRESS_LISTEN`), which the
    /// workload containers' proxy variables name; `None` injects no proxy.
    pub egress_port: Option<u16>,
    /// Egress redirection for the Pods this injector serves.
    pub egress_redirect: Redirect,
    /// Audience of the sidecar's projected ServiceAccount token (the gateway's).
    pub token_audience: String,
    /// Lifetime of that token in seconds.
    pub token_expiration_seconds: i64,
    /// Recorded in the annotation.
    pub version: String,
}

impl Default for InjectConfig {
    fn default() -> Self {
        Self {
            sidecar_image: "openshell/sidecar:0.1.0".into(),
            image_pull_policy: "IfNotPresent".into(),
            default_mode: SidecarMode::Native,
            supervisor_route: DEFAULT_SUPERVISOR_ROUTE.into(),
            gateway_endpoints: vec![DEFAULT_GATEWAY_ENDPOINT.into()],
            supervisor_tls_name: Some(DEFAULT_SUPERVISOR_TLS_NAME.into()),
            install_namespace: "openshell-supervision".into(),
            resources: SidecarResources::default(),
            run_as_user: None,
            egress_port: Some(15001),
            egress_redirect: Redirect::Off,
            token_audience: proto::trust::KUBERNETES_AUDIENCE.into(),
            token_expiration_seconds: 3600,
            version: plumbing::build::version().into(),
        }
    }
}

/// Egress redirection, chosen per namespace by [`EGRESS_MODE_LABEL`] (the webhook
/// configuration sends such namespaces' Pods to `/mutate/redirect`, or to
/// `/mutate/redirect-blocked` where the namespace enforces a Pod Security level that refuses
/// the init container's `NET_ADMIN`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Redirect {
    /// The proxy variables only (cooperative clients).
    #[default]
    Off,
    /// Every TCP connection of the Pod goes to the sidecar.
    On(Redirection),
    /// Asked for, but the namespace's Pod Security level would refuse the Pod: proxy only.
    Blocked,
}

/// Where redirected connections go and who may leave the Pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Redirection {
    /// The sidecar's redirect listener on 127.0.0.1.
    pub port: u16,
    /// The dialer's UID (and GID), whose connections leave the Pod undecided. `None` (the
    /// default): a UID drawn per Pod from [`DIALER_UIDS`], which no image can be built to run
    /// as beforehand.
    pub dialer_uid: Option<i64>,
}

/// The UIDs a Pod's dialer is drawn from.
pub const DIALER_UIDS: std::ops::Range<i64> = 1_000_000_000..2_000_000_000;

impl Redirection {
    /// The dialer's UID for one Pod.
    pub fn dialer_uid_for_pod(&self) -> i64 {
        self.dialer_uid.unwrap_or_else(|| rand::random_range(DIALER_UIDS))
    }
}

impl Default for Redirection {
    fn default() -> Self {
        Self {
            port: 15002,
            dialer_uid: None,
        }
    }
}
