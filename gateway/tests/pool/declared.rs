//! `SupervisorPoolOperation` objects run by real gateway replicas (real database, real gRPC, a
//! scripted member): the test feeds the index as the watch would and reads the API calls off
//! the recording cluster. The reconcile's decisions are unit-tested in
//! `src/kubernetes/operation_reconcile_tests.rs`.

use crate::doubles::{Call, Recording};
use gateway::kubernetes::Scope;
use gateway::kubernetes::Shared;
use gateway::kubernetes::operation_reconcile::{
    CANCELLED, COMPLETE, REASON_STARTED, SUCCEEDED, SUCCEEDED_CONDITION, condition_of,
};
use gateway::kubernetes::plan::SUPERVISOR_SECRET;
use gateway::kubernetes::pool_operation::{FINALIZER, OperationObject, OperationStatus, Spec};
use gateway::store::OperationPhase;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::kubernetes::{INSTALL, applied, attach_supervisor_0, next_call, replica_with};
use crate::support::{TestDb, wait_for};

const UID: &str = "3b9e6f0a-8c1d-4e2f-9a7b-5c6d7e8f9a0b";

/// Every call until (and with) the first matching `want`.
async fn calls_until(
    calls: &mut UnboundedReceiver<Call>,
    what: &str,
    mut want: impl FnMut(&Call) -> bool,
) -> Vec<Call> {
    let mut seen = Vec::new();
    next_call(calls, what, |c| {
        seen.push(c.clone());
        want(c)
    })
    .await;
    seen
}

fn status_of(call: &Call) -> Option<&OperationStatus> {
    match call {
        Call::ApplyOperationStatus { name, status } if name == "drain-0" => Some(status),
        _ => None,
    }
}

fn events(calls: &[Call]) -> Vec<&'static str> {
    calls
        .iter()
        .filter_map(|c| match c {
            Call::PublishOperation(n) if n.name == "drain-0" => Some(n.reason),
            _ => None,
        })
        .collect()
}

fn watched(shared: &[&Shared], object: &OperationObject) {
    for index in shared {
        index.with(|i| i.reset_operation_objects([object.clone()]));
    }
}

/// A drain declared as an object is recorded once under the object's UID after the finalizer
/// is on, reaches `Succeeded` with Events; only the coordinator acts; after a failover the next
/// coordinator starts nothing again, and deleting the object cancels the (succeeded) drain
/// before the finalizer goes.
pub async fn a_declared_drain_runs_once_and_deleting_its_object_cancels_it(db: &TestDb) {
    let shared = Shared::default();
    let (first, _, mut calls): (_, Recording, _) = replica_with(db, "gw-k", Scope::new(INSTALL), &shared).await;
    next_call(&mut calls, "the supervisor Secret (coordinating)", |c| {
        applied(c, INSTALL, SUPERVISOR_SECRET).is_some()
    })
    .await;
    let standby_shared = Shared::default();
    let (standby, _, mut standby_calls) = replica_with(db, "gw-standby", Scope::new(INSTALL), &standby_shared).await;
    let member = attach_supervisor_0(&first.endpoint()).await;

    let object = OperationObject {
        name: "drain-0".into(),
        uid: UID.into(),
        generation: 1,
        resource_version: "1".into(),
        spec: Spec {
            kind: "Drain".into(),
            member: "supervisor-0".into(),
            max_parallel: Some(2),
            ..Spec::default()
        },
        ..OperationObject::default()
    };
    watched(&[&shared, &standby_shared], &object);
    let before = calls_until(&mut calls, "the finalizer put on", |c| {
        matches!(c, Call::SetOperationFinalizers { name, finalizers } if name == "drain-0" && finalizers == &[FINALIZER])
    })
    .await;
    assert!(
        before.iter().all(|c| status_of(c).is_none()),
        "nothing before the finalizer: {before:?}"
    );
    // The API server's answer, as the watch brings it.
    let finalized = OperationObject {
        finalizers: vec![FINALIZER.into()],
        resource_version: "2".into(),
        ..object
    };
    watched(&[&shared, &standby_shared], &finalized);
    let seen = calls_until(&mut calls, "the drain succeeded", |c| {
        status_of(c).is_some_and(|s| s.phase == SUCCEEDED)
    })
    .await;
    let done = seen.last().and_then(status_of).cloned().unwrap();
    assert_eq!(done.operation_id, UID);
    assert_eq!((done.moves.as_str(), done.observed_generation), ("0/0", 1));
    assert_eq!(events(&seen), [REASON_STARTED, SUCCEEDED]);
    let state = |type_| condition_of(&done, type_).map(|c| (c.status.as_str(), c.reason.as_str()));
    assert_eq!(state(SUCCEEDED_CONDITION), Some(("True", SUCCEEDED)));
    assert_eq!(state(COMPLETE), Some(("True", SUCCEEDED)));
    let requested_by = format!("SupervisorPoolOperation {INSTALL}/drain-0");
    let recorded = |db: &TestDb| {
        let store = db.store.clone();
        let requested_by = requested_by.clone();
        async move {
            let all = store.list_operations().await.unwrap();
            all.into_iter()
                .filter(|o| o.requested_by == requested_by)
                .collect::<Vec<_>>()
        }
    };
    let mine = recorded(db).await;
    assert_eq!(mine.len(), 1, "{mine:?}");
    assert_eq!(mine[0].id, UID, "the object's UID is the operation's id");
    while let Ok(call) = standby_calls.try_recv() {
        assert!(
            !matches!(
                call,
                Call::SetOperationFinalizers { .. } | Call::ApplyOperationStatus { .. } | Call::PublishOperation(_)
            ),
            "the standby acted on the object: {call:?}"
        );
    }

    // Failover, with the object as the watch shows it; then it is deleted.
    let shown = OperationObject {
        status: Some(done),
        ..finalized
    };
    watched(&[&standby_shared], &shown);
    drop(member);
    first.stop().await;
    let deleting = OperationObject {
        deleting: true,
        resource_version: "3".into(),
        ..shown
    };
    watched(&[&standby_shared], &deleting);
    let seen = calls_until(&mut standby_calls, "the finalizer released", |c| {
        matches!(c, Call::SetOperationFinalizers { name, finalizers } if name == "drain-0" && finalizers.is_empty())
    })
    .await;
    assert!(
        seen.iter()
            .all(|c| status_of(c).is_none() && events(std::slice::from_ref(c)).is_empty()),
        "the next coordinator started and reported nothing again: {seen:?}"
    );
    let cancelled = next_call(&mut standby_calls, "the Cancelled Event", |c| {
        events(std::slice::from_ref(c)) == [CANCELLED]
    })
    .await;
    assert!(matches!(cancelled, Call::PublishOperation(_)));
    let mine = recorded(db).await;
    assert_eq!(mine.len(), 1, "never recorded twice: {mine:?}");
    assert!(
        mine[0].cancel_requested,
        "the cancellation was recorded before the release"
    );
    wait_for("the drain cancelled", 2000, || async {
        let op = db.store.operation(UID).await.ok().flatten()?;
        (op.phase == OperationPhase::Cancelled).then_some(())
    })
    .await;
    standby.stop().await;
}
