//! Tenancy: a credential acts only for whom it was issued to. An instance's credential
//! registers, withdraws and reports only its own route and workload; a namespace's
//! registrations stop at its quota, storing nothing beyond it. (Members acting only for
//! themselves: `scenarios::streams_without_a_valid_token_or_identity_are_refused` and
//! `scenarios::grants_are_single_use_and_activation_checks_receipt_and_process`.)

use proto::registry::v1::instance_registry_client::InstanceRegistryClient;
use proto::registry::v1::{DeregisterRequest, RecoveryFailedRequest, RegisterRequest};
use tonic::Code;

use crate::cluster::{
    Behaviour, Member, Replica, Tokens, attach_live, channel, instance_ref, registration, start_replica_with,
    with_token,
};
use crate::support::TestDb;

async fn replica(db: &TestDb, extra: &[&str]) -> (Replica, Tokens, Member) {
    let replica = start_replica_with("gw-t", &db.url, extra, None).await;
    let tokens = Tokens::load(&db.store).await;
    let member = attach_live(
        db,
        &replica.endpoint(),
        &tokens.member("m-a"),
        "m-a",
        Behaviour::Healthy,
    )
    .await;
    (replica, tokens, member)
}

/// With `token`, register `default/agent-0` anew (another Pod UID), withdraw it and report
/// its recovery failed, each naming `claimed` as the instance's namespace: what each answered.
pub async fn act_for_agent_0(
    registry: &mut InstanceRegistryClient<tonic::transport::Channel>,
    token: &str,
    claimed: &str,
) -> Vec<(&'static str, Option<Code>)> {
    let claim = |uid: &str| proto::common::v1::InstanceRef {
        namespace: claimed.into(),
        ..instance_ref("agent-0", uid)
    };
    let hijack = RegisterRequest {
        instance: Some(claim("uid-evil")),
        ..registration("default", "agent-0", "uid-evil")
    };
    let withdraw = DeregisterRequest {
        route: "default/agent-0".into(),
        instance: Some(claim("uid-agent-0")),
        reason: "attack".into(),
    };
    let report = RecoveryFailedRequest {
        route: "default/agent-0".into(),
        instance: Some(claim("uid-agent-0")),
        fence_term: 1,
        reason: "attack".into(),
        ..RecoveryFailedRequest::default()
    };
    vec![
        ("Register", denied(registry.register(with_token(hijack, token)).await)),
        (
            "Deregister",
            denied(registry.deregister(with_token(withdraw, token)).await),
        ),
        (
            "ReportRecoveryFailed",
            denied(registry.report_recovery_failed(with_token(report, token)).await),
        ),
    ]
}

/// The code a call was refused with (`None`: it succeeded).
fn denied<T>(result: Result<T, tonic::Status>) -> Option<Code> {
    result.err().map(|s| s.code())
}

async fn registry(replica: &Replica) -> InstanceRegistryClient<tonic::transport::Channel> {
    InstanceRegistryClient::new(channel(&replica.endpoint()).await)
}

/// What the store holds for `default/agent-0`: (namespace, uid, generation, withdrawn).
async fn victim(db: &TestDb) -> (String, String, i64, bool) {
    let i = db.store.instance("default/agent-0").await.unwrap().expect("registered");
    (i.namespace, i.uid, i.generation, i.withdrawn)
}

pub async fn instance_credentials_act_only_on_their_own_route_and_workload(db: &TestDb) {
    let (replica, tokens, _member) = replica(db, &[]).await;
    let mut registry = registry(&replica).await;
    let victim_token = tokens.instance("agent-0");
    let registered = registry
        .register(with_token(
            registration("default", "agent-0", "uid-agent-0"),
            &victim_token,
        ))
        .await
        .unwrap()
        .into_inner();
    let before = victim(db).await;
    assert_eq!(before, ("default".into(), "uid-agent-0".into(), 1, false));

    let intruder = tokens.instance_in("team-b", "intruder");
    let neighbour = tokens.instance("agent-1");
    for token in [&intruder, &neighbour] {
        for claimed in ["team-b", "default"] {
            let answers = act_for_agent_0(&mut registry, token, claimed).await;
            assert!(
                answers.iter().all(|(_, code)| *code == Some(Code::PermissionDenied)),
                "claiming {claimed}: {answers:?}"
            );
        }
    }
    assert_eq!(victim(db).await, before, "nothing changed");

    // The token a registration issues is bound to the Pod UID too: a recreated Pod (another
    // UID) cannot use it, and neither can it act for another route.
    let bound = registered.instance_token;
    assert!(!bound.is_empty());
    assert_eq!(
        denied(
            registry
                .register(with_token(
                    registration("default", "agent-0", "uid-agent-0-new"),
                    &bound
                ))
                .await
        ),
        Some(Code::PermissionDenied)
    );
    let withdraw_other_uid = DeregisterRequest {
        route: "default/agent-0".into(),
        instance: Some(instance_ref("agent-0", "uid-other")),
        reason: "stale".into(),
    };
    assert_eq!(
        denied(registry.deregister(with_token(withdraw_other_uid, &bound)).await),
        Some(Code::PermissionDenied)
    );
    assert_eq!(victim(db).await, before, "nothing changed");

    // Its own workload's calls go through, with either credential.
    registry
        .register(with_token(registration("default", "agent-0", "uid-agent-0"), &bound))
        .await
        .expect("registering again with the issued token");
    let own = DeregisterRequest {
        route: "default/agent-0".into(),
        instance: Some(instance_ref("agent-0", "uid-agent-0")),
        reason: "workload exited".into(),
    };
    registry.deregister(with_token(own, &victim_token)).await.unwrap();
    assert!(victim(db).await.3, "withdrawn by its own sidecar");
    replica.stop().await;
}

