//! One isolated session per hosted instance: a tokio task (on the member's one shared runtime)
//! with its own launch material, grant, sidecar stream, tracing span (member, route, instance,
//! term), cancellation token and status.
//!
//! Split sans-I/O, as the sidecar's engine: `machine` (with `takeover` and `relay`) decides —
//! `Machine::on(now, event)` returns effects and touches no stream, call, task or clock;
//! `driver` runs it, turning the inbox, the sidecar stream, the gateway call and the timers
//! into `effect::Event`s and carrying out the `effect::Effect`s (send, refuse, drop, issue a
//! grant, activate, publish).
//!
//! Modes (the takeover's `Stage`, with the stop and the end beside it): `Reserved` (the term
//! is reserved for this process: a grant from the snapshot, or IssueGrant sent once, is
//! presented) → `Activating` (the receipt went to Activate, sent once) → `Active` (activated
//! here, with the proof, or adopted from a snapshot; a sidecar at the term is Attached) or
//! `Failed` (this process cannot run the term; only a higher one starts over). Ending:
//! omission relinquishes (Relinquish to the sidecar, the workload keeps running);
//! `stop_routes` stops (Release, then the sidecar's Stopped). A stopping session is never
//! abandoned: neither cancellation (the member exiting), nor its handle being dropped, nor a
//! later snapshot ends it before the stop completed or [`STOP_BOUND`] passed; and a new
//! session for the same route (a new instance generation) runs beside it at once.
//!
//! The inbox is bounded: sidecar streams wait at most [`SIDECAR_INBOX`] deep (a stream beyond
//! it is refused UNAVAILABLE and the sidecar redials); the member's events at most
//! [`MEMBER_INBOX`] deep, and past that in the handle's `inbox::Backlog`, coalesced by term
//! so it stays a few events long, delivered on the next send or status report.

mod driver;
mod effect;
mod inbox;
mod machine;
mod relay;
mod takeover;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use proto::common::v1::InstanceRef;
use proto::host::v1::InstanceStatus;
use proto::timing;
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use self::driver::{Driver, Inbox};
use self::effect::Event;
use self::inbox::Backlog;
use self::machine::{Machine, Setup};
use super::plan::{Assignment, Held};
use crate::gateway::Gateway;
use crate::runtime::route::{Me, RouteTable, Sidecars};

/// Longest a stop may take once a sidecar has been seen: delivering the Release (the sidecar
/// may be reconnecting) and the workload's exit (SIGTERM, then SIGKILL after the Pod's grace).
pub const STOP_BOUND: Duration = Duration::from_secs(60);
/// How long a stop waits for a sidecar when none ever connected to this session.
pub const UNSEEN_STOP_BOUND: Duration = timing::RUNTIME_SILENCE_TIMEOUT;
/// Counter-only status changes (progress) are announced at most this often per session.
const COUNTER_REPORT_INTERVAL: Duration = Duration::from_secs(1);
/// Longest free text taken from a sidecar (runtime.proto: 0..256 bytes).
const MAX_SIDECAR_TEXT_BYTES: usize = 256;
/// Member events a session's inbox holds before they wait in the handle's backlog.
pub const MEMBER_INBOX: usize = 64;
/// Sidecar streams waiting for a session (one sidecar, a few reconnects in flight).
pub const SIDECAR_INBOX: usize = 4;

/// What every session of a member process shares.
pub(crate) struct Shared {
    pub me: Me,
    pub gateway: Arc<Gateway>,
    /// For the recovery deadline of the latest snapshot.
    pub table: watch::Receiver<Arc<RouteTable>>,
    /// Installed in every sidecar this member owns (`--egress-policy`, read again when the
    /// file changes).
    pub policy: watch::Receiver<Option<Arc<proto::runtime::v1::EgressPolicy>>>,
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
    /// The snapshot's route directory names the route at this term, below the one held (the
    /// store lost commits), or 0: it names it not at all while the snapshot keeps it (the store
    /// lost the instance). runtime.v1.StoreBehind.
    StoreBehind(u64),
}

