//! The machine: one session's term, takeover stage, grant, sidecar bookkeeping, stop and
//! status, and every decision over them. Sans-I/O: `Machine::on(now, event)` returns the
//! `Effect`s to carry out, in order; no stream, call, task or clock is touched here. This file
//! holds the events, the sidecar stream's life, the stop and relinquish, the deadlines and the
//! status; `takeover` the grant → receipt → activate → confirm steps, `relay` the workload's
//! requests.

use std::mem;
use std::time::Instant;

use proto::common::v1::{InstancePhase, InstanceRef};
use proto::host::v1::{InstanceCounters, InstanceStatus};
use proto::runtime::v1::supervisor_message::Kind;
use proto::runtime::v1::{Release, Relinquish, Stopped, sidecar_message};
use proto::timing;
use tracing::{debug, info, warn};

use super::effect::{Effect, Event, Now, StreamId};
use super::takeover::Stage;
use super::{COUNTER_REPORT_INTERVAL, MAX_SIDECAR_TEXT_BYTES, STOP_BOUND, SessionEvent, UNSEEN_STOP_BOUND};
use crate::runtime::route::Me;
use crate::runtime::stream::Opening;
use crate::sessions::plan::{Assignment, Credentials, Grant};

/// Who the session is: its route and instance, and the member process it runs in.
#[derive(Clone, Debug)]
pub(crate) struct Setup {
    pub route: String,
    pub instance: InstanceRef,
    pub me: Me,
    /// The egress policy revision installed in the sidecar at every attach and activation.
    pub policy: Option<std::sync::Arc<proto::runtime::v1::EgressPolicy>>,
    /// The highest term of this instance this member process released (0: none): never
    /// taken up again (`sessions::released`).
    pub released: u64,
}

/// A stop in progress.
#[derive(Debug)]
pub(super) struct Stop {
    pub since: Instant,
    pub until: Instant,
    /// Releases handed to a stream that took them.
    pub releases: u32,
}

/// The sidecar stream the session holds and what happened on it.
#[derive(Debug)]
pub(super) struct Sidecar {
    pub id: StreamId,
    /// The stream's opening, updated by later RecoveryHellos and by the confirm.
    pub opening: Opening,
    /// This term's grant was presented on this stream.
    pub presented: bool,
    /// The sidecar answered that presentation with a receipt.
    pub receipted: bool,
    /// This stream relays for the active term (Attached or ActivationConfirm sent).
    pub attached: bool,
    /// This stream relayed an earlier term of this session: the sidecar goes on sending its
    /// workload's requests until it takes this term, and they wait for it (`Machine::waiting`).
    pub relayed_before: bool,
    /// Release sent on this stream.
    pub released: bool,
}

/// The one gateway call in flight, never retried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Call {
    Grant,
    Activation,
}

pub(crate) struct Machine {
    pub(super) setup: Setup,
    pub(super) credentials: Option<Credentials>,
    pub(super) term: u64,
    pub(super) stage: Stage,
    /// The grant for `term`, once obtained.
    pub(super) grant: Option<Grant>,
    /// The grant is useless after this unless receipted.
    pub(super) grant_deadline: Option<Instant>,
    pub(super) sidecar: Option<Sidecar>,
    pub(super) ever_connected: bool,
    /// The relaying stream of the active term was lost (RECOVERING).
    pub(super) lost_at_active: bool,
    /// A sidecar stream was held at this term (the relaying one, or one that took the grant
    /// before the activation).
    pub(super) met_this_term: bool,
    /// Since when no sidecar stream is held after one was, at the active term: past
    /// [`timing::SIDECAR_AWAY_BOUND`] the term is given up ([`Machine::away`]).
    away_since: Option<Instant>,
    /// The sidecar stayed away past the bound: the term is reported FAILED so that the
    /// coordinator moves the instance to a member the sidecar reaches — until the sidecar comes
    /// back at this term first, which attaches it again.
    pub(super) gave_up: bool,
    pub(super) call: Option<Call>,
    /// The term whose sidecar's audit records are being stored, while they are.
    pub(super) audit_call: Option<u64>,
    /// Workload requests the sidecar sent on its stream while this session moved that stream
    /// to a higher term: answered once it relays at that term, refused if it cannot.
    pub(super) waiting: Vec<(StreamId, proto::runtime::v1::WorkloadRequest)>,
    /// The term at which the sidecar was told the store is behind (0: none).
    store_behind_told: u64,
    /// The term at which the store was behind while no sidecar was relaying (0: none): told
    /// when one attaches at that term.
    store_behind_pending: u64,
    pub(super) stop: Option<Stop>,
    /// Set when the session ends: its final phase and message.
    pub(super) ended: Option<(InstancePhase, String)>,
    pub(super) counters: InstanceCounters,
    pub(super) workload_pid: u32,
    /// The sidecar's last answer to this term's policy install.
    pub(super) egress_loaded: Option<proto::runtime::v1::PolicyLoaded>,
    /// The status last published.
    pub(super) published: InstanceStatus,
    counters_announced: Instant,
    /// Counters changed since the last announcement.
    counters_pending: bool,
    /// `Effect::Done` was returned: every later event is ignored.
    done: bool,
    pub(super) now: Now,
    pub(super) out: Vec<Effect>,
}

