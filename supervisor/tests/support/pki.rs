//! Throwaway certificates: a CA and server certificates it signs, as PEM files.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use plumbing::tls::CertStore;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

/// A CA whose certificate is `ca.crt` in `dir`.
pub struct Pki {
    dir: PathBuf,
    pub ca: PathBuf,
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    pub fn new(dir: &Path, name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let ca = dir.join(format!("{name}-ca.crt"));
        std::fs::write(&ca, issuer.pem()).unwrap();
        Self {
            dir: dir.to_path_buf(),
            ca,
            issuer,
        }
    }

    /// A server certificate for `names` (DNS names or IP addresses): (certificate, key) files.
    pub fn issue(&self, file: &str, names: &[&str]) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let cert = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &self.issuer)
            .unwrap();
        let (cert_file, key_file) = (
            self.dir.join(format!("{file}.crt")),
            self.dir.join(format!("{file}.key")),
        );
        std::fs::write(&cert_file, cert.pem()).unwrap();
        std::fs::write(&key_file, key.serialize_pem()).unwrap();
        (cert_file, key_file)
    }

    /// A rustls server configuration serving a certificate for `names`.
    pub fn server_config(&self, file: &str, names: &[&str]) -> rustls::ServerConfig {
        let (cert, key) = self.issue(file, names);
        let store = Arc::new(CertStore::new(cert, key));
        store.reload().unwrap();
        plumbing::tls::server_config(store, &[b"h2"]).unwrap()
    }
}
