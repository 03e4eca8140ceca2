//! The machine: the fence, every runtime stream's bookkeeping, the relay queues and the
//! recovery clock, and every decision over them. Sans-I/O: `Machine::on` takes an `Event` at a
//! `Now` and returns the `Effect`s to carry out, in order; no file, socket, task or clock is
//! touched here. This file holds the modes and their transitions; `control` the member
//! messages, `relay` the workload's side.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::common::v1::{InstanceRef, WorkloadIdentity};
use proto::registry::v1::RegisterResponse;
use proto::runtime::v1::{Attach, sidecar_message};
use proto::timing::{self, reconnect_backoff};
use tracing::{debug, info, warn};

use super::effect::{Effect, Ending, Event, Now, Reply};
use crate::config::{Config, valid_address};
use crate::episode::{Episode, Slot};
use crate::fence::{Fence, Presenter};
use crate::runtime_link::{First, StreamId};
use crate::state_file::State;
use crate::supervision::Token;
use crate::workload::Op;

/// Longest free text the sidecar forwards (Stopped.reason, Release.reason, Rejected.reason).
pub(super) const MAX_REASON_BYTES: usize = 256;

pub(super) const LOST: &str = "the supervisor connection was lost; the request was not replayed";
pub(super) const STOPPING: &str = "the workload is stopping";

/// What the machine is told once: who it is and where the members are.
#[derive(Clone, Debug)]
pub(crate) struct Setup {
    pub route: String,
    /// Namespace, name and uid (the generation comes from the persisted state).
    pub instance: InstanceRef,
    /// The runtime addresses dialed in turn.
    pub addresses: Vec<String>,
    /// The expected `iss` of grants and proofs.
    pub issuer: String,
    /// The sidecar started the workload itself (a command after `--`).
    pub local: bool,
}

impl Setup {
    pub(crate) fn from_config(cfg: &Config) -> Self {
        Self {
            route: cfg.route(),
            instance: InstanceRef {
                namespace: cfg.namespace.clone(),
                name: cfg.name.clone(),
                uid: cfg.uid.clone(),
                generation: 0,
            },
            addresses: cfg.route_addresses(),
            issuer: cfg.issuer.clone(),
            local: !cfg.command.is_empty(),
        }
    }
}

#[derive(Debug)]
pub(super) enum Mode {
    Unregistered,
    Placing { deadline: Instant, deadline_ms: u64 },
    Active,
    Recovering { episode: Arc<Episode> },
    Stopping,
}

#[derive(Debug)]
pub(super) struct RuntimeStream {
    /// The runtime address dialed.
    pub address: String,
    pub open: bool,
    /// The member process whose grant the sidecar receipted on this stream.
    pub presenter: Option<Presenter>,
    pub next_request: u64,
    /// The member was told which process the workload is (in the stream's first message, or
    /// by a WorkloadStarted since).
    pub workload_told: bool,
}

#[derive(Debug)]
pub(super) struct Dial {
    pub next_at: Instant,
    pub failures: u32,
    pub redirects: u32,
    pub cursor: usize,
    pub preferred: Option<String>,
}

impl Dial {
    pub(super) fn backoff(&mut self, now: Instant) {
        self.failures = self.failures.saturating_add(1);
        self.cursor = self.cursor.wrapping_add(1);
        self.next_at = now + reconnect_backoff(self.failures);
    }
}

/// A decision waiting for its `Effect::Commit`: `before` is the fence restored if it fails.
#[derive(Debug)]
pub(super) enum Pending {
    Receipt {
        id: StreamId,
        receipt: Box<proto::recovery::v1::Receipt>,
        presenter: Presenter,
        before: Box<Fence>,
    },
    Activation {
        id: StreamId,
        term: u64,
        before: Box<Fence>,
    },
}

