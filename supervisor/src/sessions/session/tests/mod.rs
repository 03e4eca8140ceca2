//! The session machine, event by event: what it asks for and in which order (a grant presented
//! before its receipt is taken, Activate sent once and only for a receipted grant, a stop
//! releasing instead of activating, Relinquish before the stream is let go), fences refused,
//! unsent messages undone, and the deadlines in simulated time. No socket, call or runtime.
//! This file is the harness; `takeover` checks the takeover, `modes` the other modes, the
//! relay and the status.

mod modes;
mod takeover;

use std::time::{Duration, Instant};

use proto::common::v1::{InstancePhase, InstanceRef, WorkloadIdentity};
use proto::recovery::v1::{ActivationProof, IssueGrantResponse, Receipt};
use proto::runtime::v1::{RecoveryHello, sidecar_message, supervisor_message};

use super::effect::{Effect, Event, Now, StreamId};
use super::machine::{Machine, Setup};
use crate::runtime::route::Me;
use crate::runtime::stream::Opening;
use crate::sessions::SessionEvent;
use crate::sessions::material::{Credentials, Grant};
use crate::sessions::plan::{Assignment, TermPhase};

pub(super) const ROUTE: &str = "team-a/agent";
pub(super) const NOW_MS: i64 = 1_700_000_000_000;
pub(super) const DEADLINE_MS: u64 = 30_000;

pub(super) type Effects = Vec<Effect>;

pub(super) struct Harness {
    pub m: Machine,
    pub now: Now,
}

pub(super) fn instance() -> InstanceRef {
    InstanceRef {
        namespace: "team-a".into(),
        name: "agent".into(),
        uid: "uid-1".into(),
        generation: 1,
    }
}

pub(super) fn material() -> Option<Credentials> {
    Credentials::from_wire(b"{}")
}

pub(super) fn assignment(term: u64, phase: TermPhase, credentials: Option<Credentials>) -> Assignment {
    Assignment {
        term,
        phase,
        credentials,
        grant: None,
    }
}

impl Harness {
    /// A session at `assignment`, started (its first status published).
    pub(super) fn new(assignment: Assignment) -> Self {
        Self::with_policy(assignment, None)
    }

    /// As `new`, installing `policy` in the sidecar.
    pub(super) fn with_policy(
        assignment: Assignment,
        policy: Option<std::sync::Arc<proto::runtime::v1::EgressPolicy>>,
    ) -> Self {
        let setup = Setup {
            route: ROUTE.into(),
            instance: instance(),
            me: Me {
                member: "m-0".into(),
                process_id: "p-0".into(),
            },
            policy,
            released: 0,
        };
        let now = Now {
            at: Instant::now(),
            unix_ms: NOW_MS,
            recovery_deadline_ms: DEADLINE_MS,
        };
        let mut h = Self {
            m: Machine::new(setup, assignment, now),
            now,
        };
        let started = names(&h.on(Event::Started));
        assert!(
            matches!(started.as_slice(), [publish, announce] if publish.starts_with("publish") && announce == "announce")
        );
        h
    }

    /// Term `term` reserved for this process, with launch material.
    pub(super) fn reserved(term: u64) -> Self {
        Self::new(assignment(term, TermPhase::Reserved, material()))
    }

    /// Term `term` active (adopted from the snapshot) and sidecar stream 1 attached at it.
    pub(super) fn attached(term: u64) -> Self {
        let mut h = Self::new(assignment(term, TermPhase::Active, material()));
        let effects = h.connect(1, term, false);
        assert_eq!(io(&effects), ["send 1 Attached"]);
        assert_eq!(h.phase(), (InstancePhase::Active, String::new()));
        h
    }

    /// Term `term` taken over on stream 1: grant issued, presented, receipted, activated and
    /// confirmed.
    pub(super) fn taken_over(term: u64) -> Self {
        let mut h = Self::reserved(term);
        assert_eq!(io(&h.connect(1, 0, false)), [format!("issue grant {term}")]);
        assert_eq!(io(&h.on(granted(term))), ["send 1 GrantPresentation"]);
        assert_eq!(io(&h.message(1, receipt(term, "g"))), ["activate"]);
        assert_eq!(io(&h.on(activated(term))), ["send 1 ActivationConfirm"]);
        assert_eq!(h.phase(), (InstancePhase::Active, String::new()));
        h
    }

    pub(super) fn on(&mut self, event: Event) -> Effects {
        self.m.on(self.now, event)
    }

