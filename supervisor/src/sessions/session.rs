//! One isolated session per hosted instance: a tokio task (on the member's one shared runtime)
//! with its own credentials, tracing span (member, route, instance, term), cancellation token
//! and status.
//!
//! The session is driven by [`SessionEvent`]s. Today they come from snapshots only; this is the
//! seam where the runtime.v1 takeover plugs in next: sidecar streams routed to the session
//! become further events, and [`Session::take`] runs grant -> receipt -> activate -> confirm
//! for a RESERVED term instead of merely reporting STARTING.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use proto::common::v1::{InstancePhase, InstanceRef};
use proto::host::v1::{InstanceCounters, InstanceStatus};
use tokio::sync::{Notify, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::plan::{Assignment, Credentials, Held, TermPhase};

/// What the member tells a session.
#[derive(Debug)]
pub enum SessionEvent {
    /// The snapshot assigns a higher term, or activates the current one, or brings material.
    Ownership(Assignment),
    /// `stop_routes`: stop the workload (runtime.v1.Release) and end the session.
    Stop,
    /// Omitted from the snapshot: give up ownership (runtime.v1.Relinquish), leave the workload
    /// running, end the session.
    Relinquish,
}

/// The member's side of a running session.
pub(crate) struct SessionHandle {
    held: Held,
    events: mpsc::UnboundedSender<SessionEvent>,
    cancel: CancellationToken,
    status: watch::Receiver<InstanceStatus>,
}

impl SessionHandle {
    /// Starts the session task for `instance` at `assignment`.
    pub(crate) fn spawn(
        member: &str,
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
        };
        let span = tracing::info_span!(
            "session",
            member = %member,
            route = %route,
            instance = %instance,
            term = assignment.term,
        );
        let mut session = Session {
            route: route.to_owned(),
            instance,
            credentials: None,
            status: watch::Sender::new(InstanceStatus::default()),
            changed,
        };
        session.take(assignment);
        let status = session.status.subscribe();
        let (events, inbox) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        tokio::spawn(session.run(inbox, cancel.clone()).instrument(span));
        Self {
            held,
            events,
            cancel,
            status,
        }
    }

    pub(crate) fn held(&self) -> &Held {
        &self.held
    }

    /// Sends an event to the session (a session that already ended ignores it).
    pub(crate) fn send(&mut self, event: SessionEvent) {
        if let SessionEvent::Ownership(assignment) = &event {
            self.held.term = assignment.term;
            self.held.phase = assignment.phase;
            self.held.has_credentials |= assignment.credentials.is_some();
        }
        let _ended = self.events.send(event);
    }

    pub(crate) fn status(&self) -> InstanceStatus {
        self.status.borrow().clone()
    }

    /// Ends the session task without stopping or releasing anything (the member exits).
    pub(crate) fn abandon(&self) {
        self.cancel.cancel();
    }
}

/// The task's state: this instance's own material and status.
struct Session {
    route: String,
    instance: InstanceRef,
    credentials: Option<Credentials>,
    status: watch::Sender<InstanceStatus>,
    changed: Arc<Notify>,
}

impl Session {
    async fn run(mut self, mut inbox: mpsc::UnboundedReceiver<SessionEvent>, cancel: CancellationToken) {
        tracing::info!(phase = %self.status.borrow().phase(), "session started");
        loop {
            let event = tokio::select! {
                () = cancel.cancelled() => {
                    tracing::debug!("session abandoned; the workload keeps running");
                    return;
                }
                event = inbox.recv() => event,
            };
            match event {
                Some(SessionEvent::Ownership(assignment)) => {
                    tracing::Span::current().record("term", assignment.term);
                    self.take(assignment);
                }
                Some(SessionEvent::Stop) => {
                    // Next issue: send runtime.v1.Release to the sidecar first.
                    return self.finish(InstancePhase::Stopped, "stopped: the gateway withdrew the instance");
                }
                Some(SessionEvent::Relinquish) => {
                    // Next issue: send runtime.v1.Relinquish if this member holds the activated term.
                    return self.finish(InstancePhase::Relinquished, "released: the workload keeps running");
                }
                None => return,
            }
        }
    }

    /// Takes the instance on at `assignment`. The runtime.v1 takeover plugs in here: for a
    /// RESERVED term with material, present the grant to the sidecar, forward its receipt to
    /// recovery.v1.Activate and confirm the activation. Until then a reserved term reports
    /// STARTING and an active one ACTIVE.
    fn take(&mut self, assignment: Assignment) {
        if let Some(credentials) = assignment.credentials {
            self.credentials = Some(credentials);
        }
        let (phase, message) = match (assignment.phase, self.credentials.is_some()) {
            (TermPhase::Active, _) => (InstancePhase::Active, ""),
            (TermPhase::Reserved, true) => (InstancePhase::Starting, "takeover pending"),
            (TermPhase::Reserved, false) => (InstancePhase::Starting, "waiting for launch material"),
        };
        self.publish(assignment.term, phase, message);
    }

    fn finish(self, phase: InstancePhase, message: &str) {
        let term = self.status.borrow().term;
        self.publish(term, phase, message);
        tracing::info!(%phase, "session ended");
    }

    fn publish(&self, term: u64, phase: InstancePhase, message: &str) {
        let changed = self.status.send_if_modified(|status| {
            let before = (status.term, status.phase, status.message.clone());
            if before == (term, phase as i32, message.to_owned()) {
                return false;
            }
            let counters = if status.term == term { status.counters } else { None };
            *status = InstanceStatus {
                route: self.route.clone(),
                instance: Some(self.instance.clone()),
                term,
                phase: phase as i32,
                workload_pid: 0,
                message: message.to_owned(),
                counters: Some(counters.unwrap_or(InstanceCounters::default())),
                observed_at_ms: now_ms(),
            };
            true
        });
        if changed {
            self.changed.notify_one();
        }
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
