//! In-process gateway replicas on real sockets, sharing one database, and a
//! scripted member client that speaks the host protocol over real gRPC.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use gateway::kubernetes::Integration;

use crate::doubles::Recording;
use gateway::registration::{Binding, Material};
use gateway::store::Store;
use proto::common::v1::{InstancePhase, InstanceRef, RouteDirectoryEntry};
use proto::host::v1::member_message::Kind as MemberKind;
use proto::host::v1::supervisor_host_client::SupervisorHostClient;
use proto::host::v1::{
    Ack, AssignmentPhase, GatewayMessage, Heartbeat, Hello, InstanceStatus, MemberMessage, Snapshot, StatusReport,
    gateway_message,
};
use proto::registry::v1::instance_registry_client::InstanceRegistryClient;
use proto::registry::v1::{RegisterRequest, RegisterResponse};
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// One in-process gateway replica.
pub struct Replica {
    pub name: String,
    pub address: SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Replica {
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Graceful stop: streams are told to go elsewhere, the lease is released.
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// Start a replica named `name` on `url`, writing local credentials to `credentials`.
pub async fn start_replica(name: &str, url: &str, credentials: &std::path::Path) -> Replica {
    let dir = credentials.to_str().expect("utf-8 path");
    start_replica_with(name, url, &["--credentials-dir", dir], None).await
}

/// Start a replica with extra arguments and, optionally, a (recording) Kubernetes integration.
pub async fn start_replica_with(
    name: &str,
    url: &str,
    extra: &[&str],
    kubernetes: Option<Integration<Recording>>,
) -> Replica {
    let settings = settings(name, url, extra);
    let listener = gateway::bind(&settings).await.expect("bind");
    let address = listener.local_addr().expect("address");
    let stop = CancellationToken::new();
    let shutdown = stop.clone();
    let task = tokio::spawn(async move {
        gateway::run_with(settings, listener, shutdown, kubernetes)
            .await
            .expect("replica runs");
    });
    Replica {
        name: name.into(),
        address,
        stop,
        task,
    }
}

fn settings(name: &str, url: &str, extra: &[&str]) -> gateway::Settings {
    let kek = crate::support::test_kek_file();
    let mut args = vec![
        "gateway",
        "--key-encryption-key-file",
        kek.to_str().expect("a UTF-8 path"),
        "--database-url",
        url,
        "--replica",
        name,
        "--listen",
        "127.0.0.1:0",
        "--status-interval-ms",
        "0",
        "--lease-length-ms",
        "2000",
    ];
    args.extend_from_slice(extra);
    gateway::Settings::parse_from(args)
}

/// A replica on a runtime of its own (one thread), which the test can freeze as SIGSTOP
/// would: all its tasks, timers and sockets stop, its connections stay open.
pub struct Pausable {
    pub replica: Replica,
    /// The replica's health port (`/metrics`).
    pub health: SocketAddr,
    runtime: tokio::runtime::Handle,
    resume: Option<std::sync::mpsc::Sender<()>>,
}

impl Pausable {
    /// Freeze the replica; returns once it stopped.
    pub async fn pause(&mut self) {
        let (resume, resumed) = std::sync::mpsc::channel::<()>();
        let (frozen, is_frozen) = tokio::sync::oneshot::channel();
        self.runtime.spawn(async move {
            let _ = frozen.send(());
            // Blocks the replica runtime's only thread until `resume`.
            let _ = resumed.recv();
        });
        is_frozen.await.expect("replica runtime runs");
        self.resume = Some(resume);
    }

    pub fn resume(&mut self) {
        if let Some(resume) = self.resume.take() {
            let _ = resume.send(());
        }
    }

    /// A gauge of the replica's `/metrics`.
    pub async fn metric(&self, name: &str) -> Option<i64> {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut socket = tokio::net::TcpStream::connect(self.health).await.ok()?;
        socket
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .await
            .ok()?;
        let mut body = String::new();
        socket.read_to_string(&mut body).await.ok()?;
        let line = format!("openshell_gateway_{name} ");
        body.lines()
            .find_map(|l| l.strip_prefix(&line))
            .and_then(|v| v.trim().parse().ok())
    }

    pub async fn stop(mut self) {
        self.resume();
        self.replica.stop().await;
    }
}

/// Start a [`Pausable`] replica named `name` on `url`.
pub async fn start_pausable_replica(name: &str, url: &str, credentials: &std::path::Path) -> Pausable {
    let health = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let (dir, health_listen) = (credentials.to_str().expect("utf-8 path"), health.to_string());
    let settings = settings(
        name,
        url,
        &["--credentials-dir", dir, "--health-listen", &health_listen],
    );
    let stop = CancellationToken::new();
    let shutdown = stop.clone();
    let (started, is_started) = tokio::sync::oneshot::channel();
    let (done, is_done) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("replica runtime");
        runtime.block_on(async move {
            let listener = gateway::bind(&settings).await.expect("bind");
            let address = listener.local_addr().expect("address");
            let _ = started.send((address, tokio::runtime::Handle::current()));
            gateway::run_with(settings, listener, shutdown, None::<Integration<Recording>>)
                .await
                .expect("replica runs");
        });
        let _ = done.send(());
    });
    let (address, runtime) = is_started.await.expect("replica started");
    let task = tokio::spawn(async move {
        let _ = is_done.await;
    });
    Pausable {
        replica: Replica {
            name: name.into(),
            address,
            stop,
            task,
        },
        health,
        runtime,
        resume: None,
    }
}

