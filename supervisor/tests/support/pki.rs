//! Throwaway certificates ([`testkit::pki`]) as the supervisor's tests use them: a CA file and
//! server certificates it signs, as files, or as a rustls server configuration.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use plumbing::tls::CertStore;
use testkit::pki::Ca;

/// A CA whose certificate is `<name>-ca.crt` in `dir`.
pub struct Pki {
    dir: PathBuf,
    pub ca: PathBuf,
    issuer: Ca,
}

impl Pki {
    pub fn new(dir: &Path, name: &str) -> Self {
        let issuer = Ca::new();
        let ca = issuer.write(dir.join(format!("{name}-ca.crt")));
        Self {
            dir: dir.to_path_buf(),
            ca,
            issuer,
        }
    }

    /// A server certificate for `names` (DNS names or IP addresses): (certificate, key) files.
    pub fn issue(&self, file: &str, names: &[&str]) -> (PathBuf, PathBuf) {
        self.issuer.leaf(names).write(&self.dir, file)
    }

    /// A rustls server configuration serving a certificate for `names`.
    pub fn server_config(&self, file: &str, names: &[&str]) -> rustls::ServerConfig {
        let (cert, key) = self.issue(file, names);
        let store = Arc::new(CertStore::new(cert, key));
        store.reload().unwrap();
        plumbing::tls::server_config(store, &[b"h2"]).unwrap()
    }
}
