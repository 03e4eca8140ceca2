//! Handing tokens (when the target gets one) and the trust bundle to members, sidecars and the
//! operator. Local
//! mode writes files the members re-read before every (re)connect ([`FileDelivery`]); the
//! Kubernetes Secret delivery will implement the same [`Delivery`] trait.

use std::fmt;
use std::fs::{self, DirBuilder, Permissions};
use std::future::Future;
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use plumbing::tls::CA_FILE;
use proto::trust::{TOKEN_FILE, TRUST_BUNDLE_FILE, TrustBundle};

use super::Error;
use super::keyring::Minted;

/// What one delivery hands over. `Debug` does not show the token.
#[derive(Clone, PartialEq, Eq)]
pub struct Delivered {
    /// None for trust-only deliveries (Kubernetes: the Pods bring their own tokens).
    pub token: Option<String>,
    pub expires_at_ms: i64,
    /// The trust bundle as JWKS JSON.
    pub trust_jwks: String,
    /// PEM CA bundle that verifies the pool's TLS certificates (`ca.crt`), when configured.
    pub ca_pem: Option<String>,
}

impl Delivered {
    pub fn new(token: Option<&Minted>, bundle: &TrustBundle) -> Self {
        Self {
            token: token.map(|t| t.token.clone()),
            expires_at_ms: token.map_or(0, |t| t.expires_at_ms),
            trust_jwks: bundle.to_jwks(),
            ca_pem: None,
        }
    }

    pub fn with_ca(self, ca_pem: Option<String>) -> Self {
        Self { ca_pem, ..self }
    }
}

impl fmt::Debug for Delivered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivered")
            .field("token", &"<redacted>")
            .field("expires_at_ms", &self.expires_at_ms)
            .field("trust_jwks_bytes", &self.trust_jwks.len())
            .field("ca_bytes", &self.ca_pem.as_ref().map(String::len))
            .finish()
    }
}

/// Where tokens go. Deliver again on every renewal and every change of the bundle.
pub trait Delivery {
    fn deliver(&self, delivered: &Delivered) -> impl Future<Output = Result<(), Error>> + Send;
}

/// Local mode: `<dir>/token` (mode 0600) and `<dir>/trust.jwks` (0644) in `<dir>` (created
/// or tightened to 0700), each replaced
/// atomically (a temporary file in the same directory, synced, then renamed over the old
/// one), the bundle first so a new token's key is published before the token appears.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileDelivery {
    dir: PathBuf,
}

impl FileDelivery {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn token_path(&self) -> PathBuf {
        self.dir.join(TOKEN_FILE)
    }

    pub fn bundle_path(&self) -> PathBuf {
        self.dir.join(TRUST_BUNDLE_FILE)
    }
}

impl Delivery for FileDelivery {
    async fn deliver(&self, delivered: &Delivered) -> Result<(), Error> {
        let dir = self.dir.clone();
        let delivered = delivered.clone();
        tokio::task::spawn_blocking(move || {
            DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
                .and_then(|()| fs::set_permissions(&dir, Permissions::from_mode(0o700)))
                .map_err(|source| write_error(&dir, source))?;
            write_atomic(&dir, TRUST_BUNDLE_FILE, delivered.trust_jwks.as_bytes(), 0o644)?;
            if let Some(ca) = &delivered.ca_pem {
                write_atomic(&dir, CA_FILE, ca.as_bytes(), 0o644)?;
            }
            match &delivered.token {
                Some(token) => write_atomic(&dir, TOKEN_FILE, token.as_bytes(), 0o600),
                None => Ok(()),
            }
        })
        .await
        .map_err(|e| write_error(&self.dir, io::Error::other(e)))?
    }
}

/// Replace `dir/name` with `bytes` atomically and durably, the file having `mode`.
fn write_atomic(dir: &Path, name: &str, bytes: &[u8], mode: u32) -> Result<(), Error> {
    plumbing::file::write_atomic(dir, name, bytes, mode).map_err(|source| write_error(&dir.join(name), source))
}

fn write_error(path: &Path, source: io::Error) -> Error {
    Error::Write {
        path: path.display().to_string(),
        source,
    }
}
