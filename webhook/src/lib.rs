//! OpenShell shared supervision: the mutating admission webhook.
//!
//! - [`review::mutate`] / [`review::mutate_bytes`]: the pure AdmissionReview → response
//!   function (no I/O), built on [`inject::Injector::mutate_pod`], which computes the JSON
//!   Patch from the raw Pod JSON.
//! - [`server::run`]: the HTTPS `/mutate` endpoint (rustls, certificate reloaded from files by
//!   [`tls::CertStore`]) and the plain-HTTP `/healthz`, `/readyz`, `/metrics` endpoint.
//! - [`config::Config`]: flags and `OPENSHELL_WEBHOOK_*` environment variables.

pub mod config;
pub mod decode;
pub mod inject;
pub mod metrics;
pub mod patch;
pub mod policies;
pub mod review;
pub mod server;
pub mod tls;

pub use config::Config;
pub use inject::{InjectConfig, Injector, SidecarMode};
pub use review::{Outcome, Reviewed, mutate, mutate_bytes};
pub use server::{Listeners, ShutdownPhase, ShutdownSignal, ShutdownTrigger, run, shutdown_channel};
