//! The machine's modes, event by event: what it asks for and in which order (a commit before
//! the receipt or the relaying it allows), stale terms refused, a failed commit undone, the
//! hello budget and the deadlines in simulated time. No socket, file or runtime.

use std::time::{Duration, Instant};

use proto::registry::v1::RegisterResponse;
use proto::runtime::v1::{
    Alive, Attached, GrantPresentation, Redirect, Release, Relinquish, SupervisorMessage, WorkloadResponse,
    sidecar_message, supervisor_message, workload_response,
};
use proto::trust::TrustBundle;

use super::effect::{Effect, Ending, Event, Keys, Now, Reply};
use super::machine::{LOST, Machine, Mode, STOPPING, Setup};
use super::relay::MAX_HELD;
use crate::fence::Fence;
use crate::link::{First, StreamId};
use crate::process::Exit;
use crate::receipt::ReceiptKey;
use crate::store::State;
use crate::testkit::*;
use crate::workload::{Answer, Op};

/// A requester: `closed` once it stopped waiting.
#[derive(Debug)]
struct Probe {
    id: u32,
    closed: bool,
}

impl Reply for Probe {
    fn is_closed(&self) -> bool {
        self.closed
    }
}

type Effects = Vec<Effect<Probe>>;

struct Harness {
    m: Machine<Probe>,
    now: Now,
}

const A: &str = "http://10.0.0.1:50061";
const B: &str = "http://10.0.0.2:50061";

