//! Supervisor pool member: attaches to a gateway replica over the `host.v1` stream, hosts one
//! isolated session per owned instance, stops withdrawn instances and releases omitted ones.
//!
//! - [`config`]: settings (clap, environment fallbacks) and the supervisor token file.
//! - `link`: the host stream client (hello, heartbeats, acks, status reports, silence
//!   detection, reconnects, leaving).
//! - [`sessions`]: the pure snapshot planner and the per-instance session tasks.
//! - `member`: [`run`], the entry point the binary and the tests call.

pub mod config;
mod link;
mod member;
pub mod sessions;

pub use config::Config;
pub use link::{LEAVE_BOUND, LinkError};
pub use member::{Error, run};