pub(crate) struct Machine<R> {
    pub(super) setup: Setup,
    pub(super) instance: InstanceRef,
    pub(super) state: State,
    pub(super) streams: BTreeMap<StreamId, RuntimeStream>,
    pub(super) next_stream: StreamId,
    pub(super) owner: Option<StreamId>,
    pub(super) release_stream: Option<StreamId>,
    pub(super) mode: Mode,
    pub(super) held: VecDeque<(Op, R)>,
    /// Requests sent to the owner and not answered yet, with what they asked.
    pub(super) inflight: HashMap<(StreamId, u64), (Op, R)>,
    pub(super) workload: Option<WorkloadIdentity>,
    pub(super) dial: Dial,
    pub(super) ending: Option<Ending>,
    /// The instance token the last registration issued (bound to this Pod): what pool
    /// members are shown. Before it, the mounted bootstrap token.
    pub(super) instance_token: Option<Token>,
    pub(super) pending: Option<Pending>,
    /// The audit spool's delivery through the activated owner.
    pub(super) audit: super::audit::Delivery,
    /// While placing or recovering: when to register again, so a registry that lost the
    /// instance records it again (and learns its fence, to place it above).
    pub(super) register_at: Instant,
    pub(super) now: Now,
    pub(super) out: Vec<Effect<R>>,
}

impl<R: Reply> Machine<R> {
    pub(crate) fn new(setup: Setup, state: State, workload: Option<WorkloadIdentity>, now: Now) -> Self {
        let instance = InstanceRef {
            generation: state.generation,
            ..setup.instance.clone()
        };
        Self {
            setup,
            instance,
            state,
            streams: BTreeMap::new(),
            next_stream: 1,
            owner: None,
            release_stream: None,
            mode: Mode::Unregistered,
            held: VecDeque::new(),
            inflight: HashMap::new(),
            workload,
            dial: Dial {
                next_at: now.at,
                failures: 0,
                redirects: 0,
                cursor: 0,
                preferred: None,
            },
            ending: None,
            instance_token: None,
            pending: None,
            audit: super::audit::Delivery::default(),
            register_at: now.at,
            now,
            out: Vec::new(),
        }
    }

    /// Takes one event; returns what to do, in order. A `Commit` is always the last effect.
    pub(crate) fn on(&mut self, now: Now, event: Event<R>) -> Vec<Effect<R>> {
        self.now = now;
        match event {
            // After a restart the persisted generation is enough to resume; the registration
            // (re-sent in the background) only confirms it.
            Event::Started => self.start(0),
            Event::Registered(response) => self.on_registered(response),
            Event::Tick => self.on_tick(),
            Event::Shutdown => self.begin_stop(Ending::Shutdown),
            Event::Exited(exit) => self.on_exit(exit),
            Event::Opened(id) => {
                if let Some(stream) = self.streams.get_mut(&id) {
                    stream.open = true;
                    self.dial.failures = 0;
                }
            }
            Event::Closed { id, opened, reason } => self.on_closed(id, opened, &reason),
            Event::Message { id, message, keys } => self.on_message(id, message, keys),
            Event::Peer { pid } => {
                let admission = self.admit(pid);
                self.out.push(admission);
            }
            Event::Pin(identity) => self.pin(identity),
            Event::Request { op, reply } => self.on_request(op, reply),
            Event::Committed(result) => self.on_committed(result),
            Event::Unsent { id, request, congested } => self.on_unsent(id, request, congested),
            Event::Undialed { id, reason } => {
                warn!(error = %reason, "cannot read the instance token; retrying");
                self.streams.remove(&id);
                self.dial.backoff(self.now.at);
            }
            Event::AuditPending(last) => self.on_audit_pending(last),
            Event::AuditFetched { records, dropped } => self.on_audit_fetched(records, dropped),
        }
        std::mem::take(&mut self.out)
    }

    /// Whether a stop (and which) has begun.
    pub(crate) fn stopping(&self) -> bool {
        self.ending.is_some()
    }