/// Read a delivered token, waiting for the coordinator to write it.
/// A member's hello identity.
pub fn identity(member: &str, process_id: &str, epoch: u64, capacity: u32) -> Identity {
    Identity {
        member: member.into(),
        process_id: process_id.into(),
        epoch,
        capacity,
        directory_deltas: true,
    }
}

/// Member `member` (process `<member>-p1`, capacity 256) attached with `token`, once its
/// membership is live.
pub async fn attach_live(
    db: &crate::support::TestDb,
    endpoint: &str,
    token: &str,
    member: &str,
    behaviour: Behaviour,
) -> Member {
    let attached = Member::attach(
        endpoint,
        token,
        identity(member, &format!("{member}-p1"), 1, 256),
        behaviour,
    )
    .await
    .unwrap();
    crate::support::wait_for("the member live", 2000, || async {
        let (now, all) = db.store.list_members().await.ok()?;
        all.iter().any(|m| m.member == member && m.is_live(now)).then_some(())
    })
    .await;
    attached
}

/// Mints the credentials the coordinator's keys sign: each member's and each instance's own.
#[derive(Clone)]
pub struct Tokens {
    keyring: Arc<gateway::tokens::Keyring>,
}

impl Tokens {
    /// Waits until the coordinator created a signing key.
    pub async fn load(store: &Store) -> Self {
        let keyring = crate::support::wait_for("a signing key", 1000, || async {
            let keyring = gateway::tokens::Keyring::load(store, proto::trust::DEFAULT_ISSUER)
                .await
                .ok()?;
            keyring.signing_kid().is_some().then_some(keyring)
        })
        .await;
        Self {
            keyring: Arc::new(keyring),
        }
    }

    /// The token of pool member `member`.
    pub fn member(&self, member: &str) -> String {
        self.keyring
            .mint(
                proto::trust::Kind::Supervisor,
                &proto::trust::member_subject(member),
                Duration::from_secs(600),
                &proto::trust::NoExtra {},
            )
            .expect("mint")
            .token
    }

    /// An operator token with `roles`.
    pub fn operator(&self, roles: &[&str]) -> String {
        let claims = proto::trust::OperatorClaims {
            roles: roles.iter().map(|r| (*r).to_owned()).collect(),
        };
        self.keyring
            .mint(
                proto::trust::Kind::Operator,
                "test-operator",
                Duration::from_secs(600),
                &claims,
            )
            .expect("mint")
            .token
    }

    /// Member `member`'s token, expired an hour ago.
    pub fn expired_member(&self, member: &str) -> String {
        let two_hours_ago = proto::trust::unix_ms(std::time::SystemTime::now()) - 2 * 3600 * 1000;
        self.keyring
            .mint_at(
                proto::trust::Kind::Supervisor,
                &proto::trust::member_subject(member),
                Duration::from_secs(3600),
                &proto::trust::NoExtra {},
                two_hours_ago,
            )
            .expect("mint")
            .token
    }

    /// Instance `default/<name>`'s bootstrap token, expired an hour ago.
    pub fn expired_instance(&self, name: &str) -> String {
        let two_hours_ago = proto::trust::unix_ms(std::time::SystemTime::now()) - 2 * 3600 * 1000;
        let claims = proto::trust::InstanceTokenClaims {
            namespace: "default".into(),
            name: name.into(),
            uid: None,
        };
        self.keyring
            .mint_at(
                proto::trust::Kind::Instance,
                &proto::trust::instance_subject(&format!("default/{name}")),
                Duration::from_secs(3600),
                &claims,
                two_hours_ago,
            )
            .expect("mint")
            .token
    }

