//! The shared accept loop over real sockets and real TLS, serving a real tonic service: an idle
//! TCP flood from one source does not keep a TLS client from its call, request-less TLS
//! connections are closed after the idle time-out, connections over the cap are closed at
//! accept — and the counters say so. The flood comes from 127.0.0.2, the client from 127.0.0.1
//! (both loopback, different sources).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use plumbing::listener::{ConnectionMetrics, Counters, Limits, Listener, Snapshot};
use plumbing::tls::{CertStore, ClientTls};
use proto::recovery::v1::supervisor_recovery_client::SupervisorRecoveryClient;
use proto::recovery::v1::supervisor_recovery_server::{SupervisorRecovery, SupervisorRecoveryServer};
use proto::recovery::v1::{
    ActivateRequest, ActivateResponse, IssueGrantRequest, IssueGrantResponse, TrustBundleRequest, TrustBundleResponse,
};
use rustls::pki_types::ServerName;
use tokio::io::AsyncReadExt as _;
use tokio::net::{TcpSocket, TcpStream};
use tonic::{Request, Response, Status};

const WAIT: Duration = Duration::from_secs(20);

/// A tonic service with one answering call.
struct Bundle;

#[tonic::async_trait]
impl SupervisorRecovery for Bundle {
    async fn issue_grant(&self, _: Request<IssueGrantRequest>) -> Result<Response<IssueGrantResponse>, Status> {
        Err(Status::unimplemented("test"))
    }
    async fn activate(&self, _: Request<ActivateRequest>) -> Result<Response<ActivateResponse>, Status> {
        Err(Status::unimplemented("test"))
    }
    async fn trust_bundle(&self, _: Request<TrustBundleRequest>) -> Result<Response<TrustBundleResponse>, Status> {
        Ok(Response::new(TrustBundleResponse {
            jwks_json: "{\"keys\":[]}".to_owned(),
            ..TrustBundleResponse::default()
        }))
    }
}

struct Pki {
    _dir: tempfile::TempDir,
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let ca = testkit::pki::Ca::new();
    let (cert, key) = ca.leaf(&["localhost", "127.0.0.1"]).write(dir.path(), "tls");
    Pki {
        ca: ca.write(dir.path().join("ca.crt")),
        cert,
        key,
        _dir: dir,
    }
}

/// Serves [`Bundle`] over TLS with `limits`; returns its address and counters.
async fn serve(pki: &Pki, limits: Limits) -> (SocketAddr, Counters) {
    let store = Arc::new(CertStore::new(pki.cert.clone(), pki.key.clone()));
    store.reload().unwrap();
    let tls = plumbing::tls::server_config(store, &[b"h2"]).unwrap();
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let counters = ConnectionMetrics::default().listener("grpc");
    let listener = Listener::new(tcp, limits, counters.clone()).with_tls(Some(tls));
    let router = plumbing::listener::grpc_server().add_service(SupervisorRecoveryServer::new(Bundle));
    tokio::spawn(plumbing::listener::serve_grpc(router, listener, std::future::pending()));
    (addr, counters)
}

/// One call as the project's clients make it: connect (TCP + TLS) within their 1 s time-out.
async fn call(addr: SocketAddr, ca: &Path) -> Result<String, String> {
    let tls = ClientTls {
        ca: Some(ca.to_path_buf()),
        server_name: Some("localhost".to_owned()),
        dialer: None,
    };
    let channel = tls
        .connect(&format!("https://{addr}"), proto::timing::CONNECT_TIMEOUT)
        .await
        .map_err(|err| err.to_string())?;
    let answer = SupervisorRecoveryClient::new(channel)
        .trust_bundle(TrustBundleRequest {})
        .await
        .map_err(|err| err.to_string())?;
    Ok(answer.into_inner().jwks_json)
}

/// A TCP connection from `source` (a loopback address other than the client's).
async fn connect_from(source: &str, addr: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
    socket.connect(addr).await.unwrap()
}