    /// When the machine wants a `Tick` (a deadline, a dial or a hello slot).
    pub(crate) fn next_wake(&self, now: Instant) -> Instant {
        let mut wake = now + timing::RECOVERY_DEADLINE;
        match &self.mode {
            Mode::Placing { deadline, .. } => {
                wake = wake.min(*deadline).min(self.register_at);
                if self.streams.is_empty() {
                    wake = wake.min(self.dial.next_at);
                }
            }
            Mode::Recovering { episode } => {
                wake = wake.min(episode.deadline()).min(self.register_at);
                if self.streams.is_empty() {
                    wake = wake.min(self.dial.next_at);
                } else if self.hello_stream().is_some()
                    && let Some(slot) = episode.next_slot(now)
                {
                    wake = wake.min(slot);
                }
            }
            Mode::Unregistered | Mode::Active | Mode::Stopping => {}
        }
        if let Some(due) = self.audit_wake() {
            wake = wake.min(due);
        }
        wake
    }

    // --- events -------------------------------------------------------------------------

    fn on_registered(&mut self, response: RegisterResponse) {
        let Some(generation) = response.instance.as_ref().map(|i| i.generation).filter(|g| *g != 0) else {
            warn!("the registry answered without a generation; ignoring");
            return;
        };
        info!(generation, term = response.term, "registered");
        if !response.instance_token.is_empty() {
            self.instance_token = Some(Token::new(response.instance_token.clone()));
        }
        if self.state.generation == generation && !matches!(self.mode, Mode::Unregistered) {
            return; // already running on the generation persisted before a restart
        }
        if self.state.generation != 0 && self.state.generation != generation {
            warn!(
                old = self.state.generation,
                new = generation,
                "the registry assigned a new generation: the fence starts over"
            );
            self.state.fence = Fence::default();
            self.state.recovery_deadline_at_ms = None;
            if let Some(id) = self.owner.take() {
                self.fail_inflight(id, LOST);
            }
            let all: Vec<StreamId> = self.streams.keys().copied().collect();
            for id in all {
                self.close_stream(id);
            }
            if let Mode::Recovering { episode } = &self.mode {
                episode.close();
            }
            self.mode = Mode::Unregistered;
        }
        self.state.generation = generation;
        self.state.next_generation = false;
        self.instance.generation = generation;
        self.persist();
        self.dial.preferred = response
            .owner
            .filter(|o| valid_address(&o.runtime_address) && self.state.fence.follows_redirect(o.term))
            .map(|o| o.runtime_address);
        self.start(response.recovery_deadline_ms);
    }

    /// Registers again, saying where the instance stands (see `register_at`), and again
    /// [`timing::REGISTER_AGAIN_EVERY`] later while still placing or recovering.
    pub(super) fn register_again(&mut self) {
        self.register_at = self.now.at + timing::REGISTER_AGAIN_EVERY;
        self.out.push(Effect::Register(crate::registration::Standing::of(
            &self.state.fence,
            self.workload.clone().filter(|w| w.pid > 0),
        )));
    }

    /// Leaves `Unregistered` once the generation is known: first placement, or recovery when
    /// a term was activated before (a restarted sidecar has lost its owner's stream).
    fn start(&mut self, placement_deadline_ms: u64) {
        if !matches!(self.mode, Mode::Unregistered) || self.state.generation == 0 {
            return;
        }
        self.dial.next_at = self.now.at;
        if self.state.fence.activated > 0 || self.state.fence.relinquished {
            self.enter_recovery();
        } else {
            let deadline = timing::recovery_deadline(placement_deadline_ms);
            self.mode = Mode::Placing {
                deadline: self.now.at + deadline,
                deadline_ms: millis(deadline),
            };
            self.register_at = self.now.at + timing::REGISTER_AGAIN_AFTER;
        }
    }

