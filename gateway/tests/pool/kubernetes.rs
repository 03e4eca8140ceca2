//! The Kubernetes integration end to end inside a real gateway replica (real database, real
//! gRPC): the test drives the index as the watches would and reads the writes the
//! coordinator intends off the recording cluster's channel. The API calls themselves are
//! tested against captured responses in `tests/kube_api.rs`.

use std::sync::Arc;
use std::time::Duration;

use crate::doubles::{Call, Recording, Scripted};
use gateway::kubernetes::index::{Pod, Unsupervised};
use gateway::kubernetes::notice::{
    Notice, REASON_MEMBER_JOINED, REASON_MEMBER_LEFT, REASON_MEMBER_LOST, REASON_NOT_SUPERVISED,
    REASON_SUPERVISOR_RECOVERY_FAILED, REASON_UNPLACEABLE, REASON_WORKLOAD_FINISHED,
};
use gateway::kubernetes::plan::{NAMESPACE_SECRET, OPERATOR_SECRET, SUPERVISOR_SECRET};
use gateway::kubernetes::pool_status::{POOL_NAME, PoolStatus};
use gateway::kubernetes::review::Account;
use gateway::kubernetes::supervised::Supervised;
use gateway::kubernetes::{Integration, Scope, Shared};
use proto::host::v1::Leaving;
use proto::host::v1::member_message::Kind as MemberKind;
use proto::registry::v1::RecoveryFailedRequest;
use proto::registry::v1::instance_registry_client::InstanceRegistryClient;
use proto::trust::TrustBundle;
use tokio::sync::mpsc::UnboundedReceiver;
use tonic::Code;

use crate::cluster::{
    Behaviour, Identity, Member, channel, identity, instance_ref, register, start_replica_with, wait_assignments,
    with_token,
};
use crate::support::{TestDb, wait_for};

pub(crate) const INSTALL: &str = "openshell-supervision";

/// The next call matching `want`, skipping others; fails after 20 s.
pub(crate) async fn next_call(
    calls: &mut UnboundedReceiver<Call>,
    what: &str,
    mut want: impl FnMut(&Call) -> bool,
) -> Call {
    let found = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(call) = calls.recv().await {
            if want(&call) {
                return Some(call);
            }
        }
        None
    })
    .await;
    match found {
        Ok(Some(call)) => call,
        _ => panic!("no call where {what}"),
    }
}

/// The supervisor Pod `supervisor-0` of the install (process `p1`, capacity 8).
fn supervisor_0() -> Identity {
    identity("supervisor-0", "p1", 1, 8)
}

/// [`supervisor_0`] attached to `endpoint` with its Pod's ServiceAccount token.
pub(crate) async fn attach_supervisor_0(endpoint: &str) -> Member {
    Member::attach(
        endpoint,
        &member_token("supervisor-0"),
        supervisor_0(),
        Behaviour::Healthy,
    )
    .await
    .expect("the supervisor Pod's token is accepted")
}

/// A replica `name` with a recording cluster, the TokenReview stand-in and `shared` as its
/// watches' index: the replica, the recording cluster and the calls it records.
pub(crate) async fn replica_with(
    db: &TestDb,
    name: &str,
    scope: Scope,
    shared: &Shared,
) -> (crate::cluster::Replica, Recording, UnboundedReceiver<Call>) {
    let (cluster, calls) = Recording::new();
    let integration = Integration {
        cluster: cluster.clone(),
        shared: shared.clone(),
        scope,
        review: Arc::new(Scripted),
    };
    (
        start_replica_with(name, &db.url, &[], Some(integration)).await,
        cluster,
        calls,
    )
}

pub(crate) fn applied(call: &Call, namespace: &str, name: &str) -> Option<(Option<String>, String)> {
    match call {
        Call::ApplySecret {
            namespace: ns,
            name: n,
            delivered,
        } if ns == namespace && n == name => Some((delivered.token.clone(), delivered.trust_jwks.clone())),
        _ => None,
    }
}

/// The ServiceAccount token of supervisor Pod `pod` (as the review stand-in takes it).
fn member_token(pod: &str) -> String {
    Scripted::token(&Account {
        namespace: INSTALL.into(),
        service_account: "openshell-supervisor".into(),
        pod_name: pod.into(),
        pod_uid: format!("uid-{pod}"),
    })
}

/// The ServiceAccount token of Pod `default/<pod>` (UID `uid-<pod>`, as `register` uses).
fn pod_token(pod: &str) -> String {
    pod_token_in("default", "default", pod)
}

fn pod_token_in(namespace: &str, account: &str, pod: &str) -> String {
    Scripted::token(&Account {
        namespace: namespace.into(),
        service_account: account.into(),
        pod_name: pod.into(),
        pod_uid: format!("uid-{pod}"),
    })
}

