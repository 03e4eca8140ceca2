//! The pool's throwaway TLS material: a CA and a `localhost`/`127.0.0.1` certificate, written
//! with private modes.

use super::*;

/// The pool's TLS files in its root directory: a throwaway CA and one server
/// certificate it signed for `localhost` and `127.0.0.1`, served by every
/// gateway and member.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// `ca.crt`: what every client verifies against.
    pub ca: PathBuf,
    /// `tls.crt`, `tls.key` (mode 0600).
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    pub fn generate(dir: &Path) -> Result<Self, Error> {
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
        let key = KeyPair::generate()?;
        let names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
        let cert = CertificateParams::new(names)?.signed_by(&key, &ca)?;
        let files = Self {
            ca: dir.join(plumbing::tls::CA_FILE),
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
        };
        write_file(&files.ca, ca.pem().as_bytes(), 0o644)?;
        write_file(&files.cert, cert.pem().as_bytes(), 0o644)?;
        write_file(&files.key, key.serialize_pem().as_bytes(), 0o600)?;
        Ok(files)
    }
}

/// Creates `path` (it must not exist: the pool's root is fresh) with `mode`.
fn write_file(path: &Path, contents: &[u8], mode: u32) -> Result<(), Error> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(io_error(path))?;
    file.write_all(contents).map_err(io_error(path))
}
