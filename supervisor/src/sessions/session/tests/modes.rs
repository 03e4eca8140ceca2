//! The other modes and the status: streams replaced and lost, relinquish, stop and its
//! bounds, abandonment, unsent messages, the relay, counter reports.

use std::time::Duration;

use proto::common::v1::InstancePhase;
use proto::runtime::v1::supervisor_message::Kind;
use proto::runtime::v1::workload_request::Kind as Request;
use proto::runtime::v1::workload_response::Kind as Response;
use proto::runtime::v1::{Liveness, ReportProgress, Stopped, SupervisorMessage, WorkloadRequest, sidecar_message};

use super::*;
use crate::sessions::session::{STOP_BOUND, UNSEEN_STOP_BOUND};

fn request(id: u64, kind: Request) -> sidecar_message::Kind {
    sidecar_message::Kind::WorkloadRequest(WorkloadRequest {
        request_id: id,
        kind: Some(kind),
    })
}

fn answer(effects: &[Effect]) -> Response {
    match sent(effects, 1) {
        Kind::WorkloadResponse(response) => response.kind.unwrap_or_else(|| panic!("an answer")),
        other => panic!("a response: {other:?}"),
    }
}

fn unsent(stream: StreamId, kind: Kind) -> Event {
    Event::Unsent {
        stream,
        message: SupervisorMessage { kind: Some(kind) },
    }
}

#[test]
fn a_new_stream_replaces_the_held_one_and_losing_the_relaying_one_is_recovering() {
    let mut h = Harness::attached(3);
    assert_eq!(io(&h.connect(2, 3, false)), ["drop 1", "send 2 Attached"]);
    assert_eq!(h.m.counters.sidecar_connects, 2);
    assert_eq!(names(&h.lose(2)), ["drop 2", "publish RECOVERING", "announce"]);
    assert_eq!(h.m.held_stream(), None);
    assert!(io(&h.lose(2)).is_empty(), "a stream no longer held is ignored");
    assert!(io(&h.message(2, hello(3, false))).is_empty());
    assert_eq!(io(&h.connect(3, 3, false)), ["send 3 Attached"]);
    assert_eq!(h.phase(), (InstancePhase::Active, String::new()));
}

/// A sidecar that cannot reach its owner (a cut route; the owner is fine towards the
/// gateways) would otherwise wait out its whole recovery deadline and be stopped: the owner
/// gives the term up, and the coordinator moves the instance to a member the sidecar reaches.
#[test]
fn an_owner_whose_sidecar_stays_away_gives_the_term_up() {
    let bound = proto::timing::SIDECAR_AWAY_BOUND;
    let mut h = Harness::attached(3);
    let lost_at = h.now.at;
    assert_eq!(names(&h.lose(1)), ["drop 1", "publish RECOVERING", "announce"]);
    assert_eq!(h.m.next_wake(), Some(lost_at + bound));
    h.advance(bound - Duration::from_millis(1));
    h.on(Event::Tick);
    assert_eq!(h.phase().0, InstancePhase::Recovering);
    h.advance(Duration::from_millis(1));
    assert_eq!(names(&h.on(Event::Tick)), ["publish FAILED", "announce"]);
    let (phase, message) = h.phase();
    assert_eq!(phase, InstancePhase::Failed);
    assert!(message.contains("giving term 3 up"), "{message}");
    // Not armed again while given up.
    assert_eq!(h.m.next_wake(), None);
    // Back before a higher term came: attached again, the term not given up.
    assert_eq!(io(&h.connect(2, 3, false)), ["send 2 Attached"]);
    assert_eq!(h.phase(), (InstancePhase::Active, String::new()));
}

/// A stream lost after it took the grant but before the activation was confirmed on it: the
/// owner activates with no sidecar held, and the sidecar that cannot reach it is moved too.
#[test]
fn a_sidecar_lost_between_its_receipt_and_the_confirm_is_waited_for_the_same_bound() {
    let bound = proto::timing::SIDECAR_AWAY_BOUND;
    let mut h = Harness::reserved(4);
    assert_eq!(io(&h.connect(1, 3, false)), ["issue grant 4"]);
    assert_eq!(io(&h.on(granted(4))), ["send 1 GrantPresentation"]);
    assert_eq!(io(&h.message(1, receipt(4, "g"))), ["activate"]);
    h.lose(1);
    h.on(activated(4));
    assert_eq!(h.m.next_wake(), Some(h.now.at + bound));
    h.advance(bound);
    h.on(Event::Tick);
    assert_eq!(h.phase().0, InstancePhase::Failed);
}

