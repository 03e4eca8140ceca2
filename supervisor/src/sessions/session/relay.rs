//! The workload's relayed requests (runtime.proto step 4): each WorkloadRequest gets exactly
//! one WorkloadResponse. Progress is recorded in the session's counters, liveness is answered
//! Alive, a credential is refused (the workload holds placeholders only). Requests are answered
//! only on the stream relaying the active term and not while stopping; otherwise Rejected.
//! A response the stream cannot take drops the stream (the sidecar is not reading).

use proto::runtime::v1::supervisor_message::Kind;
use proto::runtime::v1::workload_request::Kind as Request;
use proto::runtime::v1::workload_response::Kind as Response;
use proto::runtime::v1::{Alive, ProgressAccepted, Rejected, WorkloadRequest, WorkloadResponse};

use super::machine::Machine;
use super::takeover::Stage;

impl Machine {
    pub(super) fn on_request(&mut self, request: WorkloadRequest) {
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

fn rejected(reason: &str) -> Response {
    Response::Rejected(Rejected {
        reason: reason.to_owned(),
    })
}
