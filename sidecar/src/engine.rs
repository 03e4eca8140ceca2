//! The engine: one task that owns the fence, every runtime stream, the relay and the recovery
//! clock, and takes every decision. Streams (`link`), the workload endpoint (`workload`), the
//! registration and the process watcher are separate tasks that only report to it.
//!
//! Modes: `Unregistered` (waiting for the registry's generation) → `Placing` (first placement:
//! Attach with fence 0, bounded by the registry's deadline) → `Active` (an activated owner's
//! stream relays) ⇄ `Recovering` (owner lost or relinquished: frozen, RecoveryHello under the
//! episode's budget until a term is activated or the deadline passes) → `Stopping` (release,
//! missed deadline, workload exit or shutdown: the workload is stopped, nothing else is
//! accepted).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use proto::common::v1::{InstanceRef, WorkloadIdentity};
use proto::registry::v1::{DeregisterRequest, RecoveryFailedRequest, RegisterResponse};
use proto::runtime::v1::{
    ActivationConfirm, Attach, Attached, FetchCredential, GrantPresentation, Liveness, Redirect, Release, Relinquish,
    ReportProgress, Stopped, SupervisorMessage, WorkloadRequest, WorkloadResponse, WorkloadStarted, sidecar_message,
    supervisor_message, workload_request, workload_response,
};
use proto::timing::{self, reconnect_backoff};
use proto::trust;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::Outcome;
use crate::config::{Config, valid_address};
use crate::fence::{Accepted, Fence, Presenter, Refusal, Role, Subject, Verifier};
use crate::identity;
use crate::link::{First, Link, LinkEvent, StreamId};
use crate::process::{self, Control, Exit, Process};
use crate::receipt::ReceiptKey;
use crate::recovery::{Episode, Slot};
use crate::registry::Registry;
use crate::store::{State, StateFile};
use crate::supervision::{Token, Trust, read_token};
use crate::workload::{Admission, Answer, Inbound, Op, Request};

/// Workload requests held while frozen.
const MAX_HELD: usize = 256;
/// Workload requests awaiting the owner's answer.
const MAX_INFLIGHT: usize = 64;
/// Longest free text the sidecar forwards (Stopped.reason, Release.reason, Rejected.reason).
const MAX_REASON_BYTES: usize = 256;
/// Longest RecoveryFailedRequest.reason.
const MAX_FAILURE_REASON_BYTES: usize = 512;

const LOST: &str = "the supervisor connection was lost; the request was not replayed";
const STOPPING: &str = "the workload is stopping";

/// The workload process the sidecar is pinned to.
#[derive(Debug)]
pub(crate) struct Pinned {
    pub identity: WorkloadIdentity,
    pub control: Control,
}

/// Why the engine stopped.
#[derive(Clone, Debug)]
pub(crate) enum Ending {
    Released { reason: String },
    Exited,
    RecoveryFailed { request: RecoveryFailedRequest },
    Shutdown,
}

#[derive(Debug)]
enum Mode {
    Unregistered,
    Placing { deadline: Instant, deadline_ms: u64 },
    Active,
    Recovering { episode: Arc<Episode> },
    Stopping,
}

#[derive(Debug)]
struct Stream {
    link: Link,
    /// The runtime address dialed.
    address: String,
    open: bool,
    /// The member process whose grant the sidecar receipted on this stream.
    presenter: Option<Presenter>,
    next_request: u64,
    /// The member was told which process the workload is (in the stream's first message, or
    /// by a WorkloadStarted since).
    workload_told: bool,
}

#[derive(Debug)]
struct Dial {
    next_at: Instant,
    failures: u32,
    redirects: u32,
    cursor: usize,
    preferred: Option<String>,
}

impl Dial {
    fn backoff(&mut self) {
        self.failures = self.failures.saturating_add(1);
        self.cursor = self.cursor.wrapping_add(1);
        self.next_at = Instant::now() + reconnect_backoff(self.failures);
    }
}