#[test]
fn a_sidecar_back_within_the_bound_keeps_the_term() {
    let bound = proto::timing::SIDECAR_AWAY_BOUND;
    let mut h = Harness::attached(3);
    h.lose(1);
    h.advance(bound - Duration::from_millis(1));
    assert_eq!(io(&h.connect(2, 3, false)), ["send 2 Attached"]);
    assert_eq!(h.m.next_wake(), None);
    h.advance(bound);
    h.on(Event::Tick);
    assert_eq!(h.phase(), (InstancePhase::Active, String::new()));
    // Lost again: the bound starts over.
    h.lose(2);
    h.advance(bound - Duration::from_millis(1));
    h.on(Event::Tick);
    assert_eq!(h.phase().0, InstancePhase::Recovering);
}

#[test]
fn a_recovery_hello_on_the_relaying_stream_is_decided_again() {
    let mut h = Harness::attached(3);
    // The sidecar froze on this stream and relinquished nothing: it is attached again.
    assert_eq!(io(&h.message(1, hello(3, false))), ["send 1 Attached"]);
    // Relinquished at the term: never re-attached; FAILED, so that the coordinator reserves a
    // higher term (a store that rolled back lists a relinquished term again).
    assert!(io(&h.message(1, hello(3, true))).is_empty());
    let (phase, message) = h.phase();
    assert_eq!(phase, InstancePhase::Failed);
    assert!(message.contains("relinquished term 3"), "{message}");
}

#[test]
fn omission_relinquishes_on_the_relaying_stream_before_letting_it_go() {
    let mut h = Harness::attached(3);
    let effects = h.member(SessionEvent::Relinquish);
    assert_eq!(
        names(&effects),
        [
            "send 1 Relinquish",
            "drop 1",
            "publish RELINQUISHED",
            "announce",
            "done"
        ]
    );
    assert!(matches!(sent(&effects, 1), Kind::Relinquish(r) if r.term == 3));
    assert!(h.on(Event::Tick).is_empty(), "nothing after done");

    // Not relaying (still taking over): nothing to relinquish, the stream is let go.
    let mut h = Harness::reserved(3);
    h.connect(1, 0, false);
    assert_eq!(io(&h.member(SessionEvent::Relinquish)), ["drop 1", "done"]);
}

#[test]
fn a_stop_releases_on_the_relaying_stream_and_ends_when_the_workload_stopped() {
    let mut h = Harness::attached(3);
    let effects = h.member(SessionEvent::Stop);
    assert!(matches!(sent(&effects, 1), Kind::Release(r) if r.term == 3));
    assert_eq!(h.phase().1, "stopping: waiting for the workload to exit");
    // The sidecar comes back: it gets the Release again.
    assert_eq!(
        io(&h.connect(2, 3, false)),
        ["drop 1", "send 2 Attached", "send 2 Release"]
    );
    let stopped = sidecar_message::Kind::Stopped(Stopped {
        reason: "x".repeat(1_000),
        ..Stopped::default()
    });
    let effects = h.message(2, stopped);
    assert_eq!(names(&effects), ["publish STOPPED", "announce", "done"]);
    assert_eq!(
        h.phase().1.len(),
        "the workload stopped: ".len() + 256,
        "bounded reason"
    );
}

#[test]
fn a_stop_wins_over_a_pending_takeover_the_receipted_term_is_released_not_activated() {
    let mut h = Harness::reserved(3);
    h.connect(1, 0, false);
    h.on(granted(3));
    h.member(SessionEvent::Stop);
    assert_eq!(io(&h.message(1, receipt(3, "g"))), ["send 1 Release"]);
    assert!(h.m.call.is_none(), "nothing activated");
}

#[test]
fn a_stop_that_never_saw_a_sidecar_ends_stopped_after_its_short_bound() {
    let mut h = Harness::reserved(3);
    h.member(SessionEvent::Stop);
    assert_eq!(h.m.next_wake(), Some(h.now.at + UNSEEN_STOP_BOUND));
    h.advance(UNSEEN_STOP_BOUND);
    assert_eq!(names(&h.on(Event::Tick)), ["publish STOPPED", "announce", "done"]);
    assert_eq!(
        h.phase().1,
        "withdrawn before any sidecar connected: nothing to release"
    );
}