/// The member's side of a running session.
pub(crate) struct SessionHandle {
    held: Held,
    events: mpsc::Sender<SessionEvent>,
    backlog: Backlog,
    sidecars: Sidecars,
    cancel: CancellationToken,
    status: watch::Receiver<InstanceStatus>,
    /// The egress policy the snapshots assign this instance (on Kubernetes); it wins over the
    /// member's file.
    assigned: watch::Sender<Option<Arc<proto::runtime::v1::EgressPolicy>>>,
    task: JoinHandle<()>,
}

impl SessionHandle {
    /// Starts the session task for `instance` at `assignment` (`released`: the highest term of
    /// the instance this process released, 0 if none); its status is published before this
    /// returns.
    pub(crate) fn spawn(
        shared: Arc<Shared>,
        route: &str,
        (instance, released): (InstanceRef, u64),
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
        let setup = Setup {
            route: route.to_owned(),
            instance,
            me: shared.me.clone(),
            policy: shared.policy.borrow().clone(),
            released,
        };
        let (status_tx, status) = watch::channel(InstanceStatus::default());
        let machine = Machine::new(setup, assignment, driver::now(&shared.table));
        let (assigned, assigned_rx) = watch::channel(None);
        let mut driver = Driver::new(machine, &shared, assigned_rx, status_tx, changed);
        span.in_scope(|| driver.handle(Event::Started));
        let (events, member) = mpsc::channel(MEMBER_INBOX);
        let (sidecars, streams) = mpsc::channel(SIDECAR_INBOX);
        let inbox = Inbox {
            member: Some(member),
            sidecars: Some(streams),
        };
        let cancel = CancellationToken::new();
        let task = tokio::spawn(driver.run(inbox, cancel.clone()).instrument(span));
        Self {
            held,
            events,
            backlog: Backlog::default(),
            sidecars,
            cancel,
            status,
            assigned,
            task,
        }
    }

    /// The egress policy the latest snapshot assigns: installed in the sidecar when it differs
    /// from the one assigned before.
    pub(crate) fn assign_policy(&self, policy: &proto::runtime::v1::EgressPolicy) {
        self.assigned.send_if_modified(|current| {
            if current.as_deref() == Some(policy) {
                return false;
            }
            *current = Some(Arc::new(policy.clone()));
            true
        });
    }

    pub(crate) fn held(&self) -> &Held {
        &self.held
    }

    /// Where the route table hands this session its sidecar streams.
    pub(crate) fn sidecars(&self) -> Sidecars {
        self.sidecars.clone()
    }

    /// Sends an event to the session (a session that already ended ignores it). A full inbox
    /// keeps it in the backlog, in order.
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
        self.backlog.push(event);
        self.flush();
    }

    /// Moves what the backlog holds into the inbox, as far as it takes it.
    pub(crate) fn flush(&mut self) {
        self.backlog.deliver(&self.events);
    }

    /// The session's status. A higher term it was sent and has not taken in yet (a move to
    /// a new term on this member) is reported as that term, being taken over: the report after
    /// a snapshot must show every term the snapshot installed, or the gateway reads the term
    /// as acknowledged and not hosted, and moves the instance away.
    pub(crate) fn status(&self) -> InstanceStatus {
        let status = self.status.borrow().clone();
        let phase = proto::common::v1::InstancePhase::from_wire(status.phase);
        if status.term < self.held.term && !phase.is_terminal() {
            return InstanceStatus {
                term: self.held.term,
                phase: proto::common::v1::InstancePhase::Starting as i32,
                ..status
            };
        }
        status
    }

    /// Ends the session task without stopping or releasing anything (the member exits). A
    /// session that is stopping completes its stop first; await the returned task for that.
    pub(crate) fn abandon(self) -> JoinHandle<()> {
        self.cancel.cancel();
        self.task
    }
}