/// A TLS connection from 127.0.0.2 that completes its handshake and then sends nothing.
async fn request_less(addr: SocketAddr, ca: &Path) -> tokio_rustls::client::TlsStream<TcpStream> {
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(ca).unwrap();
    for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(&pem) {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(plumbing::tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = connect_from("127.0.0.2", addr).await;
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap()
}

async fn wait_for(what: &str, counters: &Counters, check: impl Fn(&Snapshot) -> bool) -> Snapshot {
    let deadline = Instant::now() + WAIT;
    loop {
        let now = counters.snapshot();
        if check(&now) {
            return now;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {now:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Reads until the server closes the connection (bounded by [`WAIT`]).
async fn closed_by_server(stream: &mut (impl tokio::io::AsyncRead + Unpin)) {
    let mut buf = [0u8; 1024];
    let closed = tokio::time::timeout(WAIT, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    });
    closed.await.expect("the server closes the connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_tcp_flood_from_one_source_leaves_a_tls_client_its_call() {
    let pki = pki();
    let limits = Limits {
        max_per_source: 64,
        // Long enough that every flood handshake is still pending when the client is served.
        handshake_timeout: Duration::from_secs(600),
        ..Limits::default()
    };
    let (addr, counters) = serve(&pki, limits).await;
    // More idle connections than the old loop had pending-handshake slots (256).
    let mut flood = Vec::new();
    for _ in 0..400 {
        flood.push(connect_from("127.0.0.2", addr).await);
    }
    let seen = wait_for("every flood connection decided", &counters, |c| {
        c.accepted + c.refused_source_cap >= 400
    })
    .await;
    assert_eq!(seen.refused_source_cap, 400 - 64, "{seen:?}");
    assert_eq!(seen.refused_cap, 0, "{seen:?}");
    assert_eq!(seen.open, 64, "{seen:?}");

    // Served while every accepted flood connection still holds its pending handshake (the old
    // loop served nobody until 256 handshakes had timed out, 5 s later).
    assert_eq!(call(addr, &pki.ca).await.unwrap(), "{\"keys\":[]}");
    let after = counters.snapshot();
    assert_eq!((after.accepted, after.handshake_timed_out), (65, 0), "{after:?}");
    let still_open = flood.iter().filter(|tcp| still_open(tcp)).count();
    assert_eq!(still_open, 64);
}

/// Has the server not closed `tcp` (nothing to read, no end of stream)?
fn still_open(tcp: &TcpStream) -> bool {
    let mut buf = [0u8; 1];
    matches!(tcp.try_read(&mut buf), Err(err) if err.kind() == std::io::ErrorKind::WouldBlock)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_less_tls_connections_are_closed_after_the_idle_timeout() {
    let pki = pki();
    let limits = Limits {
        first_request_timeout: Duration::from_millis(300),
        ..Limits::default()
    };
    let (addr, counters) = serve(&pki, limits).await;
    let mut silent = Vec::new();
    for _ in 0..20 {
        silent.push(request_less(addr, &pki.ca).await);
    }
    for stream in &mut silent {
        closed_by_server(stream).await;
    }
    let seen = wait_for("20 idle closes", &counters, |c| c.idle_closed >= 20 && c.open == 0).await;
    assert_eq!(seen.idle_closed, 20, "{seen:?}");
    assert_eq!(seen.handshake_timed_out, 0, "{seen:?}");
    // A client that does send its request is served.
    assert_eq!(call(addr, &pki.ca).await.unwrap(), "{\"keys\":[]}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_handshake_is_cut_at_the_handshake_timeout() {
    let pki = pki();
    let limits = Limits {
        handshake_timeout: Duration::from_millis(200),
        ..Limits::default()
    };
    let (addr, counters) = serve(&pki, limits).await;
    let mut silent = connect_from("127.0.0.2", addr).await;
    closed_by_server(&mut silent).await;
    let seen = wait_for("the handshake time-out", &counters, |c| c.handshake_timed_out == 1).await;
    assert_eq!(seen.open, 0, "{seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_closed_at_accept_and_counted() {
    let pki = pki();
    let limits = Limits {
        max_connections: 8,
        max_per_source: 8,
        ..Limits::default()
    };
    let (addr, counters) = serve(&pki, limits).await;
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(request_less(addr, &pki.ca).await);
    }
    wait_for("8 open", &counters, |c| c.open == 8).await;
    for _ in 0..5 {
        let mut over = connect_from("127.0.0.3", addr).await;
        closed_by_server(&mut over).await;
    }
    let seen = wait_for("5 refusals", &counters, |c| c.refused_cap == 5).await;
    assert_eq!(
        (seen.open, seen.accepted, seen.refused_source_cap),
        (8, 8, 0),
        "{seen:?}"
    );
    // A full listener refuses the legitimate client too (the cap is the cap) …
    assert!(call(addr, &pki.ca).await.is_err());
    // … until slots are given back.
    drop(held);
    wait_for("slots given back", &counters, |c| c.open == 0).await;
    assert_eq!(call(addr, &pki.ca).await.unwrap(), "{\"keys\":[]}");
}
