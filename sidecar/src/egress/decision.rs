//! Reporting decisions: each is a log line (target `egress`) and a record of the audit trail
//! ([`super::audit`]). What goes through is recorded when it ends, with the bytes it carried
//! each way and how long it lasted: a tunnel when it closes, a plain-HTTP exchange when its
//! answer's body ends ([`Counted`]).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tracing::info;

use super::audit::{Record, Recorder};
use super::policy::Policy;
use super::proxy::Asked;

/// The record of a decision about `asked` under `policy`.
fn record(asked: &Asked, policy: Option<&Policy>, decision: &str, rule: Option<&str>, reason: &str) -> Record {
    let (method, path) = asked.http.as_ref().map_or(("", ""), |(m, p)| (m.as_str(), p.as_str()));
    Record {
        at_ms: proto::trust::unix_ms(std::time::SystemTime::now()),
        decision: decision.to_owned(),
        destination: asked.destination(),
        method: method.to_owned(),
        path: plumbing::text::bounded(path, 256),
        rule: rule.unwrap_or_default().to_owned(),
        policy: policy.map(|p| p.name.clone()).unwrap_or_default(),
        revision: policy.map_or(0, |p| p.revision),
        reason: plumbing::text::bounded(reason, 256),
        ..Record::default()
    }
}

/// The log line of a decision.
pub(super) fn log(asked: &Asked, policy: Option<&Policy>, decision: &str, rule: Option<&str>, reason: &str) {
    let (method, path) = asked.http.as_ref().map_or(("", ""), |(m, p)| (m.as_str(), p.as_str()));
    info!(
        target: "egress",
        destination = %asked.destination(),
        method,
        path = %plumbing::text::bounded(path, 256),
        decision,
        rule = rule.unwrap_or_default(),
        policy = policy.map(|p| p.name.as_str()).unwrap_or_default(),
        revision = policy.map_or(0, |p| p.revision),
        reason,
        "egress decision"
    );
}

/// A decision that sends nothing (a refusal, a failure): logged and recorded at once.
pub(super) fn report(
    audit: &Recorder,
    asked: &Asked,
    policy: Option<&Policy>,
    decision: &str,
    rule: Option<&str>,
    reason: &str,
) {
    log(asked, policy, decision, rule, reason);
    audit.record(record(asked, policy, decision, rule, reason));
}

/// A decision that lets something through: logged now, recorded when it ends.
pub(super) struct Open {
    audit: Recorder,
    record: Record,
    started: Instant,
    /// Bytes from the workload upstream, and back.
    pub sent: Arc<AtomicU64>,
    pub received: Arc<AtomicU64>,
}

impl Open {
    pub(super) fn new(
        audit: &Recorder,
        asked: &Asked,
        policy: Option<&Policy>,
        decision: &str,
        rule: Option<&str>,
        reason: &str,
    ) -> Self {
        log(asked, policy, decision, rule, reason);
        Self {
            audit: audit.clone(),
            record: record(asked, policy, decision, rule, reason),
            started: Instant::now(),
            sent: Arc::default(),
            received: Arc::default(),
        }
    }

    /// Records it, with `why` it ended when that is worth saying (revoked, shut down).
    pub(super) fn close(self, why: Option<&str>) {
        let mut record = self.record;
        record.bytes_sent = self.sent.load(Ordering::Relaxed);
        record.bytes_received = self.received.load(Ordering::Relaxed);
        record.duration_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        if let Some(why) = why {
            record.reason = plumbing::text::bounded(why, 256);
        }
        self.audit.record(record);
    }
}

/// A body that counts the bytes it yields into `count`, and runs `done` once it ended or was
/// dropped.
pub(super) struct Counted<B> {
    inner: B,
    count: Arc<AtomicU64>,
    done: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl<B> Counted<B> {
    pub(super) fn new(inner: B, count: Arc<AtomicU64>, done: Option<Box<dyn FnOnce() + Send + Sync>>) -> Self {
        Self { inner, count, done }
    }

    fn finish(&mut self) {
        if let Some(done) = self.done.take() {
            done();
        }
    }
}

impl<B: Body<Data = Bytes> + Unpin> Body for Counted<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.count.fetch_add(data.len() as u64, Ordering::Relaxed);
                }
            }
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => self.finish(),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> Drop for Counted<B> {
    fn drop(&mut self) {
        self.finish();
    }
}
