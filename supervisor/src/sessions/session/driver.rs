//! The driver: runs one session's machine as a tokio task on the member's one runtime. It owns
//! what the machine only names — the sidecar streams, the gateway call in flight, the
//! heartbeat and wake timers, the inbox and the status channel — turns inputs into events and
//! carries out the effects in order. Nothing here blocks (the gateway call is polled beside
//! the rest); a send a stream cannot take is fed back before any later effect.

use std::collections::{BTreeMap, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::time::SystemTime;

use proto::host::v1::InstanceStatus;
use proto::runtime::v1::{SupervisorMessage, sidecar_message};
use proto::timing;
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::effect::{Effect, Event, Now, StreamId};
use super::machine::Machine;
use super::{SessionEvent, Shared};
use crate::gateway::Gateway;
use crate::runtime::route::RouteTable;
use crate::runtime::stream::SidecarStream;

type Call = Pin<Box<dyn Future<Output = Event> + Send>>;

/// The session's inbox: what the member says and the sidecar streams routed to it. A closed
/// side is `None` (nobody can send on it any more).
pub(super) struct Inbox {
    pub member: Option<mpsc::Receiver<SessionEvent>>,
    pub sidecars: Option<mpsc::Receiver<Box<SidecarStream>>>,
}

impl Inbox {
    /// The member's side closed: `Orphaned` once both are.
    fn close_member(&mut self) -> Option<Event> {
        self.member = None;
        self.sidecars.is_none().then_some(Event::Orphaned)
    }

    /// The sidecars' side closed: `Orphaned` once both are.
    fn close_sidecars(&mut self) -> Option<Event> {
        self.sidecars = None;
        self.member.is_none().then_some(Event::Orphaned)
    }
}

pub(super) struct Driver {
    machine: Machine,
    gateway: Arc<Gateway>,
    /// For the recovery deadline of the latest snapshot.
    table: watch::Receiver<Arc<RouteTable>>,
    /// The member's file…
    policy: watch::Receiver<Option<Arc<proto::runtime::v1::EgressPolicy>>>,
    /// …unless the snapshots assign this instance one.
    assigned: watch::Receiver<Option<Arc<proto::runtime::v1::EgressPolicy>>>,
    streams: BTreeMap<StreamId, SidecarStream>,
    call: Option<Call>,
    /// The audit records being stored (beside the recovery call).
    audit: Option<Call>,
    status: watch::Sender<InstanceStatus>,
    changed: Arc<Notify>,
    done: bool,
}

/// What woke the driver.
enum Wake {
    Event(Event),
    Member(Option<SessionEvent>),
    Sidecar(Option<Box<SidecarStream>>),
    Message(StreamId, Result<Option<sidecar_message::Kind>, Status>),
    Heartbeat,
}

impl Driver {
    /// The policy to install: the one assigned, else the member's file.
    fn effective_policy(&mut self) -> Option<Arc<proto::runtime::v1::EgressPolicy>> {
        let file = self.policy.borrow_and_update().clone();
        self.assigned.borrow_and_update().clone().or(file)
    }

    pub(super) fn new(
        machine: Machine,
        shared: &Shared,
        assigned: watch::Receiver<Option<Arc<proto::runtime::v1::EgressPolicy>>>,
        status: watch::Sender<InstanceStatus>,
        changed: Arc<Notify>,
    ) -> Self {
        Self {
            machine,
            gateway: Arc::clone(&shared.gateway),
            table: shared.table.clone(),
            policy: shared.policy.clone(),
            assigned,
            streams: BTreeMap::new(),
            call: None,
            audit: None,
            status,
            changed,
            done: false,
        }
    }

    pub(super) async fn run(mut self, mut inbox: Inbox, cancel: CancellationToken) {
        let mut heartbeat = tokio::time::interval(timing::RUNTIME_HEARTBEAT_INTERVAL);
        heartbeat.set_missed_tick_behavior(MissedTickBehavior::Delay);
        while !self.done {
            let held = self.machine.held_stream();
            let stopping = self.machine.stopping();
            let wake_at = self.machine.next_wake().map(Instant::from_std);
            let stream = held.and_then(|id| self.streams.get_mut(&id));
            let silent_at = stream.as_ref().map(|s| s.silent_at());
            let wake = tokio::select! {
                () = cancel.cancelled(), if !stopping => Wake::Event(Event::Abandoned),
                event = recv(&mut inbox.member) => Wake::Member(event),
                stream = recv(&mut inbox.sidecars) => Wake::Sidecar(stream),
                (id, message) = next_message(stream) => Wake::Message(id, message),
                _ = heartbeat.tick() => Wake::Heartbeat,
                Ok(()) = self.policy.changed() => Wake::Event(Event::Policy(self.effective_policy())),
                Ok(()) = self.assigned.changed() => Wake::Event(Event::Policy(self.effective_policy())),
                () = sleep_until(silent_at) => Wake::Event(lost(held, "the sidecar went silent")),
                event = finish_call(&mut self.call) => Wake::Event(event),
                event = finish_call(&mut self.audit) => Wake::Event(event),
                () = sleep_until(wake_at) => Wake::Event(Event::Tick),
            };
            let event = match wake {
                Wake::Event(event) => event,
                Wake::Member(Some(event)) => Event::Member(event),
                Wake::Sidecar(Some(stream)) => {
                    let (id, opening) = (stream.id, stream.opening.clone());
                    self.streams.insert(id, *stream);
                    Event::Sidecar { stream: id, opening }
                }
                Wake::Member(None) => match inbox.close_member() {
                    Some(event) => event,
                    None => continue,
                },
                Wake::Sidecar(None) => match inbox.close_sidecars() {
                    Some(event) => event,
                    None => continue,
                },
                Wake::Message(stream, Ok(Some(kind))) => Event::Message { stream, kind },
                Wake::Message(stream, Ok(None)) => lost(Some(stream), "the sidecar closed the stream"),
                Wake::Message(stream, Err(status)) => lost(Some(stream), status.message()),
                Wake::Heartbeat => {
                    let stream = held.and_then(|id| self.streams.get_mut(&id));
                    if stream.is_none_or(SidecarStream::heartbeat) {
                        continue;
                    }
                    lost(held, "the sidecar is not reading the stream")
                }
            };
            self.handle(event);
        }
    }

    /// One event and everything it leads to: each effect in order, a send's failure fed back
    /// at once (its effects run before the rest).
    pub(super) fn handle(&mut self, event: Event) {
        let mut queue: VecDeque<Effect> = self.machine.on(self.now(), event).into();
        while let Some(effect) = queue.pop_front() {
            if let Some(feedback) = self.apply(effect) {
                for effect in self.machine.on(self.now(), feedback).into_iter().rev() {
                    queue.push_front(effect);
                }
            }
        }
    }

    fn apply(&mut self, effect: Effect) -> Option<Event> {
        match effect {
            Effect::Send { stream, kind } => {
                let message = SupervisorMessage { kind: Some(kind) };
                let unsent = match self.streams.get(&stream) {
                    Some(held) => held.try_send(message).err(),
                    None => Some(message),
                };
                return unsent.map(|message| Event::Unsent { stream, message });
            }
            Effect::Refuse { stream, reason } => {
                if let Some(held) = self.streams.remove(&stream) {
                    held.end(Status::failed_precondition(reason));
                }
            }
            Effect::Drop(stream) => {
                self.streams.remove(&stream);
            }
            Effect::IssueGrant(request) => {
                let gateway = Arc::clone(&self.gateway);
                self.call = Some(Box::pin(
                    async move { Event::Granted(gateway.issue_grant(request).await) },
                ));
            }
            Effect::Activate(request) => {
                let gateway = Arc::clone(&self.gateway);
                self.call = Some(Box::pin(
                    async move { Event::Activated(gateway.activate(request).await) },
                ));
            }
            Effect::CancelCall => self.call = None,
            Effect::RecordAudit(request) => {
                let gateway = Arc::clone(&self.gateway);
                let term = request.term;
                self.audit = Some(Box::pin(async move {
                    Event::AuditRecorded {
                        term,
                        result: gateway.record_audit(request).await,
                    }
                }));
            }
            Effect::Publish(status) => {
                self.status.send_replace(*status);
            }
            Effect::Announce => self.changed.notify_one(),
            Effect::Done => {
                // Dropping the streams ends them.
                self.streams.clear();
                self.call = None;
                self.audit = None;
                self.done = true;
            }
        }
        None
    }

    fn now(&self) -> Now {
        now(&self.table)
    }
}

/// The time now, and the recovery deadline the latest snapshot set.
pub(super) fn now(table: &watch::Receiver<Arc<RouteTable>>) -> Now {
    Now {
        at: Instant::now().into_std(),
        unix_ms: proto::trust::unix_ms(SystemTime::now()),
        recovery_deadline_ms: table.borrow().recovery_deadline_ms,
    }
}

fn lost(stream: Option<StreamId>, reason: &str) -> Event {
    Event::Lost {
        stream: stream.unwrap_or_default(),
        reason: reason.to_owned(),
    }
}

async fn recv<T>(receiver: &mut Option<mpsc::Receiver<T>>) -> Option<T> {
    match receiver {
        Some(receiver) => receiver.recv().await,
        None => std::future::pending().await,
    }
}

async fn next_message(stream: Option<&mut SidecarStream>) -> (StreamId, Result<Option<sidecar_message::Kind>, Status>) {
    match stream {
        Some(stream) => (stream.id, stream.next().await),
        None => std::future::pending().await,
    }
}

async fn finish_call(call: &mut Option<Call>) -> Event {
    let Some(future) = call.as_mut() else {
        return std::future::pending().await;
    };
    let event = future.await;
    *call = None;
    event
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
