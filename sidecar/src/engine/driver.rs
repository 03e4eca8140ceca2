//! The driver: runs the machine. It owns what the machine only names — the runtime streams'
//! tasks, the state file, the trust bundle, the workload's watcher, the timers and the
//! requesters' reply channels — turns inputs into events, and carries out the effects in
//! order. Blocking work (fsync, file and `/proc` reads) runs off the runtime; the result of an
//! effect the machine waits on is fed back before anything else, so a commit precedes every
//! send that depends on it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::SystemTime;

use proto::common::v1::WorkloadIdentity;
use proto::registry::v1::RegisterResponse;
use proto::runtime::v1::sidecar_message;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tracing::error;

use super::effect::{Effect, Ending, Event, Keys, NOT_DESCENDANT, Now, Reply};
use super::machine::{Machine, Setup};
use super::stop::Report;
use crate::Outcome;
use crate::config::Config;
use crate::identity;
use crate::process::{self, Control, Exit, Process};
use crate::registration::{Registration, Standing};
use crate::runtime_link::{Link, LinkEvent, NotSent, StreamId};
use crate::state_file::{State, StateFile};
use crate::supervision::{Token, Trust, read_token};
use crate::workload::{Admission, Answer, Inbound, Request};

/// The workload process the sidecar is pinned to.
#[derive(Debug)]
pub(crate) struct Pinned {
    pub identity: WorkloadIdentity,
    pub control: Control,
}

/// What the driver hands the egress side: the revision in force (for the proxy) and the audit
/// spool it delivers (when the sidecar runs egress).
pub(crate) struct EgressLink {
    pub installed: watch::Sender<Option<Arc<crate::egress::Policy>>>,
    pub spool: Option<crate::egress::audit::Spool>,
}

/// The driver's inputs.
pub(crate) struct Inputs {
    pub links: mpsc::Receiver<(StreamId, LinkEvent)>,
    pub workload: mpsc::Receiver<Inbound>,
    pub registered: mpsc::Receiver<RegisterResponse>,
    pub exit: Option<oneshot::Receiver<Exit>>,
}

impl Reply for oneshot::Sender<Answer> {
    fn is_closed(&self) -> bool {
        oneshot::Sender::is_closed(self)
    }
}

type Requester = oneshot::Sender<Answer>;

pub(crate) struct Driver {
    cfg: Arc<Config>,
    machine: Machine<Requester>,
    file: StateFile,
    trust: Trust,
    links: BTreeMap<StreamId, Link>,
    link_tx: mpsc::Sender<(StreamId, LinkEvent)>,
    control: Option<Control>,
    exit: Option<oneshot::Receiver<Exit>>,
    /// The endpoint waiting for the `Peer` or `Pin` event being handled.
    admission: Option<oneshot::Sender<Admission>>,
    /// The pinned workload's PID, for the endpoint (its connections go first).
    workload_pid: watch::Sender<Option<u32>>,
    /// The egress policy revision in force, for the proxy.
    installed: watch::Sender<Option<Arc<crate::egress::Policy>>>,
    /// The audit spool of the egress decisions, when the sidecar runs egress.
    spool: Option<crate::egress::audit::Spool>,
    done: Option<(Ending, Option<Exit>)>,
    /// The registration task, told to register again with where the instance stands.
    register_again: Option<mpsc::Sender<Standing>>,
}

impl Driver {
    pub(crate) fn new(
        cfg: Arc<Config>,
        state: State,
        file: StateFile,
        workload: Option<Pinned>,
        link_tx: mpsc::Sender<(StreamId, LinkEvent)>,
        workload_pid: watch::Sender<Option<u32>>,
        egress: EgressLink,
    ) -> Self {
        let (identity, control) = workload.map(|p| (p.identity, p.control)).unzip();
        workload_pid.send_replace(identity.as_ref().map(|i| i.pid));
        Self {
            machine: Machine::new(Setup::from_config(&cfg), state, identity, now()),
            trust: Trust::new(&cfg.supervision_dir),
            cfg,
            file,
            links: BTreeMap::new(),
            link_tx,
            control,
            exit: None,
            admission: None,
            workload_pid,
            installed: egress.installed,
            spool: egress.spool,
            done: None,
            register_again: None,
        }
    }

    /// Where `Effect::Register` goes: the task that keeps the instance registered.
    pub(crate) fn registering_again(mut self, tx: mpsc::Sender<Standing>) -> Self {
        self.register_again = Some(tx);
        self
    }

