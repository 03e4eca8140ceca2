//! The report writer: member streams hand it the statuses that changed (`submit`, which
//! never waits), and it writes them in batches, one transaction per batch — at once when a
//! batch holds a new term, phase or workload PID (operations settle on those), otherwise at
//! the next [`LAZY_FLUSH`]. A stream task therefore never waits for the database: heartbeats
//! and acks are not held up behind reports, whatever the member's size.
//!
//! Pending statuses are kept per route, the latest winning, so memory is bounded by the
//! routes this replica's members host. A batch that cannot be written is kept (unless a newer
//! status of its route arrived meanwhile) and tried again.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::metrics::Metrics;
use crate::store::{Report, Store};

/// How long a counter- or message-only change may wait for its batch.
pub const LAZY_FLUSH: Duration = Duration::from_secs(1);
/// Bound on one batch's transaction.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// A member stream: its id on this replica, and its member's connection epoch.
pub type Stream = (u64, i64);

/// Statuses waiting, by route: the stream that submitted each, and the status.
type Pending = BTreeMap<String, (Stream, Report)>;

#[derive(Debug, Default)]
pub struct Writer {
    pending: Mutex<Pending>,
    urgent: Notify,
}

impl Writer {
    /// Queue `reports` from `stream` (its id, and its member's connection epoch: the store
    /// writes them only while that stream is the member's current one); `urgent` wakes the
    /// writer at once.
    pub fn submit(&self, stream: Stream, reports: Vec<Report>, urgent: bool) {
        if reports.is_empty() {
            return;
        }
        {
            let mut pending = self.lock();
            for report in reports {
                pending.insert(report.route.clone(), (stream, report));
            }
        }
        if urgent {
            self.urgent.notify_one();
        }
    }

    /// Drop what stream `stream` queued and was not written yet (the stream ended: a newer
    /// stream of its member speaks for those routes now, and an older status written late
    /// could hide a newer one of the same term).
    pub fn forget(&self, stream: u64) {
        self.lock().retain(|_, ((s, _), _)| *s != stream);
    }

    /// Statuses waiting for a batch.
    pub fn pending(&self) -> usize {
        self.lock().len()
    }

    fn take(&self) -> Vec<(String, (Stream, Report))> {
        std::mem::take(&mut *self.lock()).into_iter().collect()
    }

