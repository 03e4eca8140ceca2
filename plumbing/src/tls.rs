//! TLS on every gRPC and webhook port: serving certificates from files that are reloaded when
//! they change (the accept loop that uses them is [`crate::listener`]), and client endpoints
//! that trust a given CA.
//!
//! [`CertStore`] is the rustls [`ResolvesServerCert`]: every handshake gets the current
//! `Arc<CertifiedKey>`. [`CertStore::reload`] re-reads both files by path (so a Kubernetes
//! Secret volume that swaps its `..data` symlink is followed: the path resolves to the new
//! files) and swaps the key in only when the contents changed **and** parse into a matching
//! certificate/key pair; a half-written update (new certificate, old key) is ignored until
//! the pair is consistent. [`CertStore::watch`] polls at a fixed interval, which is robust
//! against every way of updating files (in-place writes, renames, symlink swaps) and costs
//! two small reads per interval.

use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::io::AsyncReadExt as _;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

/// How often served certificate files are re-read.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(10);
/// File name of the CA bundle delivered beside a token (`ca.crt`, as in Kubernetes TLS Secrets).
pub const CA_FILE: &str = "ca.crt";
/// Bound on a CA bundle file.
pub const MAX_CA_BYTES: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} is larger than {max} bytes")]
    TooLarge { path: PathBuf, max: usize },
    #[error("no PEM certificate in {0}")]
    NoCertificate(PathBuf),
    #[error("invalid PEM certificate in {path}: {source}")]
    BadCertificate {
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("no usable PEM private key in {path}: {source}")]
    BadKey {
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("certificate {cert} and key {key} do not form a usable pair: {source}")]
    Pair {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    #[error("invalid endpoint {url}: {reason}")]
    Endpoint { url: String, reason: String },
    #[error("{url} is https but no CA bundle to verify it is configured")]
    NoCa { url: String },
}

/// The crypto provider used everywhere (ring).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The current serving certificate, loaded from `cert_path` and `key_path`.
pub struct CertStore {
    cert_path: PathBuf,
    key_path: PathBuf,
    provider: Arc<CryptoProvider>,
    current: RwLock<Option<Arc<CertifiedKey>>>,
    /// Contents of the files behind `current`.
    seen: Mutex<Option<(Vec<u8>, Vec<u8>)>>,
    last_error: Mutex<Option<String>>,
    loaded: AtomicBool,
}

impl fmt::Debug for CertStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertStore")
            .field("cert_path", &self.cert_path)
            .field("key_path", &self.key_path)
            .field("loaded", &self.is_loaded())
            .finish()
    }
}

/// What a reload did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reload {
    /// The files are unchanged since the last successful load.
    Unchanged,
    /// A new certificate is being served.
    Loaded,
}

/// What [`CertStore::reload_logged`] saw, for callers that count it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logged {
    Unchanged,
    Loaded,
    /// A new failure (logged once).
    Failed,
    /// The same failure as last time (not logged again).
    StillFailing,
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

impl CertStore {
    pub fn new(cert_path: PathBuf, key_path: PathBuf) -> Self {
        Self {
            cert_path,
            key_path,
            provider: provider(),
            current: RwLock::new(None),
            seen: Mutex::new(None),
            last_error: Mutex::new(None),
            loaded: AtomicBool::new(false),
        }
    }

    /// Has a certificate been loaded (ever)?
    pub fn is_loaded(&self) -> bool {
        self.loaded.load(Ordering::Acquire)
    }

    /// The certificate currently served.
    pub fn current(&self) -> Option<Arc<CertifiedKey>> {
        self.current.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn parse(&self, cert_pem: &[u8], key_pem: &[u8]) -> Result<CertifiedKey, TlsError> {
        let chain = CertificateDer::pem_slice_iter(cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| TlsError::BadCertificate {
                path: self.cert_path.clone(),
                source,
            })?;
        if chain.is_empty() {
            return Err(TlsError::NoCertificate(self.cert_path.clone()));
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|source| TlsError::BadKey {
            path: self.key_path.clone(),
            source,
        })?;
        CertifiedKey::from_der(chain, key, &self.provider).map_err(|source| TlsError::Pair {
            cert: self.cert_path.clone(),
            key: self.key_path.clone(),
            source,
        })
    }

    /// Re-read the files (blocking); serve them if they changed and form a valid pair.
    pub fn reload(&self) -> Result<Reload, TlsError> {
        let cert_pem = read(&self.cert_path)?;
        let key_pem = read(&self.key_path)?;
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        if seen.as_ref().is_some_and(|(c, k)| *c == cert_pem && *k == key_pem) {
            return Ok(Reload::Unchanged);
        }
        let certified = self.parse(&cert_pem, &key_pem)?;
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(certified));
        *seen = Some((cert_pem, key_pem));
        self.loaded.store(true, Ordering::Release);
        Ok(Reload::Loaded)
    }

