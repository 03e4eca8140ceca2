//! Command line and environment settings of a pool member, and the supervisor token file.
//!
//! Every setting has an environment fallback; validation errors name the environment variable
//! to fix, because that is what operators set (Kubernetes manifests, local scripts).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::Parser;
use plumbing::validate::{self, Refusal, Scheme};

pub const MEMBER_ENV: &str = "OPENSHELL_SUPERVISOR_POOL_MEMBER";
pub const RUNTIME_ADDRESS_ENV: &str = "OPENSHELL_SUPERVISOR_POOL_RUNTIME_ADDRESS";
pub const CAPACITY_ENV: &str = "OPENSHELL_SUPERVISOR_POOL_CAPACITY";
pub const RUNTIME_LISTEN_ENV: &str = "OPENSHELL_SUPERVISOR_RUNTIME_LISTEN";
pub const GATEWAY_ENDPOINTS_ENV: &str = "OPENSHELL_GATEWAY_ENDPOINTS";
pub const TOKEN_FILE_ENV: &str = "OPENSHELL_SUPERVISOR_TOKEN_FILE";
pub const HEALTH_LISTEN_ENV: &str = "OPENSHELL_SUPERVISOR_HEALTH_LISTEN";
pub const TLS_CERT_ENV: &str = "OPENSHELL_SUPERVISOR_TLS_CERT";
pub const TLS_KEY_ENV: &str = "OPENSHELL_SUPERVISOR_TLS_KEY";
pub const TLS_CA_ENV: &str = "OPENSHELL_TLS_CA";
pub const GATEWAY_TLS_NAME_ENV: &str = "OPENSHELL_GATEWAY_TLS_NAME";
pub const EGRESS_POLICY_ENV: &str = "OPENSHELL_EGRESS_POLICY";
pub const EGRESS_SECRETS_ENV: &str = "OPENSHELL_EGRESS_SECRETS";

/// Settings of one pool member process.
#[derive(Debug, Clone, Parser)]
#[command(name = "supervisor", version = plumbing::build::version(), about = "Shared-supervision pool member")]
pub struct Config {
    /// Stable member name: the supervisor Pod name in Kubernetes (DNS-1123 subdomain).
    /// Required.
    #[arg(long, env = MEMBER_ENV, default_value = "", hide_default_value = true)]
    pub member: String,

    /// gRPC URI where sidecars reach this member's runtime service, published in the route
    /// directory (e.g. https://10.1.2.3:50061; https:// exactly when --tls-cert is set).
    /// Default: http(s)://<bound runtime listen address>.
    #[arg(long, env = RUNTIME_ADDRESS_ENV)]
    pub runtime_address: Option<String>,

    /// Most instances this member hosts (1..=256).
    #[arg(long, env = CAPACITY_ENV, default_value_t = proto::MAX_INSTANCES_PER_MEMBER)]
    pub capacity: u32,

    /// Listen address of the runtime service (sidecar streams). Port 0 picks a free port.
    #[arg(long, env = RUNTIME_LISTEN_ENV, default_value = "127.0.0.1:0")]
    pub runtime_listen: SocketAddr,

    /// The gateway replicas (`--gateway-endpoints`, required; https:// needs --tls-ca) and
    /// their trust (`--tls-ca`, `--gateway-tls-name`).
    #[command(flatten)]
    pub gateway: plumbing::gateway::GatewayArgs,

    /// File holding the supervisor token (a JWT), re-read before every (re)connect; while it
    /// is missing or empty the member keeps retrying (in Kubernetes the Secret volume fills in
    /// once the gateway has written it). Unset: connect without a token (only useful against a
    /// gateway without authentication).
    #[arg(long, env = TOKEN_FILE_ENV)]
    pub token_file: Option<PathBuf>,

    /// PEM certificate (chain) of the runtime port; with --tls-key the port speaks TLS only.
    /// Re-read when the file changes; not ready until it is loaded.
    #[arg(long, env = TLS_CERT_ENV, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert.
    #[arg(long, env = TLS_KEY_ENV, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// Plain-HTTP health port (/healthz, /readyz, /metrics), e.g. 0.0.0.0:9090. Unset: none.
    #[arg(long, env = HEALTH_LISTEN_ENV)]
    pub health_listen: Option<SocketAddr>,

    /// `--log-format` (`OPENSHELL_LOG_FORMAT`): text or json.
    #[command(flatten)]
    pub log: plumbing::logging::LogArgs,

