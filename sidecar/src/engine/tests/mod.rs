//! The machine's modes, event by event: what it asks for and in which order (a commit before
//! the receipt or the relaying it allows), stale terms refused, a failed commit undone, the
//! hello budget and the deadlines in simulated time. No socket, file or runtime. This file is
//! the harness; `control` checks member messages, `modes` the modes and the workload side.

mod audit;
mod control;
mod egress;
mod modes;

use std::time::{Duration, Instant};

use proto::runtime::v1::{Attached, GrantPresentation, SupervisorMessage, sidecar_message, supervisor_message};
use proto::trust::TrustBundle;

use super::effect::{Effect, Event, Keys, Now, Reply};
use super::machine::{Machine, Mode, Setup};
use crate::fence::Fence;
use crate::receipt::ReceiptKey;
use crate::runtime_link::{First, StreamId};
use crate::state_file::State;
use crate::testkit::*;
use crate::workload::{Answer, Op};

/// A requester: `closed` once it stopped waiting.
#[derive(Debug)]
pub(super) struct Probe {
    pub id: u32,
    pub closed: bool,
}

impl Reply for Probe {
    fn is_closed(&self) -> bool {
        self.closed
    }
}

pub(super) type Effects = Vec<Effect<Probe>>;

pub(super) struct Harness {
    pub m: Machine<Probe>,
    pub now: Now,
}

pub(super) const A: &str = "http://10.0.0.1:50061";
pub(super) const B: &str = "http://10.0.0.2:50061";

impl Harness {
    /// Persisted generation 7, nothing activated; `pinned` gives it a workload (pid 42).
    pub(super) fn new(pinned: bool, local: bool) -> Self {
        let setup = Setup {
            route: ROUTE.into(),
            instance: instance(),
            addresses: vec![A.into(), B.into()],
            issuer: ISS.into(),
            local,
        };
        let mut state = State::new(ROUTE, "u-1");
        state.receipt_key = ReceiptKey::from_bytes([3; 32]);
        state.generation = 7;
        let now = Now {
            at: Instant::now(),
            unix_ms: NOW_MS,
        };
        let m = Machine::new(setup, state, pinned.then(workload), now);
        Self { m, now }
    }

    /// Started and placing, with the Attach stream 1 open.
    pub(super) fn placing() -> Self {
        let mut h = Self::new(true, false);
        assert!(h.on(Event::Started).is_empty());
        assert!(matches!(h.m.mode, Mode::Placing { .. }));
        let dial = h.on(Event::Tick);
        let [
            Effect::Dial {
                id: 1,
                address,
                first: First::Attach(attach),
                token: None,
            },
        ] = dial.as_slice()
        else {
            panic!("expected the Attach dial, got {dial:?}")
        };
        assert_eq!((address.as_str(), attach.fence_term), (A, 0));
        h.on(Event::Opened(1));
        h
    }

    /// Term 1 activated by m1 on stream 1.
    pub(super) fn active() -> Self {
        let mut h = Self::placing();
        h.activate(1, 1, "m1");
        h
    }

    pub(super) fn on(&mut self, event: Event<Probe>) -> Effects {
        self.m.on(self.now, event)
    }

    pub(super) fn advance(&mut self, by: Duration) {
        self.now.at += by;
        self.now.unix_ms += i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
    }

    pub(super) fn message(&mut self, id: StreamId, kind: supervisor_message::Kind) -> Effects {
        self.on(Event::Message {
            id,
            message: SupervisorMessage { kind: Some(kind) },
            keys: Some(keys(bundle(), false)),
        })
    }

