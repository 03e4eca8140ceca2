//! Test support: a gateway signer (real Ed25519 grants and proofs, its JWKS on disk), a fake
//! instance registry, a scriptable fake supervisor member (real tonic server on 127.0.0.1:0),
//! and the workload agent the sidecar starts (this test binary re-executed, see
//! `workload_agent` in `sidecar.rs`): it proxies a test-side Unix socket to the sidecar's
//! socket, so the sidecar sees the agent — its own child — as the peer.

#![allow(dead_code, clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ed25519_dalek::{Signer as _, SigningKey};
use plumbing::gateway::GatewayArgs;
use plumbing::logging::{LogArgs, LogFormat};
use proto::common::v1::InstanceRef;
use proto::registry::v1::instance_registry_server::{InstanceRegistry, InstanceRegistryServer};
use proto::registry::v1::{
    DeregisterRequest, DeregisterResponse, RecoveryFailedRequest, RecoveryFailedResponse, RegisterRequest,
    RegisterResponse,
};
use proto::runtime::v1::supervisor_runtime_server::{SupervisorRuntime, SupervisorRuntimeServer};
use proto::runtime::v1::{
    ActivationConfirm, GrantPresentation, Heartbeat, SidecarMessage, SupervisorMessage, sidecar_message,
    supervisor_message,
};
use proto::trust::TrustBundle;
use serde_json::{Value, json};
use sidecar::Config;
use sidecar::receipt::ReceiptKey;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, UnixStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

pub const TOKEN: &str = "namespace-token-for-tests";
pub const GENERATION: u64 = 7;
/// Bound on any wait in a test (virtual time in paused tests).
pub const WAIT: Duration = Duration::from_secs(120);

pub async fn within<F: std::future::Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(WAIT, future)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

// --- gateway signer -----------------------------------------------------------------------

pub struct Signer {
    key: SigningKey,
}

impl Signer {
    pub fn new(seed: u8) -> Self {
        Self {
            key: SigningKey::from_bytes(&[seed; 32]),
        }
    }

    pub fn jwks(&self) -> String {
        let mut bundle = TrustBundle::new(proto::trust::DEFAULT_ISSUER);
        bundle.keys.insert("k1".into(), self.key.verifying_key());
        bundle.to_jwks()
    }

    fn sign(&self, typ: &str, claims: &Value) -> String {
        let b64 = |v: &Value| URL_SAFE_NO_PAD.encode(v.to_string());
        let input = format!(
            "{}.{}",
            b64(&json!({"alg": "EdDSA", "kid": "k1", "typ": typ})),
            b64(claims)
        );
        format!(
            "{input}.{}",
            URL_SAFE_NO_PAD.encode(self.key.sign(input.as_bytes()).to_bytes())
        )
    }

    fn claims(instance: &InstanceRef, term: u64, member: &str, lifetime: i64) -> Value {
        let now = proto::trust::unix_ms(std::time::SystemTime::now()) / 1000;
        json!({"iss": proto::trust::DEFAULT_ISSUER, "aud": proto::trust::SIDECAR_AUDIENCE,
            "sub": route_of(instance), "route": route_of(instance),
            "instance": {"namespace": instance.namespace, "name": instance.name, "uid": instance.uid,
                "generation": instance.generation},
            "term": term, "member": member, "process_id": process_of(member),
            "iat": now, "exp": now + lifetime, "jti": uuid::Uuid::new_v4().to_string()})
    }

    /// A grant for `term` to `member` (process `<member>-proc`): (token, jti).
    pub fn grant(&self, instance: &InstanceRef, term: u64, member: &str) -> (String, String) {
        let claims = Self::claims(instance, term, member, 30);
        let jti = claims["jti"].as_str().unwrap_or_default().to_owned();
        (self.sign(proto::trust::GRANT_TYP, &claims), jti)
    }

    pub fn proof(&self, instance: &InstanceRef, term: u64, member: &str, grant_id: &str) -> String {
        let mut claims = Self::claims(instance, term, member, 60);
        claims["grant_id"] = json!(grant_id);
        self.sign(proto::trust::PROOF_TYP, &claims)
    }
}

pub fn route_of(instance: &InstanceRef) -> String {
    format!("{}/{}", instance.namespace, instance.name)
}

pub fn process_of(member: &str) -> String {
    format!("{member}-proc")
}

// --- fake registry ------------------------------------------------------------------------

#[derive(Debug)]
pub enum RegistryCall {
    Register(RegisterRequest),
    Deregister(DeregisterRequest),
    RecoveryFailed(RecoveryFailedRequest),
}

