//! Supervisor pool member: attaches to a gateway replica over the `host.v1` stream, hosts one
//! isolated session per owned instance, stops withdrawn instances and releases omitted ones.
//!
//! - [`config`]: settings (clap, environment fallbacks) and the supervisor token file.
//! - `attachment`: the host stream client (hello, heartbeats, acks, status reports, silence
//!   detection, reconnects, leaving).
//! - `runtime`: the sidecar-facing runtime.v1 service (authentication, routing, redirects,
//!   parked streams).
//! - [`sessions`]: the pure snapshot planner and the per-instance session tasks (takeover,
//!   relay, relinquish, release).
//! - `gateway`: the recovery.v1 client (single-use IssueGrant and Activate, trust bundle).
//! - [`health`]: the plain-HTTP health port (`/healthz`, `/readyz`).
//! - `member`: [`run`], the entry point the binary calls ([`Listeners`] and [`run_on`] for
//!   callers that bind first, such as tests on port 0).

mod attachment;
pub mod config;
mod gateway;
pub mod health;
mod member;
mod policy;
mod runtime;
pub mod sessions;

pub use attachment::{AttachmentError, LEAVE_BOUND};
pub use config::Config;
pub use member::{Error, Listeners, run, run_on};