    /// Reload once and log the result (a failure once, not at every poll, until something
    /// changes).
    pub fn reload_logged(&self) -> Logged {
        match self.reload() {
            Ok(Reload::Unchanged) => Logged::Unchanged,
            Ok(Reload::Loaded) => {
                self.set_last_error(None);
                tracing::info!(cert = %self.cert_path.display(), key = %self.key_path.display(),
                               "serving certificate loaded");
                Logged::Loaded
            }
            Err(err) => {
                if !self.set_last_error(Some(err.to_string())) {
                    return Logged::StillFailing;
                }
                if self.is_loaded() {
                    tracing::warn!(error = %err, "certificate files changed but cannot be loaded; still serving the previous certificate");
                } else {
                    tracing::warn!(error = %err, "no serving certificate yet; not ready");
                }
                Logged::Failed
            }
        }
    }

    /// Record the last error; true if it differs from the previous one.
    fn set_last_error(&self, error: Option<String>) -> bool {
        let mut last = self.last_error.lock().unwrap_or_else(PoisonError::into_inner);
        let changed = *last != error;
        *last = error;
        changed
    }

    /// Reload off the async workers (file reads block).
    pub async fn reload_in_background(self: &Arc<Self>) -> Logged {
        let store = Arc::clone(self);
        match tokio::task::spawn_blocking(move || store.reload_logged()).await {
            Ok(logged) => logged,
            Err(err) => {
                tracing::error!(error = %err, "certificate reload task failed");
                Logged::StillFailing
            }
        }
    }

    /// A store for `cert_path`/`key_path`, loaded once now (a failure is logged and leaves it
    /// not loaded, e.g. while a Secret is still being issued) and then re-read every
    /// [`RELOAD_INTERVAL`] until `stop` completes.
    pub async fn load_and_watch(
        cert_path: PathBuf,
        key_path: PathBuf,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> Arc<Self> {
        let store = Arc::new(Self::new(cert_path, key_path));
        store.reload_in_background().await;
        tokio::spawn(Arc::clone(&store).watch(RELOAD_INTERVAL, |_| {}, stop));
        store
    }

    /// Poll the files every `interval` until `stop` completes; `on_reload` sees every result.
    pub async fn watch(
        self: Arc<Self>,
        interval: Duration,
        on_reload: impl Fn(Logged) + Send,
        stop: impl Future<Output = ()> + Send,
    ) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stop = std::pin::pin!(stop);
        loop {
            tokio::select! {
                _ = ticker.tick() => on_reload(self.reload_in_background().await),
                () = &mut stop => return,
            }
        }
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current()
    }
}

/// A rustls server configuration serving whatever `store` holds, offering `alpn`.
pub fn server_config(store: Arc<CertStore>, alpn: &[&[u8]]) -> Result<rustls::ServerConfig, TlsError> {
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(store);
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// A client endpoint for `url`: `https://` verifies the server against the PEM CA bundle
/// `ca` (required), `http://` is plaintext (loopback and tests only). With `server_name`
/// the server certificate must name that DNS name instead of the URL's host (a member
/// dialed by its Pod IP presents the certificate of its Service).
pub async fn endpoint(url: &str, ca: Option<&Path>, server_name: Option<&str>) -> Result<Endpoint, TlsError> {
    let invalid = |reason: String| TlsError::Endpoint {
        url: url.to_owned(),
        reason,
    };
    let endpoint = Endpoint::from_shared(url.to_owned()).map_err(|err| invalid(err.to_string()))?;
    if !url.starts_with("https://") {
        return Ok(endpoint);
    }
    let ca = ca.ok_or_else(|| TlsError::NoCa { url: url.to_owned() })?;
    let pem = read_ca(ca).await?;
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem));
    if let Some(name) = server_name {
        check_server_name(name).map_err(invalid)?;
        tls = tls.domain_name(name);
    }
    endpoint.tls_config(tls).map_err(|err| invalid(err.to_string()))
}

/// Checks that `name` can be verified against a server certificate (a DNS name or an IP
/// address); the error says why not.
pub fn check_server_name(name: &str) -> Result<(), String> {
    match ServerName::try_from(name) {
        Ok(_) => Ok(()),
        Err(_) => Err(format!(
            "{name:?} is not a valid TLS server name (a DNS name or an IP address)"
        )),
    }
}

/// How a client verifies the servers it dials: the CA bundle file (read again at every
/// connect, so a rotated CA is picked up) and, optionally, the name the server certificates
/// must carry instead of the dialed host.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientTls {
    pub ca: Option<PathBuf>,
    pub server_name: Option<String>,
    /// Under egress redirection, connections are opened by the Pod's dialer.
    pub dialer: Option<crate::dialer::Dialer>,
}