    /// Grant, commit, receipt, proof, commit: term `term` active on `id`.
    pub(super) fn activate(&mut self, id: StreamId, term: u64, member: &str) {
        let jti = format!("g{term}");
        assert_eq!(names(&self.message(id, present(term, member, &jti))), ["commit"]);
        let sent = names(&self.on(Event::Committed(Ok(()))));
        assert_eq!(
            sent.last().map(String::as_str),
            Some(format!("send {id} receipt").as_str())
        );
        let confirm = supervisor_message::Kind::ActivationConfirm(proof(term, member, &jti));
        assert_eq!(names(&self.message(id, confirm)), ["commit"]);
        self.on(Event::Committed(Ok(())));
        assert!(matches!(self.m.mode, Mode::Active));
        assert_eq!((self.m.state.fence.activated, self.m.owner), (term, Some(id)));
    }

    pub(super) fn request(&mut self, id: u32) -> Effects {
        self.on(Event::Request {
            op: Op::Liveness,
            reply: Probe { id, closed: false },
        })
    }
}

pub(super) fn keys(bundle: TrustBundle, fresh: bool) -> Keys {
    Keys {
        bundle: Ok(std::sync::Arc::new(bundle)),
        fresh,
    }
}

pub(super) fn present(term: u64, member: &str, jti: &str) -> supervisor_message::Kind {
    supervisor_message::Kind::GrantPresentation(GrantPresentation {
        grant: grant(term, member, jti),
        member: member.into(),
        process_id: format!("{member}-p"),
    })
}

pub(super) fn attached(term: u64, member: &str) -> supervisor_message::Kind {
    supervisor_message::Kind::Attached(Attached {
        route: ROUTE.into(),
        term,
        member: member.into(),
        process_id: format!("{member}-p"),
        recovery_deadline_ms: 0,
    })
}

/// Each effect in a word or three, for checking order.
pub(super) fn names(effects: &[Effect<Probe>]) -> Vec<String> {
    use sidecar_message::Kind;
    effects
        .iter()
        .map(|effect| match effect {
            Effect::Persist(_) => "persist".into(),
            Effect::Commit(_) => "commit".into(),
            Effect::Dial { id, .. } => format!("dial {id}"),
            Effect::Send { id, kind } => match kind {
                Kind::Receipt(_) => format!("send {id} receipt"),
                Kind::WorkloadRequest(r) => format!("send {id} request {}", r.request_id),
                Kind::RecoveryHello(h) => format!("send {id} hello {}", h.attempt),
                Kind::Stopped(_) => format!("send {id} stopped"),
                Kind::WorkloadStarted(_) => format!("send {id} workload"),
                Kind::PolicyLoaded(l) => format!("send {id} loaded {:?} {} {:?}", l.name, l.revision, l.error),
                Kind::AuditRecords(a) => format!(
                    "send {id} audit {:?}",
                    a.records.iter().map(|r| r.sequence).collect::<Vec<_>>()
                ),
                other => format!("send {id} {other:?}"),
            },
            Effect::Abort(id) => format!("abort {id}"),
            Effect::Answer { reply, answer } => match answer {
                Answer::Refused(reason) => format!("refuse {}: {reason}", reply.id),
                _ => format!("answer {}", reply.id),
            },
            Effect::Admit(admission) => format!("admit {admission:?}"),
            Effect::AdmitDescendant { pid, ancestor } => format!("admit if {pid} descends from {ancestor}"),
            Effect::Watch(identity) => format!("watch {}", identity.pid),
            Effect::StopWorkload => "stop workload".into(),
            Effect::Enforce(policy) => format!("enforce {} {}", policy.name, policy.revision),
            Effect::FetchAudit { after } => format!("fetch audit after {after}"),
            Effect::AckAudit(through) => format!("ack audit {through}"),
            Effect::Verify { id, reload, .. } => format!("verify {id} reload {reload}"),
            Effect::Register(standing) => format!("register at fence {}", standing.fence_term),
            Effect::Done { ending, exit } => format!("done {ending:?} {}", exit.is_some()),
        })
        .collect()
}

pub(super) fn committed_fence(effects: &[Effect<Probe>]) -> Fence {
    match effects {
        [Effect::Commit(state)] => state.fence.clone(),
        other => panic!("expected one commit, got {other:?}"),
    }
}
