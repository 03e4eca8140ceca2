//! The serving certificate: [`plumbing::tls::CertStore`] (files reloaded when they change,
//! including a Secret volume's `..data` swap), counted in this crate's metrics.

use std::sync::Arc;

pub use plumbing::tls::{CertStore, Logged, Reload, TlsError, provider};

use crate::metrics::{Metrics, ResultLabels};

/// A rustls server configuration serving whatever `store` holds, with ALPN h2 and http/1.1.
pub fn server_config(store: Arc<CertStore>) -> Result<rustls::ServerConfig, TlsError> {
    plumbing::tls::server_config(store, &[b"h2", b"http/1.1"])
}

/// Count one reload in the metrics (a repeated failure is counted once).
pub fn record(metrics: &Metrics, logged: Logged) {
    let result = match logged {
        Logged::Unchanged | Logged::StillFailing => return,
        Logged::Loaded => {
            metrics.cert_loaded.set(1);
            "loaded"
        }
        Logged::Failed => "error",
    };
    metrics.cert_reloads.get_or_create(&ResultLabels { result }).inc();
}
