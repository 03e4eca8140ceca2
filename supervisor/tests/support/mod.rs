//! A fake gateway replica scripted by the test (`SupervisorHost` here, `SupervisorRecovery` in
//! [`recovery`]; tonic on 127.0.0.1:0, real sockets), a fake sidecar ([`sidecar`]), and helpers
//! to run a member in-process.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod pki;
pub mod recovery;
pub mod sidecar;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use clap::Parser;
use proto::common::v1::{InstancePhase, InstanceRef};
use proto::host::v1::member_message::Kind;
use proto::host::v1::supervisor_host_server::{SupervisorHost, SupervisorHostServer};
use proto::host::v1::{
    AssignmentPhase, GatewayMessage, HeartbeatAck, Hello, InstanceStatus, MemberMessage, OwnedInstance, Snapshot,
    StatusReport, gateway_message,
};
use proto::recovery::v1::supervisor_recovery_server::SupervisorRecoveryServer;
use tokio::net::TcpListener;
use tokio::sync::{Mutex, mpsc};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

/// Orders what every fake gateway of the process saw (hellos, stream ends), so that a test can
/// say which came first across replicas.
static EVENTS: AtomicU64 = AtomicU64::new(1);

fn next_event() -> u64 {
    EVENTS.fetch_add(1, Ordering::SeqCst)
}

/// Bound on every wait in the tests: a failure, never an assertion.
pub const WAIT: Duration = Duration::from_secs(20);

pub async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, future)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

type Outbound = mpsc::Sender<Result<GatewayMessage, Status>>;

/// One Attach stream as the fake gateway sees it.
pub struct Connection {
    pub hello: Hello,
    /// When the hello arrived, in the order of [`EVENTS`].
    pub hello_seen: u64,
    /// When the member ended its side of the stream, in the same order (`None` while open).
    ended: tokio::sync::watch::Receiver<Option<u64>>,
    /// The bearer token of the call, if any.
    pub token: Option<String>,
    /// Every member message after Hello except heartbeats, in order.
    messages: mpsc::UnboundedReceiver<MemberMessage>,
    outbound: Arc<Mutex<Option<Outbound>>>,
    silent: Arc<AtomicBool>,
}

impl Connection {
    pub async fn send(&self, snapshot: Snapshot) {
        let outbound = self.outbound.lock().await;
        let message = GatewayMessage {
            kind: Some(gateway_message::Kind::Snapshot(snapshot)),
        };
        outbound
            .as_ref()
            .expect("stream open")
            .send(Ok(message))
            .await
            .expect("member reading");
    }

    /// Ends the stream with a status.
    pub async fn end(&self, status: Status) {
        if let Some(outbound) = self.outbound.lock().await.take() {
            let _ = outbound.send(Err(status)).await;
        }
    }

    /// Ends the stream cleanly (no status).
    pub async fn close(&self) {
        self.outbound.lock().await.take();
    }

    /// Stops answering heartbeats (the stream stays open).
    pub fn go_silent(&self) {
        self.silent.store(true, Ordering::SeqCst);
    }

    /// When the member ended its side of the stream (half-closed or dropped it), in the order
    /// of the hellos' [`Connection::hello_seen`].
    pub async fn ended_at(&self) -> u64 {
        let mut ended = self.ended.clone();
        let seen = within("the member to end the stream", ended.wait_for(Option::is_some))
            .await
            .expect("pump gone");
        seen.expect("checked above")
    }

    /// The next non-heartbeat member message; `None` once the member half-closed or dropped
    /// the stream.
    pub async fn next(&mut self) -> Option<MemberMessage> {
        within("a member message", self.messages.recv()).await
    }

    /// The next non-heartbeat member message before `deadline`.
    async fn next_before(&mut self, deadline: tokio::time::Instant, what: &str) -> Option<MemberMessage> {
        tokio::time::timeout_at(deadline, self.messages.recv())
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
    }

    /// Waits for the Ack of `revision`, returning every ack seen on the way.
    pub async fn acks_until(&mut self, revision: u64) -> Vec<u64> {
        let deadline = tokio::time::Instant::now() + WAIT;
        let mut acks = Vec::new();
        while acks.last() != Some(&revision) {
            match self.next_before(deadline, "an ack").await.expect("stream open").kind {
                Some(Kind::Ack(ack)) => acks.push(ack.revision),
                _ => continue,
            }
        }
        acks
    }

