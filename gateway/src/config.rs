//! Command line and environment settings of a gateway replica.

use std::path::PathBuf;

use clap::Parser;

use crate::Error;
use crate::store::sealing::{self, Kek, Keks};
use crate::store::{self, files};

/// `proto::timing::DETACHED_GRACE` in milliseconds (a flag default must be a literal value).
const DEFAULT_DETACHED_GRACE_MS: u64 = {
    let ms = proto::timing::DETACHED_GRACE.as_millis();
    assert!(ms <= u64::MAX as u128);
    ms as u64
};

#[derive(Debug, Clone, Parser)]
#[command(name = "gateway", version = plumbing::build::version(), about = "Shared-supervision gateway replica")]
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

    /// Local mode: directory where the coordinator writes the operator's, each member's
    /// and each instance's token with the trust bundle. Unset: no files.
    #[arg(long, env = "OPENSHELL_GATEWAY_CREDENTIALS_DIR")]
    pub credentials_dir: Option<PathBuf>,

    /// Local mode: pool members that get a token of their own in
    /// `<credentials-dir>/members/<member>/` (comma-separated).
    #[arg(long, env = "OPENSHELL_GATEWAY_MEMBERS", value_delimiter = ',')]
    pub members: Vec<String>,

    /// Local mode: instance routes "<namespace>/<name>" whose sidecars get a bootstrap token
    /// bound to that route in `<credentials-dir>/instances/<namespace>/<name>/`
    /// (comma-separated).
    #[arg(long, env = "OPENSHELL_GATEWAY_INSTANCES", value_delimiter = ',')]
    pub instances: Vec<String>,

    /// Kubernetes mode: follow labelled namespaces and supervised Pods, keep the token
    /// Secrets, record Events (in-cluster config or KUBECONFIG).
    #[arg(long, env = "OPENSHELL_GATEWAY_KUBERNETES", default_value_t = false)]
    pub kubernetes: bool,

    /// Kubernetes mode: the namespace the pool is installed in (its Secrets for the
    /// supervisor members and the operator go there).
    #[arg(long, env = "OPENSHELL_POD_NAMESPACE", default_value = "openshell-supervision")]
    pub install_namespace: String,

    /// Instances one namespace may have registered at once (in Kubernetes the namespace's
    /// `supervision.openshell.ai/max-instances` annotation overrides it).
    #[arg(long, env = "OPENSHELL_GATEWAY_NAMESPACE_INSTANCE_LIMIT", default_value_t = 256)]
    pub namespace_instance_limit: u32,

    /// Operator API: pool watches (`WatchSupervisorPool`, e.g. `poolctl watch`) this replica
    /// serves at once; one more is refused with RESOURCE_EXHAUSTED.
    #[arg(long, env = "OPENSHELL_GATEWAY_MAX_POOL_WATCHERS", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_pool_watchers: u32,

    /// Kubernetes mode: the audience of the projected ServiceAccount tokens sidecars and
    /// members authenticate with (checked by TokenReview).
    #[arg(long, env = "OPENSHELL_GATEWAY_TOKEN_AUDIENCE", default_value = proto::trust::KUBERNETES_AUDIENCE)]
    pub token_audience: String,

    /// Kubernetes mode: the ServiceAccount (in the install namespace) of the supervisor
    /// Pods; a token of any other account is never a member's.
    #[arg(
        long,
        env = "OPENSHELL_GATEWAY_SUPERVISOR_ACCOUNT",
        default_value = "openshell-supervisor"
    )]
    pub supervisor_account: String,

    /// Recovery deadline offered to sidecars, in milliseconds.
    #[arg(long, env = "OPENSHELL_SUPERVISOR_POOL_RECOVERY_TIMEOUT_MS", default_value_t = 60_000,
          value_parser = clap::value_parser!(u64).range(1_000..=3_600_000))]
    pub recovery_deadline_ms: u64,

    /// How long a member whose stream this replica ended for silence stays a member, in
    /// milliseconds: room to attach through another replica (a member cut off from this one
    /// keeps its instances), while a hung member's instances move this much later. The default
    /// is `proto::timing::DETACHED_GRACE`.
    #[arg(long, env = "OPENSHELL_GATEWAY_DETACHED_GRACE_MS", default_value_t = DEFAULT_DETACHED_GRACE_MS,
          value_parser = clap::value_parser!(u64).range(0..=15_000))]
    pub detached_grace_ms: u64,

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

    /// File holding the key-encryption key (32 random bytes, base64) that seals the signing
    /// keys' private halves in the store. Unset: with the embedded SQLite store one is
    /// generated beside the database (`key-encryption-key`, mode 0600); PostgreSQL refuses to
    /// start without one.
    #[arg(long, env = "OPENSHELL_GATEWAY_KEY_ENCRYPTION_KEY_FILE")]
    pub key_encryption_key_file: Option<PathBuf>,

    /// During a KEK rotation: the file of the key-encryption key being replaced. Keys sealed
    /// with it still open, and the coordinator re-seals them with the current one. A path
    /// that does not exist means no rotation is under way.
    #[arg(
        long,
        env = "OPENSHELL_GATEWAY_PREVIOUS_KEY_ENCRYPTION_KEY_FILE",
        requires = "key_encryption_key_file"
    )]
    pub previous_key_encryption_key_file: Option<PathBuf>,

    /// `--log-format` (`OPENSHELL_LOG_FORMAT`): text or json.
    #[command(flatten)]
    pub log: plumbing::logging::LogArgs,

    /// Connection limits of the gRPC and health ports.
    #[command(flatten)]
    pub connections: plumbing::listener::LimitArgs,
}

