//! Shared test helpers: fixtures, certificates, a TLS HTTP client.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use serde_json::Value;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::TlsConnector;
use webhook::config::Config;
use webhook::metrics::Metrics;
use webhook::server::{AppState, Listeners, ShutdownTrigger, run_with_state, shutdown_channel};
use webhook::tls::CertStore;

/// The captured AdmissionReview fixtures (never edited).
pub fn fixtures_dir() -> PathBuf {
    match std::env::var_os("OPENSHELL_FIXTURES_DIR") {
        Some(dir) => PathBuf::from(dir).join("admission"),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/fixtures/admission"),
    }
}

pub const POD_FIXTURES: [&str; 6] = [
    "pod-create-plain.json",
    "pod-create-with-volumes.json",
    "pod-create-no-volumes-automount-false.json",
    "pod-create-from-deployment.json",
    "pod-create-dry-run.json",
    "pod-create-kubectl-run.json",
];

pub fn fixture_bytes(name: &str) -> Vec<u8> {
    let path = fixtures_dir().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("reading fixture {}: {e}", path.display()))
}

pub fn fixture(name: &str) -> Value {
    serde_json::from_slice(&fixture_bytes(name)).unwrap()
}

/// A self-signed certificate for `localhost`; returns (cert PEM, key PEM, cert DER).
pub fn self_signed(cn_hint: &str) -> (String, String, Vec<u8>) {
    let leaf = testkit::pki::Ca::new().leaf(&["localhost", cn_hint]);
    (leaf.cert, leaf.key, leaf.der)
}

/// Accepts any server certificate: the tests compare the served certificate themselves.
#[derive(Debug)]
struct AcceptAny(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AcceptAny {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

pub fn tls_connector() -> TlsConnector {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAny(provider)))
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    TlsConnector::from(Arc::new(config))
}

/// Handshake with `addr` and return the certificate it served.
pub async fn served_cert(addr: std::net::SocketAddr) -> Result<Vec<u8>, String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let tls = tls_connector()
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (_, session) = tls.get_ref();
    session
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .ok_or_else(|| "no certificate".to_string())
}

/// An HTTP/1.1 keep-alive connection over TLS.
pub struct TlsClient {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
}

impl TlsClient {
    pub async fn connect(addr: std::net::SocketAddr) -> Result<Self, String> {
        let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        tcp.set_nodelay(true).map_err(|e| e.to_string())?;
        let tls = tls_connector()
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .map_err(|e| e.to_string())?;
        let (sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Self { sender })
    }

    /// POST `body` to `path`; returns (status, body).
    pub async fn post(&mut self, path: &str, body: Vec<u8>) -> Result<(u16, Vec<u8>), String> {
        self.sender.ready().await.map_err(|e| e.to_string())?;
        let request = hyper::Request::post(path)
            .header("host", "localhost")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let response = self.sender.send_request(request).await.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, body.to_vec()))
    }
}

/// Plain HTTP GET (health port); returns (status, body).
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> Result<(u16, String), String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake::<_, Full<Bytes>>(hyper_util::rt::TokioIo::new(tcp))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let request = hyper::Request::get(path)
        .header("host", "localhost")
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let response = sender.send_request(request).await.map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

#[allow(unused_imports)]
pub use testkit::wait::until as wait_until;

/// A webhook server on loopback ports (HTTPS and health).
pub struct Running {
    pub webhook: std::net::SocketAddr,
    pub health: std::net::SocketAddr,
    pub trigger: ShutdownTrigger,
    pub handle: JoinHandle<Result<(), webhook::server::ServerError>>,
}

/// Start the server with the certificate at `cert`/`key` (50 ms reloads, no shutdown delay),
/// `tweak` changing the configuration first.
pub async fn start(cert: PathBuf, key: PathBuf, tweak: impl FnOnce(&mut Config)) -> Running {
    let mut config = Config::with_cert_paths(cert, key).unwrap();
    config.cert_reload_ms = 50;
    config.shutdown_delay_ms = 0;
    tweak(&mut config);
    let listeners = Listeners {
        webhook: TcpListener::bind("127.0.0.1:0").await.unwrap(),
        health: TcpListener::bind("127.0.0.1:0").await.unwrap(),
    };
    let webhook = listeners.webhook.local_addr().unwrap();
    let health = listeners.health.local_addr().unwrap();
    let store = Arc::new(CertStore::new(config.tls_cert.clone(), config.tls_key.clone()));
    let state = Arc::new(AppState::new(&config, Arc::new(Metrics::new()), store));
    let (trigger, signal) = shutdown_channel();
    let handle = tokio::spawn(run_with_state(listeners, config, state, signal));
    Running {
        webhook,
        health,
        trigger,
        handle,
    }
}

/// The value of the first `/metrics` line starting with `line_prefix`.
pub async fn metric(health: std::net::SocketAddr, line_prefix: &str) -> Option<f64> {
    let (_, body) = http_get(health, "/metrics").await.ok()?;
    body.lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}