#[test]
fn a_sidecar_arriving_during_a_stop_gives_it_the_full_bound_then_an_undelivered_release_fails() {
    let mut h = Harness::reserved(3);
    h.member(SessionEvent::Stop);
    // A sidecar below the term: no grant receipted, so no Release can be delivered.
    h.connect(1, 0, false);
    assert_eq!(h.m.next_wake(), Some(h.now.at + STOP_BOUND));
    h.advance(STOP_BOUND);
    h.on(Event::Tick);
    assert_eq!(h.phase().0, InstancePhase::Failed);
    assert!(h.phase().1.contains("the release could not be delivered"));
}

#[test]
fn a_release_sent_without_a_stopped_report_ends_stopped_at_the_bound() {
    let mut h = Harness::attached(3);
    h.member(SessionEvent::Stop);
    h.advance(STOP_BOUND);
    assert_eq!(io(&h.on(Event::Tick)), ["done"]);
    assert_eq!(h.phase().0, InstancePhase::Stopped);
}

#[test]
fn a_stop_of_a_failed_term_ends_at_once_and_a_failure_during_a_stop_ends_it() {
    let mut h = Harness::reserved(3);
    h.connect(1, 5, false);
    assert_eq!(io(&h.member(SessionEvent::Stop)), ["done"]);
    assert!(h.phase().1.starts_with("cannot stop: fenced"));

    let mut h = Harness::reserved(3);
    h.connect(1, 0, false);
    h.member(SessionEvent::Stop);
    let effects = h.on(Event::Granted(Err(crate::gateway::CallError::Invalid("x"))));
    assert_eq!(io(&effects), ["done"]);
    assert!(h.phase().1.starts_with("cannot stop: IssueGrant"));
}

#[test]
fn abandonment_ends_at_once_without_a_status_but_never_a_stop() {
    let mut h = Harness::attached(3);
    assert_eq!(names(&h.on(Event::Abandoned)), ["done"]);
    assert_eq!(
        h.phase().0,
        InstancePhase::Active,
        "the workload keeps running; nothing reported"
    );

    let mut h = Harness::attached(3);
    assert_eq!(names(&h.on(Event::Orphaned)), ["done"]);

    let mut h = Harness::attached(3);
    h.member(SessionEvent::Stop);
    assert!(io(&h.on(Event::Abandoned)).is_empty());
    assert!(io(&h.on(Event::Orphaned)).is_empty());
    assert!(h.m.stopping());
    assert_eq!(
        io(&h.connect(2, 3, false)),
        ["drop 1", "send 2 Attached", "send 2 Release"]
    );
}

#[test]
fn an_attached_that_cannot_be_sent_drops_the_stream_without_counting_as_relaying() {
    let mut h = Harness::new(assignment(3, TermPhase::Active, material()));
    let effects = h.connect(1, 3, false);
    let Kind::Attached(attached) = sent(&effects, 1) else {
        panic!("attached")
    };
    let effects = h.on(unsent(1, Kind::Attached(attached)));
    assert_eq!(io(&effects), ["drop 1"]);
    assert_eq!(
        h.phase(),
        (InstancePhase::Active, "waiting for the sidecar to attach".into())
    );
}

#[test]
fn a_release_that_cannot_be_sent_is_not_counted_as_delivered() {
    let mut h = Harness::attached(3);
    let effects = h.member(SessionEvent::Stop);
    h.on(unsent(1, sent(&effects, 1)));
    assert_eq!(h.m.held_stream(), None);
    h.advance(STOP_BOUND);
    h.on(Event::Tick);
    assert_eq!(h.phase().0, InstancePhase::Failed, "the release was never delivered");
}

#[test]
fn requests_are_answered_only_while_relaying_and_not_while_stopping() {
    let mut h = Harness::reserved(3);
    h.connect(1, 0, false);
    let liveness = || request(1, Request::Liveness(Liveness {}));
    assert!(matches!(answer(&h.message(1, liveness())), Response::Rejected(_)));

    let mut h = Harness::attached(3);
    assert!(matches!(answer(&h.message(1, liveness())), Response::Alive(_)));
    let effects = h.message(1, request(2, Request::FetchCredential(Default::default())));
    assert!(matches!(answer(&effects), Response::Rejected(r) if r.reason == proto::egress::NO_CREDENTIAL));
    h.member(SessionEvent::Stop);
    assert!(
        matches!(answer(&h.message(1, liveness())), Response::Rejected(r) if r.reason == "the instance is stopping")
    );
    assert_eq!((h.m.counters.requests_relayed, h.m.counters.requests_rejected), (3, 2));
}

