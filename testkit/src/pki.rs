//! Throwaway certificates: a [`Ca`] and the [`Leaf`] certificates it signs for DNS names or IP
//! addresses, as PEM (and DER) in memory or as files.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

/// A certificate authority that exists for one test.
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate the [`Ca`] signed, with its private key.
pub struct Leaf {
    /// The certificate, PEM.
    pub cert: String,
    /// The certificate, DER.
    pub der: Vec<u8>,
    /// The private key, PEM (PKCS#8).
    pub key: String,
    /// The private key, DER (PKCS#8).
    pub key_der: Vec<u8>,
}

impl Ca {
    pub fn new() -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().expect("CA key");
        Self {
            issuer: CertifiedIssuer::self_signed(params, key).expect("self-signed CA"),
        }
    }

    /// The CA's certificate, PEM.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// Writes the CA's certificate to `path`, which it returns.
    pub fn write(&self, path: PathBuf) -> PathBuf {
        std::fs::write(&path, self.pem()).expect("write the CA certificate");
        path
    }

    /// A certificate for `names` (DNS names or IP addresses), signed by this CA.
    pub fn leaf(&self, names: &[&str]) -> Leaf {
        let key = KeyPair::generate().expect("leaf key");
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let cert = CertificateParams::new(names)
            .expect("leaf parameters")
            .signed_by(&key, &self.issuer)
            .expect("signed leaf");
        Leaf {
            cert: cert.pem(),
            der: cert.der().to_vec(),
            key: key.serialize_pem(),
            key_der: key.serialize_der(),
        }
    }
}

impl Default for Ca {
    fn default() -> Self {
        Self::new()
    }
}

impl Leaf {
    /// Writes the certificate and key as `<dir>/<name>.crt` and `<dir>/<name>.key`.
    pub fn write(&self, dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let files = (dir.join(format!("{name}.crt")), dir.join(format!("{name}.key")));
        std::fs::write(&files.0, &self.cert).expect("write the certificate");
        std::fs::write(&files.1, &self.key).expect("write the key");
        files
    }
}