struct FakeRegistry {
    calls: mpsc::UnboundedSender<RegistryCall>,
}

fn authorized<T>(request: &Request<T>) -> Result<(), Status> {
    match proto::bearer_token_from_metadata(request.metadata()) {
        Some(TOKEN) => Ok(()),
        _ => Err(Status::unauthenticated("bad token")),
    }
}

#[tonic::async_trait]
impl InstanceRegistry for FakeRegistry {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<RegisterResponse>, Status> {
        authorized(&request)?;
        let request = request.into_inner();
        let instance = InstanceRef {
            generation: GENERATION,
            ..request.instance.clone().unwrap_or_default()
        };
        let _ = self.calls.send(RegistryCall::Register(request));
        Ok(Response::new(RegisterResponse {
            instance_token: String::new(),
            instance_token_expires_at_ms: 0,
            instance: Some(instance),
            owner: None,
            term: 0,
            recovery_deadline_ms: 0,
        }))
    }

    async fn deregister(&self, request: Request<DeregisterRequest>) -> Result<Response<DeregisterResponse>, Status> {
        authorized(&request)?;
        let _ = self.calls.send(RegistryCall::Deregister(request.into_inner()));
        Ok(Response::new(DeregisterResponse {}))
    }

    async fn report_recovery_failed(
        &self,
        request: Request<RecoveryFailedRequest>,
    ) -> Result<Response<RecoveryFailedResponse>, Status> {
        authorized(&request)?;
        let _ = self.calls.send(RegistryCall::RecoveryFailed(request.into_inner()));
        Ok(Response::new(RecoveryFailedResponse {}))
    }
}

// --- fake member --------------------------------------------------------------------------

/// One runtime stream the sidecar opened, seen from the member's side. The member heartbeats
/// every second until `silence`; messages other than heartbeats arrive in `recv`.
pub struct Conn {
    rx: mpsc::UnboundedReceiver<SidecarMessage>,
    tx: Option<mpsc::Sender<Result<SupervisorMessage, Status>>>,
    beating: Arc<AtomicBool>,
    closed: CancellationToken,
}

impl Conn {
    pub async fn recv(&mut self) -> sidecar_message::Kind {
        within("a sidecar message", self.rx.recv())
            .await
            .and_then(|m| m.kind)
            .expect("the sidecar closed the stream")
    }

    /// The next message, or None when the sidecar closed the stream first.
    pub async fn recv_or_closed(&mut self) -> Option<sidecar_message::Kind> {
        within("a sidecar message or close", self.rx.recv())
            .await
            .and_then(|m| m.kind)
    }

    pub async fn send(&self, kind: supervisor_message::Kind) -> bool {
        match &self.tx {
            Some(tx) => tx.send(Ok(SupervisorMessage { kind: Some(kind) })).await.is_ok(),
            None => false,
        }
    }

    /// Stops heartbeats and answers (a paused or hung member).
    pub fn silence(&self) {
        self.beating.store(false, Ordering::SeqCst);
    }

    /// Waits until the sidecar closed (or reset) its side of the stream.
    pub async fn closed(&self) {
        within("the sidecar to close the stream", self.closed.cancelled()).await;
    }

    pub fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    /// Ends the stream with OK from the member side.
    pub fn end(&mut self) {
        self.tx = None;
    }

    pub async fn present(&self, signer: &Signer, instance: &InstanceRef, term: u64, member: &str) -> String {
        let (grant, jti) = signer.grant(instance, term, member);
        self.present_token(&grant, member).await;
        jti
    }

    pub async fn present_token(&self, grant: &str, member: &str) {
        let presentation = GrantPresentation {
            grant: grant.to_owned(),
            member: member.into(),
            process_id: process_of(member),
        };
        assert!(
            self.send(supervisor_message::Kind::GrantPresentation(presentation))
                .await
        );
    }

    pub async fn confirm(
        &self,
        signer: &Signer,
        instance: &InstanceRef,
        term: u64,
        member: &str,
        jti: &str,
        deadline_ms: u64,
    ) {
        let confirm = ActivationConfirm {
            term,
            proof: signer.proof(instance, term, member, jti),
            activated_at_ms: 1,
            recovery_deadline_ms: deadline_ms,
        };
        assert!(self.send(supervisor_message::Kind::ActivationConfirm(confirm)).await);
    }

