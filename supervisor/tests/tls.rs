//! TLS on both sides of a member, over real sockets: its runtime port serves only clients that
//! trust the pool CA and verify the Service name its certificate carries (sidecars dial the
//! member by IP), never plaintext; and it attaches to a TLS gateway by the gateway's
//! certificate name. Its standard health and reflection services answer stock clients
//! without a token, SERVING only while a gateway has admitted the member.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use plumbing::tls::ClientTls;
use proto::runtime::v1::supervisor_runtime_client::SupervisorRuntimeClient;
use proto::runtime::v1::supervisor_runtime_server::SERVICE_NAME as RUNTIME;
use support::pki::Pki;
use support::{FakeGateway, Member, within};
use tokio_stream::StreamExt as _;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

const SUPERVISOR_NAME: &str = "openshell-supervisor.team-a.svc";
const GATEWAY_NAME: &str = "openshell-gateway.system.svc";
const LIMIT: Duration = Duration::from_secs(5);

/// Opens a runtime stream without a token: a member that is reached answers UNAUTHENTICATED.
async fn runtime_call(tls: &ClientTls, url: &str) -> Result<Status, String> {
    let channel = tls.connect(url, LIMIT).await.map_err(|err| err.to_string())?;
    let mut client = SupervisorRuntimeClient::new(channel);
    match tokio::time::timeout(LIMIT, client.connect(tokio_stream::empty())).await {
        Ok(Ok(_)) => Err("a stream opened without a token".to_owned()),
        Ok(Err(status)) => Ok(status),
        Err(_) => Err("no answer".to_owned()),
    }
}

#[tokio::test]
async fn the_runtime_port_serves_only_tls_clients_that_trust_the_pool_ca_and_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pki::new(dir.path(), "pool");
    let other = Pki::new(dir.path(), "other");
    // As in Kubernetes: the certificate names the supervisor Service, not the Pod IP.
    let (cert, key) = pool.issue("runtime", &[SUPERVISOR_NAME]);
    let mut gateway = FakeGateway::start().await;
    let _member = Member::start_with(
        "supervisor-0",
        &[&gateway.endpoint],
        "t",
        &["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()],
    );
    let connection = gateway.next_connection().await;
    let url = connection.hello.runtime_address.clone();
    assert!(url.starts_with("https://127.0.0.1:"), "advertised {url}");

    let trusted = ClientTls {
        ca: Some(pool.ca.clone()),
        server_name: Some(SUPERVISOR_NAME.to_owned()),
        dialer: None,
    };
    let status = runtime_call(&trusted, &url).await.unwrap();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    // Verified against the dialed IP instead of the Service name: refused.
    let by_ip = ClientTls {
        server_name: None,
        ..trusted.clone()
    };
    let err = runtime_call(&by_ip, &url).await.unwrap_err();
    assert!(err.contains("certificate not valid for name"), "{err}");

    // Another CA: refused.
    let wrong_ca = ClientTls {
        ca: Some(other.ca.clone()),
        ..trusted.clone()
    };
    let err = runtime_call(&wrong_ca, &url).await.unwrap_err();
    assert!(err.contains("invalid peer certificate"), "{err}");

    // Plaintext on the TLS port: the service is never reached.
    let plaintext = url.replacen("https://", "http://", 1);
    let answer = runtime_call(&ClientTls::default(), &plaintext).await;
    assert!(
        !matches!(&answer, Ok(status) if status.code() == Code::Unauthenticated),
        "plaintext reached the service: {answer:?}"
    );
}

#[tokio::test]
async fn a_member_attaches_to_a_tls_gateway_by_its_certificate_name() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pki::new(dir.path(), "pool");
    let mut gateway = FakeGateway::start_tls(pool.server_config("gateway", &[GATEWAY_NAME])).await;
    assert!(gateway.endpoint.starts_with("https://127.0.0.1:"));
    let ca = pool.ca.to_str().unwrap();
    let _member = Member::start_with(
        "supervisor-0",
        &[&gateway.endpoint],
        "token-one",
        &["--tls-ca", ca, "--gateway-tls-name", GATEWAY_NAME],
    );
    let connection = gateway.next_connection().await;
    assert_eq!(connection.hello.member, "supervisor-0");
    assert_eq!(connection.token.as_deref(), Some("token-one"));
    // Without TLS of its own, the member advertises a plaintext runtime address.
    assert!(connection.hello.runtime_address.starts_with("http://"));
}