pub(crate) struct Engine {
    cfg: Arc<Config>,
    route: String,
    instance: InstanceRef,
    addresses: Vec<String>,
    state: State,
    file: StateFile,
    trust: Trust,
    link_tx: mpsc::Sender<(StreamId, LinkEvent)>,
    streams: BTreeMap<StreamId, Stream>,
    next_stream: StreamId,
    owner: Option<StreamId>,
    release_stream: Option<StreamId>,
    mode: Mode,
    held: VecDeque<Request>,
    inflight: HashMap<(StreamId, u64), oneshot::Sender<Answer>>,
    workload: Option<Pinned>,
    new_exit: Option<oneshot::Receiver<Exit>>,
    dial: Dial,
    ending: Option<Ending>,
    done: Option<(Ending, Option<Exit>)>,
    /// The instance token the last registration issued (bound to this Pod): what pool
    /// members are shown. Before it, the mounted bootstrap token.
    instance_token: Option<Token>,
}

/// The engine's inputs.
pub(crate) struct Inputs {
    pub links: mpsc::Receiver<(StreamId, LinkEvent)>,
    pub workload: mpsc::Receiver<Inbound>,
    pub registered: mpsc::Receiver<RegisterResponse>,
    pub exit: Option<oneshot::Receiver<Exit>>,
}

impl Engine {
    pub(crate) fn new(
        cfg: Arc<Config>,
        state: State,
        file: StateFile,
        workload: Option<Pinned>,
        link_tx: mpsc::Sender<(StreamId, LinkEvent)>,
    ) -> Self {
        let route = cfg.route();
        let instance = InstanceRef {
            namespace: cfg.namespace.clone(),
            name: cfg.name.clone(),
            uid: cfg.uid.clone(),
            generation: state.generation,
        };
        Self {
            addresses: cfg.route_addresses(),
            trust: Trust::new(&cfg.supervision_dir),
            cfg,
            route,
            instance,
            state,
            file,
            link_tx,
            streams: BTreeMap::new(),
            next_stream: 1,
            owner: None,
            release_stream: None,
            mode: Mode::Unregistered,
            held: VecDeque::new(),
            inflight: HashMap::new(),
            workload,
            new_exit: None,
            dial: Dial {
                next_at: Instant::now(),
                failures: 0,
                redirects: 0,
                cursor: 0,
                preferred: None,
            },
            ending: None,
            done: None,
            instance_token: None,
        }
    }

    pub(crate) async fn run(&mut self, mut inputs: Inputs, shutdown: CancellationToken) -> (Ending, Option<Exit>) {
        // After a restart the persisted generation is enough to resume; the registration
        // (re-sent in the background) only confirms it.
        self.start(0);
        loop {
            let wake = self.next_wake();
            tokio::select! {
                () = shutdown.cancelled(), if self.ending.is_none() => self.begin_stop(Ending::Shutdown),
                exit = wait_exit(&mut inputs.exit) => {
                    inputs.exit = None;
                    self.on_exit(exit);
                }
                Some((id, event)) = inputs.links.recv() => self.on_link(id, event),
                Some(inbound) = inputs.workload.recv() => self.on_workload(inbound),
                Some(response) = inputs.registered.recv() => self.on_registered(response),
                () = sleep_until(wake) => self.on_tick(),
            }
            if let Some(exit) = self.new_exit.take() {
                inputs.exit = Some(exit);
            }
            if let Some(done) = self.done.take() {
                return done;
            }
        }
    }

