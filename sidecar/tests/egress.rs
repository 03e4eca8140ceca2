//! The egress proxy, driven as a workload's HTTP client drives it, against a real upstream on
//! loopback (outside Kubernetes a sidecar honours a rule naming loopback; in a Pod the floor
//! refuses it): denied before any install, decided from the
//! revision the owner installed, 403 with a JSON body that says why and which rule would be
//! needed, the floor refused whatever the rules say, a revoked tunnel closed, hostile requests
//! refused.

#![allow(clippy::expect_used)]

mod support;

use proto::runtime::v1::{EgressPolicy, EgressRule, PolicyInstall, sidecar_message, supervisor_message};
use serde_json::Value;
use serde_json::json;
use support::{Fixture, WorkloadClient, agent_command, within};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// An upstream that answers every request with what it received (request line and headers)
/// and echoes whatever a tunnel carries after `ECHO\n`.
async fn upstream() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                while !seen.ends_with(b"\r\n\r\n") && !seen.starts_with(b"ECHO\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                if seen.starts_with(b"ECHO\n") {
                    let _ = stream.write_all(&seen[5..]).await;
                    let (mut read, mut write) = stream.split();
                    let _ = tokio::io::copy(&mut read, &mut write).await;
                    return;
                }
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    seen.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
                let _ = stream.write_all(&seen).await;
            });
        }
    });
    port
}

/// Not a test: the workload process the sidecar starts in these tests (see `support`).
#[test]
#[ignore = "helper process started by the sidecar under test"]
fn workload_agent() {
    if let Ok(socket) = std::env::var("OPENSHELL_SIDECAR_SOCKET") {
        support::agent_main(&socket);
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Sends `raw` to the proxy; the status, the head and the body (by content-length), and the
/// stream (a tunnel after a 200 to CONNECT).
async fn ask(proxy: u16, raw: &str) -> (u16, String, String, TcpStream) {
    let mut stream = TcpStream::connect(("127.0.0.1", proxy)).await.expect("the proxy");
    stream.write_all(raw.as_bytes()).await.expect("write");
    let (status, head, body) = answer(&mut stream).await;
    (status, head, body, stream)
}

/// The next response on `stream`: status, head, body.
async fn answer(stream: &mut TcpStream) -> (u16, String, String) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    within("the proxy's answer", async {
        while !head.ends_with(b"\r\n\r\n") {
            match stream.read(&mut byte).await {
                Ok(1) => head.push(byte[0]),
                _ => break,
            }
        }
    })
    .await;
    let head = String::from_utf8_lossy(&head).into_owned();
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let length: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().to_owned())
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    within("the body", stream.read_exact(&mut body)).await.expect("body");
    (status, head, String::from_utf8_lossy(&body).into_owned())
}

fn rule(name: &str, host: &str, port: u16) -> EgressRule {
    EgressRule {
        name: name.into(),
        host: host.into(),
        ports: vec![u32::from(port)],
        ..EgressRule::default()
    }
}

fn install(term: u64, revision: u64, rules: Vec<EgressRule>) -> supervisor_message::Kind {
    supervisor_message::Kind::PolicyInstall(PolicyInstall {
        term,
        policy: Some(EgressPolicy {
            name: "team-a-default".into(),
            revision,
            rules,
            ..EgressPolicy::default()
        }),
    })
}

async fn loaded(conn: &mut support::Conn) -> (String, u64, String) {
    loop {
        if let sidecar_message::Kind::PolicyLoaded(l) = conn.recv().await {
            return (l.name, l.revision, l.error);
        }
    }
}

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|_| panic!("a JSON body: {body:?}"))
}