    pub(crate) async fn run(&mut self, mut inputs: Inputs, shutdown: CancellationToken) -> (Ending, Option<Exit>) {
        self.exit = inputs.exit.take();
        self.handle(Event::Started).await;
        loop {
            if let Some(done) = self.done.take() {
                return done;
            }
            let wake = Instant::from_std(self.machine.next_wake(Instant::now().into_std()));
            let stopping = self.machine.stopping();
            let input = tokio::select! {
                () = shutdown.cancelled(), if !stopping => Input::Event(Event::Shutdown),
                exit = wait_exit(&mut self.exit) => Input::Exited(exit),
                Some((id, event)) = inputs.links.recv() => Input::Event(link_event(id, event)),
                Some(inbound) = inputs.workload.recv() => Input::Inbound(inbound),
                Some(response) = inputs.registered.recv() => Input::Event(Event::Registered(response)),
                last = spool_changed(self.spool.as_mut()) => Input::Event(Event::AuditPending(last)),
                () = sleep_until(wake) => Input::Event(Event::Tick),
            };
            let event = match input {
                Input::Event(event) => event,
                Input::Exited(exit) => {
                    self.exit = None;
                    self.control = None;
                    Event::Exited(exit)
                }
                Input::Inbound(Inbound::Peer { pid, reply }) => {
                    self.admission = Some(reply);
                    Event::Peer { pid }
                }
                Input::Inbound(Inbound::Pin { identity, reply }) => {
                    self.admission = Some(reply);
                    Event::Pin(identity)
                }
                Input::Inbound(Inbound::Request(Request { op, reply })) => Event::Request { op, reply },
            };
            self.handle(event).await;
        }
    }

    /// After `run`: flush and close the streams, then tell the registry how the instance ended.
    pub(crate) async fn finish(mut self, ending: Ending, exit: Option<Exit>, registration: &Registration) -> Outcome {
        let links = std::mem::take(&mut self.links);
        futures::future::join_all(links.into_values().map(Link::close)).await;
        let Some(conclusion) = self.machine.conclude(ending, exit) else {
            return Outcome::Shutdown;
        };
        let mut state = *conclusion.state;
        // In the same write as the end: whether the next run supervises the next process.
        state.next_generation = self.cfg.supervises_next(conclusion.outcome);
        state.ended_at_ticks = next_generation_after(exit.as_ref());
        self.persist(state).await;
        let result = match conclusion.report {
            Report::RecoveryFailed(request) => registration.report_recovery_failed(request).await,
            Report::Deregister(request) => registration.deregister(request).await,
        };
        if let Err(err) = result {
            error!(error = %err, "cannot tell the registry that the instance ended");
        }
        conclusion.outcome
    }

    /// One event and everything it leads to: each effect in order, the result of one the
    /// machine waits on fed back at once (its effects run before the rest).
    async fn handle(&mut self, event: Event<Requester>) {
        let mut queue: VecDeque<_> = self.machine.on(now(), event).into();
        while let Some(effect) = queue.pop_front() {
            if let Some(feedback) = self.apply(effect).await {
                for effect in self.machine.on(now(), feedback).into_iter().rev() {
                    queue.push_front(effect);
                }
            }
        }
        self.admission = None;
    }

    async fn apply(&mut self, effect: Effect<Requester>) -> Option<Event<Requester>> {
        match effect {
            Effect::Persist(state) => self.persist(*state).await,
            Effect::Commit(state) => return Some(Event::Committed(self.save(*state).await)),
            Effect::Dial {
                id,
                address,
                first,
                token,
            } => {
                let token = match token {
                    Some(token) => token,
                    None => match self.mounted_token().await {
                        Ok(token) => token,
                        Err(reason) => return Some(Event::Undialed { id, reason }),
                    },
                };
                let tls = self.cfg.supervisor_tls();
                let link = Link::spawn(id, address, tls, first, token, self.link_tx.clone());
                self.links.insert(id, link);
            }
            Effect::Send { id, kind } => {
                let request = match &kind {
                    sidecar_message::Kind::WorkloadRequest(r) => Some(r.request_id),
                    _ => None,
                };
                let sent = self.links.get(&id).map_or(Err(NotSent::Ended), |link| link.send(kind));
                if let Err(why) = sent {
                    return Some(Event::Unsent {
                        id,
                        request,
                        congested: why == NotSent::Congested,
                    });
                }
            }
            Effect::Abort(id) => {
                if let Some(link) = self.links.remove(&id) {
                    link.abort();
                }
            }
            Effect::Answer { reply, answer } => {
                let _ = reply.send(answer);
            }
            Effect::Admit(admission) => self.admit(admission),
            Effect::AdmitDescendant { pid, ancestor } => {
                let descends = blocking(move || identity::descends_from(pid, ancestor)).await;
                self.admit(match descends {
                    Ok(true) => Admission::Admitted,
                    _ => Admission::Refused(NOT_DESCENDANT.into()),
                });
            }
            Effect::Watch(identity) => {
                self.workload_pid.send_replace(Some(identity.pid));
                let (control, exit) = process::watch(Process::Foreign(identity));
                self.control = Some(control);
                self.exit = Some(exit);
            }
            Effect::Enforce(policy) => {
                self.installed.send_replace(Some(policy));
            }
            Effect::FetchAudit { after } => {
                let (records, dropped) = match &self.spool {
                    Some(spool) => spool.batch(after).await,
                    None => (Vec::new(), 0),
                };
                return Some(Event::AuditFetched { records, dropped });
            }
            Effect::AckAudit(through) => {
                if let Some(spool) = &self.spool {
                    spool.ack(through).await;
                }
            }
            Effect::StopWorkload => {
                if let Some(control) = &self.control {
                    control.stop(self.cfg.stop_grace());
                }
            }
            Effect::Verify { id, message, reload } => {
                let keys = Some(self.keys(reload).await);
                return Some(Event::Message { id, message, keys });
            }
            // Full: a registration is already asked for; it carries the newest standing next time.
            Effect::Register(standing) => {
                if let Some(tx) = &self.register_again {
                    let _ = tx.try_send(standing);
                }
            }
            Effect::Done { ending, exit } => self.done = Some((ending, exit)),
        }
        None
    }