impl Harness {
    /// Persisted generation 7, nothing activated; `pinned` gives it a workload (pid 42).
    fn new(pinned: bool, local: bool) -> Self {
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
    fn placing() -> Self {
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
    fn active() -> Self {
        let mut h = Self::placing();
        h.activate(1, 1, "m1");
        h
    }

    fn on(&mut self, event: Event<Probe>) -> Effects {
        self.m.on(self.now, event)
    }

    fn advance(&mut self, by: Duration) {
        self.now.at += by;
        self.now.unix_ms += i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
    }

    fn message(&mut self, id: StreamId, kind: supervisor_message::Kind) -> Effects {
        self.on(Event::Message {
            id,
            message: SupervisorMessage { kind: Some(kind) },
            keys: Some(keys(bundle(), false)),
        })
    }

    /// Grant, commit, receipt, proof, commit: term `term` active on `id`.
    fn activate(&mut self, id: StreamId, term: u64, member: &str) {
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

    fn request(&mut self, id: u32) -> Effects {
        self.on(Event::Request {
            op: Op::Liveness,
            reply: Probe { id, closed: false },
        })
    }
}

fn keys(bundle: TrustBundle, fresh: bool) -> Keys {
    Keys {
        bundle: Ok(bundle),
        fresh,
    }
}

fn present(term: u64, member: &str, jti: &str) -> supervisor_message::Kind {
    supervisor_message::Kind::GrantPresentation(GrantPresentation {
        grant: grant(term, member, jti),
        member: member.into(),
        process_id: format!("{member}-p"),
    })
}

fn attached(term: u64, member: &str) -> supervisor_message::Kind {
    supervisor_message::Kind::Attached(Attached {
        route: ROUTE.into(),
        term,
        member: member.into(),
        process_id: format!("{member}-p"),
        recovery_deadline_ms: 0,
    })
}

/// Each effect in a word or three, for checking order.
fn names(effects: &[Effect<Probe>]) -> Vec<String> {
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
            Effect::Verify { id, reload, .. } => format!("verify {id} reload {reload}"),
            Effect::Done { ending, exit } => format!("done {ending:?} {}", exit.is_some()),
        })
        .collect()
}

fn committed_fence(effects: &[Effect<Probe>]) -> Fence {
    match effects {
        [Effect::Commit(state)] => state.fence.clone(),
        other => panic!("expected one commit, got {other:?}"),
    }
}

#[test]
fn unregistered_waits_for_a_generation_then_places_with_the_instance_token() {
    let mut h = Harness::new(true, false);
    h.m.state.generation = 0;
    assert!(h.on(Event::Started).is_empty());
    assert!(h.on(Event::Tick).is_empty(), "no dial before the generation is known");
    let no_generation = RegisterResponse::default();
    assert!(h.on(Event::Registered(no_generation)).is_empty());
    let response = RegisterResponse {
        instance: Some(instance()),
        instance_token: "issued".into(),
        recovery_deadline_ms: 5_000,
        ..RegisterResponse::default()
    };
    let effects = h.on(Event::Registered(response));
    let [Effect::Persist(state)] = effects.as_slice() else {
        panic!("the generation is persisted: {effects:?}")
    };
    assert_eq!(state.generation, 7);
    let Mode::Placing { deadline_ms, .. } = h.m.mode else {
        panic!("placing")
    };
    assert_eq!(deadline_ms, 5_000);
    let dial = h.on(Event::Tick);
    let [Effect::Dial { token: Some(token), .. }] = dial.as_slice() else {
        panic!("dials with the issued token: {dial:?}")
    };
    assert_eq!(token.expose(), "issued");
}

#[test]
fn placing_fails_after_the_deadline_and_stops_the_workload() {
    let mut h = Harness::placing();
    h.advance(Duration::from_secs(59));
    assert!(h.on(Event::Tick).is_empty());
    h.advance(Duration::from_secs(1));
    assert_eq!(names(&h.on(Event::Tick)), ["stop workload"]);
    let Some(Ending::RecoveryFailed { request }) = h.m.ending.clone() else {
        panic!("recovery failed")
    };
    assert_eq!(
        (request.fence_term, request.attempts, request.recovery_deadline_ms),
        (0, 0, 60_000)
    );
    let done = h.on(Event::Exited(Exit::default()));
    assert!(matches!(
        done.as_slice(),
        [Effect::Done {
            ending: Ending::RecoveryFailed { .. },
            exit: Some(_)
        }]
    ));
}

#[test]
fn a_grant_is_committed_before_the_receipt_leaves_and_fences_every_other_stream() {
    let mut h = Harness::placing();
    // Grants and proofs need the trust bundle: the driver is asked for it first.
    let asked = h.on(Event::Message {
        id: 1,
        message: SupervisorMessage {
            kind: Some(present(1, "m1", "g1")),
        },
        keys: None,
    });
    assert_eq!(names(&asked), ["verify 1 reload false"]);
    let effects = h.message(1, present(1, "m1", "g1"));
    let fence = committed_fence(&effects);
    assert_eq!((fence.floor, fence.activated, fence.pending_term()), (1, 0, 1));
    assert_eq!(names(&h.on(Event::Committed(Ok(())))), ["send 1 receipt"]);
    // The same grant re-presented: the same receipt, nothing to commit.
    assert_eq!(names(&h.message(1, present(1, "m1", "g1"))), ["send 1 receipt"]);
}

#[test]
fn a_failed_commit_restores_the_fence_and_acknowledges_nothing() {
    let mut h = Harness::placing();
    h.message(1, present(1, "m1", "g1"));
    let effects = h.on(Event::Committed(Err("disk full".into())));
    assert_eq!(names(&effects), ["abort 1"], "no receipt without the commit");
    assert_eq!(h.m.state.fence, Fence::default());
    // The activation's commit fails alike: still not active, the term not activated.
    let mut h = Harness::placing();
    h.message(1, present(1, "m1", "g1"));
    h.on(Event::Committed(Ok(())));
    let receipted = h.m.state.fence.clone();
    h.message(1, supervisor_message::Kind::ActivationConfirm(proof(1, "m1", "g1")));
    assert_eq!(names(&h.on(Event::Committed(Err("io".into())))), ["abort 1"]);
    assert_eq!(h.m.state.fence, receipted);
    assert!(matches!(h.m.mode, Mode::Placing { .. }));
    assert_eq!(h.m.owner, None);
}

#[test]
fn activation_is_committed_before_held_requests_are_relayed() {
    let mut h = Harness::placing();
    assert!(h.request(1).is_empty(), "held while placing");
    assert!(h.request(2).is_empty());
    h.message(1, present(1, "m1", "g1"));
    h.on(Event::Committed(Ok(())));
    let confirm = supervisor_message::Kind::ActivationConfirm(proof(1, "m1", "g1"));
    let fence = committed_fence(&h.message(1, confirm));
    assert_eq!(fence.activated, 1);
    assert_eq!(
        names(&h.on(Event::Committed(Ok(())))),
        ["persist", "send 1 request 1", "send 1 request 2"]
    );
    let alive = supervisor_message::Kind::WorkloadResponse(WorkloadResponse {
        request_id: 2,
        kind: Some(workload_response::Kind::Alive(Alive {})),
    });
    assert_eq!(names(&h.message(1, alive)), ["answer 2"]);
}

#[test]
fn stale_terms_are_refused_and_their_streams_closed() {
    let mut h = Harness::active();
    h.activate(1, 3, "m2");
    // A grant at or below the activated term, an Attached of an older term.
    assert_eq!(names(&h.message(1, present(2, "m1", "g2"))), ["abort 1", "persist"]);
    assert_eq!(h.m.state.fence.activated, 3, "a refusal never changes the fence");
    let mut h = Harness::active();
    h.activate(1, 3, "m2");
    assert_eq!(names(&h.message(1, attached(1, "m1")))[0], "abort 1");
    assert!(
        matches!(h.m.mode, Mode::Recovering { .. }),
        "the owner's stream is gone"
    );
}

#[test]
fn an_unknown_kid_reads_the_bundle_once_more_then_refuses() {
    let mut h = Harness::placing();
    let empty = TrustBundle::new(ISS);
    let mut deliver = |keys: Keys| {
        h.on(Event::Message {
            id: 1,
            message: SupervisorMessage {
                kind: Some(present(1, "m1", "g1")),
            },
            keys: Some(keys),
        })
    };
    assert_eq!(names(&deliver(keys(empty.clone(), false))), ["verify 1 reload true"]);
    assert_eq!(names(&deliver(keys(empty, true))), ["abort 1"]);
    let unreadable = Keys {
        bundle: Err("no trust.jwks".into()),
        fresh: false,
    };
    assert!(deliver(unreadable).is_empty(), "stream 1 is gone");
    assert_eq!(h.m.state.fence, Fence::default());
}

#[test]
fn losing_the_owner_fails_its_requests_and_recovers_with_hellos_under_the_budget() {
    let mut h = Harness::active();
    assert_eq!(names(&h.request(7)), ["send 1 request 1"]);
    let lost = h.on(Event::Closed {
        id: 1,
        opened: true,
        reason: "silent".into(),
    });
    let lost = names(&lost);
    assert_eq!(lost[0], "abort 1");
    assert!(lost.contains(&format!("refuse 7: {LOST}")), "{lost:?}");
    assert!(
        lost.contains(&"persist".to_owned()),
        "the episode's deadline is persisted"
    );
    let Mode::Recovering { episode } = &h.m.mode else {
        panic!("recovering")
    };
    assert_eq!(episode.deadline_ms(), 20_000, "the activation's recovery deadline");
    assert_eq!(h.m.state.recovery_deadline_at_ms, Some(NOW_MS + 20_000));
    // A request made now is held (bounded), not refused.
    assert!(h.request(9).is_empty());
    // The next member is dialed (the other address first: the lost owner is likely dead).
    h.advance(Duration::from_secs(5));
    let dial = h.on(Event::Tick);
    let [
        Effect::Dial {
            id: 2,
            address,
            first: First::Hello(_),
            ..
        },
    ] = dial.as_slice()
    else {
        panic!("hello dial: {dial:?}")
    };
    assert_eq!(address, B);
    h.on(Event::Opened(2));
    // The link did not take the first slot: the machine sends one hello per interval.
    assert_eq!(names(&h.on(Event::Tick)), ["send 2 hello 1"]);
    h.advance(Duration::from_millis(500));
    assert!(h.on(Event::Tick).is_empty());
    h.advance(Duration::from_millis(500));
    assert_eq!(names(&h.on(Event::Tick)), ["send 2 hello 2"]);
    // The deadline: the workload is stopped, held requests refused, then Done on exit.
    h.advance(Duration::from_secs(15));
    let stop = names(&h.on(Event::Tick));
    assert_eq!(stop, [format!("refuse 9: {STOPPING}"), "stop workload".into()]);
    assert!(h.message(2, present(2, "m2", "g2")).is_empty(), "stop won");
    let done = h.on(Event::Exited(Exit::default()));
    assert!(matches!(
        done.as_slice(),
        [Effect::Done {
            ending: Ending::RecoveryFailed { .. },
            exit: Some(_)
        }]
    ));
}

#[test]
fn a_takeover_grant_fences_the_owner_then_activates_the_new_term() {
    let mut h = Harness::active();
    h.on(Event::Closed {
        id: 1,
        opened: true,
        reason: "silent".into(),
    });
    h.advance(Duration::from_secs(5));
    h.on(Event::Tick);
    h.on(Event::Opened(2));
    h.activate(2, 2, "m2");
    assert_eq!(h.m.state.fence.owner.as_ref().map(|o| o.member.as_str()), Some("m2"));
    // The old owner's later Attached is refused: it reaches no stream (1 is gone).
    assert!(h.message(1, attached(1, "m1")).is_empty());
}

#[test]
fn a_grant_on_the_owners_stream_while_active_enters_recovery_after_the_commit() {
    let mut h = Harness::active();
    assert_eq!(names(&h.request(5)), ["send 1 request 1"]);
    assert_eq!(names(&h.message(1, present(2, "m2", "g2"))), ["commit"]);
    assert!(matches!(h.m.mode, Mode::Active), "nothing changes before the commit");
    let after = names(&h.on(Event::Committed(Ok(()))));
    assert_eq!(
        after,
        [format!("refuse 5: {LOST}"), "persist".into(), "send 1 receipt".into()]
    );
    assert!(matches!(h.m.mode, Mode::Recovering { .. }));
}

#[test]
fn relinquish_is_persisted_before_the_stream_closes() {
    let mut h = Harness::active();
    let relinquish = supervisor_message::Kind::Relinquish(Relinquish { term: 1 });
    let effects = h.message(1, relinquish);
    let [Effect::Persist(state), Effect::Abort(1), Effect::Persist(_)] = effects.as_slice() else {
        panic!("persist, close, recovery: {effects:?}")
    };
    assert!(state.fence.relinquished);
    let Mode::Recovering { episode } = &h.m.mode else {
        panic!("recovering")
    };
    let hello = match episode.take(h.now.at) {
        crate::recovery::Slot::Ready(hello) => hello,
        other => panic!("{other:?}"),
    };
    assert!(hello.relinquished && hello.fence_term == 1);
}

#[test]
fn release_by_the_owner_stops_the_workload_and_answers_stopped_on_its_stream() {
    let mut h = Harness::active();
    let foreign = supervisor_message::Kind::Release(Release {
        term: 2,
        reason: "no".into(),
    });
    assert!(h.message(1, foreign).is_empty(), "not the activated term: ignored");
    assert_eq!(names(&h.request(4)), ["send 1 request 1"]);
    let release = supervisor_message::Kind::Release(Release {
        term: 1,
        reason: "done".into(),
    });
    assert_eq!(
        names(&h.message(1, release)),
        [format!("refuse 4: {STOPPING}"), "stop workload".into()]
    );
    assert_eq!(names(&h.request(6)), [format!("refuse 6: {STOPPING}")]);
    let exit = Exit {
        code: Some(0),
        signal: None,
    };
    let done = h.on(Event::Exited(exit));
    let [
        Effect::Send {
            id: 1,
            kind: sidecar_message::Kind::Stopped(stopped),
        },
        Effect::Done {
            ending: Ending::Released { reason },
            exit: Some(_),
        },
    ] = done.as_slice()
    else {
        panic!("Stopped on the release stream, then done: {done:?}")
    };
    assert_eq!((stopped.reason.as_str(), reason.as_str()), ("released: done", "done"));
    let conclusion =
        h.m.conclude(Ending::Released { reason: "done".into() }, Some(exit))
            .expect("reported");
    assert_eq!(conclusion.state.ended.as_deref(), Some("released: done"));
}

#[test]
fn shutdown_stops_only_a_workload_the_sidecar_started() {
    let mut h = Harness::new(true, false);
    assert_eq!(names(&h.on(Event::Shutdown)), ["done Shutdown false"]);
    assert!(h.m.conclude(Ending::Shutdown, None).is_none(), "stays registered");
    let mut h = Harness::new(true, true);
    assert_eq!(names(&h.on(Event::Shutdown)), ["stop workload"]);
    assert!(h.on(Event::Shutdown).is_empty(), "stop once");
}

#[test]
fn sends_the_stream_cannot_take_refuse_the_request_or_close_the_stream() {
    let mut h = Harness::active();
    h.request(1);
    let congested = h.on(Event::Unsent {
        id: 1,
        request: Some(1),
    });
    assert_eq!(names(&congested), ["refuse 1: the supervisor stream is congested"]);
    assert!(matches!(h.m.mode, Mode::Active), "a congested relay keeps the owner");
    let gone = names(&h.on(Event::Unsent { id: 1, request: None }));
    assert_eq!(gone[0], "abort 1");
    assert!(matches!(h.m.mode, Mode::Recovering { .. }));
}

#[test]
fn a_requester_gone_before_relaying_is_skipped_and_the_held_queue_is_bounded() {
    let mut h = Harness::placing();
    h.on(Event::Request {
        op: Op::Liveness,
        reply: Probe { id: 1, closed: true },
    });
    for id in 2..=u32::try_from(MAX_HELD).unwrap_or(u32::MAX) {
        assert!(h.request(id).is_empty());
    }
    assert_eq!(
        names(&h.request(999)),
        ["refuse 999: too many requests held while the supervisor recovers"]
    );
    h.activate(1, 1, "m1");
    assert_eq!(h.m.inflight.len(), 64, "the rest were refused: too many in flight");
}

#[test]
fn admission_and_pinning_from_the_peer_credentials() {
    let mut h = Harness::new(false, false);
    let invisible = names(&h.on(Event::Peer { pid: None }));
    assert!(invisible[0].starts_with("admit Refused"), "{invisible:?}");
    assert_eq!(names(&h.on(Event::Peer { pid: Some(42) })), ["admit NeedsIdentity"]);
    h.on(Event::Started);
    h.on(Event::Tick);
    h.on(Event::Opened(1));
    h.activate(1, 1, "m1");
    let pinned = h.on(Event::Pin(workload()));
    assert_eq!(
        names(&pinned),
        ["persist", "watch 42", "send 1 workload", "admit Admitted"]
    );
    assert_eq!(
        names(&h.on(Event::Peer { pid: Some(43) })),
        ["admit if 43 descends from 42"]
    );
    assert_eq!(names(&h.on(Event::Pin(workload()))), ["admit if 42 descends from 42"]);
    let local = names(&Harness::new(false, true).on(Event::Peer { pid: Some(1) }));
    assert_eq!(local, ["admit Refused(\"the workload process has ended\")"]);
}

#[test]
fn a_new_generation_starts_the_fence_over() {
    let mut h = Harness::active();
    let response = RegisterResponse {
        instance: Some(proto::common::v1::InstanceRef {
            generation: 8,
            ..instance()
        }),
        ..RegisterResponse::default()
    };
    let effects = h.on(Event::Registered(response));
    assert_eq!(names(&effects)[0], "abort 1");
    let Some(Effect::Persist(state)) = effects.last() else {
        panic!("the new generation is persisted: {effects:?}")
    };
    assert_eq!((state.generation, state.fence.clone()), (8, Fence::default()));
    assert!(matches!(h.m.mode, Mode::Placing { .. }));
}

#[test]
fn redirects_are_followed_only_for_this_route_at_or_above_the_fence() {
    let mut h = Harness::placing();
    let redirect = |route: &str, term: u64| {
        supervisor_message::Kind::Redirect(Redirect {
            route: route.into(),
            term,
            member: "m9".into(),
            runtime_address: "http://10.0.0.9:50061".into(),
            ..Redirect::default()
        })
    };
    let elsewhere = "http://10.0.0.9:50061";
    let redirected = |h: &mut Harness, id: StreamId, route: &str, term: u64| {
        assert_eq!(names(&h.message(id, redirect(route, term))), [format!("abort {id}")]);
        h.advance(Duration::from_secs(10));
        let dial = h.on(Event::Tick);
        let [Effect::Dial { id: next, address, .. }] = dial.as_slice() else {
            panic!("dials again: {dial:?}")
        };
        assert_eq!(*next, id + 1);
        h.on(Event::Opened(*next));
        address.clone()
    };
    assert_ne!(redirected(&mut h, 1, ROUTE, 0), elsewhere, "term 0 is below any grant");
    assert_ne!(redirected(&mut h, 2, "team-a/other", 1), elsewhere, "another route");
    assert_eq!(redirected(&mut h, 3, ROUTE, 1), elsewhere);
    let mut h = Harness::active();
    h.activate(1, 2, "m1");
    assert_eq!(names(&h.message(1, redirect(ROUTE, 1)))[0], "abort 1");
    assert_eq!(h.m.dial.preferred, None, "below the activated term");
}

#[test]
fn an_unreadable_token_backs_off_without_a_stream() {
    let mut h = Harness::new(true, false);
    h.on(Event::Started);
    let dial = h.on(Event::Tick);
    let [Effect::Dial { id, .. }] = dial.as_slice() else {
        panic!("dial")
    };
    let id = *id;
    assert!(
        h.on(Event::Undialed {
            id,
            reason: "no token".into()
        })
        .is_empty()
    );
    assert!(h.m.streams.is_empty());
    assert!(h.m.dial.next_at > h.now.at, "retried after a backoff");
    assert!(h.on(Event::Tick).is_empty());
}

#[test]
fn a_failed_announcement_on_activation_recovers_instead_of_relaying() {
    // The workload connects (and is pinned) while placing; the activation then announces it
    // and relays the held request. The announcement cannot be sent: the owner's stream is
    // closed, the relayed request fails as not replayed, and recovery starts.
    let mut h = Harness::new(false, false);
    h.on(Event::Started);
    h.on(Event::Tick);
    h.on(Event::Opened(1));
    assert_eq!(
        names(&h.on(Event::Pin(workload()))),
        ["persist", "watch 42", "admit Admitted"]
    );
    assert!(h.request(3).is_empty());
    h.message(1, present(1, "m1", "g1"));
    h.on(Event::Committed(Ok(())));
    h.message(1, supervisor_message::Kind::ActivationConfirm(proof(1, "m1", "g1")));
    let activated = names(&h.on(Event::Committed(Ok(()))));
    assert_eq!(activated, ["persist", "send 1 workload", "send 1 request 1"]);
    let failed = names(&h.on(Event::Unsent { id: 1, request: None }));
    assert_eq!(
        failed,
        ["abort 1".to_owned(), format!("refuse 3: {LOST}"), "persist".into()]
    );
    assert!(matches!(h.m.mode, Mode::Recovering { .. }));
    // The relay's own send then finds no stream: nothing more to refuse.
    assert!(
        h.on(Event::Unsent {
            id: 1,
            request: Some(1)
        })
        .is_empty()
    );
}