/// Secrets follow the namespace labels, the delivered tokens work, and an instance whose
/// Pod is gone is withdrawn.
pub async fn secrets_follow_labels_and_pods_decide_desired_instances(db: &TestDb) {
    let shared = Shared::default();
    let dir = tempfile::tempdir().unwrap();
    let ca = testkit::pki::Ca::new().pem();
    let ca_file = dir.path().join("ca.crt");
    std::fs::write(&ca_file, &ca).unwrap();
    let scope = Scope {
        unseen_pod_grace: Duration::ZERO,
        ca_file: Some(ca_file),
        ..Scope::new(INSTALL)
    };
    let (replica, _, mut calls) = replica_with(db, "gw-k", scope, &shared).await;

    // As coordinator it writes the install namespace's Secrets first.
    let call = next_call(&mut calls, "the supervisor Secret", |c| {
        applied(c, INSTALL, SUPERVISOR_SECRET).is_some()
    })
    .await;
    let (token, jwks) = applied(&call, INSTALL, SUPERVISOR_SECRET).unwrap();
    TrustBundle::from_jwks(jwks.as_bytes()).expect("the Secret's trust.jwks parses");
    assert_eq!(token, None, "members bring their own ServiceAccount tokens");
    next_call(&mut calls, "the operator Secret", |c| {
        applied(c, INSTALL, OPERATOR_SECRET).is_some()
    })
    .await;

    // A namespace is labelled: its Secret appears; system namespaces never get one.
    shared.with(|index| index.reset_namespaces(["kube-system".to_owned(), "default".to_owned()]));
    let call = next_call(
        &mut calls,
        "the namespace Secret",
        |c| matches!(c, Call::ApplySecret { namespace, .. } if namespace != INSTALL),
    )
    .await;
    let (token, _) = applied(&call, "default", NAMESPACE_SECRET).expect("only default gets a Secret");
    assert_eq!(token, None, "sidecars bring their own ServiceAccount tokens");
    let Call::ApplySecret { delivered, .. } = &call else {
        unreachable!()
    };
    assert_eq!(
        delivered.ca_pem.as_deref(),
        Some(ca.as_str()),
        "the CA bundle rides along as ca.crt"
    );

    // A member joins: an Event on its Pod in the install namespace.
    let _member = attach_supervisor_0(&replica.endpoint()).await;
    let call = next_call(
        &mut calls,
        "MemberJoined",
        |c| matches!(c, Call::Publish(n) if n.reason == REASON_MEMBER_JOINED),
    )
    .await;
    let Call::Publish(notice) = call else { unreachable!() };
    assert_eq!(
        (notice.regarding.namespace.as_str(), notice.regarding.name.as_str()),
        (INSTALL, "supervisor-0")
    );

    // The Pod's own token registers its instance (now that a member can take it).
    register(&replica.endpoint(), &pod_token("agent-0"), "agent-0")
        .await
        .expect("the Pod's token is accepted");

    // The Pod watch lists: agent-0's Pod is not among them, so it is withdrawn.
    let other = Pod {
        namespace: "default".into(),
        name: "agent-1".into(),
        uid: "uid-agent-1".into(),
    };
    shared.with(|index| index.reset_pods([other]));
    wait_for("agent-0 withdrawn", 2000, || async {
        let instance = db.store.instance("default/agent-0").await.ok()??;
        instance.withdrawn.then_some(())
    })
    .await;

    // The label goes: the Secret goes.
    shared.with(|index| index.delete_namespace("default"));
    let call = next_call(&mut calls, "the Secret removed", |c| {
        matches!(c, Call::DeleteSecret { .. })
    })
    .await;
    assert_eq!(
        call,
        Call::DeleteSecret {
            namespace: "default".into(),
            name: NAMESPACE_SECRET.into()
        }
    );
    replica.stop().await;
}

/// A labelled namespace being deleted gets no writes: the watch's terminating namespace is
/// gone for the plan, and a namespace the API server reports as terminating (403) is treated
/// the same at once, never retried.
pub async fn terminating_namespaces_get_no_writes_and_are_not_retried(db: &TestDb) {
    let shared = Shared::default();
    let (replica, cluster, mut calls) = replica_with(db, "gw-k", Scope::new(INSTALL), &shared).await;
    next_call(&mut calls, "the operator Secret", |c| {
        applied(c, INSTALL, OPERATOR_SECRET).is_some()
    })
    .await;

    // team-b is listed as terminating: only team-a gets its Secret.
    shared.with(|index| index.reset_namespaces_with(["team-a".to_owned(), "team-b".to_owned()], ["team-b".to_owned()]));
    let call = next_call(
        &mut calls,
        "a namespace Secret",
        |c| matches!(c, Call::ApplySecret { namespace, .. } if namespace != INSTALL),
    )
    .await;
    assert!(applied(&call, "team-a", NAMESPACE_SECRET).is_some(), "{call:?}");

    // team-c starts terminating before the watch says so: the API server refuses the write
    // once, and the namespace is gone for the plan from then on.
    cluster.terminate("team-c");
    shared.with(|index| index.apply_namespace("team-c"));
    next_call(&mut calls, "the refused write", |c| {
        applied(c, "team-c", NAMESPACE_SECRET).is_some()
    })
    .await;
    wait_for("team-c treated as gone", 2000, || async {
        shared.with(|index| (index.is_terminating("team-c") && !index.labelled().contains("team-c")).then_some(()))
    })
    .await;
    assert!(
        shared.with(|index| index.unlabelled().is_empty()),
        "nothing to remove from a namespace being deleted"
    );
    replica.stop().await;
    while let Ok(call) = calls.try_recv() {
        assert!(
            !matches!(&call, Call::ApplySecret { namespace, .. } | Call::DeleteSecret { namespace, .. }
                if namespace == "team-b"),
            "a write into a terminating namespace: {call:?}"
        );
    }
}

/// A namespace trust Secret deleted by hand, or removed with the label that then comes back,
/// is written again at once — not when its token would have been renewed.
pub async fn deleted_and_relabelled_namespace_secrets_are_rewritten_at_once(db: &TestDb) {
    let shared = Shared::default();
    let (replica, _, mut calls) = replica_with(db, "gw-k", Scope::new(INSTALL), &shared).await;
    let team_a = |c: &Call| applied(c, "team-a", NAMESPACE_SECRET).is_some();
    shared.with(|index| index.reset_namespaces(["team-a".to_owned()]));
    next_call(&mut calls, "team-a's Secret", team_a).await;
    shared.with(|index| index.reset_secrets(["team-a".to_owned()]));

    // Someone deletes it: the Secret watch reports it, the writer writes it again.
    shared.with(|index| index.delete_secret("team-a"));
    next_call(&mut calls, "team-a's Secret rewritten after its deletion", team_a).await;
    shared.with(|index| index.apply_secret("team-a"));

    // Unlabelled: removed. Labelled again: written again at once.
    shared.with(|index| index.delete_namespace("team-a"));
    next_call(
        &mut calls,
        "team-a's Secret removed",
        |c| matches!(c, Call::DeleteSecret { namespace, .. } if namespace == "team-a"),
    )
    .await;
    shared.with(|index| index.apply_namespace("team-a"));
    next_call(&mut calls, "team-a's Secret rewritten after the relabel", team_a).await;
    replica.stop().await;
}