    /// An egress policy file (YAML or JSON, the fields of a SandboxPolicy spec plus `name`;
    /// see `proto::egress`) installed in the sidecar of every instance this member owns.
    /// Unset: none is installed, and sidecars with an egress proxy deny every destination.
    #[arg(long, env = EGRESS_POLICY_ENV)]
    pub egress_policy: Option<PathBuf>,

    /// Where the credentials of the egress policy file are, laid out as Kubernetes mounts
    /// Secrets: the value of key K of Secret S is the file `DIR/S/K`. Read again with the
    /// policy file, so a rotated value reaches the sidecars without a new revision. Unset:
    /// no credential is available (requests needing one are answered 503).
    #[arg(long, env = EGRESS_SECRETS_ENV, requires = "egress_policy")]
    pub egress_secrets: Option<PathBuf>,

    /// Connection limits of the runtime and health ports.
    #[command(flatten)]
    pub connections: plumbing::listener::LimitArgs,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{MEMBER_ENV} is not set: give this member its stable name (its Pod name in Kubernetes)")]
    MemberMissing,
    #[error("{MEMBER_ENV}={0:?} is not a valid member name: {1}")]
    MemberInvalid(String, Refusal),
    #[error("{CAPACITY_ENV}={0} is out of range: must be 1..={max}", max = proto::MAX_INSTANCES_PER_MEMBER)]
    Capacity(u32),
    #[error("{GATEWAY_ENDPOINTS_ENV} is empty: give at least one gateway replica URI")]
    NoEndpoints,
    #[error("{GATEWAY_ENDPOINTS_ENV}: {0:?} is not a gateway URI: {1}")]
    Endpoint(String, Refusal),
    #[error("{RUNTIME_ADDRESS_ENV}={0:?} is not a runtime address: {1}")]
    RuntimeAddress(String, String),
    #[error(
        "{GATEWAY_ENDPOINTS_ENV}: {0} is https:// but {TLS_CA_ENV} is not set: give the CA bundle that signed the gateway certificate"
    )]
    NoCa(String),
    #[error("{GATEWAY_TLS_NAME_ENV}: {0}")]
    GatewayTlsName(String),
    #[error(transparent)]
    Limits(#[from] plumbing::listener::Error),
    #[error(
        "{RUNTIME_ADDRESS_ENV} must be set when {RUNTIME_LISTEN_ENV} ({0}) is a wildcard address: \
         sidecars need an address they can dial"
    )]
    WildcardListen(SocketAddr),
    #[error("{EGRESS_POLICY_ENV}={0}: {1}")]
    EgressPolicy(String, String),
}

impl Config {
    /// Checks every setting; the error names the environment variable to fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_member(&self.member)?;
        if !(1..=proto::MAX_INSTANCES_PER_MEMBER).contains(&self.capacity) {
            return Err(ConfigError::Capacity(self.capacity));
        }
        let endpoints = self.endpoints();
        if endpoints.is_empty() {
            return Err(ConfigError::NoEndpoints);
        }
        for endpoint in endpoints {
            let scheme = validate::address(endpoint, validate::MAX_ADDRESS_BYTES)
                .map_err(|why| ConfigError::Endpoint(endpoint.to_owned(), why))?;
            if scheme == Scheme::Https && self.gateway.tls_ca.is_none() {
                return Err(ConfigError::NoCa(endpoint.to_owned()));
            }
        }
        if let Some(name) = &self.gateway.gateway_tls_name {
            plumbing::tls::check_server_name(name).map_err(ConfigError::GatewayTlsName)?;
        }
        if let Some(address) = &self.runtime_address {
            self.check_runtime_address(address)?;
        }
        self.connections.limits()?;
        Ok(())
    }

    /// Does the runtime port speak TLS (`--tls-cert` and `--tls-key` set)?
    pub fn serves_tls(&self) -> bool {
        self.tls_cert.is_some() && self.tls_key.is_some()
    }

    /// How gateway endpoints are verified.
    pub fn gateway_tls(&self) -> plumbing::tls::ClientTls {
        self.gateway.tls()
    }

    /// Gateway endpoints, trimmed, empty entries skipped.
    pub fn endpoints(&self) -> Vec<&str> {
        self.gateway
            .gateway_endpoints
            .iter()
            .map(|e| e.trim())
            .filter(|e| !e.is_empty())
            .collect()
    }

    /// The gateway trust bundle file: `trust.jwks` beside the token file (the gateway delivers
    /// both into one directory or Secret).
    pub fn trust_bundle_file(&self) -> Option<PathBuf> {
        let dir = self.token_file.as_ref()?.parent()?;
        Some(dir.join(proto::trust::TRUST_BUNDLE_FILE))
    }

    /// The runtime address published in Hello: the configured one, or derived from the bound
    /// runtime listener.
    pub fn runtime_address_for(&self, bound: SocketAddr) -> Result<String, ConfigError> {
        if let Some(address) = &self.runtime_address {
            self.check_runtime_address(address)?;
            return Ok(address.clone());
        }
        if bound.ip().is_unspecified() {
            return Err(ConfigError::WildcardListen(bound));
        }
        let scheme = if self.serves_tls() { "https" } else { "http" };
        Ok(format!("{scheme}://{bound}"))
    }

    /// A runtime address: a URI with a host and a port, https:// exactly when the runtime
    /// port speaks TLS.
    fn check_runtime_address(&self, address: &str) -> Result<(), ConfigError> {
        let invalid = |why: &str| Err(ConfigError::RuntimeAddress(address.to_owned(), why.to_owned()));
        match (
            validate::address(address, validate::MAX_RUNTIME_ADDRESS_BYTES),
            self.serves_tls(),
        ) {
            (Err(why), _) => invalid(&why.to_string()),
            (Ok(Scheme::Http), true) => invalid("the runtime port speaks TLS (--tls-cert): use https://"),
            (Ok(Scheme::Https), false) => invalid("https:// needs --tls-cert and --tls-key"),
            (Ok(_), _) => Ok(()),
        }
    }
}

