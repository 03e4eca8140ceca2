//! Prometheus metrics (served on the plain-HTTP health port at `/metrics`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::review::Outcome;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabels {
    pub mode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

/// Latency buckets in milliseconds.
pub const LATENCY_BUCKETS_MS: [f64; 12] = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0];

/// All webhook metrics, prefixed `openshell_webhook_`.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub requests: Counter,
    pub injected: Family<ModeLabels, Counter>,
    pub skipped: Family<ReasonLabels, Counter>,
    pub failed: Family<ReasonLabels, Counter>,
    pub latency_ms: Histogram,
    pub cert_reloads: Family<ResultLabels, Counter>,
    pub cert_loaded: Gauge,
    /// Connection counters of the HTTPS (`listener="webhook"`) and health ports.
    pub connections: proto::listener::ConnectionMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("openshell_webhook");
        let requests = Counter::default();
        let injected = Family::<ModeLabels, Counter>::default();
        let skipped = Family::<ReasonLabels, Counter>::default();
        let failed = Family::<ReasonLabels, Counter>::default();
        let latency_ms = Histogram::new(LATENCY_BUCKETS_MS);
        let cert_reloads = Family::<ResultLabels, Counter>::default();
        let cert_loaded = Gauge::default();
        registry.register(
            "admission_requests",
            "AdmissionReview requests received on /mutate",
            requests.clone(),
        );
        registry.register(
            "admission_injected",
            "Pods that received the supervision injection, by sidecar mode",
            injected.clone(),
        );
        registry.register(
            "admission_skipped",
            "Pods admitted without injection, by reason",
            skipped.clone(),
        );
        registry.register(
            "admission_failed",
            "Reviews answered with an error, by reason",
            failed.clone(),
        );
        registry.register(
            "admission_duration_milliseconds",
            "Time to answer one review (body read to response), in milliseconds",
            latency_ms.clone(),
        );
        registry.register(
            "tls_certificate_reloads",
            "Serving certificate loads from disk, by result",
            cert_reloads.clone(),
        );
        registry.register(
            "tls_certificate_loaded",
            "1 once a serving certificate is loaded",
            cert_loaded.clone(),
        );
        let connections = proto::listener::ConnectionMetrics::default();
        connections.register(&mut registry);
        Self {
            registry,
            requests,
            injected,
            skipped,
            failed,
            latency_ms,
            cert_reloads,
            cert_loaded,
            connections,
        }
    }

    /// Count one answered review.
    pub fn record(&self, outcome: Outcome, elapsed_ms: f64) {
        match outcome {
            Outcome::Injected(mode) => {
                self.injected.get_or_create(&ModeLabels { mode: mode.as_str() }).inc();
            }
            Outcome::Skipped(reason) => {
                self.skipped
                    .get_or_create(&ReasonLabels {
                        reason: reason.as_str(),
                    })
                    .inc();
            }
            Outcome::Failed(reason) => {
                self.failed
                    .get_or_create(&ReasonLabels {
                        reason: reason.as_str(),
                    })
                    .inc();
            }
        }
        self.latency_ms.observe(elapsed_ms);
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::with_capacity(4096);
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}
