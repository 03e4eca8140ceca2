//! The server over real sockets: TLS, certificate reload, readiness, metrics, body limit,
//! graceful and forced shutdown.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::{
    Running, TlsClient, fixture, fixture_bytes, http_get, metric, self_signed, served_cert, start, wait_until,
};
use rustls::pki_types::ServerName;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

const WAIT: Duration = Duration::from_secs(15);

fn write_pair(dir: &Path, cert: &str, key: &str) {
    std::fs::write(dir.join("tls.crt"), cert).unwrap();
    std::fs::write(dir.join("tls.key"), key).unwrap();
}

async fn wait_served(addr: std::net::SocketAddr, der: &[u8], what: &str) {
    wait_until(what, WAIT, || async {
        served_cert(addr).await.ok().filter(|served| served == der)
    })
    .await;
}

#[tokio::test]
async fn ready_only_with_a_certificate_then_mutates_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path().join("tls.crt"), dir.path().join("tls.key"), |_| {}).await;

    // Alive but not ready: no certificate yet, and no TLS handshake possible.
    let (status, _) = wait_until("health port up", WAIT, || async {
        http_get(server.health, "/healthz").await.ok()
    })
    .await;
    assert_eq!(status, 200);
    let (status, body) = http_get(server.health, "/readyz").await.unwrap();
    assert_eq!(status, 503);
    assert!(body.contains("certificate"), "{body}");
    assert!(served_cert(server.webhook).await.is_err());

    let (cert, key, der) = self_signed("first");
    write_pair(dir.path(), &cert, &key);
    wait_until("ready", WAIT, || async {
        http_get(server.health, "/readyz").await.ok().filter(|(s, _)| *s == 200)
    })
    .await;
    assert_eq!(served_cert(server.webhook).await.unwrap(), der);

    // One keep-alive connection, three reviews.
    let mut client = TlsClient::connect(server.webhook).await.unwrap();
    let out = review_plain_pod(&mut client).await;
    assert_eq!(out["response"]["allowed"], true);
    assert_eq!(out["response"]["patchType"], "JSONPatch");

    let mut system = fixture("pod-create-plain.json");
    system["request"]["namespace"] = json!("kube-system");
    let (_, body) = client
        .post("/mutate", serde_json::to_vec(&system).unwrap())
        .await
        .unwrap();
    let out: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(out["response"]["allowed"], true);
    assert!(out["response"].get("patch").is_none());

    let (status, body) = client.post("/mutate", b"{not json".to_vec()).await.unwrap();
    assert_eq!(status, 200);
    let out: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(out["response"]["allowed"], false);

    assert_eq!(
        metric(server.health, "openshell_webhook_admission_requests_total ").await,
        Some(3.0)
    );
    assert_eq!(
        metric(
            server.health,
            "openshell_webhook_admission_injected_total{mode=\"native\"}"
        )
        .await,
        Some(1.0)
    );
    assert_eq!(
        metric(
            server.health,
            "openshell_webhook_admission_skipped_total{reason=\"system_namespace\"}"
        )
        .await,
        Some(1.0)
    );
    assert_eq!(
        metric(
            server.health,
            "openshell_webhook_admission_failed_total{reason=\"invalid_json\"}"
        )
        .await,
        Some(1.0)
    );
    assert_eq!(
        metric(server.health, "openshell_webhook_admission_duration_seconds_count").await,
        Some(3.0)
    );

    server.trigger.drain();
    tokio::time::timeout(WAIT, server.handle)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// Lay out `dir` like a Kubernetes Secret volume: `tls.crt -> ..data/tls.crt`,
/// `..data -> ..<version>`; each update writes a new version directory and renames a new
/// `..data` link over the old one (atomic).
fn secret_volume_update(dir: &Path, version: &str, cert: &str, key: &str) {
    let versioned = dir.join(format!("..{version}"));
    std::fs::create_dir(&versioned).unwrap();
    std::fs::write(versioned.join("tls.crt"), cert).unwrap();
    std::fs::write(versioned.join("tls.key"), key).unwrap();
    let tmp = dir.join("..data_tmp");
    std::os::unix::fs::symlink(format!("..{version}"), &tmp).unwrap();
    let old = std::fs::read_link(dir.join("..data")).ok();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    for name in ["tls.crt", "tls.key"] {
        if std::fs::symlink_metadata(dir.join(name)).is_err() {
            std::os::unix::fs::symlink(format!("..data/{name}"), dir.join(name)).unwrap();
        }
    }
    if let Some(old) = old {
        std::fs::remove_dir_all(dir.join(old)).unwrap();
    }
}

