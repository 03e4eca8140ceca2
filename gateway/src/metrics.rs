//! The replica's Prometheus metrics: one [`Registry`] built at start, served by the health
//! port's `/metrics` (OpenMetrics, prefix `openshell_gateway_`). Counters count where the event
//! happens (a denied call, a dropped message, a failed recovery, a finished operation, a token
//! Secret write); this replica's gauges (coordinator, term, member streams) and the pool-wide
//! gauges follow the lease and the pool view ([`follow`]).
//!
//! Pool-wide gauges (`members`, `member_instances`, `member_capacity`, `instances`,
//! `operations`, `operation_*`, `token_secret_oldest_issued_timestamp_seconds`) are exported
//! **only by the coordinator**: every other replica exports them empty, so a sum over
//! replicas never counts a pool twice. Counters are per replica: sum them.

mod pool;

use std::sync::Arc;

use plumbing::listener::ConnectionMetrics;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use pool::{Figures, GaugeSet};

use crate::pool::View;
use crate::store::{FencedWrite, Lease, OperationKind, OperationPhase};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabels {
    kind: &'static str,
    phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    decision: &'static str,
}

/// The decisions of the egress audit trail, as counted (anything else is `other`).
const DECISIONS: [&str; 5] = ["allow", "audit", "deny", "dropped", "other"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// Every metric of one gateway replica.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    coordinator: Gauge,
    coordinator_term: Gauge,
    member_streams: Gauge,
    messages_dropped: Family<ReasonLabels, Counter>,
    report_bytes: Counter,
    snapshot_bytes: Counter,
    calls_denied: Counter,
    refusal_lines_suppressed: Counter,
    recoveries_failed: Family<ReasonLabels, Counter>,
    operations_finished: Family<OperationLabels, Counter>,
    token_secret_writes: Family<ResultLabels, Counter>,
    egress_decisions: Family<DecisionLabels, Counter>,
    token_secret_oldest: GaugeSet<pool::KindLabels>,
    coordinator_pass: Histogram,
    pool: pool::Gauges,
}

