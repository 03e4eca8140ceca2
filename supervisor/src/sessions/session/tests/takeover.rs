//! The takeover: grant → presentation → receipt → Activate → confirm, each call sent once,
//! receipts checked, fences refused, grants that expire, higher terms that start over.

use std::time::Duration;

use proto::common::v1::InstancePhase;
use proto::runtime::v1::supervisor_message::Kind;

use super::*;
use crate::gateway::CallError;

#[test]
fn a_takeover_presents_the_grant_activates_the_receipt_and_confirms_the_proof_in_order() {
    let mut h = Harness::reserved(3);
    let effects = h.connect(1, 0, false);
    assert_eq!(names(&effects), ["issue grant 3", "publish STARTING", "announce"]);
    assert_eq!(h.phase().1, "requesting the recovery grant");
    let effects = h.on(granted(3));
    let Kind::GrantPresentation(presentation) = sent(&effects, 1) else {
        panic!("a presentation: {effects:?}")
    };
    assert_eq!(
        (presentation.grant.as_str(), presentation.member.as_str()),
        ("grant-3", "m-0")
    );
    assert_eq!(h.phase().1, "grant presented; waiting for the sidecar's receipt");
    assert_eq!(
        names(&h.message(1, receipt(3, "g"))),
        ["activate", "publish STARTING", "announce"]
    );
    assert_eq!(h.phase().1, "activating the term");
    let effects = h.on(activated(3));
    let Kind::ActivationConfirm(confirm) = sent(&effects, 1) else {
        panic!("a confirm: {effects:?}")
    };
    assert_eq!((confirm.term, confirm.proof.as_str()), (3, "proof-3"));
    assert_eq!(
        confirm.recovery_deadline_ms, DEADLINE_MS,
        "the latest snapshot's deadline"
    );
    assert_eq!(
        names(&effects),
        ["send 1 ActivationConfirm", "publish ACTIVE", "announce"]
    );
    assert_eq!(h.m.published.workload_pid, 42);
}

#[test]
fn issue_grant_is_sent_once_and_its_failure_fails_the_term_until_a_higher_one() {
    let mut h = Harness::reserved(3);
    assert_eq!(io(&h.connect(1, 0, false)), ["issue grant 3"]);
    assert!(
        io(&h.connect(2, 0, false)).iter().all(|n| !n.starts_with("issue")),
        "no second call"
    );
    h.on(Event::Granted(Err(CallError::Timeout(Duration::from_secs(5)))));
    let (phase, message) = h.phase();
    assert_eq!(phase, InstancePhase::Failed);
    assert!(
        message.contains("IssueGrant for term 3 failed (not retried)"),
        "{message}"
    );
    assert_eq!(
        io(&h.connect(3, 0, false)),
        ["drop 2"],
        "a failed term asks nothing again"
    );
    let effects = h.member(SessionEvent::Ownership(assignment(4, TermPhase::Reserved, None)));
    assert_eq!(
        io(&effects),
        ["issue grant 4"],
        "a higher term starts over, material kept"
    );
}

#[test]
fn without_launch_material_nothing_is_asked_for() {
    let mut h = Harness::new(assignment(3, TermPhase::Reserved, None));
    assert!(io(&h.connect(1, 0, false)).is_empty());
    assert_eq!(h.phase().1, "waiting for launch material");
    let effects = h.member(SessionEvent::Ownership(assignment(3, TermPhase::Reserved, material())));
    assert_eq!(io(&effects), ["issue grant 3"]);
}

#[test]
fn a_snapshot_grant_is_presented_without_a_call_and_fails_the_term_when_it_expires() {
    let mut h = Harness::new(Assignment {
        grant: snapshot_grant(NOW_MS + 2_000),
        ..assignment(3, TermPhase::Reserved, material())
    });
    assert_eq!(h.m.next_wake(), Some(h.now.at + Duration::from_secs(2)));
    assert_eq!(io(&h.connect(1, 0, false)), ["send 1 GrantPresentation"]);
    h.advance(Duration::from_millis(1_999));
    assert!(io(&h.on(Event::Tick)).is_empty());
    assert_eq!(h.phase().0, InstancePhase::Starting);
    h.advance(Duration::from_millis(1));
    h.on(Event::Tick);
    let (phase, message) = h.phase();
    assert_eq!(phase, InstancePhase::Failed);
    assert!(message.contains("expired before the sidecar receipted it"), "{message}");
    assert_eq!(h.m.next_wake(), None);
}