fn validate_member(member: &str) -> Result<(), ConfigError> {
    match validate::member_name(member) {
        Ok(()) => Ok(()),
        Err(Refusal::Empty) => Err(ConfigError::MemberMissing),
        Err(why) => Err(ConfigError::MemberInvalid(member.to_owned(), why)),
    }
}

pub use plumbing::token::Token;

/// The supervisor token file could not be used; never quotes its content.
#[derive(Debug, thiserror::Error)]
#[error("the supervisor token file ({TOKEN_FILE_ENV}): {0}")]
pub struct TokenError(#[from] plumbing::token::TokenError);

/// Reads the token file (bounded, surrounding whitespace trimmed: [`plumbing::token::read`]).
pub async fn read_token(path: &Path) -> Result<Token, TokenError> {
    Ok(plumbing::token::read(path).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Config {
        let mut all = vec!["supervisor"];
        all.extend_from_slice(args);
        if !args.contains(&"--gateway-endpoints") {
            all.extend(["--gateway-endpoints", "http://127.0.0.1:50051"]);
        }
        Config::try_parse_from(all).unwrap()
    }

    #[test]
    fn defaults_and_valid_settings() {
        let config = parse(&["--member", "supervisor-0.pool"]);
        config.validate().unwrap();
        assert_eq!(config.capacity, 256);
        assert_eq!(config.runtime_listen.to_string(), "127.0.0.1:0");
        assert_eq!(config.health_listen, None);
        let config = parse(&["--member", "m", "--health-listen", "0.0.0.0:9090"]);
        assert_eq!(config.health_listen, Some("0.0.0.0:9090".parse().unwrap()));
        assert!(
            Config::try_parse_from([
                "supervisor",
                "--gateway-endpoints",
                "http://g:1",
                "--health-listen",
                "nope"
            ])
            .is_err()
        );
        let bound: SocketAddr = "127.0.0.1:4711".parse().unwrap();
        assert_eq!(config.runtime_address_for(bound).unwrap(), "http://127.0.0.1:4711");
    }

    #[test]
    fn endpoints_are_comma_separated() {
        let config = parse(&["--member", "m", "--gateway-endpoints", "http://a:1, http://b:2,"]);
        assert_eq!(config.endpoints(), vec!["http://a:1", "http://b:2"]);
        config.validate().unwrap();
    }

    #[test]
    fn invalid_settings_name_their_variable() {
        for (args, variable) in [
            (vec![], MEMBER_ENV),
            (vec!["--member", "Supervisor_0"], MEMBER_ENV),
            (vec!["--member=-a"], MEMBER_ENV),
            (vec!["--member", "a..b"], MEMBER_ENV),
            (vec!["--member", "m", "--capacity", "0"], CAPACITY_ENV),
            (vec!["--member", "m", "--capacity", "257"], CAPACITY_ENV),
            (
                vec!["--member", "m", "--gateway-endpoints", "gw:50051"],
                GATEWAY_ENDPOINTS_ENV,
            ),
            (
                vec!["--member", "m", "--gateway-endpoints", " , "],
                GATEWAY_ENDPOINTS_ENV,
            ),
            (
                vec!["--member", "m", "--runtime-address", "http://10.0.0.1"],
                RUNTIME_ADDRESS_ENV,
            ),
        ] {
            let err = parse(&args).validate().unwrap_err().to_string();
            assert!(err.contains(variable), "{args:?}: {err}");
        }
    }

    #[test]
    fn wildcard_listen_needs_an_explicit_runtime_address() {
        let config = parse(&["--member", "m", "--runtime-listen", "0.0.0.0:50061"]);
        let bound: SocketAddr = "0.0.0.0:50061".parse().unwrap();
        let err = config.runtime_address_for(bound).unwrap_err().to_string();
        assert!(err.contains(RUNTIME_ADDRESS_ENV), "{err}");
        let config = parse(&["--member", "m", "--runtime-address", "http://10.1.2.3:50061"]);
        assert_eq!(config.runtime_address_for(bound).unwrap(), "http://10.1.2.3:50061");
    }

    #[test]
    fn tls_settings() {
        let https = ["--member", "m", "--gateway-endpoints", "https://gw:50051"];
        let err = parse(&https).validate().unwrap_err().to_string();
        assert!(err.contains(TLS_CA_ENV) && err.contains("https://gw:50051"), "{err}");

        let name = "openshell-gateway.system.svc";
        let config = parse(&[&https[..], &["--tls-ca", "/ca.crt", "--gateway-tls-name", name]].concat());
        config.validate().unwrap();
        let expected = plumbing::tls::ClientTls {
            ca: Some("/ca.crt".into()),
            server_name: Some(name.to_owned()),
            dialer: None,
        };
        assert_eq!(config.gateway_tls(), expected);
        let config = parse(&[&https[..], &["--tls-ca", "/ca.crt", "--gateway-tls-name", "not a name"]].concat());
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains(GATEWAY_TLS_NAME_ENV), "{err}");

        // A certificate needs its key.
        let base = ["supervisor", "--member", "m", "--gateway-endpoints", "http://g:1"];
        assert!(Config::try_parse_from([&base[..], &["--tls-cert", "/tls.crt"]].concat()).is_err());
        assert!(Config::try_parse_from([&base[..], &["--tls-key", "/tls.key"]].concat()).is_err());

        // Serving TLS: the advertised runtime address is https://, and only https:// is accepted.
        let bound: SocketAddr = "127.0.0.1:4711".parse().unwrap();
        let serving = ["--member", "m", "--tls-cert", "/tls.crt", "--tls-key", "/tls.key"];
        let config = parse(&serving);
        assert!(config.serves_tls());
        config.validate().unwrap();
        assert_eq!(config.runtime_address_for(bound).unwrap(), "https://127.0.0.1:4711");
        let config = parse(&[&serving[..], &["--runtime-address", "https://10.1.2.3:50061"]].concat());
        assert_eq!(config.runtime_address_for(bound).unwrap(), "https://10.1.2.3:50061");
        let config = parse(&[&serving[..], &["--runtime-address", "http://10.1.2.3:50061"]].concat());
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains(RUNTIME_ADDRESS_ENV) && err.contains("https://"), "{err}");
        let config = parse(&["--member", "m", "--runtime-address", "https://10.1.2.3:50061"]);
        let err = config.runtime_address_for(bound).unwrap_err().to_string();
        assert!(err.contains(RUNTIME_ADDRESS_ENV) && err.contains("--tls-cert"), "{err}");
    }

    #[tokio::test]
    async fn token_file_is_trimmed_and_never_shown() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "header.claims.signature\n").unwrap();
        let token = read_token(&path).await.unwrap();
        assert_eq!(token.expose(), "header.claims.signature");
        assert!(!format!("{token:?}").contains("claims"));

        std::fs::write(&path, "secret part\n").unwrap();
        let err = read_token(&path).await.unwrap_err().to_string();
        assert!(err.contains(TOKEN_FILE_ENV) && !err.contains("secret"), "{err}");
        std::fs::write(&path, "  \n").unwrap();
        assert!(read_token(&path).await.is_err());
        assert!(read_token(&dir.path().join("missing")).await.is_err());
    }
}