impl Metrics {
    /// The registry with every metric, the connection counters of `connections` included.
    pub fn new(connections: &ConnectionMetrics) -> Self {
        let mut registry = Registry::with_prefix("openshell_gateway");
        connections.register(&mut registry);
        let coordinator = Gauge::default();
        registry.register(
            "coordinator",
            "1 while this replica holds the coordinator lease, else 0",
            coordinator.clone(),
        );
        let coordinator_term = Gauge::default();
        registry.register(
            "coordinator_term",
            "Coordinator term this replica holds (0: standby)",
            coordinator_term.clone(),
        );
        let member_streams = Gauge::default();
        registry.register(
            "member_streams",
            "Member host streams this replica serves",
            member_streams.clone(),
        );
        let messages_dropped: Family<ReasonLabels, Counter> = Family::default();
        registry.register(
            "member_messages_dropped",
            "Member messages dropped by this replica's streams, by reason",
            messages_dropped.clone(),
        );
        let calls_denied = Counter::default();
        registry.register(
            "calls_denied",
            "Calls refused: a credential used for another instance or member",
            calls_denied.clone(),
        );
        let refusal_lines_suppressed = Counter::default();
        registry.register(
            "refusal_lines_suppressed",
            "Refused calls (UNAUTHENTICATED, PERMISSION_DENIED) not logged: over the per-source log rate",
            refusal_lines_suppressed.clone(),
        );
        let recoveries_failed: Family<ReasonLabels, Counter> = Family::default();
        registry.register(
            "recoveries_failed",
            "Failed recoveries: deadline_passed (the coordinator failed a recover operation at its \
             deadline), sidecar_reported (a sidecar missed its recovery deadline and stopped its workload)",
            recoveries_failed.clone(),
        );
        let operations_finished: Family<OperationLabels, Counter> = Family::default();
        registry.register(
            "operations_finished",
            "Operations this replica finished as coordinator, by kind and final phase",
            operations_finished.clone(),
        );
        let token_secret_writes: Family<ResultLabels, Counter> = Family::default();
        registry.register(
            "token_secret_writes",
            "Kubernetes token Secret writes by this replica as coordinator, by result",
            token_secret_writes.clone(),
        );
        let egress_decisions: Family<DecisionLabels, Counter> = Family::default();
        registry.register(
            "egress_decisions",
            "Egress decisions of sidecars this replica stored in the audit trail (each once), by \
             decision: allow, audit (let through by an audit-only policy), deny, dropped (a record \
             standing for decisions a full spool could not keep)",
            egress_decisions.clone(),
        );
        let token_lifetime: Gauge = Gauge::default();
        token_lifetime.set(i64::try_from(proto::timing::SUPERVISOR_TOKEN_LIFETIME.as_secs()).unwrap_or(i64::MAX));
        registry.register(
            "token_lifetime_seconds",
            "Lifetime of the tokens and trust bundles the gateway delivers (renewed at half of it)",
            token_lifetime,
        );
        let token_secret_oldest = GaugeSet::default();
        token_secret_oldest.register(
            &mut registry,
            "token_secret_oldest_issued_timestamp_seconds",
            "when the oldest token Secret it delivered was issued (Unix time), by target kind",
        );
        let report_bytes = Counter::default();
        registry.register(
            "member_report_bytes",
            "Encoded bytes of the status reports this replica's member streams received",
            report_bytes.clone(),
        );
        let snapshot_bytes = Counter::default();
        registry.register(
            "member_snapshot_bytes",
            "Encoded bytes of the snapshots this replica's member streams sent",
            snapshot_bytes.clone(),
        );
        // 0.5 ms to ~4 s.
        let coordinator_pass = Histogram::new(exponential_buckets(0.000_5, 2.0, 14));
        registry.register(
            "coordinator_pass_seconds",
            "How long the coordinator took to plan one pool view (writes not included)",
            coordinator_pass.clone(),
        );
        let pool = pool::Gauges::register(&mut registry);
        // Every labelled counter starts at 0, so `increase()` sees its first event.
        for reason in ["ack_never_sent", "ack_regressed", "report_oversized"] {
            messages_dropped.get_or_create(&ReasonLabels { reason }).inc_by(0);
        }
        for reason in ["deadline_passed", "sidecar_reported"] {
            recoveries_failed.get_or_create(&ReasonLabels { reason }).inc_by(0);
        }
        for kind in [
            OperationKind::Assign,
            OperationKind::Recover,
            OperationKind::Drain,
            OperationKind::Rebalance,
        ] {
            for phase in [
                OperationPhase::Succeeded,
                OperationPhase::Failed,
                OperationPhase::Cancelled,
            ] {
                let labels = OperationLabels {
                    kind: kind.as_str(),
                    phase: phase.as_str(),
                };
                operations_finished.get_or_create(&labels).inc_by(0);
            }
        }
        for result in ["ok", "error"] {
            token_secret_writes.get_or_create(&ResultLabels { result }).inc_by(0);
        }
        for decision in DECISIONS {
            egress_decisions.get_or_create(&DecisionLabels { decision }).inc_by(0);
        }
        Self {
            registry,
            coordinator,
            coordinator_term,
            member_streams,
            messages_dropped,
            report_bytes,
            snapshot_bytes,
            calls_denied,
            refusal_lines_suppressed,
            recoveries_failed,
            operations_finished,
            token_secret_writes,
            egress_decisions,
            token_secret_oldest,
            coordinator_pass,
            pool,
        }
    }

    /// One coordinator pass: planning a pool view took `took`.
    pub fn planned(&self, took: std::time::Duration) {
        self.coordinator_pass.observe(took.as_secs_f64());
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::with_capacity(8192);
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }

    /// A call refused because its credential is for another instance or member.
    pub fn call_denied(&self) {
        self.calls_denied.inc();
    }

    /// The counter of refused calls not logged (for [`crate::refusals::Refusals`]).
    pub fn refusal_lines_suppressed(&self) -> Counter {
        self.refusal_lines_suppressed.clone()
    }

    /// A status report of `bytes` received from a member.
    pub fn report_received(&self, bytes: usize) {
        self.report_bytes.inc_by(u64::try_from(bytes).unwrap_or(u64::MAX));
    }

    /// A snapshot of `bytes` sent to a member.
    pub fn snapshot_sent(&self, bytes: usize) {
        self.snapshot_bytes.inc_by(u64::try_from(bytes).unwrap_or(u64::MAX));
    }