/// Member Events name the supervisor Pod by UID, and a member that announces it is leaving
/// and goes at once (an idle member on SIGTERM) left: a Normal MemberLeft, never a
/// MemberLost warning.
pub async fn a_member_that_leaves_gracefully_is_reported_left_on_its_pod(db: &TestDb) {
    let shared = Shared::default();
    let (replica, _, mut calls) = replica_with(db, "gw-k", Scope::new(INSTALL), &shared).await;
    let call = next_call(&mut calls, "the supervisor Secret", |c| {
        applied(c, INSTALL, SUPERVISOR_SECRET).is_some()
    })
    .await;
    applied(&call, INSTALL, SUPERVISOR_SECRET).unwrap();
    shared.with(|index| index.reset_member_pods([("supervisor-0".to_owned(), "uid-supervisor-0".to_owned())]));

    let member = attach_supervisor_0(&replica.endpoint()).await;
    let joined = next_call(
        &mut calls,
        "MemberJoined",
        |c| matches!(c, Call::Publish(n) if n.reason == REASON_MEMBER_JOINED),
    )
    .await;
    let Call::Publish(joined) = joined else { unreachable!() };
    assert_eq!(joined.regarding.uid.as_deref(), Some("uid-supervisor-0"));

    // SIGTERM on an idle member: it announces it is leaving and its stream ends at once.
    member
        .send(MemberKind::Leaving(Leaving {
            reason: "SIGTERM".into(),
        }))
        .await;
    wait_for("the announcement recorded", 2000, || async {
        let (_, members) = db.store.list_members().await.ok()?;
        members
            .iter()
            .any(|m| m.member == "supervisor-0" && m.leaving)
            .then_some(())
    })
    .await;
    member.kill();
    drop(member);
    let gone = next_call(
        &mut calls,
        "the member's departure",
        |c| matches!(c, Call::Publish(n) if n.reason == REASON_MEMBER_LEFT || n.reason == REASON_MEMBER_LOST),
    )
    .await;
    let Call::Publish(gone) = gone else { unreachable!() };
    assert_eq!(
        (gone.reason, gone.warning, gone.note.as_str()),
        (REASON_MEMBER_LEFT, false, "member supervisor-0 left the pool")
    );
    assert_eq!(gone.regarding.uid.as_deref(), Some("uid-supervisor-0"));
    replica.stop().await;
}

/// The event `reason` on the Pod `default/<pod>`, if `call` publishes it.
fn event_on<'a>(call: &'a Call, reason: &str, pod: &str) -> Option<&'a Notice> {
    match call {
        Call::Publish(n) if n.reason == reason && n.regarding.namespace == "default" && n.regarding.name == pod => {
            Some(n)
        }
        _ => None,
    }
}

/// A coordinator with the recording cluster and a labelled `default` namespace whose
/// Pods `pods` the watch lists.
async fn coordinator_with_default_namespace(
    db: &TestDb,
    pods: &[&str],
) -> (crate::cluster::Replica, UnboundedReceiver<Call>) {
    let (replica, calls, _) = coordinator_of_default_namespace(db, pods).await;
    (replica, calls)
}

/// [`coordinator_with_default_namespace`], with the index its watches would feed.
async fn coordinator_of_default_namespace(
    db: &TestDb,
    pods: &[&str],
) -> (crate::cluster::Replica, UnboundedReceiver<Call>, Shared) {
    let shared = Shared::default();
    let (replica, _, mut calls) = replica_with(db, "gw-k", Scope::new(INSTALL), &shared).await;
    let call = next_call(&mut calls, "the supervisor Secret", |c| {
        applied(c, INSTALL, SUPERVISOR_SECRET).is_some()
    })
    .await;
    applied(&call, INSTALL, SUPERVISOR_SECRET).unwrap();
    shared.with(|index| {
        index.reset_namespaces(["default".to_owned()]);
        index.reset_pods(pods.iter().map(|name| Pod {
            namespace: "default".into(),
            name: (*name).into(),
            uid: format!("uid-{name}"),
        }));
    });
    let call = next_call(&mut calls, "the namespace Secret", |c| {
        applied(c, "default", NAMESPACE_SECRET).is_some()
    })
    .await;
    applied(&call, "default", NAMESPACE_SECRET).unwrap();
    (replica, calls, shared)
}

fn default_pod(name: &str) -> Pod {
    Pod {
        namespace: "default".into(),
        name: name.into(),
        uid: format!("uid-{name}"),
    }
}

/// The `Supervised` condition of Pod `default/<pod>`, if `call` sets it.
fn supervised_of<'a>(call: &'a Call, pod: &str) -> Option<&'a Supervised> {
    match call {
        Call::SetSupervised { pod: p, condition } if p.name == pod => Some(condition),
        _ => None,
    }
}

/// Every Pod gets the Supervised condition, kept as the pool changes: a reason other than
/// NotRegistered once its instance is placed, `False` (Finished) when the Pod finished, `False`
/// (NotSupervised) for a Pod admitted without supervision.
pub async fn the_supervised_condition_follows_each_pod(db: &TestDb) {
    // Its first condition (NotRegistered) may come before the namespace's Secret.
    let (replica, mut calls, shared) = coordinator_of_default_namespace(db, &["agent-0"]).await;
    let _member = attach_supervisor_0(&replica.endpoint()).await;
    register(&replica.endpoint(), &pod_token("agent-0"), "agent-0")
        .await
        .expect("the Pod's token is accepted");
    let placed = next_call(&mut calls, "agent-0 placed", |c| {
        supervised_of(c, "agent-0").is_some_and(|s| s.reason != "NotRegistered")
    })
    .await;
    assert!(!supervised_of(&placed, "agent-0").unwrap().reason.is_empty());
    shared.with(|index| index.apply_finished(default_pod("agent-0")));
    let finished = next_call(&mut calls, "agent-0 finished", |c| {
        supervised_of(c, "agent-0").is_some_and(|s| s.reason == "Finished")
    })
    .await;
    assert!(!supervised_of(&finished, "agent-0").unwrap().status);
    shared.with(|index| {
        index.apply_unsupervised(Unsupervised {
            pod: default_pod("root-app"),
            reason: "runs_as_root".into(),
            message: "runs as root".into(),
        })
    });
    let root = next_call(&mut calls, "root-app's condition", |c| {
        supervised_of(c, "root-app").is_some()
    })
    .await;
    let root = supervised_of(&root, "root-app").unwrap();
    assert_eq!((root.status, root.reason), (false, "NotSupervised"));
    replica.stop().await;
}