    /// Waits for a status report satisfying `accept`.
    pub async fn report_where(&mut self, accept: impl Fn(&StatusReport) -> bool) -> StatusReport {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let message = self.next_before(deadline, "a matching report").await;
            if let Some(Kind::StatusReport(report)) = message.expect("stream open").kind
                && accept(&report)
            {
                return report;
            }
        }
    }
}

/// A fake gateway replica.
pub struct FakeGateway {
    pub endpoint: String,
    connections: mpsc::UnboundedReceiver<Connection>,
    refuse: Arc<std::sync::Mutex<Option<Status>>>,
    pub recovery: recovery::Recovery,
    /// Every recovery call, in order.
    pub calls: mpsc::UnboundedReceiver<recovery::Call>,
}

impl FakeGateway {
    pub async fn start() -> Self {
        Self::start_with_keys(recovery::Keys::new(1, "gateway-key-1")).await
    }

    pub async fn start_with_keys(keys: recovery::Keys) -> Self {
        Self::serve(keys, None).await
    }

    /// A fake gateway whose port speaks TLS only (its endpoint is https://).
    pub async fn start_tls(tls: rustls::ServerConfig) -> Self {
        Self::serve(recovery::Keys::new(1, "gateway-key-1"), Some(tls)).await
    }

    async fn serve(keys: recovery::Keys, tls: Option<rustls::ServerConfig>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let endpoint = format!("{scheme}://{}", listener.local_addr().unwrap());
        let (tx, connections) = mpsc::unbounded_channel();
        let refuse = Arc::new(std::sync::Mutex::new(None));
        let service = SupervisorHostServer::new(Service {
            connections: tx,
            refuse: Arc::clone(&refuse),
        })
        .max_decoding_message_size(proto::MAX_MESSAGE_BYTES);
        let (recovery, calls) = recovery::Recovery::new(keys);
        let router = tonic::transport::Server::builder()
            .add_service(service)
            .add_service(SupervisorRecoveryServer::new(recovery.clone()));
        let listener =
            plumbing::listener::Listener::new(listener, Default::default(), Default::default()).with_tls(tls);
        tokio::spawn(plumbing::listener::serve_grpc(router, listener, std::future::pending()));
        Self {
            endpoint,
            connections,
            refuse,
            recovery,
            calls,
        }
    }

    /// The next recovery call.
    pub async fn next_call(&mut self) -> recovery::Call {
        within("a recovery call", self.calls.recv())
            .await
            .expect("server running")
    }

    /// Refuses the next Attach call with `status` after reading its Hello.
    pub fn refuse_next(&self, status: Status) {
        *self.refuse.lock().unwrap() = Some(status);
    }

    pub async fn next_connection(&mut self) -> Connection {
        within("a member to attach", self.connections.recv())
            .await
            .expect("server running")
    }

    /// A connection if one arrived already (for asserting that none did).
    pub fn try_connection(&mut self) -> Option<Connection> {
        self.connections.try_recv().ok()
    }
}

struct Service {
    connections: mpsc::UnboundedSender<Connection>,
    refuse: Arc<std::sync::Mutex<Option<Status>>>,
}

#[tonic::async_trait]
impl SupervisorHost for Service {
    type AttachStream = ReceiverStream<Result<GatewayMessage, Status>>;

    async fn record_audit(
        &self,
        request: Request<proto::host::v1::RecordAuditRequest>,
    ) -> Result<Response<proto::host::v1::RecordAuditResponse>, Status> {
        let through = request
            .into_inner()
            .records
            .iter()
            .map(|r| r.sequence)
            .max()
            .unwrap_or(0);
        Ok(Response::new(proto::host::v1::RecordAuditResponse { through }))
    }

