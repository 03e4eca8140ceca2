//! Unit tests of [`super::reconcile`] over plain data.

use super::*;
use crate::kubernetes::pool_operation::Spec;
use crate::kubernetes::pool_status::tests::{lease, running, view};

const NS: &str = "openshell-supervision";

fn drain(member: &str) -> OperationObject {
    OperationObject {
        name: "drain-a".into(),
        uid: "0b5c6a1e-uid".into(),
        generation: 1,
        resource_version: "10".into(),
        spec: Spec {
            kind: "Drain".into(),
            member: member.into(),
            ..Spec::default()
        },
        ..OperationObject::default()
    }
}

fn run(objects: &[OperationObject], view: &View) -> Vec<Effect> {
    reconcile(objects, view, Some(&lease()), NS)
}

/// The status the effects apply to `name`.
fn status_in(effects: &[Effect]) -> OperationStatus {
    effects
        .iter()
        .find_map(|e| match e {
            Effect::Status { status, .. } => Some(status.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no status in {effects:?}"))
}

fn starts(effects: &[Effect]) -> usize {
    effects.iter().filter(|e| matches!(e, Effect::Start { .. })).count()
}

fn events(effects: &[Effect]) -> Vec<&'static str> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Event(n) => Some(n.reason),
            _ => None,
        })
        .collect()
}

/// The object after the writer carried out `effects`: finalizer on, status applied.
fn after(object: &OperationObject, effects: &[Effect]) -> OperationObject {
    let mut next = object.clone();
    for effect in effects {
        match effect {
            Effect::AddFinalizer { finalizers, .. } => next.finalizers = finalizers.clone(),
            Effect::Status { status, .. } => next.status = Some(status.clone()),
            _ => {}
        }
    }
    next
}

/// The operation recorded for `object` in phase `phase`.
fn recorded(object: &OperationObject, phase: OperationPhase) -> Operation {
    Operation {
        id: object.uid.clone(),
        phase,
        ..running(OperationKind::Drain, &object.spec.member)
    }
}

#[test]
fn nothing_happens_without_the_lease() {
    let object = drain("a");
    assert!(reconcile(std::slice::from_ref(&object), &view(), None, NS).is_empty());
    let deleting = OperationObject {
        deleting: true,
        finalizers: vec![FINALIZER.into()],
        ..object
    };
    assert!(reconcile(&[deleting], &view(), None, NS).is_empty());
}

#[test]
fn an_operation_is_started_once_under_the_objects_uid_after_its_finalizer() {
    let object = drain("a");
    let effects = run(std::slice::from_ref(&object), &view());
    let order: Vec<&str> = effects
        .iter()
        .map(|e| match e {
            Effect::AddFinalizer { .. } => "finalizer",
            Effect::Start { .. } => "start",
            Effect::Event(_) => "event",
            Effect::Status { .. } => "status",
            Effect::Release { .. } => "release",
        })
        .collect();
    assert_eq!(order, ["finalizer", "start", "event", "status"], "{effects:?}");
    let Some(Effect::Start { operation, .. }) = effects.iter().find(|e| matches!(e, Effect::Start { .. })) else {
        unreachable!()
    };
    assert_eq!(operation.id, object.uid, "the object's UID is the idempotency key");
    assert_eq!((operation.kind, operation.target.as_str()), (OperationKind::Drain, "a"));
    assert_eq!(operation.requested_by, format!("SupervisorPoolOperation {NS}/drain-a"));
    assert_eq!(events(&effects), [REASON_STARTED]);
    let pending = status_in(&effects);
    assert_eq!(
        (pending.phase.as_str(), pending.operation_id.as_str()),
        (PENDING, object.uid.as_str())
    );

    // The view has not caught up yet: the same id is recorded again (the store finds it),
    // no second Started Event, no status change.
    let object = after(&object, &effects);
    let again = run(std::slice::from_ref(&object), &view());
    assert!(
        matches!(again.as_slice(), [Effect::Start { operation, .. }] if operation.id == object.uid),
        "{again:?}"
    );

    // Recorded: nothing is started again, the status follows the operation.
    let mut v = view();
    v.operations.push(recorded(&object, OperationPhase::Running));
    let effects = run(std::slice::from_ref(&object), &v);
    assert_eq!(starts(&effects), 0);
    let status = status_in(&effects);
    assert_eq!(status.phase, RUNNING);
    assert_eq!(
        (status.moves_done, status.moves_total, status.moves.as_str()),
        (0, 2, "0/2")
    );
    let object = after(&object, &effects);
    assert!(
        run(std::slice::from_ref(&object), &v).is_empty(),
        "nothing changed: nothing written"
    );
}

