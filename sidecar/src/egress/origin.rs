//! TLS the sidecar opens itself towards a rule's upstream (`originateTls`): the workload
//! sends plain `http://` to the proxy so that the sidecar sees the request and can put a
//! credential in; the upstream is reached over TLS verified against the public roots (the
//! Mozilla set, `webpki-roots`) and the rule's own CA bundle, with the rule's host as the
//! server name. A certificate that does not verify ends the request with 502: nothing of the
//! request (and so no credential) is sent.

use std::sync::{Arc, LazyLock};

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use super::policy::Target;

static PUBLIC: LazyLock<RootCertStore> = LazyLock::new(|| RootCertStore {
    roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
});

/// The public roots and the certificates of `ca_bundle` (PEM; empty: none), or why the bundle
/// does not read.
pub fn roots(ca_bundle: &str) -> Result<RootCertStore, String> {
    let mut roots = PUBLIC.clone();
    for certificate in CertificateDer::pem_slice_iter(ca_bundle.as_bytes()) {
        let certificate = certificate.map_err(|err| format!("the CA bundle does not read: {err}"))?;
        roots
            .add(certificate)
            .map_err(|err| format!("the CA bundle holds a certificate that is no CA: {err}"))?;
    }
    Ok(roots)
}

/// TLS over `upstream` to `host`, verified against [`roots`] of `ca_bundle`.
pub async fn connect(upstream: TcpStream, host: &Target, ca_bundle: &str) -> Result<TlsStream<TcpStream>, String> {
    let roots = roots(ca_bundle)?;
    let mut config = rustls::ClientConfig::builder_with_provider(plumbing::tls::provider())
        .with_safe_default_protocol_versions()
        .map_err(|err| err.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let name = match host {
        Target::Name(name) => ServerName::try_from(name.clone()).map_err(|err| err.to_string())?,
        Target::Address(address) => ServerName::IpAddress((*address).into()),
    };
    TlsConnector::from(Arc::new(config))
        .connect(name, upstream)
        .await
        .map_err(|err| format!("TLS to {host} failed: {err}"))
}