pub async fn a_namespace_quota_refuses_beyond_its_limit_and_stores_nothing(db: &TestDb) {
    let (replica, tokens, _member) = replica(db, &["--namespace-instance-limit", "3"]).await;
    let mut registry = registry(&replica).await;
    let client = registry.clone();
    let register = |name: &str| {
        let request = with_token(
            registration("default", name, &format!("uid-{name}")),
            &tokens.instance(name),
        );
        let mut registry = client.clone();
        async move { registry.register(request).await }
    };
    for name in ["agent-0", "agent-1", "agent-2"] {
        register(name).await.unwrap();
    }
    let refused = register("agent-3").await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert!(
        refused
            .message()
            .contains("namespace default has 3 registered instances, its limit is 3"),
        "the real numbers: {}",
        refused.message()
    );
    assert!(
        db.store.instance("default/agent-3").await.unwrap().is_none(),
        "nothing stored"
    );
    // The same workloads registering again (sidecar restarts) are never refused, and another
    // namespace is not affected.
    register("agent-0").await.unwrap();
    let elsewhere = with_token(
        registration("team-b", "web-0", "uid-web-0"),
        &tokens.instance_in("team-b", "web-0"),
    );
    registry.register(elsewhere).await.unwrap();
    // A withdrawn instance frees its place.
    let own = DeregisterRequest {
        route: "default/agent-0".into(),
        instance: Some(instance_ref("agent-0", "uid-agent-0")),
        reason: "workload exited".into(),
    };
    registry
        .deregister(with_token(own, &tokens.instance("agent-0")))
        .await
        .unwrap();
    register("agent-3").await.unwrap();
    replica.stop().await;
}

/// A sidecar's claims about where its instance stands (its generation, its fence, its
/// workload) are bounded and shaped as the contract says: one far out of range, or a digest
/// that is not 32 bytes, is refused and stores nothing; within range they resume its route
/// only — the generation it names, no term at or below its fence.
pub async fn claims_of_where_an_instance_stands_are_bounded(db: &TestDb) {
    let (replica, tokens, _member) = replica(db, &[]).await;
    let mut registry = registry(&replica).await;
    let token = tokens.instance("agent-0");
    let claimed = |generation: u64, fence_term: u64, digest: usize| RegisterRequest {
        instance: Some(proto::common::v1::InstanceRef {
            generation,
            ..instance_ref("agent-0", "uid-agent-0")
        }),
        fence_term,
        workload: Some(proto::common::v1::WorkloadIdentity {
            pid: 42,
            start_time_ticks: 4242,
            exe_digest: vec![1; digest],
        }),
        ..registration("default", "agent-0", "uid-agent-0")
    };
    for (request, what) in [
        (claimed(1, i64::MAX as u64, 32), "a fence at the end of the range"),
        (claimed(i64::MAX as u64, 3, 32), "a generation at the end of the range"),
        (claimed(2, 3, 4096), "a 4 KiB digest"),
    ] {
        let refused = registry.register(with_token(request, &token)).await.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument, "{what}: {refused}");
    }
    assert!(
        db.store.instance("default/agent-0").await.unwrap().is_none(),
        "nothing stored"
    );
    let answered = registry
        .register(with_token(claimed(2, 3, 32), &token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answered.instance.map(|i| i.generation), Some(2));
    let stored = db.store.instance("default/agent-0").await.unwrap().expect("registered");
    // The fence is the route's last term; a placement may already have reserved above it.
    assert_eq!(stored.generation, 2);
    assert!(
        stored.last_term.get() >= 3,
        "last term {} below the fence",
        stored.last_term
    );
}
