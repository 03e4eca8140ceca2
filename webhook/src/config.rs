//! Command line / environment configuration (every flag has an `OPENSHELL_WEBHOOK_*` env var).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use crate::inject::{
    DEFAULT_GATEWAY_ENDPOINT, DEFAULT_SUPERVISOR_ROUTE, DEFAULT_SUPERVISOR_TLS_NAME, InjectConfig, SidecarMode,
    SidecarResources,
};

pub use plumbing::logging::LogFormat;

/// A setting the sidecars could not use.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("{0} is empty: give at least one address")]
    Empty(&'static str),
    #[error("{0}: {1:?} is not an https://host:port (or plaintext http://host:port) address")]
    Address(&'static str, String),
    #[error("{0}: {1:?} is not a DNS name or IP address to verify certificates against")]
    TlsName(&'static str, String),
}

/// Trimmed, non-empty entries.
fn addresses(list: &[String]) -> Vec<String> {
    plumbing::gateway::endpoint_list(list)
}

/// `https://` (or plaintext `http://`) with a host and a port ([`plumbing::validate::address`]).
fn grpc_address(address: &str) -> bool {
    plumbing::validate::address(address, plumbing::validate::MAX_ADDRESS_BYTES).is_ok()
}

/// OpenShell shared-supervision mutating admission webhook.
#[derive(Clone, Debug, Parser)]
#[command(name = "webhook", version = plumbing::build::version(), about)]
pub struct Config {
    /// HTTPS address serving POST /mutate.
    #[arg(long, env = "OPENSHELL_WEBHOOK_LISTEN", default_value = "0.0.0.0:9443")]
    pub listen: SocketAddr,

    /// Plain-HTTP address serving /healthz, /readyz and /metrics.
    #[arg(long, env = "OPENSHELL_WEBHOOK_METRICS_LISTEN", default_value = "0.0.0.0:9090")]
    pub metrics_listen: SocketAddr,

    /// PEM certificate chain (reloaded when it changes).
    #[arg(
        long,
        env = "OPENSHELL_WEBHOOK_TLS_CERT",
        default_value = "/etc/openshell/webhook/tls/tls.crt"
    )]
    pub tls_cert: PathBuf,

    /// PEM private key (reloaded when it changes).
    #[arg(
        long,
        env = "OPENSHELL_WEBHOOK_TLS_KEY",
        default_value = "/etc/openshell/webhook/tls/tls.key"
    )]
    pub tls_key: PathBuf,

    /// How often the certificate files are checked for changes, in milliseconds.
    #[arg(long, env = "OPENSHELL_WEBHOOK_CERT_RELOAD_MS", default_value_t = 1000)]
    pub cert_reload_ms: u64,

    /// Sidecar image injected into Pods.
    #[arg(
        long,
        env = "OPENSHELL_WEBHOOK_SIDECAR_IMAGE",
        default_value = "openshell/sidecar:0.1.0"
    )]
    pub sidecar_image: String,

    /// imagePullPolicy of the injected sidecar.
    #[arg(
        long,
        env = "OPENSHELL_WEBHOOK_SIDECAR_IMAGE_PULL_POLICY",
        default_value = "IfNotPresent"
    )]
    pub sidecar_image_pull_policy: String,

    /// Default sidecar mode: `native` (init container with restartPolicy Always, Kubernetes
    /// 1.29 or newer) or `container` (older clusters). Pods override it with the annotation
    /// supervision.openshell.ai/sidecar-mode.
    #[arg(long, env = "OPENSHELL_WEBHOOK_SIDECAR_MODE", value_enum, default_value = "native")]
    pub sidecar_mode: SidecarMode,

    /// Audience of the projected ServiceAccount token the sidecar authenticates to the gateway
    /// with (the gateway's `OPENSHELL_GATEWAY_TOKEN_AUDIENCE`).
    #[arg(long, env = "OPENSHELL_WEBHOOK_TOKEN_AUDIENCE", default_value = proto::trust::KUBERNETES_AUDIENCE)]
    pub token_audience: String,

    /// Lifetime of that token in seconds (the kubelet renews it at 80 %; at least 600).
    #[arg(long, env = "OPENSHELL_WEBHOOK_TOKEN_EXPIRATION_SECONDS", default_value_t = 3600,
          value_parser = clap::value_parser!(i64).range(600..=86_400))]
    pub token_expiration_seconds: i64,

    /// Supervisor pool address given to sidecars and workloads (`OPENSHELL_SUPERVISOR_ROUTE`):
    /// the supervisor Service, gRPC over TLS (`https://`; `http://` for a plaintext pool).
    #[arg(long, env = "OPENSHELL_WEBHOOK_SUPERVISOR_ROUTE", default_value = DEFAULT_SUPERVISOR_ROUTE)]
    pub supervisor_route: String,

    /// Gateway gRPC endpoints given to sidecars (`OPENSHELL_GATEWAY_ENDPOINTS`),
    /// comma-separated (`https://`; `http://` for a plaintext gateway).
    #[arg(
        long,
        env = "OPENSHELL_WEBHOOK_GATEWAY_ENDPOINTS",
        value_delimiter = ',',
        default_value = DEFAULT_GATEWAY_ENDPOINT
    )]
    pub gateway_endpoints: Vec<String>,

    /// Server name sidecars verify supervisor certificates against
    /// (`OPENSHELL_SUPERVISOR_TLS_NAME`): the name in the members' certificates, since
    /// sidecars reach members by Pod IP. An empty value injects nothing.
    #[arg(
        long,
        env = "OPENSHELL_WEBHOOK_SUPERVISOR_TLS_NAME",
        default_value = DEFAULT_SUPERVISOR_TLS_NAME
    )]
    pub supervisor_tls_name: String,

    /// The install namespace (never mutated).
    #[arg(
        long,
        env = "OPENSHELL_WEBHOOK_INSTALL_NAMESPACE",
        default_value = "openshell-supervision"
    )]
    pub install_namespace: String,

    #[arg(long, env = "OPENSHELL_WEBHOOK_SIDECAR_CPU_REQUEST", default_value = "10m")]
    pub sidecar_cpu_request: String,

    #[arg(long, env = "OPENSHELL_WEBHOOK_SIDECAR_MEMORY_REQUEST", default_value = "32Mi")]
    pub sidecar_memory_request: String,

    /// CPU limit of the sidecar; an empty string sets none.
    #[arg(long, env = "OPENSHELL_WEBHOOK_SIDECAR_CPU_LIMIT", default_value = "500m")]
    pub sidecar_cpu_limit: String,

    #[arg(long, env = "OPENSHELL_WEBHOOK_SIDECAR_MEMORY_LIMIT", default_value = "128Mi")]
    pub sidecar_memory_limit: String,

    /// runAsUser for the sidecar. Unset: the Pod's runAsUser (so the sidecar can signal the
    /// workload) or the image's numeric USER.
    #[arg(long, env = "OPENSHELL_WEBHOOK_SIDECAR_RUN_AS_USER")]
    pub sidecar_run_as_user: Option<i64>,

    /// Loopback port of the sidecar's egress proxy: the sidecar listens on 127.0.0.1:PORT
    /// and every workload container gets HTTP_PROXY, HTTPS_PROXY and NO_PROXY (both cases)
    /// pointing at it, unless the Pod's annotation supervision.openshell.ai/egress-proxy is
    /// `disabled` or the container sets them itself. 0 injects no proxy.
    #[arg(long, env = "OPENSHELL_WEBHOOK_EGRESS_PORT", default_value_t = 15001)]
    pub egress_port: u16,

    /// Under egress redirection (namespaces labelled supervision.openshell.ai/egress=redirect):
    /// the loopback port of the sidecar's redirect listener, where the Pod's network rules send
    /// every TCP connection.
    #[arg(long, env = "OPENSHELL_WEBHOOK_EGRESS_REDIRECT_PORT", default_value_t = 15002)]
    pub egress_redirect_port: u16,

    /// Under egress redirection: the UID and GID of every Pod's dialer, whose connections
    /// alone leave the Pod. Unset (the default): a UID drawn per Pod from
    /// 1,000,000,000..2,000,000,000, which no image can be built to run as beforehand.
    #[arg(long, env = "OPENSHELL_WEBHOOK_EGRESS_DIALER_UID",
          value_parser = clap::value_parser!(i64).range(1..=2_147_483_647))]
    pub egress_dialer_uid: Option<i64>,

    /// Set the credential placeholders of the `SandboxPolicy` each Pod runs in its workload
    /// containers (a credential's `env`): the webhook then lists and watches the policies of
    /// every namespace with its ServiceAccount (in-cluster configuration or KUBECONFIG).
    #[arg(long, env = "OPENSHELL_WEBHOOK_PLACEHOLDERS")]
    pub placeholders: bool,

    /// Largest accepted request body, in bytes.
    #[arg(long, env = "OPENSHELL_WEBHOOK_MAX_BODY_BYTES", default_value_t = 3 * 1024 * 1024)]
    pub max_body_bytes: usize,

    /// Time allowed to receive a request body, in milliseconds.
    #[arg(long, env = "OPENSHELL_WEBHOOK_REQUEST_TIMEOUT_MS", default_value_t = 10_000)]
    pub request_timeout_ms: u64,

    /// After the first SIGTERM: keep serving (readyz failing) this long so endpoints
    /// controllers and the API server stop sending, in milliseconds.
    #[arg(long, env = "OPENSHELL_WEBHOOK_SHUTDOWN_DELAY_MS", default_value_t = 3_000)]
    pub shutdown_delay_ms: u64,

    /// Then wait at most this long for in-flight requests, in milliseconds.
    #[arg(long, env = "OPENSHELL_WEBHOOK_DRAIN_TIMEOUT_MS", default_value_t = 15_000)]
    pub drain_timeout_ms: u64,

    /// Log format.
    #[arg(long, env = "OPENSHELL_WEBHOOK_LOG_FORMAT", value_enum, default_value = "json")]
    pub log_format: LogFormat,

    /// Connection limits of the HTTPS and health ports.
    #[command(flatten)]
    pub connections: plumbing::listener::LimitArgs,
}