    fn admit(&mut self, admission: Admission) {
        if let Some(reply) = self.admission.take() {
            let _ = reply.send(admission);
        }
    }

    /// Writes the state (atomically, fsynced) off the runtime.
    async fn save(&self, state: State) -> Result<(), String> {
        let file = self.file.clone();
        blocking(move || file.save(&state).map_err(|e| e.to_string())).await?
    }

    /// Writes the state; a failure is logged.
    async fn persist(&self, state: State) {
        if let Err(err) = self.save(state).await {
            error!(error = %err, "cannot persist the sidecar state");
        }
    }

    async fn mounted_token(&self) -> Result<Token, String> {
        let dir = self.cfg.supervision_dir.clone();
        blocking(move || read_token(&dir).map_err(|e| e.to_string())).await?
    }

    /// The trust bundle, read off the runtime (again on purpose when `reload`).
    async fn keys(&mut self, reload: bool) -> Keys {
        let mut trust = std::mem::replace(&mut self.trust, Trust::new(&self.cfg.supervision_dir));
        let read = blocking(move || {
            let bundle = trust.bundle(reload).map_err(|e| e.to_string());
            (trust, bundle)
        })
        .await;
        let bundle = match read {
            Ok((trust, bundle)) => {
                self.trust = trust;
                bundle
            }
            Err(err) => Err(err),
        };
        Keys { bundle, fresh: reload }
    }
}

/// What woke the driver.
enum Input {
    Event(Event<Requester>),
    Exited(Exit),
    Inbound(Inbound),
}

fn link_event(id: StreamId, event: LinkEvent) -> Event<Requester> {
    match event {
        LinkEvent::Opened => Event::Opened(id),
        LinkEvent::Message(message) => Event::Message {
            id,
            message,
            keys: None,
        },
        LinkEvent::Closed { opened, reason } => Event::Closed { id, opened, reason },
    }
}

/// Runs `work` on the blocking pool.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    tokio::task::spawn_blocking(work).await.map_err(|e| e.to_string())
}

/// The spool's highest sequence once it changed (never, without a spool).
async fn spool_changed(spool: Option<&mut crate::egress::audit::Spool>) -> u64 {
    let Some(spool) = spool else {
        return std::future::pending().await;
    };
    if spool.last.changed().await.is_err() {
        return std::future::pending().await;
    }
    *spool.last.borrow_and_update()
}

async fn wait_exit(exit: &mut Option<oneshot::Receiver<Exit>>) -> Exit {
    match exit {
        Some(receiver) => receiver.await.unwrap_or_default(),
        None => std::future::pending().await,
    }
}

fn now() -> Now {
    Now {
        at: Instant::now().into_std(),
        unix_ms: proto::trust::unix_ms(SystemTime::now()),
    }
}

/// The moment (ticks since boot) after which a process in the Pod counts as the next
/// generation's. When the workload was stopped: the last moment it was seen running, not now —
/// closing the streams and telling the registry take seconds, and the kubelet restarts a
/// container within one. When nothing was stopped (no workload process had been identified,
/// so it may still run unsupervised): 0, and the next run registers the next generation at
/// once instead of waiting for a process that never comes.
fn next_generation_after(exit: Option<&Exit>) -> u64 {
    exit.map_or(0, |exit| exit.alive_until_ticks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_generation_starts_at_once_when_nothing_was_stopped() {
        let exit = Exit {
            code: Some(1),
            signal: None,
            alive_until_ticks: 4242,
        };
        assert_eq!(next_generation_after(Some(&exit)), 4242);
        assert_eq!(next_generation_after(None), 0, "an unidentified workload may still run");
    }
}
