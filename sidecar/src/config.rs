//! The sidecar's configuration: command-line flags, each also read from an `OPENSHELL_*`
//! environment variable (the webhook injects them in Kubernetes; the local launcher sets them).
//! Holds no secret: the token is read from `supervision_dir` when it is needed.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use plumbing::tls::ClientTls;

pub use plumbing::logging::LogFormat;

#[derive(Clone, Debug, Parser)]
#[command(
    name = "sidecar",
    version = plumbing::build::version(),
    about = "Shared-supervision sidecar: fence, relay and recovery clock of one workload"
)]
pub struct Config {
    /// Supervisor runtime addresses to dial, comma-separated (in Kubernetes one Service URL;
    /// locally the members' runtime addresses: any member answers or redirects).
    #[arg(long, env = "OPENSHELL_SUPERVISOR_ROUTE", value_delimiter = ',', required = true)]
    pub supervisor_route: Vec<String>,
    /// The gateways of the instance registry (`--gateway-endpoints`, required) and their trust
    /// (`--tls-ca`, default `ca.crt` in the supervision directory; `--gateway-tls-name`).
    #[command(flatten)]
    pub gateway: plumbing::gateway::GatewayArgs,
    /// Namespace of the workload Pod (local mode: the launcher's namespace, e.g. "default").
    #[arg(long, env = "OPENSHELL_POD_NAMESPACE")]
    pub namespace: String,
    /// Name of the workload Pod.
    #[arg(long, env = "OPENSHELL_POD_NAME")]
    pub name: String,
    /// UID of the workload Pod (local mode: a fresh UUID per workload start).
    #[arg(long, env = "OPENSHELL_POD_UID")]
    pub uid: String,
    /// Route of the instance; defaults to "<namespace>/<name>".
    #[arg(long, env = "OPENSHELL_ROUTE")]
    pub route: Option<String>,
    /// Directory holding `token` (the Pod's ServiceAccount token in Kubernetes, the route's
    /// bootstrap token locally), `trust.jwks` (the gateway's keys) and
    /// `ca.crt` (the CA of the pool's TLS certificates); all are re-read when they change.
    #[arg(long, env = "OPENSHELL_SUPERVISION_DIR")]
    pub supervision_dir: PathBuf,
    /// DNS name the supervisor members' certificates carry (the supervisor Service's), for
    /// route and redirect addresses that are IPs. Default: the dialed host.
    #[arg(long, env = "OPENSHELL_SUPERVISOR_TLS_NAME")]
    pub supervisor_tls_name: Option<String>,
    /// Unix socket path of the workload endpoint.
    #[arg(long, env = "OPENSHELL_SIDECAR_SOCKET")]
    pub socket: PathBuf,
    /// Directory where the fence state persists (an emptyDir in Kubernetes).
    #[arg(long, env = "OPENSHELL_SIDECAR_STATE_DIR")]
    pub state_dir: PathBuf,
    /// Expected `iss` of grants and activation proofs.
    #[arg(long, env = "OPENSHELL_GATEWAY_ISSUER", default_value = proto::trust::DEFAULT_ISSUER)]
    pub issuer: String,
    /// Seconds between SIGTERM and SIGKILL when the sidecar stops the workload.
    #[arg(long, env = "OPENSHELL_SIDECAR_STOP_GRACE_SECONDS", default_value_t = 10)]
    pub stop_grace_seconds: u64,
    /// Seconds an open workload connection may go without a request before the sidecar closes
    /// it (at least 1; a client reconnects when it next needs the socket).
    #[arg(long, env = "OPENSHELL_SIDECAR_IDLE_TIMEOUT_SECONDS", default_value_t = 300,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_timeout_seconds: u64,
    /// The Pod's `restartPolicy` (the webhook sets it when it is not `Always`): whether the
    /// kubelet starts the workload's container again after its process ended, so that the
    /// sidecar supervises the next process as the next generation.
    #[arg(long, env = "OPENSHELL_WORKLOAD_RESTART_POLICY", default_value = "Always",
          value_parser = ["Always", "OnFailure", "Never"])]
    pub restart_policy: String,
    /// In a Pod with a shared PID namespace (the webhook sets it): the workload is also
    /// identified without its cooperation, as the one container main process of the Pod
    /// besides the sidecar (a process whose parent is outside the namespace), so a workload
    /// that never talks to the socket is supervised too.
    #[arg(long, env = "OPENSHELL_WORKLOAD_FROM_PID_NAMESPACE", default_value_t = false, action = clap::ArgAction::Set)]
    pub workload_from_pid_namespace: bool,
    /// Loopback address of the egress proxy the workload's HTTP clients use (`HTTP_PROXY`),
    /// e.g. `127.0.0.1:15001`; unset: no proxy. It denies every destination until the owner
    /// installs a policy revision.
    #[arg(long, env = "OPENSHELL_EGRESS_LISTEN")]
    pub egress_listen: Option<std::net::SocketAddr>,
    /// Under egress redirection (the Pod's network rules send every TCP connection of the
    /// workload here): the loopback address where those connections are decided, e.g.
    /// `127.0.0.1:15002`.
    #[arg(long, env = "OPENSHELL_EGRESS_REDIRECT_LISTEN")]
    pub egress_redirect_listen: Option<std::net::SocketAddr>,
    /// Under egress redirection: the socket of the Pod's dialer (`egress dialer`), which opens
    /// the connections of this process that leave the Pod — the network rules let only its
    /// connections out.
    #[arg(long, env = "OPENSHELL_EGRESS_DIALER")]
    pub egress_dialer: Option<PathBuf>,
    /// `--log-format` (`OPENSHELL_LOG_FORMAT`): text or json.
    #[command(flatten)]
    pub log: plumbing::logging::LogArgs,
    /// Workload command to start and supervise (local mode), after `--`. Without it the
    /// workload is the first process that connects to the socket (Kubernetes).
    #[arg(last = true)]
    pub command: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0} is empty (set {1})")]
    Missing(&'static str, &'static str),
    #[error("the route must be 1..={max} bytes of printable ASCII without whitespace", max = proto::MAX_ROUTE_BYTES)]
    Route,
    #[error("{0} is not an http:// or https:// URI: {1}")]
    Address(&'static str, String),
    #[error("{0}: {1}")]
    TlsName(&'static str, String),
    #[error(
        "OPENSHELL_EGRESS_LISTEN and OPENSHELL_EGRESS_REDIRECT_LISTEN must be loopback addresses (the proxy is the workload's only): {0}"
    )]
    EgressListen(std::net::SocketAddr),
}