    fn on_tick(&mut self) {
        let now = self.now.at;
        match &self.mode {
            Mode::Placing { deadline, .. } => {
                let deadline = *deadline;
                if now >= self.register_at && now < deadline {
                    self.register_again();
                }
                if now >= deadline {
                    self.recovery_failed("no activation within the recovery deadline after registration");
                } else if self.streams.is_empty() && now >= self.dial.next_at {
                    let attach = First::Attach(self.attach());
                    self.dial(attach);
                }
            }
            Mode::Recovering { episode } => {
                let episode = episode.clone();
                if now >= self.register_at && now < episode.deadline() {
                    self.register_again();
                }
                if now >= episode.deadline() {
                    self.recovery_failed("recovery deadline exceeded");
                } else if self.streams.is_empty() {
                    if now >= self.dial.next_at {
                        self.dial(First::Hello(episode));
                    }
                } else if let Some(id) = self.hello_stream()
                    && let Slot::Ready(hello) = episode.take(now)
                {
                    self.send(id, sidecar_message::Kind::RecoveryHello(hello));
                }
            }
            Mode::Unregistered | Mode::Active | Mode::Stopping => {}
        }
        self.deliver_audit();
    }

    fn on_closed(&mut self, id: StreamId, opened: bool, reason: &str) {
        let Some(address) = self.streams.get(&id).map(|s| s.address.clone()) else {
            return; // a closed or fenced stream: ignored forever
        };
        let lost_owner = self.owner == Some(id);
        if lost_owner {
            warn!(stream = id, %reason, "lost the owner's stream");
        } else {
            debug!(stream = id, %reason, "runtime stream closed");
        }
        if opened {
            self.dial.cursor = self.dial.cursor.wrapping_add(1);
            self.dial.next_at = self.now.at + reconnect_backoff(0);
        } else {
            self.dial.backoff(self.now.at);
        }
        // A lost owner is likely dead or hung: try the other members first.
        let n = self.setup.addresses.len();
        if lost_owner && n > 1 && self.setup.addresses[self.dial.cursor % n] == address {
            self.dial.cursor = self.dial.cursor.wrapping_add(1);
        }
        self.close_stream(id);
    }

    /// A request the stream could not take was never sent: refused when the owner reads too
    /// slowly (backpressure); held for the next owner when the stream has ended (its `Closed`
    /// event, and any Relinquish read before it, are still on their way).
    fn on_unsent(&mut self, id: StreamId, request: Option<u64>, congested: bool) {
        match request {
            Some(request_id) => {
                if let Some((op, reply)) = self.inflight.remove(&(id, request_id)) {
                    if congested {
                        self.answer(reply, "the supervisor stream is congested");
                    } else {
                        self.held.push_back((op, reply));
                    }
                }
            }
            None => {
                debug!(stream = id, "cannot send on the stream; closing it");
                self.close_stream(id);
            }
        }
    }

    // --- transitions --------------------------------------------------------------------

    pub(super) fn enter_recovery(&mut self) {
        if let Some(id) = self.owner.take() {
            self.fail_inflight(id, LOST);
        }
        let deadline = timing::recovery_deadline(self.state.fence.recovery_deadline_ms);
        let now_ms = self.now.unix_ms;
        let at_ms = *self
            .state
            .recovery_deadline_at_ms
            .get_or_insert(now_ms.saturating_add(i64::try_from(millis(deadline)).unwrap_or(i64::MAX)));
        let remaining = Duration::from_millis(u64::try_from(at_ms.saturating_sub(now_ms)).unwrap_or(0)).min(deadline);
        self.persist();
        let template = proto::runtime::v1::RecoveryHello {
            route: self.setup.route.clone(),
            instance: Some(self.instance.clone()),
            fence_term: self.state.fence.activated,
            attempt: 0,
            deadline_remaining_ms: 0,
            relinquished: self.state.fence.relinquished,
            workload: Some(self.identity()),
        };
        warn!(
            fence = self.state.fence.activated,
            relinquished = self.state.fence.relinquished,
            remaining_ms = millis(remaining),
            "recovering: workload requests are held until a term is activated"
        );
        let episode = Episode::new(template, self.now.at + remaining, millis(deadline));
        self.register_at = self.now.at + timing::REGISTER_AGAIN_AFTER;
        self.mode = Mode::Recovering {
            episode: Arc::new(episode),
        };
        self.dial.next_at = self.now.at;
    }

