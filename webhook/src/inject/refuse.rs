//! Which Pods the webhook refuses: those whose own spec would reach the supervision sidecar's
//! credentials or memory once the sidecar is injected.
//!
//! The sidecar keeps two things from the workload: the volumes only it mounts (the projected
//! gateway-audience token, the fence state with the receipt key) and its process, which is
//! non-dumpable, so no process of the workload's UID reads or traces it. Both hold only if
//! the workload cannot name the sidecar's volumes, cannot mint a gateway-audience token of its
//! own, and has no privilege that overrides dumpability. A Pod that breaks any of that is
//! refused, before any patch is built:
//!
//! - it declares a volume under the name of a volume the webhook injects (the injection would
//!   reuse or skip it);
//! - a container of its own (`containers`, `initContainers`, `ephemeralContainers`) mounts, or
//!   attaches as a device, a volume only the sidecar mounts (the injected volume would satisfy
//!   the mount);
//! - it projects a ServiceAccount token for the gateway's audience;
//! - it shares the host's PID namespace, runs as a Windows HostProcess, or a container is
//!   privileged or adds capabilities beyond the Pod Security "baseline" set (`SYS_PTRACE`
//!   reads a non-dumpable process).
//!
//! Plain data in ([`PodView`], read from the Pod JSON by the caller), a [`Refusal`] out; no
//! I/O, no JSON.

use std::fmt;

use super::{DIALER_VOLUME, SOCKET_VOLUME, STATE_VOLUME, TOKEN_VOLUME};

/// Capabilities a container may add under the Pod Security Standards' "baseline" profile
/// (<https://kubernetes.io/docs/concepts/security/pod-security-standards/>), without `CAP_`.
pub const BASELINE_CAPABILITIES: [&str; 13] = [
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
];

/// Every volume the webhook injects.
pub const INJECTED_VOLUMES: [&str; 4] = [TOKEN_VOLUME, SOCKET_VOLUME, STATE_VOLUME, DIALER_VOLUME];

/// The injected volumes only the sidecar mounts, and what each holds.
pub const SIDECAR_VOLUMES: [(&str, &str); 3] = [
    (TOKEN_VOLUME, "gateway-audience ServiceAccount token"),
    (STATE_VOLUME, "fence state and receipt key"),
    (
        DIALER_VOLUME,
        "egress dialer's socket, which opens connections that leave the Pod",
    ),
];

/// Longest Pod-supplied name quoted in a refusal (the API server validates names only after
/// admission, so they may be anything here).
const MAX_QUOTED_BYTES: usize = 128;

/// Which list of the Pod spec a container is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContainerList {
    Containers,
    InitContainers,
    EphemeralContainers,
}

impl ContainerList {
    /// Its key in the Pod spec.
    pub fn key(self) -> &'static str {
        match self {
            ContainerList::Containers => "containers",
            ContainerList::InitContainers => "initContainers",
            ContainerList::EphemeralContainers => "ephemeralContainers",
        }
    }

    /// Its path, as a refusal names it.
    pub fn field(self) -> &'static str {
        match self {
            ContainerList::Containers => "spec.containers",
            ContainerList::InitContainers => "spec.initContainers",
            ContainerList::EphemeralContainers => "spec.ephemeralContainers",
        }
    }
}

/// What the rules read of one container of the Pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerView<'a> {
    pub list: Option<ContainerList>,
    pub index: usize,
    pub name: &'a str,
    /// Volumes named by its `volumeMounts` and `volumeDevices`.
    pub volumes: Vec<&'a str>,
    /// `securityContext.privileged`.
    pub privileged: bool,
    /// `securityContext.windowsOptions.hostProcess`.
    pub host_process: bool,
    /// `securityContext.capabilities.add`, as written.
    pub added_capabilities: Vec<&'a str>,
}

/// What the rules read of one volume the Pod declares.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolumeView<'a> {
    pub index: usize,
    pub name: &'a str,
    /// Audiences of its projected `serviceAccountToken` sources (absent: the API server's).
    pub token_audiences: Vec<&'a str>,
}

/// What the rules read of a Pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodView<'a> {
    /// `spec.hostPID`.
    pub host_pid: bool,
    /// `spec.securityContext.windowsOptions.hostProcess`.
    pub host_process: bool,
    pub volumes: Vec<VolumeView<'a>>,
    /// Every container the Pod brings (none of them is the webhook's).
    pub containers: Vec<ContainerView<'a>>,
}

/// A container named in a refusal: `container "app" (spec.containers[0])`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerRef {
    pub name: String,
    pub field: &'static str,
    pub index: usize,
}

impl fmt::Display for ContainerRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "container {:?} ({}[{}])", self.name, self.field, self.index)
    }
}

/// Why a Pod is refused (metric label `reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefuseReason {
    VolumeDeclared,
    VolumeMounted,
    GatewayToken,
    HostPid,
    HostProcess,
    Privileged,
    Capabilities,
    NotRedirected,
}

