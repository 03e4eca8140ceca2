//! The modes and the workload side: registration, placement and recovery deadlines, the hello
//! budget, stops, admission and pinning, sends a stream cannot take.

use std::time::Duration;

use proto::registry::v1::RegisterResponse;
use proto::runtime::v1::supervisor_message;
use proto::timing;

use super::*;
use crate::engine::effect::{Effect, Ending, Event};
use crate::engine::machine::{LOST, Mode, STOPPING};
use crate::engine::relay::MAX_HELD;
use crate::fence::Fence;
use crate::process::Exit;
use crate::runtime_link::First;
use crate::testkit::*;
use crate::workload::Op;

/// The workload's exit ends a failed recovery.
fn ends_as_failed_recovery(h: &mut Harness) {
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
    assert_eq!(
        names(&h.on(Event::Tick)),
        ["register at fence 0"],
        "a placing sidecar registers again too"
    );
    h.advance(Duration::from_secs(1));
    assert_eq!(names(&h.on(Event::Tick)), ["stop workload"]);
    let Some(Ending::RecoveryFailed { request }) = h.m.ending.clone() else {
        panic!("recovery failed")
    };
    assert_eq!(
        (request.fence_term, request.attempts, request.recovery_deadline_ms),
        (0, 0, 60_000)
    );
    ends_as_failed_recovery(&mut h);
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
    // The next member is dialed (the other address first: the lost owner is likely dead),
    // after registering again (the recovery has lasted `REGISTER_AGAIN_AFTER`).
    h.advance(Duration::from_secs(5));
    let dial = h.on(Event::Tick);
    let [
        Effect::Register(_),
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
    ends_as_failed_recovery(&mut h);
}

#[test]
fn a_sidecar_still_recovering_registers_again_with_its_fence() {
    let mut h = Harness::active();
    let fence = h.m.state.fence.activated;
    assert!(fence > 0);
    h.on(Event::Closed {
        id: 1,
        opened: true,
        reason: "silent".into(),
    });
    let registers = |effects: &[Effect<Probe>]| {
        names(effects)
            .iter()
            .filter(|n| **n == format!("register at fence {fence}"))
            .count()
    };
    let step = Duration::from_millis(1);
    h.advance(timing::REGISTER_AGAIN_AFTER - step);
    assert_eq!(
        registers(&h.on(Event::Tick)),
        0,
        "an ordinary recovery costs the registry nothing"
    );
    h.advance(step);
    assert_eq!(registers(&h.on(Event::Tick)), 1);
    h.advance(timing::REGISTER_AGAIN_EVERY - step);
    assert_eq!(registers(&h.on(Event::Tick)), 0);
    h.advance(step);
    assert_eq!(registers(&h.on(Event::Tick)), 1, "again while it still recovers");

    // Placing (a registry emptied before the first activation): the same, at fence 0.
    let mut h = Harness::placing();
    h.advance(timing::REGISTER_AGAIN_AFTER - step);
    assert!(!names(&h.on(Event::Tick)).contains(&"register at fence 0".to_owned()));
    h.advance(step);
    assert!(names(&h.on(Event::Tick)).contains(&"register at fence 0".to_owned()));
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
        congested: true,
    });
    assert_eq!(names(&congested), ["refuse 1: the supervisor stream is congested"]);
    assert!(matches!(h.m.mode, Mode::Active), "a congested relay keeps the owner");
    let gone = names(&h.on(Event::Unsent {
        id: 1,
        request: None,
        congested: false,
    }));
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
    let failed = names(&h.on(Event::Unsent {
        id: 1,
        request: None,
        congested: false,
    }));
    assert_eq!(
        failed,
        ["abort 1".to_owned(), format!("refuse 3: {LOST}"), "persist".into()]
    );
    assert!(matches!(h.m.mode, Mode::Recovering { .. }));
    // The relay's own send then finds no stream: nothing more to refuse.
    assert!(
        h.on(Event::Unsent {
            id: 1,
            request: Some(1),
            congested: false,
        })
        .is_empty()
    );
}