    pub(super) fn become_active(&mut self, id: StreamId) {
        if let Mode::Recovering { episode } = &self.mode {
            episode.close();
        }
        self.mode = Mode::Active;
        self.owner = Some(id);
        self.state.recovery_deadline_at_ms = None;
        self.persist();
        self.close_all_except(id);
        self.dial.failures = 0;
        self.dial.redirects = 0;
        self.announce_workload();
        while let Some((op, reply)) = self.held.pop_front() {
            self.forward(op, reply);
        }
        // What the last owner did not acknowledge goes to this one.
        self.audit.in_flight = None;
        self.deliver_audit();
    }

    // --- helpers ------------------------------------------------------------------------

    fn dial(&mut self, first: First) {
        let address = match self.dial.preferred.take() {
            Some(address) => address,
            None if self.setup.addresses.is_empty() => return,
            None => self.setup.addresses[self.dial.cursor % self.setup.addresses.len()].clone(),
        };
        let id = self.next_stream;
        self.next_stream += 1;
        debug!(stream = id, %address, "dialing the supervisor route");
        self.streams.insert(
            id,
            RuntimeStream {
                address: address.clone(),
                open: false,
                presenter: None,
                next_request: 0,
                workload_told: self.workload.is_some(),
            },
        );
        self.out.push(Effect::Dial {
            id,
            address,
            first,
            token: self.instance_token.clone(),
        });
    }

    fn attach(&self) -> Attach {
        Attach {
            route: self.setup.route.clone(),
            instance: Some(self.instance.clone()),
            fence_term: self.state.fence.activated,
            workload: Some(self.identity()),
        }
    }

    pub(super) fn identity(&self) -> WorkloadIdentity {
        self.workload.clone().unwrap_or_default()
    }

    /// An open stream that may carry repeated RecoveryHellos (no grant presented on it).
    fn hello_stream(&self) -> Option<StreamId> {
        self.streams
            .iter()
            .find(|(_, s)| s.open && s.presenter.is_none())
            .map(|(id, _)| *id)
    }

    /// Sends on a known stream; an unknown one is closed, as a stream that cannot take it.
    pub(super) fn send(&mut self, id: StreamId, kind: sidecar_message::Kind) {
        if self.streams.contains_key(&id) {
            self.out.push(Effect::Send { id, kind });
        } else {
            debug!(stream = id, "cannot send on the stream; closing it");
            self.close_stream(id);
        }
    }

    /// Closes a stream at once. Losing the activated owner's stream starts recovery.
    pub(super) fn close_stream(&mut self, id: StreamId) {
        if self.streams.remove(&id).is_some() {
            self.out.push(Effect::Abort(id));
        }
        self.fail_inflight(id, LOST);
        if self.owner == Some(id) {
            self.owner = None;
            if matches!(self.mode, Mode::Active) {
                self.enter_recovery();
            }
        }
    }

    pub(super) fn close_all_except(&mut self, keep: StreamId) {
        let others: Vec<StreamId> = self.streams.keys().copied().filter(|id| *id != keep).collect();
        for id in others {
            self.close_stream(id);
        }
    }

    /// Persists the state; a failure is logged by the driver.
    pub(super) fn persist(&mut self) {
        self.out.push(Effect::Persist(Box::new(self.state.clone())));
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// At most `max` bytes of `text`, cut at a character boundary.
pub(crate) fn bounded(text: &str, max: usize) -> String {
    plumbing::text::prefix(text, max).to_owned()
}
