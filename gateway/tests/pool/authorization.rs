//! The authorization matrix: every RPC the gateway serves (each row of
//! `proto/AUTHORIZATION.md` but the members' runtime service), tried with every kind of
//! caller — none, garbage, expired, another namespace's instance, another instance of the same
//! namespace, another member, an operator without the role — is refused with
//! UNAUTHENTICATED or PERMISSION_DENIED and changes nothing; the right caller gets through
//! authorization (its answer is whatever the call's own checks say). And every call that
//! names another party, made with the value another caller can read (the route directory of
//! its snapshot, the pool status, a registration's answer), is refused and changes nothing:
//! decisions are bound to what the store or the credential recorded, never to an identifier
//! the request carries.

use std::collections::BTreeMap;

use proto::pool::v1::supervisor_pool_client::SupervisorPoolClient;
use proto::pool::v1::{
    CancelSupervisorPoolOperationRequest, GetSupervisorPoolStatusRequest, OperationKind,
    StartSupervisorPoolOperationRequest, WatchSupervisorPoolRequest,
};
use proto::recovery::v1::supervisor_recovery_client::SupervisorRecoveryClient;
use proto::recovery::v1::{ActivateRequest, IssueGrantRequest, IssueGrantResponse, TrustBundleRequest};
use proto::registry::v1::instance_registry_client::InstanceRegistryClient;
use proto::registry::v1::{DeregisterRequest, RecoveryFailedRequest};
use tonic::Code;
use tonic::transport::Channel;

use crate::cluster::{
    Behaviour, Member, Tokens, attach_live, channel, identity, instance_ref, receipt, registration, start_replica_with,
    wait_assignments, with_token,
};
use crate::support::{TestDb, wait_for};
use proto::common::v1::{InstancePhase, RouteDirectoryEntry};
use proto::host::v1::member_message::Kind as MemberKind;
use proto::host::v1::{InstanceStatus, StatusReport};

const INVENTORY: &str = include_str!("../../../proto/AUTHORIZATION.md");

/// Who calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Caller {
    Nobody,
    Garbage,
    ExpiredMember,
    ExpiredInstance,
    OtherNamespace,
    OtherInstance,
    OtherMember,
    OperatorWithoutRole,
    Operator,
    /// m-a, the owner of agent-0.
    Member,
    /// default/agent-0 itself.
    Instance,
}

const CALLERS: [Caller; 11] = [
    Caller::Nobody,
    Caller::Garbage,
    Caller::ExpiredMember,
    Caller::ExpiredInstance,
    Caller::OtherNamespace,
    Caller::OtherInstance,
    Caller::OtherMember,
    Caller::OperatorWithoutRole,
    Caller::Operator,
    Caller::Member,
    Caller::Instance,
];

fn token(tokens: &Tokens, caller: Caller) -> Option<String> {
    Some(match caller {
        Caller::Nobody => return None,
        Caller::Garbage => "not-a-token".into(),
        Caller::ExpiredMember => tokens.expired_member("m-a"),
        Caller::ExpiredInstance => tokens.expired_instance("agent-0"),
        Caller::OtherNamespace => tokens.instance_in("team-b", "agent-0"),
        Caller::OtherInstance => tokens.instance("agent-1"),
        Caller::OtherMember => tokens.member("m-b"),
        Caller::OperatorWithoutRole => tokens.operator(&["viewer"]),
        Caller::Operator => tokens.operator(&["platform_admin"]),
        Caller::Member => tokens.member("m-a"),
        Caller::Instance => tokens.instance("agent-0"),
    })
}

fn request<T>(message: T, token: Option<&str>) -> tonic::Request<T> {
    match token {
        Some(token) => with_token(message, token),
        None => tonic::Request::new(message),
    }
}