#[test]
fn an_open_equivalent_operation_is_adopted_not_doubled() {
    let mut v = view();
    v.operations.push(running(OperationKind::Drain, "a"));
    let effects = run(&[drain("a")], &v);
    assert_eq!(starts(&effects), 0, "{effects:?}");
    assert!(effects.iter().any(|e| matches!(e, Effect::AddFinalizer { .. })));
    let status = status_in(&effects);
    assert_eq!(status.operation_id, "op-1");
    assert_eq!(
        condition_of(&status, ACCEPTED).map(|c| c.reason.as_str()),
        Some("Adopted")
    );
}

#[test]
fn deleting_the_object_cancels_its_operation_then_releases_the_finalizer() {
    let mut object = drain("a");
    object.finalizers = vec!["example.com/keep".into(), FINALIZER.into()];
    object.deleting = true;
    let mut v = view();
    v.operations.push(recorded(&object, OperationPhase::Running));
    let effects = run(std::slice::from_ref(&object), &v);
    let [
        Effect::Release {
            operation_id,
            finalizers,
            cancelled,
            ..
        },
    ] = effects.as_slice()
    else {
        panic!("only a release: {effects:?}")
    };
    assert_eq!(operation_id, &object.uid);
    assert_eq!(finalizers, &["example.com/keep".to_owned()], "only ours goes");
    assert_eq!(cancelled.reason, CANCELLED);

    // Never recorded (deleted before the store answered): the release still names the id,
    // whose cancellation finds nothing, and the finalizer goes.
    let effects = run(std::slice::from_ref(&object), &view());
    assert!(matches!(effects.as_slice(), [Effect::Release { operation_id, .. }] if *operation_id == object.uid));

    // Without our finalizer (never started, or already released): nothing.
    object.finalizers = vec!["example.com/keep".into()];
    assert!(run(&[object], &v).is_empty());
}

#[test]
fn an_adopted_operation_is_the_one_cancelled() {
    let mut object = drain("a");
    object.finalizers = vec![FINALIZER.into()];
    object.deleting = true;
    object.status = Some(OperationStatus {
        operation_id: "op-1".into(),
        ..OperationStatus::default()
    });
    let mut v = view();
    v.operations.push(running(OperationKind::Drain, "a"));
    let effects = run(&[object], &v);
    assert!(matches!(effects.as_slice(), [Effect::Release { operation_id, .. }] if operation_id == "op-1"));
}

#[test]
fn the_end_of_the_operation_is_reported_once_with_an_event() {
    let object = after(&drain("a"), &run(&[drain("a")], &view()));
    let mut v = view();
    v.operations.push(Operation {
        moves: 2,
        message: "a drained: 2 instances moved".into(),
        ..recorded(&object, OperationPhase::Succeeded)
    });
    let effects = run(std::slice::from_ref(&object), &v);
    assert_eq!(events(&effects), [SUCCEEDED]);
    let status = status_in(&effects);
    assert_eq!((status.phase.as_str(), status.moves.as_str()), (SUCCEEDED, "2/2"));
    assert_eq!(condition_of(&status, COMPLETE).map(|c| c.status.as_str()), Some("True"));
    let done = after(&object, &effects);
    assert!(run(std::slice::from_ref(&done), &v).is_empty(), "reported once");

    // Cancelled through poolctl: the object says so.
    v.operations[0].phase = OperationPhase::Cancelled;
    let effects = run(&[done], &v);
    assert_eq!(events(&effects), [CANCELLED]);
    assert_eq!(status_in(&effects).phase, CANCELLED);
}

#[test]
fn a_dry_run_lists_the_moves_and_records_nothing() {
    let mut object = drain("a");
    object.spec.dry_run = true;
    let effects = run(std::slice::from_ref(&object), &view());
    assert!(
        effects.iter().all(|e| matches!(e, Effect::Status { .. })),
        "no finalizer, no start, no event: {effects:?}"
    );
    let status = status_in(&effects);
    assert_eq!(status.phase, PLANNED);
    assert!(status.operation_id.is_empty());
    let moves: Vec<(&str, &str, &str)> = status
        .planned
        .iter()
        .map(|m| (m.instance.as_str(), m.from.as_str(), m.to.as_str()))
        .collect();
    assert_eq!(moves, [("r1", "a", "b"), ("r2", "a", "b")]);
    assert_eq!(status.moves, "0/2");
    // Planned once per generation.
    let planned = after(&object, &effects);
    assert!(run(std::slice::from_ref(&planned), &view()).is_empty());
    let mut edited = planned;
    edited.generation = 2;
    edited.spec.member = "b".into();
    let replanned = status_in(&run(&[edited], &view()));
    assert_eq!(replanned.planned.len(), 1);
    assert_eq!(replanned.observed_generation, 2);
}