/// A move to the same member: the owner takes a higher term on the stream that relays. What
/// the sidecar sends before it receipts waits for the new term and is answered there, after
/// the confirm; refused if the term cannot be taken; dropped with a replaced stream; and at
/// most `MAX_WAITING` wait.
#[test]
fn requests_sent_while_the_relaying_stream_takes_a_higher_term_wait_for_it() {
    let liveness = |id| request(id, Request::Liveness(Liveness {}));
    let higher = |h: &mut Harness| h.member(SessionEvent::Ownership(assignment(4, TermPhase::Reserved, material())));

    let mut h = Harness::taken_over(3);
    assert_eq!(io(&higher(&mut h)), ["issue grant 4"]);
    assert!(io(&h.message(1, liveness(7))).is_empty(), "waits, not refused");
    assert_eq!(io(&h.on(granted(4))), ["send 1 GrantPresentation"]);
    assert_eq!(io(&h.message(1, receipt(4, "g"))), ["activate"]);
    let effects = h.on(activated(4));
    assert_eq!(io(&effects), ["send 1 ActivationConfirm", "send 1 WorkloadResponse"]);
    assert!(matches!(
        effects.iter().find_map(|e| match e {
            Effect::Send { kind: Kind::WorkloadResponse(r), .. } => Some(r.clone()),
            _ => None,
        }),
        Some(r) if r.request_id == 7 && matches!(r.kind, Some(Response::Alive(_)))
    ));

    // The term cannot be taken: refused then.
    let mut h = Harness::taken_over(3);
    higher(&mut h);
    assert!(io(&h.message(1, liveness(8))).is_empty());
    let effects = h.on(Event::Granted(Err(crate::gateway::CallError::Timeout(
        Duration::from_secs(5),
    ))));
    assert!(matches!(answer(&effects), Response::Rejected(_)));

    // A stream that replaced it: nothing is sent for the old one's requests.
    let mut h = Harness::taken_over(3);
    higher(&mut h);
    h.message(1, liveness(9));
    let effects = h.connect(2, 3, false);
    assert!(
        !io(&effects).iter().any(|e| e.contains("WorkloadResponse")),
        "{effects:?}"
    );
    assert!(h.m.waiting.is_empty());

    // Bounded: past the bound, refused at once.
    let mut h = Harness::taken_over(3);
    higher(&mut h);
    for id in 0..crate::sessions::session::relay::MAX_WAITING as u64 {
        assert!(io(&h.message(1, liveness(id))).is_empty());
    }
    assert!(matches!(answer(&h.message(1, liveness(99))), Response::Rejected(_)));

    // A takeover waiting for launch material has no bound: refused as before, at once.
    let mut h = Harness::taken_over(3);
    h.m.credentials = None;
    assert!(io(&h.member(SessionEvent::Ownership(assignment(4, TermPhase::Reserved, None)))).is_empty());
    assert!(matches!(answer(&h.message(1, liveness(1))), Response::Rejected(_)));

    // A stream that never relayed (a sidecar still taking its first term) is refused as before.
    let mut h = Harness::reserved(3);
    h.connect(1, 0, false);
    assert!(matches!(answer(&h.message(1, liveness(1))), Response::Rejected(_)));
}

#[test]
fn counter_only_changes_are_announced_at_most_every_second() {
    let mut h = Harness::attached(3);
    let progress = |value| {
        request(
            value,
            Request::ReportProgress(ReportProgress {
                value,
                ..Default::default()
            }),
        )
    };
    h.advance(Duration::from_millis(100));
    let effects = h.message(1, progress(7));
    assert_eq!(
        names(&effects),
        ["send 1 WorkloadResponse", "publish ACTIVE"],
        "deferred"
    );
    let counters = h.m.published.counters.unwrap_or_default();
    assert_eq!(
        (counters.last_progress_value, counters.last_progress_at_ms),
        (7, NOW_MS + 100)
    );
    let wake = h.m.next_wake().unwrap_or_else(|| panic!("a deferred report"));
    h.advance(Duration::from_millis(899));
    assert!(h.now.at < wake);
    h.advance(Duration::from_millis(1));
    assert_eq!(names(&h.on(Event::Tick)), ["announce"]);
    assert_eq!(h.m.next_wake(), None);
    h.advance(Duration::from_secs(2));
    assert_eq!(
        names(&h.message(1, progress(8))),
        ["send 1 WorkloadResponse", "publish ACTIVE", "announce"]
    );
}