impl Machine {
    /// A session for `setup.instance` at `assignment`; `Event::Started` publishes its status.
    pub(crate) fn new(setup: Setup, assignment: Assignment, now: Now) -> Self {
        let mut machine = Self {
            setup,
            credentials: None,
            term: 0,
            stage: Stage::Reserved { asked: false },
            grant: None,
            grant_deadline: None,
            sidecar: None,
            ever_connected: false,
            lost_at_active: false,
            met_this_term: false,
            away_since: None,
            gave_up: false,
            call: None,
            audit_call: None,
            waiting: Vec::new(),
            store_behind_told: 0,
            store_behind_pending: 0,
            stop: None,
            ended: None,
            counters: InstanceCounters::default(),
            workload_pid: 0,
            egress_loaded: None,
            published: InstanceStatus::default(),
            counters_announced: now.at,
            counters_pending: false,
            done: false,
            now,
            out: Vec::new(),
        };
        machine.on_ownership(assignment);
        machine
    }

    /// Takes one event; returns what to do, in order. After every event the takeover takes
    /// the steps the state allows and the status is published; an ended session is `Done`.
    pub(crate) fn on(&mut self, now: Now, event: Event) -> Vec<Effect> {
        if self.done {
            return Vec::new();
        }
        self.now = now;
        let started = matches!(event, Event::Started);
        match event {
            Event::Started => {}
            Event::Member(SessionEvent::Ownership(assignment)) => self.on_ownership(assignment),
            Event::Member(SessionEvent::Stop) => self.on_stop(),
            Event::Member(SessionEvent::StoreBehind(named)) => self.on_store_behind(named),
            Event::Member(SessionEvent::Relinquish) => self.on_relinquish(),
            Event::Sidecar { stream, opening } => self.on_sidecar(stream, opening),
            Event::Message { stream, kind } if self.holds(stream) => self.on_message(kind),
            Event::Lost { stream, reason } if self.holds(stream) => self.lose_sidecar(&reason),
            Event::Unsent { stream, message } if self.holds(stream) => self.on_unsent(message.kind.as_ref()),
            Event::Message { .. } | Event::Lost { .. } | Event::Unsent { .. } => {}
            Event::Granted(result) => self.on_granted(result),
            Event::Activated(result) => self.on_activated(result),
            Event::AuditRecorded { term, result } => self.on_audit_recorded(term, result),
            Event::Tick => self.on_tick(),
            Event::Policy(policy) => self.on_policy(policy),
            // A stopping session completes its stop whoever goes away.
            Event::Abandoned | Event::Orphaned if self.stop.is_some() => {}
            Event::Abandoned => {
                debug!("session abandoned; the workload keeps running");
                return self.finish();
            }
            Event::Orphaned => return self.finish(),
        }
        self.advance();
        self.settle_waiting();
        self.away_since = if self.away() {
            self.away_since.or(Some(self.now.at))
        } else {
            None
        };
        self.publish();
        if started {
            info!(phase = %self.published.phase(), "session started");
        }
        if let Some((phase, message)) = &self.ended {
            info!(%phase, %message, "session ended");
            return self.finish();
        }
        mem::take(&mut self.out)
    }

    /// A stop is in progress: it ignores abandonment (the driver stops listening for it).
    pub(crate) fn stopping(&self) -> bool {
        self.stop.is_some()
    }

    /// The sidecar stream the session holds (the driver reads it and keeps it alive).
    pub(crate) fn held_stream(&self) -> Option<StreamId> {
        self.sidecar.as_ref().map(|s| s.id)
    }