impl RefuseReason {
    /// Every reason (each metric label starts at 0).
    pub const ALL: [Self; 8] = [
        RefuseReason::VolumeDeclared,
        RefuseReason::VolumeMounted,
        RefuseReason::GatewayToken,
        RefuseReason::HostPid,
        RefuseReason::HostProcess,
        RefuseReason::Privileged,
        RefuseReason::Capabilities,
        RefuseReason::NotRedirected,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RefuseReason::VolumeDeclared => "volume_declared",
            RefuseReason::VolumeMounted => "volume_mounted",
            RefuseReason::GatewayToken => "gateway_token",
            RefuseReason::HostPid => "host_pid",
            RefuseReason::HostProcess => "host_process",
            RefuseReason::Privileged => "privileged",
            RefuseReason::Capabilities => "capabilities",
            RefuseReason::NotRedirected => "not_redirected",
        }
    }
}

/// A refused Pod: what in it reaches the sidecar, and why that is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error(
        "volume {volume:?} (spec.volumes[{index}]) has the name of a volume the supervision \
         webhook injects; remove it (the webhook adds its own, mounted in the sidecar only)"
    )]
    VolumeDeclared { volume: String, index: usize },
    #[error(
        "{container} mounts volume {volume:?}, the supervision sidecar's {holds}, which only \
         the injected sidecar may mount; remove the mount"
    )]
    VolumeMounted {
        container: ContainerRef,
        volume: String,
        holds: &'static str,
    },
    #[error(
        "volume {volume:?} (spec.volumes[{index}]) projects a ServiceAccount token for audience \
         {audience:?}, the supervision gateway's: only the injected sidecar holds one; use \
         another audience"
    )]
    GatewayToken {
        volume: String,
        index: usize,
        audience: String,
    },
    #[error(
        "spec.hostPID is true: a Pod in the host's PID namespace can reach the supervision \
         sidecars of the node; not allowed in a supervised namespace"
    )]
    HostPid,
    #[error(
        "{} runs as a Windows HostProcess (windowsOptions.hostProcess: true), with the node's \
         privileges over the supervision sidecar; not allowed in a supervised namespace",
        .container.as_ref().map_or_else(|| "the Pod (spec.securityContext)".into(), ContainerRef::to_string)
    )]
    HostProcess { container: Option<ContainerRef> },
    #[error(
        "{container} is privileged (securityContext.privileged: true) and could read the \
         supervision sidecar's memory; not allowed in a supervised namespace"
    )]
    Privileged { container: ContainerRef },
    #[error(
        "{container} adds capability {capability:?}, beyond the Pod Security baseline set \
         ({}), and could read or trace the supervision sidecar; not allowed in a supervised \
         namespace",
        BASELINE_CAPABILITIES.join(", ")
    )]
    Capability {
        container: ContainerRef,
        capability: String,
    },
    #[error(
        "egress redirection is on for this namespace (supervision.openshell.ai/egress=redirect) \
         and this Pod would run without it: {reason}"
    )]
    NotRedirected { reason: String },
}

impl Refusal {
    pub fn reason(&self) -> RefuseReason {
        match self {
            Refusal::VolumeDeclared { .. } => RefuseReason::VolumeDeclared,
            Refusal::VolumeMounted { .. } => RefuseReason::VolumeMounted,
            Refusal::GatewayToken { .. } => RefuseReason::GatewayToken,
            Refusal::HostPid => RefuseReason::HostPid,
            Refusal::HostProcess { .. } => RefuseReason::HostProcess,
            Refusal::Privileged { .. } => RefuseReason::Privileged,
            Refusal::Capability { .. } => RefuseReason::Capabilities,
            Refusal::NotRedirected { .. } => RefuseReason::NotRedirected,
        }
    }
}

fn quoted(text: &str) -> String {
    plumbing::text::bounded(text, MAX_QUOTED_BYTES)
}

/// Is `capability` (as a runtime reads it: any case, with or without `CAP_`) in the baseline set?
pub fn is_baseline_capability(capability: &str) -> bool {
    let capability = capability.trim();
    let bare = match capability.get(..4) {
        Some(prefix) if prefix.eq_ignore_ascii_case("CAP_") => &capability[4..],
        _ => capability,
    };
    BASELINE_CAPABILITIES
        .iter()
        .any(|allowed| allowed.eq_ignore_ascii_case(bare))
}

impl ContainerView<'_> {
    fn reference(&self) -> ContainerRef {
        ContainerRef {
            name: quoted(self.name),
            field: self.list.unwrap_or(ContainerList::Containers).field(),
            index: self.index,
        }
    }

    fn check(&self) -> Result<(), Refusal> {
        for volume in &self.volumes {
            if let Some((_, holds)) = SIDECAR_VOLUMES.iter().find(|(name, _)| name == volume) {
                return Err(Refusal::VolumeMounted {
                    container: self.reference(),
                    volume: quoted(volume),
                    holds,
                });
            }
        }
        if self.privileged {
            return Err(Refusal::Privileged {
                container: self.reference(),
            });
        }
        if let Some(capability) = self.added_capabilities.iter().find(|c| !is_baseline_capability(c)) {
            return Err(Refusal::Capability {
                container: self.reference(),
                capability: quoted(capability),
            });
        }
        if self.host_process {
            return Err(Refusal::HostProcess {
                container: Some(self.reference()),
            });
        }
        Ok(())
    }
}

