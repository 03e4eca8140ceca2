//! What the machine takes in (`Event`) and what it asks its driver to do (`Effect`): plain
//! data, so the machine's decisions can be checked without sockets, files or a runtime.

use std::time::Instant;

use proto::common::v1::WorkloadIdentity;
use proto::registry::v1::{RecoveryFailedRequest, RegisterResponse};
use proto::runtime::v1::{SupervisorMessage, sidecar_message};
use proto::trust::TrustBundle;

use crate::process::Exit;
use crate::runtime_link::{First, StreamId};
use crate::state_file::State;
use crate::supervision::Token;
use crate::workload::{Admission, Answer, Op};

/// Refusal of a process that does not descend from the pinned workload.
pub(crate) const NOT_DESCENDANT: &str = "only the workload process and its descendants may use this socket";

/// Where a workload request's answer goes. The machine asks only whether anyone still waits.
pub(crate) trait Reply {
    /// The requester is gone: the request is not relayed.
    fn is_closed(&self) -> bool;
}

/// The time an event happens at: the monotonic instant for deadlines and budgets, Unix
/// milliseconds for token expiry and the persisted recovery deadline.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Now {
    pub at: Instant,
    pub unix_ms: i64,
}

/// The trust bundle a grant or activation proof is verified against, read by the driver.
#[derive(Clone, Debug)]
pub(crate) struct Keys {
    pub bundle: Result<std::sync::Arc<TrustBundle>, String>,
    /// Read again on purpose (after an unknown `kid`): no further reload is asked for.
    pub fresh: bool,
}

/// Why the engine stopped.
#[derive(Clone, Debug)]
pub(crate) enum Ending {
    Released { reason: String },
    Exited,
    RecoveryFailed { request: RecoveryFailedRequest },
    Shutdown,
}

/// An input of the machine: from its streams, the workload endpoint, the registration, the
/// process watcher, the clock, or the result of an effect it asked for.
#[derive(Debug)]
pub(crate) enum Event<R> {
    /// The driver starts (a restarted sidecar resumes on its persisted generation).
    Started,
    Registered(RegisterResponse),
    /// The instant `Machine::next_wake` named (or a later one) has come.
    Tick,
    Shutdown,
    /// The pinned workload process ended.
    Exited(Exit),
    Opened(StreamId),
    Closed {
        id: StreamId,
        opened: bool,
        reason: String,
    },
    /// A member message; a grant or an activation confirmation without `keys` is answered by
    /// `Effect::Verify`.
    Message {
        id: StreamId,
        message: SupervisorMessage,
        keys: Option<Keys>,
    },
    /// A process connected to the workload socket (answered by one `Effect::Admit*`).
    Peer {
        pid: Option<u32>,
    },
    /// Pin the workload to this observed process (answered by one `Effect::Admit*`).
    Pin(WorkloadIdentity),
    Request {
        op: Op,
        reply: R,
    },
    /// The outcome of the last `Effect::Commit`.
    Committed(Result<(), String>),
    /// An `Effect::Send` the stream could not take: `congested` (its queue is full) or ended.
    Unsent {
        id: StreamId,
        request: Option<u64>,
        congested: bool,
    },
    /// An `Effect::Dial` that could not start (no token to present).
    Undialed {
        id: StreamId,
        reason: String,
    },
    /// The audit spool holds records up to this sequence.
    AuditPending(u64),
    /// The batch `Effect::FetchAudit` asked for (empty: nothing after the sequence asked), and
    /// the spool's count of dropped records.
    AuditFetched {
        records: Vec<proto::runtime::v1::AuditRecord>,
        dropped: u64,
    },
}

/// What the machine asks its driver to do, in order.
#[derive(Debug)]
pub(crate) enum Effect<R> {
    /// Persist the state; a failure is only logged (nothing waits on it).
    Persist(Box<State>),
    /// Persist the state and feed the outcome back as `Event::Committed` before anything else:
    /// whatever depends on it is sent only after a successful commit.
    Commit(Box<State>),
    /// Open stream `id` to `address` presenting `token` (the mounted token when `None`).
    Dial {
        id: StreamId,
        address: String,
        first: First,
        token: Option<Token>,
    },
    Send {
        id: StreamId,
        kind: sidecar_message::Kind,
    },
    /// Drop the stream at once (fencing): nothing more is read from it.
    Abort(StreamId),
    Answer {
        reply: R,
        answer: Answer,
    },
    /// The answer to the `Peer` or `Pin` event being handled.
    Admit(Admission),
    /// Admit the `Peer` being handled if `pid` descends from `ancestor` (read from `/proc`).
    AdmitDescendant {
        pid: u32,
        ancestor: u32,
    },
    /// Watch the workload process pinned from the socket's peer credentials.
    Watch(WorkloadIdentity),
    /// Stop the pinned workload (SIGTERM, SIGKILL after the grace period).
    StopWorkload,
    /// Ask the audit spool for its next batch after this sequence (answered by
    /// `Event::AuditFetched`).
    FetchAudit {
        after: u64,
    },
    /// The gateway stored the audit records up to this sequence: the spool drops them.
    AckAudit(u64),
    /// Decide egress from this revision from now on (it is persisted first).
    Enforce(std::sync::Arc<crate::egress::Policy>),
    /// Read the trust bundle (again, on purpose, when `reload`) and deliver `message` once
    /// more with it.
    Verify {
        id: StreamId,
        message: SupervisorMessage,
        reload: bool,
    },
    /// Register again now, saying where the instance stands (a recovering sidecar whose
    /// registry may have lost the instance).
    Register(crate::registration::Standing),
    /// The machine is finished.
    Done {
        ending: Ending,
        exit: Option<Exit>,
    },
}