    /// Grant → receipt → confirm; returns the receipt.
    pub async fn take_over(
        &mut self,
        signer: &Signer,
        instance: &InstanceRef,
        term: u64,
        member: &str,
        deadline_ms: u64,
    ) -> proto::recovery::v1::Receipt {
        let jti = self.present(signer, instance, term, member).await;
        let sidecar_message::Kind::Receipt(receipt) = self.recv().await else {
            panic!("expected a receipt")
        };
        assert_eq!((receipt.term, receipt.grant_id.as_str()), (term, jti.as_str()));
        self.confirm(signer, instance, term, member, &jti, deadline_ms).await;
        receipt
    }
}

struct FakeMember {
    conns: mpsc::UnboundedSender<Conn>,
}

#[tonic::async_trait]
impl SupervisorRuntime for FakeMember {
    type ConnectStream = ReceiverStream<Result<SupervisorMessage, Status>>;

    async fn connect(
        &self,
        request: Request<Streaming<SidecarMessage>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        authorized(&request)?;
        let mut inbound = request.into_inner();
        let (tx, out_rx) = mpsc::channel(64);
        let (in_tx, rx) = mpsc::unbounded_channel();
        let beating = Arc::new(AtomicBool::new(true));
        let closed = CancellationToken::new();
        let weak = tx.downgrade();
        let beat = beating.clone();
        tokio::spawn(async move {
            let mut sequence = 0;
            loop {
                tokio::time::sleep(proto::timing::RUNTIME_HEARTBEAT_INTERVAL).await;
                let Some(tx) = weak.upgrade() else { return };
                if beat.load(Ordering::SeqCst) {
                    sequence += 1;
                    let heartbeat = supervisor_message::Kind::Heartbeat(Heartbeat { sequence });
                    if tx.send(Ok(SupervisorMessage { kind: Some(heartbeat) })).await.is_err() {
                        return;
                    }
                }
            }
        });
        let done = closed.clone();
        tokio::spawn(async move {
            while let Ok(Some(message)) = inbound.message().await {
                if !matches!(message.kind, Some(sidecar_message::Kind::Heartbeat(_))) {
                    let _ = in_tx.send(message);
                }
            }
            done.cancel();
        });
        let _ = self.conns.send(Conn {
            rx,
            tx: Some(tx),
            beating,
            closed,
        });
        Ok(Response::new(ReceiverStream::new(out_rx)))
    }
}

/// A fake member address and the streams the sidecar opens to it.
pub struct Member {
    pub address: String,
    conns: mpsc::UnboundedReceiver<Conn>,
}

impl Member {
    pub async fn start() -> Self {
        let (conns_tx, conns) = mpsc::unbounded_channel();
        let service = SupervisorRuntimeServer::new(FakeMember { conns: conns_tx })
            .max_decoding_message_size(proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(proto::MAX_MESSAGE_BYTES);
        let address = serve(tonic::service::Routes::new(service)).await;
        Self { address, conns }
    }

    pub async fn accept(&mut self) -> Conn {
        within("the sidecar to connect", self.conns.recv())
            .await
            .expect("member server gone")
    }

    /// Nothing connected so far.
    pub fn idle(&mut self) -> bool {
        self.conns.try_recv().is_err()
    }
}

async fn serve(routes: tonic::service::Routes) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_routes(routes)
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await
    });
    address
}

// --- fixture ------------------------------------------------------------------------------

pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub signer: Signer,
    pub member: Member,
    pub registry: mpsc::UnboundedReceiver<RegistryCall>,
    pub config: Config,
    pub instance: InstanceRef,
}

/// The workload command: this test binary, running only the `workload_agent` helper test.
pub fn agent_command() -> Vec<String> {
    let exe = std::env::current_exe().expect("current exe");
    [
        exe.display().to_string(),
        "workload_agent".into(),
        "--exact".into(),
        "--ignored".into(),
        "--nocapture".into(),
        "--quiet".into(),
        "--test-threads=1".into(),
    ]
    .into()
}

pub fn sleep_command() -> Vec<String> {
    vec!["sleep".into(), "600".into()]
}

