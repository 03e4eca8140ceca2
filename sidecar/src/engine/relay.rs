//! The machine's workload side: admitting processes to the socket, pinning the workload, and
//! relaying its requests to the activated owner (held while there is none).

use proto::common::v1::WorkloadIdentity;
use proto::runtime::v1::{
    Liveness, ReportProgress, WorkloadRequest, WorkloadResponse, WorkloadStarted, sidecar_message, workload_request,
    workload_response,
};
use tracing::info;

use super::effect::{Effect, Reply};
use super::machine::{LOST, MAX_REASON_BYTES, Machine, Mode, STOPPING, bounded};
use crate::runtime_link::StreamId;
use crate::workload::{Admission, Answer, Op};

/// Workload requests held while frozen.
pub(super) const MAX_HELD: usize = 256;
/// Workload requests awaiting the owner's answer.
pub(super) const MAX_INFLIGHT: usize = 64;

impl<R: Reply> Machine<R> {
    pub(super) fn admit(&self, pid: Option<u32>) -> Effect<R> {
        if self.ending.is_some() {
            return Effect::Admit(Admission::Refused(STOPPING.into()));
        }
        let Some(pid) = pid else {
            return Effect::Admit(Admission::Refused(
                "the connecting process is not visible to the sidecar (share the Pod's process namespace)".into(),
            ));
        };
        match &self.workload {
            Some(pinned) => Effect::AdmitDescendant {
                pid,
                ancestor: pinned.pid,
            },
            None if self.setup.local => Effect::Admit(Admission::Refused("the workload process has ended".into())),
            None => Effect::Admit(Admission::NeedsIdentity),
        }
    }

    pub(super) fn pin(&mut self, identity: WorkloadIdentity) {
        if self.workload.is_some() || self.ending.is_some() {
            let admission = self.admit(Some(identity.pid));
            self.out.push(admission);
            return;
        }
        info!(pid = identity.pid, "workload process pinned");
        self.state.workload = Some((&identity).into());
        self.persist();
        if let Mode::Recovering { episode } = &self.mode {
            episode.set_workload(identity.clone());
        }
        self.workload = Some(identity.clone());
        self.out.push(Effect::Watch(identity));
        if matches!(self.mode, Mode::Active) {
            self.announce_workload();
        }
        self.out.push(Effect::Admit(Admission::Admitted));
    }

    /// Tell the activated owner which process the workload is (its first message may have
    /// carried none: the workload connects after the activation).
    pub(super) fn announce_workload(&mut self) {
        let (Some(id), Some(pinned)) = (self.owner, &self.workload) else {
            return;
        };
        let started = WorkloadStarted {
            workload: Some(pinned.clone()),
        };
        let Some(stream) = self.streams.get_mut(&id) else {
            return;
        };
        if stream.workload_told {
            return;
        }
        stream.workload_told = true;
        self.send(id, sidecar_message::Kind::WorkloadStarted(started));
    }

    pub(super) fn on_request(&mut self, op: Op, reply: R) {
        if self.ending.is_some() {
            self.answer(reply, STOPPING);
        } else if matches!(self.mode, Mode::Active) && self.owner.is_some() {
            self.forward(op, reply);
        } else if self.held.len() >= MAX_HELD {
            self.answer(reply, "too many requests held while the supervisor recovers");
        } else {
            self.held.push_back((op, reply));
        }
    }

    pub(super) fn forward(&mut self, op: Op, reply: R) {
        let Some(id) = self.owner else {
            self.held.push_back((op, reply));
            return;
        };
        if reply.is_closed() {
            return;
        }
        if self.inflight.len() >= MAX_INFLIGHT {
            return self.answer(reply, "too many requests in flight");
        }
        let Some(stream) = self.streams.get_mut(&id) else {
            return self.answer(reply, LOST);
        };
        stream.next_request += 1;
        let request_id = stream.next_request;
        let kind = match op.clone() {
            Op::Progress { value, note } => workload_request::Kind::ReportProgress(ReportProgress { value, note }),
            Op::Liveness => workload_request::Kind::Liveness(Liveness {}),
        };
        let message = WorkloadRequest {
            request_id,
            kind: Some(kind),
        };
        // A send the stream cannot take comes back as `Event::Unsent` and is refused then.
        self.inflight.insert((id, request_id), (op, reply));
        self.out.push(Effect::Send {
            id,
            kind: sidecar_message::Kind::WorkloadRequest(message),
        });
    }

    pub(super) fn on_response(&mut self, id: StreamId, response: WorkloadResponse) {
        use workload_response::Kind;
        let Some((_, reply)) = self.inflight.remove(&(id, response.request_id)) else {
            return;
        };
        let answer = match response.kind {
            Some(Kind::ProgressAccepted(p)) => Answer::Progress {
                value: p.value,
                term: self.state.fence.activated,
                member: self
                    .state
                    .fence
                    .owner
                    .as_ref()
                    .map(|o| o.member.clone())
                    .unwrap_or_default(),
            },
            Some(Kind::Credential(_)) => Answer::Refused(proto::egress::NO_CREDENTIAL.into()),
            Some(Kind::Alive(_)) => Answer::Alive,
            Some(Kind::Rejected(r)) => Answer::Refused(bounded(&r.reason, MAX_REASON_BYTES)),
            None => Answer::Refused("the supervisor sent an empty answer".into()),
        };
        self.out.push(Effect::Answer { reply, answer });
    }

    pub(super) fn fail_inflight(&mut self, id: StreamId, reason: &str) {
        let keys: Vec<_> = self.inflight.keys().copied().filter(|(s, _)| *s == id).collect();
        for key in keys {
            if let Some((_, reply)) = self.inflight.remove(&key) {
                self.answer(reply, reason);
            }
        }
    }

    /// Holds again, ahead of anything held since and in the order they were sent, the
    /// requests stream `id` did not answer: its owner relinquished the term in a planned
    /// move, so they go to the next owner after its activation instead of failing. Every
    /// operation may be carried out twice (a progress report carries the absolute value,
    /// the others are reads), so a request the relinquishing owner did act on is safe too.
    pub(super) fn hold_inflight(&mut self, id: StreamId) {
        let mut keys: Vec<_> = self.inflight.keys().copied().filter(|(s, _)| *s == id).collect();
        keys.sort_unstable();
        for key in keys.into_iter().rev() {
            if let Some(request) = self.inflight.remove(&key) {
                self.held.push_front(request);
            }
        }
    }

    /// Refuses one request.
    pub(super) fn answer(&mut self, reply: R, reason: &str) {
        self.out.push(Effect::Answer {
            reply,
            answer: Answer::Refused(reason.into()),
        });
    }
}
