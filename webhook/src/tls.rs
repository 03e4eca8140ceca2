//! Serving certificate from files, reloaded when they change.
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
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::sync::watch;

use crate::metrics::{Metrics, ResultLabels};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
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
}

/// The crypto provider used everywhere in this crate (ring).
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
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
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

    /// Re-read the files; serve them if they changed and form a valid pair.
    pub fn reload(&self) -> Result<Reload, TlsError> {
        let cert_pem = read(&self.cert_path)?;
        let key_pem = read(&self.key_path)?;
        let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if seen.as_ref().is_some_and(|(c, k)| *c == cert_pem && *k == key_pem) {
            return Ok(Reload::Unchanged);
        }
        match self.parse(&cert_pem, &key_pem) {
            Ok(certified) => {
                *self.current.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::new(certified));
                *seen = Some((cert_pem, key_pem));
                self.loaded.store(true, Ordering::Release);
                Ok(Reload::Loaded)
            }
            Err(err) => Err(err),
        }
    }

    /// Reload once and record the result in logs and metrics (a failure is logged and counted
    /// once, not at every poll, until something changes).
    pub fn reload_logged(&self, metrics: &Metrics) {
        match self.reload() {
            Ok(Reload::Unchanged) => {}
            Ok(Reload::Loaded) => {
                self.set_last_error(None);
                metrics
                    .cert_reloads
                    .get_or_create(&ResultLabels { result: "loaded" })
                    .inc();
                metrics.cert_loaded.set(1);
                tracing::info!(
                    cert = %self.cert_path.display(),
                    key = %self.key_path.display(),
                    "serving certificate loaded"
                );
            }
            Err(err) => {
                let message = err.to_string();
                if self.set_last_error(Some(message)) {
                    metrics
                        .cert_reloads
                        .get_or_create(&ResultLabels { result: "error" })
                        .inc();
                    if self.is_loaded() {
                        tracing::warn!(error = %err, "certificate files changed but cannot be loaded; still serving the previous certificate");
                    } else {
                        tracing::warn!(error = %err, "no serving certificate yet; not ready");
                    }
                }
            }
        }
    }

    /// Record the last error; true if it differs from the previous one.
    fn set_last_error(&self, error: Option<String>) -> bool {
        let mut last = self
            .last_error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let changed = *last != error;
        *last = error;
        changed
    }

    /// Poll the files every `interval` until `stop` changes.
    pub async fn watch(self: Arc<Self>, interval: Duration, metrics: Arc<Metrics>, mut stop: watch::Receiver<bool>) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {
                    let store = Arc::clone(&self);
                    let metrics = Arc::clone(&metrics);
                    // File reads are blocking; keep them off the async workers.
                    if let Err(err) = tokio::task::spawn_blocking(move || store.reload_logged(&metrics)).await {
                        tracing::error!(error = %err, "certificate reload task failed");
                    }
                }
                changed = stop.changed() => {
                    if changed.is_err() || *stop.borrow() {
                        return;
                    }
                }
            }
        }
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current()
    }
}

/// A rustls server configuration serving whatever `store` holds, with ALPN h2 and http/1.1.
pub fn server_config(store: Arc<CertStore>) -> Result<rustls::ServerConfig, TlsError> {
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(store);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}