#[tokio::test]
async fn certificate_follows_a_secret_volume_data_symlink_swap() {
    let dir = tempfile::tempdir().unwrap();
    let (cert_a, key_a, der_a) = self_signed("a");
    secret_volume_update(dir.path(), "2026_01_01_00_00_00.1", &cert_a, &key_a);
    let server = start(dir.path().join("tls.crt"), dir.path().join("tls.key"), |_| {}).await;
    wait_served(server.webhook, &der_a, "certificate A").await;

    // A connection opened before the swap keeps working after it.
    let mut before = TlsClient::connect(server.webhook).await.unwrap();

    let (cert_b, key_b, der_b) = self_signed("b");
    assert_ne!(der_a, der_b);
    secret_volume_update(dir.path(), "2026_01_01_00_05_00.2", &cert_b, &key_b);
    assert!(
        std::fs::symlink_metadata(dir.path().join("tls.crt"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    wait_served(server.webhook, &der_b, "certificate B after the ..data swap").await;

    let (status, _) = before
        .post("/mutate", fixture_bytes("pod-create-plain.json"))
        .await
        .unwrap();
    assert_eq!(status, 200);

    // And a second swap.
    let (cert_c, key_c, der_c) = self_signed("c");
    secret_volume_update(dir.path(), "2026_01_01_00_10_00.3", &cert_c, &key_c);
    wait_served(server.webhook, &der_c, "certificate C after the second swap").await;

    server.trigger.force();
    tokio::time::timeout(WAIT, server.handle)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn in_place_rewrite_waits_for_a_consistent_pair() {
    let dir = tempfile::tempdir().unwrap();
    let (cert_a, key_a, der_a) = self_signed("a");
    write_pair(dir.path(), &cert_a, &key_a);
    let server = start(dir.path().join("tls.crt"), dir.path().join("tls.key"), |_| {}).await;
    wait_served(server.webhook, &der_a, "certificate A").await;
    let loads = "openshell_webhook_tls_certificate_reloads_total{result=\"loaded\"}";
    let errors = "openshell_webhook_tls_certificate_reloads_total{result=\"error\"}";
    assert_eq!(metric(server.health, loads).await, Some(1.0));

    // Half-way through a non-atomic update: new certificate, old key.
    let (cert_b, key_b, der_b) = self_signed("b");
    std::fs::write(dir.path().join("tls.crt"), &cert_b).unwrap();
    wait_until("the mismatched pair is noticed", WAIT, || async {
        metric(server.health, errors).await.filter(|v| *v >= 1.0)
    })
    .await;
    assert_eq!(served_cert(server.webhook).await.unwrap(), der_a, "keeps serving A");
    let (status, _) = http_get(server.health, "/readyz").await.unwrap();
    assert_eq!(status, 200, "still ready with the previous certificate");

    std::fs::write(dir.path().join("tls.key"), &key_b).unwrap();
    wait_served(server.webhook, &der_b, "certificate B once the key matches").await;
    assert_eq!(metric(server.health, loads).await, Some(2.0));

    server.trigger.force();
    tokio::time::timeout(WAIT, server.handle)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn oversized_body_is_refused_with_the_uid() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, der) = self_signed("a");
    write_pair(dir.path(), &cert, &key);
    let server = start(dir.path().join("tls.crt"), dir.path().join("tls.key"), |c| {
        c.max_body_bytes = 4096;
    })
    .await;
    wait_served(server.webhook, &der, "certificate").await;

    let body = fixture_bytes("pod-create-with-volumes.json");
    assert!(body.len() > 4096);
    let mut client = TlsClient::connect(server.webhook).await.unwrap();
    let (status, response) = client.post("/mutate", body).await.unwrap();
    assert_eq!(status, 200);
    let out: Value = serde_json::from_slice(&response).unwrap();
    assert_eq!(out["response"]["uid"], "668314f2-b781-492d-ad31-73d694b46e62");
    assert_eq!(out["response"]["allowed"], false);
    assert_eq!(out["response"]["status"]["code"], 413);
    assert!(out["response"]["status"]["message"].as_str().unwrap().contains("4096"));

    // A body under the limit on a fresh connection is served.
    let mut small = fixture("pod-create-no-volumes-automount-false.json");
    small["request"]["object"]["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("managedFields");
    let small = serde_json::to_vec(&small).unwrap();
    assert!(small.len() < 4096, "{}", small.len());
    let mut client = TlsClient::connect(server.webhook).await.unwrap();
    let (_, response) = client.post("/mutate", small).await.unwrap();
    let out: Value = serde_json::from_slice(&response).unwrap();
    assert_eq!(out["response"]["allowed"], true);
    assert_eq!(
        metric(
            server.health,
            "openshell_webhook_admission_failed_total{reason=\"body_too_large\"}"
        )
        .await,
        Some(1.0)
    );
    server.trigger.force();
    tokio::time::timeout(WAIT, server.handle)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// Send the headers and the first half of a review; return the stream and the rest.
async fn stalled_request(addr: std::net::SocketAddr) -> (tokio_rustls::client::TlsStream<TcpStream>, Vec<u8>) {
    let body = fixture_bytes("pod-create-plain.json");
    let tcp = TcpStream::connect(addr).await.unwrap();
    let mut tls = common::tls_connector()
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    let head = format!(
        "POST /mutate HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    tls.write_all(head.as_bytes()).await.unwrap();
    let half = body.len() / 2;
    tls.write_all(&body[..half]).await.unwrap();
    tls.flush().await.unwrap();
    (tls, body[half..].to_vec())
}

/// The handler counts a request before reading its body: once counted, the request is in
/// flight (not an idle connection that a graceful shutdown may close at once).
async fn wait_handler_started(health: std::net::SocketAddr) {
    wait_until("the stalled request reached the handler", WAIT, || async {
        metric(health, "openshell_webhook_admission_requests_total ")
            .await
            .filter(|v| *v >= 1.0)
    })
    .await;
}

#[tokio::test]
async fn drain_finishes_in_flight_requests_and_force_cuts_them() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, der) = self_signed("a");
    write_pair(dir.path(), &cert, &key);

    // Drain: the in-flight request completes, then run() returns.
    let server = start(dir.path().join("tls.crt"), dir.path().join("tls.key"), |c| {
        c.drain_timeout_ms = 60_000;
        c.request_timeout_ms = 60_000;
    })
    .await;
    wait_served(server.webhook, &der, "certificate").await;
    let (mut tls, rest) = stalled_request(server.webhook).await;
    wait_handler_started(server.health).await;
    server.trigger.drain();
    wait_until("listener closed", WAIT, || async {
        TcpStream::connect(server.webhook).await.err().map(|_| ())
    })
    .await;
    assert!(!server.handle.is_finished(), "waits for the in-flight request");
    tls.write_all(&rest).await.unwrap();
    tls.flush().await.unwrap();
    let mut response = Vec::new();
    let read = tokio::time::timeout(WAIT, async {
        let mut buf = [0u8; 8192];
        loop {
            let n = tls.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                break;
            }
            response.extend_from_slice(&buf[..n]);
            if String::from_utf8_lossy(&response).contains("df9a6f69-28a7-4a9b-b942-ed00b3ccf379") {
                break;
            }
        }
    });
    read.await.unwrap();
    let text = String::from_utf8_lossy(&response);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("df9a6f69-28a7-4a9b-b942-ed00b3ccf379"));
    tokio::time::timeout(WAIT, server.handle)
        .await
        .unwrap()
        .unwrap()
        .unwrap();

    // Force: a stalled request does not hold the shutdown.
    let server = start(dir.path().join("tls.crt"), dir.path().join("tls.key"), |c| {
        c.drain_timeout_ms = 600_000;
        c.request_timeout_ms = 600_000;
        c.shutdown_delay_ms = 0;
    })
    .await;
    wait_served(server.webhook, &der, "certificate").await;
    let (_tls, _rest) = stalled_request(server.webhook).await;
    wait_handler_started(server.health).await;
    server.trigger.drain();
    wait_until("listener closed", WAIT, || async {
        TcpStream::connect(server.webhook).await.err().map(|_| ())
    })
    .await;
    assert!(!server.handle.is_finished());
    server.trigger.force();
    tokio::time::timeout(WAIT, server.handle)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn dropping_the_trigger_drains_rather_than_forces() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, der) = self_signed("a");
    write_pair(dir.path(), &cert, &key);
    let server = start(dir.path().join("tls.crt"), dir.path().join("tls.key"), |c| {
        c.shutdown_delay_ms = 60_000;
    })
    .await;
    wait_served(server.webhook, &der, "certificate").await;
    let Running {
        trigger,
        handle,
        health,
        webhook,
    } = server;
    drop(trigger);
    // A drain: not ready, but still serving during the shutdown delay (a forced stop would
    // have closed both ports).
    wait_until("readyz reports the drain", WAIT, || async {
        http_get(health, "/readyz")
            .await
            .ok()
            .filter(|(s, b)| *s == 503 && b.contains("shutting down"))
    })
    .await;
    let mut client = TlsClient::connect(webhook).await.unwrap();
    let (status, _) = client
        .post("/mutate", fixture_bytes("pod-create-plain.json"))
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert!(!handle.is_finished());
    handle.abort();
}

#[tokio::test]
async fn readyz_fails_during_the_shutdown_delay() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, der) = self_signed("a");
    write_pair(dir.path(), &cert, &key);
    let server = start(dir.path().join("tls.crt"), dir.path().join("tls.key"), |c| {
        c.shutdown_delay_ms = 60_000;
    })
    .await;
    wait_served(server.webhook, &der, "certificate").await;
    assert_eq!(http_get(server.health, "/readyz").await.unwrap().0, 200);
    server.trigger.drain();
    let body = wait_until("readyz fails", WAIT, || async {
        http_get(server.health, "/readyz")
            .await
            .ok()
            .filter(|(s, _)| *s == 503)
            .map(|(_, b)| b)
    })
    .await;
    assert!(body.contains("shutting down"), "{body}");
    // Still serving during the delay, so in-flight API server calls are not refused.
    let mut client = TlsClient::connect(server.webhook).await.unwrap();
    let (status, _) = client
        .post("/mutate", fixture_bytes("pod-create-plain.json"))
        .await
        .unwrap();
    assert_eq!(status, 200);
    server.trigger.force();
    tokio::time::timeout(WAIT, server.handle)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// Posts the plain Pod fixture; the answer (200, with its UID).