/// Which callers each gateway RPC lets through authorization.
fn allowed(method: &str) -> &'static [Caller] {
    match method {
        "Attach" | "IssueGrant" | "Activate" | "RecordAudit" => &[Caller::Member],
        "TrustBundle" => &[
            Caller::Member,
            Caller::Instance,
            Caller::OtherMember,
            Caller::OtherNamespace,
            Caller::OtherInstance,
        ],
        "Register" | "Deregister" | "ReportRecoveryFailed" => &[Caller::Instance],
        "GetSupervisorPoolStatus"
        | "StartSupervisorPoolOperation"
        | "CancelSupervisorPoolOperation"
        | "WatchSupervisorPool"
        | "ListAudit" => &[Caller::Operator],
        other => panic!("no matrix entry for {other}: add one"),
    }
}

/// The call's status code (Ok when it succeeded).
fn code<T>(result: Result<T, tonic::Status>) -> Code {
    result.err().map_or(Code::Ok, |s| s.code())
}

/// One call of `method` as `caller`: its status code (Ok when it succeeded). `grant` is the
/// one m-a got for agent-0's reserved term.
async fn call(method: &str, endpoint: &str, channel: Channel, token: Option<&str>, grant: &IssueGrantResponse) -> Code {
    match method {
        "Attach" => {
            // m-a again, a newer connection epoch of its process.
            match Member::attach(
                endpoint,
                token.unwrap_or(""),
                identity("m-a", "m-a-p1", 2, 256),
                Behaviour::Healthy,
            )
            .await
            {
                Ok(mut member) => {
                    let ended = tokio::time::timeout(std::time::Duration::from_millis(500), member.wait_ended()).await;
                    member.kill();
                    ended.map_or(Code::Ok, |s| s.code())
                }
                Err(status) => status.code(),
            }
        }
        "IssueGrant" => {
            let ask = IssueGrantRequest {
                route: "default/agent-0".into(),
                term: 1,
                member: "m-a".into(),
                process_id: "m-a-p1".into(),
            };
            code(
                SupervisorRecoveryClient::new(channel)
                    .issue_grant(request(ask, token))
                    .await,
            )
        }
        "Activate" => {
            // m-a's real grant with the sidecar's real receipt: only m-a may complete it.
            let activate = ActivateRequest {
                receipt: Some(receipt(grant, 1, 0, 4242)),
                grant: grant.grant.clone(),
            };
            code(
                SupervisorRecoveryClient::new(channel)
                    .activate(request(activate, token))
                    .await,
            )
        }
        "TrustBundle" => code(
            SupervisorRecoveryClient::new(channel)
                .trust_bundle(request(TrustBundleRequest {}, token))
                .await,
        ),
        "Register" => {
            let register = registration("default", "agent-0", "uid-agent-0");
            code(
                InstanceRegistryClient::new(channel)
                    .register(request(register, token))
                    .await,
            )
        }
        "Deregister" => {
            // A reason that names another workload's UID: a no-op even for the right caller.
            let withdraw = DeregisterRequest {
                route: "default/agent-0".into(),
                instance: Some(instance_ref("agent-0", "uid-older-pod")),
                reason: "matrix".into(),
            };
            code(
                InstanceRegistryClient::new(channel)
                    .deregister(request(withdraw, token))
                    .await,
            )
        }
        "ReportRecoveryFailed" => {
            let report = RecoveryFailedRequest {
                route: "default/agent-0".into(),
                instance: Some(instance_ref("agent-0", "uid-older-pod")),
                fence_term: 1,
                reason: "matrix".into(),
                ..RecoveryFailedRequest::default()
            };
            code(
                InstanceRegistryClient::new(channel)
                    .report_recovery_failed(request(report, token))
                    .await,
            )
        }
        "RecordAudit" => {
            // agent-0 is only reserved for m-a: refused by the store even for m-a, so the
            // matrix stores nothing.
            let records = proto::host::v1::RecordAuditRequest {
                route: "default/agent-0".into(),
                member: "m-a".into(),
                term: 1,
                records: vec![proto::runtime::v1::AuditRecord {
                    sequence: 1,
                    decision: "deny".into(),
                    ..Default::default()
                }],
                dropped: 0,
            };
            code(
                proto::host::v1::supervisor_host_client::SupervisorHostClient::new(channel)
                    .record_audit(request(records, token))
                    .await,
            )
        }
        "ListAudit" => {
            let list = proto::pool::v1::ListAuditRequest {
                namespace: "default".into(),
                name: "agent-0".into(),
                ..Default::default()
            };
            code(
                SupervisorPoolClient::new(channel)
                    .list_audit(request(list, token))
                    .await,
            )
        }
        "GetSupervisorPoolStatus" => code(
            SupervisorPoolClient::new(channel)
                .get_supervisor_pool_status(request(GetSupervisorPoolStatusRequest {}, token))
                .await,
        ),
        "WatchSupervisorPool" => code(
            SupervisorPoolClient::new(channel)
                .watch_supervisor_pool(request(WatchSupervisorPoolRequest {}, token))
                .await,
        ),
        "StartSupervisorPoolOperation" => {
            // A drain of a member that does not exist: refused by its own checks even for the
            // right caller, so the matrix changes nothing.
            let start = StartSupervisorPoolOperationRequest {
                kind: OperationKind::Drain as i32,
                target: "no-such-member".into(),
                max_parallel: 1,
                timeout_ms: 0,
                dry_run: false,
            };
            code(
                SupervisorPoolClient::new(channel)
                    .start_supervisor_pool_operation(request(start, token))
                    .await,
            )
        }
        "CancelSupervisorPoolOperation" => {
            let cancel = CancelSupervisorPoolOperationRequest {
                id: "no-such-operation".into(),
            };
            code(
                SupervisorPoolClient::new(channel)
                    .cancel_supervisor_pool_operation(request(cancel, token))
                    .await,
            )
        }
        other => panic!("no call for {other}"),
    }
}

