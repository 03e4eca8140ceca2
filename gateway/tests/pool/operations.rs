//! Drain and rebalance through the operator API of a real replica: requests are recorded
//! (idempotently) by the replica that serves them, the coordinator moves the instances at
//! term + 1 and finishes the operation; cancelling a succeeded drain returns the member.

use clap::Parser;
use gateway::poolctl;
use gateway::store::{AssignmentPhase, OperationPhase};
use proto::pool::v1::supervisor_pool_client::SupervisorPoolClient;
use proto::pool::v1::{
    CancelSupervisorPoolOperationRequest, GetSupervisorPoolStatusRequest, MemberState, Operation, OperationKind,
    StartSupervisorPoolOperationRequest, StartSupervisorPoolOperationResponse,
};
use tonic::Code;

use crate::cluster::{
    Behaviour, Identity, Member, channel, register, start_replica, token, wait_assignments, with_token,
};
use crate::support::{TestDb, wait_for};

async fn start(
    endpoint: &str,
    operator: &str,
    kind: OperationKind,
    target: &str,
    max_parallel: u32,
) -> Result<StartSupervisorPoolOperationResponse, tonic::Status> {
    let request = StartSupervisorPoolOperationRequest {
        kind: kind as i32,
        target: target.into(),
        max_parallel,
        timeout_ms: 0,
    };
    SupervisorPoolClient::new(channel(endpoint).await)
        .start_supervisor_pool_operation(with_token(request, operator))
        .await
        .map(tonic::Response::into_inner)
}

async fn member_state(endpoint: &str, operator: &str, member: &str) -> MemberState {
    let status = SupervisorPoolClient::new(channel(endpoint).await)
        .get_supervisor_pool_status(with_token(GetSupervisorPoolStatusRequest {}, operator))
        .await
        .unwrap()
        .into_inner();
    let state = status.members.iter().find(|m| m.name == member).unwrap().state;
    MemberState::try_from(state).unwrap()
}

async fn wait_phase(db: &TestDb, id: &str, phase: OperationPhase) -> gateway::store::Operation {
    wait_for("the operation's phase", 2000, || async {
        let op = db.store.operation(id).await.ok()??;
        (op.phase == phase).then_some(op)
    })
    .await
}

