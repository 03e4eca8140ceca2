//! Policy installs: loaded only from the activated owner at its term, persisted before they
//! are enforced, only forward within a name, answered with the revision in force; held
//! through a handoff and refused from the fenced owner after it.

use std::time::Duration;

use proto::runtime::v1::{EgressPolicy, EgressRule, PolicyInstall, supervisor_message};

use super::*;
use crate::engine::effect::Event;

fn install(term: u64, name: &str, revision: u64) -> supervisor_message::Kind {
    supervisor_message::Kind::PolicyInstall(PolicyInstall {
        term,
        policy: Some(EgressPolicy {
            name: name.into(),
            revision,
            rules: vec![EgressRule {
                name: "api".into(),
                host: "api.example.com".into(),
                ports: vec![443],
                ..EgressRule::default()
            }],
            ..EgressPolicy::default()
        }),
    })
}

fn loaded(h: &Harness) -> Option<(String, u64)> {
    h.m.state.policy.as_ref().map(|p| (p.name.clone(), p.revision))
}

#[test]
fn the_owners_install_is_persisted_then_enforced_and_acknowledged() {
    let mut h = Harness::active();
    assert_eq!(
        names(&h.message(1, install(1, "p", 3))),
        ["persist", "enforce p 3", r#"send 1 loaded "p" 3 """#]
    );
    assert_eq!(loaded(&h), Some(("p".into(), 3)));
    // Again, or older: nothing changes; the answer names what is in force.
    assert_eq!(names(&h.message(1, install(1, "p", 3))), [r#"send 1 loaded "p" 3 """#]);
    assert_eq!(names(&h.message(1, install(1, "p", 2))), [r#"send 1 loaded "p" 3 """#]);
    // Another policy (the Pod's annotation changed) replaces it whatever its revision.
    assert_eq!(
        names(&h.message(1, install(1, "q", 1))),
        ["persist", "enforce q 1", r#"send 1 loaded "q" 1 """#]
    );
}

#[test]
fn installs_not_from_the_activated_owner_at_its_term_change_nothing() {
    let mut h = Harness::active();
    h.message(1, install(1, "p", 1));
    for wrong in [install(0, "p", 9), install(2, "p", 9)] {
        assert_eq!(
            names(&h.message(1, wrong)),
            [r#"send 1 loaded "p" 1 "refused: not from the activated owner at term 1""#]
        );
    }
    assert_eq!(loaded(&h), Some(("p".into(), 1)));
    // Before any activation nothing is loaded from anyone.
    let mut placing = Harness::placing();
    let answer = names(&placing.message(1, install(0, "p", 1)));
    assert_eq!(
        answer,
        [r#"send 1 loaded "" 0 "refused: not from the activated owner at term 0""#]
    );
    assert_eq!(loaded(&placing), None);
}

#[test]
fn an_invalid_revision_is_refused_with_its_reason_and_the_last_one_stays() {
    let mut h = Harness::active();
    h.message(1, install(1, "p", 1));
    let supervisor_message::Kind::PolicyInstall(mut bad) = install(1, "p", 2) else {
        unreachable!()
    };
    if let Some(policy) = bad.policy.as_mut() {
        policy.rules[0].host = "*".into();
    }
    let answer = names(&h.message(1, supervisor_message::Kind::PolicyInstall(bad)));
    assert_eq!(answer.len(), 1);
    assert!(
        answer[0].starts_with(r#"send 1 loaded "p" 1 "rule \"api\": host"#),
        "{answer:?}"
    );
    assert_eq!(loaded(&h), Some(("p".into(), 1)));
}

#[test]
fn the_revision_is_held_through_a_handoff_and_the_fenced_owner_installs_nothing() {
    let mut h = Harness::active();
    h.message(1, install(1, "p", 1));
    h.on(Event::Closed {
        id: 1,
        opened: true,
        reason: "silent".into(),
    });
    assert_eq!(loaded(&h), Some(("p".into(), 1)), "recovering: still enforced");
    h.advance(Duration::from_secs(5));
    h.on(Event::Tick);
    h.on(Event::Opened(2));
    h.activate(2, 2, "m2");
    assert_eq!(loaded(&h), Some(("p".into(), 1)), "the new owner starts from it");
    // The old owner's stream is gone; were a message of term 1 to arrive on the new owner's
    // stream, it is refused.
    assert!(h.message(1, install(1, "p", 5)).is_empty());
    assert_eq!(
        names(&h.message(2, install(1, "p", 5))),
        [r#"send 2 loaded "p" 1 "refused: not from the activated owner at term 2""#]
    );
    assert_eq!(
        names(&h.message(2, install(2, "p", 2)))[..2],
        ["persist", "enforce p 2"]
    );
}

#[test]
fn the_same_revision_again_takes_only_its_credential_values_which_are_never_persisted() {
    let with_value = |value: &str| {
        let supervisor_message::Kind::PolicyInstall(mut install) = install(1, "p", 3) else {
            unreachable!()
        };
        let policy = install.policy.as_mut().expect("a policy");
        policy.credentials = vec![proto::runtime::v1::CredentialBinding {
            name: "models".into(),
            value: value.as_bytes().to_vec(),
            ..Default::default()
        }];
        policy.rules[0].credential = "models".into();
        supervisor_message::Kind::PolicyInstall(install)
    };
    let mut h = Harness::active();
    assert_eq!(
        names(&h.message(1, with_value("sk-1"))),
        ["persist", "enforce p 3", r#"send 1 loaded "p" 3 """#]
    );
    // A rotated value: enforced, nothing persisted, the revision stays.
    assert_eq!(
        names(&h.message(1, with_value("sk-2"))),
        ["enforce p 3", r#"send 1 loaded "p" 3 """#]
    );
    assert_eq!(names(&h.message(1, with_value("sk-2"))), [r#"send 1 loaded "p" 3 """#]);
    let held = h.m.state.policy.as_ref().and_then(|p| p.credentials[0].value.clone());
    assert!(held.is_some_and(|v| v.0 == "sk-2"));
    let persisted = serde_json::to_string(&h.m.state).expect("serializable");
    assert!(
        !persisted.contains("sk-"),
        "no value in the persisted state: {persisted}"
    );
    // From a fenced term, no value is taken.
    let supervisor_message::Kind::PolicyInstall(mut stale) = with_value("sk-3") else {
        unreachable!()
    };
    stale.term = 0;
    h.message(1, supervisor_message::Kind::PolicyInstall(stale));
    let held = h.m.state.policy.as_ref().and_then(|p| p.credentials[0].value.clone());
    assert!(held.is_some_and(|v| v.0 == "sk-2"));
}