/// A Job's Pod finishes: its instance is withdrawn at once (not recovering, not counted) with
/// a WorkloadFinished Event on the Pod — also when its sidecar deregistered it first. A running Pod the webhook admitted without
/// supervision gets a NotSupervised warning on it, once, and the pool status counts it and
/// is Degraded (PodsNotSupervised) until the Pod is gone.
pub async fn finished_and_unsupervised_pods_are_told_apart_from_supervised_ones(db: &TestDb) {
    let (replica, mut calls, shared) = coordinator_of_default_namespace(db, &["job-0"]).await;
    let _member = attach_supervisor_0(&replica.endpoint()).await;
    register(&replica.endpoint(), &pod_token("job-0"), "job-0")
        .await
        .expect("the Pod's token is accepted");
    wait_assignments(&db.store, "job-0 placed", |a| a.len() == 1).await;

    shared.with(|index| index.apply_finished(default_pod("job-0")));
    let call = next_call(&mut calls, "WorkloadFinished on job-0", |c| {
        event_on(c, REASON_WORKLOAD_FINISHED, "job-0").is_some()
    })
    .await;
    let notice = event_on(&call, REASON_WORKLOAD_FINISHED, "job-0").unwrap();
    assert!(!notice.warning);
    let instance = db.store.instance("default/job-0").await.unwrap().unwrap();
    assert!(instance.withdrawn, "withdrawn before its Event");

    // Another Job's sidecar deregistered its instance as the workload exited; its Pod
    // finishes a moment later: the Event is on it all the same.
    shared.with(|index| index.apply_pod(default_pod("job-1")));
    register(&replica.endpoint(), &pod_token("job-1"), "job-1")
        .await
        .expect("the Pod's token is accepted");
    next_call(&mut calls, "job-1 seen running", |c| {
        supervised_of(c, "job-1").is_some_and(|s| s.reason != "NotRegistered")
    })
    .await;
    assert!(
        db.store
            .withdraw_instance("default/job-1", "uid-job-1", None)
            .await
            .unwrap()
    );
    next_call(&mut calls, "job-1 seen withdrawn", |c| {
        supervised_of(c, "job-1").is_some_and(|s| s.reason == "Withdrawn")
    })
    .await;
    shared.with(|index| index.apply_finished(default_pod("job-1")));
    next_call(&mut calls, "WorkloadFinished on job-1", |c| {
        event_on(c, REASON_WORKLOAD_FINISHED, "job-1").is_some()
    })
    .await;

    let root = Unsupervised {
        pod: default_pod("root-app"),
        reason: "runs_as_root".into(),
        message: "container \"app\" runs as root (runAsUser: 0)".into(),
    };
    shared.with(|index| index.apply_unsupervised(root.clone()));
    let call = next_call(&mut calls, "NotSupervised on root-app", |c| {
        event_on(c, REASON_NOT_SUPERVISED, "root-app").is_some()
    })
    .await;
    let notice = event_on(&call, REASON_NOT_SUPERVISED, "root-app").unwrap();
    assert!(notice.warning && notice.note.contains("runs as root"), "{notice:?}");
    let status = next_call(&mut calls, "a status counting root-app", |c| {
        pool_status(c).is_some_and(|s| s.unsupervised_pods.total == 1)
    })
    .await;
    let status = pool_status(&status).unwrap();
    assert_eq!(status.unsupervised_pods.by_reason["runs_as_root"], 1);
    assert_eq!(
        condition(&status, "Degraded"),
        ("True".into(), "PodsNotSupervised".into())
    );
    assert_eq!(status.instances.total, 0, "the finished Job's instance is not counted");

    // Nothing new: no second NotSupervised Event; the Pod goes and the pool is as expected.
    shared.with(|index| index.apply_pod(default_pod("other")));
    shared.with(|index| index.delete_unsupervised(&root.pod.uid));
    let call = next_call(&mut calls, "a status without root-app, or a second event", |c| {
        pool_status(c).is_some_and(|s| s.unsupervised_pods.total == 0)
            || event_on(c, REASON_NOT_SUPERVISED, "root-app").is_some()
    })
    .await;
    let status = pool_status(&call).expect("no second NotSupervised Event");
    assert_eq!(condition(&status, "Degraded"), ("False".into(), "AsExpected".into()));
    replica.stop().await;
}