    /// Put back a batch that was not written, unless newer statuses replaced its entries.
    fn restore(&self, batch: Vec<(String, (Stream, Report))>) {
        let mut pending = self.lock();
        for (route, entry) in batch {
            pending.entry(route).or_insert(entry);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Write batches until `stop`, then write what is left once; statuses the store did not take
/// (their stream ended, or a higher term's report stands) are counted in `metrics`.
pub async fn run(writer: Arc<Writer>, store: Store, metrics: Arc<Metrics>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(LAZY_FLUSH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let stopping = tokio::select! {
            () = stop.cancelled() => true,
            () = writer.urgent.notified() => false,
            _ = tick.tick() => false,
        };
        flush(&writer, &store, &metrics).await;
        if stopping {
            break;
        }
    }
}

async fn flush(writer: &Writer, store: &Store, metrics: &Metrics) {
    let batch = writer.take();
    if batch.is_empty() {
        return;
    }
    let reports: Vec<(Report, Option<i64>)> = batch
        .iter()
        .map(|(_, ((_, epoch), r))| (r.clone(), Some(*epoch)))
        .collect();
    let statuses = reports.len();
    let failed = match tokio::time::timeout(WRITE_TIMEOUT, store.record_stream_reports(reports)).await {
        Ok(Ok(0)) => return,
        Ok(Ok(not_written)) => {
            debug!(
                not_written,
                statuses, "statuses of ended streams or lower terms not recorded"
            );
            metrics.reports_not_recorded(not_written);
            return;
        }
        Ok(Err(err)) => err.to_string(),
        Err(_) => format!("no answer within {WRITE_TIMEOUT:?}"),
    };
    warn!(error = %failed, statuses, "cannot record status reports; retrying with the next batch");
    writer.restore(batch);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{OwnershipTerm, ReportPhase};

    fn report(route: &str, term: u64, progress: i64) -> Report {
        Report {
            route: route.into(),
            term: OwnershipTerm::new(term),
            member: "m".into(),
            process_id: "p".into(),
            phase: ReportPhase::Active,
            message: String::new(),
            workload_pid: 1,
            progress: Some(progress),
            reported_by: "gw".into(),
            updated_at_ms: 0,
            policy: None,
        }
    }

    #[test]
    fn the_latest_status_of_a_route_wins_and_an_ended_stream_is_forgotten() {
        let writer = Writer::default();
        writer.submit((1, 1), vec![report("a", 1, 1), report("b", 1, 1)], false);
        writer.submit((2, 1), vec![report("a", 1, 9)], false);
        assert_eq!(writer.pending(), 2);
        writer.forget(1);
        let left = writer.take();
        assert_eq!(left.len(), 1, "b went with stream 1; a is stream 2's");
        assert_eq!(left[0].1.1.progress, Some(9));
        // A failed batch comes back, unless a newer status replaced it meanwhile.
        writer.submit((3, 1), vec![report("a", 2, 0)], false);
        writer.restore(vec![
            ("a".into(), ((2, 1), report("a", 1, 9))),
            ("c".into(), ((2, 1), report("c", 1, 0))),
        ]);
        let mut back = writer.take();
        back.sort_by(|x, y| x.0.cmp(&y.0));
        assert_eq!(back.len(), 2);
        assert_eq!(back[0].1.1.term, OwnershipTerm::new(2), "the newer status of a stays");
    }

    #[tokio::test]
    async fn batches_reach_the_store_at_once_when_urgent() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("db").display());
        let store = Store::open(&url, &crate::store::Options::default()).await.unwrap();
        // The reports' member, attached at epoch 1.
        let member = crate::store::MemberUpdate {
            member: "m".into(),
            process_id: "p".into(),
            epoch: 1,
            runtime_address: "http://m:7443".into(),
            capacity: 8,
            served_by: "gw".into(),
            leaving: false,
        };
        store.record_member(&member, Duration::from_secs(60)).await.unwrap();
        let writer = Arc::new(Writer::default());
        let stop = CancellationToken::new();
        let metrics = Arc::new(Metrics::new(&plumbing::listener::ConnectionMetrics::default()));
        let task = tokio::spawn(run(writer.clone(), store.clone(), metrics.clone(), stop.clone()));
        let batch: Vec<Report> = (0..50).map(|i| report(&format!("ns/r{i}"), 1, i)).collect();
        writer.submit((1, 1), batch, true);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while store.list_reports().await.unwrap().len() < 50 {
            assert!(tokio::time::Instant::now() < deadline, "the batch was not written");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Lazy changes go with the next tick; the stop writes what is left.
        writer.submit((1, 1), vec![report("ns/r0", 1, 777)], false);
        stop.cancel();
        task.await.unwrap();
        let written = store.list_reports().await.unwrap();
        assert_eq!(
            written.iter().find(|r| r.route == "ns/r0").map(|r| r.progress),
            Some(Some(777))
        );
        assert_eq!(writer.pending(), 0);
        // A late batch of a stream the member left (epoch 1; it attached again at 2): never
        // written over what the newer stream said.
        store
            .record_member(
                &crate::store::MemberUpdate { epoch: 2, ..member },
                Duration::from_secs(60),
            )
            .await
            .unwrap();
        writer.submit((1, 1), vec![report("ns/r0", 1, 5)], true);
        flush(&writer, &store, &metrics).await;
        assert_eq!(writer.pending(), 0, "not tried again");
        assert!(
            metrics
                .encode()
                .unwrap()
                .contains("openshell_gateway_member_messages_dropped_total{reason=\"report_not_current\"} 1"),
            "counted"
        );
        let kept = store.list_reports().await.unwrap();
        assert_eq!(
            kept.iter().find(|r| r.route == "ns/r0").map(|r| r.progress),
            Some(Some(777))
        );
        let not_written = store
            .record_stream_reports(vec![(report("ns/r0", 1, 6), Some(2))])
            .await
            .unwrap();
        assert_eq!(not_written, 0);
        let kept = store.list_reports().await.unwrap();
        assert_eq!(
            kept.iter().find(|r| r.route == "ns/r0").map(|r| r.progress),
            Some(Some(6))
        );
        store.close().await;
    }
}
