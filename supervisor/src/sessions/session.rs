//! One isolated session per hosted instance: a tokio task (on the member's one shared runtime)
//! with its own launch material, grant, sidecar stream, tracing span (member, route, instance,
//! term), cancellation token and status.
//!
//! A session is driven by [`SessionEvent`]s (snapshots and sidecar streams routed to it), by
//! its sidecar's messages, by its single in-flight gateway call and by its timers. The
//! takeover is in [`super::takeover`], the relayed workload requests in [`super::relay`].
//!
//! Ending: omission relinquishes (Relinquish to the sidecar, the workload keeps running);
//! `stop_routes` stops (Release, then the sidecar's Stopped). A stopping session is never
//! abandoned: neither cancellation (the member exiting), nor its handle being dropped, nor a
//! later snapshot ends it before the stop completed or [`STOP_BOUND`] passed; and a new
//! session for the same route (a new instance generation) runs beside it at once.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use proto::common::v1::{InstancePhase, InstanceRef};
use proto::host::v1::{InstanceCounters, InstanceStatus};
use proto::runtime::v1::supervisor_message::Kind;
use proto::runtime::v1::{Release, Relinquish, Stopped, sidecar_message};
use proto::timing;
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tracing::Instrument;

use super::plan::{Assignment, Credentials, Grant, Held, TermPhase};
use super::takeover::{CallOutcome, Stage};
use crate::gateway::Gateway;
use crate::runtime::route::{Me, RouteTable};
use crate::runtime::stream::SidecarStream;

/// Longest a stop may take once a sidecar has been seen: delivering the Release (the sidecar
/// may be reconnecting) and the workload's exit (SIGTERM, then SIGKILL after the Pod's grace).
pub const STOP_BOUND: Duration = Duration::from_secs(60);
/// How long a stop waits for a sidecar when none ever connected to this session.
pub const UNSEEN_STOP_BOUND: Duration = timing::RUNTIME_SILENCE_TIMEOUT;
/// Counter-only status changes (progress) are announced at most this often per session.
const COUNTER_REPORT_INTERVAL: Duration = Duration::from_secs(1);
/// Longest free text taken from a sidecar (runtime.proto: 0..256 bytes).
const MAX_SIDECAR_TEXT_BYTES: usize = 256;

/// What every session of a member process shares.
pub(crate) struct Shared {
    pub me: Me,
    pub gateway: Arc<Gateway>,
    /// For the recovery deadline of the latest snapshot.
    pub table: watch::Receiver<Arc<RouteTable>>,
}

/// What the member tells a session.
#[derive(Debug)]
pub enum SessionEvent {
    /// The snapshot assigns a higher term, or activates the current one, or brings material
    /// or a grant.
    Ownership(Assignment),
    /// `stop_routes`: stop the workload (runtime.v1.Release) and end the session.
    Stop,
    /// Omitted from the snapshot: give up ownership (runtime.v1.Relinquish), leave the workload
    /// running, end the session.
    Relinquish,
    /// A sidecar stream of this instance (runtime.v1.Connect after authentication).
    Sidecar(Box<SidecarStream>),
}

/// The member's side of a running session.
pub(crate) struct SessionHandle {
    held: Held,
    events: mpsc::UnboundedSender<SessionEvent>,
    cancel: CancellationToken,
    status: watch::Receiver<InstanceStatus>,
    task: JoinHandle<()>,
}

impl SessionHandle {
    /// Starts the session task for `instance` at `assignment`.
    pub(crate) fn spawn(
        shared: Arc<Shared>,
        route: &str,
        instance: InstanceRef,
        assignment: Assignment,
        changed: Arc<Notify>,
    ) -> Self {
        let held = Held {
            instance: instance.clone(),
            term: assignment.term,
            phase: assignment.phase,
            has_credentials: assignment.credentials.is_some(),
            has_grant: assignment.grant.is_some(),
        };
        let span = tracing::info_span!(
            "session",
            member = %shared.me.member,
            route = %route,
            instance = %instance,
            term = assignment.term,
        );
        let mut session = Session {
            shared,
            route: route.to_owned(),
            instance,
            credentials: None,
            term: 0,
            stage: Stage::Reserved { asked: false },
            grant: None,
            grant_deadline: None,
            sidecar: None,
            ever_connected: false,
            lost_at_active: false,
            call: None,
            stop: None,
            ended: None,
            counters: InstanceCounters::default(),
            workload_pid: 0,
            status: watch::Sender::new(InstanceStatus::default()),
            changed,
            counters_announced: Instant::now(),
            counters_pending: false,
        };
        session.on_ownership(assignment);
        session.publish();
        let status = session.status.subscribe();
        let (events, inbox) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        let task = tokio::spawn(session.run(inbox, cancel.clone()).instrument(span));
        Self {
            held,
            events,
            cancel,
            status,
            task,
        }
    }

