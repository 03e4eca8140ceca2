//! TLS on both sides of a member, over real sockets: its runtime port serves only clients that
//! trust the pool CA and verify the Service name its certificate carries (sidecars dial the
//! member by IP), never plaintext; and it attaches to a TLS gateway by the gateway's
//! certificate name.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use proto::runtime::v1::supervisor_runtime_client::SupervisorRuntimeClient;
use proto::tls::ClientTls;
use support::pki::Pki;
use support::{FakeGateway, Member};
use tonic::{Code, Status};

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