    /// After `run`: flush and close the streams, then tell the registry how the instance ended.
    pub(crate) async fn finish(mut self, ending: Ending, exit: Option<Exit>, registry: &Registry) -> Outcome {
        let streams = std::mem::take(&mut self.streams);
        futures::future::join_all(streams.into_values().map(|s| s.link.close())).await;
        let exit_text = exit.map_or_else(|| "the workload was not running".to_owned(), |e| e.to_string());
        let (outcome, reason) = match &ending {
            Ending::Shutdown => return Outcome::Shutdown,
            Ending::Released { reason } => (Outcome::Released, format!("released: {reason}")),
            Ending::Exited => (Outcome::Exited, format!("workload {exit_text}")),
            Ending::RecoveryFailed { request } => (Outcome::RecoveryFailed, request.reason.clone()),
        };
        self.state.ended = Some(reason.clone());
        self.save_or_log();
        let result = match ending {
            Ending::RecoveryFailed { request } => registry.report_recovery_failed(request).await,
            _ => {
                let request = DeregisterRequest {
                    route: self.route.clone(),
                    instance: Some(self.instance.clone()),
                    reason: bounded(&reason, MAX_REASON_BYTES),
                };
                registry.deregister(request).await
            }
        };
        if let Err(err) = result {
            error!(error = %err, "cannot tell the registry that the instance ended");
        }
        outcome
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
        self.instance.generation = generation;
        self.save_or_log();
        self.dial.preferred = response
            .owner
            .filter(|o| valid_address(&o.runtime_address) && self.state.fence.follows_redirect(o.term))
            .map(|o| o.runtime_address);
        self.start(response.recovery_deadline_ms);
    }

    /// Leaves `Unregistered` once the generation is known: first placement, or recovery when
    /// a term was activated before (a restarted sidecar has lost its owner's stream).
    fn start(&mut self, placement_deadline_ms: u64) {
        if !matches!(self.mode, Mode::Unregistered) || self.state.generation == 0 {
            return;
        }
        self.dial.next_at = Instant::now();
        if self.state.fence.activated > 0 || self.state.fence.relinquished {
            self.enter_recovery();
        } else {
            let deadline = timing::recovery_deadline(placement_deadline_ms);
            self.mode = Mode::Placing {
                deadline: Instant::now() + deadline,
                deadline_ms: millis(deadline),
            };
        }
    }