#[test]
fn a_receipt_that_does_not_answer_this_grant_is_ignored() {
    let mut h = Harness::reserved(3);
    h.connect(1, 0, false);
    h.on(granted(3));
    assert!(io(&h.message(1, receipt(3, "another-grant"))).is_empty());
    assert!(io(&h.message(1, receipt(2, "g"))).is_empty());
    assert_eq!(io(&h.message(1, receipt(3, "g"))), ["activate"]);
}

#[test]
fn a_receipt_before_any_presentation_is_ignored() {
    let mut h = Harness::new(assignment(3, TermPhase::Reserved, None));
    h.connect(1, 0, false);
    assert!(io(&h.message(1, receipt(3, ""))).is_empty());
}

#[test]
fn activate_is_sent_once_and_a_lost_answer_fails_the_term() {
    let mut h = Harness::reserved(3);
    h.connect(1, 0, false);
    h.on(granted(3));
    assert_eq!(io(&h.message(1, receipt(3, "g"))), ["activate"]);
    assert!(io(&h.message(1, receipt(3, "g"))).is_empty(), "no second Activate");
    h.on(Event::Activated(Err(CallError::Timeout(Duration::from_secs(5)))));
    let (phase, message) = h.phase();
    assert_eq!(phase, InstancePhase::Failed);
    assert!(
        message.contains("Activate for term 3 failed (not retried)"),
        "{message}"
    );
}

#[test]
fn an_answer_for_another_term_or_instance_fails_the_term() {
    let mut h = Harness::reserved(3);
    h.connect(1, 0, false);
    h.on(granted(4));
    h.message(1, receipt(3, "g"));
    h.on(activated(4));
    assert!(h.phase().1.contains("answered another term or route"));

    let mut h = Harness::reserved(3);
    h.connect(1, 0, false);
    let Event::Granted(Ok(mut other)) = granted(3) else {
        unreachable!()
    };
    other.instance = Some(InstanceRef {
        uid: "uid-2".into(),
        ..instance()
    });
    h.on(Event::Granted(Ok(other)));
    assert!(h.phase().1.contains("named another instance"));
}

#[test]
fn a_higher_term_cancels_the_call_in_flight_and_its_late_outcome_is_ignored() {
    let mut h = Harness::reserved(3);
    h.connect(1, 0, false);
    let effects = h.member(SessionEvent::Ownership(assignment(4, TermPhase::Reserved, None)));
    assert_eq!(io(&effects), ["cancel call", "issue grant 4"]);
    assert_eq!(h.m.published.term, 4);
    assert_eq!(io(&h.on(granted(4))), ["send 1 GrantPresentation"]);
    assert!(io(&h.on(granted(4))).is_empty(), "no call in flight: ignored");
}

#[test]
fn a_sidecar_fenced_above_the_term_is_refused_and_the_term_fails() {
    let mut h = Harness::reserved(3);
    let effects = h.connect(1, 5, false);
    assert_eq!(names(&effects), ["refuse 1", "publish FAILED", "announce"]);
    assert!(
        h.phase()
            .1
            .contains("the sidecar activated term 5, above this member's term 3")
    );
    assert_eq!(h.m.held_stream(), None);

    // The same on a held stream: a RecoveryHello naming a higher fence.
    let mut h = Harness::attached(3);
    assert_eq!(io(&h.message(1, hello(4, false))), ["refuse 1"]);
    assert_eq!(h.phase().0, InstancePhase::Failed);
}

#[test]
fn a_sidecar_already_at_the_reserved_term_is_left_alone() {
    let mut h = Harness::reserved(3);
    assert!(io(&h.connect(1, 3, false)).is_empty());
    assert_eq!(h.phase().1, "waiting for the sidecar to leave its current term");
}