    /// Audit records stored for the first time, by their decisions.
    pub fn egress_decisions_stored<'a>(&self, decisions: impl IntoIterator<Item = &'a str>) {
        for decision in decisions {
            let decision = DECISIONS
                .into_iter()
                .find(|known| *known == decision)
                .unwrap_or("other");
            self.egress_decisions.get_or_create(&DecisionLabels { decision }).inc();
        }
    }

    /// A member message dropped, for `reason` (one of a fixed set: the member stream's
    /// `Dropped::reason`).
    pub fn dropped(&self, reason: &'static str) {
        self.messages_dropped.get_or_create(&ReasonLabels { reason }).inc();
    }

    /// Status reports the store did not take: their member's stream had ended (a late batch),
    /// or a report of a higher term stands.
    pub fn reports_not_recorded(&self, count: u64) {
        self.messages_dropped
            .get_or_create(&ReasonLabels {
                reason: "report_not_current",
            })
            .inc_by(count);
    }

    /// A sidecar reported that it missed its recovery deadline (first report only).
    pub fn recovery_failed_reported(&self) {
        self.recoveries_failed
            .get_or_create(&ReasonLabels {
                reason: "sidecar_reported",
            })
            .inc();
    }

    /// A fenced write batch of the coordinator committed: count the operations it finished.
    pub fn written(&self, batch: &[FencedWrite]) {
        for write in batch {
            let FencedWrite::PutOperation(op) = write else {
                continue;
            };
            if !op.phase.is_finished() {
                continue;
            }
            if op.kind == OperationKind::Recover && op.phase == OperationPhase::Failed {
                self.recoveries_failed
                    .get_or_create(&ReasonLabels {
                        reason: "deadline_passed",
                    })
                    .inc();
            }
            let labels = OperationLabels {
                kind: op.kind.as_str(),
                phase: op.phase.as_str(),
            };
            self.operations_finished.get_or_create(&labels).inc();
        }
    }

    /// A token Secret write by the coordinator, `ok` or not.
    pub fn token_secret_written(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.token_secret_writes.get_or_create(&ResultLabels { result }).inc();
    }

    /// What the coordinator has delivered this term, as (target kind, issued at in ms): the
    /// oldest issue time per kind.
    pub fn token_secrets_delivered(&self, sent: impl IntoIterator<Item = (&'static str, i64)>) {
        let mut oldest: std::collections::BTreeMap<&'static str, i64> = Default::default();
        for (kind, issued_at_ms) in sent {
            let at = oldest.entry(kind).or_insert(i64::MAX);
            *at = (*at).min(issued_at_ms / 1000);
        }
        self.token_secret_oldest
            .replace(oldest.into_iter().map(|(kind, at)| (pool::KindLabels { kind }, at)));
    }

    /// Local mode (`--credentials-dir`, never with `--kubernetes`): the token files the
    /// coordinator delivered, as `kind="local_files"`.
    pub fn token_files_delivered(&self, issued_at_ms: i64) {
        let kind = pool::KindLabels { kind: "local_files" };
        self.token_secret_oldest.replace([(kind, issued_at_ms / 1000)]);
    }

    /// No longer the coordinator: its token Secret figures go.
    pub fn token_secrets_forgotten(&self) {
        self.token_secret_oldest.clear();
    }

    /// The lease this replica holds now (`None`: standby).
    fn follow_lease(&self, lease: Option<&Lease>) {
        self.coordinator.set(i64::from(lease.is_some()));
        // No lease: 0, which no held lease has (terms start at 1).
        self.coordinator_term.set(lease.map_or(0, |l| l.term.gauge()));
    }
}

/// Keep this replica's gauges and, while it holds the lease, the pool-wide gauges in step with
/// the lease and every new pool view, until `stop`. `streams` counts the member streams this
/// replica serves.
pub async fn follow(
    metrics: Arc<Metrics>,
    mut view: watch::Receiver<Arc<View>>,
    streams: impl Fn() -> usize,
    mut lease: watch::Receiver<Option<Lease>>,
    stop: CancellationToken,
) {
    loop {
        let held = lease.borrow_and_update().clone();
        metrics.follow_lease(held.as_ref());
        let streams = streams();
        metrics.member_streams.set(i64::try_from(streams).unwrap_or(i64::MAX));
        let current = view.borrow_and_update().clone();
        match held {
            Some(_) if current.now_ms > 0 => metrics.pool.set(&Figures::of(&current)),
            Some(_) => {}
            None => {
                metrics.pool.clear();
                metrics.token_secrets_forgotten();
            }
        }
        let figured = tokio::time::Instant::now();
        tokio::select! {
            () = stop.cancelled() => return,
            changed = lease.changed() => if changed.is_err() { return },
            changed = view.changed() => {
                if changed.is_err() {
                    return;
                }
                // Pool figures at most once per FIGURES_EVERY (views come every 200 ms, scrapes
                // every 15 s or so); a lease change at once.
                tokio::select! {
                    () = stop.cancelled() => return,
                    changed = lease.changed() => if changed.is_err() { return },
                    () = tokio::time::sleep_until(figured + FIGURES_EVERY) => {}
                }
            }
        }
    }
}

/// How often the pool-wide gauges follow the pool view at most.
const FIGURES_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

#[cfg(test)]
mod tests;