impl Config {
    /// The instance's route: the configured one, or "<namespace>/<name>".
    pub fn route(&self) -> String {
        self.route
            .clone()
            .unwrap_or_else(|| format!("{}/{}", self.namespace, self.name))
    }

    pub fn stop_grace(&self) -> Duration {
        Duration::from_secs(self.stop_grace_seconds)
    }

    /// Whether, after the instance ended with `outcome`, the workload's container may run
    /// again (in a Pod, by its restart policy) and its next process is supervised as the next
    /// generation. Whether it does run again is the kubelet's: the next run waits for a new
    /// process (a workload that exited with success under `OnFailure` gets none, and the Pod
    /// completes).
    pub fn supervises_next(&self, outcome: crate::Outcome) -> bool {
        use crate::Outcome::{Exited, RecoveryFailed};
        self.command.is_empty()
            && matches!(self.restart_policy.as_str(), "Always" | "OnFailure")
            && matches!(outcome, Exited | RecoveryFailed)
    }

    /// The workload endpoint's bounds.
    pub fn workload_limits(&self) -> crate::workload::Limits {
        crate::workload::Limits {
            idle: Duration::from_secs(self.idle_timeout_seconds),
            ..crate::workload::Limits::default()
        }
    }

    /// Checks what clap cannot: non-empty identity, a valid route, dialable addresses.
    pub fn validate(&self) -> Result<(), Error> {
        let required = [
            (&self.namespace, "namespace", "OPENSHELL_POD_NAMESPACE"),
            (&self.name, "name", "OPENSHELL_POD_NAME"),
            (&self.uid, "uid", "OPENSHELL_POD_UID"),
        ];
        for (value, what, env) in required {
            if value.is_empty() {
                return Err(Error::Missing(what, env));
            }
        }
        if !valid_route(&self.route()) {
            return Err(Error::Route);
        }
        let lists = [
            (&self.supervisor_route, "OPENSHELL_SUPERVISOR_ROUTE"),
            (&self.gateway.gateway_endpoints, "OPENSHELL_GATEWAY_ENDPOINTS"),
        ];
        for (list, env) in lists {
            if list.iter().all(|a| a.trim().is_empty()) {
                return Err(Error::Missing("address list", env));
            }
            if let Some(bad) = list.iter().find(|a| !a.trim().is_empty() && !valid_address(a.trim())) {
                return Err(Error::Address(env, bad.clone()));
            }
        }
        if let Some(listen) = [self.egress_listen, self.egress_redirect_listen]
            .into_iter()
            .flatten()
            .find(|l| !l.ip().is_loopback())
        {
            return Err(Error::EgressListen(listen));
        }
        // Redirected, this process's own connections would come back to it without the dialer.
        if self.egress_redirect_listen.is_some() && self.egress_dialer.is_none() {
            return Err(Error::Missing("the dialer's socket", "OPENSHELL_EGRESS_DIALER"));
        }
        let names = [
            (&self.supervisor_tls_name, "OPENSHELL_SUPERVISOR_TLS_NAME"),
            (&self.gateway.gateway_tls_name, "OPENSHELL_GATEWAY_TLS_NAME"),
        ];
        for (name, env) in names {
            if let Some(name) = name {
                plumbing::tls::check_server_name(name).map_err(|why| Error::TlsName(env, why))?;
            }
        }
        Ok(())
    }