async fn review_plain_pod(client: &mut TlsClient) -> Value {
    let (status, body) = client
        .post("/mutate", fixture_bytes("pod-create-plain.json"))
        .await
        .unwrap();
    assert_eq!(status, 200);
    let out: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(out["response"]["uid"], "df9a6f69-28a7-4a9b-b942-ed00b3ccf379");
    out
}

/// A TCP connection from `source`, another loopback address than the client's 127.0.0.1.
async fn connect_from(source: &str, addr: std::net::SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
    socket.connect(addr).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_from_one_source_leaves_reviews_served_and_silent_connections_are_closed() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, der) = self_signed("a");
    write_pair(dir.path(), &cert, &key);
    let server = start(dir.path().join("tls.crt"), dir.path().join("tls.key"), |c| {
        c.connections.max_connections_per_source = 32;
        c.connections.first_request_timeout_ms = 300;
        // Every flood handshake stays pending while the review is served.
        c.connections.handshake_timeout_ms = 600_000;
    })
    .await;
    wait_served(server.webhook, &der, "certificate").await;

    // Idle TCP from 127.0.0.2: 32 take that source's slots, the rest are closed at accept.
    let mut flood = Vec::new();
    for _ in 0..100 {
        flood.push(connect_from("127.0.0.2", server.webhook).await);
    }
    let refused = "openshell_webhook_connections_refused_total{listener=\"webhook\",reason=\"source_cap\"}";
    wait_until("68 refusals", WAIT, || async {
        metric(server.health, refused).await.filter(|v| *v >= 68.0)
    })
    .await;
    assert_eq!(metric(server.health, refused).await, Some(68.0));

    // TLS connections from 127.0.0.3 that never send a request.
    let mut silent = Vec::new();
    for _ in 0..10 {
        let tcp = connect_from("127.0.0.3", server.webhook).await;
        let tls = common::tls_connector()
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .unwrap();
        silent.push(tls);
    }

    // The API server's review is answered meanwhile.
    let mut client = TlsClient::connect(server.webhook).await.unwrap();
    review_plain_pod(&mut client).await;

    // The silent ones are closed by the server after the first-request time-out, and counted.
    for tls in &mut silent {
        let mut buf = [0u8; 256];
        let read = tokio::time::timeout(WAIT, async {
            loop {
                match tls.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        });
        read.await.expect("the webhook closes a request-less connection");
    }
    let idle = "openshell_webhook_connections_idle_closed_total{listener=\"webhook\"}";
    wait_until("10 idle closes", WAIT, || async {
        metric(server.health, idle).await.filter(|v| *v >= 10.0)
    })
    .await;
    // The flood's idle TCP connections are still waiting in their handshakes.
    let accepted = "openshell_webhook_connections_accepted_total{listener=\"webhook\"}";
    assert!(metric(server.health, accepted).await.unwrap() >= 32.0 + 10.0 + 1.0);
    let open = metric(
        server.health,
        "openshell_webhook_connections_open{listener=\"webhook\"}",
    )
    .await;
    assert!(open.unwrap() >= 33.0, "{open:?}");
    drop(flood);
}
