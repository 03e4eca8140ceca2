//! Connection counters per listener, in the OpenMetrics format every binary's `/metrics` serves
//! (`prometheus-client`): `<prefix>_connections_accepted_total{listener}`,
//! `…_connections_refused_total{listener,reason="cap"|"source_cap"}`,
//! `…_connections_handshake_timed_out_total{listener}`,
//! `…_connections_handshake_failed_total{listener}`, `…_connections_idle_closed_total{listener}`
//! and the gauge `…_connections_open{listener}`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabels {
    listener: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusedLabels {
    listener: &'static str,
    reason: &'static str,
}

/// The connection metrics of one binary, all its listeners (cheap to clone: shared counters).
#[derive(Clone, Debug, Default)]
pub struct ConnectionMetrics {
    accepted: Family<ListenerLabels, Counter>,
    refused: Family<RefusedLabels, Counter>,
    handshake_timed_out: Family<ListenerLabels, Counter>,
    handshake_failed: Family<ListenerLabels, Counter>,
    idle_closed: Family<ListenerLabels, Counter>,
    open: Family<ListenerLabels, Gauge>,
}

impl ConnectionMetrics {
    /// The counters of the listener named `listener`.
    pub fn listener(&self, listener: &'static str) -> Counters {
        // One family lookup per statement: a lookup holds the family's lock until the end of
        // its statement, and a second lookup of the same family in it would wait on itself.
        let labels = ListenerLabels { listener };
        let refused = |reason| RefusedLabels { listener, reason };
        let accepted = self.accepted.get_or_create(&labels).clone();
        let refused_cap = self.refused.get_or_create(&refused("cap")).clone();
        let refused_source_cap = self.refused.get_or_create(&refused("source_cap")).clone();
        let handshake_timed_out = self.handshake_timed_out.get_or_create(&labels).clone();
        let handshake_failed = self.handshake_failed.get_or_create(&labels).clone();
        let idle_closed = self.idle_closed.get_or_create(&labels).clone();
        let open = self.open.get_or_create(&labels).clone();
        Counters {
            accepted,
            refused_cap,
            refused_source_cap,
            handshake_timed_out,
            handshake_failed,
            idle_closed,
            open,
        }
    }

    /// Adds every connection metric to `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "connections_accepted",
            "Connections accepted (within the caps)",
            self.accepted.clone(),
        );
        registry.register(
            "connections_refused",
            "Connections closed at accept, by the cap they would exceed",
            self.refused.clone(),
        );
        registry.register(
            "connections_handshake_timed_out",
            "Connections closed because their TLS handshake did not finish in time",
            self.handshake_timed_out.clone(),
        );
        registry.register(
            "connections_handshake_failed",
            "Connections whose TLS handshake failed",
            self.handshake_failed.clone(),
        );
        registry.register(
            "connections_idle_closed",
            "Connections closed for sending no request, or no traffic, in time",
            self.idle_closed.clone(),
        );
        registry.register("connections_open", "Connections open now", self.open.clone());
    }
}

/// The counters of one listener.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    accepted: Counter,
    refused_cap: Counter,
    refused_source_cap: Counter,
    handshake_timed_out: Counter,
    handshake_failed: Counter,
    idle_closed: Counter,
    open: Gauge,
}

impl Counters {
    pub(crate) fn accepted(&self) {
        self.accepted.inc();
    }

    pub(crate) fn refused(&self, per_source: bool) {
        if per_source {
            self.refused_source_cap.inc();
        } else {
            self.refused_cap.inc();
        }
    }

    pub(crate) fn handshake_timed_out(&self) {
        self.handshake_timed_out.inc();
    }

    pub(crate) fn handshake_failed(&self) {
        self.handshake_failed.inc();
    }

    pub(crate) fn idle_closed(&self) {
        self.idle_closed.inc();
    }

    pub(crate) fn set_open(&self, open: usize) {
        self.open.set(i64::try_from(open).unwrap_or(i64::MAX));
    }

    /// What the counters say now.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            accepted: self.accepted.get(),
            refused_cap: self.refused_cap.get(),
            refused_source_cap: self.refused_source_cap.get(),
            handshake_timed_out: self.handshake_timed_out.get(),
            handshake_failed: self.handshake_failed.get(),
            idle_closed: self.idle_closed.get(),
            open: u64::try_from(self.open.get()).unwrap_or(0),
        }
    }
}

/// The values of a listener's [`Counters`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub accepted: u64,
    pub refused_cap: u64,
    pub refused_source_cap: u64,
    pub handshake_timed_out: u64,
    pub handshake_failed: u64,
    pub idle_closed: u64,
    pub open: u64,
}

/// The content type of the OpenMetrics text every `/metrics` serves.
pub const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A `/metrics` answer: the encoded exposition, or 500 when it could not be encoded.
pub fn openmetrics(encoded: Result<String, std::fmt::Error>) -> http::Response<String> {
    let (status, body) = match encoded {
        Ok(body) => (http::StatusCode::OK, body),
        Err(_) => (http::StatusCode::INTERNAL_SERVER_ERROR, String::new()),
    };
    let mut response = http::Response::new(body);
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(OPENMETRICS_CONTENT_TYPE),
    );
    response
}