    pub(super) fn member(&mut self, event: SessionEvent) -> Effects {
        self.on(Event::Member(event))
    }

    pub(super) fn advance(&mut self, by: Duration) {
        self.now.at += by;
        self.now.unix_ms += i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
    }

    /// Sidecar stream `stream` arrives with `fence` (a RecoveryHello when `relinquished`).
    pub(super) fn connect(&mut self, stream: StreamId, fence: u64, relinquished: bool) -> Effects {
        let opening = Opening {
            route: ROUTE.into(),
            instance: instance(),
            fence_term: fence,
            relinquished,
            recovering: relinquished,
            workload: WorkloadIdentity {
                pid: 42,
                ..WorkloadIdentity::default()
            },
        };
        self.on(Event::Sidecar { stream, opening })
    }

    pub(super) fn message(&mut self, stream: StreamId, kind: sidecar_message::Kind) -> Effects {
        self.on(Event::Message { stream, kind })
    }

    pub(super) fn lose(&mut self, stream: StreamId) -> Effects {
        self.on(Event::Lost {
            stream,
            reason: "the sidecar closed the stream".into(),
        })
    }

    /// The phase and message last published.
    pub(super) fn phase(&self) -> (InstancePhase, String) {
        let status = &self.m.published;
        (status.phase(), status.message.clone())
    }
}

pub(super) fn granted(term: u64) -> Event {
    Event::Granted(Ok(IssueGrantResponse {
        grant: format!("grant-{term}"),
        grant_id: "g".into(),
        expires_at_ms: NOW_MS + 30_000,
        instance: Some(instance()),
    }))
}

pub(super) fn activated(term: u64) -> Event {
    Event::Activated(Ok(ActivationProof {
        route: ROUTE.into(),
        instance: Some(instance()),
        term,
        activated_at_ms: NOW_MS,
        proof: format!("proof-{term}"),
        grant_id: "g".into(),
    }))
}

pub(super) fn receipt(term: u64, grant_id: &str) -> sidecar_message::Kind {
    sidecar_message::Kind::Receipt(Receipt {
        route: ROUTE.into(),
        instance: Some(instance()),
        term,
        grant_id: grant_id.into(),
        ..Receipt::default()
    })
}

pub(super) fn hello(fence: u64, relinquished: bool) -> sidecar_message::Kind {
    sidecar_message::Kind::RecoveryHello(RecoveryHello {
        route: ROUTE.into(),
        instance: Some(instance()),
        fence_term: fence,
        relinquished,
        ..RecoveryHello::default()
    })
}

pub(super) fn snapshot_grant(expires_at_ms: i64) -> Option<Grant> {
    Grant::from_snapshot("snapshot-grant", expires_at_ms)
}

/// Each effect in a word or three, for checking order.
pub(super) fn names(effects: &[Effect]) -> Vec<String> {
    effects
        .iter()
        .map(|effect| match effect {
            Effect::Send { stream, kind } => format!("send {stream} {}", super::effect::message_name(kind)),
            Effect::Refuse { stream, .. } => format!("refuse {stream}"),
            Effect::Drop(stream) => format!("drop {stream}"),
            Effect::IssueGrant(request) => format!("issue grant {}", request.term),
            Effect::Activate(_) => "activate".into(),
            Effect::CancelCall => "cancel call".into(),
            Effect::RecordAudit(request) => format!("record audit {} ({})", request.term, request.records.len()),
            Effect::Publish(status) => format!(
                "publish {}",
                status.phase().as_str_name().trim_start_matches("INSTANCE_PHASE_")
            ),
            Effect::Announce => "announce".into(),
            Effect::Done => "done".into(),
        })
        .collect()
}

/// The effects that reach a stream or the gateway (status publication left out).
pub(super) fn io(effects: &[Effect]) -> Vec<String> {
    names(effects)
        .into_iter()
        .filter(|n| !n.starts_with("publish") && n != "announce")
        .collect()
}

/// The message sent on `stream`, if exactly one was.
pub(super) fn sent(effects: &[Effect], stream: StreamId) -> supervisor_message::Kind {
    let mut sends = effects.iter().filter_map(|e| match e {
        Effect::Send { stream: s, kind } if *s == stream => Some(kind.clone()),
        _ => None,
    });
    match (sends.next(), sends.next()) {
        (Some(kind), None) => kind,
        _ => panic!("expected one message on stream {stream}: {effects:?}"),
    }
}