#[tokio::test]
async fn the_proxy_decides_from_the_installed_revision_and_explains_refusals() {
    let allowed = upstream().await;
    let other = upstream().await;
    let proxy = free_port();
    let mut fx = Fixture::new(agent_command()).await;
    fx.config.egress_listen = Some(([127, 0, 0, 1], proxy).into());
    let member_port: u16 = fx
        .member
        .address
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port");
    let (run, shutdown) = fx.start();
    fx.registered().await;
    let mut m1 = fx.member.accept().await;
    let sidecar_message::Kind::Attach(_) = m1.recv().await else {
        panic!("expected Attach")
    };

    // Nothing installed: every destination is denied, and the answer says so.
    let connect = |port: u16| format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n");
    let (status, _, body, _) = ask(proxy, &connect(allowed)).await;
    assert_eq!(status, 403);
    let refused = json(&body);
    assert!(
        refused["reason"]
            .as_str()
            .is_some_and(|r| r.contains("no egress policy")),
        "{refused}"
    );
    assert_eq!(refused["destination"], format!("127.0.0.1:{allowed}"));
    // The workload reads it on its socket too, before any owner answered it.
    let mut agent = WorkloadClient::connect(&fx.agent_socket()).await;
    let view = agent.call(json!({"op": "policy"})).await;
    assert_eq!(view["proxy"], format!("http://127.0.0.1:{proxy}"), "{view}");
    assert!(view["policy"].is_null(), "{view}");
    assert_eq!(
        view["recentDenials"][0]["destination"],
        format!("127.0.0.1:{allowed}"),
        "{view}"
    );

    m1.take_over(&fx.signer, &fx.instance, 1, "m1", 0).await;
    let rules = vec![
        rule("upstream", "127.0.0.1", allowed),
        rule("metadata", "169.254.169.254", 80),
        rule("the-pool", "127.0.0.1", member_port),
    ];
    m1.send(install(1, 1, rules)).await;
    assert_eq!(loaded(&mut m1).await, ("team-a-default".into(), 1, String::new()));

    // A tunnel to the allowed upstream carries bytes both ways.
    let (status, _, _, mut tunnel) = ask(proxy, &connect(allowed)).await;
    assert_eq!(status, 200);
    tunnel.write_all(b"ECHO\nhello").await.expect("write");
    let mut echoed = [0u8; 5];
    within("the echo", tunnel.read_exact(&mut echoed)).await.expect("echo");
    assert_eq!(&echoed, b"hello");

    // Plain HTTP is forwarded in origin form with the Host the URL names; the proxy's own
    // headers are not passed on.
    let get = format!(
        "GET http://127.0.0.1:{allowed}/v1/items?q=1 HTTP/1.1\r\nHost: evil.example\r\nProxy-Authorization: Basic eA==\r\n\r\n"
    );
    let (status, _, seen, _) = ask(proxy, &get).await;
    assert_eq!(status, 200, "{seen}");
    assert!(seen.starts_with("GET /v1/items?q=1 HTTP/1.1\r\n"), "{seen}");
    assert!(
        seen.to_ascii_lowercase()
            .contains(&format!("host: 127.0.0.1:{allowed}\r\n")),
        "{seen}"
    );
    assert!(!seen.to_ascii_lowercase().contains("proxy-authorization"), "{seen}");

    // Another port: refused, with the rule that would be needed.
    let (status, _, body, _) = ask(proxy, &connect(other)).await;
    assert_eq!(status, 403);
    let refused = json(&body);
    assert_eq!(refused["policy"], "team-a-default");
    assert_eq!(refused["revision"], 1);
    assert_eq!(refused["ruleNeeded"]["ports"][0], other);
    let view = agent.call(json!({"op": "policy", "id": 2})).await;
    assert_eq!(
        (view["policy"]["name"].as_str(), view["policy"]["revision"].as_u64()),
        (Some("team-a-default"), Some(1))
    );
    assert_eq!(view["policy"]["rules"], json!(["upstream", "metadata", "the-pool"]));
    let last = &view["recentDenials"][1];
    assert_eq!(
        (last["destination"].as_str(), last["revision"].as_u64()),
        (Some(format!("127.0.0.1:{other}").as_str()), Some(1)),
        "{view}"
    );
    assert_eq!(view["id"], 2);
    // The floor, whatever the rules say: metadata, the pool's own endpoint; no rule would help.
    for port_host in ["169.254.169.254:80".to_owned(), format!("127.0.0.1:{member_port}")] {
        let raw = format!("CONNECT {port_host} HTTP/1.1\r\nHost: {port_host}\r\n\r\n");
        let (status, _, body, _) = ask(proxy, &raw).await;
        assert_eq!(status, 403, "{port_host}: {body}");
        assert!(json(&body)["ruleNeeded"].is_null(), "{port_host}: {body}");
    }

    // Hostile: a Host header that differs from the CONNECT target; an origin-form request;
    // a request with both Content-Length and Transfer-Encoding; 64 KiB of headers.
    let mismatch = format!("CONNECT 127.0.0.1:{allowed} HTTP/1.1\r\nHost: 127.0.0.1:{other}\r\n\r\n");
    assert_eq!(ask(proxy, &mismatch).await.0, 400);
    assert_eq!(ask(proxy, "GET /v1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").await.0, 400);
    let smuggled = format!(
        "POST http://127.0.0.1:{allowed}/ HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET http://127.0.0.1:{other}/ HTTP/1.1\r\nHost: y\r\n\r\n"
    );
    // Transfer-Encoding wins (RFC 9112 §6.1): the upstream gets one framing, and the
    // connection is closed after the answer, so what followed the chunked body is never
    // read as a request.
    let (status, _, seen, mut stream) = ask(proxy, &smuggled).await;
    assert_eq!(status, 200, "{seen}");
    let seen = seen.to_ascii_lowercase();
    assert!(
        seen.contains("transfer-encoding: chunked") && !seen.contains("content-length"),
        "{seen}"
    );
    let mut rest = Vec::new();
    within("the close", stream.read_to_end(&mut rest)).await.expect("read");
    assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
    let huge = format!(
        "GET http://127.0.0.1:{allowed}/ HTTP/1.1\r\nX-Big: {}\r\n\r\n",
        "a".repeat(70 * 1024)
    );
    let status = ask(proxy, &huge).await.0;
    assert_eq!(status, 431);

    // A revision without the rule closes the open tunnel.
    m1.send(install(1, 2, Vec::new())).await;
    assert_eq!(loaded(&mut m1).await.1, 2);
    let mut rest = Vec::new();
    let closed = within("the revoked tunnel to close", tunnel.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "closed, not reset mid-way: {closed:?}");
    assert_eq!(ask(proxy, &connect(allowed)).await.0, 403);

    shutdown.cancel();
    within("run to end", run).await.expect("join").expect("sidecar");
}