#[test]
fn an_invalid_spec_is_refused_in_the_status_without_starting() {
    let cases = [
        (
            Spec {
                kind: "Evict".into(),
                member: "a".into(),
                ..Spec::default()
            },
            "spec.kind must be Drain or Rebalance",
        ),
        (
            Spec {
                kind: "Drain".into(),
                member: "a".into(),
                max_parallel: Some(i64::from(MAX_MAX_PARALLEL) + 1),
                ..Spec::default()
            },
            "spec.maxParallel must be between 1 and 8",
        ),
        (
            Spec {
                kind: "Drain".into(),
                ..Spec::default()
            },
            "a drain names the member to drain",
        ),
        (
            Spec {
                kind: "Rebalance".into(),
                member: "a".into(),
                ..Spec::default()
            },
            "a rebalance takes no target",
        ),
        (
            Spec {
                kind: "Drain".into(),
                member: "m".repeat(254),
                ..Spec::default()
            },
            "not a member name",
        ),
    ];
    for (spec, why) in cases {
        let object = OperationObject { spec, ..drain("a") };
        let effects = run(&[object], &view());
        assert_eq!(effects.len(), 2, "a status and a Failed Event only: {effects:?}");
        assert_eq!(events(&effects), [FAILED]);
        let status = status_in(&effects);
        assert_eq!(status.phase, FAILED);
        assert!(status.message.contains(why), "{why}: {}", status.message);
        assert!(status.message.len() < 200, "not echoed: {}", status.message.len());
        let accepted = condition_of(&status, ACCEPTED).map(|c| (c.status.as_str(), c.reason.as_str()));
        assert_eq!(accepted, Some(("False", "InvalidSpec")));
    }
    // A member not in the pool (yet) waits, looked at again every round.
    let waiting = status_in(&run(&[drain("c")], &view()));
    assert_eq!(waiting.phase, PENDING);
    assert!(waiting.message.contains("no pool member c"), "{}", waiting.message);
}

#[test]
fn a_spec_changed_after_the_start_is_refused_and_the_operation_runs_as_started() {
    let object = after(&drain("a"), &run(&[drain("a")], &view()));
    let mut v = view();
    v.operations.push(recorded(&object, OperationPhase::Running));
    let mut edited = object;
    edited.generation = 2;
    edited.spec.member = "b".into();
    let effects = run(&[edited], &v);
    assert_eq!(starts(&effects), 0, "no second operation: {effects:?}");
    let status = status_in(&effects);
    assert_eq!(status.phase, RUNNING);
    assert_eq!(status.observed_generation, 2);
    assert!(status.message.contains("runs as started"), "{}", status.message);
    let accepted = condition_of(&status, ACCEPTED).map(|c| (c.status.as_str(), c.reason.as_str()));
    assert_eq!(accepted, Some(("False", "SpecChanged")));
}

/// `(status, reason)` of condition `type_`.
fn state_of<'s>(status: &'s OperationStatus, type_: &str) -> Option<(&'s str, &'s str)> {
    condition_of(status, type_).map(|c| (c.status.as_str(), c.reason.as_str()))
}

#[test]
fn succeeded_says_how_the_operation_ended_and_complete_only_that_it_did() {
    let object = after(&drain("a"), &run(&[drain("a")], &view()));
    let pending = object.status.clone().unwrap_or_default();
    assert_eq!(state_of(&pending, SUCCEEDED_CONDITION), Some(("Unknown", PENDING)));
    assert_eq!(state_of(&pending, COMPLETE), Some(("False", PENDING)));

    let cases = [
        (OperationPhase::Running, ("Unknown", RUNNING), "False"),
        (OperationPhase::Succeeded, ("True", SUCCEEDED), "True"),
        (OperationPhase::Failed, ("False", FAILED), "True"),
        (OperationPhase::Cancelled, ("False", CANCELLED), "True"),
    ];
    for (phase, succeeded, complete) in cases {
        let mut v = view();
        v.operations.push(recorded(&object, phase));
        let status = status_in(&run(std::slice::from_ref(&object), &v));
        assert_eq!(state_of(&status, SUCCEEDED_CONDITION), Some(succeeded), "{phase:?}");
        assert_eq!(
            condition_of(&status, COMPLETE).map(|c| c.status.as_str()),
            Some(complete),
            "{phase:?}"
        );
    }

    // Refused: failed, not succeeded. Waiting for its member: not decided.
    let invalid = OperationObject {
        spec: Spec {
            kind: "Evict".into(),
            ..Spec::default()
        },
        ..drain("a")
    };
    let refused = status_in(&run(&[invalid], &view()));
    assert_eq!(state_of(&refused, SUCCEEDED_CONDITION), Some(("False", FAILED)));
    let waiting = status_in(&run(&[drain("c")], &view()));
    assert_eq!(state_of(&waiting, SUCCEEDED_CONDITION), Some(("Unknown", PENDING)));

    // A dry run ends planned: complete, and not succeeded (nothing was done).
    let mut plan = drain("a");
    plan.spec.dry_run = true;
    let planned = status_in(&run(&[plan], &view()));
    assert_eq!(state_of(&planned, SUCCEEDED_CONDITION), Some(("False", PLANNED)));
    assert_eq!(state_of(&planned, COMPLETE), Some(("True", PLANNED)));
}

