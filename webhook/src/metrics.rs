//! Prometheus metrics (served on the plain-HTTP health port at `/metrics`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::inject::refuse::RefuseReason;
use crate::inject::{SidecarMode, SkipReason};
use crate::review::{FailReason, Outcome};

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

/// Latency buckets in seconds (0.1 ms to 1 s).
pub const LATENCY_BUCKETS_SECONDS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// All webhook metrics, prefixed `openshell_webhook_`.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub requests: Counter,
    pub injected: Family<ModeLabels, Counter>,
    pub skipped: Family<ReasonLabels, Counter>,
    pub refused: Family<ReasonLabels, Counter>,
    pub failed: Family<ReasonLabels, Counter>,
    pub latency: Histogram,
    pub cert_reloads: Family<ResultLabels, Counter>,
    pub cert_loaded: Gauge,
    /// Connection counters of the HTTPS (`listener="webhook"`) and health ports.
    pub connections: plumbing::listener::ConnectionMetrics,
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
        let refused = Family::<ReasonLabels, Counter>::default();
        let failed = Family::<ReasonLabels, Counter>::default();
        let latency = Histogram::new(LATENCY_BUCKETS_SECONDS);
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
            "admission_refused",
            "Pods refused because they would reach the supervision sidecar's volumes or memory, by reason",
            refused.clone(),
        );
        registry.register(
            "admission_failed",
            "Reviews answered with an error, by reason",
            failed.clone(),
        );
        registry.register(
            "admission_duration_seconds",
            "Time to answer one review (body read to response), in seconds",
            latency.clone(),
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
        let connections = plumbing::listener::ConnectionMetrics::default();
        connections.register(&mut registry);
        // Every label starts at 0, so `increase()` sees the first event of each.
        for mode in <SidecarMode as clap::ValueEnum>::value_variants() {
            injected.get_or_create(&ModeLabels { mode: mode.as_str() }).inc_by(0);
        }
        for reason in SkipReason::ALL.map(SkipReason::as_str) {
            skipped.get_or_create(&ReasonLabels { reason }).inc_by(0);
        }
        for reason in RefuseReason::ALL.map(RefuseReason::as_str) {
            refused.get_or_create(&ReasonLabels { reason }).inc_by(0);
        }
        for reason in FailReason::ALL.map(FailReason::as_str) {
            failed.get_or_create(&ReasonLabels { reason }).inc_by(0);
        }
        for result in ["loaded", "error"] {
            cert_reloads.get_or_create(&ResultLabels { result }).inc_by(0);
        }
        Self {
            registry,
            requests,
            injected,
            skipped,
            refused,
            failed,
            latency,
            cert_reloads,
            cert_loaded,
            connections,
        }
    }

    /// Count one answered review.
    pub fn record(&self, outcome: Outcome, elapsed_ms: f64) {
        let count = |family: &Family<ReasonLabels, Counter>, reason: &'static str| {
            family.get_or_create(&ReasonLabels { reason }).inc();
        };
        match outcome {
            Outcome::Injected(mode) => {
                self.injected.get_or_create(&ModeLabels { mode: mode.as_str() }).inc();
            }
            Outcome::Skipped(reason) => count(&self.skipped, reason.as_str()),
            Outcome::Refused(reason) => count(&self.refused, reason.as_str()),
            Outcome::Failed(reason) => count(&self.failed, reason.as_str()),
        }
        self.latency.observe(elapsed_ms / 1000.0);
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::with_capacity(4096);
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}