    /// The bootstrap token of instance `default/<name>` (bound to the route only).
    pub fn instance(&self, name: &str) -> String {
        self.instance_in("default", name)
    }

    /// The bootstrap token of instance `<namespace>/<name>`.
    pub fn instance_in(&self, namespace: &str, name: &str) -> String {
        let claims = proto::trust::InstanceTokenClaims {
            namespace: namespace.into(),
            name: name.into(),
            uid: None,
        };
        self.keyring
            .mint(
                proto::trust::Kind::Instance,
                &proto::trust::instance_subject(&format!("{namespace}/{name}")),
                Duration::from_secs(600),
                &claims,
            )
            .expect("mint")
            .token
    }
}

pub async fn token(credentials: &std::path::Path, who: &str) -> String {
    let path: PathBuf = credentials.join(who).join("token");
    crate::support::wait_for("a delivered token", 1000, || {
        let path = path.clone();
        async move { std::fs::read_to_string(&path).ok() }
    })
    .await
}

pub async fn channel(endpoint: &str) -> Channel {
    tonic::transport::Endpoint::from_shared(endpoint.to_owned())
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .expect("connect")
}

pub fn with_token<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", proto::bearer_value(token).parse().expect("metadata"));
    request
}

/// A receipt as the instance's sidecar would build it (receipt key [7; 32],
/// as `cluster::register` registers it).
pub fn receipt(
    grant: &proto::recovery::v1::IssueGrantResponse,
    term: u64,
    fenced: u64,
    pid: u32,
) -> proto::recovery::v1::Receipt {
    let instance = grant.instance.clone();
    let mut receipt = proto::recovery::v1::Receipt {
        route: "default/agent-0".into(),
        instance,
        term,
        grant_id: grant.grant_id.clone(),
        grant_digest: proto::sha256(grant.grant.as_bytes()),
        fenced_term: fenced,
        workload: Some(proto::common::v1::WorkloadIdentity {
            pid,
            start_time_ticks: 1234,
            exe_digest: vec![5; 32],
        }),
        issued_at_ms: 1,
        mac: Vec::new(),
    };
    receipt.mac = receipt.compute_mac(&[7u8; 32]);
    receipt
}

/// A registration of Pod `<namespace>/<name>` with Pod UID `uid` (receipt key [7; 32]).
pub fn registration(namespace: &str, name: &str, uid: &str) -> RegisterRequest {
    let route = format!("{namespace}/{name}");
    let binding = Binding {
        route: &route,
        namespace,
        name,
        uid,
    };
    RegisterRequest {
        registration_material: Material::new(&binding, &[7u8; 32]).encode(),
        route,
        instance: Some(InstanceRef {
            namespace: namespace.into(),
            name: name.into(),
            uid: uid.into(),
            generation: 0,
        }),
        workload: None,
        build_version: "0.9.0+sidecar".into(),
        ..RegisterRequest::default()
    }
}

/// Register an instance `default/<name>` through the registry of `endpoint`.
pub async fn register(endpoint: &str, token: &str, name: &str) -> Result<RegisterResponse, tonic::Status> {
    register_as(endpoint, token, name, &format!("uid-{name}")).await
}

/// The instance ref of Pod `default/<name>` with `uid`.
pub fn instance_ref(name: &str, uid: &str) -> InstanceRef {
    InstanceRef {
        namespace: "default".into(),
        name: name.into(),
        uid: uid.into(),
        generation: 0,
    }
}

/// Register Pod `default/<name>` with Pod UID `uid` (a recreated Pod keeps its name).
pub async fn register_as(
    endpoint: &str,
    token: &str,
    name: &str,
    uid: &str,
) -> Result<RegisterResponse, tonic::Status> {
    let request = registration("default", name, uid);
    let mut client = InstanceRegistryClient::new(channel(endpoint).await);
    client
        .register(with_token(request, token))
        .await
        .map(tonic::Response::into_inner)
}

/// `member` (its process `process_id`) takes `default/agent-0`'s reserved `term` up as its
/// sidecar would let it: the grant, the sidecar's receipt (under the test registration's
/// receipt key), the activation.
pub async fn take_up(endpoint: &str, token: &str, (member, process_id): (&str, &str), term: u64) {
    use proto::recovery::v1::supervisor_recovery_client::SupervisorRecoveryClient;
    use proto::recovery::v1::{ActivateRequest, IssueGrantRequest};
    let mut recovery = SupervisorRecoveryClient::new(channel(endpoint).await);
    let ask = IssueGrantRequest {
        route: "default/agent-0".into(),
        term,
        member: member.into(),
        process_id: process_id.into(),
    };
    let grant = recovery
        .issue_grant(with_token(ask, token))
        .await
        .expect("a grant for the reserved term")
        .into_inner();
    let activate = ActivateRequest {
        receipt: Some(receipt(&grant, term, 0, 4242)),
        grant: grant.grant.clone(),
    };
    recovery
        .activate(with_token(activate, token))
        .await
        .expect("the activation");
}