impl Config {
    /// The configuration with every default (and `OPENSHELL_WEBHOOK_*` overrides from the
    /// environment) and the given certificate paths: for tests and the benchmark.
    pub fn with_cert_paths(tls_cert: PathBuf, tls_key: PathBuf) -> Result<Self, clap::Error> {
        let mut config = Self::try_parse_from(["webhook"])?;
        config.tls_cert = tls_cert;
        config.tls_key = tls_key;
        Ok(config)
    }

    pub fn inject_config(&self) -> InjectConfig {
        InjectConfig {
            sidecar_image: self.sidecar_image.clone(),
            image_pull_policy: self.sidecar_image_pull_policy.clone(),
            default_mode: self.sidecar_mode,
            supervisor_route: self.supervisor_route.clone(),
            gateway_endpoints: addresses(&self.gateway_endpoints),
            supervisor_tls_name: Some(self.supervisor_tls_name.trim().to_owned()).filter(|n| !n.is_empty()),
            install_namespace: self.install_namespace.clone(),
            resources: SidecarResources {
                cpu_request: self.sidecar_cpu_request.clone(),
                memory_request: self.sidecar_memory_request.clone(),
                cpu_limit: Some(self.sidecar_cpu_limit.clone()).filter(|s| !s.is_empty()),
                memory_limit: self.sidecar_memory_limit.clone(),
            },
            run_as_user: self.sidecar_run_as_user,
            egress_port: (self.egress_port != 0).then_some(self.egress_port),
            egress_redirect: crate::inject::Redirect::Off,
            token_audience: self.token_audience.clone(),
            token_expiration_seconds: self.token_expiration_seconds,
            version: plumbing::build::version().into(),
        }
    }