    /// When the machine wants a `Tick`: the grant's expiry, the stop's bound or a deferred
    /// counter report.
    pub(crate) fn next_wake(&self) -> Option<Instant> {
        let counters = self
            .counters_pending
            .then_some(self.counters_announced + COUNTER_REPORT_INTERVAL);
        let give_up = self.away_since.map(|since| since + timing::SIDECAR_AWAY_BOUND);
        [
            self.grant_deadline,
            self.stop.as_ref().map(|s| s.until),
            counters,
            give_up,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The sidecar of the active term is away: a stream of it was held at this term, none is
    /// now, and no stop is in progress (a stop waits for the sidecar on its own bound).
    fn away(&self) -> bool {
        matches!(self.stage, Stage::Active { .. })
            && (self.lost_at_active || self.met_this_term)
            && self.sidecar.is_none()
            && self.stop.is_none()
            && self.ended.is_none()
            && !self.gave_up
    }

    fn finish(&mut self) -> Vec<Effect> {
        self.done = true;
        self.out.push(Effect::Done);
        mem::take(&mut self.out)
    }

    fn holds(&self, stream: StreamId) -> bool {
        self.held_stream() == Some(stream)
    }

    // --- the sidecar stream -------------------------------------------------------------

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
                    return self.fenced(fenced.id, hello.fence_term);
                }
                if let Some(sidecar) = &mut self.sidecar {
                    // The sidecar lost us on this very stream (e.g. it froze): decide again.
                    let opening = &mut sidecar.opening;
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
            sidecar_message::Kind::PolicyLoaded(loaded) => self.on_policy_loaded(&loaded),
            sidecar_message::Kind::AuditRecords(records) => self.on_audit_records(records),
            sidecar_message::Kind::Attach(_) | sidecar_message::Kind::Heartbeat(_) => {}
        }
    }

    /// A sidecar stream for this instance: it replaces the one held (the sidecar reconnected).
    fn on_sidecar(&mut self, id: StreamId, opening: Opening) {
        self.counters.sidecar_connects += 1;
        if let Some(stop) = &mut self.stop
            && !self.ever_connected
        {
            // A stop that waited for any sidecar now has one: give it the full bound.
            stop.until = stop.since + STOP_BOUND;
        }
        self.ever_connected = true;
        self.note_workload(opening.workload.pid);
        let fence = opening.fence_term;
        info!(fence, recovering = opening.recovering, stream = id, "sidecar connected");
        if let Some(old) = self.sidecar.take() {
            self.lost_at_active |= old.attached;
            self.out.push(Effect::Drop(old.id));
        }
        if fence > self.term {
            return self.fenced(id, fence);
        }
        self.met_this_term = true;
        self.sidecar = Some(Sidecar {
            id,
            opening,
            presented: false,
            receipted: false,
            attached: false,
            relayed_before: false,
            released: false,
        });
    }

    /// The store names the route at `named`, below this session's term (0: not at all, while
    /// the snapshot keeps it): once per term, the
    /// relaying sidecar is told to register its standing (runtime.v1.StoreBehind), which raises
    /// the route's last term to its fence so that the coordinator reserves above it.
    /// Not relaying yet (the sidecar away or still taking over), it is told once one attaches
    /// at this term.
    fn on_store_behind(&mut self, named: u64) {
        if named >= self.term || self.store_behind_told == self.term {
            return;
        }
        let relaying = matches!(self.stage, Stage::Active { .. }) && self.sidecar.as_ref().is_some_and(|s| s.attached);
        if !relaying {
            self.store_behind_pending = self.term;
            return;
        }
        self.store_behind_pending = 0;
        info!(
            named,
            "the store names the route below this term: the sidecar registers its standing"
        );
        self.store_behind_told = self.term;
        self.send(Kind::StoreBehind(proto::runtime::v1::StoreBehind { term: self.term }));
    }

    /// The store activated this term just now: a lag noticed before is not the store's any more.
    pub(super) fn store_caught_up(&mut self) {
        self.store_behind_pending = 0;
    }

    /// A sidecar attached at this term: the store's lag noticed while none was relaying.
    pub(super) fn tell_pending_store_behind(&mut self) {
        if self.store_behind_pending != 0 && self.store_behind_pending == self.term {
            self.on_store_behind(0);
        }
    }

    /// The sidecar activated a higher term: this member is fenced for the route.
    fn fenced(&mut self, stream: StreamId, fence: u64) {
        let reason = format!(
            "fenced: the sidecar activated term {fence}, above this member's term {}",
            self.term
        );
        self.out.push(Effect::Refuse {
            stream,
            reason: reason.clone(),
        });
        self.fail(reason);
    }

    fn lose_sidecar(&mut self, reason: &str) {
        if let Some(sidecar) = self.sidecar.take() {
            info!(reason, stream = sidecar.id, "sidecar stream lost");
            self.lost_at_active |= sidecar.attached;
            self.out.push(Effect::Drop(sidecar.id));
        }
    }

