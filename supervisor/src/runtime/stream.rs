//! One sidecar's `runtime.v1.Connect` stream as the member holds it: the opening message
//! (Attach or RecoveryHello, validated), the inbound messages, a bounded outbound queue and
//! the liveness bookkeeping (heartbeat sequence, last message heard).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use proto::common::v1::{InstanceRef, WorkloadIdentity};
use proto::runtime::v1::supervisor_message::Kind;
use proto::runtime::v1::{Heartbeat, SidecarMessage, SupervisorMessage, sidecar_message};
use proto::timing;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::{Status, Streaming};

/// Messages queued towards one sidecar; a full queue means it stopped reading, and the stream
/// is dropped.
pub const OUTBOUND_CAPACITY: usize = 64;

/// What the sidecar said when it opened the stream (Attach or RecoveryHello), updated by
/// later RecoveryHellos on the same stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opening {
    pub route: String,
    pub instance: InstanceRef,
    /// The highest term the sidecar has activated.
    pub fence_term: u64,
    /// RecoveryHello only: the recovery began with a Relinquish of `fence_term`.
    pub relinquished: bool,
    pub recovering: bool,
    pub workload: WorkloadIdentity,
}

impl Opening {
    /// Validates a first message (runtime.proto: INVALID_ARGUMENT when it is neither Attach
    /// nor RecoveryHello or a field is out of bounds).
    pub fn parse(message: Option<SidecarMessage>) -> Result<Self, Status> {
        let opening = match message.and_then(|m| m.kind) {
            Some(sidecar_message::Kind::Attach(attach)) => Self {
                route: attach.route,
                instance: attach.instance.unwrap_or_default(),
                fence_term: attach.fence_term,
                relinquished: false,
                recovering: false,
                workload: attach.workload.unwrap_or_default(),
            },
            Some(sidecar_message::Kind::RecoveryHello(hello)) => Self {
                route: hello.route,
                instance: hello.instance.unwrap_or_default(),
                fence_term: hello.fence_term,
                relinquished: hello.relinquished,
                recovering: true,
                workload: hello.workload.unwrap_or_default(),
            },
            _ => {
                return Err(Status::invalid_argument(
                    "the first message must be Attach or RecoveryHello",
                ));
            }
        };
        opening.check()?;
        Ok(opening)
    }

    fn check(&self) -> Result<(), Status> {
        if plumbing::validate::route(&self.route).is_err() {
            return Err(Status::invalid_argument(
                "route must be 1..=256 bytes of printable ASCII without whitespace",
            ));
        }
        let i = &self.instance;
        let instance_ok = (1..=63).contains(&i.namespace.len())
            && (1..=253).contains(&i.name.len())
            && (1..=64).contains(&i.uid.len())
            && i.generation >= 1;
        if !instance_ok {
            return Err(Status::invalid_argument(
                "instance must carry namespace, name, uid and a generation >= 1",
            ));
        }
        if self.workload.exe_digest.len() > 32 {
            return Err(Status::invalid_argument("workload.exe_digest is longer than 32 bytes"));
        }
        Ok(())
    }
}

/// One open sidecar stream. Dropping it ends the response stream with OK; [`end`](Self::end)
/// ends it with a status.
pub struct SidecarStream {
    /// Unique per member process: which stream a grant was presented on.
    pub id: u64,
    pub opening: Opening,
    inbound: Streaming<SidecarMessage>,
    outbound: mpsc::Sender<Result<SupervisorMessage, Status>>,
    sequence: u64,
    last_heard: Instant,
}

impl fmt::Debug for SidecarStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SidecarStream")
            .field("id", &self.id)
            .field("opening", &self.opening)
            .finish_non_exhaustive()
    }
}

impl SidecarStream {
    pub fn new(
        opening: Opening,
        inbound: Streaming<SidecarMessage>,
        outbound: mpsc::Sender<Result<SupervisorMessage, Status>>,
    ) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            opening,
            inbound,
            outbound,
            sequence: 0,
            last_heard: Instant::now(),
        }
    }

    /// Queues a message. False when the sidecar is gone or not reading (drop the stream).
    pub fn send(&self, kind: Kind) -> bool {
        self.try_send(SupervisorMessage { kind: Some(kind) }).is_ok()
    }

    /// Queues a message; the message back when the sidecar is gone or not reading.
    pub fn try_send(&self, message: SupervisorMessage) -> Result<(), SupervisorMessage> {
        self.outbound
            .try_send(Ok(message))
            .map_err(|err| err.into_inner().unwrap_or_default())
    }

    /// Sends the next heartbeat. False when the stream is unusable.
    pub fn heartbeat(&mut self) -> bool {
        self.sequence += 1;
        self.send(Kind::Heartbeat(Heartbeat {
            sequence: self.sequence,
        }))
    }

    /// The next message from the sidecar: `Ok(None)` when it closed the stream. Any message
    /// counts as liveness; heartbeats are consumed here.
    pub async fn next(&mut self) -> Result<Option<sidecar_message::Kind>, Status> {
        loop {
            let Some(message) = self.inbound.message().await? else {
                return Ok(None);
            };
            self.last_heard = Instant::now();
            match message.kind {
                Some(sidecar_message::Kind::Heartbeat(_)) | None => {}
                Some(kind) => return Ok(Some(kind)),
            }
        }
    }

    /// When the stream counts as dead unless the sidecar says something.
    pub fn silent_at(&self) -> Instant {
        self.last_heard + timing::RUNTIME_SILENCE_TIMEOUT
    }

    /// Ends the stream with `status` (a refusal).
    pub fn end(self, status: Status) {
        let _gone = self.outbound.try_send(Err(status));
    }
}
