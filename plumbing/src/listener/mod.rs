//! The accept loop shared by every listener (gateway gRPC, supervisor runtime, webhook HTTPS and
//! the health/metrics ports): connection hygiene against anything that can reach a port.
//!
//! - A **total connection cap** and a **per-source-IP cap** ([`Limits`]): a connection over
//!   either is closed at accept and counted, never queued.
//! - **TLS handshakes in their own tasks**, each bounded by `handshake_timeout` (shorter than
//!   the clients' [`CONNECT_TIMEOUT`](proto::timing::CONNECT_TIMEOUT)): a slow or silent client
//!   never holds up accept or another handshake.
//! - **Idle time-outs** on every connection ([`Conn`]): no byte within `first_request_timeout`
//!   after the handshake, or no traffic either way for `idle_timeout` later, closes it.
//! - Server settings for what runs on a connection ([`grpc_server`], [`serve_http`]): HTTP/2
//!   keep-alive pings, a gRPC request time-out, an HTTP/1 header time-out, graceful drain.
//! - Counters per listener ([`ConnectionMetrics`]) for each binary's `/metrics`.

mod conn;
mod metrics;
mod serve;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;

pub use self::conn::Conn;
pub use self::metrics::{ConnectionMetrics, Counters, OPENMETRICS_CONTENT_TYPE, Snapshot, openmetrics};
pub use self::serve::{
    Drain, HEALTH_DRAIN_BOUND, HttpBody, HttpService, KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT, REQUEST_TIMEOUT,
    grpc_server, serve_grpc, serve_health, serve_http,
};

/// Default total connection cap per listener.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Default bound on a server-side TLS handshake: below the clients' 1 s connect time-out, so a
/// client is never left waiting on a handshake the server has already given up on.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_millis(750);
/// Default time after accept (and handshake) within which a connection must send its first byte.
pub const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Default time without traffic in either direction after which a connection is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default bound on receiving an HTTP/1 request's headers (also how long an HTTP/1 keep-alive
/// connection waits for its next request).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Why limits are unusable.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the connection cap (OPENSHELL_MAX_CONNECTIONS) must be at least 1")]
    NoConnections,
    #[error(
        "the per-source connection cap (OPENSHELL_MAX_CONNECTIONS_PER_SOURCE) {per_source} is above the connection cap {max}"
    )]
    PerSourceAboveCap { per_source: usize, max: usize },
    #[error("the {name} time-out must be above zero")]
    ZeroTimeout { name: &'static str },
}

/// Bounds on one listener's connections.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Open connections at once (handshaking or established).
    pub max_connections: usize,
    /// Open connections at once from one source IP address (loopback included).
    pub max_per_source: usize,
    /// Bound on a TLS handshake, from accept.
    pub handshake_timeout: Duration,
    /// Time after the handshake within which the first byte of a request must arrive.
    pub first_request_timeout: Duration,
    /// Time without traffic either way after which an established connection is closed.
    pub idle_timeout: Duration,
    /// Bound on an HTTP/1 request's headers.
    pub header_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_per_source: DEFAULT_MAX_CONNECTIONS / 4,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            first_request_timeout: FIRST_REQUEST_TIMEOUT,
            idle_timeout: IDLE_TIMEOUT,
            header_timeout: HEADER_TIMEOUT,
        }
    }
}

impl Limits {
    /// `Ok` when every bound is usable.
    pub fn validate(&self) -> Result<(), Error> {
        if self.max_connections == 0 {
            return Err(Error::NoConnections);
        }
        if self.max_per_source > self.max_connections {
            return Err(Error::PerSourceAboveCap {
                per_source: self.max_per_source,
                max: self.max_connections,
            });
        }
        for (name, value) in [
            ("handshake", self.handshake_timeout),
            ("first request", self.first_request_timeout),
            ("idle", self.idle_timeout),
            ("header", self.header_timeout),
        ] {
            if value.is_zero() {
                return Err(Error::ZeroTimeout { name });
            }
        }
        Ok(())
    }
}

/// The connection limits as flags and environment, shared by every binary (flatten it into the
/// binary's clap settings).
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct LimitArgs {
    /// Open connections at once per listener; more are closed at accept.
    #[arg(long, env = "OPENSHELL_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Open connections at once per listener from one source IP; 0: a quarter of
    /// --max-connections.
    #[arg(long, env = "OPENSHELL_MAX_CONNECTIONS_PER_SOURCE", default_value_t = 0)]
    pub max_connections_per_source: usize,
    /// Bound on a server-side TLS handshake, in milliseconds.
    #[arg(long, env = "OPENSHELL_HANDSHAKE_TIMEOUT_MS", default_value_t = HANDSHAKE_TIMEOUT.as_millis() as u64)]
    pub handshake_timeout_ms: u64,
    /// A connection that sends nothing this long after its handshake is closed, in milliseconds.
    #[arg(long, env = "OPENSHELL_FIRST_REQUEST_TIMEOUT_MS", default_value_t = FIRST_REQUEST_TIMEOUT.as_millis() as u64)]
    pub first_request_timeout_ms: u64,
    /// A connection without traffic either way this long is closed, in milliseconds.
    #[arg(long, env = "OPENSHELL_IDLE_TIMEOUT_MS", default_value_t = IDLE_TIMEOUT.as_millis() as u64)]
    pub idle_timeout_ms: u64,
    /// Bound on an HTTP/1 request's headers (and an idle keep-alive), in milliseconds.
    #[arg(long, env = "OPENSHELL_HEADER_TIMEOUT_MS", default_value_t = HEADER_TIMEOUT.as_millis() as u64)]
    pub header_timeout_ms: u64,
}