#[test]
fn a_term_this_process_released_is_failed_at_once_and_a_higher_one_is_taken_up() {
    // The store rolled back to a term this process relinquished: no sidecar will take it.
    let mut h = Harness::new(assignment(3, TermPhase::Active, material()));
    h.m.setup.released = 3;
    h.on(Event::Tick);
    let (phase, message) = h.phase();
    assert_eq!(phase, InstancePhase::Failed);
    assert!(message.contains("released term 3"), "{message}");
    assert!(io(&h.connect(1, 3, true)).is_empty(), "nothing is attached");
    // The coordinator reserves above it: taken up as any reserved term.
    let effects = h.member(SessionEvent::Ownership(assignment(4, TermPhase::Reserved, material())));
    assert_eq!(io(&effects), ["issue grant 4"]);
    assert_eq!(h.phase().0, InstancePhase::Starting);
}

#[test]
fn a_sidecar_relinquished_at_the_reserved_term_fails_it() {
    let mut h = Harness::reserved(3);
    assert!(io(&h.connect(1, 3, true)).is_empty());
    assert_eq!(h.phase().0, InstancePhase::Failed);
}

#[test]
fn a_reconnect_mid_takeover_gets_the_same_grant_and_the_proof_held_without_new_calls() {
    let mut h = Harness::taken_over(3);
    // The sidecar lost the stream before it saw the confirm and comes back below the term.
    assert_eq!(io(&h.lose(1)), ["drop 1"]);
    assert_eq!(h.phase().0, InstancePhase::Recovering);
    assert_eq!(io(&h.connect(2, 2, true)), ["send 2 GrantPresentation"]);
    let effects = h.message(2, receipt(3, "g"));
    assert_eq!(
        io(&effects),
        ["send 2 ActivationConfirm"],
        "the proof held, no second Activate"
    );
    assert_eq!(h.phase(), (InstancePhase::Active, String::new()));
}

#[test]
fn an_active_term_attaches_a_sidecar_at_it_and_fails_one_below_without_a_proof() {
    let h = Harness::attached(3);
    assert_eq!(h.m.held_stream(), Some(1));

    let mut h = Harness::new(assignment(3, TermPhase::Active, material()));
    assert_eq!(
        io(&h.connect(1, 3, true)),
        Vec::<String>::new(),
        "a relinquished term is never re-attached"
    );
    assert_eq!(
        h.phase().0,
        InstancePhase::Failed,
        "and it is given up for a higher one"
    );
    let mut h = Harness::new(assignment(3, TermPhase::Active, material()));
    h.connect(1, 2, false);
    let (phase, message) = h.phase();
    assert_eq!(phase, InstancePhase::Failed);
    assert!(message.contains("holds no activation proof"), "{message}");
}

#[test]
fn an_active_snapshot_adopts_a_reserved_term_nobody_asked_for() {
    let mut h = Harness::reserved(3);
    h.member(SessionEvent::Ownership(assignment(3, TermPhase::Active, None)));
    assert_eq!(io(&h.connect(1, 3, false)), ["send 1 Attached"]);
}

#[test]
fn a_stream_replaced_while_activating_gets_the_grant_again_once_activated() {
    let mut h = Harness::reserved(3);
    h.connect(1, 0, false);
    h.on(granted(3));
    assert_eq!(io(&h.message(1, receipt(3, "g"))), ["activate"]);
    assert_eq!(io(&h.connect(2, 0, false)), ["drop 1"], "nothing while Activate is out");
    let effects = h.on(activated(3));
    assert_eq!(
        io(&effects),
        ["send 2 GrantPresentation"],
        "no confirm on an unreceipted stream"
    );
    assert_eq!(io(&h.message(2, receipt(3, "g"))), ["send 2 ActivationConfirm"]);
}