/// How a scripted member behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// Acks every snapshot and reports every owned instance: STARTING at a reserved term (as
    /// a member taking it over does until its activation is written), ACTIVE at an active one.
    Healthy,
    /// Acks but never reports (its recoveries never settle).
    Mute,
}

/// A member stream driven by the test.
pub struct Member {
    pub name: String,
    /// The latest snapshot received, its directory the whole one the member holds after
    /// applying it (`directory_delta` says whether it came as a delta).
    pub snapshots: watch::Receiver<Option<Snapshot>>,
    /// How the stream ended (`None` while open).
    pub ended: watch::Receiver<Option<tonic::Status>>,
    outbound: mpsc::Sender<MemberMessage>,
    cancel: CancellationToken,
    /// Set: the member sends nothing more (no heartbeats, acks or reports) and keeps the
    /// stream open, as a member behind a one-way network cut or a hung process.
    silent: Arc<std::sync::atomic::AtomicBool>,
    /// Every snapshot received, in order (`snapshots` holds the latest only).
    seen: Arc<std::sync::Mutex<Vec<Snapshot>>>,
}

#[derive(Debug, Clone)]
pub struct Identity {
    pub member: String,
    pub process_id: String,
    pub epoch: u64,
    pub capacity: u32,
    /// Whether the member applies directory deltas (`Hello.directory_deltas`).
    pub directory_deltas: bool,
}

impl Member {
    /// A healthy member reports what it hosts (nothing) right after its hello, as a real one
    /// does; a mute one says nothing.
    pub async fn attach(
        endpoint: &str,
        token: &str,
        hello: Identity,
        behaviour: Behaviour,
    ) -> Result<Self, tonic::Status> {
        let hosting = (behaviour == Behaviour::Healthy).then(Vec::new);
        Self::attach_hosting(endpoint, token, hello, behaviour, hosting).await
    }

    /// Attaches and, right after the hello, reports `hosting` (when given) as all it hosts.
    pub async fn attach_hosting(
        endpoint: &str,
        token: &str,
        hello: Identity,
        behaviour: Behaviour,
        hosting: Option<Vec<InstanceStatus>>,
    ) -> Result<Self, tonic::Status> {
        let (outbound, rx) = mpsc::channel(64);
        let first = MemberMessage {
            kind: Some(MemberKind::Hello(Hello {
                member: hello.member.clone(),
                process_id: hello.process_id.clone(),
                connection_epoch: hello.epoch,
                runtime_address: format!("http://127.0.0.1:{}", 7000 + hello.epoch),
                capacity: hello.capacity,
                build_version: "test".into(),
                process_started_at_ms: 0,
                directory_deltas: hello.directory_deltas,
            })),
        };
        outbound.send(first).await.expect("queue hello");
        if let Some(instances) = hosting {
            let report = StatusReport {
                applied_revision: 0,
                instances,
                partial: false,
            };
            let kind = Some(MemberKind::StatusReport(report));
            outbound.send(MemberMessage { kind }).await.expect("queue report");
        }
        let mut client = SupervisorHostClient::new(channel(endpoint).await);
        let inbound = client
            .attach(with_token(ReceiverStream::new(rx), token))
            .await?
            .into_inner();
        let (snap_tx, snapshots) = watch::channel(None);
        let (end_tx, ended) = watch::channel(None);
        let cancel = CancellationToken::new();
        let silent = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        tokio::spawn(drive(
            inbound,
            outbound.clone(),
            (snap_tx, seen.clone()),
            end_tx,
            behaviour,
            (cancel.clone(), silent.clone()),
        ));
        Ok(Self {
            name: hello.member,
            snapshots,
            ended,
            outbound,
            cancel,
            silent,
            seen,
        })
    }

    /// Every snapshot received so far, in order.
    pub fn seen(&self) -> Vec<Snapshot> {
        self.seen.lock().expect("not poisoned").clone()
    }

    /// Send a raw message (for stale or regressing acks).
    pub async fn send(&self, kind: MemberKind) {
        let _ = self.outbound.send(MemberMessage { kind: Some(kind) }).await;
    }

    /// Drop the stream as a crashed process would.
    pub fn kill(&self) {
        self.cancel.cancel();
    }