    pub(crate) fn held(&self) -> &Held {
        &self.held
    }

    /// The session's inbox, for the route table.
    pub(crate) fn events(&self) -> mpsc::UnboundedSender<SessionEvent> {
        self.events.clone()
    }

    /// Sends an event to the session (a session that already ended ignores it).
    pub(crate) fn send(&mut self, event: SessionEvent) {
        if let SessionEvent::Ownership(assignment) = &event {
            if assignment.term > self.held.term {
                self.held.has_grant = false;
            }
            self.held.term = assignment.term;
            self.held.phase = assignment.phase;
            self.held.has_credentials |= assignment.credentials.is_some();
            self.held.has_grant |= assignment.grant.is_some();
        }
        let _ended = self.events.send(event);
    }

    pub(crate) fn status(&self) -> InstanceStatus {
        self.status.borrow().clone()
    }

    /// Ends the session task without stopping or releasing anything (the member exits). A
    /// session that is stopping completes its stop first; await the returned task for that.
    pub(crate) fn abandon(self) -> JoinHandle<()> {
        self.cancel.cancel();
        self.task
    }
}

/// A stop in progress.
pub(super) struct Stop {
    pub since: Instant,
    pub until: Instant,
    /// A Release was sent on some stream.
    pub sent: bool,
}

/// The sidecar stream the session holds and what happened on it.
pub(super) struct Sidecar {
    pub stream: SidecarStream,
    /// This term's grant was presented on this stream.
    pub presented: bool,
    /// The sidecar answered that presentation with a receipt.
    pub receipted: bool,
    /// This stream relays for the active term (Attached or ActivationConfirm sent).
    pub attached: bool,
    /// Release sent on this stream.
    pub released: bool,
}

pub(super) type Call = Pin<Box<dyn Future<Output = CallOutcome> + Send>>;

/// The task's state: this instance's own material, grant, stream and status.
pub(super) struct Session {
    pub shared: Arc<Shared>,
    pub route: String,
    pub instance: InstanceRef,
    pub credentials: Option<Credentials>,
    pub term: u64,
    pub stage: Stage,
    /// The grant for `term`, once obtained.
    pub grant: Option<Grant>,
    /// The grant is useless after this unless receipted.
    pub grant_deadline: Option<Instant>,
    pub sidecar: Option<Sidecar>,
    pub ever_connected: bool,
    /// The relaying stream of the active term was lost (RECOVERING).
    pub lost_at_active: bool,
    /// The one gateway call in flight (IssueGrant or Activate), never retried.
    pub call: Option<Call>,
    pub stop: Option<Stop>,
    /// Set when the session ends: its final phase and message.
    pub ended: Option<(InstancePhase, String)>,
    pub counters: InstanceCounters,
    pub workload_pid: u32,
    status: watch::Sender<InstanceStatus>,
    changed: Arc<Notify>,
    counters_announced: Instant,
    /// Counters changed since the last announcement.
    counters_pending: bool,
}

enum Wake {
    Cancelled,
    Event(Option<SessionEvent>),
    Message(Result<Option<sidecar_message::Kind>, Status>),
    Heartbeat,
    Silent,
    Call(CallOutcome),
    Deadline,
}

