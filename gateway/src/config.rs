//! Command line and environment settings of a gateway replica.

use std::path::PathBuf;

use clap::Parser;

use crate::Error;
use crate::store;

#[derive(Debug, Clone, Parser)]
#[command(name = "gateway", version, about = "Shared-supervision gateway replica")]
pub struct Settings {
    /// Database URL: postgres://… for production, sqlite:… for the embedded
    /// store. Unset: an SQLite file in --data-dir.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,

    /// Directory of the embedded SQLite store (used when no URL is given).
    #[arg(long, env = "OPENSHELL_GATEWAY_DATA_DIR", default_value = ".local/gateway")]
    pub data_dir: PathBuf,

    /// This replica's name (its Pod name in Kubernetes). The lease holder is
    /// this name plus a random per-process suffix.
    #[arg(long, env = "OPENSHELL_GATEWAY_REPLICA", default_value = "gateway")]
    pub replica: String,

    /// Address the gRPC server listens on (member streams, registry, operator API).
    #[arg(long, env = "OPENSHELL_GATEWAY_LISTEN", default_value = "127.0.0.1:8443")]
    pub listen: String,

    /// PEM certificate (chain) of the gRPC port; with --tls-key the port speaks TLS only.
    /// Re-read when the file changes.
    #[arg(long, env = "OPENSHELL_GATEWAY_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert.
    #[arg(long, env = "OPENSHELL_GATEWAY_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// PEM CA bundle that verifies the pool's gateway and supervisor certificates; delivered
    /// as `ca.crt` beside every token (files locally, Secrets in Kubernetes). Re-read on
    /// every delivery round.
    #[arg(long, env = "OPENSHELL_GATEWAY_TLS_CA")]
    pub tls_ca: Option<PathBuf>,

    /// Plain-HTTP health port (/healthz, /readyz, /metrics). Unset: none.
    #[arg(long, env = "OPENSHELL_GATEWAY_HEALTH_LISTEN")]
    pub health_listen: Option<String>,

    /// Issuer of the tokens this gateway signs and verifies.
    #[arg(long, env = "OPENSHELL_GATEWAY_ISSUER", default_value = proto::trust::DEFAULT_ISSUER)]
    pub issuer: String,

    /// Name of the supervisor pool (the subject of its members' token).
    #[arg(long, env = "OPENSHELL_GATEWAY_POOL", default_value = "default")]
    pub pool: String,

    /// Local mode: directory where the coordinator writes the supervisor,
    /// operator and namespace tokens with the trust bundle. Unset: no files.
    #[arg(long, env = "OPENSHELL_GATEWAY_CREDENTIALS_DIR")]
    pub credentials_dir: Option<PathBuf>,

    /// Local mode: namespaces whose sidecars get a token file (comma-separated).
    #[arg(
        long,
        env = "OPENSHELL_GATEWAY_NAMESPACES",
        value_delimiter = ',',
        default_value = "default"
    )]
    pub namespaces: Vec<String>,

    /// Kubernetes mode: follow labelled namespaces and supervised Pods, keep the token
    /// Secrets, record Events (in-cluster config or KUBECONFIG).
    #[arg(long, env = "OPENSHELL_GATEWAY_KUBERNETES", default_value_t = false)]
    pub kubernetes: bool,

    /// Kubernetes mode: the namespace the pool is installed in (its Secrets for the
    /// supervisor members and the operator go there).
    #[arg(long, env = "OPENSHELL_POD_NAMESPACE", default_value = "openshell-supervision")]
    pub install_namespace: String,

    /// Recovery deadline offered to sidecars, in milliseconds.
    #[arg(long, env = "OPENSHELL_SUPERVISOR_POOL_RECOVERY_TIMEOUT_MS", default_value_t = 60_000,
          value_parser = clap::value_parser!(u64).range(1_000..=3_600_000))]
    pub recovery_deadline_ms: u64,

    /// Coordinator lease length in milliseconds.
    #[arg(long, env = "OPENSHELL_GATEWAY_LEASE_LENGTH_MS", default_value_t = 5000,
          value_parser = clap::value_parser!(u64).range(500..=60_000))]
    pub lease_length_ms: u64,

    /// Print the pool status this often (milliseconds); 0 turns it off.
    #[arg(long, env = "OPENSHELL_GATEWAY_STATUS_INTERVAL_MS", default_value_t = 2000)]
    pub status_interval_ms: u64,

    /// Bound on connecting to the database, in milliseconds.
    #[arg(long, env = "OPENSHELL_GATEWAY_DATABASE_TIMEOUT_MS", default_value_t = 5000)]
    pub database_timeout_ms: u64,

    /// Log format: text or json.
    #[arg(long, env = "OPENSHELL_LOG_FORMAT", default_value = "text")]
    pub log_format: String,

    /// Connection limits of the gRPC and health ports.
    #[command(flatten)]
    pub connections: proto::listener::LimitArgs,
}

impl Settings {
    /// The database URL, creating the embedded store's directory if needed.
    pub fn database_url(&self) -> Result<String, Error> {
        if let Some(url) = &self.database_url {
            return Ok(url.clone());
        }
        std::fs::create_dir_all(&self.data_dir).map_err(|source| Error::DataDir {
            path: self.data_dir.display().to_string(),
            source,
        })?;
        Ok(format!(
            "sqlite://{}?mode=rwc",
            self.data_dir.join("gateway.db").display()
        ))
    }

    pub fn store_options(&self) -> store::Options {
        store::Options {
            connect_timeout: std::time::Duration::from_millis(self.database_timeout_ms),
            ..store::Options::default()
        }
    }
}