    /// Fall silent with the stream open (see [`Member::silent`]).
    pub fn go_silent(&self) {
        self.silent.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Wait until the stream ended and return its status.
    pub async fn wait_ended(&mut self) -> tonic::Status {
        let ended = self
            .ended
            .wait_for(Option::is_some)
            .await
            .expect("driver alive")
            .clone();
        ended.expect("checked above")
    }

    pub async fn wait_snapshot(&mut self, what: &str, check: impl Fn(&Snapshot) -> bool) -> Snapshot {
        let mut snapshots = self.snapshots.clone();
        let waited = tokio::time::timeout(
            Duration::from_secs(20),
            snapshots.wait_for(|s| s.as_ref().is_some_and(&check)),
        )
        .await
        .ok()
        .and_then(|r| r.ok().and_then(|s| s.clone()));
        match waited {
            Some(snapshot) => snapshot,
            None => panic!(
                "{}: no snapshot where {what}; last: {:?}",
                self.name,
                self.snapshots.borrow()
            ),
        }
    }
}

async fn drive(
    mut inbound: tonic::Streaming<GatewayMessage>,
    outbound: mpsc::Sender<MemberMessage>,
    (snapshots, seen): (watch::Sender<Option<Snapshot>>, Arc<std::sync::Mutex<Vec<Snapshot>>>),
    ended: watch::Sender<Option<tonic::Status>>,
    behaviour: Behaviour,
    (cancel, silent): (CancellationToken, Arc<std::sync::atomic::AtomicBool>),
) {
    let quiet = || silent.load(std::sync::atomic::Ordering::SeqCst);
    let mut beat = tokio::time::interval(proto::timing::HEARTBEAT_INTERVAL);
    let mut sequence = 0;
    let mut directory: Option<std::collections::BTreeMap<String, RouteDirectoryEntry>> = None;
    let status = loop {
        tokio::select! {
            () = cancel.cancelled() => break tonic::Status::cancelled("killed by the test"),
            _ = beat.tick(), if !quiet() => {
                sequence += 1;
                let _ = outbound.send(MemberMessage { kind: Some(MemberKind::Heartbeat(Heartbeat { sequence, monotonic_ms: 0 })) }).await;
            }
            message = inbound.next() => match message {
                Some(Ok(GatewayMessage { kind: Some(gateway_message::Kind::Snapshot(_)) })) if quiet() => {}
                Some(Ok(GatewayMessage { kind: Some(gateway_message::Kind::Snapshot(mut snapshot)) })) => {
                    if !snapshot.directory_delta {
                        directory = Some(Default::default());
                    }
                    let Some(held) = directory.as_mut() else {
                        break tonic::Status::internal("a directory delta before a whole directory");
                    };
                    for route in &snapshot.directory_removed {
                        held.remove(route);
                    }
                    held.extend(snapshot.directory.drain(..).map(|e| (e.route.clone(), e)));
                    snapshot.directory = held.values().cloned().collect();
                    let _ = outbound.send(MemberMessage { kind: Some(MemberKind::Ack(Ack { revision: snapshot.revision })) }).await;
                    if behaviour == Behaviour::Healthy {
                        let report = StatusReport {
                            applied_revision: snapshot.revision,
                            instances: snapshot.instances.iter().map(|owned| InstanceStatus {
                                route: owned.route.clone(),
                                instance: owned.instance.clone(),
                                term: owned.term,
                                phase: if owned.phase == AssignmentPhase::Active as i32 {
                                    InstancePhase::Active as i32
                                } else {
                                    InstancePhase::Starting as i32
                                },
                                workload_pid: 4242,
                                ..InstanceStatus::default()
                            }).collect(),
                            partial: false,
                        };
                        let _ = outbound.send(MemberMessage { kind: Some(MemberKind::StatusReport(report)) }).await;
                    }
                    seen.lock().expect("not poisoned").push(snapshot.clone());
                    snapshots.send_replace(Some(snapshot));
                }
                Some(Ok(_)) => {}
                Some(Err(status)) => break status,
                None => break tonic::Status::ok("stream closed by the gateway"),
            }
        }
    };
    ended.send_replace(Some(status));
}

/// Poll the store until `check` holds on its assignments.
pub async fn wait_assignments<F>(store: &Store, what: &str, check: F) -> Vec<gateway::store::Assignment>
where
    F: Fn(&[gateway::store::Assignment]) -> bool,
{
    let check = Arc::new(check);
    crate::support::wait_for(what, 2000, || {
        let check = check.clone();
        async move {
            let assignments = store.list_assignments().await.ok()?;
            check(&assignments).then_some(assignments)
        }
    })
    .await
}