    /// The CA bundle file: `--tls-ca`, else `ca.crt` in the supervision directory (read only
    /// when an https:// address is dialed; the gateway delivers it beside the token).
    pub fn tls_ca(&self) -> PathBuf {
        self.gateway
            .tls_ca
            .clone()
            .unwrap_or_else(|| self.supervision_dir.join(plumbing::tls::CA_FILE))
    }

    /// How supervisor route, member and redirect addresses are verified.
    pub fn supervisor_tls(&self) -> ClientTls {
        ClientTls {
            ca: Some(self.tls_ca()),
            server_name: self.supervisor_tls_name.clone(),
            dialer: self.dialer(),
        }
    }

    /// How gateway endpoints are verified.
    pub fn gateway_tls(&self) -> ClientTls {
        ClientTls {
            dialer: self.dialer(),
            ..self.gateway.tls_with(Some(self.tls_ca()))
        }
    }

    /// Under egress redirection: the Pod's dialer, which opens every connection of this
    /// process that leaves the Pod.
    pub fn dialer(&self) -> Option<plumbing::dialer::Dialer> {
        self.egress_dialer.as_ref().map(plumbing::dialer::Dialer::new)
    }

    /// The non-empty supervisor route addresses.
    pub fn route_addresses(&self) -> Vec<String> {
        addresses(&self.supervisor_route)
    }

    /// The non-empty gateway endpoints.
    pub fn gateway_addresses(&self) -> Vec<String> {
        self.gateway.endpoints()
    }

    /// What no egress policy opens: among it the pool's own endpoints (the gateways and the
    /// supervisor route, by name; their addresses as they resolve now, best effort).
    pub async fn egress_floor(&self) -> crate::egress::Floor {
        let endpoints: Vec<String> = self
            .gateway_addresses()
            .into_iter()
            .chain(self.route_addresses())
            .collect();
        // Every container of a Pod has KUBERNETES_SERVICE_HOST (the kubelet sets it whatever
        // the Pod says): only outside Kubernetes are upstreams on loopback.
        let mut floor = crate::egress::Floor {
            local: std::env::var_os("KUBERNETES_SERVICE_HOST").is_none(),
            ..crate::egress::Floor::default()
        };
        for endpoint in endpoints {
            let Ok(uri) = endpoint.parse::<tonic::transport::Uri>() else {
                continue;
            };
            let (Some(host), port) = (uri.host(), uri.port_u16().unwrap_or(443)) else {
                continue;
            };
            let host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
            let lookup = tokio::net::lookup_host((host.as_str(), port));
            if let Ok(Ok(addresses)) = tokio::time::timeout(Duration::from_secs(2), lookup).await {
                floor.pool_endpoints.extend(addresses);
            }
            floor.pool_names.push(host);
        }
        floor
    }
}

fn addresses(list: &[String]) -> Vec<String> {
    plumbing::gateway::endpoint_list(list)
}

/// Routes are printable ASCII without whitespace, bounded (common.proto).
pub fn valid_route(route: &str) -> bool {
    plumbing::validate::route(route).is_ok()
}