/// Whether the coordinator refuses `spec` as invalid (not: waiting for its member).
fn invalid(spec: Spec) -> bool {
    let status = status_in(&run(&[OperationObject { spec, ..drain("a") }], &view()));
    condition_of(&status, ACCEPTED).is_some_and(|c| c.reason == "InvalidSpec")
}

#[test]
fn the_operation_crd_refuses_at_apply_what_the_coordinator_refuses() {
    use crate::kubernetes::pool_status::tests::{enum_of, schema_at, unenforced_bounds};
    use proto::timing::MAX_OPERATION_TIMEOUT;
    const CRD: &str = include_str!("../../../manifests/supervisorpooloperation-crd.yaml");
    let unenforced = unenforced_bounds(CRD);
    assert!(unenforced.is_empty(), "stated, not enforced: {unenforced:?}");
    let field = |name| schema_at(CRD, &["spec", name]);
    let bounds = |name| {
        let node = field(name);
        (node["minimum"].as_i64(), node["maximum"].as_i64())
    };
    let drain = |member: &str| Spec {
        kind: "Drain".into(),
        member: member.into(),
        ..Spec::default()
    };

    // The numbers: the coordinator takes exactly the CRD's range.
    let max_timeout = i64::try_from(MAX_OPERATION_TIMEOUT.as_secs()).unwrap_or(i64::MAX);
    assert_eq!(bounds("maxParallel"), (Some(1), Some(i64::from(MAX_MAX_PARALLEL))));
    assert_eq!(bounds("timeoutSeconds"), (Some(1), Some(max_timeout)));
    for (name, set) in [
        (
            "maxParallel",
            (|s: &mut Spec, n| s.max_parallel = Some(n)) as fn(&mut Spec, i64),
        ),
        ("timeoutSeconds", |s: &mut Spec, n| s.timeout_seconds = Some(n)),
    ] {
        let (Some(low), Some(high)) = bounds(name) else {
            unreachable!()
        };
        for (n, refused) in [(low - 1, true), (low, false), (high, false), (high + 1, true)] {
            let mut spec = drain("a");
            set(&mut spec, n);
            assert_eq!(invalid(spec), refused, "{name} {n}");
        }
    }

    // The kinds: each the CRD allows is one the coordinator takes; another is refused.
    let kinds = enum_of(&field("kind"));
    assert_eq!(kinds, ["Drain", "Rebalance"]);
    for kind in &kinds {
        let member = if kind == "Drain" { "a" } else { "" };
        assert!(
            !invalid(Spec {
                kind: kind.clone(),
                ..drain(member)
            }),
            "{kind}"
        );
    }
    assert!(invalid(Spec {
        kind: "Evict".into(),
        ..drain("a")
    }));

    // The member: a name as long as the CRD allows waits for its member, a longer one is
    // refused; the rules that a drain names its member and a rebalance none are the
    // coordinator's too.
    let longest = field("member")["maxLength"].as_u64().unwrap_or_default();
    let name = |n: u64| "m".repeat(usize::try_from(n).unwrap_or_default());
    assert!(!invalid(drain(&name(longest))) && invalid(drain(&name(longest + 1))));
    let rules = schema_at(CRD, &["spec"])["x-kubernetes-validations"].clone();
    let messages: Vec<&str> = rules
        .as_sequence()
        .map(|rules| rules.iter().filter_map(|r| r["message"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(
        messages,
        ["a drain names the member to drain", "a rebalance takes no member"]
    );
    assert!(invalid(drain("")));
    assert!(invalid(Spec {
        kind: "Rebalance".into(),
        ..drain("a")
    }));

    // The phases the status can have are the CRD's.
    let phases = enum_of(&schema_at(CRD, &["status", "phase"]));
    assert_eq!(phases, [PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED, PLANNED]);
    assert_eq!(
        schema_at(CRD, &["status", "planned"])["maxItems"].as_u64(),
        u64::try_from(MAX_LISTED_MOVES).ok()
    );
}