#[test]
fn a_response_that_cannot_be_sent_drops_the_stream() {
    let mut h = Harness::attached(3);
    let effects = h.message(1, request(1, Request::Liveness(Liveness {})));
    assert_eq!(
        names(&h.on(unsent(1, sent(&effects, 1)))),
        ["drop 1", "publish RECOVERING", "announce"]
    );
}

#[test]
fn workload_pids_from_the_sidecar_are_reported() {
    let mut h = Harness::attached(3);
    let started = sidecar_message::Kind::WorkloadStarted(proto::runtime::v1::WorkloadStarted {
        workload: Some(WorkloadIdentity {
            pid: 77,
            ..WorkloadIdentity::default()
        }),
    });
    assert_eq!(names(&h.message(1, started)), ["publish ACTIVE", "announce"]);
    assert_eq!(h.m.published.workload_pid, 77);
}

#[test]
fn audit_records_are_acknowledged_only_once_the_gateway_stored_them_for_this_term() {
    use proto::host::v1::RecordAuditResponse;
    use proto::runtime::v1::{AuditRecord, AuditRecords};
    let records = |sequences: &[u64]| {
        sidecar_message::Kind::AuditRecords(AuditRecords {
            records: sequences
                .iter()
                .map(|&sequence| AuditRecord {
                    sequence,
                    ..AuditRecord::default()
                })
                .collect(),
            dropped: 0,
        })
    };
    let mut h = Harness::attached(3);
    assert_eq!(io(&h.message(1, records(&[1, 2]))), ["record audit 3 (2)"]);
    assert!(io(&h.message(1, records(&[1, 2]))).is_empty(), "one delivery at a time");
    let stored = Event::AuditRecorded {
        term: 3,
        result: Ok(RecordAuditResponse { through: 2 }),
    };
    assert_eq!(io(&h.on(stored)), ["send 1 AuditAck"]);
    // A failed call is not acknowledged: the sidecar sends the records again.
    assert_eq!(io(&h.message(1, records(&[3]))), ["record audit 3 (1)"]);
    let failed = Event::AuditRecorded {
        term: 3,
        result: Err(crate::gateway::CallError::Timeout(std::time::Duration::from_secs(5))),
    };
    assert!(io(&h.on(failed)).is_empty());
    // Nothing is delivered for a sidecar that is not attached at the active term.
    h.lose(1);
    assert!(io(&h.message(1, records(&[3]))).is_empty());
}

#[test]
fn a_store_behind_the_active_term_is_told_to_the_relaying_sidecar_once_per_term() {
    let mut h = Harness::attached(3);
    assert!(
        io(&h.member(SessionEvent::StoreBehind(3))).is_empty(),
        "not below the term"
    );
    let effects = h.member(SessionEvent::StoreBehind(2));
    assert_eq!(io(&effects), ["send 1 StoreBehind"]);
    assert!(matches!(sent(&effects, 1), Kind::StoreBehind(b) if b.term == 3));
    assert!(io(&h.member(SessionEvent::StoreBehind(1))).is_empty(), "once per term");
    // Still taking over: the activation shows the store holds the term, so nothing is told
    // (the sidecar registering again could find the store's reservation not yet activated in
    // a replica's view, and that term recorded as used).
    let mut h = Harness::reserved(3);
    assert_eq!(io(&h.connect(1, 2, false)), ["issue grant 3"]);
    assert!(!io(&h.member(SessionEvent::StoreBehind(2))).contains(&"send 1 StoreBehind".to_owned()));
    assert_eq!(io(&h.on(granted(3))), ["send 1 GrantPresentation"]);
    assert_eq!(io(&h.message(1, receipt(3, "g"))), ["activate"]);
    assert_eq!(io(&h.on(activated(3))), ["send 1 ActivationConfirm"]);
    // The sidecar away when the store's lag shows: told when it comes back at the term.
    let mut h = Harness::attached(3);
    h.lose(1);
    assert!(io(&h.member(SessionEvent::StoreBehind(2))).is_empty());
    assert_eq!(io(&h.connect(2, 3, false)), ["send 2 Attached", "send 2 StoreBehind"]);
    // A lag noticed at a lower term is not told at a higher one (the store reserved it).
    let mut h = Harness::attached(3);
    h.lose(1);
    h.member(SessionEvent::StoreBehind(2));
    h.member(SessionEvent::Ownership(assignment(4, TermPhase::Active, material())));
    assert!(!io(&h.connect(2, 4, false)).contains(&"send 2 StoreBehind".to_owned()));
}