/// Supervisors scaled to zero: the instance's owner is gone and nobody can take it over
/// (InstanceUnplaceable), then its sidecar stops the workload at the recovery deadline and
/// reports it to another replica: the coordinator records SupervisorRecoveryFailed on the
/// Pod, once, naming the last owner and term.
pub async fn a_workload_stopped_at_its_recovery_deadline_is_reported_on_its_pod(db: &TestDb) {
    let (coordinator, mut calls) = coordinator_with_default_namespace(db, &["agent-0", "agent-1"]).await;
    let instance_token = pod_token("agent-0");
    // Another replica, a follower (its writer never acts), serves the sidecar's report.
    let listed = Shared::default();
    listed.with(|index| index.reset_namespaces(["default".to_owned()]));
    let (follower, _, _ignored) = replica_with(db, "gw-f", Scope::new(INSTALL), &listed).await;

    let member = attach_supervisor_0(&coordinator.endpoint()).await;
    next_call(
        &mut calls,
        "MemberJoined",
        |c| matches!(c, Call::Publish(n) if n.reason == REASON_MEMBER_JOINED),
    )
    .await;
    register(&coordinator.endpoint(), &instance_token, "agent-0")
        .await
        .unwrap();
    wait_assignments(&db.store, "agent-0 placed on supervisor-0", |a| {
        a.iter()
            .any(|a| a.route == "default/agent-0" && a.member == "supervisor-0" && a.term.get() == 1)
    })
    .await;

    // Scaled to zero.
    member.kill();
    drop(member);
    let call = next_call(&mut calls, "agent-0 unplaceable", |c| {
        event_on(c, REASON_UNPLACEABLE, "agent-0").is_some()
    })
    .await;
    let unplaceable = event_on(&call, REASON_UNPLACEABLE, "agent-0").unwrap();
    assert_eq!(
        unplaceable.note,
        "instance default/agent-0 cannot be placed: no live pool members"
    );

    // The sidecar's deadline passes: it stops the workload and reports it (to the follower).
    let report = || RecoveryFailedRequest {
        route: "default/agent-0".into(),
        instance: Some(instance_ref("agent-0", "uid-agent-0")),
        fence_term: 1,
        attempts: 3,
        recovery_deadline_ms: 60_000,
        reason: "no supervisor took the instance over before the deadline".into(),
        ..RecoveryFailedRequest::default()
    };
    let mut registry = InstanceRegistryClient::new(channel(&follower.endpoint()).await);
    registry
        .report_recovery_failed(with_token(report(), &instance_token))
        .await
        .unwrap();
    let call = next_call(
        &mut calls,
        "SupervisorRecoveryFailed on agent-0",
        |c| matches!(c, Call::Publish(n) if n.reason == REASON_SUPERVISOR_RECOVERY_FAILED),
    )
    .await;
    let Some(stopped) = event_on(&call, REASON_SUPERVISOR_RECOVERY_FAILED, "agent-0") else {
        panic!("on another object: {call:?}");
    };
    assert!(stopped.warning);
    assert_eq!(stopped.regarding.uid.as_deref(), Some("uid-agent-0"));
    // The PID (the member reported 4242) when the coordinator's view still held the dead
    // owner's last report of that term.
    let [named, unnamed] = ["the workload (PID 4242) was stopped", "the workload was stopped"].map(|what| {
        format!(
            "instance default/agent-0: {what} because no supervisor took it over before its recovery \
             deadline (last owner supervisor-0, term 1)"
        )
    });
    assert!(stopped.note == named || stopped.note == unnamed, "{}", stopped.note);
    assert_eq!(
        stopped
            .related
            .as_ref()
            .map(|r| (r.namespace.as_str(), r.name.as_str())),
        Some((INSTALL, "supervisor-0"))
    );
    let instance = db.store.instance("default/agent-0").await.unwrap().unwrap();
    assert!(instance.withdrawn);

    // A retried report (its answer lost) changes nothing and is recorded no second time:
    // by the time a later change is reported, no other SupervisorRecoveryFailed came.
    registry
        .report_recovery_failed(with_token(report(), &instance_token))
        .await
        .unwrap();
    // The follower answers from its own view, which may still hold the killed member for a
    // refresh (or miss a read under load): asked again (the same Pod: idempotent) until it
    // says why it cannot place the instance.
    let refused = wait_for("the follower refuses agent-1 as unplaceable", 1000, || async {
        register(&follower.endpoint(), &pod_token("agent-1"), "agent-1")
            .await
            .err()
            .filter(|s| s.code() == Code::ResourceExhausted)
    })
    .await;
    assert!(
        refused.message().contains("no pool member can take the instance"),
        "{refused:?}"
    );
    let mut between = Vec::new();
    next_call(&mut calls, "agent-1 unplaceable", |c| {
        between.push(c.clone());
        event_on(c, REASON_UNPLACEABLE, "agent-1").is_some()
    })
    .await;
    let repeated: Vec<&Call> = between
        .iter()
        .filter(|c| matches!(c, Call::Publish(n) if n.reason == REASON_SUPERVISOR_RECOVERY_FAILED))
        .collect();
    assert!(repeated.is_empty(), "recorded again: {repeated:?}");
    follower.stop().await;
    coordinator.stop().await;
}

/// A new Pod while no member is attached cannot be placed: an InstanceUnplaceable Event on it
/// says why (no members), once however often its sidecar retries; a member that joins takes
/// it.
pub async fn an_instance_registered_without_members_is_reported_unplaceable(db: &TestDb) {
    let (replica, mut calls) = coordinator_with_default_namespace(db, &["agent-0"]).await;
    let instance_token = pod_token("agent-0");

    let refused = register(&replica.endpoint(), &instance_token, "agent-0")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert!(refused.message().contains("no live pool members"), "{refused:?}");
    let call = next_call(
        &mut calls,
        "agent-0 unplaceable",
        |c| matches!(c, Call::Publish(n) if n.reason == REASON_UNPLACEABLE),
    )
    .await;
    let Some(unplaceable) = event_on(&call, REASON_UNPLACEABLE, "agent-0") else {
        panic!("on another object: {call:?}");
    };
    assert!(unplaceable.warning);
    assert_eq!(unplaceable.regarding.uid.as_deref(), Some("uid-agent-0"));
    assert_eq!(
        unplaceable.note,
        "instance default/agent-0 cannot be placed: no live pool members"
    );

    // The sidecar retries its registration: the same reason is not recorded again. A member
    // arrives: the instance is placed.
    register(&replica.endpoint(), &instance_token, "agent-0")
        .await
        .unwrap_err();
    let _member = attach_supervisor_0(&replica.endpoint()).await;
    let mut between = Vec::new();
    next_call(&mut calls, "MemberJoined", |c| {
        between.push(c.clone());
        matches!(c, Call::Publish(n) if n.reason == REASON_MEMBER_JOINED)
    })
    .await;
    let repeated: Vec<&Call> = between
        .iter()
        .filter(|c| matches!(c, Call::Publish(n) if n.reason == REASON_UNPLACEABLE))
        .collect();
    assert!(repeated.is_empty(), "recorded again: {repeated:?}");
    wait_assignments(&db.store, "agent-0 placed on supervisor-0", |a| {
        a.iter()
            .any(|a| a.route == "default/agent-0" && a.member == "supervisor-0")
    })
    .await;
    replica.stop().await;
}