    /// The injection for namespaces that turned egress redirection on.
    pub fn redirection(&self) -> crate::inject::Redirection {
        crate::inject::Redirection {
            port: self.egress_redirect_port,
            dialer_uid: self.egress_dialer_uid,
        }
    }

    /// Checks what clap cannot: the addresses given to sidecars must be dialable by them.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let route: Vec<String> = self.supervisor_route.split(',').map(str::to_owned).collect();
        for (list, env) in [
            (&route, "OPENSHELL_WEBHOOK_SUPERVISOR_ROUTE"),
            (&self.gateway_endpoints, "OPENSHELL_WEBHOOK_GATEWAY_ENDPOINTS"),
        ] {
            let list = addresses(list);
            if list.is_empty() {
                return Err(ConfigError::Empty(env));
            }
            if let Some(bad) = list.iter().find(|a| !grpc_address(a)) {
                return Err(ConfigError::Address(env, bad.clone()));
            }
        }
        let name = self.supervisor_tls_name.trim();
        if !name.is_empty() && plumbing::tls::check_server_name(name).is_err() {
            return Err(ConfigError::TlsName(
                "OPENSHELL_WEBHOOK_SUPERVISOR_TLS_NAME",
                self.supervisor_tls_name.clone(),
            ));
        }
        Ok(())
    }

    pub fn cert_reload_interval(&self) -> Duration {
        Duration::from_millis(self.cert_reload_ms.max(10))
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms.max(1))
    }

    pub fn shutdown_delay(&self) -> Duration {
        Duration::from_millis(self.shutdown_delay_ms)
    }

    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, clap::Error> {
        Config::try_parse_from(std::iter::once("webhook").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_are_tls_service_addresses() -> Result<(), Box<dyn std::error::Error>> {
        let config = parse(&[])?;
        config.validate()?;
        let inject = config.inject_config();
        assert_eq!(
            inject.supervisor_route,
            "https://openshell-supervisor.openshell-supervision.svc:7443"
        );
        assert_eq!(
            inject.gateway_endpoints,
            ["https://openshell-gateway.openshell-supervision.svc:8443"]
        );
        assert_eq!(
            inject.supervisor_tls_name.as_deref(),
            Some("openshell-supervisor.openshell-supervision.svc")
        );
        Ok(())
    }

    #[test]
    fn gateway_endpoints_are_a_comma_separated_list() -> Result<(), Box<dyn std::error::Error>> {
        let config = parse(&["--gateway-endpoints", "https://gw-0:8443, https://gw-1:8443,"])?;
        config.validate()?;
        assert_eq!(
            config.inject_config().gateway_endpoints,
            ["https://gw-0:8443", "https://gw-1:8443"]
        );
        Ok(())
    }

    #[test]
    fn plaintext_addresses_are_still_accepted() -> Result<(), Box<dyn std::error::Error>> {
        let config = parse(&[
            "--gateway-endpoints",
            "http://gw:8443",
            "--supervisor-route",
            "http://sup:7443",
        ])?;
        config.validate()?;
        assert_eq!(config.inject_config().supervisor_route, "http://sup:7443");
        Ok(())
    }

    #[test]
    fn supervisor_tls_name_is_configurable_and_empty_injects_none() -> Result<(), Box<dyn std::error::Error>> {
        let config = parse(&["--supervisor-tls-name", " pool.example.internal "])?;
        config.validate()?;
        assert_eq!(
            config.inject_config().supervisor_tls_name.as_deref(),
            Some("pool.example.internal")
        );
        let config = parse(&["--supervisor-tls-name", ""])?;
        config.validate()?;
        assert_eq!(config.inject_config().supervisor_tls_name, None);
        Ok(())
    }

    #[test]
    fn unusable_settings_are_refused_naming_the_variable() -> Result<(), Box<dyn std::error::Error>> {
        for (args, expected) in [
            (
                vec!["--gateway-endpoints", " , "],
                ConfigError::Empty("OPENSHELL_WEBHOOK_GATEWAY_ENDPOINTS"),
            ),
            (
                vec!["--gateway-endpoints", "grpcs://gw:8443"],
                ConfigError::Address("OPENSHELL_WEBHOOK_GATEWAY_ENDPOINTS", "grpcs://gw:8443".into()),
            ),
            (
                vec!["--gateway-endpoints", "https://gw:8443,ftp://gw:21"],
                ConfigError::Address("OPENSHELL_WEBHOOK_GATEWAY_ENDPOINTS", "ftp://gw:21".into()),
            ),
            (
                vec!["--supervisor-route", "openshell-supervisor:7443"],
                ConfigError::Address("OPENSHELL_WEBHOOK_SUPERVISOR_ROUTE", "openshell-supervisor:7443".into()),
            ),
            (
                vec!["--supervisor-route", "https://"],
                ConfigError::Address("OPENSHELL_WEBHOOK_SUPERVISOR_ROUTE", "https://".into()),
            ),
            (
                vec!["--supervisor-route", "http://"],
                ConfigError::Address("OPENSHELL_WEBHOOK_SUPERVISOR_ROUTE", "http://".into()),
            ),
            (
                vec!["--supervisor-tls-name", "openshell supervisor"],
                ConfigError::TlsName("OPENSHELL_WEBHOOK_SUPERVISOR_TLS_NAME", "openshell supervisor".into()),
            ),
            (
                vec!["--supervisor-tls-name", "https://openshell-supervisor"],
                ConfigError::TlsName(
                    "OPENSHELL_WEBHOOK_SUPERVISOR_TLS_NAME",
                    "https://openshell-supervisor".into(),
                ),
            ),
        ] {
            assert_eq!(parse(&args)?.validate(), Err(expected), "{args:?}");
        }
        Ok(())
    }
}
