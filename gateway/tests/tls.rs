//! The gateway's gRPC port over real TLS: a client that trusts the pool's CA gets through, one
//! with another CA or without TLS does not, and the CA is delivered beside the tokens.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::time::Duration;

use clap::Parser;
use proto::pool::v1::GetSupervisorPoolStatusRequest;
use proto::pool::v1::supervisor_pool_client::SupervisorPoolClient;
use tokio_util::sync::CancellationToken;

/// A CA and a server certificate it signed for localhost; returns (CA PEM, cert PEM, key PEM).
fn pki() -> (String, String, String) {
    let ca = testkit::pki::Ca::new();
    let leaf = ca.leaf(&["localhost", "127.0.0.1"]);
    (ca.pem(), leaf.cert, leaf.key)
}

fn write(dir: &Path, name: &str, contents: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path.to_str().unwrap().to_owned()
}

async fn status(url: &str, ca: Option<&Path>, token: &str) -> Result<(), String> {
    let endpoint = plumbing::tls::endpoint(url, ca, None)
        .await
        .map_err(|e| e.to_string())?;
    let channel = endpoint
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    let mut request = tonic::Request::new(GetSupervisorPoolStatusRequest::default());
    request
        .metadata_mut()
        .insert("authorization", proto::bearer_value(token).parse().unwrap());
    SupervisorPoolClient::new(channel)
        .get_supervisor_pool_status(request)
        .await
        .map(|_| ())
        .map_err(|e| format!("call: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_port_speaks_tls_with_the_pool_ca_only() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = pki();
    let (other_ca, _, _) = pki();
    let ca_file = write(dir.path(), "ca.crt", &ca);
    let other_ca_file = write(dir.path(), "other-ca.crt", &other_ca);
    let credentials = dir.path().join("credentials");
    let health = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap();
    let settings = gateway::Settings::parse_from([
        "gateway",
        "--database-url",
        &format!("sqlite://{}?mode=rwc", dir.path().join("store.db").display()),
        "--listen",
        "127.0.0.1:0",
        "--status-interval-ms",
        "0",
        "--tls-cert",
        &write(dir.path(), "tls.crt", &cert),
        "--tls-key",
        &write(dir.path(), "tls.key", &key),
        "--tls-ca",
        &ca_file,
        "--credentials-dir",
        credentials.to_str().unwrap(),
        "--health-listen",
        &health.to_string(),
    ]);
    let listener = gateway::bind(&settings).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(gateway::run(settings, listener, shutdown.clone()));

    // The coordinator delivers the CA beside every token.
    let operator = credentials.join("operator");
    let mut token = None;
    for _ in 0..2000 {
        if let (Ok(t), Ok(delivered_ca)) = (
            std::fs::read_to_string(operator.join("token")),
            std::fs::read_to_string(operator.join("ca.crt")),
        ) {
            assert_eq!(delivered_ca, ca, "the delivered ca.crt is the configured bundle");
            token = Some(t);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let token = token.expect("the operator token and ca.crt are delivered");

    let url = format!("https://localhost:{port}");
    status(&url, Some(Path::new(&ca_file)), &token)
        .await
        .expect("a client trusting the pool CA is served");
    let wrong = status(&url, Some(Path::new(&other_ca_file)), &token).await;
    assert!(wrong.is_err(), "a client trusting another CA must be refused");
    let plain = status(&format!("http://127.0.0.1:{port}"), None, &token).await;
    assert!(plain.is_err(), "plaintext must not be served on a TLS port");
    let no_ca = status(&url, None, &token).await.unwrap_err();
    assert!(no_ca.contains("no CA bundle"), "{no_ca}");

    // The shared accept loop counted them on the health port's /metrics.
    let metrics = get_metrics(health).await;
    let value = |name: &str| -> u64 {
        let line = format!("openshell_gateway_connections_{name}{{listener=\"grpc\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&line))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{line} in {metrics}"))
    };
    assert!(value("accepted_total") >= 3, "{metrics}");
    // The other CA's client and the plaintext one never completed a handshake.
    assert!(value("handshake_failed_total") >= 2, "{metrics}");

    shutdown.cancel();
    task.await.unwrap().unwrap();
}

/// The health port's `/metrics` text.
async fn get_metrics(health: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut socket = tokio::net::TcpStream::connect(health).await.unwrap();
    socket
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    socket.read_to_string(&mut body).await.unwrap();
    body
}