/// The code a call was refused with (`None`: it succeeded).
fn code<T>(result: Result<T, tonic::Status>) -> Option<Code> {
    result.err().map(|s| s.code())
}

/// Tenancy in Kubernetes: who calls is what the TokenReview says (namespace, Pod name, Pod
/// UID), never the request. A Pod of namespace team-b cannot register, withdraw or report
/// for a Pod of `default`; a Pod of a namespace without the label takes no part; a member's
/// token is no instance's and an instance's no member's; a namespace's annotation sets its
/// quota.
pub async fn a_pod_acts_only_for_itself_within_its_namespace_quota(db: &TestDb) {
    let shared = Shared::default();
    shared.with(|index| index.reset_namespaces(["default".to_owned(), "team-b".to_owned()]));
    let (replica, _, _calls) = replica_with(db, "gw-k", Scope::new(INSTALL), &shared).await;
    // Registration answers with an instance token: the coordinator's first signing key.
    crate::cluster::Tokens::load(&db.store).await;
    let supervisor = supervisor_0();
    let _member = attach_supervisor_0(&replica.endpoint()).await;
    register(&replica.endpoint(), &pod_token("agent-0"), "agent-0")
        .await
        .unwrap();
    let victim = || async { db.store.instance("default/agent-0").await.unwrap().unwrap() };
    let before = victim().await;

    let mut registry = InstanceRegistryClient::new(channel(&replica.endpoint()).await);
    let intruder = pod_token_in("team-b", "default", "intruder");
    for claimed in ["team-b", "default"] {
        let answers = crate::tenancy::act_for_agent_0(&mut registry, &intruder, claimed).await;
        assert!(
            answers.iter().all(|(_, code)| *code == Some(Code::PermissionDenied)),
            "claiming {claimed}: {answers:?}"
        );
    }
    let after = victim().await;
    assert_eq!(
        (after.namespace, after.uid, after.generation, after.withdrawn),
        (before.namespace, before.uid, before.generation, before.withdrawn),
        "nothing changed"
    );

    // A namespace without the label takes no part, whatever its Pods' tokens say.
    let outside = with_token(
        crate::cluster::registration("team-c", "x", "uid-x"),
        &pod_token_in("team-c", "default", "x"),
    );
    assert_eq!(code(registry.register(outside).await), Some(Code::PermissionDenied));
    // A member's token is no instance's; an instance's is no member's; a token the API
    // server refuses is nobody's.
    let as_member = with_token(
        crate::cluster::registration(INSTALL, "supervisor-0", "uid-supervisor-0"),
        &member_token("supervisor-0"),
    );
    assert_eq!(code(registry.register(as_member).await), Some(Code::PermissionDenied));
    let refused = match Member::attach(
        &replica.endpoint(),
        &pod_token("agent-0"),
        Identity {
            member: "agent-0".into(),
            ..supervisor
        },
        Behaviour::Healthy,
    )
    .await
    {
        Ok(mut m) => m.wait_ended().await,
        Err(status) => status,
    };
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    let forged = with_token(
        crate::cluster::registration("default", "agent-1", "uid-agent-1"),
        "forged",
    );
    assert_eq!(code(registry.register(forged).await), Some(Code::Unauthenticated));

    // team-b's annotation allows one instance.
    shared.with(|index| index.set_limit("team-b", Some(1)));
    let web = |name: &str| {
        with_token(
            crate::cluster::registration("team-b", name, &format!("uid-{name}")),
            &pod_token_in("team-b", "default", name),
        )
    };
    registry.register(web("web-0")).await.unwrap();
    let over = registry.register(web("web-1")).await.unwrap_err();
    assert_eq!(over.code(), Code::ResourceExhausted);
    assert!(
        over.message()
            .contains("namespace team-b has 1 registered instances, its limit is 1"),
        "{over:?}"
    );
    assert!(db.store.instance("team-b/web-1").await.unwrap().is_none());
    replica.stop().await;
}

/// The `SupervisorPool` status the call applies, if it is one (of the install's pool object).
fn pool_status(call: &Call) -> Option<PoolStatus> {
    match call {
        Call::ApplyPoolStatus {
            namespace,
            name,
            status,
        } if namespace == INSTALL && name == POOL_NAME => Some((**status).clone()),
        _ => None,
    }
}

fn condition(status: &PoolStatus, type_: &str) -> (String, String) {
    let c = status.conditions.iter().find(|c| c.type_ == type_).unwrap();
    (c.status.clone(), c.reason.clone())
}

