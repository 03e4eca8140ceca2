//! A local pool as real processes on loopback: gateway replicas on one
//! database (an SQLite file unless a PostgreSQL URL is given) and supervisor
//! members, with their logs and the tokens the coordinator delivers to files.
//! Every gRPC connection is TLS (a throwaway CA made at start) unless the
//! pool is configured plaintext.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use plumbing::tls::ClientTls;
use proto::pool::v1::supervisor_pool_client::SupervisorPoolClient;
use proto::pool::v1::{GetSupervisorPoolStatusRequest, GetSupervisorPoolStatusResponse};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

use crate::process::{self, Process};

mod binaries;
mod launch;
mod tls;

use binaries::binary;
pub use binaries::{binary_dir, ensure_binaries};
pub use launch::GatewayLaunch;
pub use tls::TlsFiles;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Process(#[from] process::Error),
    #[error("cannot prepare {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the binary {0} is missing: build the workspace first (cargo build --release)")]
    MissingBinary(String),
    #[error("{what} did not happen within {seconds} s; see the logs in {logs}")]
    Timeout { what: String, seconds: u64, logs: String },
    #[error("no gateway replica answered the status call: {0}")]
    Status(String),
    #[error("cannot make the local certificates: {0}")]
    Certificate(#[from] rcgen::Error),
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> Error + use<> {
    let path = path.display().to_string();
    move |source| Error::Io { path, source }
}

/// A free loopback port for a process to listen on: bound and released, from below the
/// kernel's ephemeral range (32768 on) and never handed out twice by this process, so neither
/// a connection's source port nor a listener bound to port 0 (a fault path) takes it before its
/// process binds it.
pub fn free_port() -> Result<u16, Error> {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_000;
    // Each process starts at its own place in the range, so runs side by side rarely meet.
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = std::process::id() % SPAN;
    for _ in 0..SPAN {
        let offset = (start + NEXT.fetch_add(1, Ordering::Relaxed) % SPAN) % SPAN;
        let port = u16::try_from(FIRST + offset).unwrap_or(u16::MAX);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(Error::Io {
        path: "127.0.0.1".into(),
        source: std::io::Error::new(std::io::ErrorKind::AddrInUse, "no free port below 32000"),
    })
}

#[derive(Debug, Clone)]
pub struct Config {
    /// Working directory: database, credentials, logs. Emptied at start.
    pub root: PathBuf,
    /// A PostgreSQL URL; `None` for an SQLite file under `root`.
    pub database_url: Option<String>,
    pub gateways: usize,
    pub members: usize,
    /// Sandboxes (sidecar + counting agent) started once the members are up.
    pub sandboxes: usize,
    /// Coordinator lease length (ms).
    pub lease_length_ms: u64,
    /// Plaintext gRPC everywhere (debugging); TLS otherwise.
    pub plaintext: bool,
    /// How often each sandbox's agent counts and reports (ms).
    pub agent_interval_ms: u64,
    /// Members list the gateways in reverse order, so they attach to the last-started
    /// replica and the first (which usually takes the lease) serves none of them.
    pub members_on_standby: bool,
    /// An egress policy file (`proto::egress::Document`) the members install in every
    /// sidecar; with it each sidecar runs its egress proxy on a loopback port of its own.
    pub policy: Option<PathBuf>,
    /// Where that policy's credentials are (`DIR/<secret>/<key>`, as Kubernetes mounts a
    /// Secret; `supervisor --egress-secrets`).
    pub secrets: Option<PathBuf>,
    /// Members' runtime ports behind a [`testkit::fault::Path`] each, which the route directory names:
    /// a member's sidecars can be cut off from it while it stays fine towards the gateways.
    pub cuttable_links: bool,
}

/// The agents' default counting period: a report every 50 ms, so a gap in the observed
/// counter measures a handoff to within 50 ms.
pub const AGENT_INTERVAL_MS: u64 = 50;

pub struct Gateway {
    pub name: String,
    pub endpoint: String,
    /// The plain-HTTP health port (`/readyz`, `/metrics`), `127.0.0.1:port`.
    pub health: String,
    pub process: Process,
}

pub struct Member {
    pub name: String,
    /// Where sidecars reach it (through `path` when there is one).
    pub runtime_address: String,
    /// Where its runtime service listens, `127.0.0.1:port`.
    listen: String,
    /// The path its sidecars reach it by ([`Config::cuttable_links`]).
    pub path: Option<testkit::fault::Path>,
    /// The gateway endpoints it dials, in the order it tries them.
    gateway_endpoints: Vec<String>,
    /// Its paths to each gateway, by the gateway's index ([`Config::cuttable_links`]).
    pub gateway_paths: Vec<testkit::fault::Path>,
    /// The plain-HTTP health port (`/readyz`, `/metrics`), `127.0.0.1:port`.
    pub health: String,
    pub process: Process,
}

/// A fault path in front of `upstream` (`127.0.0.1:port`).
async fn fault_path(upstream: &str) -> Result<testkit::fault::Path, Error> {
    testkit::fault::Path::start(upstream.to_owned())
        .await
        .map_err(|source| Error::Io {
            path: format!("a path to {upstream}"),
            source,
        })
}

/// One workload: its sidecar and the counting agent beside it.
pub struct Sandbox {
    pub name: String,
    pub uid: String,
    /// The sidecar's egress proxy (`127.0.0.1:port`) with `Config::policy`.
    pub egress: Option<String>,
    pub sidecar: Process,
    pub agent: Process,
}

pub struct LocalPool {
    pub config: Config,
    pub gateways: Vec<Gateway>,
    pub members: Vec<Member>,
    pub sandboxes: Vec<Sandbox>,
    /// `None` when plaintext.
    pub tls: Option<TlsFiles>,
    database_url: String,
    /// The key-encryption key file every gateway of the pool shares (0600).
    kek: PathBuf,
}

impl LocalPool {
    pub fn credentials(&self) -> PathBuf {
        self.config.root.join("credentials")
    }

    pub fn logs(&self) -> PathBuf {
        self.config.root.join("logs")
    }

    /// The pool's database (an SQLite file URL unless a PostgreSQL one was configured).
    pub fn database_url(&self) -> &str {
        &self.database_url
    }

    /// The key-encryption key file the pool's gateways seal their signing keys with.
    pub fn kek(&self) -> &Path {
        &self.kek
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.gateways.iter().map(|g| g.endpoint.clone()).collect()
    }

    /// The gateway endpoints in the order members try them (see
    /// [`Config::members_on_standby`]).
    pub fn member_endpoints(&self) -> Vec<String> {
        let mut endpoints = self.endpoints();
        if self.config.members_on_standby {
            endpoints.reverse();
        }
        endpoints
    }

    /// `https://127.0.0.1:port`, or `http://` when plaintext.
    fn url(&self, address: &str) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{address}")
    }

    /// How a client of the pool verifies it.
    pub fn client_tls(&self) -> ClientTls {
        ClientTls {
            ca: self.tls.as_ref().map(|tls| tls.ca.clone()),
            server_name: None,
            dialer: None,
        }
    }

    /// Make the certificates (unless plaintext), start the gateways, wait for
    /// a coordinator to deliver tokens, then start the members.
    pub async fn start(config: Config) -> Result<Self, Error> {
        ensure_binaries()?;
        if config.root.exists() {
            std::fs::remove_dir_all(&config.root).map_err(io_error(&config.root))?;
        }
        // The root holds the TLS key, the KEK, the database and the tokens: owner only.
        gateway::store::files::private_dir(&config.root.join("logs")).map_err(io_error(&config.root))?;
        gateway::store::files::private_dir(&config.root).map_err(io_error(&config.root))?;
        let kek = config.root.join(gateway::store::sealing::GENERATED_KEK_FILE);
        gateway::store::sealing::Kek::load_or_create(&kek).map_err(|err| Error::Io {
            path: kek.display().to_string(),
            source: std::io::Error::other(err.to_string()),
        })?;
        let tls = if config.plaintext {
            None
        } else {
            Some(TlsFiles::generate(&config.root)?)
        };
        let database_url = config
            .database_url
            .clone()
            .unwrap_or_else(|| format!("sqlite://{}?mode=rwc", config.root.join("gateway.db").display()));
        let mut pool = Self {
            config,
            gateways: Vec::new(),
            members: Vec::new(),
            sandboxes: Vec::new(),
            tls,
            database_url,
            kek,
        };
        for i in 0..pool.config.gateways {
            pool.start_gateway(&format!("gateway-{i}")).await?;
        }
        let token = pool.credentials().join("operator").join(proto::trust::TOKEN_FILE);
        pool.wait_for("the coordinator to deliver tokens", Duration::from_secs(30), || {
            token.is_file()
        })
        .await?;
        for i in 0..pool.config.members {
            pool.start_member(&format!("supervisor-{i}")).await?;
        }
        for i in 0..pool.config.sandboxes {
            pool.start_sandbox(&format!("sandbox-{i}"))?;
        }
        Ok(pool)
    }

    pub async fn start_gateway(&mut self, name: &str) -> Result<(), Error> {
        let listen = format!("127.0.0.1:{}", free_port()?);
        let health = format!("127.0.0.1:{}", free_port()?);
        let process = self.spawn_gateway(name, &listen, &health)?;
        self.gateways.push(Gateway {
            name: name.into(),
            endpoint: self.url(&listen),
            health,
            process,
        });
        Ok(())
    }

    /// Start gateway replica `index` again on its address (after a kill -9: the old process
    /// is reaped first). Its log goes on in the same file.
    pub async fn restart_gateway(&mut self, index: usize) -> Result<(), Error> {
        let Some(gateway) = self.gateways.get(index) else {
            return Ok(());
        };
        let (name, listen, health) = (
            gateway.name.clone(),
            address_of(&gateway.endpoint),
            gateway.health.clone(),
        );
        self.gateways[index].process.kill().await;
        self.gateways[index].process = self.spawn_gateway(&name, &listen, &health)?;
        Ok(())
    }

    fn spawn_gateway(&self, name: &str, listen: &str, health: &str) -> Result<Process, Error> {
        let launch = GatewayLaunch {
            name,
            listen,
            health_listen: Some(health),
            database_url: &self.database_url,
            credentials: &self.credentials(),
            kek: &self.kek,
            lease_length_ms: self.config.lease_length_ms,
            tls: self.tls.as_ref(),
            // Each member and each sandbox gets a token of its own.
            members: &(0..self.config.members)
                .map(|i| format!("supervisor-{i}"))
                .collect::<Vec<_>>(),
            instances: &(0..self.config.sandboxes)
                .map(|i| format!("default/sandbox-{i}"))
                .collect::<Vec<_>>(),
        };
        let (args, env) = launch.command();
        let log = self.logs().join(format!("{name}.log"));
        Ok(Process::spawn(name, &binary("gateway")?, &args, &env, log)?)
    }

    pub async fn start_member(&mut self, name: &str) -> Result<(), Error> {
        let runtime = format!("127.0.0.1:{}", free_port()?);
        let health = format!("127.0.0.1:{}", free_port()?);
        let path = if self.config.cuttable_links {
            Some(fault_path(&runtime).await?)
        } else {
            None
        };
        let mut gateway_paths = Vec::new();
        if self.config.cuttable_links {
            for gateway in &self.gateways {
                let listen = gateway.endpoint.rsplit("://").next().unwrap_or_default();
                gateway_paths.push(fault_path(listen).await?);
            }
        }
        let runtime_address = self.url(&path.as_ref().map_or(runtime.clone(), |p| p.address.to_string()));
        let gateway_endpoints = if gateway_paths.is_empty() {
            self.member_endpoints()
        } else {
            let mut endpoints: Vec<String> = gateway_paths.iter().map(|p| self.url(&p.address.to_string())).collect();
            if self.config.members_on_standby {
                endpoints.reverse();
            }
            endpoints
        };
        let process = self.spawn_member(name, &runtime, &runtime_address, &health, &gateway_endpoints)?;
        self.members.push(Member {
            name: name.into(),
            runtime_address,
            listen: runtime,
            path,
            gateway_endpoints,
            gateway_paths,
            health,
            process,
        });
        Ok(())
    }

    /// Start member `index` again under its name and runtime address (the sidecars' route
    /// names it), reaping the old process first. Its log goes on in the same file.
    pub async fn restart_member(&mut self, index: usize) -> Result<(), Error> {
        let Some(member) = self.members.get_mut(index) else {
            return Ok(());
        };
        member.process.kill().await;
        let member = &self.members[index];
        let process = self.spawn_member(
            &member.name,
            &member.listen,
            &member.runtime_address,
            &member.health,
            &member.gateway_endpoints,
        )?;
        self.members[index].process = process;
        Ok(())
    }

    fn spawn_member(
        &self,
        name: &str,
        runtime: &str,
        address: &str,
        health: &str,
        gateways: &[String],
    ) -> Result<Process, Error> {
        let mut env = vec![
            ("OPENSHELL_SUPERVISOR_POOL_MEMBER".to_owned(), name.to_owned()),
            ("OPENSHELL_GATEWAY_ENDPOINTS".to_owned(), gateways.join(",")),
            (
                "OPENSHELL_SUPERVISOR_TOKEN_FILE".to_owned(),
                self.credentials()
                    .join("members")
                    .join(name)
                    .join(proto::trust::TOKEN_FILE)
                    .display()
                    .to_string(),
            ),
            ("OPENSHELL_SUPERVISOR_RUNTIME_LISTEN".to_owned(), runtime.to_owned()),
            (
                "OPENSHELL_SUPERVISOR_POOL_RUNTIME_ADDRESS".to_owned(),
                address.to_owned(),
            ),
            ("OPENSHELL_SUPERVISOR_HEALTH_LISTEN".to_owned(), health.to_owned()),
        ];
        if let Some(policy) = &self.config.policy {
            env.push(("OPENSHELL_EGRESS_POLICY".to_owned(), policy.display().to_string()));
        }
        if let Some(secrets) = &self.config.secrets {
            env.push(("OPENSHELL_EGRESS_SECRETS".to_owned(), secrets.display().to_string()));
        }
        if let Some(tls) = &self.tls {
            for (variable, path) in [
                ("OPENSHELL_SUPERVISOR_TLS_CERT", &tls.cert),
                ("OPENSHELL_SUPERVISOR_TLS_KEY", &tls.key),
                ("OPENSHELL_TLS_CA", &tls.ca),
            ] {
                env.push((variable.to_owned(), path.display().to_string()));
            }
        }
        let log = self.logs().join(format!("{name}.log"));
        Ok(Process::spawn(name, &binary("supervisor")?, &[], &env, log)?)
    }

    /// Start a sidecar for workload `name` in namespace `default`, and the
    /// counting agent that talks to it. The sidecar verifies the pool with the
    /// `ca.crt` the coordinator delivered beside its instance token (as in
    /// Kubernetes, where it comes in the namespace Secret).
    pub fn start_sandbox(&mut self, name: &str) -> Result<(), Error> {
        let dir = self.config.root.join("sandboxes").join(name);
        std::fs::create_dir_all(dir.join("state")).map_err(io_error(&dir))?;
        let socket = dir.join("workload.sock");
        let uid = uuid_like();
        let route: Vec<String> = self.members.iter().map(|m| m.runtime_address.clone()).collect();
        let supervision = self.credentials().join("instances").join("default").join(name);
        let mut env = vec![
            ("OPENSHELL_SUPERVISOR_ROUTE".to_owned(), route.join(",")),
            ("OPENSHELL_GATEWAY_ENDPOINTS".to_owned(), self.endpoints().join(",")),
            ("OPENSHELL_POD_NAMESPACE".to_owned(), "default".to_owned()),
            ("OPENSHELL_POD_NAME".to_owned(), name.to_owned()),
            ("OPENSHELL_POD_UID".to_owned(), uid.clone()),
            (
                "OPENSHELL_SUPERVISION_DIR".to_owned(),
                supervision.display().to_string(),
            ),
            ("OPENSHELL_SIDECAR_SOCKET".to_owned(), socket.display().to_string()),
            (
                "OPENSHELL_SIDECAR_STATE_DIR".to_owned(),
                dir.join("state").display().to_string(),
            ),
        ];
        let egress = match self.config.policy {
            Some(_) => Some(format!("127.0.0.1:{}", free_port()?)),
            None => None,
        };
        if let Some(egress) = &egress {
            env.push(("OPENSHELL_EGRESS_LISTEN".to_owned(), egress.clone()));
        }
        let logs = self.logs();
        let sidecar_log = logs.join(format!("{name}-sidecar.log"));
        let sidecar = Process::spawn(&format!("{name}-sidecar"), &binary("sidecar")?, &[], &env, sidecar_log)?;
        let mut agent_env = vec![("OPENSHELL_SIDECAR_SOCKET".to_owned(), socket.display().to_string())];
        if let Some(egress) = &egress {
            for variable in ["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"] {
                agent_env.push((variable.to_owned(), format!("http://{egress}")));
            }
        }
        let agent_log = logs.join(format!("{name}-agent.log"));
        let interval = ["--interval-ms".to_owned(), self.config.agent_interval_ms.to_string()];
        let agent = Process::spawn(
            &format!("{name}-agent"),
            &binary("agent")?,
            &interval,
            &agent_env,
            agent_log,
        )?;
        self.sandboxes.push(Sandbox {
            name: name.into(),
            uid,
            egress,
            sidecar,
            agent,
        });
        Ok(())
    }

    /// Poll `check` every 50 ms until it holds or `limit` passes.
    pub async fn wait_for(&self, what: &str, limit: Duration, mut check: impl FnMut() -> bool) -> Result<(), Error> {
        let deadline = tokio::time::Instant::now() + limit;
        while !check() {
            if tokio::time::Instant::now() > deadline {
                return Err(Error::Timeout {
                    what: what.into(),
                    seconds: limit.as_secs(),
                    logs: self.logs().display().to_string(),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// An operator client (poolctl's, with the delivered operator token) of the first of
    /// `endpoints` that connects.
    pub async fn operator(&self, endpoints: Vec<String>) -> Result<poolctl::Client, String> {
        poolctl::Client::connect(&self.operator_connection(endpoints))
            .await
            .map_err(|e| e.to_string())
    }

    /// How poolctl reaches `endpoints` with the delivered operator token and the pool's CA.
    pub fn operator_connection(&self, endpoints: Vec<String>) -> poolctl::Connection {
        let tls = self.client_tls();
        poolctl::Connection {
            gateway: plumbing::gateway::GatewayArgs {
                gateway_endpoints: endpoints,
                tls_ca: tls.ca.clone(),
                gateway_tls_name: tls.server_name.clone(),
            },
            token_file: Some(self.credentials().join("operator").join(proto::trust::TOKEN_FILE)),
        }
    }

    /// Pool status from the first gateway replica that answers.
    pub async fn status(&self) -> Result<GetSupervisorPoolStatusResponse, Error> {
        let token_path = self.credentials().join("operator").join(proto::trust::TOKEN_FILE);
        let token = std::fs::read_to_string(&token_path).map_err(io_error(&token_path))?;
        let mut last = String::from("no gateway replica");
        let tls = self.client_tls();
        for endpoint in self.endpoints() {
            match status_from(&tls, &endpoint, token.trim()).await {
                Ok(status) => return Ok(status),
                Err(err) => last = format!("{endpoint}: {err}"),
            }
        }
        Err(Error::Status(last))
    }

    /// The stored egress audit trail of sandbox `name` (namespace `default`), oldest first,
    /// read a page of 1,000 at a time.
    pub async fn audit(&self, name: &str) -> Result<Vec<proto::pool::v1::AuditEntry>, Error> {
        const PAGE: u32 = 1000;
        let mut trail: Vec<proto::pool::v1::AuditEntry> = Vec::new();
        loop {
            let after = trail.last().and_then(|e| e.record.as_ref()).map_or(0, |r| r.sequence);
            let page = self.audit_page(name, after, PAGE).await?;
            let full = page.len() == PAGE as usize;
            trail.extend(page);
            if !full {
                return Ok(trail);
            }
        }
    }

    async fn audit_page(
        &self,
        name: &str,
        after_sequence: u64,
        limit: u32,
    ) -> Result<Vec<proto::pool::v1::AuditEntry>, Error> {
        let token_path = self.credentials().join("operator").join(proto::trust::TOKEN_FILE);
        let token = std::fs::read_to_string(&token_path).map_err(io_error(&token_path))?;
        let mut last = String::from("no gateway replica");
        let tls = self.client_tls();
        for endpoint in self.endpoints() {
            let request = proto::pool::v1::ListAuditRequest {
                namespace: "default".into(),
                name: name.to_owned(),
                after_sequence,
                limit,
                ..Default::default()
            };
            match audit_from(&tls, &endpoint, token.trim(), request).await {
                Ok(entries) => return Ok(entries),
                Err(err) => last = format!("{endpoint}: {err}"),
            }
        }
        Err(Error::Status(last))
    }

    /// The coordinator term gateway replica `index` says it holds (0: standby), from its
    /// `/metrics`; `None` when it does not answer within a second.
    pub async fn coordinator_term(&self, index: usize) -> Option<i64> {
        let gateway = self.gateways.get(index)?;
        let body = http_get(&gateway.health, "/metrics", Duration::from_secs(1)).await?;
        body.lines()
            .find_map(|line| line.strip_prefix("openshell_gateway_coordinator_term "))
            .and_then(|v| v.trim().parse().ok())
    }

    /// Stop the sandboxes, then the members (they announce leaving), then the gateways.
    pub async fn stop(self) {
        let grace = Duration::from_secs(5);
        for sandbox in self.sandboxes {
            sandbox.sidecar.stop(grace).await;
            sandbox.agent.stop(grace).await;
        }
        for member in self.members {
            member.process.stop(grace).await;
        }
        for gateway in self.gateways {
            gateway.process.stop(grace).await;
        }
    }
}

/// The body of a plain HTTP/1.0 GET answered 200, bounded to `limit` and 1 MiB.
pub async fn http_get(address: &str, path: &str, limit: Duration) -> Option<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let fetch = async {
        let mut stream = tokio::net::TcpStream::connect(address).await.ok()?;
        let request = format!("GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut answer = Vec::new();
        stream.take(1 << 20).read_to_end(&mut answer).await.ok()?;
        let answer = String::from_utf8_lossy(&answer).into_owned();
        let (head, body) = answer.split_once("\r\n\r\n")?;
        (head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200")).then(|| body.to_owned())
    };
    tokio::time::timeout(limit, fetch).await.ok().flatten()
}

/// `127.0.0.1:port` of `https://127.0.0.1:port`.
fn address_of(url: &str) -> String {
    url.split_once("://").map_or(url, |(_, rest)| rest).to_owned()
}

/// A random id for a local workload (what a Pod UID is in Kubernetes).
fn uuid_like() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("local-{:x}-{:x}", nanos, std::process::id())
}

/// Bound on one operator call of the launcher.
const OPERATOR_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// The operator API of `endpoint`, and `message` as a request with the operator `token`.
async fn operator<T>(
    tls: &ClientTls,
    endpoint: &str,
    token: &str,
    message: T,
) -> Result<(SupervisorPoolClient<tonic::transport::Channel>, tonic::Request<T>), String> {
    let channel = tls
        .connect(endpoint, Duration::from_secs(1))
        .await
        .map_err(|e| e.to_string())?;
    let mut request = tonic::Request::new(message);
    request.set_timeout(OPERATOR_CALL_TIMEOUT);
    plumbing::token::Token::new(token)
        .authorize(&mut request)
        .map_err(|e| e.to_string())?;
    Ok((SupervisorPoolClient::new(channel), request))
}

async fn answered<R>(
    call: impl std::future::Future<Output = Result<tonic::Response<R>, tonic::Status>>,
) -> Result<R, String> {
    let response = tokio::time::timeout(OPERATOR_CALL_TIMEOUT, call)
        .await
        .map_err(|_| format!("no answer within {OPERATOR_CALL_TIMEOUT:?}"))?
        .map_err(|s| s.message().to_owned())?;
    Ok(response.into_inner())
}

async fn status_from(tls: &ClientTls, endpoint: &str, token: &str) -> Result<GetSupervisorPoolStatusResponse, String> {
    let (mut client, request) = operator(tls, endpoint, token, GetSupervisorPoolStatusRequest {}).await?;
    answered(client.get_supervisor_pool_status(request)).await
}

async fn audit_from(
    tls: &ClientTls,
    endpoint: &str,
    token: &str,
    request: proto::pool::v1::ListAuditRequest,
) -> Result<Vec<proto::pool::v1::AuditEntry>, String> {
    let (mut client, request) = operator(tls, endpoint, token, request).await?;
    Ok(answered(client.list_audit(request)).await?.entries)
}
