//! Supervisor pool member: attaches to a gateway replica over the `host.v1` stream, hosts one
//! isolated session per owned instance, stops withdrawn instances and releases omitted ones.
//!
//! - [`config`]: settings (clap, environment fallbacks) and the supervisor token file.
//! - `link`: the host stream client (hello, heartbeats, acks, status reports, silence
//!   detection, reconnects, leaving).
//! - `runtime`: the sidecar-facing runtime.v1 service (authentication, routing, redirects,
//!   parked streams).
//! - [`sessions`]: the pure snapshot planner and the per-instance session tasks (takeover,
//!   relay, relinquish, release).
//! - `gateway`: the recovery.v1 client (single-use IssueGrant and Activate, trust bundle).
//! - `member`: [`run`], the entry point the binary and the tests call.

pub mod config;
mod gateway;
mod link;
mod member;
mod runtime;
pub mod sessions;

pub use config::Config;
pub use link::{LEAVE_BOUND, LinkError};
pub use member::{Error, run};