/// The gateway's RPCs, from the inventory (the members' runtime service is tested in the
/// supervisor crate).
fn gateway_methods() -> Vec<String> {
    INVENTORY
        .lines()
        .filter(|l| l.starts_with("| openshell.") && !l.contains(".runtime.v1."))
        .filter_map(|l| l.split('|').nth(2).map(|m| m.trim().to_owned()))
        .collect()
}

pub async fn every_rpc_refuses_every_caller_but_the_right_one(db: &TestDb) {
    let replica = start_replica_with("gw-m", &db.url, &[], None).await;
    let endpoint = replica.endpoint();
    let tokens = Tokens::load(&db.store).await;
    let owner = attach_live(db, &endpoint, &tokens.member("m-a"), "m-a", Behaviour::Mute).await;
    let mut registry = InstanceRegistryClient::new(channel(&endpoint).await);
    registry
        .register(with_token(
            registration("default", "agent-0", "uid-agent-0"),
            &tokens.instance("agent-0"),
        ))
        .await
        .unwrap();
    let before = db.store.instance("default/agent-0").await.unwrap().unwrap();
    wait_assignments(&db.store, "agent-0 reserved for m-a", |a| {
        a.iter().any(|a| a.route == "default/agent-0" && a.member == "m-a")
    })
    .await;
    let wrong = with_what_others_read(db, &endpoint, &tokens, &owner).await;
    assert!(
        wrong.is_empty(),
        "taken with what another caller reads:\n{}",
        wrong.join("\n")
    );
    // Nothing they tried consumed anything: the term's single grant is still m-a's to take.
    let ask = IssueGrantRequest {
        route: "default/agent-0".into(),
        term: 1,
        member: "m-a".into(),
        process_id: "m-a-p1".into(),
    };
    let grant = SupervisorRecoveryClient::new(channel(&endpoint).await)
        .issue_grant(with_token(ask, &tokens.member("m-a")))
        .await
        .unwrap()
        .into_inner();

    let methods = gateway_methods();
    assert_eq!(methods.len(), 13, "the gateway's RPCs in the inventory: {methods:?}");
    let mut matrix: BTreeMap<(String, Caller), Code> = BTreeMap::new();
    for method in &methods {
        for caller in CALLERS {
            let token = token(&tokens, caller);
            let got = call(method, &endpoint, channel(&endpoint).await, token.as_deref(), &grant).await;
            matrix.insert((method.clone(), caller), got);
        }
    }
    let mut wrong = Vec::new();
    for ((method, caller), code) in &matrix {
        let through = allowed(method).contains(caller);
        let refused = matches!(code, Code::Unauthenticated | Code::PermissionDenied);
        let expected = match caller {
            Caller::Nobody | Caller::Garbage | Caller::ExpiredMember | Caller::ExpiredInstance => {
                *code == Code::Unauthenticated
            }
            _ if through => !refused,
            _ => refused,
        };
        if !expected {
            wrong.push(format!("{method} as {caller:?}: {code:?}"));
        }
    }
    assert!(wrong.is_empty(), "unexpected answers:\n{}", wrong.join("\n"));
    // The same-kind credential of someone else is PERMISSION_DENIED, not merely unknown.
    for (method, caller) in [
        ("Register", Caller::OtherNamespace),
        ("Deregister", Caller::OtherNamespace),
        ("ReportRecoveryFailed", Caller::OtherInstance),
        ("Attach", Caller::OtherMember),
        ("IssueGrant", Caller::OtherMember),
        ("Activate", Caller::OtherMember),
        ("GetSupervisorPoolStatus", Caller::OperatorWithoutRole),
        ("RecordAudit", Caller::OtherMember),
        ("ListAudit", Caller::OperatorWithoutRole),
    ] {
        assert_eq!(
            matrix[&(method.to_owned(), caller)],
            Code::PermissionDenied,
            "{method} as {caller:?}"
        );
    }

    // Nothing changed: the instance is as registered, no operation was recorded.
    let after = db.store.instance("default/agent-0").await.unwrap().unwrap();
    assert_eq!(
        (after.uid, after.generation, after.withdrawn, after.namespace),
        (before.uid, before.generation, before.withdrawn, before.namespace)
    );
    assert!(db.store.list_operations().await.unwrap().is_empty());
    replica.stop().await;
}

