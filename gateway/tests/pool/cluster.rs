//! In-process gateway replicas on real sockets, sharing one database, and a
//! scripted member client that speaks the host protocol over real gRPC.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use gateway::kubernetes::{Integration, Recording};
use gateway::registration::{Binding, Material};
use gateway::store::Store;
use proto::common::v1::{InstancePhase, InstanceRef};
use proto::host::v1::member_message::Kind as MemberKind;
use proto::host::v1::supervisor_host_client::SupervisorHostClient;
use proto::host::v1::{
    Ack, GatewayMessage, Heartbeat, Hello, InstanceStatus, MemberMessage, Snapshot, StatusReport, gateway_message,
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
    let route = format!("default/{name}");
    let binding = Binding {
        route: &route,
        namespace: "default",
        name,
        uid,
    };
    let material = Material::new(&binding, &[7u8; 32]).encode();
    let request = RegisterRequest {
        route: route.clone(),
        instance: Some(instance_ref(name, uid)),
        registration_material: material,
        workload: None,
    };
    let mut client = InstanceRegistryClient::new(channel(endpoint).await);
    client
        .register(with_token(request, token))
        .await
        .map(tonic::Response::into_inner)
}

/// How a scripted member behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// Acks every snapshot and reports every owned instance ACTIVE.
    Healthy,
    /// Acks but never reports (its recoveries never settle).
    Mute,
}

/// A member stream driven by the test.
pub struct Member {
    pub name: String,
    /// The latest snapshot received.
    pub snapshots: watch::Receiver<Option<Snapshot>>,
    /// How the stream ended (`None` while open).
    pub ended: watch::Receiver<Option<tonic::Status>>,
    outbound: mpsc::Sender<MemberMessage>,
    cancel: CancellationToken,
}

pub struct Identity {
    pub member: String,
    pub process_id: String,
    pub epoch: u64,
    pub capacity: u32,
}

impl Member {
    pub async fn attach(
        endpoint: &str,
        token: &str,
        hello: Identity,
        behaviour: Behaviour,
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
            })),
        };
        outbound.send(first).await.expect("queue hello");
        let mut client = SupervisorHostClient::new(channel(endpoint).await);
        let inbound = client
            .attach(with_token(ReceiverStream::new(rx), token))
            .await?
            .into_inner();
        let (snap_tx, snapshots) = watch::channel(None);
        let (end_tx, ended) = watch::channel(None);
        let cancel = CancellationToken::new();
        tokio::spawn(drive(
            inbound,
            outbound.clone(),
            snap_tx,
            end_tx,
            behaviour,
            cancel.clone(),
        ));
        Ok(Self {
            name: hello.member,
            snapshots,
            ended,
            outbound,
            cancel,
        })
    }

    /// Send a raw message (for stale or regressing acks).
    pub async fn send(&self, kind: MemberKind) {
        let _ = self.outbound.send(MemberMessage { kind: Some(kind) }).await;
    }

    /// Drop the stream as a crashed process would.
    pub fn kill(&self) {
        self.cancel.cancel();
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
    snapshots: watch::Sender<Option<Snapshot>>,
    ended: watch::Sender<Option<tonic::Status>>,
    behaviour: Behaviour,
    cancel: CancellationToken,
) {
    let mut beat = tokio::time::interval(proto::timing::HEARTBEAT_INTERVAL);
    let mut sequence = 0;
    let status = loop {
        tokio::select! {
            () = cancel.cancelled() => break tonic::Status::cancelled("killed by the test"),
            _ = beat.tick() => {
                sequence += 1;
                let _ = outbound.send(MemberMessage { kind: Some(MemberKind::Heartbeat(Heartbeat { sequence, monotonic_ms: 0 })) }).await;
            }
            message = inbound.next() => match message {
                Some(Ok(GatewayMessage { kind: Some(gateway_message::Kind::Snapshot(snapshot)) })) => {
                    let _ = outbound.send(MemberMessage { kind: Some(MemberKind::Ack(Ack { revision: snapshot.revision })) }).await;
                    if behaviour == Behaviour::Healthy {
                        let report = StatusReport {
                            applied_revision: snapshot.revision,
                            instances: snapshot.instances.iter().map(|owned| InstanceStatus {
                                route: owned.route.clone(),
                                instance: owned.instance.clone(),
                                term: owned.term,
                                phase: InstancePhase::Active as i32,
                                workload_pid: 4242,
                                ..InstanceStatus::default()
                            }).collect(),
                        };
                        let _ = outbound.send(MemberMessage { kind: Some(MemberKind::StatusReport(report)) }).await;
                    }
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