    /// The held stream could not take a message: the sidecar is not reading and the stream
    /// is dropped; what the message would have done did not happen.
    fn on_unsent(&mut self, kind: Option<&Kind>) {
        if let Some(sidecar) = &mut self.sidecar {
            match kind {
                Some(Kind::Attached(_) | Kind::ActivationConfirm(_)) => sidecar.attached = false,
                Some(Kind::Release(_)) => {
                    sidecar.released = false;
                    if let Some(stop) = &mut self.stop {
                        stop.releases = stop.releases.saturating_sub(1);
                    }
                }
                _ => {}
            }
        }
        self.lose_sidecar("the sidecar is not reading the stream");
    }

    /// Queues a message on the held stream.
    pub(super) fn send(&mut self, kind: Kind) {
        if let Some(sidecar) = &self.sidecar {
            self.out.push(Effect::Send {
                stream: sidecar.id,
                kind,
            });
        }
    }

    // --- ending -------------------------------------------------------------------------

    fn on_stop(&mut self) {
        if self.stop.is_some() || self.ended.is_some() {
            return;
        }
        let bound = if self.ever_connected {
            STOP_BOUND
        } else {
            UNSEEN_STOP_BOUND
        };
        info!(?bound, "stopping the workload");
        let since = self.now.at;
        self.stop = Some(Stop {
            since,
            until: since + bound,
            releases: 0,
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
        if let Some(sidecar) = self.sidecar.take() {
            if sidecar.attached && matches!(self.stage, Stage::Active { .. }) {
                let kind = Kind::Relinquish(Relinquish { term: self.term });
                self.out.push(Effect::Send {
                    stream: sidecar.id,
                    kind,
                });
                info!("relinquished the term to the sidecar");
            }
            self.out.push(Effect::Drop(sidecar.id));
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
        info!(stream = sidecar.id, "release sent; waiting for the workload to stop");
        sidecar.released = true;
        stop.releases += 1;
        let stream = sidecar.id;
        self.out.push(Effect::Send {
            stream,
            kind: Kind::Release(release),
        });
    }

    fn on_tick(&mut self) {
        let now = self.now.at;
        if self.counters_pending && now >= self.counters_announced + COUNTER_REPORT_INTERVAL {
            self.announce();
        }
        if self
            .away_since
            .is_some_and(|since| now >= since + timing::SIDECAR_AWAY_BOUND)
        {
            self.away_since = None;
            self.gave_up = true;
            warn!(bound = ?timing::SIDECAR_AWAY_BOUND, "the sidecar stayed away; giving the term up");
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
            self.ended = Some(if stop.releases > 0 {
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
        warn!(%reason, "instance failed for this term");
        if self.call.take().is_some() {
            self.out.push(Effect::CancelCall);
        }
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

    // --- status -------------------------------------------------------------------------

    /// Publishes the status; phase, term, message and PID changes are announced at once,
    /// counter-only changes at most every [`COUNTER_REPORT_INTERVAL`] (deferred, not dropped).
    fn publish(&mut self) {
        let (phase, message) = self.phase();
        let last = &self.published;
        let changed = (
            last.term,
            last.phase,
            last.workload_pid,
            last.message.as_str(),
            last.egress_policy.as_ref(),
        ) != (
            self.term,
            phase as i32,
            self.workload_pid,
            message.as_str(),
            self.egress_loaded.as_ref(),
        );
        if changed {
            self.published = InstanceStatus {
                route: self.setup.route.clone(),
                instance: Some(self.setup.instance.clone()),
                term: self.term,
                phase: phase as i32,
                workload_pid: self.workload_pid,
                message,
                counters: Some(self.counters),
                observed_at_ms: self.now.unix_ms,
                egress_policy: self.egress_loaded.clone(),
            };
        } else if last.counters != Some(self.counters) {
            self.published.counters = Some(self.counters);
        } else {
            return;
        }
        self.out.push(Effect::Publish(Box::new(self.published.clone())));
        let since = self.now.at.saturating_duration_since(self.counters_announced);
        if changed || since >= COUNTER_REPORT_INTERVAL {
            self.announce();
        } else {
            self.counters_pending = true;
        }
    }

    fn announce(&mut self) {
        self.counters_announced = self.now.at;
        self.counters_pending = false;
        self.out.push(Effect::Announce);
    }

    fn phase(&self) -> (InstancePhase, String) {
        if let Some(ended) = &self.ended {
            return ended.clone();
        }
        let (phase, message) = match &self.stage {
            Stage::Failed(reason) => return (InstancePhase::Failed, reason.clone()),
            Stage::Active { .. } if self.gave_up => {
                return (
                    InstancePhase::Failed,
                    format!(
                        "the sidecar has not come back for {:?} since its stream was lost: giving term {} up \
                         so that a member it can reach takes the instance over",
                        timing::SIDECAR_AWAY_BOUND,
                        self.term
                    ),
                );
            }
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