/// An address the sidecar may dial (configured, or named by a Redirect): http(s) with a host
/// and a port.
pub fn valid_address(address: &str) -> bool {
    plumbing::validate::address(address, plumbing::validate::MAX_ADDRESS_BYTES).is_ok()
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn parse(args: &[&str]) -> Config {
        let base = [
            "sidecar",
            "--supervisor-route",
            "http://127.0.0.1:1,http://127.0.0.1:2",
            "--gateway-endpoints",
            "http://127.0.0.1:3",
            "--namespace",
            "team-a",
            "--name",
            "agent",
            "--uid",
            "u-1",
            "--supervision-dir",
            "/s",
            "--socket",
            "/s/sock",
            "--state-dir",
            "/state",
        ];
        Config::try_parse_from(base.iter().chain(args)).unwrap()
    }

    #[test]
    fn defaults_route_lists_and_command() {
        let c = parse(&["--", "sleep", "600"]);
        assert_eq!(c.route(), "team-a/agent");
        assert_eq!(c.route_addresses().len(), 2);
        assert_eq!(c.stop_grace(), Duration::from_secs(10));
        assert_eq!(c.issuer, proto::trust::DEFAULT_ISSUER);
        assert_eq!(c.command, ["sleep", "600"]);
        c.validate().unwrap();
    }

    #[test]
    fn the_next_process_is_supervised_only_as_the_kubelet_restarts_it() {
        use crate::Outcome::{Exited, RecoveryFailed, Released, Shutdown};
        let always = parse(&[]);
        assert!(always.supervises_next(Exited) && always.supervises_next(RecoveryFailed));
        assert!(!always.supervises_next(Released) && !always.supervises_next(Shutdown));
        let on_failure = parse(&["--restart-policy", "OnFailure"]);
        assert!(
            on_failure.supervises_next(RecoveryFailed) && on_failure.supervises_next(Exited),
            "a failed exit is restarted: the next run waits for the kubelet to start it"
        );
        assert!(!on_failure.supervises_next(Released));
        let never = parse(&["--restart-policy", "Never"]);
        assert!(!never.supervises_next(RecoveryFailed) && !never.supervises_next(Exited));
        let local = parse(&["--", "sleep", "600"]);
        assert!(
            !local.supervises_next(Exited),
            "a started workload is the launcher's to restart"
        );
        let all = [&["sidecar"][..], &["--restart-policy", "Sometimes"]].concat();
        assert!(Config::try_parse_from(all).is_err());
    }

    #[test]
    fn validation_refuses_bad_routes_and_addresses() {
        let mut c = parse(&[]);
        c.route = Some("has space".into());
        assert!(matches!(c.validate(), Err(Error::Route)));
        let mut c = parse(&[]);
        c.supervisor_route = vec!["127.0.0.1:5".into()];
        assert!(matches!(c.validate(), Err(Error::Address(..))));
        // No host: refused here as by the supervisor, the gateway and the webhook.
        for hostless in ["http://", "https://", "http://:7443"] {
            let mut c = parse(&[]);
            c.supervisor_route = vec![hostless.into()];
            assert!(matches!(c.validate(), Err(Error::Address(..))), "{hostless}");
            assert!(!valid_address(hostless), "a redirect to {hostless} is not followed");
        }
        let mut c = parse(&[]);
        c.uid.clear();
        assert!(matches!(c.validate(), Err(Error::Missing("uid", _))));
        let c = parse(&["--supervisor-tls-name", "not a name"]);
        assert!(
            matches!(c.validate(), Err(Error::TlsName("OPENSHELL_SUPERVISOR_TLS_NAME", _))),
            "{:?}",
            c.validate()
        );
    }

    #[test]
    fn tls_trust_defaults_to_the_supervision_directory() {
        let c = parse(&[]);
        assert_eq!(c.tls_ca(), PathBuf::from("/s/ca.crt"));
        assert_eq!(c.supervisor_tls().server_name, None);
        let c = parse(&[
            "--tls-ca",
            "/etc/pool/ca.crt",
            "--supervisor-tls-name",
            "openshell-supervisor.system.svc",
            "--gateway-tls-name",
            "openshell-gateway.system.svc",
        ]);
        c.validate().unwrap();
        let supervisor = c.supervisor_tls();
        assert_eq!(supervisor.ca.as_deref(), Some(Path::new("/etc/pool/ca.crt")));
        assert_eq!(
            supervisor.server_name.as_deref(),
            Some("openshell-supervisor.system.svc")
        );
        let gateway = c.gateway_tls();
        assert_eq!(gateway.ca, supervisor.ca);
        assert_eq!(gateway.server_name.as_deref(), Some("openshell-gateway.system.svc"));
    }
}
