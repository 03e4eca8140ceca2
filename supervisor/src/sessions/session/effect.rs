//! What the session machine takes in (`Event`) and what it asks its driver to do (`Effect`):
//! plain data, so its decisions can be checked without sockets, calls or a runtime.

use std::fmt;
use std::time::Instant;

use proto::host::v1::InstanceStatus;
use proto::recovery::v1::{ActivateRequest, ActivationProof, IssueGrantRequest, IssueGrantResponse};
use proto::runtime::v1::{SupervisorMessage, sidecar_message, supervisor_message};

use super::SessionEvent;
use crate::gateway::CallError;
use crate::runtime::stream::Opening;

/// A sidecar stream, as the machine names it (`SidecarStream::id`, unique per process).
pub(crate) type StreamId = u64;

/// The time an event happens at (the monotonic instant for deadlines, Unix milliseconds for
/// what is reported and for grant expiry), and the recovery deadline of the latest snapshot
/// then (what Attached and ActivationConfirm carry).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Now {
    pub at: Instant,
    pub unix_ms: i64,
    pub recovery_deadline_ms: u64,
}

/// An input of the machine: from the member, the sidecar stream, the clock, or the result of
/// an effect it asked for.
#[derive(Debug)]
pub(crate) enum Event {
    /// The driver starts.
    Started,
    /// What the member told the session (a snapshot's assignment, Stop, Relinquish).
    Member(SessionEvent),
    /// A sidecar stream of this instance arrived (runtime.v1.Connect, authenticated and routed).
    Sidecar { stream: StreamId, opening: Opening },
    /// A message on the held sidecar stream (heartbeats are consumed by the driver).
    Message {
        stream: StreamId,
        kind: sidecar_message::Kind,
    },
    /// The held sidecar stream ended, went silent or stopped reading.
    Lost { stream: StreamId, reason: String },
    /// An `Effect::Send` the stream could not take (closed or not reading): the message back.
    Unsent {
        stream: StreamId,
        message: SupervisorMessage,
    },
    /// The outcome of `Effect::IssueGrant`.
    Granted(Result<IssueGrantResponse, CallError>),
    /// The outcome of `Effect::Activate`.
    Activated(Result<ActivationProof, CallError>),
    /// The outcome of `Effect::RecordAudit` for records of `term`.
    AuditRecorded {
        term: u64,
        result: Result<proto::host::v1::RecordAuditResponse, CallError>,
    },
    /// The instant `Machine::next_wake` named (or a later one) has come.
    Tick,
    /// The member's egress policy changed (its file was edited).
    Policy(Option<std::sync::Arc<proto::runtime::v1::EgressPolicy>>),
    /// The member exits and abandons the session (nothing is stopped or released).
    Abandoned,
    /// Nobody can send to the session any more (its handle and route-table entries are gone).
    Orphaned,
}

/// What the machine asks its driver to do, in order.
pub(crate) enum Effect {
    /// Queue a message on a sidecar stream; one it cannot take comes back as `Event::Unsent`
    /// before any later effect.
    Send {
        stream: StreamId,
        kind: supervisor_message::Kind,
    },
    /// End a stream with FAILED_PRECONDITION and this reason (fenced).
    Refuse { stream: StreamId, reason: String },
    /// Let go of a stream (replaced, lost or done with): it ends with OK after what is queued.
    Drop(StreamId),
    /// Send recovery.v1.IssueGrant, once; the outcome comes back as `Event::Granted`.
    IssueGrant(IssueGrantRequest),
    /// Send recovery.v1.Activate, once; the outcome comes back as `Event::Activated`.
    Activate(ActivateRequest),
    /// Forget the call in flight: its outcome is never delivered (the term moved or failed).
    CancelCall,
    /// Send host.v1.RecordAudit (beside any recovery call); the outcome comes back as
    /// `Event::AuditRecorded`.
    RecordAudit(proto::host::v1::RecordAuditRequest),
    /// Make this the session's status (what the member reports).
    Publish(Box<InstanceStatus>),
    /// Tell the member a status report is due.
    Announce,
    /// The session is finished: the driver drops everything it holds.
    Done,
}

/// Names only: messages and requests carry grants, proofs and credentials.
impl fmt::Debug for Effect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Send { stream, kind } => write!(f, "Send({stream}, {})", message_name(kind)),
            Self::Refuse { stream, reason } => write!(f, "Refuse({stream}, {reason:?})"),
            Self::Drop(stream) => write!(f, "Drop({stream})"),
            Self::IssueGrant(request) => write!(f, "IssueGrant(term {})", request.term),
            Self::Activate(_) => f.write_str("Activate(<redacted>)"),
            Self::CancelCall => f.write_str("CancelCall"),
            Self::RecordAudit(request) => write!(
                f,
                "RecordAudit(term {}, {} records)",
                request.term,
                request.records.len()
            ),
            Self::Publish(status) => write!(f, "Publish({:?}, {:?})", status.phase(), status.message),
            Self::Announce => f.write_str("Announce"),
            Self::Done => f.write_str("Done"),
        }
    }
}

/// A member message's name (never its content).
pub(crate) fn message_name(kind: &supervisor_message::Kind) -> &'static str {
    use supervisor_message::Kind;
    match kind {
        Kind::Attached(_) => "Attached",
        Kind::GrantPresentation(_) => "GrantPresentation",
        Kind::ActivationConfirm(_) => "ActivationConfirm",
        Kind::Redirect(_) => "Redirect",
        Kind::Relinquish(_) => "Relinquish",
        Kind::Release(_) => "Release",
        Kind::WorkloadResponse(_) => "WorkloadResponse",
        Kind::Heartbeat(_) => "Heartbeat",
        Kind::PolicyInstall(_) => "PolicyInstall",
        Kind::AuditAck(_) => "AuditAck",
        Kind::StoreBehind(_) => "StoreBehind",
    }
}
