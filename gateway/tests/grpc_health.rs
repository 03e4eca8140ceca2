//! The standard gRPC services on the gateway's TLS port, asked by stock clients
//! (`tonic_health`'s and `tonic_reflection`'s): health answers without a token — the overall
//! status SERVING on a ready replica, `openshell.coordinator` SERVING on the coordinator only
//! and following the lease to the standby when the coordinator stops, NOT_FOUND for a name
//! nobody serves — and reflection lists the port's services; the pool's own RPCs still refuse
//! a call without a token.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use proto::pool::v1::GetSupervisorPoolStatusRequest;
use proto::pool::v1::supervisor_pool_client::SupervisorPoolClient;
use tokio_stream::StreamExt as _;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
use tonic_reflection::pb::v1::{ServerReflectionRequest, ServiceResponse};

/// Bound on every wait: a status that never comes fails the test instead of hanging it.
const WAIT: Duration = Duration::from_secs(20);

/// The pool's CA and the gateways' certificate for localhost, as files in `dir`: (CA, cert, key).
fn pki(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let ca = testkit::pki::Ca::new();
    let (cert, key) = ca.leaf(&["localhost"]).write(dir, "tls");
    (ca.write(dir.join("ca.crt")), cert, key)
}

/// One in-process replica on TLS, sharing the SQLite store in `dir`.
struct Replica {
    channel: Channel,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Replica {
    async fn start(name: &str, dir: &Path, (ca, cert, key): &(PathBuf, PathBuf, PathBuf)) -> Self {
        let path = |p: &Path| p.to_str().unwrap().to_owned();
        let settings = gateway::Settings::parse_from([
            "gateway",
            "--replica",
            name,
            "--database-url",
            &format!("sqlite://{}?mode=rwc", dir.join("store.db").display()),
            "--listen",
            "127.0.0.1:0",
            "--status-interval-ms",
            "0",
            "--tls-cert",
            &path(cert),
            "--tls-key",
            &path(key),
            "--tls-ca",
            &path(ca),
            "--credentials-dir",
            &path(&dir.join("credentials")),
        ]);
        let listener = gateway::bind(&settings).await.unwrap();
        let url = format!("https://localhost:{}", listener.local_addr().unwrap().port());
        let stop = CancellationToken::new();
        let task = tokio::spawn(gateway::run(settings, listener, stop.clone()));
        let task = tokio::spawn(async move { task.await.unwrap().unwrap() });
        let endpoint = plumbing::tls::endpoint(&url, Some(ca), None).await.unwrap();
        let channel = endpoint.connect_timeout(WAIT).timeout(WAIT).connect_lazy();
        Self { channel, stop, task }
    }

    /// `Health/Check` without a token.
    async fn check(&self, service: &str) -> Result<ServingStatus, tonic::Status> {
        let request = HealthCheckRequest {
            service: service.into(),
        };
        let response = HealthClient::new(self.channel.clone()).check(request).await?;
        Ok(response.into_inner().status())
    }

    /// `Health/Watch` without a token, until `service` reports `wanted`.
    async fn watch_until(&self, service: &str, wanted: ServingStatus) {
        let request = HealthCheckRequest {
            service: service.into(),
        };
        let watched = async {
            let mut updates = HealthClient::new(self.channel.clone())
                .watch(request)
                .await
                .unwrap()
                .into_inner();
            while let Some(update) = updates.next().await {
                if update.unwrap().status() == wanted {
                    return;
                }
            }
            panic!("the watch of {service:?} ended");
        };
        tokio::time::timeout(WAIT, watched)
            .await
            .unwrap_or_else(|_| panic!("{service:?} never reported {wanted:?}"));
    }

    /// Reflection's `ListServices` without a token.
    async fn list_services(&self) -> Vec<String> {
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut answers = ServerReflectionClient::new(self.channel.clone())
            .server_reflection_info(tokio_stream::iter([request]))
            .await
            .unwrap()
            .into_inner();
        match answers.next().await.unwrap().unwrap().message_response {
            Some(MessageResponse::ListServicesResponse(list)) => {
                list.service.into_iter().map(|ServiceResponse { name }| name).collect()
            }
            other => panic!("not a service list: {other:?}"),
        }
    }

    async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap();
    }
}

/// Whichever of `replicas` reports `openshell.coordinator` SERVING first.
async fn first_coordinator(replicas: &[&Replica]) -> usize {
    let waits = replicas.iter().enumerate().map(|(i, replica)| {
        Box::pin(async move {
            replica
                .watch_until("openshell.coordinator", ServingStatus::Serving)
                .await;
            i
        })
    });
    futures::future::select_all(waits).await.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_reflection_answer_without_a_token_and_follow_the_lease() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let replicas = [
        Replica::start("gw-a", dir.path(), &pki).await,
        Replica::start("gw-b", dir.path(), &pki).await,
    ];
    for replica in &replicas {
        replica.watch_until("", ServingStatus::Serving).await;
        assert_eq!(replica.check("").await.unwrap(), ServingStatus::Serving);
        for service in gateway::server::SERVICES {
            assert_eq!(
                replica.check(service).await.unwrap(),
                ServingStatus::Serving,
                "{service}"
            );
        }
        let unknown = replica.check("openshell.no.such.Service").await.unwrap_err();
        assert_eq!(unknown.code(), Code::NotFound, "{unknown:?}");
    }

    // One coordinator: the other replica is a standby.
    let coordinator = first_coordinator(&[&replicas[0], &replicas[1]]).await;
    let [a, b] = replicas;
    let (coordinator, standby) = if coordinator == 0 { (a, b) } else { (b, a) };
    assert_eq!(
        standby.check("openshell.coordinator").await.unwrap(),
        ServingStatus::NotServing
    );

    // Reflection lists the port's services and the standard ones.
    let services = standby.list_services().await;
    for service in [
        "openshell.supervisor.pool.v1.SupervisorPool",
        "openshell.supervisor.registry.v1.InstanceRegistry",
        "openshell.supervisor.host.v1.SupervisorHost",
        "openshell.supervisor.recovery.v1.SupervisorRecovery",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    ] {
        assert!(services.iter().any(|s| s == service), "{service} in {services:?}");
    }
    assert!(
        !services.iter().any(|s| s.contains("runtime")),
        "the members' runtime service is not served here: {services:?}"
    );

    // The exemption is the standard services' only: the pool's RPCs still want a token.
    let refused = SupervisorPoolClient::new(standby.channel.clone())
        .get_supervisor_pool_status(GetSupervisorPoolStatusRequest::default())
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");

    // The coordinator leaves: its lease passes to the standby, whose status follows.
    coordinator.stop().await;
    standby
        .watch_until("openshell.coordinator", ServingStatus::Serving)
        .await;
    assert_eq!(standby.check("").await.unwrap(), ServingStatus::Serving);
    standby.stop().await;
}