#[tokio::test]
async fn an_https_gateway_without_a_ca_is_a_configuration_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = support::config("supervisor-0", &["https://127.0.0.1:9"], &dir.path().join("token"), &[]);
    let err = supervisor::run(config, tokio_util::sync::CancellationToken::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("OPENSHELL_TLS_CA"), "{err}");
}

/// `Health/Check` of `service` without a token.
async fn health(channel: &Channel, service: &str) -> Result<ServingStatus, Status> {
    let request = HealthCheckRequest {
        service: service.into(),
    };
    Ok(HealthClient::new(channel.clone())
        .check(request)
        .await?
        .into_inner()
        .status())
}

/// `Health/Watch` of `service` without a token, until it reports `wanted`.
async fn watch_until(channel: &Channel, service: &str, wanted: ServingStatus) {
    let request = HealthCheckRequest {
        service: service.into(),
    };
    let mut updates = HealthClient::new(channel.clone())
        .watch(request)
        .await
        .unwrap()
        .into_inner();
    within(&format!("{service:?} to report {wanted:?}"), async {
        while let Some(update) = updates.next().await {
            if update.unwrap().status() == wanted {
                return;
            }
        }
        panic!("the watch of {service:?} ended");
    })
    .await;
}

#[tokio::test]
async fn the_runtime_port_answers_health_and_reflection_without_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pki::new(dir.path(), "pool");
    let (cert, key) = pool.issue("runtime", &[SUPERVISOR_NAME]);
    let mut gateway = FakeGateway::start().await;
    // No token yet: the member cannot be admitted by a gateway.
    let token_file = dir.path().join("token");
    let config = support::config(
        "supervisor-0",
        &[&gateway.endpoint],
        &token_file,
        &["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()],
    );
    let listeners = supervisor::Listeners::bind(&config).await.unwrap();
    let url = format!("https://127.0.0.1:{}", listeners.runtime.local_addr().unwrap().port());
    let _member = tokio::spawn(supervisor::run_on(config, listeners, CancellationToken::new()));
    let tls = ClientTls {
        ca: Some(pool.ca.clone()),
        server_name: Some(SUPERVISOR_NAME.to_owned()),
        dialer: None,
    };
    let channel = tls.connect(&url, LIMIT).await.unwrap();

    // Serving sidecars, but not admitted: NOT_SERVING, for the member and its service.
    for service in ["", RUNTIME] {
        assert_eq!(
            health(&channel, service).await.unwrap(),
            ServingStatus::NotServing,
            "{service}"
        );
    }
    let unknown = health(&channel, "openshell.coordinator").await.unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound, "{unknown:?}");

    // Reflection lists the runtime service and the standard ones, not the gateway's.
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let answer = ServerReflectionClient::new(channel.clone())
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner()
        .next()
        .await
        .unwrap()
        .unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("not a service list: {answer:?}");
    };
    let services: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for service in [RUNTIME, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"] {
        assert!(services.iter().any(|s| s == service), "{service} in {services:?}");
    }
    assert!(!services.iter().any(|s| s.contains("pool.v1")), "{services:?}");

    // The exemption is the standard services' only: the runtime stream still wants a token.
    let status = runtime_call(&tls, &url).await.unwrap();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    // Admitted: SERVING. The gateway goes away and no token is left: NOT_SERVING again.
    std::fs::write(&token_file, "token-one\n").unwrap();
    let connection = gateway.next_connection().await;
    watch_until(&channel, "", ServingStatus::Serving).await;
    assert_eq!(health(&channel, RUNTIME).await.unwrap(), ServingStatus::Serving);
    std::fs::remove_file(&token_file).unwrap();
    connection.end(Status::unavailable("replica going away")).await;
    watch_until(&channel, "", ServingStatus::NotServing).await;
    assert_eq!(health(&channel, RUNTIME).await.unwrap(), ServingStatus::NotServing);
}