/// m-b, a member of the pool, and default/agent-1, an instance of the same namespace, try
/// every call that names another party with what they can read of agent-0 and its owner m-a:
/// m-b's route directory names agent-0's route, owner, owner process and term; the pool
/// status and Events name its Pod UID. Each must be refused and change nothing (the list of
/// what was not).
async fn with_what_others_read(db: &TestDb, endpoint: &str, tokens: &Tokens, owner: &Member) -> Vec<String> {
    let mut wrong = Vec::new();
    // m-b attaches after agent-0 was reserved for m-a (placement is stable) and reads it.
    let mut other = attach_live(db, endpoint, &tokens.member("m-b"), "m-b", Behaviour::Mute).await;
    let snapshot = other
        .wait_snapshot("agent-0 in m-b's directory", |s| {
            s.directory.iter().any(|d| d.route == "default/agent-0")
        })
        .await;
    let read: RouteDirectoryEntry = snapshot
        .directory
        .iter()
        .find(|d| d.route == "default/agent-0")
        .cloned()
        .unwrap();
    assert_eq!((read.member.as_str(), read.process_id.as_str()), ("m-a", "m-a-p1"));
    let before = db.store.list_assignments().await.unwrap();
    let mut expect = |what: &str, got: Code, want: &[Code]| {
        if !want.contains(&got) {
            wrong.push(format!("{what}: {got:?}, wanted one of {want:?}"));
        }
    };
    let mut recovery = SupervisorRecoveryClient::new(channel(endpoint).await);
    let as_m_b = |message| with_token(message, &tokens.member("m-b"));

    // IssueGrant: m-b in its own name with m-a's process and term, then in m-a's name.
    let own_name = IssueGrantRequest {
        route: read.route.clone(),
        term: read.term,
        member: "m-b".into(),
        process_id: read.process_id.clone(),
    };
    expect(
        "IssueGrant as m-b naming m-a's process (directory)",
        code(recovery.issue_grant(as_m_b(own_name.clone())).await),
        &[Code::PermissionDenied],
    );
    let their_name = IssueGrantRequest {
        member: read.member.clone(),
        ..own_name
    };
    expect(
        "IssueGrant as m-b naming m-a (directory)",
        code(recovery.issue_grant(as_m_b(their_name)).await),
        &[Code::PermissionDenied],
    );

    // Attach: m-a's name with m-a's token but a process of its own (a stranger holding the
    // token) must not end m-a's live stream; m-b's token with m-a's name is refused.
    for (who, token) in [("m-a", tokens.member("m-a")), ("m-b", tokens.member("m-b"))] {
        let got = match Member::attach(endpoint, &token, identity("m-a", "intruder", 1, 256), Behaviour::Mute).await {
            Ok(mut stranger) => {
                let ended = tokio::time::timeout(std::time::Duration::from_millis(500), stranger.wait_ended()).await;
                stranger.kill();
                ended.map_or(Code::Ok, |s| s.code())
            }
            Err(status) => status.code(),
        };
        let want: &[Code] = if who == "m-a" {
            &[Code::FailedPrecondition]
        } else {
            &[Code::PermissionDenied]
        };
        expect(&format!("Attach as m-a, new process, with {who}'s token"), got, want);
    }

    // A StatusReport on m-b's own stream about agent-0 at its term (directory): not
    // attributed, so nothing is recorded and agent-0 does not move.
    let failed = InstanceStatus {
        route: read.route.clone(),
        term: read.term,
        phase: InstancePhase::Failed as i32,
        ..InstanceStatus::default()
    };
    for partial in [true, false] {
        other
            .send(MemberKind::StatusReport(StatusReport {
                instances: vec![failed.clone()],
                applied_revision: snapshot.revision,
                partial,
            }))
            .await;
    }

    // The registry: agent-1's credential with agent-0's route and Pod UID (the pool status).
    let mut registry = InstanceRegistryClient::new(channel(endpoint).await);
    let agent_1 = tokens.instance("agent-1");
    let agent_0 = instance_ref("agent-0", "uid-agent-0");
    let withdraw = DeregisterRequest {
        route: read.route.clone(),
        instance: Some(agent_0.clone()),
        reason: "what others read".into(),
    };
    expect(
        "Deregister as agent-1 naming agent-0's route and UID",
        code(registry.deregister(with_token(withdraw, &agent_1)).await),
        &[Code::PermissionDenied],
    );
    let report = RecoveryFailedRequest {
        route: read.route.clone(),
        instance: Some(agent_0.clone()),
        fence_term: read.term,
        reason: "what others read".into(),
        ..RecoveryFailedRequest::default()
    };
    expect(
        "ReportRecoveryFailed as agent-1 naming agent-0's route, UID and term",
        code(registry.report_recovery_failed(with_token(report, &agent_1)).await),
        &[Code::PermissionDenied],
    );
    let register = registration("default", "agent-0", "uid-agent-0");
    expect(
        "Register as agent-1 naming agent-0's route and UID",
        code(registry.register(with_token(register, &agent_1)).await),
        &[Code::PermissionDenied],
    );

    // Give the reports and any move time to land, then: nothing changed.
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    if owner.ended.borrow().is_some() {
        wrong.push(format!("m-a's live stream ended: {:?}", owner.ended.borrow()));
    }
    let (now, record) = db.store.member("m-a").await.unwrap();
    if !record
        .as_ref()
        .is_some_and(|r| r.process_id == "m-a-p1" && r.is_live(now))
    {
        wrong.push(format!("m-a's membership record changed: {record:?}"));
    }
    let after = db.store.list_assignments().await.unwrap();
    if after != before {
        wrong.push(format!("assignments changed: {before:?} -> {after:?}"));
    }
    let reports = db.store.list_reports().await.unwrap();
    if reports.iter().any(|r| r.member == "m-b") {
        wrong.push(format!("m-b's report about agent-0 was recorded: {reports:?}"));
    }
    let instance = db.store.instance("default/agent-0").await.unwrap().unwrap();
    if instance.withdrawn {
        wrong.push("agent-0 was withdrawn".into());
    }
    other.kill();
    wait_for("m-b's membership gone", 2000, || async {
        let (now, members) = db.store.list_members().await.ok()?;
        (!members.iter().any(|m| m.member == "m-b" && m.is_live(now))).then_some(())
    })
    .await;
    wrong
}
