//! The runtime plumbing every binary of shared supervision shares, so that no binary grows its
//! own copy (in the manner of kubert): the contracts stay in `proto`; this crate holds how a
//! process runs them.
//!
//! | module | what |
//! |---|---|
//! | [`shutdown`] | the two-signal shutdown: drain on the first SIGTERM/SIGINT, force on the second |
//! | [`logging`] | tracing set-up: one `--log-format` option (`text` or `json`), errors in the field `error` |
//! | [`listener`] | the accept loop every listener shares (caps, bounded handshakes, idle time-outs, counters) |
//! | [`tls`] | reloading serving certificates, CA-pinned client endpoints |
//! | [`bundle`] | the trust bundle file, cached and read again when it changes |
//! | [`token`] | the bearer token: one bounded reader, one redacted type, one `authorization` header |
//! | [`dialer`] | under egress redirection, the one process whose connections leave the Pod, and its client |
//! | [`gateway`] | dialing the gateway replicas: endpoint rotation and jittered backoff |
//! | [`cmdline`] | what a command line must not carry (a URL with a password) |
//! | [`validate`] | http(s) addresses, routes, member names |
//! | [`text`] | truncation by bytes on a character boundary |

pub mod build;
pub mod bundle;
pub mod cmdline;
pub mod dialer;
pub mod file;
pub mod gateway;
pub mod listener;
pub mod logging;
pub mod shutdown;
pub mod text;
pub mod tls;
pub mod token;
pub mod validate;