/// An HTTPS upstream on loopback with a certificate for `localhost` from a throwaway CA:
/// (port, the CA's PEM, how many requests it read).
async fn tls_upstream() -> (u16, String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let ca = testkit::pki::Ca::new();
    let leaf = ca.leaf(&["localhost"]);
    let config = rustls::ServerConfig::builder_with_provider(plumbing::tls::provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der.clone().into()],
            rustls::pki_types::PrivateKeyDer::try_from(leaf.key_der.clone()).expect("key"),
        )
        .expect("config");
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let requests = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = requests.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (acceptor, counted) = (acceptor.clone(), counted.clone());
            tokio::spawn(async move {
                let Ok(mut stream) = acceptor.accept(stream).await else {
                    return;
                };
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                while !seen.ends_with(b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    seen.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
                let _ = stream.write_all(&seen).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    (port, ca.pem(), requests)
}

#[tokio::test]
async fn a_credential_goes_only_to_its_bound_destination_over_tls_the_sidecar_verifies() {
    use proto::runtime::v1::CredentialBinding;
    use std::sync::atomic::Ordering;

    let (models, ca_pem, requests) = tls_upstream().await;
    let other = upstream().await;
    let proxy = free_port();
    let mut fx = Fixture::new(agent_command()).await;
    fx.config.egress_listen = Some(([127, 0, 0, 1], proxy).into());
    let (run, shutdown) = fx.start();
    fx.registered().await;
    let mut m1 = fx.member.accept().await;
    let sidecar_message::Kind::Attach(_) = m1.recv().await else {
        panic!("expected Attach")
    };
    m1.take_over(&fx.signer, &fx.instance, 1, "m1", 0).await;
    let policy = |revision: u64, value: &str, ca_bundle: &str| {
        let mut bound = rule("models", "localhost", models);
        bound.credential = "models".into();
        bound.originate_tls = true;
        bound.ca_bundle = ca_bundle.into();
        supervisor_message::Kind::PolicyInstall(PolicyInstall {
            term: 1,
            policy: Some(EgressPolicy {
                name: "team-a-default".into(),
                revision,
                rules: vec![bound, rule("other", "127.0.0.1", other)],
                credentials: vec![CredentialBinding {
                    name: "models".into(),
                    env: "MODELS_API_KEY".into(),
                    secret: "models".into(),
                    key: "token".into(),
                    value: value.as_bytes().to_vec(),
                    error: String::new(),
                }],
                ..EgressPolicy::default()
            }),
        })
    };
    m1.send(policy(1, "sk-live-1", &ca_pem)).await;
    assert_eq!(loaded(&mut m1).await, ("team-a-default".into(), 1, String::new()));

    // The bound destination: the placeholder is replaced, over TLS the sidecar opened.
    let placeholder = proto::egress::placeholder("models");
    let to = |port: u16, host: &str| {
        format!(
            "GET http://{host}:{port}/v1/chat HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {placeholder}\r\n\r\n"
        )
    };
    let (status, _, seen, _) = ask(proxy, &to(models, "localhost")).await;
    assert_eq!(status, 200, "{seen}");
    assert!(seen.starts_with("GET /v1/chat HTTP/1.1\r\n"), "{seen}");
    assert!(
        seen.to_ascii_lowercase()
            .contains("authorization: bearer sk-live-1\r\n"),
        "{seen}"
    );
    // Anywhere else the placeholder goes out as it is.
    let (status, _, seen, _) = ask(proxy, &to(other, "127.0.0.1")).await;
    assert_eq!(status, 200, "{seen}");
    assert!(seen.contains(&placeholder) && !seen.contains("sk-live"), "{seen}");
    // A tunnel would hide the request: refused, and the refusal says what to send instead.
    let connect = format!("CONNECT localhost:{models} HTTP/1.1\r\nHost: localhost:{models}\r\n\r\n");
    let (status, _, body, _) = ask(proxy, &connect).await;
    assert_eq!(status, 403);
    assert!(body.contains("http://localhost"), "{body}");

    // The workload learns the placeholder and whether the credential is held, never the value.
    let mut agent = WorkloadClient::connect(&fx.agent_socket()).await;
    let view = agent.call(json!({"op": "policy"})).await;
    let credential = &view["policy"]["credentials"][0];
    assert_eq!(
        (
            credential["placeholder"].as_str(),
            credential["held"].as_bool(),
            credential["env"].as_str()
        ),
        (Some(placeholder.as_str()), Some(true), Some("MODELS_API_KEY")),
        "{view}"
    );
    assert_eq!(credential["boundTo"], json!(["models"]));
    assert!(!view.to_string().contains("sk-live"), "{view}");

    // A rotated value under the same revision replaces the one held.
    m1.send(policy(1, "sk-live-2", &ca_pem)).await;
    loaded(&mut m1).await;
    let (_, _, seen, _) = ask(proxy, &to(models, "localhost")).await;
    assert!(
        seen.to_ascii_lowercase()
            .contains("authorization: bearer sk-live-2\r\n"),
        "{seen}"
    );

    // An upstream whose certificate does not verify (the CA is no longer trusted) gets nothing.
    m1.send(policy(2, "sk-live-2", "")).await;
    assert_eq!(loaded(&mut m1).await.1, 2);
    let before = requests.load(Ordering::SeqCst);
    let (status, _, body, _) = ask(proxy, &to(models, "localhost")).await;
    assert_eq!(status, 502, "{body}");
    assert!(json(&body)["error"] == "upstream TLS failed", "{body}");
    assert_eq!(requests.load(Ordering::SeqCst), before, "nothing reached the upstream");

    // A value the owner could not resolve: the request is not sent at all.
    m1.send(policy(3, "", &ca_pem)).await;
    assert_eq!(loaded(&mut m1).await.1, 3);
    let (status, _, body, _) = ask(proxy, &to(models, "localhost")).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(requests.load(Ordering::SeqCst), before, "nothing reached the upstream");

    shutdown.cancel();
    within("the sidecar to stop", run)
        .await
        .expect("joined")
        .expect("clean stop");
}