impl Fixture {
    pub async fn new(command: Vec<String>) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let signer = Signer::new(1);
        let supervision = dir.path().join("supervision");
        std::fs::create_dir_all(&supervision).expect("mkdir");
        std::fs::write(supervision.join(proto::trust::TOKEN_FILE), TOKEN).expect("token");
        std::fs::write(supervision.join(proto::trust::TRUST_BUNDLE_FILE), signer.jwks()).expect("jwks");
        let member = Member::start().await;
        let (calls, registry) = mpsc::unbounded_channel();
        let registry_address = serve(tonic::service::Routes::new(InstanceRegistryServer::new(FakeRegistry {
            calls,
        })))
        .await;
        let uid = uuid::Uuid::new_v4().to_string();
        let config = Config {
            supervisor_route: vec![member.address.clone()],
            gateway: GatewayArgs {
                gateway_endpoints: vec![registry_address],
                tls_ca: None,
                gateway_tls_name: None,
            },
            namespace: "team-a".into(),
            name: "agent".into(),
            uid: uid.clone(),
            route: None,
            supervision_dir: supervision,
            supervisor_tls_name: None,
            socket: dir.path().join("workload.sock"),
            state_dir: dir.path().join("state"),
            issuer: proto::trust::DEFAULT_ISSUER.into(),
            stop_grace_seconds: 5,
            idle_timeout_seconds: 300,
            restart_policy: "Always".into(),
            egress_listen: None,
            egress_redirect_listen: None,
            egress_dialer: None,
            workload_from_pid_namespace: false,
            log: LogArgs {
                log_format: LogFormat::Text,
            },
            command,
        };
        let instance = InstanceRef {
            namespace: "team-a".into(),
            name: "agent".into(),
            uid,
            generation: GENERATION,
        };
        Self {
            dir,
            signer,
            member,
            registry,
            config,
            instance,
        }
    }

    pub fn start(
        &self,
    ) -> (
        tokio::task::JoinHandle<Result<sidecar::Outcome, sidecar::Error>>,
        CancellationToken,
    ) {
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(sidecar::run(self.config.clone(), shutdown.clone()));
        (handle, shutdown)
    }

    pub async fn registry_call(&mut self) -> RegistryCall {
        within("a registry call", self.registry.recv())
            .await
            .expect("registry gone")
    }

    /// Waits for Register and returns the receipt key from its registration material.
    pub async fn registered(&mut self) -> ReceiptKey {
        let RegistryCall::Register(request) = self.registry_call().await else {
            panic!("expected Register")
        };
        let binding = proto::registration::Binding {
            route: &request.route,
            namespace: "team-a",
            name: "agent",
            uid: &self.instance.uid,
        };
        let material = proto::registration::Material::decode(&request.registration_material, &binding)
            .expect("material bound to the instance");
        let key = material.receipt_key().expect("receipt key");
        ReceiptKey::from_bytes(key.try_into().expect("32-byte receipt key"))
    }

    pub fn agent_socket(&self) -> PathBuf {
        let mut path = self.config.socket.clone().into_os_string();
        path.push(".agent");
        path.into()
    }
}

// --- the workload agent -------------------------------------------------------------------

/// Runs inside the re-executed test binary: proxies `<socket>.agent` to the sidecar's socket.
pub fn agent_main(socket: &str) {
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
        return;
    };
    runtime.block_on(async move {
        let listen = format!("{socket}.agent");
        let _ = std::fs::remove_file(&listen);
        let Ok(listener) = tokio::net::UnixListener::bind(&listen) else {
            return;
        };
        while let Ok((mut client, _)) = listener.accept().await {
            let socket = socket.to_owned();
            tokio::spawn(async move {
                if let Ok(mut upstream) = UnixStream::connect(&socket).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                }
            });
        }
    });
}

/// A workload-side client speaking the socket protocol.
pub struct WorkloadClient {
    reader: BufReader<tokio::net::unix::OwnedReadHalf>,
    writer: tokio::net::unix::OwnedWriteHalf,
}

impl WorkloadClient {
    /// Connects to `path`, waiting (bounded) for it to appear.
    pub async fn connect(path: &Path) -> Self {
        let stream = within("the workload socket", async {
            loop {
                if let Ok(stream) = UnixStream::connect(path).await {
                    return stream;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        let (read, writer) = stream.into_split();
        Self {
            reader: BufReader::new(read),
            writer,
        }
    }

    pub async fn send(&mut self, request: Value) {
        let mut line = request.to_string();
        line.push('\n');
        self.writer.write_all(line.as_bytes()).await.expect("write");
    }

    pub async fn answer(&mut self) -> Value {
        let mut line = String::new();
        within("a workload answer", self.reader.read_line(&mut line))
            .await
            .expect("read");
        serde_json::from_str(&line).unwrap_or_else(|_| panic!("not JSON: {line:?}"))
    }

    pub async fn call(&mut self, request: Value) -> Value {
        self.send(request).await;
        self.answer().await
    }
}

/// True while `/proc/<pid>` exists (running or an unreaped zombie).
pub fn process_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}