    async fn attach(&self, request: Request<Streaming<MemberMessage>>) -> Result<Response<Self::AttachStream>, Status> {
        let token = proto::bearer_token_from_metadata(request.metadata()).map(str::to_owned);
        let mut inbound = request.into_inner();
        let Some(Kind::Hello(hello)) = inbound.message().await?.and_then(|m| m.kind) else {
            return Err(Status::invalid_argument("first message must be Hello"));
        };
        let hello_seen = next_event();
        let (ended_tx, ended) = tokio::sync::watch::channel(None);
        if let Some(status) = self.refuse.lock().unwrap().take() {
            return Err(status);
        }
        let (outbound_tx, outbound_rx) = mpsc::channel(64);
        let outbound = Arc::new(Mutex::new(Some(outbound_tx)));
        let silent = Arc::new(AtomicBool::new(false));
        let (messages_tx, messages) = mpsc::unbounded_channel();
        // Pump: answers heartbeats (unless silent), forwards everything else to the test, and
        // ends the response stream when the member half-closes.
        let (pump_outbound, pump_silent) = (Arc::clone(&outbound), Arc::clone(&silent));
        tokio::spawn(async move {
            while let Ok(Some(message)) = inbound.message().await {
                match message.kind {
                    Some(Kind::Heartbeat(heartbeat)) => {
                        if pump_silent.load(Ordering::SeqCst) {
                            continue;
                        }
                        let ack = HeartbeatAck {
                            sequence: heartbeat.sequence,
                            gateway_time_ms: 0,
                        };
                        let message = GatewayMessage {
                            kind: Some(gateway_message::Kind::HeartbeatAck(ack)),
                        };
                        if let Some(outbound) = pump_outbound.lock().await.as_ref() {
                            let _ = outbound.send(Ok(message)).await;
                        }
                    }
                    _ => {
                        let _ = messages_tx.send(message);
                    }
                }
            }
            ended_tx.send_replace(Some(next_event()));
            pump_outbound.lock().await.take();
        });
        let connection = Connection {
            hello,
            hello_seen,
            ended,
            token,
            messages,
            outbound,
            silent,
        };
        self.connections
            .send(connection)
            .map_err(|_| Status::unavailable("test over"))?;
        Ok(Response::new(ReceiverStream::new(outbound_rx)))
    }
}

/// A member running in-process.
pub struct Member {
    pub shutdown: CancellationToken,
    pub task: JoinHandle<Result<(), supervisor::Error>>,
    pub token_file: PathBuf,
    _dir: tempfile::TempDir,
}

impl Member {
    pub fn start(member: &str, endpoints: &[&str], token: &str) -> Self {
        Self::start_with(member, endpoints, token, &[])
    }

    pub fn start_with(member: &str, endpoints: &[&str], token: &str, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, format!("{token}\n")).unwrap();
        let config = config(member, endpoints, &token_file, extra);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(supervisor::run(config, shutdown.clone()));
        Self {
            shutdown,
            task,
            token_file,
            _dir: dir,
        }
    }

    pub fn write_token(&self, token: &str) {
        std::fs::write(&self.token_file, token).unwrap();
    }

    /// Writes `trust.jwks` beside the token file.
    pub fn write_trust(&self, bundle: &proto::trust::TrustBundle) {
        let path = self.token_file.with_file_name(proto::trust::TRUST_BUNDLE_FILE);
        std::fs::write(path, bundle.to_jwks()).unwrap();
    }

    /// Waits for the member to exit.
    pub async fn exit(self) -> Result<(), supervisor::Error> {
        within("the member to exit", self.task)
            .await
            .expect("member task panicked")
    }
}