    fn on_tick(&mut self) {
        let now = Instant::now();
        match &self.mode {
            Mode::Placing { deadline, .. } => {
                if now >= *deadline {
                    self.recovery_failed("no activation within the recovery deadline after registration");
                } else if self.streams.is_empty() && now >= self.dial.next_at {
                    let attach = First::Attach(self.attach());
                    self.dial(attach);
                }
            }
            Mode::Recovering { episode } => {
                let episode = episode.clone();
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
    }

    fn next_wake(&self) -> Instant {
        let mut wake = Instant::now() + timing::RECOVERY_DEADLINE;
        match &self.mode {
            Mode::Placing { deadline, .. } => {
                wake = wake.min(*deadline);
                if self.streams.is_empty() {
                    wake = wake.min(self.dial.next_at);
                }
            }
            Mode::Recovering { episode } => {
                wake = wake.min(episode.deadline());
                if self.streams.is_empty() {
                    wake = wake.min(self.dial.next_at);
                } else if self.hello_stream().is_some()
                    && let Some(slot) = episode.next_slot()
                {
                    wake = wake.min(slot);
                }
            }
            Mode::Unregistered | Mode::Active | Mode::Stopping => {}
        }
        wake
    }

    fn on_link(&mut self, id: StreamId, event: LinkEvent) {
        if !self.streams.contains_key(&id) {
            return; // a closed or fenced stream: ignored forever
        }
        match event {
            LinkEvent::Opened => {
                if let Some(stream) = self.streams.get_mut(&id) {
                    stream.open = true;
                }
                self.dial.failures = 0;
            }
            LinkEvent::Closed { opened, reason } => {
                let lost_owner = self.owner == Some(id);
                if lost_owner {
                    warn!(stream = id, %reason, "lost the owner's stream");
                } else {
                    debug!(stream = id, %reason, "runtime stream closed");
                }
                if opened {
                    self.dial.cursor = self.dial.cursor.wrapping_add(1);
                    self.dial.next_at = Instant::now() + reconnect_backoff(0);
                } else {
                    self.dial.backoff();
                }
                // A lost owner is likely dead or hung: try the other members first.
                let n = self.addresses.len();
                if lost_owner
                    && n > 1
                    && let Some(stream) = self.streams.get(&id)
                    && self.addresses[self.dial.cursor % n] == stream.address
                {
                    self.dial.cursor = self.dial.cursor.wrapping_add(1);
                }
                self.close_stream(id);
            }
            LinkEvent::Message(message) => self.on_message(id, message),
        }
    }

    fn on_message(&mut self, id: StreamId, message: SupervisorMessage) {
        use supervisor_message::Kind;
        let Some(kind) = message.kind else { return };
        if matches!(self.mode, Mode::Stopping) {
            return; // stop won: nothing else is accepted
        }
        match kind {
            Kind::Redirect(redirect) => self.on_redirect(id, redirect),
            Kind::Attached(attached) => self.on_attached(id, &attached),
            Kind::GrantPresentation(grant) => self.on_grant(id, grant),
            Kind::ActivationConfirm(confirm) => self.on_confirm(id, &confirm),
            Kind::WorkloadResponse(response) => self.on_response(id, response),
            Kind::Relinquish(relinquish) => self.on_relinquish(id, &relinquish),
            Kind::Release(release) => self.on_release(id, &release),
            Kind::Heartbeat(_) => {}
        }
    }

    fn on_redirect(&mut self, id: StreamId, redirect: Redirect) {
        self.close_stream(id);
        let follow = redirect.route == self.route
            && self.state.fence.follows_redirect(redirect.term)
            && valid_address(&redirect.runtime_address);
        if !follow || !matches!(self.mode, Mode::Placing { .. } | Mode::Recovering { .. }) {
            info!(
                term = redirect.term,
                fence = self.state.fence.activated,
                "redirect ignored"
            );
            self.dial.backoff();
            return;
        }
        debug!(to = %redirect.runtime_address, term = redirect.term, member = %redirect.member, "following redirect");
        // Redirect loops are slowed down; a recovery stream also waits for its hello slot.
        let delay = if self.dial.redirects == 0 {
            Duration::ZERO
        } else {
            reconnect_backoff(self.dial.redirects)
        };
        self.dial.redirects = self.dial.redirects.saturating_add(1);
        self.dial.preferred = Some(redirect.runtime_address);
        if let Mode::Recovering { episode } = &self.mode {
            episode.redirected();
        }
        self.dial.next_at = Instant::now() + delay;
    }

    fn on_attached(&mut self, id: StreamId, attached: &Attached) {
        let result = if attached.route == self.route {
            self.state.fence.accept_attached(attached)
        } else {
            Err(Refusal::Route)
        };
        match result {
            Ok(()) => {
                info!(term = attached.term, member = %attached.member, "owner attached");
                self.become_active(id);
            }
            Err(refusal) => {
                warn!(term = attached.term, member = %attached.member, %refusal, "Attached refused; closing the stream");
                self.close_stream(id);
            }
        }
    }

    fn on_grant(&mut self, id: StreamId, grant: GrantPresentation) {
        let presenter = Presenter {
            member: grant.member,
            process_id: grant.process_id,
        };
        let before = self.state.fence.clone();
        let workload = self.identity();
        let result = self.decide(|fence, verifier, me, key| {
            fence.present_grant(verifier, me, &grant.grant, &presenter, &workload, key)
        });
        let receipt = match result {
            Ok(Accepted::Fresh(receipt)) => {
                if let Err(err) = self.file.save(&self.state) {
                    error!(error = %err, "cannot persist the fence: the grant is not receipted");
                    self.state.fence = before;
                    self.close_stream(id);
                    return;
                }
                info!(
                    term = receipt.term,
                    fenced = receipt.fenced_term,
                    member = %presenter.member,
                    "grant receipted: every lower term is fenced"
                );
                // Fence the older owner's channel (and any other stream) at once.
                self.close_all_except(id);
                if self.owner == Some(id) {
                    self.owner = None;
                    self.fail_inflight(id, LOST);
                }
                if matches!(self.mode, Mode::Active) {
                    self.enter_recovery();
                }
                receipt
            }
            Ok(Accepted::Replay(receipt)) => {
                info!(term = receipt.term, member = %presenter.member, "grant re-presented: same receipt");
                receipt
            }
            Err(refusal) => {
                warn!(member = %presenter.member, %refusal, "grant refused; closing the stream");
                self.close_stream(id);
                return;
            }
        };
        if let Some(stream) = self.streams.get_mut(&id) {
            stream.presenter = Some(presenter);
        }
        self.send(id, sidecar_message::Kind::Receipt(receipt));
    }

    fn on_confirm(&mut self, id: StreamId, confirm: &ActivationConfirm) {
        let presenter = self.streams.get(&id).and_then(|s| s.presenter.clone());
        let before = self.state.fence.clone();
        match self.decide(|fence, verifier, me, _| fence.confirm_activation(verifier, me, confirm, presenter.as_ref()))
        {
            Ok(term) => {
                if let Err(err) = self.file.save(&self.state) {
                    error!(error = %err, "cannot persist the activation; the stream is closed");
                    self.state.fence = before;
                    self.close_stream(id);
                    return;
                }
                info!(term, "term activated; relaying resumes");
                self.become_active(id);
            }
            Err(refusal) => {
                warn!(term = confirm.term, %refusal, "activation confirm refused; closing the stream");
                self.close_stream(id);
            }
        }
    }

    fn on_relinquish(&mut self, id: StreamId, relinquish: &Relinquish) {
        let role = if self.owner == Some(id) {
            Role::Owner
        } else {
            Role::Other
        };
        match self.state.fence.relinquish(relinquish.term, role) {
            Ok(()) => {
                info!(term = relinquish.term, "owner relinquished; recovering");
                self.save_or_log();
                self.close_stream(id); // enters recovery: the owner's stream is gone
            }
            Err(refusal) => debug!(term = relinquish.term, %refusal, "relinquish ignored"),
        }
    }

    fn on_release(&mut self, id: StreamId, release: &Release) {
        let presenter = self.streams.get(&id).and_then(|s| s.presenter.clone());
        let role = match (&presenter, self.owner == Some(id)) {
            (_, true) => Role::Owner,
            (Some(p), false) => Role::Candidate(p),
            (None, false) => Role::Other,
        };
        if !self.state.fence.accepts_release(release.term, role) {
            warn!(
                term = release.term,
                "release ignored: not from the activated owner or the receipted candidate"
            );
            return;
        }
        info!(term = release.term, reason = %bounded(&release.reason, MAX_REASON_BYTES), "released: stopping the workload");
        self.release_stream = Some(id);
        self.begin_stop(Ending::Released {
            reason: bounded(&release.reason, MAX_REASON_BYTES),
        });
    }

    fn on_response(&mut self, id: StreamId, response: WorkloadResponse) {
        use workload_response::Kind;
        let Some(reply) = self.inflight.remove(&(id, response.request_id)) else {
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
            Some(Kind::Credential(c)) => Answer::Credential {
                token: Token::new(c.token),
                expires_at_ms: c.expires_at_ms,
            },
            Some(Kind::Alive(_)) => Answer::Alive,
            Some(Kind::Rejected(r)) => Answer::Refused(bounded(&r.reason, MAX_REASON_BYTES)),
            None => Answer::Refused("the supervisor sent an empty answer".into()),
        };
        let _ = reply.send(answer);
    }

    fn on_exit(&mut self, exit: Exit) {
        info!(%exit, "the workload process ended");
        let ending = match self.ending.clone() {
            Some(ending) => ending,
            None => {
                self.freeze_for_stop(Ending::Exited);
                Ending::Exited
            }
        };
        let reason = match &ending {
            Ending::Released { reason } => format!("released: {reason}"),
            Ending::Exited => exit.to_string(),
            Ending::RecoveryFailed { .. } => "recovery deadline exceeded".into(),
            Ending::Shutdown => "the sidecar is shutting down".into(),
        };
        let stopped = Stopped {
            reason: bounded(&reason, MAX_REASON_BYTES),
            exit_code: exit.code,
            signal: exit.signal,
        };
        if let Some(id) = self.release_stream.or(self.owner) {
            self.send(id, sidecar_message::Kind::Stopped(stopped));
        }
        self.workload = None;
        self.done = Some((ending, Some(exit)));
    }

    fn on_workload(&mut self, inbound: Inbound) {
        match inbound {
            Inbound::Peer { pid, reply } => {
                let _ = reply.send(self.admit(pid));
            }
            Inbound::Pin { identity, reply } => {
                let _ = reply.send(self.pin(identity));
            }
            Inbound::Request(request) => self.on_request(request),
        }
    }

    fn admit(&self, pid: Option<u32>) -> Admission {
        if self.ending.is_some() {
            return Admission::Refused(STOPPING.into());
        }
        let Some(pid) = pid else {
            return Admission::Refused(
                "the connecting process is not visible to the sidecar (share the Pod's process namespace)".into(),
            );
        };
        match &self.workload {
            Some(pinned) if identity::descends_from(pid, pinned.identity.pid) => Admission::Admitted,
            Some(_) => Admission::Refused("only the workload process and its descendants may use this socket".into()),
            None if !self.cfg.command.is_empty() => Admission::Refused("the workload process has ended".into()),
            None => Admission::NeedsIdentity,
        }
    }

    fn pin(&mut self, identity: WorkloadIdentity) -> Admission {
        if self.workload.is_some() || self.ending.is_some() {
            return self.admit(Some(identity.pid));
        }
        info!(
            pid = identity.pid,
            "workload process pinned from the socket's peer credentials"
        );
        self.state.workload = Some((&identity).into());
        self.save_or_log();
        if let Mode::Recovering { episode } = &self.mode {
            episode.set_workload(identity.clone());
        }
        let (control, exit) = process::watch(Process::Foreign(identity.clone()));
        self.workload = Some(Pinned { identity, control });
        self.new_exit = Some(exit);
        if matches!(self.mode, Mode::Active) {
            self.announce_workload();
        }
        Admission::Admitted
    }

    /// Tell the activated owner which process the workload is (its first message may have
    /// carried none: the workload connects after the activation).
    fn announce_workload(&mut self) {
        let (Some(id), Some(pinned)) = (self.owner, &self.workload) else {
            return;
        };
        let Some(stream) = self.streams.get_mut(&id) else {
            return;
        };
        if stream.workload_told {
            return;
        }
        stream.workload_told = true;
        let started = WorkloadStarted {
            workload: Some(pinned.identity.clone()),
        };
        self.send(id, sidecar_message::Kind::WorkloadStarted(started));
    }

    fn on_request(&mut self, request: Request) {
        if self.ending.is_some() {
            let _ = request.reply.send(Answer::Refused(STOPPING.into()));
        } else if matches!(self.mode, Mode::Active) && self.owner.is_some() {
            self.forward(request);
        } else if self.held.len() >= MAX_HELD {
            let _ = request.reply.send(Answer::Refused(
                "too many requests held while the supervisor recovers".into(),
            ));
        } else {
            self.held.push_back(request);
        }
    }

    // --- transitions --------------------------------------------------------------------

    fn enter_recovery(&mut self) {
        if let Some(id) = self.owner.take() {
            self.fail_inflight(id, LOST);
        }
        let deadline = timing::recovery_deadline(self.state.fence.recovery_deadline_ms);
        let now_ms = unix_now_ms();
        let at_ms = *self
            .state
            .recovery_deadline_at_ms
            .get_or_insert(now_ms.saturating_add(i64::try_from(millis(deadline)).unwrap_or(i64::MAX)));
        let remaining = Duration::from_millis(u64::try_from(at_ms.saturating_sub(now_ms)).unwrap_or(0)).min(deadline);
        self.save_or_log();
        let template = proto::runtime::v1::RecoveryHello {
            route: self.route.clone(),
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
        let episode = Episode::new(template, Instant::now() + remaining, millis(deadline));
        self.mode = Mode::Recovering {
            episode: Arc::new(episode),
        };
        self.dial.next_at = Instant::now();
    }

    fn become_active(&mut self, id: StreamId) {
        if let Mode::Recovering { episode } = &self.mode {
            episode.close();
        }
        self.mode = Mode::Active;
        self.owner = Some(id);
        self.state.recovery_deadline_at_ms = None;
        self.save_or_log();
        self.close_all_except(id);
        self.dial.failures = 0;
        self.dial.redirects = 0;
        self.announce_workload();
        while let Some(request) = self.held.pop_front() {
            self.forward(request);
        }
    }

    fn recovery_failed(&mut self, reason: &str) {
        let (attempts, deadline_ms) = match &self.mode {
            Mode::Recovering { episode } => (episode.attempts(), episode.deadline_ms()),
            Mode::Placing { deadline_ms, .. } => (0, *deadline_ms),
            _ => (0, 0),
        };
        error!(
            attempts,
            deadline_ms,
            fence = self.state.fence.activated,
            "{reason}: stopping the workload (SupervisorRecoveryFailed)"
        );
        let request = RecoveryFailedRequest {
            route: self.route.clone(),
            instance: Some(self.instance.clone()),
            fence_term: self.state.fence.activated,
            receipted_term: self.state.fence.pending_term(),
            attempts,
            recovery_deadline_ms: deadline_ms,
            reason: bounded(reason, MAX_FAILURE_REASON_BYTES),
        };
        self.begin_stop(Ending::RecoveryFailed { request });
    }

    /// Stop wins: freeze everything, then stop the workload (for a shutdown only when it is
    /// the sidecar's own child).
    fn begin_stop(&mut self, ending: Ending) {
        if self.ending.is_some() {
            return;
        }
        let stop_workload = !matches!(ending, Ending::Shutdown) || !self.cfg.command.is_empty();
        self.freeze_for_stop(ending.clone());
        match &self.workload {
            Some(pinned) if stop_workload => pinned.control.stop(self.cfg.stop_grace()),
            _ => self.done = Some((ending, None)),
        }
    }

    fn freeze_for_stop(&mut self, ending: Ending) {
        if let Mode::Recovering { episode } = &self.mode {
            episode.close();
        }
        self.mode = Mode::Stopping;
        self.ending = Some(ending);
        for request in self.held.drain(..) {
            let _ = request.reply.send(Answer::Refused(STOPPING.into()));
        }
        for (_, reply) in self.inflight.drain() {
            let _ = reply.send(Answer::Refused(STOPPING.into()));
        }
    }

    // --- helpers ------------------------------------------------------------------------

    /// Runs a fence decision against the trust bundle, reloading it once on an unknown kid.
    fn decide<T>(
        &mut self,
        mut decision: impl FnMut(&mut Fence, &Verifier<'_>, &Subject<'_>, &ReceiptKey) -> Result<T, Refusal>,
    ) -> Result<T, Refusal> {
        let mut reload = false;
        loop {
            let bundle = self.trust.bundle(reload).map_err(|e| Refusal::Trust(e.to_string()))?;
            let verifier = Verifier {
                bundle: &bundle,
                issuer: &self.cfg.issuer,
                now_ms: unix_now_ms(),
            };
            let me = Subject {
                route: &self.route,
                instance: &self.instance,
            };
            match decision(&mut self.state.fence, &verifier, &me, &self.state.receipt_key) {
                Err(Refusal::Token(trust::Error::UnknownKid(_))) if !reload => reload = true,
                other => return other,
            }
        }
    }

    fn dial(&mut self, first: First) {
        let address = match self.dial.preferred.take() {
            Some(address) => address,
            None if self.addresses.is_empty() => return,
            None => self.addresses[self.dial.cursor % self.addresses.len()].clone(),
        };
        let token = match self
            .instance_token
            .clone()
            .map_or_else(|| read_token(&self.cfg.supervision_dir), Ok)
        {
            Ok(token) => token,
            Err(err) => {
                warn!(error = %err, "cannot read the instance token; retrying");
                self.dial.backoff();
                return;
            }
        };
        let id = self.next_stream;
        self.next_stream += 1;
        debug!(stream = id, %address, "dialing the supervisor route");
        let tls = self.cfg.supervisor_tls();
        let link = Link::spawn(id, address.clone(), tls, first, token, self.link_tx.clone());
        self.streams.insert(
            id,
            Stream {
                link,
                address,
                open: false,
                presenter: None,
                next_request: 0,
                workload_told: self.workload.is_some(),
            },
        );
    }

    fn attach(&self) -> Attach {
        Attach {
            route: self.route.clone(),
            instance: Some(self.instance.clone()),
            fence_term: self.state.fence.activated,
            workload: Some(self.identity()),
        }
    }

    fn identity(&self) -> WorkloadIdentity {
        self.workload.as_ref().map(|p| p.identity.clone()).unwrap_or_default()
    }

    /// An open stream that may carry repeated RecoveryHellos (no grant presented on it).
    fn hello_stream(&self) -> Option<StreamId> {
        self.streams
            .iter()
            .find(|(_, s)| s.open && s.presenter.is_none())
            .map(|(id, _)| *id)
    }

    fn forward(&mut self, request: Request) {
        let Some(id) = self.owner else {
            self.held.push_back(request);
            return;
        };
        if request.reply.is_closed() {
            return;
        }
        if self.inflight.len() >= MAX_INFLIGHT {
            let _ = request
                .reply
                .send(Answer::Refused("too many requests in flight".into()));
            return;
        }
        let Some(stream) = self.streams.get_mut(&id) else {
            let _ = request.reply.send(Answer::Refused(LOST.into()));
            return;
        };
        stream.next_request += 1;
        let request_id = stream.next_request;
        let kind = match request.op {
            Op::Progress { value, note } => workload_request::Kind::ReportProgress(ReportProgress { value, note }),
            Op::Credential => workload_request::Kind::FetchCredential(FetchCredential {}),
            Op::Liveness => workload_request::Kind::Liveness(Liveness {}),
        };
        let message = WorkloadRequest {
            request_id,
            kind: Some(kind),
        };
        if stream.link.send(sidecar_message::Kind::WorkloadRequest(message)) {
            self.inflight.insert((id, request_id), request.reply);
        } else {
            let _ = request
                .reply
                .send(Answer::Refused("the supervisor stream is congested".into()));
        }
    }

    fn send(&mut self, id: StreamId, kind: sidecar_message::Kind) {
        let sent = self.streams.get(&id).is_some_and(|s| s.link.send(kind));
        if !sent {
            debug!(stream = id, "cannot send on the stream; closing it");
            self.close_stream(id);
        }
    }

    /// Closes a stream at once. Losing the activated owner's stream starts recovery.
    fn close_stream(&mut self, id: StreamId) {
        if let Some(stream) = self.streams.remove(&id) {
            stream.link.abort();
        }
        self.fail_inflight(id, LOST);
        if self.owner == Some(id) {
            self.owner = None;
            if matches!(self.mode, Mode::Active) {
                self.enter_recovery();
            }
        }
    }

    fn close_all_except(&mut self, keep: StreamId) {
        let others: Vec<StreamId> = self.streams.keys().copied().filter(|id| *id != keep).collect();
        for id in others {
            self.close_stream(id);
        }
    }

    fn fail_inflight(&mut self, id: StreamId, reason: &str) {
        let keys: Vec<_> = self.inflight.keys().copied().filter(|(s, _)| *s == id).collect();
        for key in keys {
            if let Some(reply) = self.inflight.remove(&key) {
                let _ = reply.send(Answer::Refused(reason.into()));
            }
        }
    }

    fn save_or_log(&self) {
        if let Err(err) = self.file.save(&self.state) {
            error!(error = %err, "cannot persist the sidecar state");
        }
    }
}

async fn wait_exit(exit: &mut Option<oneshot::Receiver<Exit>>) -> Exit {
    match exit {
        Some(receiver) => receiver.await.unwrap_or_default(),
        None => std::future::pending().await,
    }
}

fn unix_now_ms() -> i64 {
    trust::unix_ms(SystemTime::now())
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// At most `max` bytes of `text`, cut at a character boundary.
pub(crate) fn bounded(text: &str, max: usize) -> String {
    plumbing::text::prefix(text, max).to_owned()
}
