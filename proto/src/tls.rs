//! TLS on every gRPC and webhook port: serving certificates from files that are reloaded when
//! they change, a listener that does TLS handshakes off the accept loop, and client endpoints
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
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

/// Bound on one server-side TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often served certificate files are re-read.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(10);
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

/// TLS connections accepted on `listener`, for `tonic`'s `serve_with_incoming`. Handshakes
/// run in their own tasks (bounded by [`HANDSHAKE_TIMEOUT`]), so a slow or silent client
/// cannot hold up the others; failed handshakes are logged at debug level and dropped.
pub fn incoming(
    listener: TcpListener,
    config: rustls::ServerConfig,
) -> ReceiverStream<std::io::Result<TlsStream<TcpStream>>> {
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                () = tx.closed() => return,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(err) => {
                        // Out of file descriptors and the like: back off a little, keep serving.
                        tracing::warn!(error = %err, "cannot accept a connection");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = tcp.set_nodelay(true);
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(err)) => tracing::debug!(%peer, error = %err, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// A client endpoint for `url`: `https://` verifies the server against the PEM CA bundle
/// `ca` (required), `http://` is plaintext (loopback and tests only).
pub async fn endpoint(url: &str, ca: Option<&Path>) -> Result<Endpoint, TlsError> {
    let endpoint = Endpoint::from_shared(url.to_owned()).map_err(|err| TlsError::Endpoint {
        url: url.to_owned(),
        reason: err.to_string(),
    })?;
    if !url.starts_with("https://") {
        return Ok(endpoint);
    }
    let ca = ca.ok_or_else(|| TlsError::NoCa { url: url.to_owned() })?;
    let pem = read_ca(ca).await?;
    endpoint
        .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)))
        .map_err(|err| TlsError::Endpoint {
            url: url.to_owned(),
            reason: err.to_string(),
        })
}

async fn read_ca(path: &Path) -> Result<Vec<u8>, TlsError> {
    let error = |source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    };
    let len = tokio::fs::metadata(path).await.map_err(error)?.len();
    if usize::try_from(len).map_or(true, |len| len > MAX_CA_BYTES) {
        return Err(TlsError::TooLarge {
            path: path.to_path_buf(),
            max: MAX_CA_BYTES,
        });
    }
    let pem = tokio::fs::read(path).await.map_err(error)?;
    if CertificateDer::pem_slice_iter(&pem).next().is_none() {
        return Err(TlsError::NoCertificate(path.to_path_buf()));
    }
    Ok(pem)
}