pub fn config(member: &str, endpoints: &[&str], token_file: &std::path::Path, extra: &[&str]) -> supervisor::Config {
    let endpoints = endpoints.join(",");
    let mut args = vec![
        "supervisor",
        "--member",
        member,
        "--gateway-endpoints",
        &endpoints,
        "--token-file",
        token_file.to_str().unwrap(),
        "--runtime-listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    supervisor::Config::try_parse_from(args).unwrap()
}

pub fn instance(name: &str) -> InstanceRef {
    InstanceRef {
        namespace: "team-a".into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        generation: 1,
    }
}

pub fn owned(route: &str, term: u64, phase: AssignmentPhase) -> OwnedInstance {
    OwnedInstance {
        route: route.into(),
        instance: Some(instance(route)),
        term,
        phase: phase as i32,
        credentials: format!("launch-material-{route}").into_bytes(),
        ..Default::default()
    }
}

pub fn snapshot(revision: u64, instances: Vec<OwnedInstance>) -> Snapshot {
    Snapshot {
        revision,
        instances,
        gateway_replica: "fake".into(),
        ..Default::default()
    }
}

/// (route, term, phase) of every entry, sorted by route.
pub fn entries(report: &StatusReport) -> Vec<(String, u64, InstancePhase)> {
    let mut entries: Vec<_> = report
        .instances
        .iter()
        .map(|s| (s.route.clone(), s.term, InstancePhase::from_wire(s.phase)))
        .collect();
    entries.sort();
    entries
}

pub fn entry(route: &str, term: u64, phase: InstancePhase) -> (String, u64, InstancePhase) {
    (route.to_owned(), term, phase)
}

/// The member view of registration material for `instance` under `route`, carrying the
/// workload's `token` credential.
pub fn material(route: &str, instance: &InstanceRef, token: &str) -> Vec<u8> {
    let binding = proto::registration::Binding {
        route,
        namespace: &instance.namespace,
        name: &instance.name,
        uid: &instance.uid,
    };
    let mut material = proto::registration::Material::new(&binding, &[7; 32]);
    material.credentials.insert("token".into(), token.into());
    material.for_member()
}

/// An owned instance carrying real registration material (workload token `token-<route>`).
pub fn placed(route: &str, instance: &InstanceRef, term: u64, phase: AssignmentPhase) -> OwnedInstance {
    OwnedInstance {
        route: route.into(),
        instance: Some(instance.clone()),
        term,
        phase: phase as i32,
        credentials: material(route, instance, &format!("token-{route}")),
        ..Default::default()
    }
}

/// The status of `route` in a report.
pub fn status<'a>(report: &'a StatusReport, route: &str) -> Option<&'a InstanceStatus> {
    report.instances.iter().find(|s| s.route == route)
}

/// Whether `route` is reported at `term` in `phase`.
pub fn shows(report: &StatusReport, route: &str, term: u64, phase: InstancePhase) -> bool {
    status(report, route).is_some_and(|s| s.term == term && InstancePhase::from_wire(s.phase) == phase)
}

/// A gateway replica shutting down, as HTTP/2 shows it: on every connection, once the client's
/// first stream has arrived (its HEADERS frame), the server's SETTINGS and a graceful GOAWAY
/// that leaves every stream out (last stream 0, NO_ERROR), so no call on it is processed.
/// Counts the streams it refused.
pub struct ShuttingDownReplica {
    pub endpoint: String,
    refused: Arc<AtomicU64>,
}

impl ShuttingDownReplica {
    pub async fn start() -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        const PREFACE: usize = 24;
        const HEADERS: u8 = 1;
        // SETTINGS (empty), then GOAWAY: length 8, type 7, stream 0, last stream 0, NO_ERROR.
        const FRAMES: [u8; 26] = [
            0, 0, 0, 4, 0, 0, 0, 0, 0, //
            0, 0, 8, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ];
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let refused = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&refused);
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let counted = Arc::clone(&counted);
                tokio::spawn(async move {
                    let mut preface = [0u8; PREFACE];
                    if socket.read_exact(&mut preface).await.is_err() {
                        return;
                    }
                    // Frames until the first HEADERS: 9-byte header (length 3, type 1, flags
                    // 1, stream 4), then the payload.
                    loop {
                        let mut header = [0u8; 9];
                        if socket.read_exact(&mut header).await.is_err() {
                            return;
                        }
                        let length = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
                        let mut payload = vec![0u8; length];
                        if socket.read_exact(&mut payload).await.is_err() {
                            return;
                        }
                        if header[3] == HEADERS {
                            break;
                        }
                    }
                    counted.fetch_add(1, Ordering::SeqCst);
                    let _ = socket.write_all(&FRAMES).await;
                    // Hold the connection (as a draining server does) until the client leaves.
                    let mut rest = [0u8; 1024];
                    while matches!(socket.read(&mut rest).await, Ok(n) if n > 0) {}
                });
            }
        });
        Self { endpoint, refused }
    }

    /// How many streams it refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::SeqCst)
    }
}