impl Settings {
    /// The database URL, creating the embedded store's directory (mode 0700) if needed.
    pub fn database_url(&self) -> Result<String, Error> {
        if let Some(url) = &self.database_url {
            return Ok(url.clone());
        }
        files::private_dir(&self.data_dir).map_err(|source| Error::DataDir {
            path: self.data_dir.display().to_string(),
            source,
        })?;
        Ok(format!(
            "sqlite://{}?mode=rwc",
            self.data_dir.join("gateway.db").display()
        ))
    }

    /// The key-encryption keys for the store at `url`: read from the configured files; with
    /// none configured, on SQLite the one beside the database file (generated there on first
    /// start: the path is returned), in memory a throwaway one, on PostgreSQL an error.
    /// Blocking: call it off the runtime.
    pub fn load_keks(&self, url: &str) -> Result<(Keks, Option<PathBuf>), Error> {
        if let Some(current) = &self.key_encryption_key_file {
            // A previous KEK file that does not exist is no rotation under way (a Secret
            // without its `previous` key); a row that needs it fails to open, by name.
            let previous = self.previous_key_encryption_key_file.as_deref().filter(|path| {
                let exists = path.exists();
                if !exists {
                    tracing::info!(path = %path.display(), "no previous key-encryption key file: no KEK rotation under way");
                }
                exists
            });
            return Ok((Keks::load(current, previous)?, None));
        }
        if !url.starts_with("sqlite:") {
            return Err(Error::KekRequired);
        }
        let Some(database) = files::sqlite_path(url) else {
            return Ok((Keks::new(Kek::generate()?, None), None));
        };
        let dir = match database.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
            _ => PathBuf::from("."),
        };
        files::private_dir(&dir).map_err(|source| Error::DataDir {
            path: dir.display().to_string(),
            source,
        })?;
        let path = sealing::generated_path(&dir);
        let (kek, created) = Kek::load_or_create(&path)?;
        Ok((Keks::new(kek, None), created.then_some(path)))
    }

    pub fn store_options(&self) -> store::Options {
        store::Options {
            connect_timeout: std::time::Duration::from_millis(self.database_timeout_ms),
            ..store::Options::default()
        }
    }
}
