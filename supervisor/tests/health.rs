//! The health port of a member driven against a fake gateway over real sockets: `/healthz`
//! while the process serves, `/readyz` following the gateway attachment and the leave.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use proto::host::v1::AssignmentPhase::Active as Owned;
use support::{FakeGateway, WAIT, owned, snapshot, within};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::Status;

/// One plain HTTP/1.1 GET; `None` when nothing answers.
async fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let status = response.split(' ').nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((status, body))
}

/// Polls `path` until its answer satisfies `accept` (bounded by [`WAIT`]).
async fn wait_for(addr: SocketAddr, path: &str, what: &str, accept: impl Fn(&Option<(u16, String)>) -> bool) {
    let deadline = Instant::now() + WAIT;
    loop {
        let answer = get(addr, path).await;
        if accept(&answer) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; last answer {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn readyz_follows_the_gateway_attachment_and_the_leave() {
    let mut gateway = FakeGateway::start().await;
    let dir = tempfile::tempdir().unwrap();
    // The token file does not exist yet, as in a supervisor Pod started before the gateway
    // has written its Secret: the member keeps retrying and is not ready.
    let token_file = dir.path().join("token");
    let config = support::config(
        "supervisor-0",
        &[&gateway.endpoint],
        &token_file,
        &["--health-listen", "127.0.0.1:0"],
    );
    let listeners = supervisor::Listeners::bind(&config).await.unwrap();
    let health = listeners.health_addr().expect("a health port");
    assert_ne!(health.port(), 0);
    let shutdown = CancellationToken::new();
    let member = tokio::spawn(supervisor::run_on(config, listeners, shutdown.clone()));

    // Live, not ready: no gateway attached.
    wait_for(health, "/healthz", "healthz 200", |a| {
        a.as_ref().is_some_and(|(code, body)| *code == 200 && body == "ok\n")
    })
    .await;
    let (code, body) = get(health, "/readyz").await.unwrap();
    assert_eq!((code, body.as_str()), (503, "not attached to a gateway\n"));
    assert!(gateway.try_connection().is_none());

    // The token appears: the member attaches and becomes ready.
    std::fs::write(&token_file, "token-one\n").unwrap();
    let connection = gateway.next_connection().await;
    assert_eq!(connection.token.as_deref(), Some("token-one"));
    wait_for(health, "/readyz", "ready after attaching", |a| {
        a.as_ref().is_some_and(|(code, _)| *code == 200)
    })
    .await;
    // The connection counters of both ports, in the gateway's and the webhook's format.
    let (code, metrics) = get(health, "/metrics").await.unwrap();
    assert_eq!(code, 200);
    for line in [
        "openshell_supervisor_connections_accepted_total{listener=\"health\"}",
        "openshell_supervisor_connections_refused_total{listener=\"runtime\",reason=\"source_cap\"} 0",
        "openshell_supervisor_connections_idle_closed_total{listener=\"runtime\"} 0",
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }

    // The stream ends and no new one can be opened (token gone): not ready, still live.
    std::fs::remove_file(&token_file).unwrap();
    connection.end(Status::unavailable("replica going away")).await;
    wait_for(health, "/readyz", "not ready after losing the gateway", |a| {
        a.as_ref()
            .is_some_and(|(code, body)| *code == 503 && body == "not attached to a gateway\n")
    })
    .await;
    assert_eq!(get(health, "/healthz").await.map(|(code, _)| code), Some(200));

    // Attached again: ready again. It hosts an instance, so it stays while leaving.
    std::fs::write(&token_file, "token-two\n").unwrap();
    let mut connection = gateway.next_connection().await;
    assert_eq!(connection.token.as_deref(), Some("token-two"));
    wait_for(health, "/readyz", "ready after re-attaching", |a| {
        a.as_ref().is_some_and(|(code, _)| *code == 200)
    })
    .await;

    connection.send(snapshot(1, vec![owned("a", 1, Owned)])).await;
    assert_eq!(connection.acks_until(1).await, vec![1]);

    // Leaving: not ready at once, while it still hosts; once the gateway has moved the
    // instance away the member leaves and the port closes.
    shutdown.cancel();
    wait_for(health, "/readyz", "not ready while leaving", |a| {
        a.as_ref()
            .is_some_and(|(code, body)| *code == 503 && body == "leaving the pool\n")
    })
    .await;
    assert_eq!(get(health, "/healthz").await.map(|(code, _)| code), Some(200));
    connection.send(snapshot(2, Vec::new())).await;
    within("the member to leave", member).await.unwrap().unwrap();
    wait_for(health, "/healthz", "the health port to close", Option::is_none).await;
    drop(connection);
}

#[tokio::test]
async fn a_health_port_that_cannot_be_bound_names_its_variable() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let config = support::config(
        "supervisor-0",
        &["http://127.0.0.1:9"],
        &dir.path().join("token"),
        &["--health-listen", &address],
    );
    let err = supervisor::run(config, CancellationToken::new()).await.unwrap_err();
    assert!(err.to_string().contains("OPENSHELL_SUPERVISOR_HEALTH_LISTEN"), "{err}");
}