pub async fn drain_and_rebalance_move_instances_at_term_plus_one(db: &TestDb) {
    let credentials = tempfile::tempdir().unwrap();
    let replica = start_replica("gw-ops", &db.url, credentials.path()).await;
    let endpoint = replica.endpoint();
    let operator = token(credentials.path(), "operator").await;
    let tokens = crate::cluster::Tokens::load(&db.store).await;
    let mut members = Vec::new();
    for name in ["m-a", "m-b"] {
        let id = Identity {
            member: name.into(),
            process_id: format!("{name}-p1"),
            epoch: 1,
            capacity: 16,
        };
        members.push(
            Member::attach(&endpoint, &tokens.member(name), id, Behaviour::Healthy)
                .await
                .unwrap(),
        );
    }
    wait_for("two live members", 2000, || async {
        let (now, all) = db.store.list_members().await.ok()?;
        (all.iter().filter(|m| m.is_live(now)).count() == 2).then_some(())
    })
    .await;
    for i in 0..4 {
        let name = format!("agent-{i}");
        register(&endpoint, &tokens.instance(&name), &name).await.unwrap();
    }
    wait_assignments(&db.store, "two instances on each member", |a| {
        a.len() == 4 && a.iter().filter(|a| a.member == "m-a").count() == 2
    })
    .await;

    // Bad requests are refused with the reason.
    let refused = start(&endpoint, &operator, OperationKind::Drain, "m-a", 9)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused}");
    let refused = start(&endpoint, &operator, OperationKind::Drain, "nobody", 1)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::NotFound, "{refused}");
    let refused = start(&endpoint, &operator, OperationKind::Rebalance, "m-a", 1)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused}");
    let refused = start(&endpoint, &operator, OperationKind::Recover, "default/agent-0", 1)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused}");
    let refused = start(&endpoint, &tokens.member("m-a"), OperationKind::Rebalance, "", 1)
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        Code::Unauthenticated,
        "a supervisor token is no operator token"
    );

    // Drain m-a: recorded once, even when asked twice.
    let first = start(&endpoint, &operator, OperationKind::Drain, "m-a", 2)
        .await
        .unwrap();
    assert!(first.created);
    let op: Operation = first.operation.unwrap();
    let again = start(&endpoint, &operator, OperationKind::Drain, "m-a", 2)
        .await
        .unwrap();
    assert!(!again.created, "an equivalent open drain is returned, not duplicated");
    assert_eq!(again.operation.unwrap().id, op.id);

    let moved = wait_assignments(&db.store, "every instance on m-b at term 2", |a| {
        a.len() == 4 && a.iter().all(|a| a.member == "m-b")
    })
    .await;
    let terms: Vec<i64> = moved.iter().map(|a| a.term).collect();
    assert_eq!(
        terms.iter().filter(|t| **t == 2).count(),
        2,
        "the two moved instances are at term 2: {terms:?}"
    );
    assert!(moved.iter().all(|a| a.phase == AssignmentPhase::Reserved));
    let done = wait_phase(db, &op.id, OperationPhase::Succeeded).await;
    assert_eq!(done.moves, 2);
    assert_eq!(member_state(&endpoint, &operator, "m-a").await, MemberState::Drained);

    // A drained member takes nothing new.
    register(&endpoint, &tokens.instance("agent-4"), "agent-4")
        .await
        .unwrap();
    wait_assignments(&db.store, "the new instance on m-b", |a| {
        a.iter().any(|a| a.route == "default/agent-4" && a.member == "m-b")
    })
    .await;

    // Cancelling the succeeded drain returns m-a to service.
    let cancelled = SupervisorPoolClient::new(channel(&endpoint).await)
        .cancel_supervisor_pool_operation(with_token(
            CancelSupervisorPoolOperationRequest { id: op.id.clone() },
            &operator,
        ))
        .await
        .unwrap()
        .into_inner()
        .operation
        .unwrap();
    assert_eq!(cancelled.id, op.id);
    wait_phase(db, &op.id, OperationPhase::Cancelled).await;
    assert_eq!(member_state(&endpoint, &operator, "m-a").await, MemberState::Active);
    let unknown = SupervisorPoolClient::new(channel(&endpoint).await)
        .cancel_supervisor_pool_operation(with_token(
            CancelSupervisorPoolOperationRequest {
                id: "no-such-op".into(),
            },
            &operator,
        ))
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);

    // Rebalance evens out 0 / 5, through poolctl's client (as an operator would).
    let cli = poolctl::Cli::try_parse_from([
        "poolctl",
        "--gateway",
        &endpoint,
        "--token-file",
        credentials.path().join("operator").join("token").to_str().unwrap(),
        "rebalance",
        "--max-parallel",
        "8",
        "--wait",
    ])
    .unwrap();
    let poolctl::Command::Rebalance { run } = &cli.command else {
        panic!("a rebalance")
    };
    let mut client = poolctl::Client::connect(&cli).await.unwrap();
    let (rebalance, created) = client.start(OperationKind::Rebalance, "", run).await.unwrap();
    assert!(created);
    let done = client.wait(&rebalance.id, 0).await.expect("the rebalance succeeds");
    assert_eq!(done.moves, 2, "{}", poolctl::render_operation(&done));
    let on_a = db
        .store
        .list_assignments()
        .await
        .unwrap()
        .iter()
        .filter(|a| a.member == "m-a")
        .count();
    assert!((2..=3).contains(&on_a), "two or three of five on m-a, got {on_a}");
    drop(members);
    replica.stop().await;
}