/// The first rule `pod` breaks, if any. `gateway_audience` is the audience of the token the
/// webhook projects for the sidecar (`--token-audience`).
pub fn check(pod: &PodView<'_>, gateway_audience: &str) -> Result<(), Refusal> {
    for volume in &pod.volumes {
        if INJECTED_VOLUMES.contains(&volume.name) {
            return Err(Refusal::VolumeDeclared {
                volume: quoted(volume.name),
                index: volume.index,
            });
        }
        if volume.token_audiences.contains(&gateway_audience) {
            return Err(Refusal::GatewayToken {
                volume: quoted(volume.name),
                index: volume.index,
                audience: quoted(gateway_audience),
            });
        }
    }
    if pod.host_pid {
        return Err(Refusal::HostPid);
    }
    if pod.host_process {
        return Err(Refusal::HostProcess { container: None });
    }
    pod.containers.iter().try_for_each(ContainerView::check)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn app<'a>() -> ContainerView<'a> {
        ContainerView {
            list: Some(ContainerList::Containers),
            name: "app",
            ..ContainerView::default()
        }
    }

    fn pod(container: ContainerView<'_>) -> PodView<'_> {
        PodView {
            containers: vec![container],
            ..PodView::default()
        }
    }

    #[test]
    fn capabilities_are_read_as_runtimes_read_them() {
        for allowed in ["CHOWN", "chown", "CAP_CHOWN", "cap_net_bind_service", " KILL "] {
            assert!(is_baseline_capability(allowed), "{allowed}");
        }
        for refused in [
            "SYS_PTRACE",
            "CAP_SYS_PTRACE",
            "sys_ptrace",
            "ALL",
            "NET_ADMIN",
            "",
            "CAP_",
        ] {
            assert!(!is_baseline_capability(refused), "{refused}");
        }
    }

    #[test]
    fn each_rule_names_what_breaks_it() {
        let gateway = "openshell-gateway";
        assert_eq!(check(&pod(app()), gateway), Ok(()));

        let mounts = ContainerView {
            volumes: vec!["data", STATE_VOLUME],
            ..app()
        };
        let refusal = check(&pod(mounts), gateway).unwrap_err();
        assert_eq!(refusal.reason(), RefuseReason::VolumeMounted);
        let message = refusal.to_string();
        assert!(message.contains(r#"container "app" (spec.containers[0]) mounts volume "openshell-sidecar-state""#));
        assert!(message.contains("fence state and receipt key"), "{message}");

        // The socket volume is the workload's.
        let socket = ContainerView {
            volumes: vec![SOCKET_VOLUME],
            ..app()
        };
        assert_eq!(check(&pod(socket), gateway), Ok(()));

        let declared = PodView {
            volumes: vec![VolumeView {
                index: 2,
                name: SOCKET_VOLUME,
                token_audiences: Vec::new(),
            }],
            ..pod(app())
        };
        assert_eq!(
            check(&declared, gateway),
            Err(Refusal::VolumeDeclared {
                volume: SOCKET_VOLUME.into(),
                index: 2
            })
        );

        let token = PodView {
            volumes: vec![VolumeView {
                index: 0,
                name: "mine",
                token_audiences: vec!["vault", gateway],
            }],
            ..pod(app())
        };
        assert_eq!(check(&token, gateway).unwrap_err().reason(), RefuseReason::GatewayToken);
        assert_eq!(check(&token, "another-gateway"), Ok(()));

        let host_pid = PodView {
            host_pid: true,
            ..pod(app())
        };
        assert_eq!(check(&host_pid, gateway), Err(Refusal::HostPid));
        let host_process = PodView {
            host_process: true,
            ..pod(app())
        };
        assert!(
            check(&host_process, gateway)
                .unwrap_err()
                .to_string()
                .starts_with("the Pod (")
        );

        let privileged = ContainerView {
            list: Some(ContainerList::EphemeralContainers),
            name: "debug",
            privileged: true,
            ..app()
        };
        assert!(
            check(&pod(privileged), gateway)
                .unwrap_err()
                .to_string()
                .starts_with(r#"container "debug" (spec.ephemeralContainers[0]) is privileged"#)
        );
        let ptrace = ContainerView {
            added_capabilities: vec!["CHOWN", "CAP_SYS_PTRACE"],
            ..app()
        };
        assert_eq!(
            check(&pod(ptrace), gateway).unwrap_err(),
            Refusal::Capability {
                container: app().reference(),
                capability: "CAP_SYS_PTRACE".into()
            }
        );
    }

    #[test]
    fn what_the_pod_wrote_is_quoted_bounded() {
        let long = "x".repeat(10_000);
        let container = ContainerView {
            name: &long,
            privileged: true,
            ..app()
        };
        let message = check(&pod(container), "g").unwrap_err().to_string();
        assert!(message.len() < 512, "{} bytes", message.len());
    }
}