impl LimitArgs {
    /// The [`Limits`] these flags give, checked.
    pub fn limits(&self) -> Result<Limits, Error> {
        let per_source = match self.max_connections_per_source {
            0 => (self.max_connections / 4).max(1),
            n => n,
        };
        let limits = Limits {
            max_connections: self.max_connections,
            max_per_source: per_source,
            handshake_timeout: Duration::from_millis(self.handshake_timeout_ms),
            first_request_timeout: Duration::from_millis(self.first_request_timeout_ms),
            idle_timeout: Duration::from_millis(self.idle_timeout_ms),
            header_timeout: Duration::from_millis(self.header_timeout_ms),
        };
        limits.validate()?;
        Ok(limits)
    }
}

/// Why a connection was refused at accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    Cap,
    SourceCap,
}

/// Open connections, in total and per source.
#[derive(Debug, Default)]
struct Occupancy {
    total: usize,
    per_source: HashMap<IpAddr, usize>,
}

/// The open-connection book of one listener.
#[derive(Debug)]
struct Slots {
    limits: Limits,
    occupancy: Mutex<Occupancy>,
    counters: Counters,
}

/// One taken slot; given back when dropped (with the connection).
#[derive(Debug)]
pub(crate) struct Slot {
    slots: Arc<Slots>,
    source: IpAddr,
}

impl Slots {
    fn take(self: &Arc<Self>, source: IpAddr) -> Result<Slot, Refusal> {
        let mut occupancy = self.occupancy.lock().unwrap_or_else(PoisonError::into_inner);
        if occupancy.total >= self.limits.max_connections {
            return Err(Refusal::Cap);
        }
        let from_source = occupancy.per_source.entry(source).or_insert(0);
        if *from_source >= self.limits.max_per_source {
            return Err(Refusal::SourceCap);
        }
        *from_source += 1;
        occupancy.total += 1;
        self.counters.set_open(occupancy.total);
        Ok(Slot {
            slots: Arc::clone(self),
            source,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut occupancy = self.slots.occupancy.lock().unwrap_or_else(PoisonError::into_inner);
        occupancy.total = occupancy.total.saturating_sub(1);
        if let Some(n) = occupancy.per_source.get_mut(&self.source) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                occupancy.per_source.remove(&self.source);
            }
        }
        self.slots.counters.set_open(occupancy.total);
    }
}

/// A bound socket with its limits, counters and (optionally) TLS.
pub struct Listener {
    tcp: TcpListener,
    limits: Limits,
    counters: Counters,
    tls: Option<TlsAcceptor>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("address", &self.tcp.local_addr().ok())
            .field("limits", &self.limits)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Listener {
    /// Plaintext connections on `tcp`; [`Listener::with_tls`] makes them TLS.
    pub fn new(tcp: TcpListener, limits: Limits, counters: Counters) -> Self {
        Self {
            tcp,
            limits,
            counters,
            tls: None,
        }
    }

    /// Connections are TLS with `config` (`None`: plaintext).
    pub fn with_tls(mut self, config: Option<rustls::ServerConfig>) -> Self {
        self.tls = config.map(|c| TlsAcceptor::from(Arc::new(c)));
        self
    }

    /// The bound address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// This listener's counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Connections ready to serve (handshake done), accepted until the stream is dropped.
    pub fn incoming(self) -> ReceiverStream<std::io::Result<Conn>> {
        let (tx, rx) = mpsc::channel(64);
        let slots = Arc::new(Slots {
            limits: self.limits,
            occupancy: Mutex::default(),
            counters: self.counters,
        });
        let (tcp, tls) = (self.tcp, self.tls);
        tokio::spawn(async move {
            loop {
                let (stream, peer) = tokio::select! {
                    () = tx.closed() => return,
                    accepted = tcp.accept() => match accepted {
                        Ok(accepted) => accepted,
                        Err(err) => {
                            // Out of file descriptors and the like: back off a little, keep serving.
                            tracing::warn!(error = %err, "cannot accept a connection");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                };
                let slot = match slots.take(peer.ip()) {
                    Ok(slot) => slot,
                    Err(refusal) => {
                        // Closed at once: never queued.
                        slots.counters.refused(refusal == Refusal::SourceCap);
                        tracing::debug!(%peer, ?refusal, "connection refused");
                        continue;
                    }
                };
                slots.counters.accepted();
                let _ = stream.set_nodelay(true);
                let (tx, tls, limits) = (tx.clone(), tls.clone(), slots.limits.clone());
                tokio::spawn(async move {
                    if let Some(conn) = Conn::establish(stream, peer, tls, &limits, slot).await {
                        let _ = tx.send(Ok(conn)).await;
                    }
                });
            }
        });
        ReceiverStream::new(rx)
    }
}