#[test]
fn a_lower_term_changes_nothing_but_the_material_it_brings() {
    let mut h = Harness::new(assignment(3, TermPhase::Reserved, None));
    let effects = h.member(SessionEvent::Ownership(assignment(2, TermPhase::Active, material())));
    assert!(io(&effects).is_empty());
    assert_eq!(h.m.published.term, 3);
    assert_eq!(io(&h.connect(1, 0, false)), ["issue grant 3"]);
}

#[test]
fn the_egress_policy_follows_every_attach_and_activation_stamped_with_the_term() {
    use proto::runtime::v1::{EgressPolicy, PolicyLoaded};
    let policy = std::sync::Arc::new(EgressPolicy {
        name: "p".into(),
        revision: 4,
        ..EgressPolicy::default()
    });
    let installs = |effects: &[Effect]| -> Vec<(u64, u64)> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Send {
                    kind: supervisor_message::Kind::PolicyInstall(install),
                    ..
                } => Some((install.term, install.policy.as_ref().map_or(0, |p| p.revision))),
                _ => None,
            })
            .collect()
    };
    // Attached at the active term, then the install.
    let mut h = Harness::with_policy(assignment(3, TermPhase::Active, material()), Some(policy.clone()));
    let effects = h.connect(1, 3, false);
    assert_eq!(io(&effects), ["send 1 Attached", "send 1 PolicyInstall"]);
    assert_eq!(installs(&effects), [(3, 4)]);
    // The sidecar's answer changes nothing in the session, loaded or not; it is reported in
    // the status (for the SandboxPolicy's), and only for this term.
    let loaded = PolicyLoaded {
        term: 3,
        name: "p".into(),
        revision: 4,
        error: "refused".into(),
    };
    let stale = PolicyLoaded {
        term: 2,
        error: String::new(),
        ..loaded.clone()
    };
    assert!(io(&h.message(1, sidecar_message::Kind::PolicyLoaded(loaded.clone()))).is_empty());
    assert_eq!(h.phase(), (InstancePhase::Active, String::new()));
    assert_eq!(h.m.published.egress_policy.as_ref(), Some(&loaded));
    assert!(io(&h.message(1, sidecar_message::Kind::PolicyLoaded(stale))).is_empty());
    assert_eq!(
        h.m.published.egress_policy.as_ref(),
        Some(&loaded),
        "another term's answer is ignored"
    );

    // A takeover: ActivationConfirm, then the install at the new term.
    let mut h = Harness::with_policy(assignment(5, TermPhase::Reserved, material()), Some(policy));
    h.connect(1, 0, false);
    h.on(granted(5));
    h.message(1, receipt(5, "g"));
    let effects = h.on(activated(5));
    assert_eq!(io(&effects), ["send 1 ActivationConfirm", "send 1 PolicyInstall"]);
    assert_eq!(installs(&effects), [(5, 4)]);
    // Without a policy nothing is installed (the new stream replaces the old one).
    assert_eq!(
        io(&Harness::attached(3).connect(2, 3, false)),
        ["drop 1", "send 2 Attached"]
    );
}

#[test]
fn an_edited_policy_is_installed_where_the_sidecar_relays_and_later_elsewhere() {
    use proto::runtime::v1::EgressPolicy;
    let revision = |revision| {
        Some(std::sync::Arc::new(EgressPolicy {
            name: "p".into(),
            revision,
            ..EgressPolicy::default()
        }))
    };
    let mut h = Harness::attached(3);
    let effects = h.on(Event::Policy(revision(2)));
    let Kind::PolicyInstall(install) = sent(&effects, 1) else {
        panic!("an install: {effects:?}")
    };
    assert_eq!((install.term, install.policy.map(|p| p.revision)), (3, Some(2)));
    // Not yet relaying (the grant is not even presented): nothing now, the edit with the
    // activation.
    let mut h = Harness::reserved(5);
    h.connect(1, 0, false);
    assert!(io(&h.on(Event::Policy(revision(7)))).is_empty());
    h.on(granted(5));
    h.message(1, receipt(5, "g"));
    let effects = h.on(activated(5));
    assert_eq!(io(&effects), ["send 1 ActivationConfirm", "send 1 PolicyInstall"]);
}