/// The `SupervisorPool` status comes from the coordinator only: not ready without members,
/// ready with the member and its active instance once they are there (and not written again
/// while nothing changes), and after a failover written by the next coordinator under its own
/// name and term, which the standby never wrote before.
pub async fn the_pool_status_is_kept_by_the_coordinator_alone(db: &TestDb) {
    let (first, mut calls) = coordinator_with_default_namespace(db, &["agent-0"]).await;
    let empty = next_call(&mut calls, "a pool status", |c| pool_status(c).is_some()).await;
    let empty = pool_status(&empty).unwrap();
    assert_eq!(empty.coordinator.as_ref().map(|c| c.replica.as_str()), Some("gw-k"));
    assert_eq!(condition(&empty, "CoordinatorElected").0, "True");
    assert_eq!(
        condition(&empty, "Ready"),
        ("False".into(), "NoMemberTakesInstances".into())
    );
    let shared = Shared::default();
    let (standby, _, mut standby_calls) = replica_with(db, "gw-standby", Scope::new(INSTALL), &shared).await;
    shared.with(|index| {
        index.reset_namespaces(["default".to_owned()]);
        index.reset_pods([Pod {
            namespace: "default".into(),
            name: "agent-0".into(),
            uid: "uid-agent-0".into(),
        }]);
    });

    let member = attach_supervisor_0(&first.endpoint()).await;
    register(&first.endpoint(), &pod_token("agent-0"), "agent-0")
        .await
        .unwrap();
    let placed = wait_assignments(&db.store, "agent-0 placed", |a| !a.is_empty()).await;
    crate::cluster::take_up(
        &first.endpoint(),
        &member_token("supervisor-0"),
        ("supervisor-0", "p1"),
        placed[0].term.get(),
    )
    .await;
    let mut between = Vec::new();
    let ready = next_call(&mut calls, "a ready pool with one active instance", |c| {
        let status = pool_status(c);
        if let Some(s) = &status {
            between.push(s.clone());
        }
        status.is_some_and(|s| s.ready_instances == "1/1" && condition(&s, "Ready").0 == "True")
    })
    .await;
    let ready = pool_status(&ready).unwrap();
    assert_eq!(ready.ready_members, "1/1");
    assert_eq!(
        (
            ready.members[0].name.as_str(),
            ready.members[0].state.as_str(),
            ready.members[0].instances
        ),
        ("supervisor-0", "active", 1)
    );
    assert_eq!(condition(&ready, "Degraded"), ("False".into(), "AsExpected".into()));
    for pair in between.windows(2) {
        assert_ne!(pair[0], pair[1], "the same status applied twice in a row");
    }
    // Only the coordinator writes it.
    while let Ok(call) = standby_calls.try_recv() {
        assert!(
            pool_status(&call).is_none(),
            "the standby wrote the pool status: {call:?}"
        );
    }

    // Failover: the standby coordinates and writes the status under its name and next term.
    let term = ready.coordinator.as_ref().unwrap().term;
    first.stop().await;
    let taken = next_call(&mut standby_calls, "the pool status from the next coordinator", |c| {
        pool_status(c).is_some()
    })
    .await;
    let taken = pool_status(&taken).unwrap();
    let coordinator = taken.coordinator.clone().unwrap();
    assert_eq!(coordinator.replica, "gw-standby");
    assert!(coordinator.term > term, "{} after {term}", coordinator.term);
    drop(member);
    standby.stop().await;
}

/// A member's snapshot carries the egress policy of each Pod it owns, resolved from the
/// watched `SandboxPolicy` objects: nothing before they were listed, deny-all without one,
/// the namespace's `default`, then each edit — without any change of ownership.
pub async fn each_owned_pod_carries_its_sandbox_policy_in_the_snapshots(db: &TestDb) {
    use gateway::kubernetes::egress::{Choice, DENY_ALL, policy_of};
    let shared = Shared::default();
    let (replica, _, mut calls) = replica_with(db, "gw-k", Scope::new(INSTALL), &shared).await;
    // Its first Secret is written once the coordinator has made its signing keys.
    next_call(&mut calls, "the supervisor Secret", |c| {
        applied(c, INSTALL, SUPERVISOR_SECRET).is_some()
    })
    .await;
    shared.with(|index| index.reset_namespaces(["default".to_owned()]));
    let mut member = attach_supervisor_0(&replica.endpoint()).await;
    register(&replica.endpoint(), &pod_token("agent-0"), "agent-0")
        .await
        .expect("the Pod's token is accepted");
    let pod = Pod {
        namespace: "default".into(),
        name: "agent-0".into(),
        uid: "uid-agent-0".into(),
    };
    shared.with(|index| index.reset_pods([pod]));
    let carried = |snapshot: &proto::host::v1::Snapshot| {
        snapshot
            .instances
            .iter()
            .find(|i| i.route == "default/agent-0")
            .map(|i| {
                i.egress_policy
                    .as_ref()
                    .map(|p| (p.name.clone(), p.revision, p.rules.len()))
            })
    };
    let first = member.wait_snapshot("agent-0 owned", |s| carried(s).is_some()).await;
    assert_eq!(carried(&first), Some(None), "nothing before the policies are listed");

    shared.with(|index| {
        index.egress_mut().reset_pods([Choice {
            uid: "uid-agent-0".into(),
            namespace: "default".into(),
            policy: None,
        }]);
        index.egress_mut().reset_policies([]);
    });
    member
        .wait_snapshot("deny-all", |s| carried(s) == Some(Some((DENY_ALL.to_owned(), 1, 0))))
        .await;

    let object = |generation: i64, hosts: &[&str]| {
        let rules: Vec<_> = hosts
            .iter()
            .map(|h| serde_json::json!({"name": "r", "host": h, "ports": [443]}))
            .collect();
        let object: kube::api::DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "supervision.openshell.ai/v1alpha1", "kind": "SandboxPolicy",
            "metadata": {"name": "default", "namespace": "default", "generation": generation,
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"rules": rules},
        }))
        .expect("an object");
        policy_of(&object).expect("a policy")
    };
    let (ns, policy) = object(1, &["api.example.com"]);
    let revision = policy.revision;
    shared.with(|index| index.egress_mut().apply_policy(ns, policy));
    member
        .wait_snapshot("the default policy", |s| {
            carried(s) == Some(Some(("default".to_owned(), revision, 1)))
        })
        .await;
    let (ns, edited) = object(2, &["api.example.com", "docs.example.com"]);
    let term_before: Vec<_> = db
        .store
        .list_assignments()
        .await
        .expect("assignments")
        .into_iter()
        .map(|a| (a.route, a.term))
        .collect();
    shared.with(|index| index.egress_mut().apply_policy(ns, edited));
    member
        .wait_snapshot("the edit", |s| {
            carried(s) == Some(Some(("default".to_owned(), revision + 1, 2)))
        })
        .await;
    let term_after: Vec<_> = db
        .store
        .list_assignments()
        .await
        .expect("assignments")
        .into_iter()
        .map(|a| (a.route, a.term))
        .collect();
    assert_eq!(term_before, term_after, "an edit changes no ownership");

    // The policy's status: the Pod counted, then its sidecar's answer (relayed by the owner
    // in its status report) shown as the current revision loaded.
    let status_of = |c: &Call| match c {
        Call::ApplyPolicyStatus {
            namespace,
            name,
            status,
        } if namespace == "default" && name == "default" => Some(status.clone()),
        _ => None,
    };
    let current = i64::try_from(revision + 1).expect("fits");
    next_call(&mut calls, "the policy's status with its Pod", |c| {
        status_of(c).is_some_and(|s| s.revision == current && s.pods == 1 && s.loaded == 0)
    })
    .await;
    let snapshot = member.wait_snapshot("the edit", |s| carried(s).is_some()).await;
    let owned = snapshot
        .instances
        .iter()
        .find(|i| i.route == "default/agent-0")
        .expect("owned");
    let answer = |error: &str| proto::host::v1::InstanceStatus {
        route: owned.route.clone(),
        instance: owned.instance.clone(),
        term: owned.term,
        phase: proto::common::v1::InstancePhase::Active as i32,
        egress_policy: Some(proto::runtime::v1::PolicyLoaded {
            term: owned.term,
            name: "default".into(),
            revision: revision + 1,
            error: error.into(),
        }),
        ..Default::default()
    };
    let report = |error: &str| {
        MemberKind::StatusReport(proto::host::v1::StatusReport {
            instances: vec![answer(error)],
            applied_revision: snapshot.revision,
            partial: false,
        })
    };
    member.send(report("")).await;
    next_call(&mut calls, "the revision shown loaded", |c| {
        status_of(c).is_some_and(|s| s.loaded == 1 && s.failed == 0 && s.revisions.len() == 1)
    })
    .await;
    member.send(report("the sidecar's state directory is full")).await;
    let refused = next_call(&mut calls, "the refusal shown", |c| {
        status_of(c).is_some_and(|s| s.failed == 1)
    })
    .await;
    let refused = status_of(&refused).expect("matched");
    assert_eq!(refused.failures[0].pod, "agent-0");
    assert_eq!(refused.failures[0].reason, "the sidecar's state directory is full");
    replica.stop().await;
}