impl Session {
    async fn run(mut self, inbox: mpsc::UnboundedReceiver<SessionEvent>, cancel: CancellationToken) {
        tracing::info!(phase = %self.status.borrow().phase(), "session started");
        let mut inbox = Some(inbox);
        let mut heartbeat = tokio::time::interval(timing::RUNTIME_HEARTBEAT_INTERVAL);
        heartbeat.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            self.advance();
            self.publish();
            if let Some((phase, message)) = &self.ended {
                tracing::info!(%phase, %message, "session ended");
                return; // Dropping the sidecar stream ends it.
            }
            let silent_at = self.sidecar.as_ref().map(|s| s.stream.silent_at());
            let deadline = self.deadline();
            let wake = tokio::select! {
                () = cancel.cancelled(), if self.stop.is_none() => Wake::Cancelled,
                event = recv(&mut inbox) => Wake::Event(event),
                message = next_message(&mut self.sidecar) => Wake::Message(message),
                _ = heartbeat.tick() => Wake::Heartbeat,
                () = sleep_until(silent_at) => Wake::Silent,
                outcome = finish_call(&mut self.call) => Wake::Call(outcome),
                () = sleep_until(deadline) => Wake::Deadline,
            };
            match wake {
                Wake::Cancelled => {
                    tracing::debug!("session abandoned; the workload keeps running");
                    return;
                }
                // The member dropped the handle: only a stop in progress continues.
                Wake::Event(None) if self.stop.is_some() => inbox = None,
                Wake::Event(None) => return,
                Wake::Event(Some(event)) => self.on_event(event),
                Wake::Message(Ok(Some(message))) => self.on_message(message),
                Wake::Message(Ok(None)) => self.lose_sidecar("the sidecar closed the stream"),
                Wake::Message(Err(status)) => self.lose_sidecar(status.message()),
                Wake::Heartbeat => {
                    if let Some(sidecar) = &mut self.sidecar
                        && !sidecar.stream.heartbeat()
                    {
                        self.lose_sidecar("the sidecar is not reading the stream");
                    }
                }
                Wake::Silent => self.lose_sidecar("the sidecar went silent"),
                Wake::Call(outcome) => self.on_call(outcome),
                Wake::Deadline => self.on_deadline(),
            }
        }
    }

    fn on_event(&mut self, event: SessionEvent) {
        match event {
            SessionEvent::Ownership(assignment) => self.on_ownership(assignment),
            SessionEvent::Stop => self.on_stop(),
            SessionEvent::Relinquish => self.on_relinquish(),
            SessionEvent::Sidecar(stream) => self.on_sidecar(*stream),
        }
    }

    fn on_message(&mut self, message: sidecar_message::Kind) {
        match message {
            sidecar_message::Kind::Receipt(receipt) => self.on_receipt(receipt),
            sidecar_message::Kind::WorkloadRequest(request) => self.on_request(request),
            sidecar_message::Kind::Stopped(stopped) => self.on_stopped(&stopped),
            sidecar_message::Kind::RecoveryHello(hello) => {
                self.note_workload(hello.workload.map_or(0, |w| w.pid));
                if hello.fence_term > self.term
                    && let Some(fenced) = self.sidecar.take()
                {
                    return self.fenced(fenced.stream, hello.fence_term);
                }
                if let Some(sidecar) = &mut self.sidecar {
                    // The sidecar lost us on this very stream (e.g. it froze): decide again.
                    let opening = &mut sidecar.stream.opening;
                    opening.fence_term = hello.fence_term;
                    opening.relinquished = hello.relinquished;
                    opening.recovering = true;
                    if sidecar.attached {
                        sidecar.attached = false;
                        self.lost_at_active = true;
                    }
                }
            }
            sidecar_message::Kind::WorkloadStarted(started) => {
                self.note_workload(started.workload.map_or(0, |w| w.pid));
            }
            sidecar_message::Kind::Attach(_) | sidecar_message::Kind::Heartbeat(_) => {}
        }
    }

    /// A sidecar stream for this instance: it replaces the one held (the sidecar reconnected).
    fn on_sidecar(&mut self, stream: SidecarStream) {
        self.counters.sidecar_connects += 1;
        if let Some(stop) = &mut self.stop
            && !self.ever_connected
        {
            // A stop that waited for any sidecar now has one: give it the full bound.
            stop.until = stop.since + STOP_BOUND;
        }
        self.ever_connected = true;
        self.note_workload(stream.opening.workload.pid);
        let fence = stream.opening.fence_term;
        tracing::info!(
            fence,
            recovering = stream.opening.recovering,
            stream = stream.id,
            "sidecar connected"
        );
        if let Some(old) = self.sidecar.take()
            && old.attached
        {
            self.lost_at_active = true;
        }
        if fence > self.term {
            return self.fenced(stream, fence);
        }
        self.sidecar = Some(Sidecar {
            stream,
            presented: false,
            receipted: false,
            attached: false,
            released: false,
        });
    }

    /// The sidecar activated a higher term: this member is fenced for the route.
    fn fenced(&mut self, stream: SidecarStream, fence: u64) {
        let reason = format!(
            "fenced: the sidecar activated term {fence}, above this member's term {}",
            self.term
        );
        stream.end(Status::failed_precondition(reason.clone()));
        self.fail(reason);
    }

    fn lose_sidecar(&mut self, reason: &str) {
        if let Some(sidecar) = self.sidecar.take() {
            tracing::info!(reason, stream = sidecar.stream.id, "sidecar stream lost");
            self.lost_at_active |= sidecar.attached;
        }
    }

    fn on_stop(&mut self) {
        if self.stop.is_some() || self.ended.is_some() {
            return;
        }
        let bound = if self.ever_connected {
            STOP_BOUND
        } else {
            UNSEEN_STOP_BOUND
        };
        tracing::info!(?bound, "stopping the workload");
        let since = Instant::now();
        self.stop = Some(Stop {
            since,
            until: since + bound,
            sent: false,
        });
        if let Stage::Failed(reason) = &self.stage {
            self.ended = Some((InstancePhase::Failed, format!("cannot stop: {reason}")));
        }
    }

    /// Omitted from the snapshot: Relinquish the activated term (the workload keeps running)
    /// and end. A stop in progress wins.
    fn on_relinquish(&mut self) {
        if self.stop.is_some() {
            return;
        }
        if let Some(sidecar) = self.sidecar.take()
            && sidecar.attached
            && matches!(self.stage, Stage::Active { .. })
        {
            sidecar.stream.send(Kind::Relinquish(Relinquish { term: self.term }));
            tracing::info!("relinquished the term to the sidecar");
        }
        self.ended = Some((
            InstancePhase::Relinquished,
            "released: the workload keeps running".to_owned(),
        ));
    }

    fn on_stopped(&mut self, stopped: &Stopped) {
        let mut reason = stopped.reason.clone();
        plumbing::text::truncate(&mut reason, MAX_SIDECAR_TEXT_BYTES);
        self.ended = Some((InstancePhase::Stopped, format!("the workload stopped: {reason}")));
    }

    /// Delivers a pending Release once the sidecar accepts it from this member: on the stream
    /// of the activated term, or the stream that receipted this member's grant.
    pub(super) fn deliver_release(&mut self) {
        let (Some(stop), Some(sidecar)) = (&mut self.stop, &mut self.sidecar) else {
            return;
        };
        if sidecar.released || !(sidecar.attached || sidecar.receipted) {
            return;
        }
        let release = Release {
            term: self.term,
            reason: "the gateway withdrew the instance".to_owned(),
        };
        if sidecar.stream.send(Kind::Release(release)) {
            tracing::info!(
                stream = sidecar.stream.id,
                "release sent; waiting for the workload to stop"
            );
            sidecar.released = true;
            stop.sent = true;
        }
    }

    fn deadline(&self) -> Option<Instant> {
        let counters = self
            .counters_pending
            .then_some(self.counters_announced + COUNTER_REPORT_INTERVAL);
        [self.grant_deadline, self.stop.as_ref().map(|s| s.until), counters]
            .into_iter()
            .flatten()
            .min()
    }

    fn on_deadline(&mut self) {
        let now = Instant::now();
        if self.counters_pending && now >= self.counters_announced + COUNTER_REPORT_INTERVAL {
            self.announce();
        }
        if self.grant_deadline.is_some_and(|d| now >= d) {
            self.grant_deadline = None;
            self.fail(format!(
                "the grant for term {} expired before the sidecar receipted it",
                self.term
            ));
        }
        if let Some(stop) = self.stop.as_ref().filter(|s| now >= s.until)
            && self.ended.is_none()
        {
            self.ended = Some(if stop.sent {
                (
                    InstancePhase::Stopped,
                    "release sent; the sidecar did not report the workload's exit in time".to_owned(),
                )
            } else if !self.ever_connected {
                (
                    InstancePhase::Stopped,
                    "withdrawn before any sidecar connected: nothing to release".to_owned(),
                )
            } else {
                (
                    InstancePhase::Failed,
                    "the release could not be delivered: the sidecar did not reconnect in time".to_owned(),
                )
            });
        }
    }

    /// This term cannot be run by this member process; a stop in progress ends with it.
    pub(super) fn fail(&mut self, reason: String) {
        tracing::warn!(%reason, "instance failed for this term");
        self.call = None;
        self.grant_deadline = None;
        if self.stop.is_some() {
            self.ended = Some((InstancePhase::Failed, format!("cannot stop: {reason}")));
        }
        self.stage = Stage::Failed(reason);
    }

    pub(super) fn note_workload(&mut self, pid: u32) {
        if pid != 0 {
            self.workload_pid = pid;
        }
    }

    pub(super) fn recovery_deadline_ms(&self) -> u64 {
        self.shared.table.borrow().recovery_deadline_ms
    }

    /// Publishes the status; phase, term, message and PID changes are announced at once,
    /// counter-only changes at most every [`COUNTER_REPORT_INTERVAL`] (deferred, not dropped).
    pub(super) fn publish(&mut self) {
        let (phase, message) = self.phase();
        let next = InstanceStatus {
            route: self.route.clone(),
            instance: Some(self.instance.clone()),
            term: self.term,
            phase: phase as i32,
            workload_pid: self.workload_pid,
            message,
            counters: Some(self.counters),
            observed_at_ms: 0,
        };
        let mut change = None;
        self.status.send_if_modified(|status| {
            let key = |s: &InstanceStatus| (s.term, s.phase, s.workload_pid, s.message.clone());
            if key(status) != key(&next) {
                *status = InstanceStatus {
                    observed_at_ms: now_ms(),
                    ..next
                };
                change = Some(true);
            } else if status.counters != next.counters {
                status.counters = next.counters;
                change = Some(false);
            }
            change.is_some()
        });
        match change {
            Some(true) => self.announce(),
            Some(false) if self.counters_announced.elapsed() >= COUNTER_REPORT_INTERVAL => self.announce(),
            Some(false) => self.counters_pending = true,
            None => {}
        }
    }

    fn announce(&mut self) {
        self.counters_announced = Instant::now();
        self.counters_pending = false;
        self.changed.notify_one();
    }

    fn phase(&self) -> (InstancePhase, String) {
        if let Some(ended) = &self.ended {
            return ended.clone();
        }
        let (phase, message) = match &self.stage {
            Stage::Failed(reason) => return (InstancePhase::Failed, reason.clone()),
            Stage::Active { .. } if self.sidecar.as_ref().is_some_and(|s| s.attached) => (InstancePhase::Active, ""),
            Stage::Active { .. } if self.lost_at_active => (
                InstancePhase::Recovering,
                "the sidecar stream was lost; waiting for the sidecar to reconnect",
            ),
            Stage::Active { .. } => (InstancePhase::Active, "waiting for the sidecar to attach"),
            Stage::Reserved { .. } | Stage::Activating => (InstancePhase::Starting, self.starting_detail()),
        };
        let message = if self.stop.is_some() {
            "stopping: waiting for the workload to exit"
        } else {
            message
        };
        (phase, message.to_owned())
    }
}

async fn recv(inbox: &mut Option<mpsc::UnboundedReceiver<SessionEvent>>) -> Option<SessionEvent> {
    match inbox {
        Some(inbox) => inbox.recv().await,
        None => std::future::pending().await,
    }
}

async fn next_message(sidecar: &mut Option<Sidecar>) -> Result<Option<sidecar_message::Kind>, Status> {
    match sidecar {
        Some(sidecar) => sidecar.stream.next().await,
        None => std::future::pending().await,
    }
}

async fn finish_call(call: &mut Option<Call>) -> CallOutcome {
    let Some(future) = call.as_mut() else {
        return std::future::pending().await;
    };
    let outcome = future.await;
    *call = None;
    outcome
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

pub(super) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

impl TermPhase {
    pub(super) fn initial_stage(self) -> Stage {
        match self {
            TermPhase::Reserved => Stage::Reserved { asked: false },
            TermPhase::Active => Stage::Active { activation: None },
        }
    }
}
