//! Member messages: grants and confirmations committed before they are acknowledged, stale
//! terms, the trust bundle read again once, takeover, Relinquish, Release, redirects.

use std::time::Duration;

use proto::runtime::v1::{
    Alive, Redirect, Release, Relinquish, SupervisorMessage, WorkloadResponse, sidecar_message, supervisor_message,
    workload_response,
};
use proto::trust::TrustBundle;

use super::*;
use crate::engine::effect::{Effect, Ending, Event, Keys};
use crate::engine::machine::{LOST, Mode, STOPPING};
use crate::fence::Fence;
use crate::process::Exit;
use crate::runtime_link::StreamId;
use crate::testkit::*;

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

/// A move to the same member: the owner's own stream presents a higher term. The requests in
/// flight on it stay and are answered there once it relays at that term; those made meanwhile
/// are held and sent after the activation; closing the stream first fails them.
#[test]
fn requests_in_flight_stay_when_the_owners_stream_takes_a_higher_term() {
    let mut h = Harness::active();
    assert_eq!(names(&h.request(7)), ["send 1 request 1"]);
    assert_eq!(names(&h.message(1, present(2, "m1", "g2"))), ["commit"]);
    let receipted = names(&h.on(Event::Committed(Ok(()))));
    assert_eq!(receipted.last().map(String::as_str), Some("send 1 receipt"));
    assert!(!receipted.iter().any(|n| n.starts_with("refuse")), "{receipted:?}");
    assert!(h.request(8).is_empty(), "held while the term is taken");
    let confirm = supervisor_message::Kind::ActivationConfirm(proof(2, "m1", "g2"));
    assert_eq!(names(&h.message(1, confirm)), ["commit"]);
    assert_eq!(names(&h.on(Event::Committed(Ok(())))), ["persist", "send 1 request 2"]);
    let alive = |request_id| {
        supervisor_message::Kind::WorkloadResponse(WorkloadResponse {
            request_id,
            kind: Some(workload_response::Kind::Alive(Alive {})),
        })
    };
    assert_eq!(names(&h.message(1, alive(1))), ["answer 7"]);
    assert_eq!(names(&h.message(1, alive(2))), ["answer 8"]);

    let mut h = Harness::active();
    h.request(7);
    h.message(1, present(2, "m1", "g2"));
    h.on(Event::Committed(Ok(())));
    let closed = names(&h.on(Event::Closed {
        id: 1,
        opened: true,
        reason: "gone".into(),
    }));
    assert!(closed.contains(&format!("refuse 7: {LOST}")), "{closed:?}");
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
        crate::episode::Slot::Ready(hello) => hello,
        other => panic!("{other:?}"),
    };
    assert!(hello.relinquished && hello.fence_term == 1);
}

/// The next owner takes over on stream 2 at term 2; the requests it is relayed, as sent.
fn next_owner_relays(h: &mut Harness) -> Vec<String> {
    h.advance(Duration::from_secs(1));
    h.on(Event::Tick);
    h.on(Event::Opened(2));
    assert_eq!(names(&h.message(2, present(2, "m2", "g2"))), ["commit"]);
    h.on(Event::Committed(Ok(())));
    let confirm = supervisor_message::Kind::ActivationConfirm(proof(2, "m2", "g2"));
    assert_eq!(names(&h.message(2, confirm)), ["commit"]);
    let relayed = names(&h.on(Event::Committed(Ok(()))));
    relayed.into_iter().filter(|n| n.contains("request")).collect()
}

/// Which workload requests (by their reply's id) are in flight.
fn in_flight(h: &Harness) -> Vec<u32> {
    let mut ids: Vec<u32> = h.m.inflight.values().map(|(_, reply)| reply.id).collect();
    ids.sort_unstable();
    ids
}

#[test]
fn requests_the_relinquishing_owner_did_not_answer_go_to_the_next_owner_in_order() {
    // A planned move: the owner relinquishes with two requests unanswered; a third arrives
    // while recovering. None is refused: all three go to the next owner after its activation.
    let mut h = Harness::active();
    assert_eq!(names(&h.request(4)), ["send 1 request 1"]);
    assert_eq!(names(&h.request(5)), ["send 1 request 2"]);
    let relinquish = supervisor_message::Kind::Relinquish(Relinquish { term: 1 });
    assert_eq!(names(&h.message(1, relinquish)), ["persist", "abort 1", "persist"]);
    assert!(h.m.inflight.is_empty());
    assert!(h.request(6).is_empty(), "held while recovering");
    let relayed = next_owner_relays(&mut h);
    assert_eq!(relayed, ["send 2 request 1", "send 2 request 2", "send 2 request 3"]);
    assert_eq!(in_flight(&h), [4, 5, 6], "each request once, to the new owner");
}

/// Active; request 4 went to the owner, request 5 found its stream ended: held, not refused.
fn one_sent_one_unsent() -> Harness {
    let mut h = Harness::active();
    assert_eq!(names(&h.request(4)), ["send 1 request 1"]);
    assert_eq!(names(&h.request(5)), ["send 1 request 2"]);
    let unsent = Event::Unsent {
        id: 1,
        request: Some(2),
        congested: false,
    };
    assert!(h.on(unsent).is_empty(), "held, not refused");
    h
}

#[test]
fn a_request_the_ended_stream_did_not_take_waits_for_the_next_owner() {
    // The owner relinquished and ended its stream; the link has ended before the machine
    // reads the Relinquish, so a request relayed meanwhile is not queued. It is held, behind
    // the request the owner did not answer, and neither is refused.
    let mut h = one_sent_one_unsent();
    let relinquish = supervisor_message::Kind::Relinquish(Relinquish { term: 1 });
    assert_eq!(names(&h.message(1, relinquish)), ["persist", "abort 1", "persist"]);
    let closed = Event::Closed {
        id: 1,
        opened: true,
        reason: "closed".into(),
    };
    assert!(h.on(closed).is_empty(), "the stream was already closed");
    assert_eq!(next_owner_relays(&mut h), ["send 2 request 1", "send 2 request 2"]);
    assert_eq!(in_flight(&h), [4, 5]);

    // Without a Relinquish (the owner died): what it was sent fails, what it was not sent waits.
    let mut h = one_sent_one_unsent();
    let closed = Event::Closed {
        id: 1,
        opened: true,
        reason: "reset".into(),
    };
    let lost = names(&h.on(closed));
    assert!(lost.contains(&format!("refuse 4: {LOST}")), "{lost:?}");
    assert!(!lost.iter().any(|n| n.starts_with("refuse 5")), "{lost:?}");
    assert_eq!(next_owner_relays(&mut h), ["send 2 request 1"]);
    assert_eq!(in_flight(&h), [5]);
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
        ..Exit::default()
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
        // (A placing sidecar registers again every 10 s meanwhile.)
        let dial: Vec<_> = h
            .on(Event::Tick)
            .into_iter()
            .filter(|e| !matches!(e, Effect::Register(_)))
            .collect();
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
fn a_store_behind_notice_from_the_owner_at_the_activated_term_registers_the_standing() {
    use proto::runtime::v1::StoreBehind;
    let behind = |term| supervisor_message::Kind::StoreBehind(StoreBehind { term });
    let mut h = Harness::active();
    assert!(names(&h.message(1, behind(2))).is_empty(), "another term: ignored");
    assert_eq!(names(&h.message(1, behind(1))), ["register at fence 1"]);
    assert!(matches!(h.m.mode, Mode::Active), "still relaying");
    assert_eq!(h.m.owner, Some(1));
}