/// Denials a sidecar's owner stores in the audit trail, through any replica, come back as
/// `EgressDenied` Warning Events on the Pod from the coordinator, one per destination, and a
/// repeat of the same denial publishes the same note again (one Event series).
pub async fn egress_denials_become_warning_events_on_the_pod(db: &TestDb) {
    use gateway::kubernetes::denials::REASON_EGRESS_DENIED;
    use gateway::store::AssignmentPhase;
    use proto::host::v1::supervisor_host_client::SupervisorHostClient;
    use proto::runtime::v1::AuditRecord;

    use crate::cluster::take_up;

    let (coordinator, mut calls) = coordinator_with_default_namespace(db, &["agent-0"]).await;
    let listed = Shared::default();
    listed.with(|index| index.reset_namespaces(["default".to_owned()]));
    let (follower, _, _ignored) = replica_with(db, "gw-f", Scope::new(INSTALL), &listed).await;
    let _member = attach_supervisor_0(&coordinator.endpoint()).await;
    register(&coordinator.endpoint(), &pod_token("agent-0"), "agent-0")
        .await
        .unwrap();
    let term = wait_assignments(&db.store, "agent-0 placed on supervisor-0", |a| {
        a.iter()
            .any(|a| a.route == "default/agent-0" && a.member == "supervisor-0")
    })
    .await
    .into_iter()
    .find(|a| a.route == "default/agent-0")
    .map(|a| a.term.get())
    .unwrap();
    take_up(
        &coordinator.endpoint(),
        &member_token("supervisor-0"),
        ("supervisor-0", "p1"),
        term,
    )
    .await;
    wait_assignments(&db.store, "agent-0 active", |a| {
        a.iter()
            .any(|a| a.route == "default/agent-0" && a.phase == AssignmentPhase::Active)
    })
    .await;

    let mut host = SupervisorHostClient::new(channel(&follower.endpoint()).await);
    let mut sequence = 0;
    let mut deliver = |decisions: &[(&str, &str)]| {
        let records = decisions
            .iter()
            .map(|(decision, destination)| {
                sequence += 1;
                AuditRecord {
                    sequence,
                    decision: (*decision).into(),
                    destination: (*destination).into(),
                    policy: "default".into(),
                    revision: 2,
                    reason: format!("no rule allows {destination}"),
                    ..AuditRecord::default()
                }
            })
            .collect();
        proto::host::v1::RecordAuditRequest {
            route: "default/agent-0".into(),
            member: "supervisor-0".into(),
            term,
            records,
            dropped: 0,
        }
    };
    let first = deliver(&[
        ("deny", "evil.example:443"),
        ("allow", "api.example.com:443"),
        ("deny", "evil.example:443"),
    ]);
    host.record_audit(with_token(first, &member_token("supervisor-0")))
        .await
        .unwrap();
    let call = next_call(&mut calls, "EgressDenied on agent-0", |c| {
        event_on(c, REASON_EGRESS_DENIED, "agent-0").is_some()
    })
    .await;
    let denied = event_on(&call, REASON_EGRESS_DENIED, "agent-0").unwrap().clone();
    assert!(denied.warning);
    assert_eq!(denied.regarding.uid.as_deref(), Some("uid-agent-0"));
    assert_eq!(
        denied.note,
        "egress to evil.example:443 denied: no rule allows evil.example:443 (SandboxPolicy default \
         revision 2); `poolctl audit default/agent-0` lists every attempt"
    );

    // Denied again later: the same note, so the recorder makes it one series.
    let again = deliver(&[("deny", "evil.example:443")]);
    host.record_audit(with_token(again, &member_token("supervisor-0")))
        .await
        .unwrap();
    let call = next_call(&mut calls, "EgressDenied on agent-0 again", |c| {
        event_on(c, REASON_EGRESS_DENIED, "agent-0").is_some()
    })
    .await;
    assert_eq!(event_on(&call, REASON_EGRESS_DENIED, "agent-0"), Some(&denied));
    follower.stop().await;
    coordinator.stop().await;
}