/// Why [`ClientTls::connect`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("cannot connect to {url}: {reason}")]
    Transport { url: String, reason: String },
    #[error("no connection to {url} within {limit:?}")]
    Timeout { url: String, limit: Duration },
}

impl ClientTls {
    /// [`endpoint`] with this trust.
    pub async fn endpoint(&self, url: &str) -> Result<Endpoint, TlsError> {
        endpoint(url, self.ca.as_deref(), self.server_name.as_deref()).await
    }

    /// Connects to `url` (CA read, TCP connect, TLS handshake) within `limit`.
    pub async fn connect(&self, url: &str, limit: Duration) -> Result<Channel, ConnectError> {
        let attempt = async {
            let endpoint = self.endpoint(url).await?.connect_timeout(limit);
            let connected = match &self.dialer {
                Some(dialer) => endpoint.connect_with_connector(dialer.connector(limit)).await,
                None => endpoint.connect().await,
            };
            connected.map_err(|err| ConnectError::Transport {
                url: url.to_owned(),
                reason: error_chain(&err),
            })
        };
        tokio::time::timeout(limit, attempt)
            .await
            .map_err(|_| ConnectError::Timeout {
                url: url.to_owned(),
                limit,
            })?
    }
}

/// An error and its sources, `: `-separated (tonic's transport error alone says only
/// "transport error"; the reason, such as an unknown certificate issuer, is in its sources).
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Read a PEM CA bundle (bounded to [`MAX_CA_BYTES`], must hold a certificate).
pub async fn read_ca(path: &Path) -> Result<Vec<u8>, TlsError> {
    let error = |source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    };
    // Read at most one byte past the bound, so a file swapped for a larger one is refused too.
    let file = tokio::fs::File::open(path).await.map_err(error)?;
    let mut pem = Vec::new();
    let limit = u64::try_from(MAX_CA_BYTES).unwrap_or(u64::MAX).saturating_add(1);
    file.take(limit).read_to_end(&mut pem).await.map_err(error)?;
    if pem.len() > MAX_CA_BYTES {
        return Err(TlsError::TooLarge {
            path: path.to_path_buf(),
            max: MAX_CA_BYTES,
        });
    }
    if CertificateDer::pem_slice_iter(&pem).next().is_none() {
        return Err(TlsError::NoCertificate(path.to_path_buf()));
    }
    Ok(pem)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[tokio::test]
    async fn http_endpoints_stay_plaintext_and_need_no_ca() {
        let plain = endpoint("http://127.0.0.1:50051", None, Some("ignored.example"))
            .await
            .unwrap();
        assert_eq!(plain.uri().to_string(), "http://127.0.0.1:50051/");
        // The CA is not even read for plaintext.
        let missing = Path::new("/nonexistent/ca.crt");
        assert!(endpoint("http://gw:1", Some(missing), None).await.is_ok());
        let err = endpoint("not a url", None, None).await.unwrap_err();
        assert!(matches!(err, TlsError::Endpoint { .. }), "{err}");
    }

    #[tokio::test]
    async fn https_needs_a_readable_pem_ca_of_bounded_size() {
        let url = "https://gateway.example:50051";
        let err = endpoint(url, None, None).await.unwrap_err();
        assert!(matches!(err, TlsError::NoCa { .. }), "{err}");
        assert!(err.to_string().contains(url), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.crt");
        let err = endpoint(url, Some(&missing), None).await.unwrap_err();
        assert!(
            matches!(err, TlsError::Read { .. }) && err.to_string().contains("missing.crt"),
            "{err}"
        );

        let not_pem = dir.path().join("not-pem.crt");
        std::fs::write(&not_pem, "just some text, no certificate\n").unwrap();
        let err = endpoint(url, Some(&not_pem), None).await.unwrap_err();
        assert!(matches!(err, TlsError::NoCertificate(ref p) if *p == not_pem), "{err}");

        let huge = dir.path().join("huge.crt");
        std::fs::write(&huge, vec![b'a'; MAX_CA_BYTES + 1]).unwrap();
        let err = endpoint(url, Some(&huge), None).await.unwrap_err();
        assert!(matches!(err, TlsError::TooLarge { max: MAX_CA_BYTES, .. }), "{err}");
    }

    #[tokio::test]
    async fn an_invalid_server_name_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.crt");
        // Not a real certificate, but PEM-framed: read_ca only checks the framing.
        std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").unwrap();
        let err = endpoint("https://10.0.0.1:1", Some(&ca), Some("not a name"))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("not a valid TLS server name"), "{err}");
        assert!(check_server_name("openshell-supervisor.team-a.svc").is_ok());
        assert!(check_server_name("10.1.2.3").is_ok());
        assert!(check_server_name("").is_err());
    }

    #[tokio::test]
    async fn connect_errors_name_the_url() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        let err = ClientTls::default()
            .connect(&url, Duration::from_secs(2))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains(&url) && err.contains("refused"), "{err}");
    }
}
