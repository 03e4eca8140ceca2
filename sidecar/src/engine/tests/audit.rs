//! Audit delivery: one batch at a time to the activated owner, dropped from the spool only on
//! that owner's acknowledgement at its term; sent again after a handoff or a silent owner.

use std::time::Duration;

use proto::runtime::v1::{AuditAck, AuditRecord, supervisor_message};

use super::*;
use crate::engine::effect::Event;

fn batch(sequences: &[u64]) -> Event<Probe> {
    Event::AuditFetched {
        records: sequences
            .iter()
            .map(|&sequence| AuditRecord {
                sequence,
                decision: "deny".into(),
                ..AuditRecord::default()
            })
            .collect(),
        dropped: 0,
    }
}

fn ack(term: u64, through: u64) -> supervisor_message::Kind {
    supervisor_message::Kind::AuditAck(AuditAck { term, through })
}

#[test]
fn records_go_to_the_activated_owner_one_batch_at_a_time_and_leave_only_on_its_ack() {
    let mut h = Harness::placing();
    assert!(h.on(Event::AuditPending(3)).is_empty(), "no owner yet: nothing is sent");
    h.activate(1, 1, "m1");
    // Activation asked for the batch; the spool answers.
    assert_eq!(names(&h.on(batch(&[1, 2, 3]))), ["send 1 audit [1, 2, 3]"]);
    assert!(h.on(Event::AuditPending(5)).is_empty(), "one batch in flight at a time");
    // An acknowledgement from another term, or beyond what was sent, changes nothing.
    assert!(h.message(1, ack(0, 3)).is_empty());
    assert!(h.message(1, ack(1, 9)).is_empty());
    assert_eq!(names(&h.message(1, ack(1, 3))), ["ack audit 3"]);
    // The next batch follows after the linger.
    h.advance(crate::engine::audit::LINGER);
    assert_eq!(names(&h.on(Event::Tick)), ["fetch audit after 3"]);
    assert_eq!(names(&h.on(batch(&[4, 5]))), ["send 1 audit [4, 5]"]);
}

#[test]
fn a_lone_decision_goes_at_once_a_burst_waits_for_the_linger_unless_a_whole_batch_waits() {
    let mut h = Harness::placing();
    h.activate(1, 1, "m1");
    // Nothing sent for a while: the first decision goes at once.
    assert_eq!(names(&h.on(Event::AuditPending(1))), ["fetch audit after 0"]);
    assert_eq!(names(&h.on(batch(&[1]))), ["send 1 audit [1]"]);
    assert_eq!(names(&h.message(1, ack(1, 1))), ["ack audit 1"]);
    // The decisions right after it wait for more, and the machine wakes for them.
    assert!(h.on(Event::AuditPending(2)).is_empty());
    assert!(h.on(Event::AuditPending(40)).is_empty());
    let linger = crate::engine::audit::LINGER;
    assert!(h.m.next_wake(h.now.at) <= h.now.at + linger);
    h.advance(linger / 2);
    assert!(h.on(Event::Tick).is_empty(), "still lingering");
    h.advance(linger / 2);
    assert_eq!(names(&h.on(Event::Tick)), ["fetch audit after 1"]);
    let all: Vec<u64> = (2..=40).collect();
    h.on(batch(&all));
    h.message(1, ack(1, 40));
    // A whole batch waiting goes without waiting.
    let whole = 40 + crate::egress::audit::BATCH as u64;
    assert!(h.on(Event::AuditPending(whole - 1)).is_empty());
    assert_eq!(names(&h.on(Event::AuditPending(whole))), ["fetch audit after 40"]);
}

#[test]
fn what_an_owner_did_not_acknowledge_goes_to_the_next_and_a_silent_one_gets_it_again() {
    let mut h = Harness::placing();
    h.activate(1, 1, "m1");
    h.on(Event::AuditPending(2));
    assert_eq!(names(&h.on(batch(&[1, 2]))), ["send 1 audit [1, 2]"]);
    // No acknowledgement within the timeout: the same records again.
    h.advance(Duration::from_secs(11));
    assert!(names(&h.on(Event::Tick)).contains(&"fetch audit after 0".to_owned()));
    assert_eq!(names(&h.on(batch(&[1, 2]))), ["send 1 audit [1, 2]"]);

    // The owner is lost before acknowledging: the next owner gets them.
    h.on(Event::Closed {
        id: 1,
        opened: true,
        reason: "silent".into(),
    });
    assert!(h.m.audit.in_flight.is_none() || h.message(1, ack(1, 2)).is_empty());
    h.advance(Duration::from_secs(5));
    h.on(Event::Tick);
    h.on(Event::Opened(2));
    h.activate(2, 2, "m2");
    assert_eq!(names(&h.on(batch(&[1, 2]))), ["send 2 audit [1, 2]"]);
    // The fenced owner's late acknowledgement is not taken; the new owner's is.
    assert!(h.message(2, ack(1, 2)).is_empty());
    assert_eq!(names(&h.message(2, ack(2, 2))), ["ack audit 2"]);
}
