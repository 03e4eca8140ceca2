//! The workload's relayed requests (runtime.proto step 4): each WorkloadRequest gets exactly
//! one WorkloadResponse. Progress is recorded in the session's counters, liveness is answered
//! Alive, a credential is refused (the workload holds placeholders only). Requests are answered
//! only on the stream relaying the active term and not while stopping; otherwise Rejected —
//! except on a stream that relayed an earlier term of this session while the session takes a
//! higher one on it (a move to the same member): the sidecar still relays there until it
//! receipts the new grant, so its requests wait (at most [`MAX_WAITING`]) and are answered
//! once the stream relays at the new term, or refused if the takeover fails or the instance
//! stops; a replaced or lost stream takes them with it (the sidecar fails what it had in
//! flight there). A response the stream cannot take drops the stream (the sidecar is not
//! reading).
//!
//! The sidecar's audit records (runtime.proto, Audit) are stored through the gateway
//! (`host.v1.RecordAudit`) for the active term, one batch at a time, and acknowledged to the
//! sidecar only once stored; a failed call is not acknowledged (the sidecar sends them again).

use proto::runtime::v1::supervisor_message::Kind;
use proto::runtime::v1::workload_request::Kind as Request;
use proto::runtime::v1::workload_response::Kind as Response;
use proto::runtime::v1::{Alive, ProgressAccepted, Rejected, WorkloadRequest, WorkloadResponse};

use super::effect::{Effect, StreamId};
use super::machine::Machine;
use super::takeover::Stage;

/// Requests that wait for a takeover on the stream that sent them (the sidecar's own bound on
/// requests in flight).
pub(super) const MAX_WAITING: usize = 64;

impl Machine {
    pub(super) fn on_request(&mut self, request: WorkloadRequest) {
        if let Some(id) = self.taking_over_relaying_stream()
            && self.waiting.len() < MAX_WAITING
        {
            self.waiting.push((id, request));
            return;
        }
        self.respond(request);
    }

    fn respond(&mut self, request: WorkloadRequest) {
        let answer = match self.refusal() {
            Some(reason) => rejected(reason),
            None => self.answer(request.kind),
        };
        self.counters.requests_relayed += 1;
        if matches!(answer, Response::Rejected(_)) {
            self.counters.requests_rejected += 1;
        }
        let response = WorkloadResponse {
            request_id: request.request_id,
            kind: Some(answer),
        };
        self.send(Kind::WorkloadResponse(response));
    }

    /// The held stream, when it relayed an earlier term and this one is being taken on it by
    /// a step with a bound (the grant asked for or held: `CALL_TIMEOUT`, the grant's deadline;
    /// the activation in flight), not stopping. A takeover that waits for launch material
    /// has no bound: its requests are refused as before.
    fn taking_over_relaying_stream(&self) -> Option<StreamId> {
        let sidecar = self.sidecar.as_ref().filter(|s| s.relayed_before && !s.attached)?;
        let bounded = match self.stage {
            Stage::Reserved { asked } => asked || self.grant.is_some(),
            Stage::Activating => true,
            Stage::Active { .. } | Stage::Failed(_) => false,
        };
        (bounded && self.stop.is_none()).then_some(sidecar.id)
    }

    /// After each event: the waiting requests are answered once their stream relays, refused
    /// once the takeover cannot bring it there, dropped with their stream.
    pub(super) fn settle_waiting(&mut self) {
        if self.waiting.is_empty() || self.taking_over_relaying_stream().is_some() {
            return;
        }
        let held = self.sidecar.as_ref().map(|s| s.id);
        for (id, request) in std::mem::take(&mut self.waiting) {
            if Some(id) == held {
                self.respond(request);
            }
        }
    }

    fn refusal(&self) -> Option<&'static str> {
        let relaying = matches!(self.stage, Stage::Active { .. }) && self.sidecar.as_ref().is_some_and(|s| s.attached);
        if self.stop.is_some() {
            Some("the instance is stopping")
        } else if !relaying {
            Some("this member does not relay for the instance's active term on this stream")
        } else {
            None
        }
    }

    fn answer(&mut self, request: Option<Request>) -> Response {
        match request {
            Some(Request::ReportProgress(progress)) => {
                self.counters.last_progress_value = progress.value;
                self.counters.last_progress_at_ms = self.now.unix_ms;
                Response::ProgressAccepted(ProgressAccepted { value: progress.value })
            }
            // A workload holds no credential (sidecars before placeholders still ask).
            Some(Request::FetchCredential(_)) => rejected(proto::egress::NO_CREDENTIAL),
            Some(Request::Liveness(_)) => Response::Alive(Alive {}),
            None => rejected("unknown request"),
        }
    }
}

impl Machine {
    pub(super) fn on_audit_records(&mut self, batch: proto::runtime::v1::AuditRecords) {
        let relaying = matches!(self.stage, Stage::Active { .. }) && self.sidecar.as_ref().is_some_and(|s| s.attached);
        let bounded = !batch.records.is_empty() && batch.records.len() <= 256;
        if !relaying || !bounded || self.audit_call.is_some() || self.stop.is_some() {
            return; // the sidecar sends them again
        }
        self.audit_call = Some(self.term);
        self.out.push(Effect::RecordAudit(proto::host::v1::RecordAuditRequest {
            route: self.setup.route.clone(),
            member: self.setup.me.member.clone(),
            term: self.term,
            records: batch.records,
            dropped: batch.dropped,
        }));
    }

    pub(super) fn on_audit_recorded(
        &mut self,
        term: u64,
        result: Result<proto::host::v1::RecordAuditResponse, crate::gateway::CallError>,
    ) {
        self.audit_call = None;
        let relaying = matches!(self.stage, Stage::Active { .. }) && self.sidecar.as_ref().is_some_and(|s| s.attached);
        match result {
            Ok(stored) if relaying && term == self.term => {
                let ack = proto::runtime::v1::AuditAck {
                    term,
                    through: stored.through,
                };
                self.send(Kind::AuditAck(ack));
            }
            Ok(_) => {}
            Err(err) => tracing::warn!(error = %err, "cannot store the sidecar's audit records; it sends them again"),
        }
    }
}

fn rejected(reason: &str) -> Response {
    Response::Rejected(Rejected {
        reason: reason.to_owned(),
    })
}
